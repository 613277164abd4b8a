"""Layout-independent checkpoints: gather any layout into one dense state dict, load into any."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ntp.sharding import (
    counted_units,
    dense_shape,
    element_index,
    local_index,
    shard_tensor,
    spec_of,
)
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import RankShard

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
    dense = local.new_zeros(dense_shape(shape, name, local.shape))
    values = local.detach().index_select(
        spec.dim, local_index(shape, spec.kind, held, mine, local.device)
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


def _check_shape(name: str, what: str, got: torch.Tensor, want: torch.Size) -> None:
    if got.shape != want:
        raise ValueError(
            f"checkpoint {what} {name!r} has shape {tuple(got.shape)}, this model needs "
            f"{tuple(want)}: the checkpoint is from a model of another shape"
        )


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: DenseState,
    shape: ModelShape,
    shard: RankShard,
) -> None:
    """Load a dense checkpoint into a model of any layout; its optimizer state too when
    `optimizer` is given and the checkpoint has it. Every tensor is checked against the model's
    dense shape before anything is written."""
    params = dict(model.named_parameters())
    if set(params) != set(state["model"]):
        raise ValueError(
            f"checkpoint parameters differ from the model's: "
            f"{sorted(set(params) ^ set(state['model']))[:5]}"
        )
    optim = None if optimizer is None else state.get("optimizer")
    for name, p in params.items():
        want = dense_shape(shape, name, p.shape)
        _check_shape(name, "weight", state["model"][name], want)
        for m in MOMENTS if optim is not None else ():
            _check_shape(name, m, optim[m][name], want)

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        spec = spec_of(name)
        return full.detach().clone() if spec is None else shard_tensor(full, shape, spec, shard)

    with torch.no_grad():
        for name, p in params.items():
            p.copy_(cut(name, state["model"][name]))  # copy_ moves devices
    if optimizer is None or optim is None:
        return
    for name, p in params.items():
        optimizer.state[p] = {
            "step": torch.tensor(float(optim["step"])),
            **{m: cut(name, optim[m][name]).to(p.device) for m in MOMENTS},
        }
