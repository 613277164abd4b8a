"""Resharding: this rank's weights and AdamW moments moved to a new layout, from the processes
that hold them, in one all_to_all over the new generation's world.

The steps of a switch: `local_state` (what this rank holds), `reshard` (agree on the step, plan
each unit's source with `tessera_core.plan.reshard_moves`, `exchange_state`), then
`install_state` into the shard built for the new layout. `CannotReshard` says where that cannot
work (the trainer restores the last checkpoint instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ntp.checkpoint import MOMENTS
from ntp.model import ModelArgs, parameter_shapes
from ntp.sharding import (
    local_index,
    local_shape,
    pack,
    slice_elements,
    spec_of,
    unit_size,
    unpack,
)
from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_core.plan import JobLayout, RankShard, reshard_moves

# name -> the parameter-shaped tensors that travel together (weight, then AdamW moments)
LocalState = dict[str, list[torch.Tensor]]


class CannotReshard(Exception):
    """Live resharding cannot work: a unit no survivor holds, or survivors at different steps
    (a failure inside an optimizer step). Every rank of the new generation sees it alike."""


@dataclass(frozen=True)
class Resharded:
    """This rank's tensors in the new layout, and the step and data position they stand at."""

    step: int
    samples: int
    state: LocalState


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LocalState:
    """Each parameter's local weight followed by its AdamW moments (if any yet)."""
    state: LocalState = {}
    for name, p in model.named_parameters():
        moments = optimizer.state.get(p, {})
        state[name] = [p.detach(), *(moments[m] for m in MOMENTS if m in moments)]
    return state


def empty_state(shape: ModelShape, args: ModelArgs, device: torch.device) -> LocalState:
    """What a process holding nothing (a returning GPU) brings: a weight with no units."""
    empty = RankShard()
    return {
        name: [torch.empty(local_shape(shape, name, dense, empty), device=device)]
        for name, dense in parameter_shapes(args).items()
    }


def reshard(
    state: LocalState,
    step: int,
    samples: int,
    old_layout: JobLayout,
    old_shard: RankShard,
    layout: JobLayout,
    origin: Sequence[int | None],
    device: torch.device,
) -> Resharded:
    """This rank's units of `layout`, with their AdamW moments, from whoever holds them
    (collective over the new world). `origin[d]`: new rank d's rank in `old_layout`, None for
    a process that joins holding nothing (its `state` is `empty_state`)."""
    rank = dist.get_rank()
    # 1. Survivors must agree on the step (a failure inside an optimizer step breaks that);
    #    joiners learn it here. Every rank sees the same sums, so all take the same branch.
    survivor = origin[rank] is not None
    mine = [step, -step, samples] if survivor else [-1, -(2**62), -1]
    steps = torch.tensor(mine, dtype=torch.long, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    if int(steps[0]) != -int(steps[1]):
        raise CannotReshard(f"survivors at steps {-int(steps[1])}..{int(steps[0])}")
    # 2. Where every unit comes from.
    try:
        moves = reshard_moves(old_layout, layout, origin)
    except PlanError as exc:  # a unit no survivor holds
        raise CannotReshard(str(exc)) from None
    step, samples = int(steps[0]), int(steps[2])
    if not survivor and step > 0:
        # Weight plus both AdamW moments travel once the optimizer has state.
        state = {n: [ts[0].clone() for _ in range(1 + len(MOMENTS))] for n, ts in state.items()}
    # 3. Move weights and moments.
    new_replica, new_tp_rank = layout.locate(rank)
    new_shard = layout.replicas[new_replica].shards[new_tp_rank]
    src = next(d for d, o in enumerate(origin) if o is not None)
    moved = exchange_state(state, layout.shape, old_shard, new_shard, moves, rank, src)
    return Resharded(step, samples, moved)


def install_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: LocalState, step: int
) -> None:
    """Put moved weights into `model` (built for the new layout) and their moments into
    `optimizer`'s state, as AdamW holds them after `step` steps."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            weight, *moments = state[name]
            p.copy_(weight)
            if moments:
                optimizer.state[p] = {
                    "step": torch.tensor(float(step)),
                    **dict(zip(MOMENTS, moments, strict=True)),
                }


def exchange_state(
    state: Mapping[str, list[torch.Tensor]],
    shape: ModelShape,
    old_shard: RankShard,
    new_shard: RankShard,
    moves: Sequence[Sequence[RankShard]],
    rank: int,
    replicated_src: int,
    group: dist.ProcessGroup | None = None,
) -> LocalState:
    """This rank's tensors in the new layout (collective over the new world).

    `moves[d][s]` are the units new rank d takes from new rank s (see `plan.reshard_moves`).
    Replicated tensors are identical on every survivor; `replicated_src` (a survivor) broadcasts
    them for the ranks that join with nothing.
    """
    names = sorted(state)
    world = len(moves)
    chunks: list[torch.Tensor] = []
    send_splits = []
    for d in range(world):
        size = 0
        for name in names:
            spec = spec_of(name)
            units = () if spec is None else moves[d][rank].units(spec.kind)
            if not units:
                continue
            index = local_index(
                shape, spec.kind, old_shard.units(spec.kind), units, state[name][0].device
            )
            for t in state[name]:
                chunks.append(pack(t, spec, index))
                size += chunks[-1].numel()
        send_splits.append(size)

    out: LocalState = {}
    recv_splits = [0] * world
    for name in names:
        spec = spec_of(name)
        if spec is None:
            out[name] = [t.clone() for t in state[name]]
            continue
        new_shape = local_shape(shape, name, state[name][0].shape, new_shard)
        out[name] = [t.new_empty(new_shape) for t in state[name]]
        one = slice_elements(out[name][0], spec.dim) * unit_size(shape, spec.kind)
        per_unit = one * len(out[name])
        for s in range(world):
            recv_splits[s] += len(moves[rank][s].units(spec.kind)) * per_unit

    device = state[names[0]][0].device
    outgoing = torch.cat(chunks) if chunks else torch.zeros(0, device=device)
    incoming = outgoing.new_empty(sum(recv_splits))
    dist.all_to_all_single(incoming, outgoing, recv_splits, send_splits, group=group)

    for name in names:
        if spec_of(name) is None:
            for t in out[name]:
                dist.broadcast(t, replicated_src, group=group)
    offset = 0
    for s in range(world):
        for name in names:
            spec = spec_of(name)
            units = () if spec is None else moves[rank][s].units(spec.kind)
            if not units:
                continue
            index = local_index(shape, spec.kind, new_shard.units(spec.kind), units, device)
            for t in out[name]:
                size = index.numel() * slice_elements(t, spec.dim)
                unpack(incoming[offset : offset + size], t, spec, index)
                offset += size
    return out
