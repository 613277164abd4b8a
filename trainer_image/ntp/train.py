"""Trainer: one rank of a mixed-TP data-parallel job (`python -m ntp.train --layout FILE`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ntp.checkpoint import MOMENTS, DenseState, gather_checkpoint, load_checkpoint
from ntp.clip import clip_grad_norm_
from ntp.data import split_inputs, synthetic_batch
from ntp.distributed import (
    collective_timeout,
    init_distributed,
    is_communication_failure,
    leave_process_groups,
    pick_device,
)
from ntp.generations import injected_fault, planned_switch, wait_for_generation
from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS, GradSync
from ntp.groups import build_groups
from ntp.model import FLAVORS, ModelArgs, build_model
from ntp.parallelize import apply_ntp
from ntp.plan import JobLayout, RankShard, reshard_moves
from ntp.reshard import LocalState, exchange_state
from ntp.sharding import shard_tensor, spec_of


@dataclass(frozen=True)
class TrainConfig:
    flavor: str = "debug"
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    overlap: bool = True
    device: str = "cpu"
    max_grad_norm: float | None = None


@dataclass
class StepTimes:
    compute_s: list[float] = field(default_factory=list)  # forward + backward (overlapped sync)
    sync_s: list[float] = field(default_factory=list)  # the sync tail after backward
    step_s: list[float] = field(default_factory=list)  # whole step incl. optimizer


def model_args(flavor: str, layout: JobLayout) -> ModelArgs:
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(FLAVORS)}")
    args = FLAVORS[flavor]
    if args.shape() != layout.shape:
        raise ValueError(f"flavor {flavor!r} has shape {args.shape()}, layout has {layout.shape}")
    return args


class Trainer:
    """Builds this rank's shard from dense weights and runs synchronized AdamW steps."""

    def __init__(self, layout: JobLayout, config: TrainConfig, init: DenseState | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.times = StepTimes()
        self.step = 0
        self._build(layout)
        if init is not None:
            load_checkpoint(self.model, self.optimizer, init, layout.shape, self.shard)
            if init.get("optimizer") is not None:
                self.step = int(init["optimizer"]["step"])

    def _build(self, layout: JobLayout) -> None:
        """Groups, this rank's shard of the model, AdamW and the sync hooks for `layout`."""
        # 1. Groups and this rank's place in the layout.
        self.layout = layout
        self.args = model_args(self.config.flavor, layout)
        self.groups = build_groups(layout, timeout=collective_timeout())
        self.replica = layout.replicas[self.groups.replica]
        self.shard = self.replica.shards[self.groups.rank]
        # 2. Seeded dense weights cut to this rank's shard.
        self.model = build_model(self.args, seed=self.config.seed)
        self.loss_fn = apply_ntp(self.model, self.shard, self.groups.tp)
        self.model.to(self.device)
        # 3. AdamW is elementwise, so local shards with their own state do exactly the dense math.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            foreach=False,
        )
        # 4. Gradient sync hooks.
        self.sync = GradSync(
            self.model,
            layout,
            self.groups,
            self.config.bucket_elements,
            overlap=self.config.overlap,
        )

    def local_state(self) -> LocalState:
        """Each parameter's local weight followed by its AdamW moments (if any yet)."""
        state: LocalState = {}
        for name, p in self.model.named_parameters():
            moments = self.optimizer.state.get(p, {})
            state[name] = [p.detach(), *(moments[m] for m in MOMENTS if m in moments)]
        return state

    def reconfigure(self, layout: JobLayout, origin: Sequence[int], generation: int) -> None:
        """Continue on `layout` without a restart: new groups, units moved from survivors.

        `origin[d]` is the old global rank of the process that becomes new rank d.
        """
        # 1. What this process holds now.
        old_layout, old_shard, old_rank = self.layout, self.shard, dist.get_rank()
        state = self.local_state()
        # 2. Leave the old groups (a dead peer may have broken them) and join the new generation.
        # Every reference to the old groups goes, so their sockets close and peers still blocked
        # on this rank fail at once instead of waiting for the collective timeout.
        del self.model, self.optimizer, self.sync, self.loss_fn, self.groups
        leave_process_groups()
        new_rank = origin.index(old_rank)
        init_distributed(self.config.device, new_rank, layout.world_size, f"gen{generation}")
        self._adopt(layout, old_layout, old_shard, state, origin)

    @classmethod
    def join(
        cls,
        layout: JobLayout,
        previous: JobLayout,
        origin: Sequence[int | None],
        config: TrainConfig,
    ) -> Trainer:
        """A process holding nothing (a returning GPU) joins the generation `layout` describes.

        The default group must already be the new generation's; the survivors are switching to
        it at the same time and hand this rank its units and their optimizer state.
        """
        trainer = cls.__new__(cls)
        trainer.config = config
        trainer.device = torch.device(config.device)
        trainer.times = StepTimes()
        trainer.step = -1  # learnt from the survivors
        dense = build_model(model_args(config.flavor, layout), seed=config.seed)
        empty = RankShard()
        state: LocalState = {}
        for name, p in dense.named_parameters():
            spec = spec_of(name)
            t = p.detach() if spec is None else shard_tensor(p.detach(), layout.shape, spec, empty)
            state[name] = [t.to(trainer.device)]
        trainer._adopt(layout, previous, empty, state, origin)
        return trainer

    def _adopt(
        self,
        layout: JobLayout,
        old_layout: JobLayout,
        old_shard: RankShard,
        state: LocalState,
        origin: Sequence[int | None],
    ) -> None:
        """Take this rank's units of `layout` from the survivors and rebuild around them."""
        new_rank = dist.get_rank()
        # 1. Survivors must agree on the step: a failure inside an optimizer step is not
        #    repairable in place (that needs the last checkpoint). Joiners learn it here.
        survivor = origin[new_rank] is not None
        mine = [self.step, -self.step] if survivor else [-1, -(2**62)]
        steps = torch.tensor(mine, dtype=torch.long, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) != -int(steps[1]):
            raise RuntimeError(
                f"survivors are at different steps ({-int(steps[1])}..{int(steps[0])})"
            )
        self.step = int(steps[0])
        if not survivor and self.step > 0:
            # Weight plus both AdamW moments travel once the optimizer has state.
            state = {n: [ts[0].clone() for _ in range(1 + len(MOMENTS))] for n, ts in state.items()}
        # 2. Move weights and moments, then rebuild this rank's shard around them.
        new_replica, new_tp_rank = layout.locate(new_rank)
        new_shard = layout.replicas[new_replica].shards[new_tp_rank]
        moves = reshard_moves(old_layout, layout, origin)
        src = next(d for d, o in enumerate(origin) if o is not None)
        moved = exchange_state(state, layout.shape, old_shard, new_shard, moves, new_rank, src)
        self._build(layout)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                weight, *moments = moved[name]
                p.copy_(weight)
                if moments:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(self.step)),
                        **dict(zip(MOMENTS, moments, strict=True)),
                    }

    def forward_backward(self) -> torch.Tensor:
        """Local loss on this replica's slice of the global batch; gradients left in .grad."""
        tokens = synthetic_batch(
            self.args.vocab_size,
            self.args.max_seq_len,
            self.layout.global_batch,
            self.step,
            self.config.seed,
        )
        rows = slice(
            self.replica.batch_offset, self.replica.batch_offset + self.replica.local_batch
        )
        inputs, targets = split_inputs(tokens[rows].to(self.device))
        loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        return loss.detach()

    def train_step(self, on_grads: Callable[[Trainer], None] | None = None) -> float:
        """One synchronized step; returns the global (full-batch) loss.

        `on_grads` sees the synchronized gradients before the optimizer uses them.
        """
        t0 = self._now()
        loss = self.forward_backward()
        t1 = self._now()
        self.sync.finish()
        t2 = self._now()
        if self.config.max_grad_norm is not None:
            clip_grad_norm_(
                self.model,
                self.config.max_grad_norm,
                self.layout.shape,
                self.replica.shards,
                self.groups.rank,
                self.groups.tp,
            )
        if on_grads is not None:
            on_grads(self)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        t3 = self._now()
        self.times.compute_s.append(t1 - t0)
        self.times.sync_s.append(t2 - t1)
        self.times.step_s.append(t3 - t0)
        return self.global_loss(loss)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def global_loss(self, local: torch.Tensor) -> float:
        weighted = local * self.layout.sample_weight(self.groups.replica)
        total = weighted if self.groups.rank == 0 else torch.zeros_like(weighted)
        dist.all_reduce(total, group=self.groups.world)
        return float(total)

    def state_dict(self) -> DenseState | None:
        """The dense checkpoint at global rank 0, gathered by replica 0 alone (every replica
        holds the same state); None on every other rank."""
        if self.groups.replica != 0:
            return None
        return gather_checkpoint(
            self.model,
            self.optimizer,
            self.layout.shape,
            self.replica.shards,
            self.groups.rank,
            self.groups.tp,
        )


def agreed_switch(trainer: Trainer, directory: Path, generation: int) -> dict | None:
    """The next generation's document if it switches at this step boundary, as rank 0 read it.

    One reader decides for everyone (a broadcast on the job's world group): ranks reading the
    file themselves could disagree when it is written while they pass the boundary.
    """
    box = [planned_switch(directory, generation, trainer.step) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=trainer.groups.world)
    return box[0]


def log_step(trainer: Trainer, loss: float) -> None:
    """One JSON line per step on stdout, for whoever supervises the job."""
    record = {
        "step": trainer.step,
        "loss": loss,
        "step_s": trainer.times.step_s[-1],
        "samples": trainer.layout.global_batch,
        "tp_degrees": list(trainer.layout.tp_degrees),
    }
    print(json.dumps(record), flush=True)


def save_checkpoint(trainer: Trainer, path: Path) -> None:
    """Gather the dense checkpoint (collective) and write it atomically from global rank 0."""
    state = trainer.state_dict()
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ntp.train", description=__doc__)
    parser.add_argument("--layout", type=Path, required=True, help="JobLayout JSON document")
    parser.add_argument("--flavor", default="debug", choices=sorted(FLAVORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-elements", type=int, default=DEFAULT_BUCKET_ELEMENTS)
    parser.add_argument("--max-grad-norm", type=float, help="clip by the global gradient norm")
    parser.add_argument("--no-overlap", action="store_true", help="sync only after backward")
    parser.add_argument(
        "--layout-dir", type=Path, help="where gen{N}.json of later generations appear"
    )
    parser.add_argument("--reconfigure-timeout", type=float, default=300.0)
    parser.add_argument(
        "--join", action="store_true", help="join --layout's generation holding nothing"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--init", type=Path, help="dense checkpoint to start from")
    parser.add_argument("--save", type=Path, help="write the dense checkpoint here at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also every N steps (0: never)")
    parser.add_argument(
        "--resume", action="store_true", help="start from the --save checkpoint when it exists"
    )
    parser.add_argument("--out", type=Path, help="directory for per-rank metrics and grad dumps")
    parser.add_argument(
        "--dump",
        action="store_true",
        help="with --out: each rank's local gradients after the first step (grads-rank{G}.pt) "
        "and its local weights and AdamW moments at the end (state-rank{G}.pt)",
    )
    opts = parser.parse_args(argv)
    if opts.dump and opts.out is None:
        parser.error("--dump needs --out")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    document = json.loads(opts.layout.read_text())
    generation = int(document.get("generation", 0))
    layout_dir = opts.layout_dir or opts.layout.parent
    device = pick_device(opts.device)
    config = TrainConfig(
        device=device,
        flavor=opts.flavor,
        lr=opts.lr,
        seed=opts.seed,
        bucket_elements=opts.bucket_elements,
        overlap=not opts.no_overlap,
        max_grad_norm=opts.max_grad_norm,
    )
    if opts.resume and opts.save is not None and opts.save.exists():
        opts.init = opts.save
    init_distributed(device, prefix=f"gen{generation}")
    if opts.join:
        previous = json.loads((layout_dir / f"gen{generation - 1}.json").read_text())
        trainer = Trainer.join(
            JobLayout.from_dict(document),
            JobLayout.from_dict(previous),
            document["origin"],
            config,
        )
    else:
        init = (
            None
            if opts.init is None
            else torch.load(opts.init, weights_only=True, map_location="cpu")
        )
        trainer = Trainer(JobLayout.from_dict(document), config, init)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)

    def dump_grads(t: Trainer) -> None:
        grads = {name: p.grad.detach().cpu() for name, p in t.model.named_parameters()}
        torch.save(grads, opts.out / f"grads-rank{dist.get_rank()}.pt")

    first, target = trainer.step, trainer.step + opts.steps
    losses: list[float] = []
    while trainer.step < target:
        if injected_fault(generation, dist.get_rank(), trainer.step):
            os._exit(3)
        error = None
        try:
            dump = dump_grads if trainer.step == first and opts.dump and not opts.join else None
            losses.append(trainer.train_step(dump))
            # A planned change (a GPU back, a drain) may be due at this step boundary.
            following = agreed_switch(trainer, layout_dir, generation + 1)
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            # Handled below, outside the except block: its traceback would keep the failed
            # step's graph, and with it the old process groups, alive.
            error = repr(exc)
        if error is None:
            if dist.get_rank() == 0:
                log_step(trainer, losses[-1])
            every = opts.save_every and trainer.step % opts.save_every == 0
            if opts.save is not None and (trainer.step == target or every):
                save_checkpoint(trainer, opts.save)
            if following is None:
                continue
        else:
            # A peer is gone: the failed step is redone on the next generation's layout.
            following = wait_for_generation(layout_dir, generation + 1, opts.reconfigure_timeout)
            if following is None:
                raise RuntimeError(
                    f"a collective failed and no generation {generation + 1} layout appeared: "
                    f"{error}"
                )
        generation += 1
        if dist.get_rank() not in following["origin"]:
            leave_process_groups()
            return 0
        trainer.reconfigure(JobLayout.from_dict(following), following["origin"], generation)
        if dist.get_rank() == 0:
            event = {"event": "reconfigured", "generation": generation, "step": trainer.step}
            print(json.dumps(event | {"tp_degrees": list(trainer.layout.tp_degrees)}), flush=True)
    if opts.save is not None and not opts.steps:
        save_checkpoint(trainer, opts.save)
    if opts.out is not None:
        metrics = {
            "replica": trainer.groups.replica,
            "rank": trainer.groups.rank,
            "tp": trainer.replica.tp,
            "local_batch": trainer.replica.local_batch,
            "generation": generation,
            "losses": losses,
            **vars(trainer.times),
        }
        (opts.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(metrics))
        if opts.dump:
            state = {n: [t.cpu() for t in ts] for n, ts in trainer.local_state().items()}
            torch.save(state, opts.out / f"state-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
