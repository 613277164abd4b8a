"""Layout-independent checkpoints: gather any layout into one dense state dict, load into any."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ntp.plan import ModelShape, RankShard
from ntp.sharding import (
    counted_units,
    element_index,
    local_positions,
    shard_tensor,
    spec_of,
    unit_size,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
DenseState = dict[str, Any]  # {"model": {name: tensor}, "optimizer": {...} | None}


def gather_tensor(
    name: str,
    local: torch.Tensor,
    shape: ModelShape,
    shards: Sequence[RankShard],
    rank: int,
    group: ProcessGroup,
) -> torch.Tensor | None:
    """The dense tensor (on the CPU) of a parameter-shaped local tensor, at rank 0 of the TP
    group; None on the other ranks. Every rank of the group calls it."""
    spec = spec_of(name)
    if spec is None:
        return local.detach().cpu().clone() if rank == 0 else None
    held = shards[rank].units(spec.kind)
    mine = counted_units(shards, rank, spec.kind)
    full_shape = list(local.shape)
    full_shape[spec.dim] = shape.unit_count(spec.kind) * unit_size(shape, spec.kind)
    dense = local.new_zeros(full_shape)
    values = local.detach().index_select(
        spec.dim, element_index(shape, spec.kind, local_positions(held, mine)).to(local.device)
    )
    dense.index_copy_(spec.dim, element_index(shape, spec.kind, mine).to(local.device), values)
    if dist.get_world_size(group) > 1:
        dist.reduce(dense, dst=dist.get_global_rank(group, 0), group=group)
    return dense.cpu() if rank == 0 else None


def _named_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]] | None, float | None]:
    params = dict(model.named_parameters())
    if optimizer is None or not optimizer.state:
        return params, None, None
    moments = {m: {n: optimizer.state[p][m] for n, p in params.items()} for m in MOMENTS}
    step = float(next(iter(optimizer.state.values()))["step"])
    return params, moments, step


def gather_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    shape: ModelShape,
    shards: Sequence[RankShard],
    rank: int,
    group: ProcessGroup,
) -> DenseState | None:
    """Dense weights and AdamW state of a sharded model, at rank 0 of its TP group (None
    elsewhere; every rank of the group calls it)."""

    def gather(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        return {n: gather_tensor(n, t, shape, shards, rank, group) for n, t in named.items()}

    params, moments, step = _named_state(model, optimizer)
    weights = gather(params)  # collective on every rank, so before deciding what to return
    optim = None if moments is None else {m: gather(moments[m]) for m in MOMENTS} | {"step": step}
    return {"model": weights, "optimizer": optim} if rank == 0 else None


def dense_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> DenseState:
    """The same format from an unsharded model."""

    def clone(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in named.items()}

    params, moments, step = _named_state(model, optimizer)
    optim = None if moments is None else {m: clone(moments[m]) for m in MOMENTS} | {"step": step}
    return {"model": clone(params), "optimizer": optim}


def _slice(
    name: str, full: torch.Tensor, shape: ModelShape, shard: RankShard | None
) -> torch.Tensor:
    spec = spec_of(name)
    if shard is None or spec is None:
        return full.detach().clone()
    return shard_tensor(full, shape, spec, shard)


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: DenseState,
    shape: ModelShape,
    shard: RankShard | None,
) -> None:
    """Load a dense checkpoint into a model of any layout (`shard=None`: an unsharded model)."""
    params = dict(model.named_parameters())
    if set(params) != set(state["model"]):
        raise ValueError(
            f"checkpoint parameters differ from the model's: "
            f"{sorted(set(params) ^ set(state['model']))[:5]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_slice(name, state["model"][name], shape, shard))  # copy_ moves devices
    if optimizer is None or state.get("optimizer") is None:
        return
    optim = state["optimizer"]
    for name, p in params.items():
        optimizer.state[p] = {
            "step": torch.tensor(float(optim["step"])),
            **{m: _slice(name, optim[m][name], shape, shard).to(p.device) for m in MOMENTS},
        }
