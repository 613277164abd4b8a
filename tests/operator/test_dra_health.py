"""DRA as a health source: device taints in the nodes' ResourceSlices (as the simulated nodes'
driver publishes them, NVIDIA's shape) and in DeviceTaintRules, and the devices' health in the
trainer pods' allocatedResourcesStatus (as the kubelet writes it), judged by the taint's effect:
NoSchedule drains a GPU, NoExecute loses it, None changes nothing; through the signal policy
only when the job names the source; and a job asking for its GPUs through a resource claim."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from test_policies import EXAMPLE, NOW, A, B, _in_force, _job, _spec

from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError, defaulted
from tessera_dev.simnode import dra
from tessera_operator import dra_health, workload
from tessera_operator.policies import signal

pytestmark = pytest.mark.operator

GPUS = 8


def _slice(node: str, taints: dict[int, tuple[str, str]]) -> dra_health.SliceView:
    """The node's slice as its driver publishes it and the operator's index holds it, with
    `taints` (GPU -> (value, effect)) on the XID key."""
    gpus = SimBackend(count=GPUS, node=node).snapshot()
    published = dra.resource_slice(node, gpus, {i: dra.Taint(v, e) for i, (v, e) in
                                                 taints.items()}, generation=1)
    return dra_health.read_slice(published)


def _rule(name: str, effect: str, **selector: str) -> dra_health.RuleView:
    rule = dra_health.read_rule({"metadata": {"name": name}, "spec": {
        "deviceSelector": selector, "taint": {"key": "example.com/maintenance",
                                              "value": "bios", "effect": effect}}})
    assert rule is not None
    return rule


def test_a_taints_effect_drains_or_loses_its_gpu_and_none_changes_nothing() -> None:
    taints = dra_health.DeviceTaints((
        _slice(A, {1: ("48", "NoSchedule"), 2: ("13", "None")}),
        _slice(B, {5: ("79", "NoExecute")}),
        _slice("elsewhere", {0: ("79", "NoExecute")})))
    found, lost = dra_health.from_device_taints(taints, [A, B], GPUS)
    assert found.failed == {(A, 1), (B, 5)}
    assert lost.failed == {(B, 5)}
    assert "gpu.nvidia.com/xid=48:NoSchedule by its DRA driver" in found.reasons[(A, 1)]
    # a GPU beyond the job's count per node is not the job's
    assert dra_health.from_device_taints(taints, [A, B], 4)[0].failed == {(A, 1)}


def test_a_device_taint_rule_taints_the_devices_it_selects() -> None:
    slices = (_slice(A, {}), _slice(B, {}))
    whole_pool = dra_health.DeviceTaints(slices, (_rule("drain-a", "NoSchedule", pool=A),))
    assert dra_health.from_device_taints(whole_pool, [A, B], GPUS)[0].failed == {
        (A, i) for i in range(GPUS)}
    one = dra_health.DeviceTaints(slices, (_rule("evict", "NoExecute", driver=dra.DRIVER,
                                                 pool=B, device="gpu-3"),))
    found, lost = dra_health.from_device_taints(one, [A, B], GPUS)
    assert found.failed == lost.failed == {(B, 3)}
    assert "DeviceTaintRule evict" in lost.reasons[(B, 3)]
    other = dra_health.DeviceTaints(slices, (_rule("nic", "NoExecute", driver="nic.example"),))
    assert dra_health.from_device_taints(other, [A, B], GPUS)[0].failed == frozenset()
    assert dra_health.read_rule({"metadata": {"name": "x"}, "spec": {"taint": {}}}) is None


def _pod(node: str, health: dict[int, str], resource_id: str = "{driver}/{node}/gpu-{i}"
         ) -> dict[str, Any]:
    """A trainer pod on `node` whose claim holds GPUs 0-3, their health as given (Healthy
    where not), reported as the simulated kubelet does."""
    devices = [dra.Device("gpus", dra.device_name(i), i,
                          resource_id.format(driver=dra.DRIVER, node=node, i=i))
               for i in range(4)]
    reported = dra.resource_health([("claim:gpus", devices)],
                                   {i for i in range(4) if i not in health})
    for entry in reported:
        for resource, device in zip(entry["resources"], devices, strict=True):
            if device.index in health:
                resource["health"] = health[device.index]
    return {"spec": {"nodeName": node}, "status": {"containerStatuses": [
        {"name": "trainer", "allocatedResourcesStatus": reported}]}}


def test_a_device_its_pod_reports_unhealthy_is_lost_and_unknown_is_unknown() -> None:
    cdi = "k8s.gpu.nvidia.com/claim=0b7e-4c1d-gpu-{i}"  # NVIDIA's CDI device ID
    found = dra_health.from_resource_health(
        [_pod(A, {2: "Unhealthy", 3: "Unknown"}), _pod(B, {1: "Unhealthy"}, cdi),
         {"spec": {}, "status": {}}], GPUS)
    assert found.failed == {(A, 2), (B, 1)}
    assert found.unknown == {(A, 3)}
    odd = dra_health.from_resource_health([_pod(A, {0: "Unhealthy"}, "nic.example/x/port-{i}")],
                                          GPUS)
    assert odd.failed == frozenset() and "names no GPU of the job" in odd.problems[0]


@pytest.mark.parametrize(("sources", "failed", "lost"), [
    (["dcgm", "cordon", "dra"], {(A, 1), (B, 5)}, {(B, 5)}),
    (["dcgm", "cordon"], set(), set()),
])
def test_signal_reads_device_taints_when_the_job_names_dra(
        sources: list[str], failed: set[tuple[str, int]], lost: set[tuple[str, int]]) -> None:
    job = _job(failurePolicy=EXAMPLE["spec"]["failurePolicy"] | {"healthSources": sources})
    taints = dra_health.DeviceTaints((_slice(A, {1: ("48", "NoSchedule")}),
                                      _slice(B, {5: ("79", "NoExecute")})))
    observed = replace(_in_force(job), devices=taints)
    found, under = signal.health_of(_spec(job).whole, observed, {0: A, 1: B}, observed.nodes,
                                    NOW)
    assert found.failed == failed and under.failed == lost


def test_signal_loses_a_gpu_its_trainer_pod_reports_unhealthy() -> None:
    job = _job()
    observed = _in_force(job)
    pods = tuple(p if workload.pod_node(p) != B else p | _pod(B, {2: "Unhealthy"})
                 for p in observed.pods)
    found, lost = signal.health_of(_spec(job).whole, replace(observed, pods=pods),
                                   {0: A, 1: B}, observed.nodes, NOW)
    assert found.failed == lost.failed == {(B, 2)}


def _claiming(claim: str = "gpus") -> dict[str, Any]:
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1"}
    job["spec"]["gpuResourceClaim"] = claim
    job["spec"]["template"]["spec"]["resourceClaims"] = [
        {"name": "gpus", "resourceClaimTemplateName": "node-gpus"},
        {"name": "ib", "resourceClaimTemplateName": "ib-nic"}]
    return job


def test_a_job_asks_for_its_gpus_through_the_claim_it_names() -> None:
    job = _claiming()
    spec = NTPTrainingJobSpec.from_spec(defaulted(job["spec"]))
    pod = workload.trainer_pod(job, spec, 0, A)
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == workload.TRAINER]
    resources = trainer["resources"]
    assert workload.GPU_RESOURCE not in resources.get("limits", {})
    assert workload.GPU_RESOURCE not in resources.get("requests", {})
    assert resources["claims"] == [{"name": "gpus"}]
    assert pod["spec"]["resourceClaims"] == job["spec"]["template"]["spec"]["resourceClaims"]
    # placement counts them taken on its node, as it counts the extended resource
    assert workload.taken_gpus([pod]) == {A: spec.gpus_per_node}


def test_a_gpu_claim_the_template_does_not_have_is_refused_with_its_path() -> None:
    with pytest.raises(SpecError, match="gpuResourceClaim.*'gpu'.*gpus, ib"):
        NTPTrainingJobSpec.from_spec(defaulted(_claiming("gpu")["spec"]))

