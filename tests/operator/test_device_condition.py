"""A job whose trainer pods hold GPUs but whose ranks train on CPU says so: the condition
TrainingOnCPU, from the devices the nodes' agents report, decided as a reconcile decides (pure,
no API server), with an Event only when it changes."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from ntp.nodeagent.progress import NodeProgress
from tessera_contracts.generation import LAYOUT_KEY, Generation
from tessera_contracts.jobspec import NTPTrainingJobSpec, defaulted
from tessera_contracts.progress import Device, NodeReport
from tessera_dev import paths
from tessera_operator import desired, workload
from tessera_operator.observed import Layout, Observed

pytestmark = pytest.mark.operator

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
NODES = ("gpu-a", "gpu-b")
POOL = {"pool.tessera.dev/name": "llama"}
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())


def _job(**spec: Any) -> dict[str, Any]:
    """The example job (TP8 x DP2, a node each) as the API server stores it."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"]["template"]["spec"]["nodeSelector"] = dict(POOL)
    job["spec"] = defaulted(job["spec"] | spec)
    return job


def _node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": dict(POOL), "annotations": {}}, "spec": {},
            "status": {"allocatable": {workload.GPU_RESOURCE: "8"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


JOB = _job()
SPEC = NTPTrainingJobSpec.from_spec(JOB["spec"])
PODS = (workload.rendezvous_pod(JOB, SPEC) | {"status": {"podIP": "10.0.0.5"}},
        *(workload.trainer_pod(JOB, SPEC, i, node) for i, node in enumerate(NODES)))
# What each trainer pod holds, as the operator made it: the reference the message is read by.
HELD = {c["resources"]["limits"][workload.GPU_RESOURCE] for pod in PODS[1:]
        for c in pod["spec"]["containers"] if c["name"] == "trainer"}
PLACED = Observed(JOB, pods=PODS, nodes=tuple(_node(n) for n in NODES))
_FIRST = desired.desired(desired.job_spec(JOB), PLACED, NOW).layout
assert _FIRST is not None
GENERATION_1 = Generation.from_dict(json.loads(_FIRST["data"][LAYOUT_KEY]))


def _report(node: str, device: Device | None) -> tuple[str, NodeReport]:
    """The node's report as its agent writes it: a rank started on `device`, a step done."""
    progress = NodeProgress(node, int(JOB["spec"]["steps"]), clock=lambda: 0.0)
    if device is not None:
        progress.ranks_on(device)
    progress.read(json.dumps({"step": 1, "rank": 0, "loss": 2.0, "step_s": 1.0, "samples": 64,
                              "generation": 1}).encode())
    return node, NodeReport.from_json(progress.report().to_json())  # as the operator reads it


def _decide(devices: dict[str, Device | None], status: dict[str, Any] | None = None,
            now: datetime = NOW, **spec: Any) -> desired.Desired:
    """The reconcile's decision with generation 1 in force, each node reporting `devices`."""
    job = _job(**spec) | {"status": {"layoutGeneration": 1} | (status or {})}
    observed = replace(PLACED, job=job, layout=Layout("7", generation=GENERATION_1),
                       reports=dict(_report(n, d) for n, d in devices.items()))
    return desired.desired(desired.job_spec(job), observed, now)


def _on_cpu(wanted: desired.Desired) -> dict[str, Any]:
    return next(c for c in wanted.status["conditions"] if c["type"] == "TrainingOnCPU")


def _events(wanted: desired.Desired) -> list[desired.Event]:
    return [e for e in wanted.events if e.message.startswith("TrainingOnCPU=")]


def test_ranks_on_their_gpus_are_no_cpu_training() -> None:
    wanted = _decide({n: Device("cuda", 8) for n in NODES})
    assert (_on_cpu(wanted)["status"], _on_cpu(wanted)["reason"]) == ("False", "TrainingOnGPU")


def test_agents_that_do_not_say_leave_it_unreported() -> None:
    wanted = _decide({n: None for n in NODES})
    assert (_on_cpu(wanted)["status"], _on_cpu(wanted)["reason"]) == ("False", "NotReported")


def test_a_node_without_cuda_devices_is_named_with_the_gpus_its_pod_holds() -> None:
    (held,) = HELD
    wanted = _decide({"gpu-a": Device("cpu", 0), "gpu-b": Device("cuda", 8)})
    condition = _on_cpu(wanted)
    assert (condition["status"], condition["reason"]) == ("True", "NoCUDADevice")
    assert condition["message"].startswith(
        f"the ranks on gpu-a (CUDA sees 0 of {held} GPUs) train on CPU though each of their "
        f"trainer pods holds {held} {workload.GPU_RESOURCE}: CUDA gives them no device")
    assert "gpu-b" not in condition["message"]


def test_ranks_told_to_train_on_cpu_are_said_to_be() -> None:
    wanted = _decide({n: Device("cpu", 8) for n in NODES}, args=["--device", "cpu"])
    condition = _on_cpu(wanted)
    assert (condition["status"], condition["reason"]) == ("True", "CPURequested")
    assert "gpu-a (--device cpu), gpu-b (--device cpu)" in condition["message"]


def test_an_event_only_when_it_changes() -> None:
    healthy = _decide({n: Device("cuda", 8) for n in NODES})
    first = _events(healthy)  # the condition appears
    assert [(e.reason, e.message.split(":")[0]) for e in first] == [
        ("TrainingOnGPU", "TrainingOnCPU=False")]
    # A node's ranks on CPU: one Event.
    later = NOW + timedelta(minutes=1)
    one = _decide({"gpu-a": Device("cpu", 0), "gpu-b": Device("cuda", 8)},
                  dict(healthy.status), later)
    assert [e.reason for e in _events(one)] == ["NoCUDADevice"]
    # The same again, or a second node on CPU (the message alone moves): none.
    assert _events(_decide({"gpu-a": Device("cpu", 0), "gpu-b": Device("cuda", 8)},
                           dict(one.status), later)) == []
    both = _decide({n: Device("cpu", 0) for n in NODES}, dict(one.status), later)
    assert _events(both) == [] and "gpu-b" in _on_cpu(both)["message"]
    assert _on_cpu(both)["lastTransitionTime"] == _on_cpu(one)["lastTransitionTime"]


def test_a_job_that_runs_no_attempt_trains_on_nothing() -> None:
    on_cpu = _decide({n: Device("cpu", 0) for n in NODES})
    suspended = _decide({n: Device("cpu", 0) for n in NODES}, dict(on_cpu.status),
                        suspend=True)
    condition = _on_cpu(suspended)
    assert (condition["status"], condition["reason"]) == ("False", "NotRunning")
    assert [e.reason for e in _events(suspended)] == ["NotRunning"]
