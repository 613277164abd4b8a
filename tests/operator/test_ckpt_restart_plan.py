"""failurePolicy.mode CKPT-RESTART as a pure decision, no API server: a GPU lost under the
layout ends the attempt as a failed trainer pod does (every pod replaced, a restart counted
against maxRestarts, the steps since the checkpoint lost progress) instead of a live relayout;
the next attempt is placed on whole nodes with no failed GPU, spares as found, at full TP."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from tessera_contracts.generation import LAYOUT_KEY, Generation
from tessera_contracts.gpuhealth import PublishedHealth, read
from tessera_contracts.jobspec import NTPTrainingJobSpec, defaulted
from tessera_contracts.powertarget import format_time
from tessera_contracts.progress import NodeReport, State
from tessera_contracts.unreadable import Unreadable
from tessera_dev import paths
from tessera_operator import desired, planner, workload
from tessera_operator.observed import Candidates, Layout, Observed
from tessera_operator.policies import placement

pytestmark = [pytest.mark.operator, pytest.mark.recovery]

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
A, B, C = "gpu-a", "gpu-b", "gpu-c"
IP = "10.0.0.5"
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
BASE = EXAMPLE["spec"]["powerPolicy"]["baseCapWatts"]
EVERY_POD = {"llama-rendezvous", "llama-node-0", "llama-node-1"}
BOTH_CONFIGMAPS = {"llama-layout", "llama-progress"}


def _job(mode: str = "CKPT-RESTART", dp: int = 1, tp: int = 8, **status: Any) -> dict[str, Any]:
    """The example job (8-GPU nodes) at TP `tp`, DP `dp` on two nodes' GPUs: TP8 x DP1 leaves
    one spare node; checkpoints every 500 steps."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"]["dataParallelReplicas"] = dp
    job["spec"]["tensorParallelSize"] = tp
    policy = job["spec"]["failurePolicy"]
    policy["mode"] = mode
    # the CRD refuses a minimum above the healthy degree
    policy["minTensorParallelSize"] = min(policy["minTensorParallelSize"], tp)
    job["spec"] = defaulted(job["spec"])
    return job | ({"status": status} if status else {})


def _node(name: str, cordon: str | None = None, gpus: int = 8, lost: bool = False
          ) -> dict[str, Any]:
    annotations = {} if cordon is None else {"tessera.dev/cordoned-gpus": cordon}
    ready = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"} if lost \
        else {"type": "Ready", "status": "True"}
    return {"metadata": {"name": name, "labels": {}, "annotations": annotations}, "spec": {},
            "status": {"allocatable": {workload.GPU_RESOURCE: str(gpus)},
                       "conditions": [ready]}}


def _pods(job: dict[str, Any], attempt: int = 0) -> tuple[dict[str, Any], ...]:
    """The attempt's pods on A and B, the rendezvous with an address."""
    spec = NTPTrainingJobSpec.from_spec(job["spec"])
    return (workload.rendezvous_pod(job, spec, attempt) | {"status": {"podIP": IP}},
            workload.trainer_pod(job, spec, 0, A, attempt),
            workload.trainer_pod(job, spec, 1, B, attempt))


def _gpu_health(node: str, xids: dict[int, list[int]]) -> PublishedHealth | Unreadable:
    """The node's GPUHealth as the operator's index holds it."""
    return read({"metadata": {"name": node},
                 "status": {"observedAt": format_time(NOW), "gpus": [
                     {"index": i, "state": "Healthy", "xids": xids.get(i, [])}
                     for i in range(8)]}})


def _report(node: str, step: int) -> tuple[str, NodeReport]:
    """A node's report at `step` after 1,300 s, 2 s a step, the rest startup."""
    return node, NodeReport(node, 1, step, 1000, State.TRAINING, step_seconds=2.0,
                            productive_seconds=1240.0, wall_seconds=1300.0,
                            badput_seconds={"startup": 60.0})


def _document(layout: dict[str, Any] | None) -> dict[str, Any]:
    assert layout is not None
    return json.loads(layout["data"][LAYOUT_KEY])


def _desired(observed: Observed) -> desired.Desired:
    return desired.desired(desired.job_spec(observed.job), observed, NOW)


def _running(job: dict[str, Any], **before: Any) -> Observed:
    """`job`'s attempt 0 on A and B, generation 1 in force (the plan's on healthy nodes, or as
    the world `before` it had it), both nodes at step 620: its last checkpoint is step 500."""
    placed = Observed(job, pods=_pods(job), nodes=(_node(A), _node(B)))
    placed = replace(placed, **before)
    first = Generation.from_dict(_document(_desired(placed).layout))
    return replace(placed, job=job | {"status": {"layoutGeneration": 1}},
                   layout=Layout("7", generation=first), gpu_health=(),
                   configmap_attempts={"llama-layout": 0, "llama-progress": 0},
                   reports=dict([_report(A, 620), _report(B, 620)]))


@pytest.fixture
def running() -> Observed:
    return _running(_job())


def test_the_layout_starts_on_the_first_healthy_node_at_full_tp(running: Observed) -> None:
    assert running.layout.generation is not None
    assert [(g.node, g.index) for g in running.layout.generation.gpus] == [
        (A, i) for i in range(8)]
    read_spec = desired.job_spec(running.job)
    assert not isinstance(read_spec, planner.Problem)
    spec = read_spec.planning
    assert isinstance(spec, planner.JobSpec) and spec.restarts_on_loss
    assert spec.fewest_nodes == 1
    # A lost GPU makes its group unusable: a spare group takes its place at full TP, none
    # is reduced (what a new attempt on those nodes would run).
    plan = planner.plan(spec, {A: A, B: B}, {(A, 3)})
    assert plan.tp_layout == "8" and plan.replicas[0].nodes() == (B,)


LOSSES = {
    "DCGM: an XID 79 on A/3": dict(gpu_health=(_gpu_health(A, {3: [79]}), _gpu_health(B, {}))),
    "a cordon of A/3": dict(nodes=(_node(A, cordon="3"), _node(B))),
    "node A lost (its kubelet silent)": dict(nodes=(_node(A, lost=True), _node(B))),
    "A's trainer pod gone": dict(pods=tuple(p for p in _pods(_job())
                                            if p["metadata"]["name"] != "llama-node-0")),
}


@pytest.mark.parametrize("world", LOSSES.values(), ids=LOSSES.keys())
def test_a_gpu_lost_under_the_layout_ends_the_attempt_instead_of_a_relayout(
        running: Observed, world: dict[str, Any]) -> None:
    wanted = _desired(replace(running, **world))
    status = wanted.status
    assert wanted.ended and status["phase"] == "Restarting"
    assert (status["attempt"], status["restarts"]) == (1, 1)
    assert status["restartingSince"] == format_time(NOW)
    # Every pod of the attempt is replaced, its layout and reports go, its power with them.
    assert set(wanted.delete_pods) == EVERY_POD - {
        p["metadata"]["name"] for p in running.pods if p not in world.get("pods", running.pods)}
    assert set(wanted.delete_configmaps) == BOTH_CONFIGMAPS
    assert wanted.layout is None and not wanted.targets and not wanted.children
    # The 120 steps since the checkpoint at 500 are lost progress, on each node.
    assert status["earlierAttempts"]["badputSeconds"]["lost_progress"] == 2 * 120 * 2.0
    (lost,) = [e for e in wanted.events if e.reason == "LayoutGPULost"]
    assert lost.type == "Warning" and f"{A}/" in lost.message and "CKPT-RESTART" in lost.message


def test_the_same_loss_under_ntp_is_a_live_relayout() -> None:
    ntp = _running(_job("NTP"))
    wanted = _desired(replace(ntp, nodes=(_node(A, cordon="3"), _node(B))))
    assert not wanted.ended and wanted.status["attempt"] == 0
    assert _document(wanted.layout)["generation"] == 2


def test_a_gpu_lost_outside_the_layout_changes_nothing(running: Observed) -> None:
    wanted = _desired(replace(running, nodes=(_node(A), _node(B, cordon="3")),
                              gpu_health=(_gpu_health(A, {}), _gpu_health(B, {5: [79]}))))
    assert not wanted.ended and wanted.layout is None and not wanted.delete_pods
    assert (wanted.status["attempt"], wanted.status["restarts"]) == (0, 0)
    assert wanted.status["tpLayout"] == "8"
    # No boost in this mode: every GPU at the base cap or below.
    assert wanted.targets and all(t.watts_for(i) <= BASE for t in wanted.targets.values()
                                  for i in range(8))
    assert not any(e.reason == "LayoutGPULost" for e in wanted.events)


def test_an_attempt_keeps_its_first_layout() -> None:
    """TP4 on 8-GPU nodes: generation 1 went to A's second group while A/1 was failed; with
    A/1 back, planning would move the replica to A's first group: a live relayout in NTP,
    nothing here while none of the layout's GPUs is lost."""
    failed = {"gpu_health": (_gpu_health(A, {1: [79]}), _gpu_health(B, {}))}
    for mode, moves in (("CKPT-RESTART", False), ("NTP", True)):
        back = _running(_job(mode, tp=4), **failed)
        assert back.layout.generation is not None
        assert [(g.node, g.index) for g in back.layout.generation.gpus] == [
            (A, i) for i in range(4, 8)]
        wanted = _desired(back)
        assert not wanted.ended and (wanted.layout is not None) == moves, mode
        assert [r["nodes"] for r in wanted.status["replicas"]] == [[A]]
        assert wanted.status["tpLayout"] == "4"


def test_the_restarts_count_against_max_restarts(running: Observed) -> None:
    spent = _job(restarts=3, layoutGeneration=1)
    wanted = _desired(replace(running, job=spent, nodes=(_node(A, cordon="3"), _node(B))))
    assert wanted.status["phase"] == "Failed"
    failed = next(c for c in wanted.status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "RestartLimitReached"
    assert f"GPU {A}/3 lost" in failed["message"]
    (lost,) = [e for e in wanted.events if e.reason == "LayoutGPULost"]
    assert "no restart left" in lost.message


def test_before_the_first_generation_a_loss_restarts_only_when_the_replicas_no_longer_fit(
        ) -> None:
    failed = (_gpu_health(A, {3: [79]}), _gpu_health(B, {}))
    # DP1 with a spare node: generation 1 goes to the spare, no restart.
    spare = Observed(_job(), pods=_pods(_job()), nodes=(_node(A), _node(B)), gpu_health=failed)
    wanted = _desired(spare)
    assert not wanted.ended
    assert {g.split("/")[0] for r in _document(wanted.layout)["replicas"]
            for g in r["gpus"]} == {B}
    # DP2 on two nodes: one full replica left of two, so the attempt ends.
    full = Observed(_job(dp=2), pods=_pods(_job(dp=2)), nodes=(_node(A), _node(B)),
                    gpu_health=failed)
    wanted = _desired(full)
    assert wanted.ended and wanted.status["restarts"] == 1 and wanted.layout is None


# The attempt after the restart: attempt 1, no pod yet, restarting for a minute.
RESTARTING = _job(attempt=1, restarts=1,
                  restartingSince=format_time(NOW - timedelta(seconds=60)))


def _placed(*candidates: dict[str, Any],
            gpu_health: tuple[PublishedHealth | Unreadable, ...] = ()) -> desired.Desired:
    observed = Observed(RESTARTING, candidates=Candidates(candidates), gpu_health=gpu_health)
    assert placement.needs_placement(desired.job_spec(RESTARTING), observed, NOW)
    return _desired(observed)


def _trainers(wanted: desired.Desired) -> dict[str, str]:
    return {c["metadata"]["name"]: workload.pod_node(c) for c in wanted.children
            if c["kind"] == "Pod" and workload.is_trainer(c)}


def test_the_next_attempt_is_placed_on_whole_healthy_nodes_with_the_spares_found() -> None:
    # A cordoned, C failed by DCGM (its device plugin still counts 8), A short of a GPU the
    # device plugin withdrew: only whole healthy nodes, as many as the job asks for.
    assert _trainers(_placed(_node(A, cordon="3"), _node(B), _node(C))) == {
        "llama-node-0": B, "llama-node-1": C}
    wanted = _placed(_node(A, gpus=7), _node(B), _node(C),
                     gpu_health=(_gpu_health(C, {2: [79]}),))
    assert _trainers(wanted) == {"llama-node-0": B}  # the spare it cannot have left out
    assert wanted.status["tpLayout"] == "8" and wanted.status["phase"] == "Pending"
    # The minute without pods is restart badput on each of the job's two nodes.
    assert wanted.status["earlierAttempts"]["badputSeconds"]["restart"] == 2 * 60.0
    assert "restartingSince" not in wanted.status


def test_too_few_healthy_nodes_leave_the_attempt_waiting() -> None:
    wanted = _placed(_node(A, cordon="3"))
    assert not wanted.children and wanted.status["phase"] == "Pending"
    ready = next(c for c in wanted.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Unschedulable"
    assert "CKPT-RESTART" in ready["message"] and "needs 1 whole nodes" in ready["message"]


def test_an_attempt_with_its_pods_adds_no_spare() -> None:
    one = Observed(RESTARTING, pods=(workload.trainer_pod(
        RESTARTING, NTPTrainingJobSpec.from_spec(RESTARTING["spec"]), 0, B, 1),),
                   nodes=(_node(B),))
    assert not placement.needs_placement(desired.job_spec(RESTARTING), one, NOW)
