"""Gradient clipping by the global norm of a sharded model, each unit counted once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ntp.sharding import counted_units, local_index, spec_of
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import RankShard


def grad_norm(
    model: nn.Module,
    shape: ModelShape,
    shards: Sequence[RankShard],
    rank: int,
    group: dist.ProcessGroup,
    world: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The dense model's gradient norm, from synchronized sharded gradients (a collective over
    the TP group, and with `world` over the job).

    KV copies hold the same gradient after the sync, so only the lowest holder counts them;
    replicated parameters are counted on rank 0. Each replica sums its squares in the order of
    its own layout, so replicas' norms differ in the last bits; with `world` (every rank of the
    job) all of them take replica 0's norm.
    """
    squares = []
    for name, p in model.named_parameters():
        spec = spec_of(name)
        if spec is None:
            counted = p.grad if rank == 0 else p.grad[:0]
        elif spec.kind == "kv_heads":
            held = shards[rank].units(spec.kind)
            keep = counted_units(shards, rank, spec.kind)
            counted = p.grad.index_select(
                spec.dim, local_index(shape, spec.kind, held, keep, p.device)
            )
        else:
            counted = p.grad
        squares.append(counted.float().pow(2).sum())
    total = torch.stack(squares).sum()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if world is not None and dist.get_world_size(world) > 1:
        dist.broadcast(norm, group_src=0, group=world)
    return norm


def clip_grad_norm_(model: nn.Module, max_norm: float, norm: torch.Tensor) -> float:
    """torch.nn.utils.clip_grad_norm_ of the dense model, given its norm (`grad_norm`: every
    replica scales by the same coefficient, so none drifts from the others). Returns the norm.
    """
    # The same coefficient as torch's, applied unconditionally like torch does.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef.to(p.grad.dtype))
    return float(norm)
