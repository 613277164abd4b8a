"""Process groups of a mixed-TP job, created in the same order on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from tessera_core.plan import JobLayout


@dataclass(frozen=True)
class JobGroups:
    replica: int
    rank: int  # inside the replica's TP group
    tp: ProcessGroup  # the model's TP collectives
    tp_sync: ProcessGroup  # gradient exchange inside the TP group (its own order of ops)
    dp_owner: ProcessGroup | None  # owners of this rank's sync partition, one per replica
    world: ProcessGroup  # replicated-parameter averaging and metrics
    checkpoint: ProcessGroup  # a save's coordination, in the background (gloo: CPU-staged data)


def build_groups(layout: JobLayout, timeout: timedelta | None = None) -> JobGroups:
    """Create every group of the job (all ranks must call this) and return this rank's.

    `timeout` bounds each collective: a rank blocked on a peer that hangs or died without
    closing its connections fails after it instead of waiting forever.
    """
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout needs {layout.world_size} ranks, the process group has {dist.get_world_size()}"
        )
    groups = layout_groups(layout, range(layout.world_size), timeout)
    assert groups is not None
    return groups


def layout_groups(layout: JobLayout, world_ranks: Sequence[int],
                  timeout: timedelta | None = None) -> JobGroups | None:
    """Create every group of `layout`, whose global rank g is world rank `world_ranks[g]` (a
    pipeline stage's layout inside the job's world; all ranks of the world must call this),
    and return this rank's (None: it is not in the layout)."""
    me = dist.get_rank()
    if me in world_ranks:
        replica, rank = layout.locate(list(world_ranks).index(me))
    else:
        replica = rank = -1
    tp = tp_sync = dp_owner = None
    for r in layout.replicas:
        ranks = [world_ranks[r.global_rank(i)] for i in range(r.tp)]
        model_group = dist.new_group(ranks, timeout=timeout)
        sync_group = dist.new_group(ranks, timeout=timeout)
        if r.index == replica:
            tp, tp_sync = model_group, sync_group
    for p in range(layout.sync_degree):
        owners = [world_ranks[g] for g in layout.owner_ranks(p)]
        group = dist.new_group(owners, timeout=timeout)
        if p == rank:
            dp_owner = group
    world = dist.new_group(list(world_ranks), timeout=timeout)
    checkpoint = dist.new_group(list(world_ranks), timeout=timeout, backend="gloo")
    if tp is None or tp_sync is None:
        return None
    return JobGroups(
        replica=replica,
        rank=rank,
        tp=tp,
        tp_sync=tp_sync,
        dp_owner=dp_owner,
        world=world,
        checkpoint=checkpoint,
    )
