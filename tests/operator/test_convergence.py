"""A running job's children converge on what the operator wants: its trainer identity changed
or deleted by someone is applied back by the next reconcile (the change's own watch event
brings it), without touching the job's pods or its layout; and what the operator may apply is
only what its jobs already control."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from opharness import ROOT, RunningOperator

from tessera_dev import simnodes

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())


def _rules(rbac: client.RbacAuthorizationV1Api, namespace: str, name: str) -> list[Any]:
    role = rbac.read_namespaced_role(name, namespace)
    return [rbac.api_client.sanitize_for_serialization(r) for r in role.rules or []]


def _binding(rbac: client.RbacAuthorizationV1Api, namespace: str, name: str
             ) -> dict[str, Any] | None:
    found = rbac.list_namespaced_role_binding(namespace,
                                              field_selector=f"metadata.name={name}").items
    return rbac.api_client.sanitize_for_serialization(found[0]) if found else None


def test_a_changed_trainer_identity_converges_on_a_running_job(
    running_operator: RunningOperator,
) -> None:
    op, job = running_operator, "converging"
    op.create_nodes(job, 2)
    body = copy.deepcopy(EXAMPLE) | {"metadata": {"name": job}}
    simnodes.place_in_pool(body["spec"], job)
    op.create_job(body)
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    core, rbac = client.CoreV1Api(op.admin), client.RbacAuthorizationV1Api(op.admin)
    name = f"{job}-trainer"
    pods = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(
        op.namespace, label_selector=f"tessera.dev/job={job}").items}
    wanted = _rules(rbac, op.namespace, name)
    # The trainers may read the layout and patch their progress reports, nothing else.
    assert {(tuple(r["resourceNames"]), tuple(r["verbs"])) for r in wanted} == {
        ((f"{job}-layout",), ("get", "list", "watch")), ((f"{job}-progress",), ("get", "patch"))}

    # Someone narrows the Role: the trainers could no longer report their progress.
    rbac.patch_namespaced_role(name, op.namespace, {"rules": wanted[:1]})
    op.wait(lambda: _rules(rbac, op.namespace, name), lambda r: r == wanted, "the Role back")
    fields = rbac.read_namespaced_role(name, op.namespace).metadata.managed_fields
    assert ("tessera-operator", "Apply") in {(f.manager, f.operation) for f in fields}

    # Someone deletes the RoleBinding: it is made again, bound to the trainers' account.
    rbac.delete_namespaced_role_binding(name, op.namespace)
    bound = op.wait(lambda: _binding(rbac, op.namespace, name), bool, "the RoleBinding back")
    assert bound["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                "name": name}
    assert [(s["kind"], s["name"]) for s in bound["subjects"]] == [("ServiceAccount", name)]
    assert [r["uid"] for r in bound["metadata"]["ownerReferences"]] == [
        op.job(job)["metadata"]["uid"]]

    # The job went on as it was: the same pods, the same generation.
    assert {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(
        op.namespace, label_selector=f"tessera.dev/job={job}").items} == pods
    assert op.status(job)["layoutGeneration"] == 1


def test_the_operator_may_update_only_the_identity_its_job_controls(
    running_operator: RunningOperator,
) -> None:
    """Its own credentials, the shipped RBAC and admission: it may apply the trainer identity
    back, but not adopt someone else's Role, nor write one outside its jobs."""
    op, job = running_operator, "fenced"
    op.create_nodes(job, 2)
    body = copy.deepcopy(EXAMPLE) | {"metadata": {"name": job}}
    simnodes.place_in_pool(body["spec"], job)
    op.create_job(body)
    rbac_admin = client.RbacAuthorizationV1Api(op.admin)
    name = f"{job}-trainer"
    op.wait(lambda: [r.metadata.name for r in rbac_admin.list_namespaced_role(
        op.namespace, field_selector=f"metadata.name={name}").items], bool, "the Role")
    theirs = f"{job}-theirs"  # named after the job, controlled by nobody
    rbac_admin.create_namespaced_role(op.namespace, {"metadata": {"name": theirs}, "rules": []})
    owner = {"apiVersion": "tessera.dev/v1alpha1", "kind": "NTPTrainingJob", "name": job,
             "uid": op.job(job)["metadata"]["uid"], "controller": True}
    assert op.operator_kubeconfig is not None
    with config.new_client_from_config(str(op.operator_kubeconfig)) as api:
        rbac = client.RbacAuthorizationV1Api(api)
        with pytest.raises(client.ApiException) as refused:
            rbac.patch_namespaced_role(theirs, op.namespace,
                                       {"metadata": {"ownerReferences": [owner]}})
        assert refused.value.status == 403, refused.value.body
        # What it needs stays allowed: its job's own Role.
        rbac.patch_namespaced_role(name, op.namespace,
                                   {"metadata": {"annotations": {"tessera.dev/probe": "1"}}})
    assert not rbac_admin.read_namespaced_role(theirs, op.namespace).metadata.owner_references
