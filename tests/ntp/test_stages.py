"""Pipeline stages' pure planning: balanced layer splits, per-stage layouts, the limiting stage."""

from __future__ import annotations

import itertools

import pytest
import yaml

from tessera_cli import plan as plan_cli
from tessera_contracts.api import JOB_KIND
from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_core.memory import LocalModel, Training, rank_memory
from tessera_core.perf_model import PAPER
from tessera_core.plan import plan_job
from tessera_core.stages import (
    PipelineLayout,
    StageCosts,
    bubble_ratio,
    in_flight,
    one_f_one_b,
    plan_pipeline,
    plan_stages,
    split_layers,
    stage_costs,
    stage_memory,
    stage_power,
)

pytestmark = pytest.mark.pipeline

SHAPE = ModelShape(hidden=64, n_heads=8, n_kv_heads=4, ffn=96, vocab=512, n_layers=6,
                   seq_len=16)


def _brute_force(shape: ModelShape, stages: int, costs: StageCosts, micro: int) -> int:
    """The least largest-stage bytes over every split, by enumeration."""
    best = None
    for cuts in itertools.combinations(range(1, shape.n_layers), stages - 1):
        bounds = (0, *cuts, shape.n_layers)
        worst = max(costs.stage_bytes((bounds[k], bounds[k + 1]), k, stages, micro)
                    for k in range(stages))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 8])
def test_split_is_the_least_largest_stage(stages: int, micro_batches: int) -> None:
    costs = stage_costs(SHAPE, 2, Training(), micro_batch=2)
    split = split_layers(SHAPE, stages, costs, micro_batches)
    assert [s for s, _ in split] == [0, *(e for _, e in split[:-1])]
    assert split[-1][1] == SHAPE.n_layers and all(e > s for s, e in split)
    worst = max(costs.stage_bytes(lay, k, stages, micro_batches) for k, lay in enumerate(split))
    assert worst == _brute_force(SHAPE, stages, costs, micro_batches)


def test_the_lm_head_and_the_embedding_shorten_their_stages() -> None:
    # A vocabulary far larger than a layer: the head's and embedding's stages take fewer layers.
    shape = ModelShape(hidden=64, n_heads=8, n_kv_heads=4, ffn=96, vocab=8192, n_layers=8,
                       seq_len=16)
    split = plan_stages(shape, 4, 1, Training(), local_batch=4)
    sizes = [e - s for s, e in split]
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes), split


def test_1f1b_keeps_more_activations_in_the_first_stages() -> None:
    assert [in_flight(k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight(k, 4, 2) for k in range(4)] == [2, 2, 2, 1]
    # Long sequences make activations dominate: the first stage, holding the most micro-batches
    # in flight, gets fewer layers than the last without the head counted against it.
    shape = ModelShape(hidden=64, n_heads=8, n_kv_heads=4, ffn=96, vocab=64, n_layers=8,
                       seq_len=2048)
    split = plan_stages(shape, 2, 1, Training(micro_batch=1), local_batch=8)
    assert split[0][1] - split[0][0] < split[1][1] - split[1][0], split


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(PlanError, match="between 1 and the 6 layers"):
        plan_stages(SHAPE, 7, 1, Training(), local_batch=2)


def test_each_stage_has_its_own_degree_and_the_replica_batch_follows_its_slowest_stage() -> None:
    layers = ((0, 2), (2, 6))
    pipe = plan_pipeline(SHAPE, layers, [(4, 3), (4, 4)], global_batch=14)
    assert pipe.degrees(0) == (4, 3) and pipe.degrees(1) == (4, 4)
    # Plain NTP: replica 0 runs at its slowest stage's TP 3, so 3:4 of the batch.
    assert [r.local_batch for r in pipe.stages[0].replicas] == [6, 8]
    assert [r.local_batch for r in pipe.stages[1].replicas] == [6, 8]
    # Stage 0's sync is the mixed TP 4 + TP 4 job's, stage 1's the TP 3 + TP 4 one's.
    assert pipe.stages[0].partitions == plan_job(SHAPE, (4, 4), 14).partitions
    assert pipe.stages[1].replicas[1].shards == plan_job(SHAPE, (3, 4), 14).replicas[1].shards
    assert pipe.world_size == 15
    assert [pipe.locate(g) for g in (0, 3, 4, 6, 7, 14)] == [
        (0, 0, 0), (0, 0, 3), (1, 0, 0), (1, 0, 2), (0, 1, 0), (1, 1, 3)]
    assert pipe.stage_world_ranks(1) == (4, 5, 6, 11, 12, 13, 14)
    assert PipelineLayout.from_dict(pipe.to_dict()) == pipe


def test_a_document_whose_stages_miss_a_layer_is_refused() -> None:
    doc = plan_pipeline(SHAPE, ((0, 2), (2, 6)), [(2, 2)], 4).to_dict()
    doc["stages"][1]["layers"] = [3, 6]
    with pytest.raises(PlanError, match="cover layers"):
        PipelineLayout.from_dict(doc)


# A vocabulary small against a layer's work, so that even stages balance.
NARROW = ModelShape(hidden=64, n_heads=8, n_kv_heads=4, ffn=96, vocab=64, n_layers=6, seq_len=16)


def test_the_degraded_stage_limits_its_replica_and_alone_is_boosted() -> None:
    layers = ((0, 3), (3, 6))
    healthy = stage_power(NARROW, layers, 8, (8, 8), cap_ratio=1.3)
    assert healthy.power_ratios == (1.0, 1.0)
    # The last stage also carries the LM head: it sets the healthy pace.
    assert healthy.limiting == 1
    hit = stage_power(NARROW, layers, 8, (6, 8), cap_ratio=1.3)
    assert hit.limiting == 0 and hit.slowdowns[0] > 1.0
    assert hit.power_ratios[1] == 1.0
    assert hit.power_ratios[0] == PAPER.ratio_for_slowdown(hit.slowdowns[0], 1.3) > 1.0


def test_a_light_stage_absorbs_a_loss_without_power() -> None:
    # Stage 0 has one layer of six: at TP 6 of 8 it is still faster than the healthy last stage.
    hit = stage_power(NARROW, ((0, 1), (1, 6)), 8, (6, 8), cap_ratio=1.3)
    assert hit.limiting == 1 and hit.power_ratios == (1.0, 1.0)


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (3, 5), (4, 2), (3, 1)])
def test_1f1b_runs_every_micro_batch_once_and_keeps_stages_in_flight(stages: int, micro: int
                                                                   ) -> None:
    for k in range(stages):
        order = one_f_one_b(k, stages, micro)
        assert sorted(order) == sorted([("B", i) for i in range(micro)]
                                       + [("F", i) for i in range(micro)])
        # A micro-batch's backward after its forward; the most forwards pending a backward is
        # what the memory plan counts for the stage.
        pending, most = set(), 0
        for kind, i in order:
            if kind == "F":
                pending.add(i)
            else:
                assert i in pending
                pending.remove(i)
            most = max(most, len(pending))
        assert most == in_flight(k, stages, micro)
    assert bubble_ratio(4, 12) == pytest.approx(3 / 15)


def test_stage_state_adds_up_to_the_memory_plans_rank() -> None:
    # One stage holds the whole model: its state is the memory plan's weights (less buffers),
    # gradients and optimizer state for rank 0 of the healthy replica; more stages split it.
    layout = plan_job(SHAPE, (2, 2), 8)
    rank = rank_memory(layout, 0, 0, Training())
    local = LocalModel.of(SHAPE, layout.replicas[0].shards[0])
    whole = stage_memory(SHAPE, 1, 2, Training(), local_batch=4)
    assert whole[0].state == rank.weights - local.buffers + rank.gradients + rank.optimizer
    split = stage_memory(SHAPE, 3, 2, Training(micro_batch=1), local_batch=4)
    assert sum(s.state for s in split) == whole[0].state
    assert [s.in_flight for s in split] == [3, 2, 1]


def test_tessera_plan_shows_each_stage(tmp_path, capsys) -> None:
    job = {"kind": JOB_KIND, "metadata": {"name": "pp"},
           "spec": {"image": "trainer", "model": {"hidden": 64, "heads": 8, "kvHeads": 4,
                                                  "ffn": 96, "vocab": 512, "layers": 6,
                                                  "seqLen": 16},
                    "tensorParallelSize": 2, "dataParallelReplicas": 2,
                    "pipelineParallelSize": 3, "totalGPUs": 12, "globalBatch": 8,
                    "microBatchSize": 1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert plan_cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    rows = stage_memory(SHAPE, 3, 2, Training(micro_batch=1), local_batch=4)
    for r in rows:
        assert (f"stage {r.stage}: layers {r.layers[0]}-{r.layers[1] - 1}, state" in out
                and f"(micro-batches in flight: {r.in_flight})" in out), out
