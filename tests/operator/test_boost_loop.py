"""The closed boost loop: a reduced replica's power ratio follows its measured compute time
against the healthy replicas' (`planner.follow_compute`), within the boost cap and the rack
budget, and the job's status carries it across reconciles and operator restarts. The last test
plays the trainers' agents on a real API server: progress reports written by hand move the
reduced replica's power targets."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest
import yaml
from kubernetes import client
from opharness import ROOT, RunningOperator

from tessera_contracts.model_shape import ModelShape
from tessera_contracts.progress import NodeReport, State, progress_configmap, report_key
from tessera_contracts.vocabulary import FailurePolicy
from tessera_core import group_decision
from tessera_core.perf_model import PAPER
from tessera_dev import simnodes
from tessera_operator import conditions, power_targets
from tessera_operator.planner import SETTLE_STEPS, Boost, JobPlan, JobSpec, follow_compute, plan
from tessera_operator.power_planning import PowerPolicy

LLAMA_8B = ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256)
HEALTHY_S = 2.0  # a healthy replica's compute seconds per step


def _plan(budget: int | None = 5600, failed: frozenset = frozenset({("a", 3)})) -> JobPlan:
    """Two HGX nodes, one replica each: a's at TP 7 (GPU 3 failed), b's healthy."""
    spec = JobSpec(shape=LLAMA_8B, tp=8, dp=2, min_tp=6, mode=FailurePolicy.NTP_PW,
                   power=PowerPolicy(base_w=500, boost_cap_w=700, rack_budget_w=budget))
    return plan(spec, {"a": "a", "b": "b"}, failed)


STEPS = 100_000


def _report(node: str, step: int, compute_s: float | None,
            state: State = State.TRAINING) -> NodeReport:
    return NodeReport(node=node, generation=2, step=step, steps=STEPS, state=state,
                      compute_seconds=compute_s)


def _reports(step: int, reduced_s: float | None) -> dict[str, NodeReport | None]:
    return {"a": _report("a", step, reduced_s), "b": _report("b", step, HEALTHY_S)}


def _boosts(p: JobPlan) -> dict:
    return {r.key(): Boost(r.power_ratio, r.ratio_step) for r in p.replicas if r.tp < 8}


def _plant(slowdown: float, ratio: float) -> float:
    """The reduced replica's compute time at `ratio` x the base cap when its work is
    `slowdown` x a healthy replica's (the paper's power -> speed model)."""
    return HEALTHY_S * slowdown / PAPER.speedup(ratio)


def _run_loop(p: JobPlan, slowdown: float, start: Boost, rounds: int) -> list[float]:
    """`rounds` turns of the loop, each SETTLE_STEPS steps after the last; the ratios set."""
    boosts = {p.replicas[0].key(): start}
    ratios = []
    for turn in range(1, rounds + 1):
        ratio = next(iter(boosts.values())).ratio
        step = start.step + turn * SETTLE_STEPS
        p = follow_compute(p, _reports(step, _plant(slowdown, ratio)), boosts)
        boosts = _boosts(p)
        ratios.append(p.replicas[0].power_ratio)
        for target in p.power_targets().values():
            assert target.budget_w <= target.rack_budget_w
            assert max(target.gpu_w.values(), default=0) <= 700
    return ratios


def test_the_loop_raises_an_underpowered_replica_until_it_keeps_pace() -> None:
    p = _plan()
    slowdown = group_decision.planned_slowdown(LLAMA_8B, 8, 7)
    ratios = _run_loop(p, slowdown, Boost(1.0, 0), rounds=12)
    assert ratios == sorted(ratios)  # it only raises on the way up
    assert all(b - a <= 0.05 + 1e-9 for a, b in zip([1.0, *ratios], ratios, strict=False))
    lag = _plant(slowdown, ratios[-1]) / HEALTHY_S
    assert abs(lag - 1.0) <= 0.01, (ratios, lag)
    assert ratios[-1] == ratios[-2]  # settled: inside the band it stays put


def test_the_loop_lowers_a_boost_that_overshoots() -> None:
    # The model overestimated the work: the replica keeps pace with less power.
    p = _plan()
    seed = p.replicas[0].power_ratio
    ratios = _run_loop(p, 1.05, Boost(seed, 0), rounds=12)
    assert ratios[0] == round(seed - 0.05, 4)
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] >= 1.0
    assert abs(_plant(1.05, ratios[-1]) / HEALTHY_S - 1.0) <= 0.01


def test_the_loop_stays_within_the_boost_cap_and_what_the_rack_budget_can_pay() -> None:
    # Work beyond any boost: the ratio climbs to the cap and no further.
    ratios = _run_loop(_plan(), 1.5, Boost(1.0, 0), rounds=12)
    assert max(ratios) == ratios[-1] == 700 / 500
    # The default rack budget (8 x the base cap) pays for 542 W survivors: a ratio beyond that
    # would change no watt, so the loop does not wind up past it.
    tight = _plan(budget=None)
    ratios = _run_loop(tight, 1.5, Boost(1.0, 0), rounds=12)
    reachable = tight.reachable_ratio(tight.replicas[0])
    assert reachable == 542 / 500 and max(ratios) == ratios[-1] == reachable
    # A boost that a hand edit of the status put beyond the cap is brought back inside.
    p = follow_compute(_plan(), _reports(SETTLE_STEPS, HEALTHY_S * 1.2),
                       {_plan().replicas[0].key(): Boost(9.0, 0)})
    assert p.replicas[0].power_ratio == 700 / 500


def test_the_loop_holds_inside_its_band_without_news_and_until_the_steps_ran() -> None:
    p = _plan()
    key, seed = p.replicas[0].key(), p.replicas[0].power_ratio
    start = {key: Boost(1.2, 100)}

    def ratio_after(reports: dict[str, NodeReport | None]) -> tuple[float, int]:
        r = follow_compute(p, reports, start).replicas[0]
        return r.power_ratio, r.ratio_step

    late = 100 + SETTLE_STEPS
    assert ratio_after(_reports(late, HEALTHY_S * 1.009)) == (1.2, 100)  # within 1%
    assert ratio_after(_reports(late - 1, HEALTHY_S * 1.2)) == (1.2, 100)  # too soon
    assert ratio_after(_reports(late, None)) == (1.2, 100)  # no measurement
    assert ratio_after({"a": _report("a", late, 2.4, State.RECONFIGURING),
                        "b": _report("b", late, HEALTHY_S)}) == (1.2, 100)
    assert ratio_after({"a": _report("a", late, 2.4), "b": None}) == (1.2, 100)
    assert ratio_after(_reports(late, HEALTHY_S * 1.2)) == (1.25, late)  # moves, at most 0.05
    # A replica the loop has not seen starts from the open-loop seed at the current step; so
    # does one that changed (another failed GPU makes it another replica).
    fresh = follow_compute(p, _reports(500, HEALTHY_S * 1.2), {}).replicas[0]
    assert (fresh.power_ratio, fresh.ratio_step) == (round(seed, 4), 500)
    other = _plan(failed=frozenset({("a", 3), ("a", 5)}))
    assert follow_compute(other, _reports(late, HEALTHY_S), start).replicas[0].ratio_step == late


def test_healthy_replicas_and_other_modes_are_left_alone() -> None:
    p = _plan()
    followed = follow_compute(p, _reports(SETTLE_STEPS, HEALTHY_S * 1.2), {})
    assert followed.replicas[1] == p.replicas[1]
    ntp = replace(p, spec=replace(p.spec, mode=FailurePolicy.NTP))
    assert follow_compute(ntp, _reports(SETTLE_STEPS, HEALTHY_S * 1.2), {}) is ntp


def test_the_status_keeps_the_loop_across_reconciles() -> None:
    seeded = _plan()
    p = follow_compute(seeded, _reports(40, HEALTHY_S * 1.2),
                       {seeded.replicas[0].key(): Boost(1.2, 0)})
    status = conditions.render(p, (), {}, now="2026-01-01T00:00:00Z", generation=1,
                               layout_generation=1)
    reduced = next(r for r in status["replicas"] if r["tensorParallelSize"] == 7)
    assert (reduced["powerRatio"], reduced["powerRatioStep"]) == (1.25, 40)
    assert "powerRatio" not in next(r for r in status["replicas"] if r["index"] == 1)
    # Read back through JSON, as the API server returns it.
    assert conditions.boosts(json.loads(json.dumps(status))) == {
        p.replicas[0].key(): Boost(1.25, 40)}
    broken = copy.deepcopy(status)
    broken["replicas"][0]["powerRatio"] = "fast"
    assert conditions.boosts(broken) == {}


# ----------------------------------------------------------------------------------------------
# On a real API server
# ----------------------------------------------------------------------------------------------

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())


def _watts(op: RunningOperator, node: str) -> set[int]:
    obj = power_targets.fetch(op.admin, node)
    if obj is None:
        return set()
    spec = obj["spec"]
    listed = {g["index"]: g["watts"] for g in spec.get("gpus", [])}
    return {listed.get(i, spec["baseWatts"]) for i in range(8)}


def _write_reports(op: RunningOperator, job: str, reports: dict[str, NodeReport]) -> None:
    """What the nodes' agents do: each patches its own key of the job's progress ConfigMap."""
    client.CoreV1Api(op.admin).patch_namespaced_config_map(
        progress_configmap(job), op.namespace,
        {"data": {report_key(n): r.to_json() for n, r in reports.items()}})


def _reduced(status: dict[str, Any]) -> dict[str, Any]:
    return next((r for r in status.get("replicas", []) if r["tensorParallelSize"] == 7), {})


@pytest.mark.operator
def test_progress_reports_move_the_reduced_replicas_power(running_operator: RunningOperator
                                                          ) -> None:
    op, job = running_operator, "boost-loop"
    node_a, node_b = op.create_nodes(job, 2)
    client.CoreV1Api(op.admin).patch_node(
        node_a, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "3"}}})
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": job}
    body["spec"]["steps"] = STEPS  # what the reports below say the ranks were told
    simnodes.place_in_pool(body["spec"], job)
    policy = body["spec"]["powerPolicy"]
    policy["rackBudgetWatts"] = 8 * policy["boostCapWatts"]  # the budget is not what binds
    base, cap = policy["baseCapWatts"], policy["boostCapWatts"]
    op.create_job(body)
    op.start_rendezvous(job)
    # Open loop: the seed asks for more than the cap, so the survivors run at the cap.
    seeded = op.wait(lambda: _reduced(op.status(job)), lambda r: "powerRatio" in r, "a seed")
    assert seeded["nodes"] == [node_a] and seeded["powerRatio"] == round(cap / base, 4)
    assert op.wait(lambda: _watts(op, node_a), lambda w: w == {200, cap}, "boosted") \
        == {200, cap}

    # The reduced replica computes faster than the healthy one: its boost is lowered.
    step = seeded["powerRatioStep"] + SETTLE_STEPS
    _write_reports(op, job, {node_a: _report(node_a, step, 1.80),
                             node_b: _report(node_b, step, HEALTHY_S)})
    lowered = op.wait(lambda: _reduced(op.status(job)),
                      lambda r: r.get("powerRatioStep") == step, "the ratio lowered")
    assert lowered["powerRatio"] == round(cap / base - 0.05, 4)
    watts = round(base * lowered["powerRatio"])
    op.wait(lambda: _watts(op, node_a), lambda w: w == {200, watts}, f"survivors at {watts} W")
    assert _watts(op, node_b) == {base}  # its own HGX rack: nothing to pay for

    # Keeping pace within 1%: the ratio and the targets stay as they are.
    later = step + SETTLE_STEPS
    _write_reports(op, job, {node_a: _report(node_a, later, HEALTHY_S * 1.005),
                             node_b: _report(node_b, later, HEALTHY_S)})
    op.wait(lambda: op.status(job).get("step"), lambda s: s == later, "the reports read")
    assert _reduced(op.status(job))["powerRatio"] == lowered["powerRatio"]
    assert _watts(op, node_a) == {200, watts}
