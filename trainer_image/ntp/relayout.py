"""Relayout: one rank's state across the job's generations (`RankState`: its shard of the
current layout, the step and data position it stands at) and how it changes layout without a
restart: built or loaded at the start, received by a process that joins holding nothing, moved
live to the next generation's layout, or restored from the last checkpoint where live
resharding cannot work.

Which generation comes next and when is `ntp.membership`'s; what moves, `ntp.reshard`'s; the
loop that trains on the state, `ntp.train.Trainer`'s.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ntp.build import GenerationRank, build_rank, model_args
from ntp.checkpointing import Checkpointer
from ntp.config import TrainConfig
from ntp.groups import JobGroups
from ntp.initialize import init_parameters
from ntp.membership import Membership
from ntp.memory_meter import PeakMeter
from ntp.model import ModelArgs
from ntp.report import RankRecord
from ntp.reshard import (
    CannotReshard,
    LocalState,
    empty_state,
    install_moments,
    local_state,
    reshard,
)
from ntp.sharded_optimizer import (
    LostOptimizerState,
    OwnedState,
    ShardedAdamW,
    check_survives,
    empty_owned,
    move_owned_state,
)
from ntp.sources import Assignment
from tessera_contracts.model_shape import PlanError
from tessera_contracts.rank_events import EventKind, RankEvent
from tessera_core.plan import JobLayout, RankShard


class RankState:
    """What one rank holds across generations, and its changes of layout.

    Phases: `materialize` this rank's shard in the generation it starts in (or `receive` it
    from the survivors, for a process that starts holding nothing); after a planned switch
    `reconfigure` onto the next generation; after a loss `recover` (end the generation, abort
    what is in flight, reconfigure), or `restore` the last checkpoint onto the new layout
    where live resharding cannot work.
    """

    current: GenerationRank  # this rank's part of the generation it is in (none between two)

    def __init__(
        self,
        config: TrainConfig,
        checkpointer: Checkpointer,
        membership: Membership,
        carried: ModelArgs | None = None,
    ):
        self.config = config
        self.checkpointer = checkpointer
        self.membership = membership
        # The model's arguments beyond its shape, from the checkpoint this process starts from
        # (a joiner's survivors started from one of the same job), read once: the job prunes
        # that checkpoint while it trains, and every later generation builds from them.
        self.carried = carried
        self.device = torch.device(config.device)
        self.record = RankRecord()
        self.meter = PeakMeter(self.device) if config.measure_memory else None
        self.step = -1  # set by materialize, restore or the survivors
        self.samples = 0  # the global index of the next step's first sample

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

    @property
    def generation(self) -> int:
        return self.membership.generation

    # -- this rank's shard ---------------------------------------------------------------------

    def build(self, layout: JobLayout) -> None:
        self.current = build_rank(self.config, layout, self.carried, self.device)

    def materialize(self, layout: JobLayout, checkpoint: Path | None) -> None:
        """This rank's shard: its units' seeded initial values, or read from a checkpoint."""
        self.build(layout)
        cur = self.current
        if checkpoint is None:
            init_parameters(cur.model, cur.args, cur.shard, self.config.seed)
            self.step, self.samples = 0, 0
            return
        self.step, self.samples = self.checkpointer.load(cur, checkpoint)

    def receive(self, layout: JobLayout, previous: JobLayout, origin: Sequence[int | None]) -> None:
        """A process holding nothing (a returning GPU) takes its units of `layout` from the
        survivors, who are switching to the same generation."""
        args = model_args(self.config.flavor, layout, self.carried)
        state = empty_state(layout.shape, args, self.device)
        self._adopt(layout, previous, RankShard(), state, origin, owned=None)

    # -- change generation ---------------------------------------------------------------------

    def recover(self, error: str) -> bool:
        """The generation failed: end it (if nobody has), abort what is in flight, and go on in
        the next one. Returns False when this process has no place in it."""
        return self.reconfigure(self.membership.after_failure(error))

    def reconfigure(self, following: Assignment) -> bool:
        """Continue on `following` without a restart: new groups, units moved from survivors.

        Returns False (having left the groups) when this process has no place in it.
        """
        if following.origin is None:
            raise PlanError(f"generation {following.generation} has no origin")
        # 1. What this process holds now: `state` alone keeps it (the exchange frees each
        #    parameter's old tensors as it moves them).
        old, old_rank = self.current, dist.get_rank()
        state = local_state(old.model, old.optimizer)
        owned = old.optimizer.owned_state() if isinstance(old.optimizer, ShardedAdamW) else None
        old_layout, old_shard = old.layout, old.shard
        old.sync.close()
        # 2. Leave the old generation and its groups.
        del self.current, old
        if not self.membership.leave(following, old_rank):
            return False
        # 3. Join the next one (or the one it comes to) and take this rank's units of it.
        joined = self.membership.join_formed(
            following, following.origin.index(old_rank), following.origin
        )
        if joined is None:
            return False
        following, origin = joined
        self._adopt(following.layout, old_layout, old_shard, state, origin, owned)
        self.event(EventKind.RECONFIGURED)
        return True

    def _adopt(
        self,
        layout: JobLayout,
        old_layout: JobLayout,
        old_shard: RankShard,
        state: LocalState,
        origin: Sequence[int | None],
        owned: OwnedState | None,
    ) -> None:
        """Take this rank's units of `layout` from the survivors and rebuild around them, or
        restore the last checkpoint onto `layout` where that cannot work. `owned`: this rank's
        sharded optimizer state (`ntp.sharded_optimizer`), None when it keeps none."""
        sharded = self.config.sharded_state
        with self.meter.phase() if self.meter else contextlib.nullcontext():
            # What is left of the old generation (its modules refer to each other) collected
            # now: `state` holds the last references to what moves.
            gc.collect()
            try:
                if sharded:
                    check_survives(old_layout, origin)
                moved = reshard(state, self.step, self.samples, old_layout, old_shard, layout,
                                origin, self.device, with_moments=not sharded)
            except (CannotReshard, LostOptimizerState) as exc:
                self.restore(layout, str(exc))
                return
            del state
            self.step, self.samples = moved.step, moved.samples
            weights = {name: tensors[0] for name, tensors in moved.state.items()}
            if sharded and self.step > 0:
                owned = move_owned_state(owned or empty_owned(weights, layout), weights,
                                         old_layout, layout, origin)
            self.current = build_rank(self.config, layout, self.carried, self.device, weights)
            optimizer = self.current.optimizer
            if isinstance(optimizer, ShardedAdamW):
                optimizer.install(owned or {}, self.step)
            else:
                install_moments(self.current.model, optimizer, moved.state, self.step)
        if self.meter:
            self.record.relayout_peak_bytes.append(self.meter.peaks[-1])

    def restore(self, layout: JobLayout, why: str) -> None:
        """Checkpoint-restart onto `layout` inside the running processes: the job's last
        checkpoint, else what it started from; the steps since are redone."""
        path = self.checkpointer.policy.newest()
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
        """Record an event, and print it as a JSON line. `layout`: the one the event is about,
        when the rank holds none (between two layouts); else the rank's own."""
        self.record.event(RankEvent(
            kind,
            dist.get_rank(),
            self.generation,
            self.step,
            (layout or self.layout).tp_degrees,
            time.time(),
            checkpoint,
            why,
        ))
