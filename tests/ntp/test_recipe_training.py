"""The training recipe in real trainer processes: the learning-rate schedule and the held-out
loss through a checkpoint restore equal an uninterrupted run's, the held-out loss is the dense
model's on the same sequences, and TensorBoard's own reader reads the run's curves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ntp.checkpoint import checkpoint_name, dense_state
from ntp.curves import DIRECTORY, EVAL_LOSS, GOODPUT, GRAD_NORM, LEARNING_RATE, LOSS, TOKENS_PER_S
from ntp.data import split_inputs, synthetic_batch
from ntp.evaluation import HELD_OUT_STEP
from ntp.initialize import dense_model
from ntp.launch import launch_local
from ntp.model import FLAVORS, cross_entropy_loss
from ntp.recipe import Schedule
from tessera_core.plan import plan_job

pytestmark = pytest.mark.parity

ARGS = FLAVORS["debug"]
LAYOUT = plan_job(ARGS.shape(), [2, 1], global_batch=6)
STEPS, EVERY, SAMPLES, LR = 8, 2, 5, 1e-3
RECIPE = ("--lr", str(LR), "--lr-schedule", "cosine", "--warmup-steps", "3",
          "--min-lr-ratio", "0.1", "--eval-every", str(EVERY), "--eval-samples", str(SAMPLES),
          "--micro-batch-size", "2")


def train(tmp: Path, steps: int, *extra: str) -> dict:
    """The job trained until it has done `steps` of STEPS; rank 0's record."""
    args = ["--until-step", str(steps), "--device", "cpu", "--out", str(tmp), "--save",
            str(tmp / "ckpt"), "--save-every", "4", "--resume", *RECIPE, *extra]
    env = {"TESSERA_COLLECTIVE_TIMEOUT_S": "60", "TESSERA_RENDEZVOUS_TIMEOUT_S": "60"}
    launch_local(LAYOUT, args, timeout_s=300, env=env)
    return json.loads((tmp / "rank0.json").read_text())


def keyed(record: dict, key: str) -> dict[int, float]:
    return {int(step): value for step, value in record[key].items()}


def test_the_schedule_and_held_out_loss_through_a_restore_are_an_uninterrupted_runs(tmp_path):
    whole = train(tmp_path / "whole", STEPS)
    # Another job stops at step 5; restarted, it resumes from its checkpoint of step 4 and
    # redoes step 5.
    train(tmp_path / "resumed", 5)
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / checkpoint_name(5))
    resumed = train(tmp_path / "resumed", STEPS)
    # 1. The schedule, a function of the step: warmup, then cosine to 0.1 of the peak.
    schedule = Schedule("cosine", warmup_steps=3, min_ratio=0.1)
    rates = keyed(whole, "learning_rates")
    assert rates == pytest.approx({s: LR * schedule.factor(s, STEPS) for s in range(STEPS)})
    assert keyed(resumed, "learning_rates") == {s: rates[s] for s in range(4, STEPS)}
    # 2. Losses and held-out losses after the restore are the uninterrupted run's.
    assert resumed["losses"] == pytest.approx(whole["losses"][4:], abs=1e-6)
    held_out = keyed(whole, "eval_losses")
    assert sorted(held_out) == [2, 4, 6, 8]
    assert keyed(resumed, "eval_losses") == pytest.approx({6: held_out[6], 8: held_out[8]},
                                                         abs=1e-6)
    # 3. The held-out loss is the dense model's, from the checkpoint of step 4, on the same
    #    sequences: the synthetic split no training step draws.
    dense = dense_model(ARGS)
    dense.load_state_dict(dense_state(tmp_path / "whole" / "ckpt" / checkpoint_name(4))["model"])
    inputs, targets = split_inputs(
        synthetic_batch(ARGS.vocab_size, ARGS.max_seq_len, SAMPLES, HELD_OUT_STEP, 0))
    with torch.no_grad():
        expected = cross_entropy_loss(dense(inputs), targets).item()
    assert held_out[4] == pytest.approx(expected, rel=1e-5)
    # 4. TensorBoard reads the curves beside the checkpoints: every step once, the redone step
    #    5 as the restored run took it.
    events = EventAccumulator(str(tmp_path / "resumed" / "ckpt" / DIRECTORY))
    events.Reload()
    curve = {tag: {e.step: e.value for e in events.Scalars(tag)}
             for tag in (LOSS, LEARNING_RATE, GRAD_NORM, TOKENS_PER_S, GOODPUT, EVAL_LOSS)}
    assert sorted(curve[LOSS]) == list(range(1, STEPS + 1))
    assert [curve[LOSS][s] for s in range(1, STEPS + 1)] == pytest.approx(whole["losses"],
                                                                         abs=1e-6)
    assert curve[LEARNING_RATE][5] == pytest.approx(rates[4])
    assert curve[GRAD_NORM][8] == pytest.approx(keyed(whole, "grad_norms")[7], rel=1e-5)
    assert all(v > 0 for v in curve[TOKENS_PER_S].values())
    assert all(0 < v <= 1 for v in curve[GOODPUT].values())
    assert curve[EVAL_LOSS] == pytest.approx(held_out, abs=1e-6)
