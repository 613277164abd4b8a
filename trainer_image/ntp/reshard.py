"""Move weights and optimizer moments to a new layout in one all_to_all over the survivors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ntp.sharding import (
    local_index,
    local_shape,
    pack,
    slice_elements,
    spec_of,
    unit_size,
    unpack,
)
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import RankShard

# name -> the parameter-shaped tensors that travel together (weight, then AdamW moments)
LocalState = dict[str, list[torch.Tensor]]


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
