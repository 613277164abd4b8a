"""Process groups of a mixed-TP job, created in the same order on every rank."""

from __future__ import annotations

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
    replica, rank = layout.locate(dist.get_rank())
    tp = tp_sync = dp_owner = None
    for r in layout.replicas:
        ranks = [r.global_rank(i) for i in range(r.tp)]
        model_group = dist.new_group(ranks, timeout=timeout)
        sync_group = dist.new_group(ranks, timeout=timeout)
        if r.index == replica:
            tp, tp_sync = model_group, sync_group
    for p in range(layout.sync_degree):
        group = dist.new_group(list(layout.owner_ranks(p)), timeout=timeout)
        if p == rank:
            dp_owner = group
    world = dist.new_group(list(range(layout.world_size)), timeout=timeout)
    checkpoint = dist.new_group(list(range(layout.world_size)), timeout=timeout, backend="gloo")
    assert tp is not None and tp_sync is not None
    return JobGroups(
        replica=replica,
        rank=rank,
        tp=tp,
        tp_sync=tp_sync,
        dp_owner=dp_owner,
        world=world,
        checkpoint=checkpoint,
    )
