"""The planner's decisions on plain data: packing, the minimum TP, failure modes, spares, the
boost against tessera_core.plan's real per-rank work, power targets within the rack budget."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tessera_contracts import api
from tessera_contracts.generation import Gpu, Rendezvous
from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.model_shape import ModelShape
from tessera_contracts.powertarget import parse_object, to_object
from tessera_contracts.vocabulary import FailurePolicy
from tessera_core.perf_model import PAPER
from tessera_core.plan import layer_flops, plan_replica, rank_layer_flops
from tessera_operator import planner
from tessera_operator.planner import JobSpec, plan
from tessera_operator.power_planning import PowerPolicy
from tessera_operator.workload import generation_for

pytestmark = pytest.mark.operator

LLAMA_8B = ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256)
RENDEZVOUS = Rendezvous("10.0.0.1", 29400)


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
    # NTP per stage: the hit stage alone runs at TP 7, the healthy one keeps its 8 GPUs; the
    # replica runs at its limiting stage's pace.
    mixed = plan(_spec(pp=2, dp=1), _own_domains("a", "b"), {("a", 0)}).replicas[0]
    assert mixed.tp == 7 and mixed.degrees() == (7, 8) and mixed.limiting_stage == 0
    assert mixed.idle_gpus() == () and len(mixed.stage_gpus()[1]) == 8


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
    assert plan(_spec(mode=FailurePolicy.SPARE), nodes, {("a", 3)}).tp_layout == "8,8"
    # no spares for DROP
    assert plan(_spec(mode=FailurePolicy.DROP), nodes, {("a", 3)}).tp_layout == "8"
    # The NTP modes, too, prefer a healthy spare to a shrunk group.
    assert plan(_spec(), nodes, {("a", 3)}).tp_layout == "8,8"


def test_a_new_generation_follows_the_layout_only() -> None:
    nodes = _own_domains("a", "b", "c")
    healthy = plan(_spec(), nodes, set())
    first = generation_for(healthy, 16, RENDEZVOUS, None)
    assert first is not None and first.generation == 1
    assert generation_for(plan(_spec(), nodes, set()), 16, RENDEZVOUS, first) is None
    # A failure on the idle spare domain changes nothing the trainer sees.
    assert generation_for(plan(_spec(), nodes, {("c", 1)}), 16, RENDEZVOUS, first) is None
    hit = plan(_spec(), nodes, {("a", 1)})
    second = generation_for(hit, 16, RENDEZVOUS, first, at_step=5)
    assert second is not None and (second.generation, second.at_step) == (2, 5)
    assert hit.replicas[0].index == 0  # numbered by position


@pytest.mark.parametrize("mode", [FailurePolicy.NTP, FailurePolicy.SPARE])
def test_a_loss_keeps_the_replicas_its_survivors_form_and_plans_the_rest(mode) -> None:
    """A node lost whole: its replica's stand-in on the spare needs processes that do not run
    yet, so the generation after the loss keeps the survivors' replica alone and the spare
    joins by a planned generation (which the ranks switch to once its processes have come)."""
    nodes = _own_domains("a", "b", "c")
    first = generation_for(plan(_spec(mode=mode), nodes, set()), 16, RENDEZVOUS, None)
    assert first is not None and {g.node for g in first.gpus} == {"a", "b"}
    lost = {("a", i) for i in range(8)}
    hit = plan(_spec(mode=mode), nodes, lost)
    assert hit.tp_layout == "8,8"  # the spare stands in
    after_loss = generation_for(hit, 16, RENDEZVOUS, first, [Gpu(n, i) for n, i in lost],
                                at_step=5)
    assert after_loss is not None and after_loss.at_step is None
    assert after_loss.replicas == tuple(r for r in first.replicas if r[0].node == "b")
    assert None not in (after_loss.origin or ())  # nobody to wait for
    joined = generation_for(hit, 16, RENDEZVOUS, after_loss, at_step=5)
    assert joined is not None and joined.at_step == 5
    assert {g.node for g in joined.gpus} == {"b", "c"}
    assert sum(o is None for o in joined.origin or ()) == 8
    # Without a replica the survivors form alone, the loss's generation takes the spare at once.
    single = replace(_spec(mode=mode), dp=1)
    alone = generation_for(plan(single, nodes, set()), 16, RENDEZVOUS, None)
    assert alone is not None
    gone = {(alone.gpus[0].node, i) for i in range(8)}
    moved = generation_for(plan(single, nodes, gone), 16, RENDEZVOUS, alone,
                           [Gpu(n, i) for n, i in gone])
    assert moved is not None and moved.at_step is None and len(moved.gpus) == 8
    assert {g.node for g in moved.gpus}.isdisjoint({n for n, _ in gone})


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
    result = plan(_spec(mode=FailurePolicy.NTP_PW), _own_domains("a", "b"), {("a", 3)})
    targets = result.power_targets()
    a, b = targets["a"], targets["b"]
    watts = [a.watts_for(i) for i in range(8)]
    assert watts[3] == 200 and set(watts[:3] + watts[4:]) == {657}  # (4800 - 200) // 7
    assert sum(watts) <= 4800 and a.rack_budget_w == 4800
    assert b.gpu_w == {} and b.base_w == 600
    # Plain NTP manages power too, but never boosts.
    plain = plan(_spec(mode=FailurePolicy.NTP), _own_domains("a", "b"), {("a", 3)}).power_targets()
    assert {plain["a"].watts_for(i) for i in range(8) if i != 3} == {600}
    assert plan(_spec(power=None), _own_domains("a"), set()).power_targets() == {}


def test_the_boost_lands_on_the_degraded_stage_alone() -> None:
    # PP 2, DP 1: stage 0 (domain a) lost a GPU. The pipeline runs at its pace, so only a's
    # survivors are boosted; stage 1's domain b keeps its 8 GPUs at the base cap.
    result = plan(_spec(mode=FailurePolicy.NTP_PW, pp=2, dp=1), _own_domains("a", "b"),
                  {("a", 3)})
    replica = result.replicas[0]
    assert replica.limiting_stage == 0 and replica.power_ratio > 1.0
    assert result.rack_ratios() == {"a": replica.power_ratio, "b": 1.0}
    targets = result.power_targets()
    assert {targets["a"].watts_for(i) for i in range(8) if i != 3} == {657}
    assert targets["b"].gpu_w == {} and targets["b"].base_w == 600
    assert result.reachable_ratio(replica) == pytest.approx(657 / 600)


def test_a_rack_budget_below_the_gpus_minimum_is_a_spec_error() -> None:
    # 8 GPUs cannot go below 8 x 200 W: only the observed rack size shows it, so it is the
    # planner (not the schema) that must name the field.
    small = _spec(mode=FailurePolicy.NTP_PW, power=PowerPolicy(base_w=600, boost_cap_w=700,
                                                    rack_budget_w=1000))
    with pytest.raises(SpecError, match="rackBudgetWatts"):
        plan(small, _own_domains("a", "b"), {("a", 3)}).power_targets()


EXAMPLE_SPEC = {
    "image": "tessera-trainer:0.1.0",
    "model": {"hidden": 4096, "heads": 32, "kvHeads": 8, "ffn": 14336, "vocab": 128256,
              "layers": 32, "seqLen": 8192},
    "tensorParallelSize": 8, "dataParallelReplicas": 2, "totalGPUs": 16,
    "failurePolicy": {"mode": "NTP-PW", "minTensorParallelSize": 6},
    "powerPolicy": {"baseCapWatts": 600, "boostCapWatts": 700, "ramp": {"stepWatts": 25}},
}


def test_spec_reading_and_its_errors() -> None:
    spec = JobSpec.of(NTPTrainingJobSpec.from_spec(EXAMPLE_SPEC))
    assert (spec.tp, spec.dp, spec.pp, spec.min_tp, spec.mode) == (8, 2, 1, 6, "NTP-PW")
    assert spec.power == PowerPolicy(base_w=600, boost_cap_w=700, ramp_step_w=25)
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
            JobSpec.of(NTPTrainingJobSpec.from_spec(broken))
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
    # The trainer runs PP 1: the same GPUs as TP32 x DP1024 make its generation document.
    flat = plan(replace(spec, pp=1, dp=1024), nodes, failed)
    document = generation_for(flat, 1024, RENDEZVOUS, None)
    assert document is not None and len(document.gpus) == 32768 - 100
    text = json.dumps(document.to_dict(), separators=(",", ":"))
    assert len(text.encode()) < 1024 * 1024 * 0.8
    assert len(result.tp_layout) <= 4096


def test_tp_layout_runs_when_replicas_are_many() -> None:
    nodes = _own_domains(*(f"n{i:04d}" for i in range(3000)))
    result = plan(_spec(dp=3000), nodes, {("n1000", 0)})
    assert result.tp_layout == "8x1000,7,8x1999"
    assert plan(_spec(), _own_domains("a", "b"), set()).tp_layout == "8,8"


@pytest.mark.parametrize("seed", range(4))
def test_busiest_rank_from_counts_matches_the_unit_ids(seed: int) -> None:
    """The planner's slowdown comes from unit counts (bounded memory); tessera_core.plan's
    materialized unit ids are the reference, over random GQA shapes and every degree."""
    rng = random.Random(seed)
    for _ in range(20):
        kv, group = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4])
        heads = kv * group
        shape = ModelShape(hidden=heads * rng.choice([8, 64]), n_heads=heads, n_kv_heads=kv,
                           ffn=rng.randint(heads, 4000), vocab=rng.randint(heads, 4000),
                           seq_len=rng.choice([1, 128, 8192]))
        for tp in range(1, heads + 1):
            by_ids = tuple(layer_flops(shape, s) for s in plan_replica(shape, tp))
            assert rank_layer_flops(shape, tp) == by_ids


def test_survivors_of_a_group_too_small_to_run_go_to_the_minimum() -> None:
    # 5 survivors < minimum TP 6: the group runs nothing, so its GPUs hold the minimum and the
    # rack's budget is not spent on idle GPUs.
    failed = {("a", 0), ("a", 1), ("a", 2)}
    result = plan(_spec(mode=FailurePolicy.NTP_PW), _own_domains("a", "b"), failed)
    assert result.tp_layout == "8"
    a = result.power_targets()["a"]
    assert {a.watts_for(i) for i in range(8)} == {200}
    assert result.stranded == {("a", i) for i in range(3, 8)}


def test_a_rack_budget_beyond_every_gpu_at_the_cap_still_fits_a_target() -> None:
    # The schema allows 10 MW per rack; a GPUPowerTarget's node share only 320 kW. Watts no GPU
    # can draw are left out of the shares.
    huge = _spec(mode=FailurePolicy.NTP_PW, power=PowerPolicy(base_w=600, boost_cap_w=700,
                                                   rack_budget_w=10_000_000))
    targets = plan(huge, _own_domains("a"), {("a", 3)}).power_targets()
    assert targets["a"].budget_w == 8 * 700 == targets["a"].rack_budget_w
    assert parse_object(to_object(targets["a"]), "a") == targets["a"]


def _schema() -> dict:
    return api.job_schema()


def test_the_schema_and_the_planner_agree_on_every_bound() -> None:
    """What the API server accepts, the operator can plan and publish: the largest shape at the
    largest TP, the lowest caps, the largest rack budget, each with a failed GPU."""
    props = _schema()["properties"]
    power = props["powerPolicy"]["properties"]
    floor = PowerPolicy().min_w  # what failed and idle GPUs are set to
    assert power["baseCapWatts"]["minimum"] == power["boostCapWatts"]["minimum"] == floor
    assert power["rackBudgetWatts"]["minimum"] == floor
    model = {key: props["model"]["properties"][key]["maximum"]
             for key in ("hidden", "ffn", "vocab", "layers", "seqLen")}
    model["heads"] = model["kvHeads"] = props["model"]["properties"]["heads"]["maximum"]
    tp, per_node = props["tensorParallelSize"]["maximum"], props["gpusPerNode"]["maximum"]
    nodes = {f"n{i:02d}": "nvl" for i in range(tp // per_node)}
    for caps, budget in (((floor, floor), None),
                         ((floor, power["boostCapWatts"]["maximum"]),
                          power["rackBudgetWatts"]["maximum"])):
        spec = JobSpec.of(NTPTrainingJobSpec.from_spec({
            "image": "tessera-trainer:0.1.0", "model": model, "tensorParallelSize": tp,
            "dataParallelReplicas": 1, "gpusPerNode": per_node, "totalGPUs": tp,
            "failurePolicy": {"mode": "NTP-PW"},
            "powerPolicy": {"baseCapWatts": caps[0], "boostCapWatts": caps[1]}
            | ({} if budget is None else {"rackBudgetWatts": budget})}))
        result = plan(spec, nodes, {("n00", 0)})
        assert result.tp_layout == str(tp - 1)
        for node, target in result.power_targets().items():
            assert parse_object(to_object(target), node) == target
