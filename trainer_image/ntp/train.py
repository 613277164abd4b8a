"""Trainer: one rank of a mixed-TP data-parallel job (`python -m ntp.train --layout FILE`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ntp.checkpoint import (
    MOMENTS,
    CheckpointError,
    CheckpointSaver,
    latest,
    load_state,
    read_args,
    save_state,
)
from ntp.clip import clip_grad_norm_
from ntp.data import split_inputs, synthetic_batch
from ntp.dataset import TokenDataset
from ntp.distributed import (
    End,
    EndReason,
    FailureWatch,
    RendezvousEnded,
    abort_in_flight,
    collective_timeout,
    connect,
    end_generation,
    init_distributed,
    is_communication_failure,
    leave_process_groups,
    pick_device,
    ready_to_form,
    register_process,
    rendezvous_from_env,
)
from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS, GradSync
from ntp.groups import JobGroups, build_groups
from ntp.hf_write import keep_beside
from ntp.initialize import init_parameters, materialize
from ntp.model import FLAVORS, ModelArgs, Transformer, parameter_shapes
from ntp.parallelize import apply_ntp
from ntp.reshard import LocalState, exchange_state
from ntp.sharding import local_shape
from ntp.sources import (
    Assignment,
    FileGenerationSource,
    GenerationSource,
    assignment,
    at_step_of,
    wait_for,
)
from tessera_contracts.generation import Rendezvous
from tessera_contracts.invocation import (
    STRANDED_EXIT,
    InvocationError,
    RankInvocation,
    rank_help,
)
from tessera_contracts.model_shape import PlanError
from tessera_contracts.rank_events import EventKind, RankEvent, StepRecord
from tessera_core.plan import JobLayout, RankShard, ReplicaLayout, reshard_moves


@dataclass(frozen=True)
class TrainConfig:
    flavor: str | None = None  # None: the model the layout's shape describes
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    overlap: bool = True
    device: str = "cpu"
    max_grad_norm: float | None = None
    precision: str = "fp32"  # or "bf16": autocast compute, fp32 weights, moments and reductions


# What a checkpoint's model arguments carry beyond the shape the layout gives.
CARRIED_ARGS = ("rope_theta", "norm_eps", "init_std")


@dataclass(frozen=True)
class Checkpointing:
    save: Path | None = None  # the job's checkpoint directory: at the end and every `every` steps
    every: int = 0
    init: Path | None = None  # what the job started from (the fallback before any save)
    keep: int = 3
    blocking: bool = False  # write before training on (else only the copy to CPU is waited for)

    def newest(self) -> Path | None:
        """The checkpoint to restart from: the job's newest, else what it started from."""
        found = None if self.save is None else latest(self.save)
        return found or self.newest_init()

    def newest_init(self) -> Path | None:
        if self.init is None:
            return None
        found = latest(self.init)
        if found is None:
            raise CheckpointError(f"--init {self.init}: no complete checkpoint there")
        return found


@dataclass
class PhaseTimes:
    """Seconds per phase of each step this rank ran, for its step lines and its `--out` record;
    the node agent's `StepTimes` histogram counts whole steps for Prometheus."""

    compute_s: list[float] = field(default_factory=list)  # forward + backward (overlapped sync)
    sync_s: list[float] = field(default_factory=list)  # the sync tail after backward
    optimizer_s: list[float] = field(default_factory=list)  # the optimizer's own step
    step_s: list[float] = field(default_factory=list)  # whole step incl. optimizer


def model_args(
    flavor: str | None, layout: JobLayout, carried: ModelArgs | None = None
) -> ModelArgs:
    """The model of the layout's shape, with what the model it starts from carries beyond it
    (`carried`: a checkpoint's RoPE base and norm epsilon); a named flavor must have that
    shape."""
    shape = layout.shape
    if flavor is None:
        args = ModelArgs.of_shape(shape)
        if carried is None:
            return args
        return replace(args, **{k: getattr(carried, k) for k in CARRIED_ARGS})
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(FLAVORS)}")
    if FLAVORS[flavor].shape() != shape:
        raise ValueError(
            f"flavor {flavor!r} has shape {FLAVORS[flavor].shape()}, layout has {shape}"
        )
    return FLAVORS[flavor]


class GenerationEnded(RuntimeError):
    """The generation this work belonged to is over; the thread doing it was abandoned."""


class Stranded(RuntimeError):
    """A generation failed and no later one was published in time: nobody plans the job's next
    layout (the rank exits with STRANDED_EXIT)."""


@dataclass
class GenerationRank:
    """This rank's part of one generation: its groups, model shard, AdamW and gradient sync.

    A training thread holds its own reference: a thread abandoned in a collective (see
    `Trainer.run`) keeps its generation's objects and never touches the next one's.
    """

    layout: JobLayout
    args: ModelArgs
    groups: JobGroups
    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    sync: GradSync
    abandoned: bool = False

    @property
    def replica(self) -> ReplicaLayout:
        return self.layout.replicas[self.groups.replica]

    @property
    def shard(self) -> RankShard:
        return self.replica.shards[self.groups.rank]


# How long a training thread may take to leave a generation that ended under it before it is
# abandoned: long enough for a collective that the abort failed to return, short next to a
# step. A thread that stays (gloo's send posted on an already failed connection waits for the
# collective timeout) cannot change the job's state any more (`GenerationRank.abandoned`).
LEAVE_GRACE_S = 0.2


class Trainer:
    """One rank of the job, across layout generations.

    Phases: `join` a generation's groups; `materialize` this rank's shard (or `receive` it from
    the survivors, for a process that starts holding nothing); `train_step`s; at a step boundary
    a planned `switch`; after a loss `recover` (end the generation, abort what is in flight,
    `reconfigure` onto the next one, or `restore` the last checkpoint onto it where live
    resharding cannot work); `save_checkpoint`; `finish`.

    Steps run in a thread per generation while the calling thread waits for either that thread
    or the generation's end notice: a rank learns of a loss from the notice even when its own
    collective cannot return (`LEAVE_GRACE_S`).
    """

    def __init__(
        self,
        config: TrainConfig,
        checkpointing: Checkpointing,
        source: GenerationSource,
        rendezvous: Rendezvous,
        reconfigure_timeout_s: float = 300.0,
        data: TokenDataset | None = None,
        carried: ModelArgs | None = None,
    ):
        self.config = config
        self.checkpointing = checkpointing
        self.data = data  # None: the synthetic sequences (ntp.data), for tests and benchmarks
        self.saver = None if checkpointing.save is None else CheckpointSaver(
            checkpointing.save, checkpointing.keep, checkpointing.blocking
        )
        # The model's arguments beyond its shape, from the checkpoint this process starts from
        # (a joiner's survivors started from one of the same job), read once: the job prunes
        # that checkpoint while it trains, and every later generation builds from them.
        self.carried = carried
        self.source = source
        self.rendezvous = rendezvous
        self.reconfigure_timeout_s = reconfigure_timeout_s
        self.store = connect(rendezvous)
        self.device = torch.device(config.device)
        self.times = PhaseTimes()
        self.step = -1  # set by materialize, restore or the survivors
        self.samples = 0  # the global index of the next step's first sample
        self.losses: dict[int, float] = {}  # step -> global loss (a redone step overwrites)
        self.step_ends: dict[int, float] = {}  # steps done -> wall-clock time
        self.events: list[RankEvent] = []
        self.generation = -1
        self.first_generation: int | None = None  # the one this process started in
        # Guards what a step changes (weights, moments, step, losses) against abandonment.
        self._lock = threading.Lock()

    # The current generation's shard, for hooks and reports.
    @property
    def layout(self) -> JobLayout:
        return self.current.layout

    @property
    def model(self) -> torch.nn.Module:
        return self.current.model

    @property
    def groups(self) -> JobGroups:
        return self.current.groups

    # -- join a generation ---------------------------------------------------------------------

    def join(self, target: Assignment, rank: int) -> None:
        """Rendezvous as global rank `rank` of `target`'s generation, watched for its end."""
        register_process(self.store, target.generation)
        init_distributed(
            self.config.device, self.store, rank, target.layout.world_size, target.generation
        )
        self.generation = target.generation
        if self.first_generation is None:
            self.first_generation = target.generation
        self.wake = threading.Event()  # the generation ended, or its training thread returned
        self.watch = FailureWatch(
            self.rendezvous, target.generation, self._abort_in_flight, self.wake.set
        )

    def join_formed(
        self, target: Assignment, rank: int, origin: Sequence[int | None]
    ) -> tuple[Assignment, tuple[int | None, ...]] | None:
        """Join `target` as `rank`; while the generation to join ends before it forms (a
        process it counts on died first), the next one instead, where this process has a place.
        `origin[d]`: the rank, in the layout this process holds, of the process that becomes
        `target`'s rank d. Returns the generation joined and its origin in that held layout
        (through every generation that never formed); None when this process has no place."""
        while True:
            try:
                self.join(target, rank)
                return target, tuple(origin)
            except RendezvousEnded as exc:
                print(f"rank {rank} of generation {target.generation}: {exc}", file=sys.stderr,
                      flush=True)
                following = wait_for(self.source, target.generation + 1,
                                     self.reconfigure_timeout_s)
                if following is None:
                    raise Stranded(
                        f"{exc}; no generation {target.generation + 1} appeared within "
                        f"{self.reconfigure_timeout_s:.0f} s") from None
                if following.origin is None:
                    raise PlanError(f"generation {following.generation} has no origin") from None
            if rank not in following.origin:
                return None
            origin = tuple(None if o is None else origin[o] for o in following.origin)
            target, rank = following, following.origin.index(rank)

    def _abort_in_flight(self) -> None:
        abort_in_flight(self.config.device, self.rendezvous.port)

    # -- build this rank's shard ---------------------------------------------------------------

    def _build(self, layout: JobLayout) -> None:
        """Groups, this rank's shard of the model, AdamW and the sync hooks for `layout`."""
        # 1. Groups and this rank's place in the layout.
        args = model_args(self.config.flavor, layout, self.carried)
        groups = build_groups(layout, timeout=collective_timeout())
        shard = layout.replicas[groups.replica].shards[groups.rank]
        # 2. This rank's shard only, allocated uninitialized: the caller fills it.
        with torch.device("meta"):
            model = Transformer(args)
        loss_fn = apply_ntp(model, shard, groups.tp)
        materialize(model, self.device)
        # 3. AdamW is elementwise, so local shards with their own state do exactly the dense math.
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            foreach=False,
        )
        # 4. Gradient sync hooks.
        sync = GradSync(
            model, layout, groups, self.config.bucket_elements, overlap=self.config.overlap
        )
        self.current = GenerationRank(layout, args, groups, model, loss_fn, optimizer, sync)

    def materialize(self, layout: JobLayout, checkpoint: Path | None) -> None:
        """This rank's shard: its units' seeded initial values, or read from a checkpoint."""
        self._build(layout)
        cur = self.current
        if checkpoint is None:
            init_parameters(cur.model, cur.args, cur.shard, self.config.seed)
            self.step, self.samples = 0, 0
            return
        info = load_state(checkpoint, cur.model, cur.optimizer, layout.shape, cur.shard)
        self.step, self.samples = int(info["step"]), int(info["samples"])

    def receive(self, layout: JobLayout, previous: JobLayout, origin: Sequence[int | None]) -> None:
        """A process holding nothing (a returning GPU) takes its units of `layout` from the
        survivors, who are switching to the same generation."""
        args = model_args(self.config.flavor, layout, self.carried)
        empty = RankShard()
        state: LocalState = {
            name: [torch.empty(local_shape(layout.shape, name, dense, empty), device=self.device)]
            for name, dense in parameter_shapes(args).items()
        }
        self._adopt(layout, previous, empty, state, origin)

    def local_state(self) -> LocalState:
        """Each parameter's local weight followed by its AdamW moments (if any yet)."""
        state: LocalState = {}
        optimizer = self.current.optimizer
        for name, p in self.current.model.named_parameters():
            moments = optimizer.state.get(p, {})
            state[name] = [p.detach(), *(moments[m] for m in MOMENTS if m in moments)]
        return state

    # -- train ---------------------------------------------------------------------------------

    def forward_backward(self, cur: GenerationRank) -> torch.Tensor:
        """Local loss on this replica's slice of the global batch; gradients left in .grad."""
        replica = cur.replica
        if self.data is not None:
            rows = self.data.samples(self.samples + replica.batch_offset, replica.local_batch)
        else:
            tokens = synthetic_batch(
                cur.args.vocab_size,
                cur.args.max_seq_len,
                cur.layout.global_batch,
                self.step,
                self.config.seed,
            )
            rows = tokens[replica.batch_offset : replica.batch_offset + replica.local_batch]
        inputs, targets = split_inputs(rows.to(self.device))
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16"
        ):
            logits = cur.model(inputs)
        loss = cur.loss_fn(logits, targets)
        loss.backward()
        return loss.detach()

    def train_step(
        self, cur: GenerationRank, on_grads: Callable[[Trainer], None] | None = None
    ) -> float:
        """One synchronized step; returns the global (full-batch) loss.

        `on_grads` sees the synchronized gradients before the optimizer uses them. The loss is
        reduced before the optimizer step, so a step is counted together with its loss record:
        a failure in any collective of the step leaves it undone, and it is redone whole.
        """
        t0 = self._now()
        loss = self.forward_backward(cur)
        t1 = self._now()
        cur.sync.finish()
        t2 = self._now()
        if self.config.max_grad_norm is not None:
            clip_grad_norm_(
                cur.model,
                self.config.max_grad_norm,
                cur.layout.shape,
                cur.replica.shards,
                cur.groups.rank,
                cur.groups.tp,
                world=cur.groups.world,
            )
        if on_grads is not None:
            on_grads(self)
        global_loss = self.global_loss(cur, loss)
        with self._lock:
            if cur.abandoned:
                raise GenerationEnded("abandoned before the optimizer step")
            # The loss and the norm clip wait for every replica: the optimizer's own time
            # starts after them (the loss's float() has synchronized the device already).
            t_opt = self._now()
            cur.optimizer.step()
            cur.optimizer.zero_grad()
            t3 = self._now()
            self.times.compute_s.append(t1 - t0)
            self.times.sync_s.append(t2 - t1)
            self.times.optimizer_s.append(t3 - t_opt)
            self.times.step_s.append(t3 - t0)
            self.losses[self.step] = global_loss
            self.step += 1
            self.samples += cur.layout.global_batch
            self.step_ends[self.step] = time.time()
        return global_loss

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def global_loss(self, cur: GenerationRank, local: torch.Tensor) -> float:
        weighted = local * cur.layout.sample_weight(cur.groups.replica)
        total = weighted if cur.groups.rank == 0 else torch.zeros_like(weighted)
        dist.all_reduce(total, group=cur.groups.world)
        return float(total)

    # -- change generation ---------------------------------------------------------------------

    def agreed_switch(self, cur: GenerationRank) -> Assignment | None:
        """The next generation if it is planned for this step boundary, as rank 0 read it: at or
        after its step (the operator plans from progress reports, which lag the ranks), once the
        processes it adds have come to its rendezvous (until then the ranks train on).

        One reader decides for everyone (a broadcast on the job's world group): ranks reading
        the source themselves could disagree when it is published while they pass the boundary.
        """
        box: list = [None]
        if cur.groups.replica == 0 and cur.groups.rank == 0:
            document = self.source.get(self.generation + 1)
            planned = None if document is None else at_step_of(document)
            if planned is not None and planned <= self.step:
                joiners = sum(o is None for o in document.get("origin") or ())
                if ready_to_form(self.store, self.generation + 1, joiners):
                    box[0] = document
        dist.broadcast_object_list(box, src=0, group=cur.groups.world)
        return None if box[0] is None else assignment(box[0])

    def recover(self, error: str) -> bool:
        """The generation failed: end it (if nobody has), abort what is in flight, and go on in
        the next one. Returns False when this process has no place in it."""
        end_generation(
            self.store, self.generation, EndReason(End.FAILED, f"rank {dist.get_rank()}: {error}")
        )
        self.watch.join()  # its abort has failed whatever was still in flight
        following = wait_for(self.source, self.generation + 1, self.reconfigure_timeout_s)
        if following is None:
            raise Stranded(
                f"generation {self.generation} failed and no generation {self.generation + 1} "
                f"appeared within {self.reconfigure_timeout_s:.0f} s: {error}"
            )
        return self.reconfigure(following)

    def reconfigure(self, following: Assignment) -> bool:
        """Continue on `following` without a restart: new groups, units moved from survivors.

        Returns False (having left the groups) when this process has no place in it.
        """
        if following.origin is None:
            raise PlanError(f"generation {following.generation} has no origin")
        # 1. What this process holds now, and where it goes.
        old, old_rank = self.current, dist.get_rank()
        stays = old_rank in following.origin
        state = self.local_state()
        if stays:
            register_process(self.store, following.generation)
        # 2. The old generation is over for everyone once anyone joins the next one; its watch
        #    stops (a failure already ended it, and the watch aborted what was in flight).
        end_generation(self.store, self.generation, EndReason(End.SUPERSEDED))
        self.watch.join()
        # 3. Leave the old groups; only an abandoned thread may still hold them.
        del self.current
        leave_process_groups()
        if not stays:
            return False
        joined = self.join_formed(following, following.origin.index(old_rank), following.origin)
        if joined is None:
            return False
        following, origin = joined
        self._adopt(following.layout, old.layout, old.shard, state, origin)
        self.event(EventKind.RECONFIGURED)
        return True

    def _adopt(
        self,
        layout: JobLayout,
        old_layout: JobLayout,
        old_shard: RankShard,
        state: LocalState,
        origin: Sequence[int | None],
    ) -> None:
        """Take this rank's units of `layout` from the survivors and rebuild around them, or
        restore the last checkpoint onto `layout` where that cannot work."""
        new_rank = dist.get_rank()
        # 1. Survivors must agree on the step (a failure inside an optimizer step breaks that);
        #    joiners learn it here. Every rank sees the same sums, so all take the same branch.
        survivor = origin[new_rank] is not None
        mine = [self.step, -self.step, self.samples] if survivor else [-1, -(2**62), -1]
        steps = torch.tensor(mine, dtype=torch.long, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) != -int(steps[1]):
            self.restore(layout, f"survivors at steps {-int(steps[1])}..{int(steps[0])}")
            return
        try:
            moves = reshard_moves(old_layout, layout, origin)
        except PlanError as exc:  # a unit no survivor holds
            self.restore(layout, str(exc))
            return
        self.step, self.samples = int(steps[0]), int(steps[2])
        if not survivor and self.step > 0:
            # Weight plus both AdamW moments travel once the optimizer has state.
            state = {n: [ts[0].clone() for _ in range(1 + len(MOMENTS))] for n, ts in state.items()}
        # 2. Move weights and moments, then rebuild this rank's shard around them.
        new_replica, new_tp_rank = layout.locate(new_rank)
        new_shard = layout.replicas[new_replica].shards[new_tp_rank]
        src = next(d for d, o in enumerate(origin) if o is not None)
        moved = exchange_state(state, layout.shape, old_shard, new_shard, moves, new_rank, src)
        self._build(layout)
        with torch.no_grad():
            for name, p in self.current.model.named_parameters():
                weight, *moments = moved[name]
                p.copy_(weight)
                if moments:
                    self.current.optimizer.state[p] = {
                        "step": torch.tensor(float(self.step)),
                        **dict(zip(MOMENTS, moments, strict=True)),
                    }

    def restore(self, layout: JobLayout, why: str) -> None:
        """Checkpoint-restart onto `layout` inside the running processes: the job's last
        checkpoint, else what it started from; the steps since are redone."""
        path = self.checkpointing.newest()
        checkpoint = None if path is None else str(path)
        self.event(EventKind.RESTORING, layout, checkpoint=checkpoint, why=why)
        self.materialize(layout, path)
        self.event(EventKind.RESTORED, checkpoint=checkpoint, why=why)

    def event(
        self,
        kind: EventKind,
        layout: JobLayout | None = None,
        checkpoint: str | None = None,
        why: str = "",
    ) -> None:
        """Record an event, and print it as a JSON line (every rank: each node's agent keeps
        its own goodput ledger from its ranks' lines). `layout`: the one the event is about,
        when the rank holds none (between two layouts); else the rank's own."""
        record = RankEvent(
            kind,
            dist.get_rank(),
            self.generation,
            self.step,
            (layout or self.layout).tp_degrees,
            time.time(),
            checkpoint,
            why,
        )
        self.events.append(record)
        print(record.to_line(), flush=True)

    # -- checkpoint and finish -----------------------------------------------------------------

    def save_checkpoint(self, cur: GenerationRank) -> None:
        """Every rank stages its part (replica 0's units; the other replicas hold the same) and
        the saver writes it in the background; global rank 0 commits it."""
        assert self.saver is not None
        state = (
            save_state(cur.model, cur.optimizer, cur.layout.shape, cur.replica.shards,
                       cur.groups.rank)
            if cur.groups.replica == 0
            else {}
        )
        info = {
            "step": self.step,
            "samples": self.samples,
            "model": asdict(cur.args),
            "tp_degrees": list(cur.layout.tp_degrees),
        }
        self.saver.save(state, info, cur.groups.checkpoint, coordinator=dist.get_rank() == 0)

    def metrics(self) -> dict:
        cur = self.current
        return {
            "replica": cur.groups.replica,
            "rank": cur.groups.rank,
            "tp": cur.replica.tp,
            "local_batch": cur.replica.local_batch,
            "generation": self.generation,
            "first_generation": self.first_generation,
            "losses": [self.losses[s] for s in sorted(self.losses)],
            "step_ends": self.step_ends,
            "events": [e.to_dict() for e in self.events],
            **vars(self.times),
        }

    def finish(self) -> None:
        if self.saver is not None:
            self.saver.wait()  # the last checkpoint is committed before the job says it is done
        dist.barrier()
        end_generation(self.store, self.generation, EndReason(End.FINISHED))
        self.watch.join()
        dist.destroy_process_group()

    # -- the loop ------------------------------------------------------------------------------

    def run(
        self,
        until: int,
        before_step: Callable[[Trainer], None] | None = None,
        on_first_grads: Callable[[Trainer], None] | None = None,
    ) -> bool:
        """Train until the job has done `until` steps, across generations; False when this
        process leaves the job before that (no place in a later generation)."""
        first, target = self.step, until
        while self.step < target:
            # 1. This generation's steps, in a thread of their own.
            cur, outcome = self.current, []
            worker = threading.Thread(
                target=self._train_generation,
                args=(cur, target, first, before_step, on_first_grads, outcome),
                name=f"train-gen{self.generation}",
                daemon=True,
            )
            worker.start()
            # 2. Until it returns or the generation ends under it (a loss someone else saw).
            self.wake.wait()
            if not outcome:
                reason = self.watch.join()
                if reason.failed:
                    with self._lock:
                        cur.abandoned = True
                    worker.join(LEAVE_GRACE_S)
                    outcome.append(("failed", str(reason)))
                else:  # peers passed the same boundary first: this thread finishes it too
                    worker.join()
            kind, detail = outcome[0]
            # 3. Go on where the generation leaves the job.
            if kind == "error":
                raise detail
            # A planned switch leaves the groups a save in flight uses: it completes first. A
            # failure has broken them already.
            if self.saver is not None and kind == "switch":
                self.saver.wait()
            if self.saver is not None and kind == "failed":
                self.saver.abandon()
            if kind == "switch" and not self.reconfigure(detail):
                return False
            if kind == "failed" and not self.recover(detail):
                return False
        return True

    def _train_generation(
        self,
        cur: GenerationRank,
        target: int,
        first: int,
        before_step: Callable[[Trainer], None] | None,
        on_first_grads: Callable[[Trainer], None] | None,
        outcome: list,
    ) -> None:
        """Steps on `cur` until `target`, a planned switch or a failure; `outcome` says which."""
        every = self.checkpointing.every
        try:
            while self.step < target:
                if before_step is not None:
                    before_step(self)
                self.train_step(cur, on_first_grads if self.step == first else None)
                # A planned change (a GPU back, a drain) may be due at this step boundary.
                following = self.agreed_switch(cur)
                log_step(self)
                if self.checkpointing.save is not None and (
                    self.step == target or (every and self.step % every == 0)
                ):
                    self.event(EventKind.SAVING_CHECKPOINT)
                    self.save_checkpoint(cur)
                    self.event(EventKind.CHECKPOINTED)
                if following is not None:
                    self.event(EventKind.SWITCHING)
                    outcome.append(("switch", following))
                    return
            outcome.append(("done", None))
        except RuntimeError as exc:
            # A peer is gone (or this thread was abandoned): the failed step is redone on the
            # next generation's layout. Anything else is a bug and stops the rank.
            failed = isinstance(exc, GenerationEnded) or is_communication_failure(exc)
            outcome.append(("failed", repr(exc)) if failed else ("error", exc))
        except BaseException as exc:
            outcome.append(("error", exc))
        finally:
            if not cur.abandoned:
                self.wake.set()


def log_step(trainer: Trainer) -> None:
    """One JSON line per step on stdout from every rank, for whoever supervises the job (each
    node's agent counts the step when the first of its ranks reports it)."""
    cur, times = trainer.current, trainer.times
    record = StepRecord(
        step=trainer.step,
        rank=dist.get_rank(),
        generation=trainer.generation,
        loss=trainer.losses[trainer.step - 1],
        step_s=times.step_s[-1],
        samples=cur.layout.global_batch,
        tokens=cur.layout.global_batch * cur.args.max_seq_len,
        compute_s=times.compute_s[-1] + times.optimizer_s[-1],
        tp_degrees=trainer.layout.tp_degrees,
        time=trainer.step_ends[trainer.step],
    )
    print(record.to_line(), flush=True)


def open_data(
    opts: argparse.Namespace, layout: JobLayout, carried: ModelArgs | None
) -> TokenDataset | None:
    if opts.data is None:
        return None
    args = model_args(opts.flavor, layout, carried)
    return TokenDataset.open(
        opts.data, args.max_seq_len, opts.seed, args.vocab_size, tokenizer=opts.tokenizer
    )


def parse_args(argv: list[str]) -> tuple[RankInvocation, argparse.Namespace]:
    """The rank's invocation (what its node agent sets: tessera_contracts.invocation) and the
    trainer's own options."""
    parser = argparse.ArgumentParser(
        prog="ntp.train",
        description=__doc__,
        epilog=rank_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--flavor", choices=sorted(FLAVORS), help="a named model (default: the layout's shape)"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-elements", type=int, default=DEFAULT_BUCKET_ELEMENTS)
    parser.add_argument("--max-grad-norm", type=float, help="clip by the global gradient norm")
    parser.add_argument("--no-overlap", action="store_true", help="sync only after backward")
    parser.add_argument("--reconfigure-timeout", type=float, default=300.0)
    parser.add_argument(
        "--device",
        default="auto",
        choices=["cpu", "cuda", "auto"],
        help="auto: this rank's GPU (NCCL) when every rank of the host has one, else CPU (gloo)",
    )
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: autocast compute; weights, AdamW state and reductions fp32")
    parser.add_argument("--data", type=Path, help="a prepared dataset (python -m ntp.prepare); "
                        "default: synthetic sequences")
    parser.add_argument("--tokenizer", type=Path,
                        help="refuse a dataset not tokenized with this tokenizer.json")
    parser.add_argument("--init", type=Path,
                        help="checkpoint (or checkpoint directory) to start from")
    parser.add_argument("--save", type=Path,
                        help="the job's checkpoint directory, written at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also every N steps (0: never)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    parser.add_argument("--blocking-save", action="store_true",
                        help="write each checkpoint before training on (default: in the "
                        "background once copied to CPU memory)")
    parser.add_argument(
        "--resume", action="store_true",
        help="start from the newest checkpoint under --save when there is one",
    )
    parser.add_argument("--out", type=Path, help="directory for per-rank metrics and grad dumps")
    parser.add_argument(
        "--dump",
        action="store_true",
        help="with --out: each rank's local gradients after the first step (grads-rank{G}.pt) "
        "and its local weights and AdamW moments at the end (state-rank{G}.pt)",
    )
    # The trainer's own options first, so that --help needs no invocation; what is left is
    # the invocation's, or unknown.
    opts, rest = parser.parse_known_args(argv)
    try:
        invocation = RankInvocation.from_args(rest)
    except InvocationError as exc:
        parser.error(str(exc))
    if invocation.options:
        parser.error(f"unrecognized arguments: {' '.join(invocation.options)}")
    if opts.dump and opts.out is None:
        parser.error("--dump needs --out")
    return invocation, opts


def main(
    argv: list[str] | None = None, before_step: Callable[[Trainer], None] | None = None
) -> int:
    """Run one rank (RANK, WORLD_SIZE; MASTER_ADDR/PORT for explicit layouts). `before_step`
    runs at every step boundary: failure drills hook in there, outside the training loop. A
    rank left with no generation to go on in exits with STRANDED_EXIT."""
    try:
        return _run_rank(sys.argv[1:] if argv is None else argv, before_step)
    except Stranded as exc:
        print(f"ntp.train: {exc}", file=sys.stderr, flush=True)
        return STRANDED_EXIT


def _run_rank(argv: list[str], before_step: Callable[[Trainer], None] | None) -> int:
    invocation, opts = parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # 1. The generation this process starts in, and where later ones appear.
    first = assignment(json.loads(invocation.layout.read_text()))
    source = FileGenerationSource(invocation.layout_dir or invocation.layout.parent)
    checkpointing = Checkpointing(
        opts.save, opts.save_every, opts.init, keep=opts.keep, blocking=opts.blocking_save
    )
    start_from = checkpointing.newest() if opts.resume else checkpointing.newest_init()
    carried = None if start_from is None else read_args(start_from)
    if opts.save is not None and start_from is not None and os.environ["RANK"] == "0":
        keep_beside(start_from, opts.save)  # the tokenizer, for the job's exports
    config = TrainConfig(
        device=pick_device(opts.device),
        precision=opts.precision,
        flavor=opts.flavor,
        lr=opts.lr,
        seed=opts.seed,
        bucket_elements=opts.bucket_elements,
        overlap=not opts.no_overlap,
        max_grad_norm=opts.max_grad_norm,
    )
    trainer = Trainer(
        config,
        checkpointing,
        source,
        first.rendezvous or rendezvous_from_env(),
        opts.reconfigure_timeout,
        data=open_data(opts, first.layout, carried),
        carried=carried,
    )
    # 2. Join it: build this rank's shard, or receive it from the survivors.
    rank = int(os.environ["RANK"])
    if invocation.join:
        if first.origin is None:
            raise PlanError(
                f"--join needs a generation with an origin; {invocation.layout} has none"
            )
        previous = source.get(first.generation - 1)
        if previous is None:
            raise FileNotFoundError(f"--join: generation {first.generation - 1} is not published")
        # Building on the meta device the first time imports much of torch (about a second):
        # done before the rendezvous, where every survivor would wait for it.
        parameter_shapes(model_args(config.flavor, first.layout, carried))
        joined = trainer.join_formed(first, rank, first.origin)
        if joined is None:
            return 0  # the generation it came for never formed, and the next has no place
        trainer.receive(joined[0].layout, assignment(previous).layout, joined[1])
    else:
        trainer.join(first, rank)
        trainer.materialize(first.layout, start_from)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)

    def dump_grads(t: Trainer) -> None:
        grads = {name: p.grad.detach().cpu() for name, p in t.model.named_parameters()}
        torch.save(grads, opts.out / f"grads-rank{dist.get_rank()}.pt")

    # 3. Train across generations.
    start = trainer.step
    until = invocation.until(start)
    dump = dump_grads if opts.dump and not invocation.join else None
    if not trainer.run(until, before_step, dump):
        return 0  # no place in the job's later layout: this GPU left it
    if opts.save is not None and until <= start and not invocation.join:
        # Nothing to train: the checkpoint is what was loaded, on this layout (every rank of
        # the first generation starts from the same state, so all of them gather it).
        trainer.save_checkpoint(trainer.current)
    # 4. Report and finish.
    if opts.out is not None:
        rank = dist.get_rank()
        (opts.out / f"rank{rank}.json").write_text(json.dumps(trainer.metrics()))
        if opts.dump:
            state = {n: [t.cpu() for t in ts] for n, ts in trainer.local_state().items()}
            torch.save(state, opts.out / f"state-rank{rank}.pt")
    trainer.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
