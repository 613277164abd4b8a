"""Kueue on the local cluster (`tessera-dev up --kueue`): its release installed offline with
every webhook reached on loopback and the workload webhooks narrowed to the managed namespaces;
the real controller admits within a ClusterQueue's quota and holds what is over it, its v1beta1
API served through the conversion webhook; its pod integration gates a plain pod in a managed
namespace and leaves alone the pods of a queued NTPTrainingJob (an external framework) and
every pod elsewhere."""

from __future__ import annotations

import copy
import os
import subprocess
import uuid
from typing import Any

import pytest
import yaml
from kubernetes import client
from kueueharness import KUEUE_API, conditions, make_namespace, queues

from tessera_contracts.api import API_VERSION, GROUP, JOB_KIND, JOB_PLURAL, VERSION
from tessera_dev import paths, probes
from tessera_dev.controlplane import build, cluster, kueue

# the first test may wait for Kueue's build from the Go module registry
pytestmark = [pytest.mark.kueue, pytest.mark.timeout(2400)]

HANG_S = 120.0
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())


def test_the_release_is_rendered_for_a_controller_on_loopback() -> None:
    release = [doc for doc in yaml.safe_load_all(build.ensure_kueue_manifests().read_text())
               if doc]
    url = "https://127.0.0.1:9443"
    objects = kueue.local_objects(release, url, b"PEM")
    kinds = {obj["kind"] for obj in objects}
    assert not kinds & kueue.DROPPED_KINDS, kinds
    configs = [c for obj in objects for c in (
        [w["clientConfig"] for w in obj.get("webhooks") or []]
        + [((obj.get("spec") or {}).get("conversion") or {}).get("webhook", {}).get(
            "clientConfig")])
        if c]
    assert len(configs) > 40  # every workload kind's webhooks and the conversions
    for config in configs:
        assert config["url"].startswith(url + "/") and "service" not in config, config
        assert config["caBundle"] == "UEVN"  # base64 of the bundle given
    # a webhook that selects namespaces selects the managed ones only (with failurePolicy
    # Fail, a stopped Kueue would otherwise refuse every pod of the cluster)
    selected = [w for obj in objects for w in obj.get("webhooks") or []
                if "namespaceSelector" in w]
    assert {w["name"] for w in selected} >= {"mpod.kb.io", "vpod.kb.io", "mjob.kb.io"}
    assert all(w["namespaceSelector"] == {"matchLabels": {kueue.MANAGED_LABEL: "true"}}
               for w in selected)
    # the release itself is left as it was
    assert any("service" in w["clientConfig"] for obj in release
               for w in obj.get("webhooks") or [])


def _workload(namespace: str, queue: str, gpus: int) -> dict[str, Any]:
    name = f"wl-{uuid.uuid4().hex[:6]}"
    trainer = {"containers": [{"name": "trainer", "image": "tessera-trainer:0.1.0",
                               "resources": {"requests": {"cpu": "1", "memory": "1Gi",
                                                          kueue.GPU_RESOURCE: str(gpus)}}}]}
    return {"apiVersion": "/".join(KUEUE_API), "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"queueName": queue,
                     "podSets": [{"name": "trainer", "count": 1,
                                  "template": {"spec": trainer}}]}}


def test_admits_within_the_quota_holds_what_is_over_it_and_serves_v1beta1(
        kueue_api: client.ApiClient) -> None:
    namespace = make_namespace(kueue_api, managed=True)
    queue = queues(kueue_api, namespace, gpus=2)
    custom = client.CustomObjectsApi(kueue_api)
    first, second = _workload(namespace, queue, 2), _workload(namespace, queue, 2)
    for body in (first, second):
        custom.create_namespaced_custom_object(*KUEUE_API, namespace, "workloads", body)

    def state(name: str) -> dict[str, Any]:
        return custom.get_namespaced_custom_object(*KUEUE_API, namespace, "workloads", name)

    admitted = probes.wait_for("the first workload admitted", lambda: state(
        first["metadata"]["name"]), lambda wl: conditions(wl).get("Admitted", {}).get(
            "status") == "True", timeout=HANG_S)
    assert admitted["status"]["admission"]["clusterQueue"] == queue
    held = probes.wait_for("the second workload evaluated", lambda: state(
        second["metadata"]["name"]), lambda wl: "QuotaReserved" in conditions(wl),
        timeout=HANG_S)
    reserved = conditions(held)["QuotaReserved"]
    assert reserved["status"] == "False", reserved
    assert f"insufficient unused quota for {kueue.GPU_RESOURCE}" in reserved["message"]
    # the deprecated version, converted by Kueue's webhook at its loopback URL
    old = custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", namespace,
                                              "workloads", first["metadata"]["name"])
    assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert old["spec"]["podSets"][0]["count"] == 1


def _pod(name: str, namespace: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {QUEUE_LABEL: "gpus"}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": JOB_KIND,
                                    "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]
    return {"metadata": meta, "spec": {"containers": [
        {"name": "c", "image": "tessera:0.1.0", "command": ["sleep", "3600"]}]}}


def _gated(pod: client.V1Pod) -> bool:
    """Whether Kueue's pod integration took the pod as a workload of its own."""
    gates = [g.name for g in pod.spec.scheduling_gates or []]
    return ADMISSION_GATE in gates or "kueue.x-k8s.io/managed" in (
        pod.metadata.finalizers or [])


def test_its_pod_integration_gates_plain_pods_and_leaves_a_queued_jobs_pods_alone(
        kueue_api: client.ApiClient, kueue_cluster: cluster.Cluster) -> None:
    managed = make_namespace(kueue_api, managed=True)
    unmanaged = make_namespace(kueue_api, managed=False)
    queues(kueue_api, managed, gpus=2)
    job = copy.deepcopy(EXAMPLE) | {"metadata": {"name": "queued",
                                                 "labels": {QUEUE_LABEL: "gpus"}}}
    owner = client.CustomObjectsApi(kueue_api).create_namespaced_custom_object(
        GROUP, VERSION, managed, JOB_PLURAL, job)
    core = client.CoreV1Api(kueue_api)
    made = {name: core.create_namespaced_pod(where, _pod(name, where, owned))
            for name, where, owned in (("trainer", managed, owner), ("plain", managed, None),
                                       ("elsewhere", unmanaged, None))}
    assert _gated(made["plain"]), made["plain"].metadata
    assert not _gated(made["trainer"]), made["trainer"].metadata
    assert not _gated(made["elsewhere"]), made["elsewhere"].metadata
    # Kueue reads the jobs it is told to leave alone (manifests/kueue), and no more
    identity = f"system:serviceaccount:{kueue.NAMESPACE}:{kueue.SERVICE_ACCOUNT}"
    for verb, allowed in (("list", "yes"), ("watch", "yes"), ("delete", "no")):
        said = subprocess.run(["kubectl", "auth", "can-i", verb, f"{JOB_PLURAL}.{GROUP}",
                               "--all-namespaces", "--as", identity],
                              env=os.environ | {
                                  "KUBECONFIG": str(kueue_cluster.plane.kubeconfig)},
                              capture_output=True, text=True, timeout=60)
        assert said.stdout.strip() == allowed, (verb, said.stdout, said.stderr)
