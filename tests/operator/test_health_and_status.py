"""The health signal from node annotations (bad input ignored and reported, never raised) and the
status rebuilt from a plan (phase, conditions, transition times kept while nothing changes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera_contracts import api, cordon
from tessera_contracts.model_shape import ModelShape
from tessera_contracts.vocabulary import FailurePolicy
from tessera_operator import conditions, health, planner
from tessera_operator.power_planning import PowerPolicy

pytestmark = pytest.mark.operator


def _node(name: str, cordoned: str | None = None) -> dict:
    annotations = {} if cordoned is None else {api.CORDON_ANNOTATION: cordoned}
    return {"metadata": {"name": name, "annotations": annotations}}


@pytest.mark.parametrize(("value", "indices", "problems"), [
    ("3", {3}, 0),
    (" 1, 5 ,", {1, 5}, 0),
    ("", set(), 0),
    ("3,3", {3}, 0),
    ("two,1", {1}, 1),
    ("-1,8,7", {7}, 2),  # a negative index and one past the node's 8 GPUs
    ("1-3", set(), 1),
    ("9" * 5000 + ",2", {2}, 1),  # past Python's 4,300-digit integer parsing limit
    ("\u0663", set(), 1),  # an Arabic-Indic 3 is a digit to Python, not to the annotation
])
def test_parse_indices(value: str, indices: set[int], problems: int) -> None:
    got, bad = cordon.parse_indices(value, 8)
    assert got == indices and len(bad) == problems


def test_a_huge_item_is_reported_clipped() -> None:
    _, (problem,) = cordon.parse_indices("7" * 100_000, 8)
    assert problem == "GPU 77777777...(100000 characters) does not exist (the node has GPUs 0-7)"


def test_cordons_from_nodes_and_merge() -> None:
    signal = health.from_cordons([_node("a", "3"), _node("b"), _node("c", "x")], 8)
    assert signal.failed == {("a", 3)}
    assert signal.problems == (f"node c: {api.CORDON_ANNOTATION}: 'x' is not a GPU index, "
                               "ignored",)
    other = health.Health(frozenset({("b", 0)}), ("dcgm: stale",))
    merged = signal.merge(other)
    assert merged.failed == {("a", 3), ("b", 0)} and len(merged.problems) == 2
    assert cordon.format_indices([5, 1, 5]) == "1,5"


SPEC = planner.JobSpec(
    shape=ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256),
    tp=8, dp=2, min_tp=6, mode=FailurePolicy.NTP_PW,
    power=PowerPolicy(base_w=600, boost_cap_w=700))


def _render(plan, previous=None, now="2026-01-01T00:00:00Z", problems=()):
    problems = plan.problems if plan is not None and not problems else problems
    return conditions.render(plan, problems, previous or {}, now=now, generation=4,
                             layout_generation=2)


def _by_type(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_of_a_degraded_job() -> None:
    status = _render(planner.plan(SPEC, {"a": "a", "b": "b"}, {("a", 3)}))
    assert (status["phase"], status["tpLayout"], status["observedGeneration"]) == (
        "Degraded", "7,8", 4)
    assert status["replicas"][0] == {"index": 0, "tensorParallelSize": 7, "nodes": ["a"],
                                     "failedGPUs": ["a/3"], "powerBoosted": True,
                                     "powerRatio": 1.1667, "powerRatioStep": 0}
    c = _by_type(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "RunningDegraded")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == (
        "True", "ReducedTensorParallelism")
    assert c["PowerBoosted"]["status"] == "True"


def test_a_held_raise_is_not_claimed_in_effect() -> None:
    plan = planner.plan(SPEC, {"a": "a", "b": "b"}, {("a", 3)})
    held = conditions.render(plan, plan.problems, {}, now="2026-01-01T00:00:00Z", generation=4,
                             layout_generation=2, held=("b",))
    message = _by_type(held)["PowerBoosted"]["message"]
    assert message.endswith("; raises on b wait for their racks' cuts to be reported in effect")
    assert "wait" not in _by_type(_render(plan))["PowerBoosted"]["message"]


def test_status_without_a_plan() -> None:
    status = _render(None, problems=(planner.Problem("InvalidSpec", "spec.model: bad"),))
    assert status["phase"] == "Pending" and status["replicas"] == []
    assert _by_type(status)["Ready"]["reason"] == "InvalidSpec"


def test_transition_times_change_only_with_the_status() -> None:
    nodes = {"a": "a", "b": "b"}
    healthy = _render(planner.plan(SPEC, nodes, set()))
    assert healthy["phase"] == "Running"
    again = _render(planner.plan(SPEC, nodes, set()), healthy, now="2026-01-01T00:05:00Z")
    assert again == healthy and conditions.changed(healthy, again) == []
    hit = _render(planner.plan(SPEC, nodes, {("b", 0)}), healthy, now="2026-01-01T00:09:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in hit["conditions"]}
    # Ready stays True (its reason changes), Degraded and PowerBoosted flip.
    assert times == {"Ready": "2026-01-01T00:00:00Z", "Degraded": "2026-01-01T00:09:00Z",
                     "PowerBoosted": "2026-01-01T00:09:00Z"}
    assert {c["type"] for c in conditions.changed(healthy, hit)} == {
        "Ready", "Degraded", "PowerBoosted"}


def test_nothing_is_running_before_a_layout_is_published() -> None:
    plan = planner.plan(SPEC, {"a": "a", "b": "b"}, set())
    waiting = conditions.render(plan, plan.problems, {}, now="2026-01-01T00:00:00Z",
                                generation=1, layout_generation=0)
    assert waiting["phase"] == "Pending"
    assert _by_type(waiting)["Ready"]["reason"] == "AllReplicasHealthy"  # the plan holds


def test_the_status_shows_the_layout_in_force_and_why_a_gpu_failed() -> None:
    plan = planner.plan(SPEC, {"a": "a", "b": "b"}, {("a", 3)})
    why = {("a", 3): "recent XID 48, fatal by the job's fatalXIDs"}
    # the plan has a GPU out; the generation in force (not yet replaced) still runs 8,8
    status = conditions.render(plan, plan.problems, {}, now="2026-01-01T00:00:00Z",
                               generation=1, layout_generation=1, tp_layout="8,8", why=why)
    assert status["tpLayout"] == "8,8"
    assert "replica 0 at TP 7 (failed a/3: recent XID 48, fatal by the job's fatalXIDs)" in \
        _by_type(status)["Degraded"]["message"]


def test_a_message_that_moves_is_no_event() -> None:
    before = {"conditions": [{"type": "Training", "status": "True", "reason": "Running",
                              "message": "step 1395/2000"}]}
    after = {"conditions": [{"type": "Training", "status": "True", "reason": "Running",
                             "message": "step 1338/2000"}]}
    assert conditions.changed(before, after) == []
    stopped = {"conditions": [{"type": "Training", "status": "True", "reason": "Reconfiguring",
                               "message": "step 1340/2000"}]}
    assert [c["reason"] for c in conditions.changed(after, stopped)] == ["Reconfiguring"]


def test_a_rack_budget_below_the_base_caps_is_said() -> None:
    spec = replace(SPEC, power=PowerPolicy(base_w=600, boost_cap_w=700, rack_budget_w=3000))
    plan = planner.plan(spec, {"a": "a", "b": "b"}, set())
    power = _by_type(_render(plan))["PowerBoosted"]
    assert (power["status"], power["reason"]) == ("False", "BudgetBelowBaseCap")
    assert "holds domain a's 8 GPUs at 375 W each, below baseCapWatts 600 W" in power["message"]
    # below the device minimum, nothing could run: the job is refused before it has pods
    assert planner.budget_problem(replace(spec, power=replace(
        spec.power, rack_budget_w=1000)), {"a": "a"}).reason == "InvalidSpec"
    assert planner.budget_problem(spec, {"a": "a"}) is None
