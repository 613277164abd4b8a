"""The planner's decisions on plain data: packing, the minimum TP, failure modes, spares, the
boost against ntp.plan's real per-rank work, power targets within the rack budget."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from ntp.plan import ModelShape, layer_flops, plan_replica
from power_controller.perf_model import PAPER
from power_controller.planning import PowerPolicy
from tessera_operator import planner
from tessera_operator.planner import JobSpec, SpecError, plan

pytestmark = pytest.mark.operator

LLAMA_8B = ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256)
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _spec(**changes: object) -> JobSpec:
    base = JobSpec(shape=LLAMA_8B, tp=8, dp=2, min_tp=6,
                   power=PowerPolicy(base_w=600, boost_cap_w=700, rack_budget_w=4800))
    return replace(base, **changes)


def _own_domains(*nodes: str) -> dict[str, str]:
    return {n: n for n in nodes}


def test_one_failure_shrinks_only_its_replica() -> None:
    result = plan(_spec(), _own_domains("a", "b"), {("a", 3)})
    assert result.tp_layout == "7,8" and result.degraded
    reduced = result.replicas[0]
    assert reduced.stage_gpus() == (tuple(("a", i) for i in range(8) if i != 3),)
    assert reduced.failed_gpus() == (("a", 3),)
    assert result.replicas[1].stage_gpus() == (tuple(("b", i) for i in range(8)),)


def test_replicas_below_the_minimum_tp_are_dropped() -> None:
    failed = {("a", 0), ("a", 1), ("a", 2)}  # 5 survivors < minTP 6
    result = plan(_spec(), _own_domains("a", "b"), failed)
    assert result.tp_layout == "8"
    assert [p.reason for p in result.problems] == ["ReplicasDropped"]
    # Without a stated minimum, half the healthy TP is the floor (as in the simulator).
    assert plan(_spec(min_tp=0), _own_domains("a", "b"), failed).tp_layout == "5,8"


def test_partially_failed_groups_are_packed_into_one_replica() -> None:
    # PP 2: four single-node domains make two replicas of two stages. A failure in domains a
    # and c would slow both replicas if they kept their positions; packed, only one is slow.
    result = plan(_spec(pp=2), _own_domains("a", "b", "c", "d"), {("a", 0), ("c", 5)})
    assert sorted(r.tp for r in result.replicas) == [7, 8]
    slow = next(r for r in result.replicas if r.tp == 7)
    assert {g.domain for g in slow.stages} == {"a", "c"}
    # A replica with a healthy and a reduced stage runs both at TP 7: the healthy one idles a GPU.
    mixed = plan(_spec(pp=2, dp=1), _own_domains("a", "b"), {("a", 0)}).replicas[0]
    assert mixed.tp == 7 and mixed.idle_gpus() == (("b", 7),)


def test_groups_stay_inside_their_scale_up_domain() -> None:
    clique = {"n0": "nvl16", "n1": "nvl16"}
    result = plan(_spec(tp=16, dp=1, min_tp=8), clique, {("n1", 2)})
    assert result.tp_layout == "15"
    assert len(result.replicas[0].stage_gpus()[0]) == 15
    too_small = plan(_spec(tp=16, dp=1), _own_domains("n0", "n1"), set())
    assert too_small.replicas == ()
    assert [p.reason for p in too_small.problems] == ["DomainTooSmall", "DomainTooSmall"]


def test_uniform_modes() -> None:
    nodes = _own_domains("a", "b", "c")  # one spare domain
    assert plan(_spec(mode="SPARE"), nodes, {("a", 3)}).tp_layout == "8,8"
    assert plan(_spec(mode="DROP"), nodes, {("a", 3)}).tp_layout == "8"  # no spares for DROP
    # The NTP modes, too, prefer a healthy spare to a shrunk group.
    assert plan(_spec(), nodes, {("a", 3)}).tp_layout == "8,8"


def test_fingerprint_follows_the_layout_only() -> None:
    nodes = _own_domains("a", "b", "c")
    healthy = plan(_spec(), nodes, set())
    assert healthy.fingerprint == plan(_spec(), nodes, set()).fingerprint
    # A failure on the idle spare domain changes nothing the trainer sees.
    assert plan(_spec(), nodes, {("c", 1)}).fingerprint == healthy.fingerprint
    assert plan(_spec(), nodes, {("a", 1)}).fingerprint != healthy.fingerprint
    assert plan(_spec(), nodes, {("a", 1)}).replicas[0].index == 0  # numbered by position


def _busiest(tp: int) -> float:
    return max(layer_flops(LLAMA_8B, s) for s in plan_replica(LLAMA_8B, tp))


def test_boost_makes_the_busiest_rank_keep_pace() -> None:
    # A generous cap: the boost is what the model says the real (uneven) split needs.
    spec = _spec(power=PowerPolicy(base_w=500, boost_cap_w=900))
    reduced = plan(spec, _own_domains("a", "b"), {("a", 3)}).replicas[0]
    slowdown = _busiest(7) / _busiest(8)
    assert slowdown > 8 / 7  # 32 heads over 7 ranks: the planner's slowdown beats the ideal
    assert PAPER.speedup(reduced.power_ratio) == pytest.approx(slowdown, rel=1e-6)
    # The boost cap bounds it.
    capped = plan(_spec(), _own_domains("a", "b"), {("a", 3)}).replicas[0]
    assert capped.power_ratio == pytest.approx(700 / 600)


def test_power_targets_boost_survivors_within_the_budget() -> None:
    result = plan(_spec(mode="NTP-PW"), _own_domains("a", "b"), {("a", 3)})
    targets = result.power_targets(NOW)
    a, b = targets["a"], targets["b"]
    watts = [a.watts_for(i) for i in range(8)]
    assert watts[3] == 200 and set(watts[:3] + watts[4:]) == {657}  # (4800 - 200) // 7
    assert sum(watts) <= 4800 and a.rack_budget_w == 4800
    assert b.gpu_w == {} and b.base_w == 600
    # Plain NTP manages power too, but never boosts.
    plain = plan(_spec(mode="NTP"), _own_domains("a", "b"), {("a", 3)}).power_targets(NOW)
    assert {plain["a"].watts_for(i) for i in range(8) if i != 3} == {600}
    assert plan(_spec(power=None), _own_domains("a"), set()).power_targets(NOW) == {}


def test_a_rack_budget_below_the_gpus_minimum_is_a_spec_error() -> None:
    # 8 GPUs cannot go below 8 x 200 W: only the observed rack size shows it, so it is the
    # planner (not the schema) that must name the field.
    small = _spec(mode="NTP-PW", power=PowerPolicy(base_w=600, boost_cap_w=700,
                                                    rack_budget_w=1000))
    with pytest.raises(SpecError, match="rackBudgetWatts"):
        plan(small, _own_domains("a", "b"), {("a", 3)}).power_targets(NOW)


EXAMPLE_SPEC = {
    "model": {"hidden": 4096, "heads": 32, "kvHeads": 8, "ffn": 14336, "vocab": 128256,
              "layers": 32, "seqLen": 8192},
    "tensorParallelSize": 8, "dataParallelReplicas": 2, "totalGPUs": 16,
    "failurePolicy": {"mode": "NTP-PW", "minTensorParallelSize": 6},
    "powerPolicy": {"baseCapWatts": 600, "boostCapWatts": 700, "ramp": {"stepWatts": 25}},
}


def test_spec_reading_and_its_errors() -> None:
    spec = JobSpec.from_spec(EXAMPLE_SPEC, ttl_s=90)
    assert (spec.tp, spec.dp, spec.pp, spec.min_tp, spec.mode) == (8, 2, 1, 6, "NTP-PW")
    assert spec.power == PowerPolicy(base_w=600, boost_cap_w=700, ttl_s=90, ramp_step_w=25)
    assert spec.domain_label == planner.DEFAULT_DOMAIN_LABEL
    for broken, field in (
        ({**EXAMPLE_SPEC, "powerPolicy": {"baseCapWatts": 150, "boostCapWatts": 700}},
         "powerPolicy"),
        ({k: v for k, v in EXAMPLE_SPEC.items() if k != "powerPolicy"}, "powerPolicy"),
        ({**EXAMPLE_SPEC, "model": {**EXAMPLE_SPEC["model"], "kvHeads": 5}}, "model"),
        ({k: v for k, v in EXAMPLE_SPEC.items() if k != "tensorParallelSize"},
         "tensorParallelSize"),
    ):
        with pytest.raises(SpecError) as err:
            JobSpec.from_spec(broken)
        assert err.value.field == field


def test_node_domains() -> None:
    nodes = [{"metadata": {"name": "n0", "labels": {"nvidia.com/gpu.clique": "c1"}}},
             {"metadata": {"name": "n1"}}]
    assert planner.node_domains(nodes, "nvidia.com/gpu.clique") == {"n0": "c1", "n1": "n1"}


def test_the_papers_job_fits_its_api_objects() -> None:
    """32,768 GPUs (NVL32 domains of 8 four-GPU nodes, TP32 PP8 DP128) with 100 failed GPUs:
    the layout document fits a ConfigMap (1 MiB), tpLayout the CRD's 4096 characters."""
    shape = ModelShape(hidden=20480, n_heads=128, n_kv_heads=128, ffn=81920, vocab=128256)
    spec = JobSpec(shape=shape, tp=32, dp=128, pp=8, gpus_per_node=4, min_tp=16)
    nodes = {f"gpu-node-{i:05d}": f"nvl32-{i // 8:04d}" for i in range(8192)}
    # One failed GPU in each of 100 domains (every tenth).
    failed = {(f"gpu-node-{80 * i + i % 8:05d}", i % 4) for i in range(100)}
    result = plan(spec, nodes, failed)
    assert len(result.replicas) == 128
    # Packed, the 100 hit groups slow ceil(100 / 8) = 13 replicas instead of up to 100.
    assert sorted(r.tp for r in result.replicas)[:14] == [31] * 13 + [32]
    document = json.dumps(result.document("ns/job", 1), separators=(",", ":"))
    assert len(document.encode()) < 1024 * 1024 * 0.8
    assert len(result.tp_layout) <= 4096


def test_tp_layout_runs_when_replicas_are_many() -> None:
    nodes = _own_domains(*(f"n{i:04d}" for i in range(3000)))
    result = plan(_spec(dp=3000), nodes, {("n1000", 0)})
    assert result.tp_layout == "8x1000,7,8x1999"
    assert plan(_spec(), _own_domains("a", "b"), set()).tp_layout == "8,8"
