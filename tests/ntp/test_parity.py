"""Nonuniform TP with mixed-TP data parallelism against a single-process dense model (gloo, CPU).

Each layout runs as real trainer processes. Compared with the dense model on the same global
batches: the loss curve; every rank's local gradients at the first and the last step (each unit,
KV-head copy and replicated norm against its slice of the dense gradient, sliced here by plain
index arithmetic); every rank's weights and AdamW moments, which must equal their slices of the
gathered checkpoint; and the last step's weights and moments, every rank's and gathered, against
the dense step from the same checkpoint within a bound derived from the gradients' rounding
(`adam_bound`). The dense model itself is checked against an independent reference in
test_model.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest
import torch
from adam_bound import adamw_state_bounds

from ntp.checkpoint import dense_state, latest
from ntp.data import split_inputs, synthetic_batch
from ntp.initialize import dense_model
from ntp.launch import launch_local
from ntp.model import FLAVORS, ModelArgs, Transformer, cross_entropy_loss
from tessera_core.plan import JobLayout, RankShard, layout_from_shards, plan_job

pytestmark = pytest.mark.parity

ARGS = FLAVORS["debug"]  # 12 query heads, 4 KV heads, 2 layers
SHAPE = ARGS.shape()
STEPS = 30
LR = 1e-3
WEIGHT_DECAY = 0.1  # the trainer's
BETAS, EPS = (0.9, 0.999), 1e-8  # torch's AdamW defaults, which the trainer keeps
# A synchronized gradient's error relative to the largest magnitude in its unit (measured up to
# 1.3e-6: float32 sums in another order and split over ranks).
GRAD_TOL = 1e-5


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's AdamW as the trainer's recipe sets it: weight decay on the weight matrices, none
    on norm gains and the token embedding."""
    named = list(model.named_parameters())
    kept = [p for n, p in named if p.dim() < 2 or n == "tok_embeddings.weight"]
    decayed = [p for n, p in named if not (p.dim() < 2 or n == "tok_embeddings.weight")]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": kept, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False,
    )


def dense_steps(
    model: Transformer,
    opt: torch.optim.Optimizer,
    first: int,
    steps: int,
    global_batch: int,
    max_grad_norm: float | None,
    replicas: Sequence[int] = (),
) -> dict:
    """Steps first..first+steps-1 on the global batch, with torch's own loss and clipping: the
    loss, the (clipped) gradient and the state after each step. With `replicas` (local batch
    sizes), the gradient is summed as data parallelism does: each slice's mean weighted by its
    share of the batch."""
    args = model.args
    losses, grads, states = [], [], []
    for step in range(first, first + steps):
        inputs, targets = split_inputs(
            synthetic_batch(args.vocab_size, args.max_seq_len, global_batch, step, 0)
        )
        loss, offset = 0.0, 0
        for size in replicas or [global_batch]:
            rows = slice(offset, offset + size)
            part = cross_entropy_loss(model(inputs[rows]), targets[rows]) * (size / global_batch)
            part.backward()
            loss, offset = loss + part.item(), offset + size
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        states.append(
            {
                n: (
                    p.detach().clone(),
                    opt.state[p]["exp_avg"].clone(),
                    opt.state[p]["exp_avg_sq"].clone(),
                )
                for n, p in model.named_parameters()
            }
        )
    return {"losses": losses, "grads": grads, "states": states}


@cache
def dense_run(global_batch: int, steps: int, max_grad_norm: float | None = None) -> dict:
    """The reference from the seeded initial weights."""
    torch.manual_seed(0)
    model = dense_model(ARGS, seed=0)
    return dense_steps(model, adamw(model), 0, steps, global_batch, max_grad_norm)


def dense_step_from(
    ckpt: dict,
    global_batch: int,
    max_grad_norm: float | None = None,
    args: ModelArgs = ARGS,
    replicas: Sequence[int] = (),
) -> dict:
    """One dense step from a gathered checkpoint's weights and AdamW state.

    Two runs that differ by rounding drift apart over several AdamW steps: an element whose
    gradient is as small as its rounding error gets a whole step (lr) of either sign, and the
    next step's gradients, everywhere, differ far beyond rounding (two dense runs of the bench
    flavor summing the batch in another order: 4.7e-4 of a unit's largest gradient at the
    second step, 1.4e-3 within 30). So state is compared one step away from a common state,
    where the difference is bounded from the gradients' rounding alone (`adam_bound`), for any
    shape.
    """
    model = dense_model(args, seed=0)
    model.load_state_dict(ckpt["model"])
    opt = adamw(model)
    step = int(ckpt["optimizer"]["step"])
    for n, p in model.named_parameters():
        opt.state[p] = {
            "step": torch.tensor(float(step)),
            **{m: ckpt["optimizer"][m][n].clone() for m in ("exp_avg", "exp_avg_sq")},
        }
    taken = dense_steps(model, opt, step, 1, global_batch, max_grad_norm, replicas)
    return taken | {"first_step": step + 1}


def ckpt_state(ckpt: dict) -> dict:
    """A gathered checkpoint as name -> (weight, exp_avg, exp_avg_sq)."""
    moments = ckpt["optimizer"]
    return {
        n: (w, moments["exp_avg"][n], moments["exp_avg_sq"][n]) for n, w in ckpt["model"].items()
    }


# How each sharded parameter splits, written out here rather than taken from ntp.sharding:
# name (without "layers.N.") -> (unit kind, split dimension); a head is head_dim rows or columns.
SPLITS = {
    "attention.wq.weight": ("q_heads", 0),
    "attention.wk.weight": ("kv_heads", 0),
    "attention.wv.weight": ("kv_heads", 0),
    "attention.wo.weight": ("q_heads", 1),
    "feed_forward.w1.weight": ("mlp_cols", 0),
    "feed_forward.w3.weight": ("mlp_cols", 0),
    "feed_forward.w2.weight": ("mlp_cols", 1),
    "tok_embeddings.weight": ("vocab_rows", 0),
    "output.weight": ("vocab_rows", 0),
}


def split_of(name: str, head_dim: int = SHAPE.head_dim) -> tuple[str, int, int] | None:
    """(unit kind, split dimension, rows or columns per unit), None if replicated."""
    split = SPLITS.get(name.split(".", 2)[2] if name.startswith("layers.") else name)
    if split is None:
        return None
    kind, dim = split
    return kind, dim, head_dim if kind.endswith("heads") else 1


def unit_max(name: str, dense: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each element's unit's largest magnitude (the whole tensor's if replicated)."""
    split = split_of(name, head_dim)
    if split is None:
        return dense.abs().amax().expand_as(dense)
    _, dim, size = split
    units = dense.abs().movedim(dim, 0).unflatten(0, (-1, size))
    peaks = units.flatten(1).amax(1).view(-1, *[1] * (units.dim() - 1))
    return peaks.expand_as(units).flatten(0, 1).movedim(0, dim)


def grad_bounds(grads: dict, head_dim: int = SHAPE.head_dim) -> dict:
    return {n: GRAD_TOL * unit_max(n, g, head_dim) for n, g in grads.items()}


def state_bounds(run: dict, head_dim: int = SHAPE.head_dim) -> dict:
    """Bounds on a state one step from a common one (`dense_step_from`), given the gradients'
    rounding bound."""
    errors = [grad_bounds(g, head_dim) for g in run["grads"]]
    return adamw_state_bounds(run["states"], errors, LR, BETAS, EPS, first_step=run["first_step"])


def excess(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor) -> float:
    """Largest elementwise |got - want| as a fraction of what is allowed (0 allowed: exact)."""
    diff = (got.double() - want.double()).abs()
    return float((diff / allowed.double().clamp_min(1e-300)).max())


def dense_excess(got: dict, want: dict, allowed: dict) -> float:
    """`excess` over whole dense tensors (or tuples of them), every name."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name, wants in want.items():
        gots, alloweds = got[name], allowed[name]
        if isinstance(wants, torch.Tensor):
            gots, wants, alloweds = [gots], [wants], [alloweds]
        for g, w, a in zip(gots, wants, alloweds, strict=True):
            assert g.shape == w.shape, name
            worst = max(worst, excess(g, w, a))
    return worst


def held_units(shard: RankShard, kind: str) -> list[int]:
    if kind == "kv_heads":  # a copy of the KV head of each query head held
        return sorted({h // SHAPE.group_size for h in shard.q_heads})
    return sorted(getattr(shard, kind))


def unit_slices(name: str, shard: RankShard, local: torch.Tensor, *dense: torch.Tensor):
    """(local, *dense) slices of every unit a rank holds; the whole tensors if replicated."""
    split = split_of(name)
    if split is None:
        assert all(local.shape == d.shape for d in dense), name
        yield (local, *dense)
        return
    kind, dim, size = split
    units = held_units(shard, kind)
    assert local.shape[dim] == len(units) * size, name
    for i, u in enumerate(units):
        yield (local.narrow(dim, i * size, size), *(d.narrow(dim, u * size, size) for d in dense))


def local_excess(
    layout: JobLayout,
    dumps: list[dict],
    dense: dict,
    allowed: dict,
) -> float:
    """Worst `excess` of every rank's local tensors against its own slices of the dense ones.

    `dumps[g]` maps names to global rank g's local tensor or tuple of tensors (weight and AdamW
    moments), `dense` and `allowed` names to the dense ones and their elementwise bounds. Every
    unit a rank holds is compared (a head's rows or columns, KV-head copies included, an MLP
    column, a vocabulary row), and replicated parameters (norms) on every rank of every replica.
    """
    worst = 0.0
    for replica in layout.replicas:
        for j, shard in enumerate(replica.shards):
            local = dumps[replica.global_rank(j)]
            assert local.keys() == dense.keys()
            for name, wants in dense.items():
                gots, alloweds = local[name], allowed[name]
                if isinstance(wants, torch.Tensor):
                    gots, wants, alloweds = [gots], [wants], [alloweds]
                for got, want, bound in zip(gots, wants, alloweds, strict=True):
                    for g, w, a in unit_slices(name, shard, got, want, bound):
                        worst = max(worst, excess(g, w, a))
    return worst


def exactly(dense: dict) -> dict:
    """Zero allowed error for every tensor."""
    return {n: tuple(torch.zeros_like(t) for t in ts) for n, ts in dense.items()}


def rank_dumps(tmp: Path, prefix: str, world: int) -> list[dict]:
    """What each of `world` ranks dumped (`--dump`): grads-rank{g}.pt or state-rank{g}.pt."""
    return [torch.load(tmp / f"{prefix}-rank{g}.pt") for g in range(world)]


def run_layout(
    layout: JobLayout,
    tmp: Path,
    steps: int,
    init: Path | None = None,
    extra: tuple = (),
    dump: bool = True,
    **launch: object,
) -> dict:
    """Run the trainer on `layout`; with `dump` (and steps), every rank's gradients of the first
    step run come back too, and each rank's state at the end is left in `tmp`."""
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
        str(tmp / "ckpt"),
        "--bucket-elements",
        "3000",
        *extra,  # after the defaults, so that it may override them
    ]
    if init is not None:
        args += ["--init", str(init)]
    if dump:
        args.append("--dump")
    # Short timeouts so that a hang fails the test within a couple of minutes.
    env = {"TESSERA_COLLECTIVE_TIMEOUT_S": "60", "TESSERA_RENDEZVOUS_TIMEOUT_S": "60"}
    env |= launch.pop("env", {})
    launch_local(layout, args, timeout_s=150, env=env, **launch)
    return {
        "losses": json.loads((tmp / "rank0.json").read_text())["losses"],
        "ckpt": dense_state(latest(tmp / "ckpt")),
        "grads": rank_dumps(tmp, "grads", layout.world_size) if dump and steps else [],
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
    # 8 + 6 rows in micro-batches of 3 (the last of each replica short), every layer recomputed
    "tp4+tp3, micro-batches of 3, full activation checkpointing": (
        lambda: plan_job(SHAPE, [4, 3], global_batch=14),
        ("--micro-batch-size", "3", "--activation-checkpointing", "full"),
    ),
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
    clip = float(extra[extra.index("--max-grad-norm") + 1]) if "--max-grad-norm" in extra else None
    # STEPS - 1 steps, then the last one as a run of its own from that run's checkpoint
    got = run_layout(layout, tmp_path / "a", STEPS - 1, extra=extra)
    last = run_layout(layout, tmp_path / "b", 1, init=tmp_path / "a" / "ckpt", extra=extra)
    want = dense_run(layout.global_batch, STEPS, clip)

    # 1. Loss, and every rank's gradients after one step: every unit, every KV-head copy and
    #    every replicated norm, on every rank of every replica.
    assert got["losses"][0] == pytest.approx(want["losses"][0], rel=1e-5)
    grad_err = local_excess(layout, got["grads"], want["grads"][0], grad_bounds(want["grads"][0]))
    assert grad_err <= 1
    # 2. The loss curve over all the steps.
    losses = got["losses"] + last["losses"]
    loss_err = max(abs(a - b) for a, b in zip(losses, want["losses"], strict=True))
    assert loss_err <= 1e-4
    assert want["losses"][-1] < want["losses"][0] - 0.05  # it actually trains
    # 3. Every rank holds exactly its slices of the weights and AdamW moments gathered from
    #    replica 0: KV-head copies, replicas and replicated norms never drift apart, clipped
    #    replicas included (they all scale by replica 0's norm).
    gathered = ckpt_state(got["ckpt"])
    states = rank_dumps(tmp_path / "a", "state", layout.world_size)
    assert local_excess(layout, states, gathered, exactly(gathered)) == 0
    # 4. The last step against the dense step from the same checkpoint: every rank's gradients,
    #    then its weights and moments and the gathered checkpoint, within the bound the
    #    gradients' rounding allows through AdamW.
    assert last["ckpt"]["optimizer"]["step"] == STEPS
    step = dense_step_from(got["ckpt"], layout.global_batch, clip)
    last_grad_err = local_excess(
        layout, last["grads"], step["grads"][0], grad_bounds(step["grads"][0])
    )
    assert last_grad_err <= 1
    bounds = state_bounds(step)
    states = rank_dumps(tmp_path / "b", "state", layout.world_size)
    rank_state_err = local_excess(layout, states, step["states"][0], bounds)
    assert rank_state_err <= 1
    ckpt_err = dense_excess(ckpt_state(last["ckpt"]), step["states"][0], bounds)
    assert ckpt_err <= 1
    with capsys.disabled():
        print(
            f"\n[{name}] TP {layout.tp_degrees} batches {[r.local_batch for r in layout.replicas]}:"
            f" loss err over {STEPS} steps {loss_err:.2e}; share of the bounds used:"
            f" grads at step 1 {grad_err:.3f}, at step {STEPS} {last_grad_err:.3f},"
            f" every rank's state {rank_state_err:.3f}, checkpoint {ckpt_err:.3f}"
        )


# outside every other parity test: 10 query heads on 2 KV heads, a prime vocabulary, 3 layers
OUTSIDE = ModelArgs(
    dim=40, n_layers=3, n_heads=10, n_kv_heads=2, ffn_dim=52, vocab_size=61, max_seq_len=11
)


@pytest.mark.parametrize(
    ("args", "replicas"),
    [(ARGS, (8, 6)), (OUTSIDE, (9, 3, 2))],
    ids=["debug flavor, 8+6", "10q/2kv heads, vocab 61, 9+3+2"],
)
def test_the_state_bound_holds_for_another_summation_order(args, replicas):
    # Two single-process steps from one trained state that differ only in how the batch is
    # summed (whole, or in data-parallel slices): gradients within GRAD_TOL of each unit, weights
    # and AdamW moments within the derived bound, on shapes of their own.
    global_batch = sum(replicas)
    model = dense_model(args, seed=0)
    state = dense_steps(model, adamw(model), 0, 10, global_batch, None)["states"][-1]
    ckpt = {
        "model": {n: w for n, (w, _, _) in state.items()},
        "optimizer": {
            "exp_avg": {n: m for n, (_, m, _) in state.items()},
            "exp_avg_sq": {n: v for n, (_, _, v) in state.items()},
            "step": 10,
        },
    }
    whole = dense_step_from(ckpt, global_batch, args=args)
    split = dense_step_from(ckpt, global_batch, args=args, replicas=replicas)
    head_dim = args.dim // args.n_heads
    grads = whole["grads"][0]
    assert any(not torch.equal(split["grads"][0][n], g) for n, g in grads.items())
    assert dense_excess(split["grads"][0], grads, grad_bounds(grads, head_dim)) <= 1
    bounds = state_bounds(whole, head_dim)
    assert dense_excess(split["states"][0], whole["states"][0], bounds) <= 1


def test_checkpoint_moves_between_layouts(tmp_path):
    # Train on one layout, save sharded, load into a different layout, continue.
    first = plan_job(SHAPE, [3, 2], global_batch=12)
    second = layout_from_shards(SHAPE, [interleaved(2), interleaved(4, offset=3)], 12, "ntp")
    a = run_layout(first, tmp_path / "a", steps=3)
    # Loading then gathering on another layout gives back exactly the same dense state, which
    # every rank holds.
    same = run_layout(second, tmp_path / "same", steps=0, init=tmp_path / "a" / "ckpt")
    assert same["ckpt"]["optimizer"]["step"] == a["ckpt"]["optimizer"]["step"] == 3
    gathered = ckpt_state(a["ckpt"])
    assert dense_excess(ckpt_state(same["ckpt"]), gathered, exactly(gathered)) == 0
    states = rank_dumps(tmp_path / "same", "state", second.world_size)
    assert local_excess(second, states, gathered, exactly(gathered)) == 0
    # Checkpoint-restart style: resume from the job's own checkpoint path, saving every step;
    # the step taken is the dense step from that checkpoint.
    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")
    b = run_layout(
        second, tmp_path / "b", steps=1, extra=("--resume", "--save-every", "1"), dump=False
    )
    assert a["losses"] + b["losses"] == pytest.approx(dense_run(12, 4)["losses"], abs=1e-5)
    assert b["ckpt"]["optimizer"]["step"] == 4
    step = dense_step_from(a["ckpt"], 12)
    assert dense_excess(ckpt_state(b["ckpt"]), step["states"][0], state_bounds(step)) <= 1


LOSS_AT_STEP_3 = {"generation": 1, "origin": [0, 1, 2, 3, 4, 5, 7]}  # old rank 6 is gone


def run_losing_rank_6(
    tmp: Path, steps: int, joiners: list | None = None, extra: tuple[str, ...] = ()
) -> dict:
    """TP4 + TP4 where global rank 6 dies at the start of step 3; TP4 + TP3 takes over."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "gen1.json").write_text(
        json.dumps(plan_job(SHAPE, [4, 3], global_batch=16).to_dict() | LOSS_AT_STEP_3)
    )
    return run_layout(
        plan_job(SHAPE, [4, 4], global_batch=16),
        tmp,
        steps=steps,
        extra=("--layout-dir", str(tmp), "--reconfigure-timeout", "60", *extra),
        faults={6: 3},
        may_fail={6},
        joiners=joiners or [],
    )


def test_live_reconfiguration_after_a_gpu_loss(tmp_path):
    # The survivors re-form groups as TP4 + TP3 (generation 1), fetch the lost units and their
    # AdamW state from the DP peer, redo step 3 and go on: the loss curve is the dense one.
    got = run_losing_rank_6(tmp_path, steps=6)
    assert json.loads((tmp_path / "rank6.json").read_text())["generation"] == 1  # new rank 6
    assert not (tmp_path / "rank7.json").exists()
    assert got["losses"] == pytest.approx(dense_run(16, 6)["losses"], abs=1e-4)
    # Every moved unit arrived with its weights and AdamW moments: every rank of both replicas
    # holds exactly its slices of the state gathered from replica 0, which kept its ranks.
    after = plan_job(SHAPE, [4, 3], global_batch=16)
    gathered = ckpt_state(got["ckpt"])
    states = rank_dumps(tmp_path, "state", after.world_size)
    assert local_excess(after, states, gathered, exactly(gathered)) == 0


MICRO_AND_RECOMPUTED = ("--micro-batch-size", "3", "--activation-checkpointing", "selective")


def test_micro_batches_and_recomputation_through_a_relayout_and_a_restore(tmp_path):
    # The loss of rank 6 at step 3 and TP4 + TP3 from there, every replica's share in
    # micro-batches of 3 with every other layer recomputed: the dense loss curve, and every
    # rank holding exactly its slices of the gathered state.
    got = run_losing_rank_6(tmp_path / "live", steps=6, extra=MICRO_AND_RECOMPUTED)
    want = dense_run(16, 7)
    assert got["losses"] == pytest.approx(want["losses"][:6], abs=1e-4)
    after = plan_job(SHAPE, [4, 3], global_batch=16)
    gathered = ckpt_state(got["ckpt"])
    states = rank_dumps(tmp_path / "live", "state", after.world_size)
    assert local_excess(after, states, gathered, exactly(gathered)) == 0
    # Restored from that checkpoint onto TP3 + TP2: the dense step 7 from it.
    shutil.copytree(tmp_path / "live" / "ckpt", tmp_path / "restored" / "ckpt")
    restored = run_layout(plan_job(SHAPE, [3, 2], global_batch=16), tmp_path / "restored", 1,
                          extra=("--resume", *MICRO_AND_RECOMPUTED))
    assert restored["losses"] == pytest.approx(want["losses"][6:], abs=1e-4)
    step = dense_step_from(got["ckpt"], 16)
    assert dense_excess(ckpt_state(restored["ckpt"]), step["states"][0],
                        state_bounds(step)) <= 1
    grads = local_excess(plan_job(SHAPE, [3, 2], global_batch=16), restored["grads"],
                         step["grads"][0], grad_bounds(step["grads"][0]))
    assert grads <= 1


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
    # the joiner, too, holds exactly its slices of the state gathered from replica 0
    healed_layout = JobLayout.from_dict(healed)
    gathered = ckpt_state(got["ckpt"])
    states = rank_dumps(tmp_path, "state", healed_layout.world_size)
    assert local_excess(healed_layout, states, gathered, exactly(gathered)) == 0
