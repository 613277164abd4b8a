"""Optimizer state sharded across the replicas (`--sharded-state`) against the unsharded trainer
and the dense reference, on real trainer processes (gloo, CPU): a nonuniform TP3 + TP2 job
switching live to TP2 + TP3 (every unit's AdamW state moves to its new owner), then restored from
its sharded checkpoint onto TP2 + TP1.

Checked like tests/ntp/test_parity.py: the loss curve, every rank's weights against its slices of
the gathered checkpoint (exactly: the owner's update reached every holder), and the last step's
gathered state and the restored step's gradients against the dense step from the same checkpoint,
within the bound derived from the gradients' rounding (`adam_bound`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_parity import (
    SHAPE,
    ckpt_state,
    dense_excess,
    dense_run,
    dense_step_from,
    grad_bounds,
    local_excess,
    rank_dumps,
    run_layout,
    state_bounds,
)

from ntp.checkpoint import dense_state
from ntp.sharded_optimizer import LostOptimizerState, check_survives, exchange_routes
from tessera_core.plan import UNIT_KINDS, plan_job

pytestmark = pytest.mark.memory

BATCH = 10
BEFORE, AFTER, RESTORED = (3, 2), (2, 3), (2, 1)
SWITCH_AT, STEPS = 1, 3
SHARDED = ("--sharded-state",)


def switching_run(tmp: Path, extra: tuple[str, ...]) -> dict:
    """TP3 + TP2 for SWITCH_AT steps, then the same five processes as TP2 + TP3; saved every
    step."""
    tmp.mkdir(parents=True, exist_ok=True)
    switch = {"generation": 1, "at_step": SWITCH_AT, "origin": [0, 1, 2, 3, 4]}
    (tmp / "gen1.json").write_text(
        json.dumps(plan_job(SHAPE, AFTER, BATCH).to_dict() | switch))
    return run_layout(plan_job(SHAPE, BEFORE, BATCH), tmp, STEPS,
                      extra=("--layout-dir", str(tmp), "--save-every", "1", *extra))


def weights_of(dumps: list[dict]) -> list[dict]:
    return [{n: ts[0] for n, ts in dump.items()} for dump in dumps]


def test_sharded_state_trains_as_the_unsharded_trainer_through_a_relayout_and_a_restore(
    tmp_path,
):
    sharded = switching_run(tmp_path / "sharded", SHARDED)
    unsharded = switching_run(tmp_path / "unsharded", ())
    want = dense_run(BATCH, STEPS + 1)
    # 1. The loss curve: the unsharded trainer's, and the dense one.
    assert sharded["losses"] == pytest.approx(unsharded["losses"], rel=0, abs=1e-6)
    assert sharded["losses"] == pytest.approx(want["losses"][:STEPS], abs=1e-4)
    # 2. Every rank of both replicas holds exactly its slices of the gathered weights.
    after = plan_job(SHAPE, AFTER, BATCH)
    weights = sharded["ckpt"]["model"]
    dumps = weights_of(rank_dumps(tmp_path / "sharded", "state", after.world_size))
    exact = {n: torch.zeros_like(w) for n, w in weights.items()}
    assert local_excess(after, dumps, weights, exact) == 0
    # 3. The last step, on the moved state, is the dense step from the step before.
    before_last = dense_state(tmp_path / "sharded" / "ckpt" / f"step-{STEPS - 1:08d}")
    step = dense_step_from(before_last, BATCH)
    assert dense_excess(ckpt_state(sharded["ckpt"]), step["states"][0],
                        state_bounds(step)) <= 1
    # 4. Restored from the sharded checkpoint onto TP2 + TP1: the dense step from it, its
    #    gradients on every rank, and the state it saves.
    shutil.copytree(tmp_path / "sharded" / "ckpt", tmp_path / "restored" / "ckpt")
    layout = plan_job(SHAPE, RESTORED, BATCH)
    restored = run_layout(layout, tmp_path / "restored", 1, extra=("--resume", *SHARDED))
    assert restored["losses"] == pytest.approx(want["losses"][STEPS:], abs=1e-4)
    step = dense_step_from(sharded["ckpt"], BATCH)
    grads = step["grads"][0]
    assert local_excess(layout, restored["grads"], grads, grad_bounds(grads)) <= 1
    assert dense_excess(ckpt_state(restored["ckpt"]), step["states"][0],
                        state_bounds(step)) <= 1


def test_every_held_unit_is_owned_or_taken_from_its_one_owner():
    # The step's exchange plan on a nonuniform layout: what one rank sends another is what
    # that one takes from it, and each rank's held units are its owned ones plus those taken.
    layout = plan_job(SHAPE, BEFORE, BATCH)
    world, cpu = layout.world_size, torch.device("cpu")
    for kind in UNIT_KINDS:
        for layer in range(SHAPE.n_layers):
            plans = [exchange_routes(layout, g, kind, layer, cpu) for g in range(world)]
            for g, (_, owned, sends, takes) in enumerate(plans):
                held = layout.replicas[layout.locate(g)[0]].shards[layout.locate(g)[1]]
                taken = sum(0 if t is None else t.numel() for t in takes)
                assert owned.numel() + taken == len(held.units(kind)) * (
                    SHAPE.head_dim if kind.endswith("heads") else 1), (kind, layer, g)
                for h in range(world):
                    sent, their = sends[h], plans[h][3][g]
                    assert (sent is None) == (their is None), (kind, layer, g, h)
                    assert sent is None or sent.numel() == their.numel()


def test_a_layout_without_a_rank_that_kept_state_restores_instead():
    layout = plan_job(SHAPE, BEFORE, BATCH)
    check_survives(layout, [0, 1, 2, 3, 4])  # the same processes, any new layout
    check_survives(layout, [4, 3, 2, 1, 0, None])  # and a joiner
    with pytest.raises(LostOptimizerState, match="rank 4"):
        check_survives(layout, [0, 1, 2, 3])
