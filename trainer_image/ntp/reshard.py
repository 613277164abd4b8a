"""Resharding: this rank's weights and AdamW moments moved to a new layout, from the processes
that hold them, one parameter at a time over the new generation's world.

The steps of a switch: `local_state` (what this rank holds), `reshard` (agree on the step, plan
each unit's source with `tessera_core.plan.reshard_moves`, `exchange_state`), then
`install_moments` into the shard built of the moved weights. `CannotReshard` says where that cannot
work (the trainer restores the last checkpoint instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ntp.checkpoint import MOMENTS
from ntp.model import ModelArgs, parameter_shapes
from ntp.sharding import (
    ParamSpec,
    local_index,
    local_shape,
    pack_into,
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
    with_moments: bool = True,
) -> Resharded:
    """This rank's units of `layout`, with their AdamW moments, from whoever holds them
    (collective over the new world). `origin[d]`: new rank d's rank in `old_layout`, None for
    a process that joins holding nothing (its `state` is `empty_state`). Without
    `with_moments` (sharded optimizer state, moved by `ntp.sharded_optimizer`) the weights
    alone travel."""
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
    if not survivor and step > 0 and with_moments:
        # Weight plus both AdamW moments travel once the optimizer has state.
        state = {n: [ts[0].clone() for _ in range(1 + len(MOMENTS))] for n, ts in state.items()}
    # 3. Move weights and moments.
    new_replica, new_tp_rank = layout.locate(rank)
    new_shard = layout.replicas[new_replica].shards[new_tp_rank]
    src = next(d for d, o in enumerate(origin) if o is not None)
    moved = exchange_state(state, layout.shape, old_shard, new_shard, moves, rank, src)
    return Resharded(step, samples, moved)


def install_moments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: LocalState, step: int
) -> None:
    """Give `optimizer` the moved AdamW moments of `model`'s parameters (built of the moved
    weights: `ntp.build.build_rank(weights=...)`), as AdamW holds them after `step` steps."""
    for name, p in model.named_parameters():
        _, *moments = state[name]
        if moments:
            optimizer.state[p] = {
                "step": torch.tensor(float(step)),
                **dict(zip(MOMENTS, moments, strict=True)),
            }


def exchange_state(
    state: dict[str, list[torch.Tensor]],
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
    One parameter at a time, in name order (the same on every rank): the units this rank keeps
    are copied within it, those that change rank travel in one all_to_all, and the parameter's
    old tensors are taken out of `state`, so a caller whose `state` holds the last references
    frees each as soon as it has moved: a relayout holds about one copy of the state, not two.
    Replicated tensors are identical on every survivor; `replicated_src` (a survivor) broadcasts
    them for the ranks that join with nothing.
    """
    out: LocalState = {}
    for name in sorted(state):
        old = state.pop(name)
        spec = spec_of(name)
        if spec is None:
            out[name] = [t.clone() for t in old]
            for t in out[name]:
                dist.broadcast(t, replicated_src, group=group)
        else:
            out[name] = move_parameter(
                old, shape, spec, old_shard, new_shard, moves, rank, group, name
            )
        del old
    return out


def move_parameter(
    old: list[torch.Tensor],
    shape: ModelShape,
    spec: ParamSpec,
    old_shard: RankShard,
    new_shard: RankShard,
    moves: Sequence[Sequence[RankShard]],
    rank: int,
    group: dist.ProcessGroup | None,
    name: str,
) -> list[torch.Tensor]:
    """One sharded parameter's tensors (weight, moments) in the new layout."""
    kind, dim, world = spec.kind, spec.dim, len(moves)
    device = old[0].device
    held, holds = old_shard.units(kind), new_shard.units(kind)
    new = [t.new_empty(local_shape(shape, name, t.shape, new_shard)) for t in old]
    # 1. What this rank keeps, copied within it.
    kept = moves[rank][rank].units(kind)
    if kept:
        source = local_index(shape, kind, held, kept, device)
        target = local_index(shape, kind, holds, kept, device)
        for o, n in zip(old, new, strict=True):
            n.index_copy_(dim, target, o.index_select(dim, source))
    # 2. What changes rank, in one all_to_all: to each rank its units, tensor by tensor.
    one = unit_size(shape, kind) * slice_elements(old[0], dim) * len(old)
    sends = [() if d == rank else moves[d][rank].units(kind) for d in range(world)]
    takes = [() if s == rank else moves[rank][s].units(kind) for s in range(world)]
    outgoing = old[0].new_empty(sum(len(u) for u in sends) * one)
    offset = 0
    for units in sends:
        if units:
            index = local_index(shape, kind, held, units, device)
            for t in old:
                size = index.numel() * slice_elements(t, dim)
                pack_into(outgoing[offset : offset + size], t, spec, index)
                offset += size
    incoming = outgoing.new_empty(sum(len(u) for u in takes) * one)
    dist.all_to_all_single(
        incoming, outgoing, [len(u) * one for u in takes], [len(u) * one for u in sends],
        group=group,
    )
    offset = 0
    for units in takes:
        if units:
            index = local_index(shape, kind, holds, units, device)
            for t in new:
                size = index.numel() * slice_elements(t, dim)
                unpack(incoming[offset : offset + size], t, spec, index)
                offset += size
    return new
