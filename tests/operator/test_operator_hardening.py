"""Inputs that must not wedge the operator, on a real API server with the operator running
under the shipped RBAC: a job of a mebibyte is reconciled and deleted like any other (kopf keeps
nothing on it), a power target whose job is gone is released, a spec that cannot run says why
before any pod holds a GPU, and a node another job holds is not shared."""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any

import pytest
import yaml
from kubernetes import client
from opharness import ROOT, RunningOperator

from tessera_contracts.api import JOB_LABEL
from tessera_contracts.progress import progress_configmap, report_key
from tessera_dev import simnodes
from tessera_operator import power_targets, workload

pytestmark = pytest.mark.hardening

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())
JOBS = ("tessera.dev", "v1alpha1")


def _job(name: str, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name}
    body["spec"] |= spec
    simnodes.place_in_pool(body["spec"], name)
    return body


def _pods(op: RunningOperator, job: str) -> list[str]:
    return [p.metadata.name for p in client.CoreV1Api(op.admin).list_namespaced_pod(
        op.namespace, label_selector=f"{JOB_LABEL}={job}").items]


def _ready(op: RunningOperator, job: str) -> dict[str, Any]:
    return next((c for c in op.status(job).get("conditions") or [] if c["type"] == "Ready"), {})


def _jobs(op: RunningOperator) -> set[str]:
    return {j["metadata"]["name"] for j in client.CustomObjectsApi(op.admin)
            .list_namespaced_custom_object(*JOBS, op.namespace, "ntptrainingjobs")["items"]}


def test_a_job_of_a_mebibyte_is_reconciled_and_deleted_cleanly(running_operator) -> None:
    op, job = running_operator, "huge"
    node, _ = op.create_nodes(job, 2)
    op.create_job(_job(job, args=["x" * 4096] * 256))  # the schema's largest args: 1 MiB
    op.wait(lambda: op.status(job).get("observedGeneration"), lambda g: g == 1, "reconciled")
    op.wait(lambda: power_targets.fetch(op.admin, node), bool, "its power target")
    meta = op.job(job)["metadata"]
    # nothing of kopf's on the object: no diff base, no progress, no finalizer
    assert not meta.get("finalizers") and not meta.get("annotations"), meta
    client.CustomObjectsApi(op.admin).delete_namespaced_custom_object(
        *JOBS, op.namespace, "ntptrainingjobs", job)
    op.wait(lambda: _jobs(op), lambda names: job not in names, "the job gone")
    op.wait(lambda: power_targets.fetch(op.admin, node), lambda t: t is None,
            "its power target released")
    # its handlers' own lines are in the log, kopf's line per handler success not
    released = f"job {op.namespace}/{job} deleted; released its power targets"
    text = op.wait(op.log.read_text, lambda t: released in t, "the release logged")
    assert not re.search(r"Handler '[^']*' succeeded", text)


def test_a_power_target_whose_job_is_gone_is_released(running_operator) -> None:
    op, job = running_operator, "owner"
    node, _ = op.create_nodes(job, 2)
    op.create_job(_job(job))
    made = op.wait(lambda: power_targets.fetch(op.admin, node), bool, "a power target")
    # As a job deleted while the operator was away leaves its targets: one whose job uid no
    # job has.
    orphan = f"orphan-{uuid.uuid4().hex[:6]}"
    labels = made["metadata"]["labels"] | {power_targets.JOB_UID_LABEL: str(uuid.uuid4())}
    client.CustomObjectsApi(op.admin).create_cluster_custom_object(
        *JOBS, "gpupowertargets", {"apiVersion": "tessera.dev/v1alpha1",
                                   "kind": made["kind"], "spec": made["spec"],
                                   "metadata": {"name": orphan, "labels": labels}})
    op.wait(lambda: power_targets.fetch(op.admin, orphan), lambda t: t is None,
            "the orphan target deleted")
    assert power_targets.fetch(op.admin, node) is not None  # its job's target stays


# (what the spec asks for, the condition reason, words of its message)
UNRUNNABLE = {
    "budget below the GPUs' minimum": (
        lambda s: s["powerPolicy"].update(rackBudgetWatts=1000), "InvalidSpec",
        "cannot hold 8 GPUs at their 200 W minimum"),
    "env name with =": (
        lambda s: s["template"]["spec"]["containers"][0]["env"].append(
            {"name": "A=B", "value": "1"}), "PodRejected", 'name: Invalid value: "A=B"'),
    "image of one space": (lambda s: s.update(image=" "), "PodRejected", "image"),
    "cpu: lots": (
        lambda s: s["template"]["spec"]["containers"][0]["resources"]["requests"].update(
            cpu="lots"), "PodRejected", "quantities must match"),
    "a misspelt template field": (
        lambda s: s["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"),
        "PodRejected", 'unknown field "spec.containers[0].imagePullPolicyy"'),
}


@pytest.mark.parametrize("case", UNRUNNABLE)
def test_a_spec_that_cannot_run_says_why_before_any_pod(running_operator, case) -> None:
    op = running_operator
    job = f"cannot-{uuid.uuid4().hex[:6]}"
    op.create_nodes(job, 2)
    mutate, reason, words = UNRUNNABLE[case]
    body = _job(job)
    mutate(body["spec"])
    try:
        op.create_job(body)
    except client.ApiException as exc:  # refused by the schema: as good, said at once
        assert exc.status == 422 and words in exc.body, exc.body
        return
    ready = op.wait(lambda: _ready(op, job), lambda c: c.get("reason") == reason, reason)
    assert ready["status"] == "False" and words in ready["message"], ready
    assert _pods(op, job) == []  # no GPU held
    client.CustomObjectsApi(op.admin).delete_namespaced_custom_object(
        *JOBS, op.namespace, "ntptrainingjobs", job)


def test_a_node_another_pod_holds_is_not_shared(running_operator) -> None:
    """Jobs take whole nodes: the plan, cordons, health and the node's one power target name
    GPUs by index, which only hold for a node the job has to itself."""
    op = running_operator
    pool = f"shared-{uuid.uuid4().hex[:6]}"
    taken, *free = op.create_nodes(pool, 3)
    # someone else's pod holds 2 of the first node's 8 GPUs
    core = client.CoreV1Api(op.admin)
    op.wait(lambda: core.list_namespaced_service_account(
        op.namespace, field_selector="metadata.name=default").items, bool,
        "the namespace's default service account")
    core.create_namespaced_pod(op.namespace, {
        "metadata": {"name": "someone-else"},
        "spec": {"nodeName": taken, "containers": [{
            "name": "c", "image": "busybox",
            "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}})
    first, second = _job("first"), _job("second")
    for job in (first, second):
        simnodes.place_in_pool(job["spec"], pool)
    op.create_job(first)
    op.wait(lambda: len(_pods(op, "first")), lambda n: n == 3, "the first job's pods")
    placed = {workload.pod_node(op.admin.sanitize_for_serialization(p))
              for p in core.list_namespaced_pod(
                  op.namespace, label_selector=f"{JOB_LABEL}=first,tessera.dev/role=trainer").items}
    assert placed == set(free)
    # half a node would fit beside the other pod by free GPUs alone: not a whole node
    second["spec"] |= {"tensorParallelSize": 4, "gpusPerNode": 4, "totalGPUs": 4,
                       "dataParallelReplicas": 1}
    second["spec"]["failurePolicy"]["minTensorParallelSize"] = 2
    op.create_job(second)
    ready = op.wait(lambda: _ready(op, "second"), lambda c: c.get("reason") == "Unschedulable",
                    "the second Unschedulable")
    assert "whole nodes" in ready["message"]
    assert _pods(op, "second") == []


def _write_reports(op: RunningOperator, job: str, reports: dict[str, dict[str, Any]]) -> None:
    """Write node reports into the job's progress ConfigMap as the nodes' agents would."""
    core = client.CoreV1Api(op.admin)
    op.wait(lambda: core.list_namespaced_config_map(
        op.namespace, field_selector=f"metadata.name={progress_configmap(job)}").items, bool,
        "the progress ConfigMap")
    core.patch_namespaced_config_map(progress_configmap(job), op.namespace, {"data": {
        report_key(node): json.dumps(report) for node, report in reports.items()}})


def _honest(node: str, job: dict[str, Any], step: int) -> dict[str, Any]:
    return {"node": node, "generation": 1, "step": step, "steps": job["spec"]["steps"],
            "state": "Training", "productiveSeconds": 90.0, "wallSeconds": 100.0,
            "badputSeconds": {"startup": 10.0}, "goodput": 0.9}


def test_a_report_claiming_more_time_than_its_node_had_leaves_the_status_moving(
        running_operator) -> None:
    """One trainer pod's report claims a million productive seconds in 100 s: were it read,
    the job's goodput would pass the schema's maximum of 1 and the API server would refuse
    every status write for as long as the report stays. It is refused on read instead: the
    status follows the other node's report, says why the first is not counted, and stays in
    the schema's bounds."""
    op, job = running_operator, "boasting"
    lying, honest = op.create_nodes(job, 2)
    op.create_job(_job(job))
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    stored = op.job(job)
    _write_reports(op, job, {
        lying: _honest(lying, stored, 7) | {"productiveSeconds": 1.0e6},
        honest: _honest(honest, stored, 7)})
    status = op.wait(lambda: op.status(job), lambda s: s.get("step") == 7,
                     "the status at the honest node's step")
    assert status["goodput"] == 0.9
    assert f"node {lying}'s progress report refused" in _ready(op, job)["message"]


REFUSING = "refuse-status"
PROBE = "refuse-status-probe"  # a ConfigMap the same policy refuses: whether it is in force


def test_a_status_the_api_server_refuses_is_said_once_not_retried_in_a_loop(
        running_operator) -> None:
    """An admission policy (as a platform team might install) refuses the job's status but
    for its conditions: the operator says so in Ready and in a Warning event with the API
    server's message, once, and waits for the next change instead of retrying the same write
    every few seconds."""
    op, job = running_operator, REFUSING
    admission = client.AdmissionregistrationV1Api(op.admin)
    core = client.CoreV1Api(op.admin)
    policy = f"tessera-test-{REFUSING}"
    admission.create_validating_admission_policy({
        "metadata": {"name": policy},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [
                     {"apiGroups": ["tessera.dev"], "apiVersions": ["*"],
                      "operations": ["UPDATE"], "resources": ["ntptrainingjobs/status"]},
                     {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                      "resources": ["configmaps"]}]},
                 "matchConditions": [{"name": "this-job", "expression":
                                      f"object.metadata.name in ['{REFUSING}', '{PROBE}']"}],
                 "validations": [{"expression": f"object.metadata.name != '{PROBE}' && "
                                  "!has(object.status.phase)", "reason": "Invalid",
                                  "message": "status writes of this job are closed"}]}})
    admission.create_validating_admission_policy_binding({
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": op.namespace}}}}})

    def in_force() -> bool:
        try:
            core.create_namespaced_config_map(op.namespace, {"metadata": {"name": PROBE}})
        except client.ApiException as exc:
            return exc.status == 422
        core.delete_namespaced_config_map(PROBE, op.namespace)
        return False

    def refusals() -> list[str]:
        return [e.message for e in core.list_namespaced_event(
            op.namespace, field_selector=f"involvedObject.name={job},reason=StatusRefused").items]

    refused = f"job {op.namespace}/{job}: status refused by the API server"
    try:
        op.wait(in_force, bool, "the admission policy in force")
        op.create_nodes(job, 2)
        op.create_job(_job(job))
        op.start_rendezvous(job)
        [said] = op.wait(refusals, bool, "the StatusRefused event")
        assert "status writes of this job are closed" in said
        ready = op.wait(lambda: _ready(op, job), lambda c: c.get("reason") == "StatusRefused",
                        "Ready saying the status is refused")
        assert ready["status"] == "False"
        assert "status writes of this job are closed" in ready["message"]
        assert "phase" not in op.status(job)
        # A change brings a reconcile: its write is refused again, said in the log, no event
        # more, and never put back on a retry timer.
        before = op.log.read_text().count(refused)
        _write_reports(op, job, {"a-node": {"node": "a-node"}})
        text = op.wait(op.log.read_text, lambda t: t.count(refused) > before,
                       "the next refusal logged")
        assert refusals() == [said]
        assert f"reconcile of job {op.namespace}/{job} failed" not in text
    finally:
        admission.delete_validating_admission_policy_binding(policy)
        admission.delete_validating_admission_policy(policy)


def _condition(op: RunningOperator, job: str, kind: str) -> dict[str, Any]:
    return next((c for c in op.status(job).get("conditions") or [] if c["type"] == kind), {})


def test_trainer_pods_that_never_start_are_said_then_given_up_by_the_jobs_policy(
        running_operator) -> None:
    """These nodes have no kubelet: the trainer pods never start and hold their nodes.
    PodsStarted says why each waits and when the attempt gives up; at podStartTimeoutSeconds
    (its minimum, 30 s) the job fails by its onPodStartTimeout (Fail), its pods deleted and
    its nodes released."""
    op, job = running_operator, "never-starts"
    op.create_nodes(job, 2)
    body = _job(job)
    body["spec"]["failurePolicy"] |= {"podStartTimeoutSeconds": 30, "onPodStartTimeout": "Fail"}
    op.create_job(body)
    op.start_rendezvous(job)
    waiting = op.wait(lambda: _condition(op, job, "PodsStarted"),
                      lambda c: c.get("status") == "False" and c.get("reason") != "NoPods",
                      "PodsStarted saying why the trainer pods wait")
    assert f"pod {job}-" in waiting["message"]
    assert "podStartTimeoutSeconds 30 s, onPodStartTimeout Fail" in waiting["message"]
    failed = op.wait(lambda: _condition(op, job, "Failed"), lambda c: c.get("status") == "True",
                     "the job Failed")
    assert failed["reason"] == "PodStartTimeout"
    assert "did not start within failurePolicy.podStartTimeoutSeconds" in failed["message"]
    op.wait(lambda: _pods(op, job), lambda pods: pods == [], "its pods deleted")
