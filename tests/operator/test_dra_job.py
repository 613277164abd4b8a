"""A job that asks for its GPUs through a resource claim, on a local cluster of its own (one
simulated node: its ranks are the test's cost) with the real scheduler and controller-manager,
and the operator as a process under its own RBAC: its trainer pod trains on exactly the devices
the scheduler allocated to its claim; a NoExecute DeviceTaintRule on one of them reshapes the
replica (the device-taint eviction controller leaves the pod, whose claim tolerates the taint),
and deleting the rule brings the GPU back; the same with the NoSchedule taint the node's driver
sets for an XID, until `restore-gpu`. The time from each taint to the first step on the new
layout is printed."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from opharness import ROOT, RunningOperator, operator_on

from tessera_contracts import dradevice
from tessera_contracts.api import JOB_LABEL, ROLE_LABEL
from tessera_contracts.rank_events import StepRecord, parse_line
from tessera_dev import demo_data
from tessera_dev.controlplane import cluster, crds, launcher
from tessera_dev.simnode import faults
from tessera_operator.reconcile import RESYNC_INTERVAL_S
from tessera_operator.workload import GPU_RESOURCE, TRAINER

# Guards against a hang: ranks starting on a loaded machine; a relayout's guard stays below the
# operator's resync, so each is seen driven by a watch event.
START_S = 600.0
RELAYOUT_S = 240.0
assert RELAYOUT_S < RESYNC_INTERVAL_S
pytestmark = [pytest.mark.dra, pytest.mark.timeout(START_S + 5 * RELAYOUT_S)]

JOB = "dra-llama"
EXAMPLE = ROOT / "manifests/examples/ntpjob-local.yaml"
GPUS = 4  # the node's: two replicas of TP 2
TAINTED = 1  # the GPU the test taints: replica 0's last


@pytest.fixture(scope="module")
def dra_cluster(tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RunningOperator, cluster.Cluster]]:
    """A control plane with one simulated node of GPUS GPUs, and the operator on it."""
    bins = launcher.prebuilt()
    if bins is None:
        pytest.fail("the control plane is not built: run `make setup` first", pytrace=False)
    with launcher.ControlPlane.start(bin_dir=bins) as plane:
        with plane.api_client() as api:
            crds.apply(api, crds.load())
        running = cluster.Cluster.start(plane, cluster.node_specs(1, GPUS))
        try:
            with operator_on(plane, tmp_path_factory.mktemp("operator")) as op:
                yield op, running
        finally:
            running.stop()


def _claim_template(api: client.ApiClient, namespace: str, gpus: int) -> str:
    """The user's claim template: the node's GPUs, tolerating the driver's taints."""
    name = f"node-gpus-{uuid.uuid4().hex[:6]}"
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(namespace, {
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": dradevice.DEVICE_CLASS, "allocationMode": "ExactCount",
            "count": gpus, "tolerations": dradevice.claim_tolerations()}}]}}}})
    return name


def _job(template: str, gpus: int) -> dict[str, Any]:
    """The local example on one node's GPUs through the claim: two TP replicas of half the
    node each, on synthetic sequences, DRA its one health source."""
    job = demo_data.without_dataset(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    del spec["powerPolicy"]
    spec |= {"tensorParallelSize": gpus // 2, "dataParallelReplicas": 2, "gpusPerNode": gpus,
             "totalGPUs": gpus, "gpuResourceClaim": "gpus",
             "failurePolicy": {"mode": "NTP", "minTensorParallelSize": 1,
                               "healthSources": ["dra"]}}
    spec["template"]["spec"]["resourceClaims"] = [
        {"name": "gpus", "resourceClaimTemplateName": template}]
    return job


def _records(api: client.ApiClient, namespace: str, pod: str) -> list[StepRecord]:
    log = client.CoreV1Api(api).read_namespaced_pod_log(pod, namespace, container=TRAINER)
    return [r for r in map(parse_line, log.splitlines()) if isinstance(r, StepRecord)]


def _first_step(op: RunningOperator, pod: str, layout: tuple[int, ...], since: float
                ) -> tuple[float, StepRecord]:
    """Seconds from `since` to the first step on `layout` (its TP degrees), and the step."""
    def found() -> StepRecord | None:
        return next((r for r in _records(op.admin, op.namespace, pod)
                     if r.tp_degrees == layout and (r.time or 0) > since), None)

    step = op.wait(found, lambda r: r is not None, f"a step on layout {layout}",
                   timeout=RELAYOUT_S)
    assert step is not None and step.time is not None
    return step.time - since, step


def _held(node_dir: Any, gpus: int) -> set[int]:
    """The node's GPUs whose device file a process holds (a rank trains on it)."""
    return {i for i in range(gpus) if faults.holders(faults.device_file(node_dir, i))}


def _tessera_dev(*argv: str, data_dir: Any) -> None:
    done = subprocess.run([sys.executable, "-m", "tessera_dev.cli", *argv, "--data-dir",
                           str(data_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)


def test_a_claimed_gpus_taint_reshapes_the_replica_and_its_removal_brings_it_back(
        dra_cluster: tuple[RunningOperator, cluster.Cluster]) -> None:
    (op, local_cluster), gpus = dra_cluster, GPUS
    core, resource = client.CoreV1Api(op.admin), client.ResourceV1Api(op.admin)
    half = gpus // 2
    template = _claim_template(op.admin, op.namespace, gpus)
    op.create_job(_job(template, gpus))
    rule = f"{JOB}-{uuid.uuid4().hex[:6]}"
    try:
        # 1. The job trains on the devices the scheduler allocated to its pod's claim.
        op.wait(lambda: op.status(JOB), lambda s: s.get("phase") == "Running"
                and s.get("step", 0) >= 2, "the job Running past step 2", timeout=START_S)
        (pod,) = core.list_namespaced_pod(
            op.namespace, label_selector=f"{JOB_LABEL}={JOB},{ROLE_LABEL}={TRAINER}").items
        node, uid = pod.spec.node_name, pod.metadata.uid
        (trainer,) = [c for c in pod.spec.containers if c.name == TRAINER]
        assert GPU_RESOURCE not in (trainer.resources.limits or {})
        (claimed,) = pod.status.resource_claim_statuses
        claim = resource.read_namespaced_resource_claim(claimed.resource_claim_name,
                                                        op.namespace)
        allocated = {r.device for r in claim.status.allocation.devices.results
                     if r.driver == dradevice.DRIVER and r.pool == node}
        assert allocated == {dradevice.device_name(i) for i in range(gpus)}
        node_dir = faults.node_dir(local_cluster.plane.data_dir, node)
        op.wait(lambda: _held(node_dir, gpus), lambda held: held == set(range(gpus)),
                "a rank on every allocated GPU")

        # 2. An administrator's NoExecute rule on one of them: the replica is reshaped, the
        #    pod kept (its claim tolerates the taint), the GPU's rank gone.
        since = time.time()
        resource.create_device_taint_rule({"metadata": {"name": rule}, "spec": {
            "deviceSelector": {"driver": dradevice.DRIVER, "pool": node,
                               "device": dradevice.device_name(TAINTED)},
            "taint": {"key": dradevice.XID_TAINT, "value": "79", "effect": "NoExecute"}}})
        evict_s, _ = _first_step(op, pod.metadata.name, (half - 1, half), since)
        assert core.read_namespaced_pod(pod.metadata.name, op.namespace).metadata.uid == uid
        op.wait(lambda: _held(node_dir, gpus), lambda held: TAINTED not in held,
                "the tainted GPU's rank gone")

        # 3. The rule deleted: the GPU is back in the layout, in the same pod.
        since = time.time()
        resource.delete_device_taint_rule(rule)
        back_s, _ = _first_step(op, pod.metadata.name, (half, half), since)

        # 4. The node's driver taints a GPU for an XID (NoSchedule): a planned relayout,
        #    until the GPU is restored.
        since = time.time()
        _tessera_dev("fail-gpu", node, str(TAINTED), "--xid", "48", "--dra-taint",
                     data_dir=local_cluster.plane.data_dir)
        drain_s, _ = _first_step(op, pod.metadata.name, (half - 1, half), since)
        since = time.time()
        _tessera_dev("restore-gpu", node, str(TAINTED), data_dir=local_cluster.plane.data_dir)
        restored_s, _ = _first_step(op, pod.metadata.name, (half, half), since)
        now = core.read_namespaced_pod(pod.metadata.name, op.namespace)
        assert now.metadata.uid == uid and now.status.phase == "Running"
        assert not [c for c in now.status.conditions or [] if c.type == "DisruptionTarget"]
        print(f"\ntaint -> first step on the new layout: NoExecute rule {evict_s:.2f} s, "
              f"rule deleted {back_s:.2f} s, driver's NoSchedule {drain_s:.2f} s, "
              f"restored {restored_s:.2f} s")
    finally:
        _cleanup(lambda: resource.delete_device_taint_rule(rule),
                 lambda: client.CustomObjectsApi(op.admin).delete_namespaced_custom_object(
                     "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", JOB),
                 lambda: resource.delete_namespaced_resource_claim_template(template,
                                                                            op.namespace))
        op.wait(lambda: core.list_namespaced_pod(
            op.namespace, label_selector=f"{JOB_LABEL}={JOB}").items, lambda left: not left,
            "the job's pods gone")


def _cleanup(*deletes: Callable[[], object]) -> None:
    for delete in deletes:
        try:
            delete()
        except client.ApiException as exc:
            if exc.status != 404:
                raise
