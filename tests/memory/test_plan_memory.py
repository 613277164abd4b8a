"""The memory plan's terms against independent counts: the parameters each rank's real model
shard holds (built on the meta device), the published size of Llama 3 70B, every unit's state
owned exactly once with sharded state, and the layouts each failure policy can reach."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import yaml

from ntp.model import ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.model_shape import ModelShape
from tessera_contracts.vocabulary import FailurePolicy
from tessera_core.memory import (
    GIB,
    RESERVE_FIXED,
    RESERVE_SHARE,
    Job,
    LocalModel,
    Training,
    activation_bytes,
    assess,
    fits,
    human,
    plan_inputs,
    plan_memory,
    rank_memory,
)
from tessera_core.plan import UNIT_KINDS, plan_job
from tessera_core.sharded_state import HEAD_KINDS, owned_elements, owned_units, owns_replicated
from tessera_dev import paths

pytestmark = pytest.mark.memory

LLAMA_70B = ModelShape(hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672, vocab=128256,
                       n_layers=80, seq_len=4096)
SMALL = ModelShape(hidden=96, n_heads=12, n_kv_heads=4, ffn=40, vocab=64, n_layers=2,
                   seq_len=16)


class _Solo:
    """apply_ntp asks its group only for its size inside collectives it does not run here."""


@pytest.mark.parametrize("degrees", [(4, 3), (3, 2, 2), (1,)])
def test_each_rank_holds_the_parameters_the_plan_counts(degrees):
    layout = plan_job(SMALL, degrees, 12)
    args = ModelArgs.of_shape(SMALL)
    for rep in layout.replicas:
        for shard in rep.shards:
            with torch.device("meta"):
                model = Transformer(args)
            apply_ntp(model, shard, _Solo())
            held = sum(p.numel() for p in model.parameters())
            assert LocalModel.of(SMALL, shard).elements == held


def test_seventy_billion_at_tp8_is_sixteen_bytes_a_parameter_of_the_published_size():
    # Llama 3 70B: 70.55e9 parameters (Meta's model card: 70B; the config's arithmetic gives
    # 70,553,706,496). fp32 weights, gradients and two moments: 16 bytes each, 1/8 per rank.
    published = 70_553_706_496
    layout = plan_job(LLAMA_70B, [8], 8)
    memory = rank_memory(layout, 0, 0, Training())
    states = memory.weights + memory.gradients + memory.optimizer
    assert states == pytest.approx(16 * published / 8, rel=0.01)
    assert states > 80e9  # the point: it cannot fit an 80 GB H100 as it is


@pytest.mark.parametrize("degrees", [(4, 4), (4, 3, 2), (3, 3, 3, 1)])
def test_sharded_state_owns_every_unit_once_and_about_one_rank_share_each(degrees):
    layout = plan_job(SMALL, degrees, 16)
    world = layout.world_size
    owners: dict[tuple[str, int, int], int] = {}
    replicated: dict[int, int] = {}
    for rep in layout.replicas:
        for j, shard in enumerate(rep.shards):
            for layer in range(SMALL.n_layers):
                owned = owned_units(layout, rep.index, j, layer)
                for kind in UNIT_KINDS:
                    assert set(owned.units(kind)) <= set(shard.units(kind))  # held where owned
                    for u in owned.units(kind):
                        key = (kind, layer if kind in HEAD_KINDS else 0, u)
                        if key not in owners:
                            owners[key] = rep.global_rank(j)
                        assert owners[key] == rep.global_rank(j), f"{key} owned twice"
            for i in range(2 * SMALL.n_layers + 1):
                if owns_replicated(layout, rep.index, j, i):
                    assert i not in replicated
                    replicated[i] = rep.global_rank(j)
    for kind in UNIT_KINDS:
        for layer in range(SMALL.n_layers) if kind in HEAD_KINDS else [0]:
            got = {u for k, at, u in owners if k == kind and at == layer}
            assert got == set(range(SMALL.unit_count(kind)))
    assert set(replicated) == set(range(2 * SMALL.n_layers + 1))
    # Every element's state is kept once: the owned elements add up to the model.
    total = sum(owned_elements(layout, rep.index, j)
                for rep in layout.replicas for j in range(rep.tp))
    assert total == LocalModel.of(SMALL, plan_job(SMALL, [1], 1).replicas[0].shards[0]).elements
    # Each replica owns in proportion to its degree.
    for rep in layout.replicas:
        share = sum(owned_elements(layout, rep.index, j) for j in range(rep.tp))
        assert share / total == pytest.approx(rep.tp / world, abs=0.1)


def test_sharded_optimizer_state_per_rank_is_about_one_over_dp():
    shape = ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256,
                       n_layers=32, seq_len=8192)
    for dp in (2, 8):
        layout = plan_job(shape, [8] * dp, 8 * dp)
        for rank in (0, 3, 7):
            whole = rank_memory(layout, 0, rank, Training()).optimizer
            for replica in range(dp):
                part = rank_memory(layout, replica, rank, Training(sharded_state=True)).optimizer
                # Heads are owned whole, layer by layer: a rank's 5 heads x 32 layers split over
                # DP replicas can be a few head-layers (0.8% of its share each at DP 8) off.
                assert part == pytest.approx(whole / dp, rel=0.1)


def test_micro_batches_and_checkpointing_shrink_the_activations_and_the_peak():
    shape = ModelShape(hidden=1024, n_heads=16, n_kv_heads=4, ffn=4096, vocab=32000,
                       n_layers=8, seq_len=2048)
    layout = plan_job(shape, [4, 4], 32)
    whole = rank_memory(layout, 0, 0, Training())
    micro = rank_memory(layout, 0, 0, Training(micro_batch=2))
    assert micro.activations == pytest.approx(whole.activations * 2 / 16, rel=0.01)
    assert micro.peak < whole.peak
    local = LocalModel.of(shape, layout.replicas[0].shards[0])
    tokens = 2 * shape.seq_len
    none, selective, full = (
        activation_bytes(local, Training(checkpointing=mode), tokens, shape.seq_len)
        for mode in ("none", "selective", "full")
    )
    assert full < selective < none
    # Selective every 2: half the layers keep everything, half only their input.
    assert selective == (none + full) // 2


def test_each_policy_reaches_its_own_layouts():
    def names(mode: FailurePolicy, tp: int, dp: int, min_tp: int) -> list[tuple[int, ...]]:
        return [r.degrees for r in Job(SMALL, tp, dp, 16, mode, min_tp).layouts()]

    assert names(FailurePolicy.NTP, 4, 2, 2) == [(4, 4), (4, 2), (3, 2), (2, 2)]
    assert names(FailurePolicy.NTP_PW, 4, 1, 3) == [(4,), (3,)]
    assert names(FailurePolicy.DROP, 4, 3, 2) == [(4, 4, 4), (4, 4), (4,)]
    assert names(FailurePolicy.CKPT_RESTART, 4, 3, 2) == [(4, 4, 4)]


def test_a_degraded_rank_needs_more_than_a_healthy_one():
    job = Job(ModelShape(hidden=512, n_heads=8, n_kv_heads=8, ffn=2048, vocab=8000,
                         n_layers=4, seq_len=512), 8, 2, 16, FailurePolicy.NTP, 4)
    plans = plan_memory(job, Training(micro_batch=1))
    peaks = [max(r.peak for r in m.ranks) for m in plans]
    assert peaks == sorted(peaks)
    healthy, lowest = plans[0].ranks[0], plans[-1].ranks[-1]
    assert lowest.weights == pytest.approx(healthy.weights * 8 / 4, rel=0.05)
    assert math.isclose(lowest.tp, 4)


def test_a_gpu_that_holds_the_healthy_layout_but_not_the_lowest_raises_the_minimum_tp():
    job = Job(ModelShape(hidden=512, n_heads=8, n_kv_heads=8, ffn=2048, vocab=8000,
                         n_layers=4, seq_len=512), 8, 2, 16, FailurePolicy.NTP, 4)
    training = Training(micro_batch=1)
    plans = plan_memory(job, training)
    needs = [max(r.most for r in m.ranks) for m in plans]
    # The first row that needs more than every row before it, and a GPU between the two.
    cut = next(i for i in range(1, len(needs)) if needs[i] > max(needs[:i]))
    room = (max(needs[:cut]) + needs[cut]) // 2
    gpu = int(room * (1 + RESERVE_SHARE)) + RESERVE_FIXED + 1
    assessed = assess(job, training, gpu)
    assert assessed.fits and job.min_tp < assessed.min_tp <= plans[cut - 1].reachable.tp
    # the least minimum whose every reachable layout fits
    assert all(fits(m, gpu) for m in plan_memory(replace(job, min_tp=assessed.min_tp), training))
    lower = replace(job, min_tp=assessed.min_tp - 1)
    assert not all(fits(m, gpu) for m in plan_memory(lower, training))
    line = assessed.message(job)
    assert f"layout {plans[cut].reachable.name} needs {human(needs[cut])}" in line
    if assessed.min_tp > job.min_tp:
        assert f"fits down to TP {assessed.min_tp}, not {job.min_tp}" in line
    tight = assess(job, training, RESERVE_FIXED + needs[0] // 2)
    assert not tight.fits and tight.min_tp is None
    assert tight.message(job).startswith("does not fit: layout 8,8 needs")


def test_the_effective_minimum_tp_is_the_least_whose_every_layout_fits():
    """60 GiB GPUs hold the 8B example's TP 7 ranks but not a TP 6 rank: its rows at minimum 6
    mix degrees ("8,6"), yet at minimum 7 every layout fits, so the minimum is 7, not 8."""
    example = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-small.yaml")
                             .read_text())
    job, training = plan_inputs(NTPTrainingJobSpec.from_spec(example["spec"]))
    gpu = 60 * GIB
    assert job.min_tp == 6
    assessed = assess(job, training, gpu)
    assert assessed.min_tp == 7
    seven, six = replace(job, min_tp=7), replace(job, min_tp=6)
    assert all(fits(m, gpu) for m in plan_memory(seven, training))
    assert not all(fits(m, gpu) for m in plan_memory(six, training))
    assert "the effective minimum TP is 7" in assessed.message(job)
