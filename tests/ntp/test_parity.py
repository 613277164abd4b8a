"""Nonuniform TP with mixed-TP data parallelism against a single-process dense model (gloo, CPU).

Each layout runs as real trainer processes; loss, every rank's local gradients (each unit, KV-head
copy and replicated norm against its slice of the dense gradient, sliced here by plain index
arithmetic), the loss curve, every rank's final weights and AdamW moments and the gathered
checkpoint are compared with a dense run on the same global batches.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch

from ntp.data import split_inputs, synthetic_batch
from ntp.launch import launch_local
from ntp.model import FLAVORS, build_model, cross_entropy_loss
from ntp.plan import JobLayout, RankShard, layout_from_shards, plan_job

pytestmark = pytest.mark.parity

ARGS = FLAVORS["debug"]  # 12 query heads, 4 KV heads, 2 layers
SHAPE = ARGS.shape()
STEPS = 30
LR = 1e-3
# Weights and moments after several AdamW steps: Adam divides by sqrt(v), so fp32 rounding on
# near-zero gradient elements is amplified to a fraction of one step's update (lr).
STATE_TOL = 5e-4
GRAD_TOL = 1e-5


@cache
def dense_run(global_batch: int, steps: int, max_grad_norm: float | None = None) -> dict:
    """The reference: one process, the full global batch, torch's own loss and clipping."""
    torch.manual_seed(0)
    model = build_model(ARGS, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    losses, grads, states = [], None, {}
    for step in range(steps):
        inputs, targets = split_inputs(
            synthetic_batch(ARGS.vocab_size, ARGS.max_seq_len, global_batch, step, 0)
        )
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states[step + 1] = {
            n: (
                p.detach().clone(),
                opt.state[p]["exp_avg"].clone(),
                opt.state[p]["exp_avg_sq"].clone(),
            )
            for n, p in model.named_parameters()
        }
    return {"losses": losses, "grads": grads, "states": states}


def state_err(ckpt: dict, dense: dict) -> float:
    """Worst relative error of a gathered checkpoint's weights and AdamW moments."""
    return max(
        rel_err(got, want)
        for n, (weight, exp_avg, exp_avg_sq) in dense.items()
        for got, want in (
            (ckpt["model"][n], weight),
            (ckpt["optimizer"]["exp_avg"][n], exp_avg),
            (ckpt["optimizer"]["exp_avg_sq"][n], exp_avg_sq),
        )
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise error relative to the tensor's largest magnitude."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# How each sharded parameter splits, written out here rather than taken from ntp.sharding:
# name (without "layers.N.") -> (unit kind, split dimension, rows or columns per unit).
HEAD = SHAPE.head_dim
SPLITS = {
    "attention.wq.weight": ("q_heads", 0, HEAD),
    "attention.wk.weight": ("kv_heads", 0, HEAD),
    "attention.wv.weight": ("kv_heads", 0, HEAD),
    "attention.wo.weight": ("q_heads", 1, HEAD),
    "feed_forward.w1.weight": ("mlp_cols", 0, 1),
    "feed_forward.w3.weight": ("mlp_cols", 0, 1),
    "feed_forward.w2.weight": ("mlp_cols", 1, 1),
    "tok_embeddings.weight": ("vocab_rows", 0, 1),
    "output.weight": ("vocab_rows", 0, 1),
}


def held_units(shard: RankShard, kind: str) -> list[int]:
    if kind == "kv_heads":  # a copy of the KV head of each query head held
        return sorted({h // SHAPE.group_size for h in shard.q_heads})
    return sorted(getattr(shard, kind))


def unit_pairs(name: str, got: torch.Tensor, want: torch.Tensor, shard: RankShard):
    """(local, dense) slice pairs of every unit a rank holds; the whole tensor if replicated."""
    split = SPLITS.get(name.split(".", 2)[2] if name.startswith("layers.") else name)
    if split is None:
        assert got.shape == want.shape, name
        yield got, want
        return
    kind, dim, size = split
    units = held_units(shard, kind)
    assert got.shape[dim] == len(units) * size, name
    for i, u in enumerate(units):
        yield got.narrow(dim, i * size, size), want.narrow(dim, u * size, size)


def local_err(layout: JobLayout, dumps: list[dict], dense: dict) -> float:
    """Worst error of every rank's local tensors against its own slices of the dense ones.

    `dumps[g]` maps names to global rank g's local tensor or tuple of tensors (weight and AdamW
    moments), `dense` names to the dense ones. Each unit (a head's rows or columns, an MLP column,
    a vocabulary row) is compared relative to its own largest magnitude, so a small unit cannot
    hide behind a large one; replicated parameters (norms) as whole tensors, on every rank.
    """
    worst = 0.0
    for replica in layout.replicas:
        for j, shard in enumerate(replica.shards):
            local = dumps[replica.global_rank(j)]
            assert local.keys() == dense.keys()
            for name, wants in dense.items():
                gots = local[name]
                if isinstance(wants, torch.Tensor):
                    gots, wants = [gots], [wants]
                for got, want in zip(gots, wants, strict=True):
                    for g, w in unit_pairs(name, got, want, shard):
                        worst = max(worst, rel_err(g, w))
    return worst


def rank_dumps(tmp: Path, prefix: str, world: int) -> list[dict]:
    """What each of `world` ranks dumped (`--dump`): grads-rank{g}.pt or state-rank{g}.pt."""
    return [torch.load(tmp / f"{prefix}-rank{g}.pt") for g in range(world)]


def run_layout(
    layout: JobLayout,
    tmp: Path,
    steps: int,
    init: Path | None = None,
    extra: tuple = (),
    **launch: object,
) -> dict:
    args = [
        "--flavor",
        "debug",
        "--steps",
        str(steps),
        "--lr",
        str(LR),
        "--out",
        str(tmp),
        "--save",
        str(tmp / "ckpt.pt"),
        "--bucket-elements",
        "3000",
        *extra,  # after the defaults, so that it may override them
    ]
    if init is not None:
        args += ["--init", str(init)]
    resumed = init is not None or "--resume" in extra
    if not resumed:
        args.append("--dump")
    # Short timeouts so that a hang fails the test within a couple of minutes.
    env = {"TESSERA_COLLECTIVE_TIMEOUT_S": "60", "TESSERA_RENDEZVOUS_TIMEOUT_S": "60"}
    env |= launch.pop("env", {})
    launch_local(layout, args, timeout_s=150, env=env, **launch)
    return {
        "losses": json.loads((tmp / "rank0.json").read_text())["losses"],
        "grads": [] if resumed else rank_dumps(tmp, "grads", layout.world_size),
        "ckpt": torch.load(tmp / "ckpt.pt"),
    }


def interleaved(tp: int, offset: int = 0) -> list[RankShard]:
    """Rank r holds every tp-th unit starting at (r + offset) % tp: nothing is contiguous."""
    return [
        RankShard.build(
            SHAPE,
            range((r + offset) % tp, SHAPE.n_heads, tp),
            range((r + offset) % tp, SHAPE.ffn, tp),
            range((r + offset) % tp, SHAPE.vocab, tp),
        )
        for r in range(tp)
    ]


# name -> (layout, extra trainer flags)
# name -> (layout, extra trainer flags)
LAYOUTS = {
    # 3500 dense elements per bucket: a cap that the ranks' local layer sizes straddle.
    "tp4+tp3, bucket cap between ranks' sizes": (
        lambda: plan_job(SHAPE, [4, 3], global_batch=14),
        ("--bucket-elements", "3500"),
    ),
    "tp4+tp3+tp2 (two reduced degrees), clipped at norm 0.5": (
        lambda: plan_job(SHAPE, [4, 3, 2], global_batch=18),
        ("--max-grad-norm", "0.5"),
    ),
    "tp5+tp2, 12 heads over 5 ranks (3,3,2,2,2)": (
        lambda: plan_job(SHAPE, [5, 2], global_batch=14),
        (),
    ),
    "uniform tp2+tp2, no exchange": (lambda: plan_job(SHAPE, [2, 2], global_batch=8), ()),
    "non-contiguous tp3+tp2 ntp-pw, sync after backward": (
        lambda: layout_from_shards(
            SHAPE, [interleaved(3), interleaved(2, offset=1)], global_batch=10, mode="ntp-pw"
        ),
        ("--no-overlap",),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_dense(name, tmp_path, capsys):
    make, extra = LAYOUTS[name]
    layout = make()
    got = run_layout(layout, tmp_path, STEPS, extra=extra)
    clip = float(extra[extra.index("--max-grad-norm") + 1]) if "--max-grad-norm" in extra else None
    want = dense_run(layout.global_batch, STEPS, clip)

    # 1. Loss, and every rank's gradients after one step: every unit, every KV-head copy and
    #    every replicated norm, on every rank of every replica.
    assert got["losses"][0] == pytest.approx(want["losses"][0], rel=1e-5)
    grad_err = local_err(layout, got["grads"], want["grads"])
    assert grad_err <= GRAD_TOL
    # 2. The loss curve over 30 AdamW steps.
    loss_err = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
    assert loss_err <= 1e-4
    assert want["losses"][-1] < want["losses"][0] - 0.05  # it actually trains
    # 3. Every rank's weights and AdamW moments at the end, and the gathered checkpoint.
    final = want["states"][STEPS]
    rank_state_err = local_err(layout, rank_dumps(tmp_path, "state", layout.world_size), final)
    assert rank_state_err <= STATE_TOL
    ckpt_err = state_err(got["ckpt"], final)
    assert ckpt_err <= STATE_TOL
    assert got["ckpt"]["optimizer"]["step"] == STEPS
    with capsys.disabled():
        print(
            f"\n[{name}] TP {layout.tp_degrees} batches {[r.local_batch for r in layout.replicas]}:"
            f" grad err per unit {grad_err:.2e}, loss err over {STEPS} steps {loss_err:.2e},"
            f" every rank's state per unit {rank_state_err:.2e}, checkpoint {ckpt_err:.2e}"
        )


def test_checkpoint_moves_between_layouts(tmp_path):
    # Train on one layout, gather, load the dense checkpoint into a different layout, continue.
    first = plan_job(SHAPE, [3, 2], global_batch=12)
    second = layout_from_shards(SHAPE, [interleaved(2), interleaved(4, offset=3)], 12, "ntp")
    a = run_layout(first, tmp_path / "a", steps=3)
    # Loading then gathering on another layout gives back exactly the same dense state.
    same = run_layout(second, tmp_path / "same", steps=0, init=tmp_path / "a" / "ckpt.pt")
    assert same["ckpt"]["optimizer"]["step"] == a["ckpt"]["optimizer"]["step"] == 3
    for got, want in (
        (same["ckpt"]["model"], a["ckpt"]["model"]),
        (same["ckpt"]["optimizer"]["exp_avg"], a["ckpt"]["optimizer"]["exp_avg"]),
        (same["ckpt"]["optimizer"]["exp_avg_sq"], a["ckpt"]["optimizer"]["exp_avg_sq"]),
    ):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
    # Checkpoint-restart style: resume from the job's own checkpoint path, saving every step.
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "ckpt.pt", tmp_path / "b" / "ckpt.pt")
    b = run_layout(second, tmp_path / "b", steps=3, extra=("--resume", "--save-every", "1"))
    want = dense_run(12, 6)
    assert a["losses"] + b["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert b["ckpt"]["optimizer"]["step"] == 6
    assert state_err(b["ckpt"], want["states"][6]) <= STATE_TOL


LOSS_AT_STEP_3 = {"generation": 1, "origin": [0, 1, 2, 3, 4, 5, 7]}  # old rank 6 is gone


def run_losing_rank_6(tmp: Path, steps: int, joiners: list | None = None) -> dict:
    """TP4 + TP4 where global rank 6 dies at the start of step 3; TP4 + TP3 takes over."""
    (tmp / "gen1.json").write_text(
        json.dumps(plan_job(SHAPE, [4, 3], global_batch=16).to_dict() | LOSS_AT_STEP_3)
    )
    return run_layout(
        plan_job(SHAPE, [4, 4], global_batch=16),
        tmp,
        steps=steps,
        extra=("--layout-dir", str(tmp), "--reconfigure-timeout", "60"),
        env={"TESSERA_FAULT_AT": "6:3", "TESSERA_COLLECTIVE_TIMEOUT_S": "8"},
        may_fail={6},
        joiners=joiners or [],
    )


def test_live_reconfiguration_after_a_gpu_loss(tmp_path):
    # The survivors re-form groups as TP4 + TP3 (generation 1), fetch the lost units and their
    # AdamW state from the DP peer, redo step 3 and go on: the loss curve is the dense one.
    got = run_losing_rank_6(tmp_path, steps=6)
    assert json.loads((tmp_path / "rank6.json").read_text())["generation"] == 1  # new rank 6
    assert not (tmp_path / "rank7.json").exists()
    want = dense_run(16, 6)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-4)
    assert state_err(got["ckpt"], want["states"][6]) <= STATE_TOL
    after = plan_job(SHAPE, [4, 3], global_batch=16)
    dumps = rank_dumps(tmp_path, "state", after.world_size)
    assert local_err(after, dumps, want["states"][6]) <= STATE_TOL


def test_a_returning_gpu_joins_without_a_restart(tmp_path):
    # After the loss (generation 1: TP4 + TP3 redoes step 3) the GPU comes back and a fresh
    # process joins at step 5 (generation 2: TP4 + TP4 again), receiving its units and AdamW
    # state from the others. The whole run equals the dense one.
    healed = plan_job(SHAPE, [4, 4], global_batch=16).to_dict()
    (tmp_path / "gen2.json").write_text(
        json.dumps(healed | {"generation": 2, "at_step": 5, "origin": [0, 1, 2, 3, 4, 5, 6, None]})
    )
    joiner = (
        ["--layout", str(tmp_path / "gen2.json"), "--join", "--steps", "2"],
        {"RANK": "7", "WORLD_SIZE": "8"},
    )
    got = run_losing_rank_6(tmp_path, steps=7, joiners=[joiner])
    want = dense_run(16, 7)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-4)
    joined = json.loads((tmp_path / "rank7.json").read_text())
    assert joined["generation"] == 2
    assert joined["losses"] == pytest.approx(want["losses"][5:], abs=1e-4)
    assert state_err(got["ckpt"], want["states"][7]) <= STATE_TOL
    healed_layout = JobLayout.from_dict(healed)
    dumps = rank_dumps(tmp_path, "state", healed_layout.world_size)  # the joiner's too
    assert local_err(healed_layout, dumps, want["states"][7]) <= STATE_TOL
