"""Which parameters are split by which unit kind, and how unit slices are cut, packed and placed.

A unit's gradient or weight slice is always flattened "unit-major": the slice along the split
dimension moved to the front, then row-major. Every layout packs and unpacks the same way, so a
row-parallel weight (split on dim 1) lines up between ranks whose local layouts differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ntp.kernels import gather_rows
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import RankShard


@dataclass(frozen=True)
class ParamSpec:
    """A sharded parameter: the unit kind it is split by and the dimension it is split on."""

    kind: str
    dim: int


# Parameter name (without the "layers.N." prefix) -> how it is split. Anything else is replicated.
SHARDED: dict[str, ParamSpec] = {
    "attention.wq.weight": ParamSpec("q_heads", 0),
    "attention.wk.weight": ParamSpec("kv_heads", 0),
    "attention.wv.weight": ParamSpec("kv_heads", 0),
    "attention.wq.bias": ParamSpec("q_heads", 0),
    "attention.wk.bias": ParamSpec("kv_heads", 0),
    "attention.wv.bias": ParamSpec("kv_heads", 0),
    "attention.wo.weight": ParamSpec("q_heads", 1),  # row-parallel
    "feed_forward.w1.weight": ParamSpec("mlp_cols", 0),
    "feed_forward.w3.weight": ParamSpec("mlp_cols", 0),
    "feed_forward.w2.weight": ParamSpec("mlp_cols", 1),  # row-parallel
    "tok_embeddings.weight": ParamSpec("vocab_rows", 0),
    "output.weight": ParamSpec("vocab_rows", 0),
}

# Replicated parameters that act on each head inside a TP region: a rank's gradient of them
# comes from its own heads only, so the TP group's gradients add up to the whole one.
PARTIAL = frozenset({"attention.q_norm.weight", "attention.k_norm.weight"})

_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def spec_of(name: str) -> ParamSpec | None:
    return SHARDED.get(_LAYER_PREFIX.sub("", name))


def is_partial(name: str) -> bool:
    """Whether a replicated parameter's gradient is partial on each rank (summed over the TP
    group it is the replica's); the others' gradients are identical across the group."""
    return _LAYER_PREFIX.sub("", name) in PARTIAL


def unit_size(shape: ModelShape, kind: str) -> int:
    """Rows/columns of the split dimension per unit."""
    return shape.head_dim if kind in ("q_heads", "kv_heads") else 1


def element_index(shape: ModelShape, kind: str, units: Sequence[int]) -> torch.Tensor:
    """Indices along the split dimension covered by `units` (global ids or local positions)."""
    size = unit_size(shape, kind)
    ids = torch.as_tensor(list(units), dtype=torch.long)
    return (ids.unsqueeze(1) * size + torch.arange(size)).flatten()


def local_positions(held: Sequence[int], units: Sequence[int]) -> list[int]:
    """Positions of `units` inside the sorted unit list `held`."""
    where = {u: i for i, u in enumerate(held)}
    return [where[u] for u in units]


def local_index(
    shape: ModelShape,
    kind: str,
    held: Sequence[int],
    units: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Indices along a local tensor's split dimension (holding `held`) of the slices of `units`."""
    return element_index(shape, kind, local_positions(held, units)).to(device)


def slice_elements(t: torch.Tensor, dim: int) -> int:
    """Elements per index along `dim`: the size of one row/column of the split dimension."""
    return math.prod(n for i, n in enumerate(t.shape) if i != dim)


def dense_shape(shape: ModelShape, name: str, local: torch.Size) -> torch.Size:
    """The dense (whole-model) shape of a parameter whose local slice has shape `local`."""
    spec = spec_of(name)
    if spec is None:
        return torch.Size(local)
    full = list(local)
    full[spec.dim] = shape.unit_count(spec.kind) * unit_size(shape, spec.kind)
    return torch.Size(full)


def local_shape(
    shape: ModelShape, name: str, other: Sequence[int], shard: RankShard
) -> torch.Size:
    """The shape of `shard`'s slice of a parameter, from the dense shape or any rank's slice
    (they differ only along the split dimension)."""
    spec = spec_of(name)
    local = list(other)
    if spec is not None:
        local[spec.dim] = len(shard.units(spec.kind)) * unit_size(shape, spec.kind)
    return torch.Size(local)


def runs(ids: Sequence[int], positions: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first id, first local position, length) of each run of units consecutive in both: the
    pieces a local tensor holding `ids` at `positions` is cut into against the dense one."""
    found: list[tuple[int, int, int]] = []
    for u, pos in zip(ids, positions, strict=True):
        if found and found[-1][0] + found[-1][2] == u and found[-1][1] + found[-1][2] == pos:
            first, at, n = found[-1]
            found[-1] = (first, at, n + 1)
        else:
            found.append((u, pos, 1))
    return found


def counted_units(shards: Sequence[RankShard], rank: int, kind: str) -> list[int]:
    """The units `rank` answers for when a replica's units are each counted once.

    Every unit has one holder except KV heads, whose copies are counted at their lowest holder.
    """
    held = shards[rank].units(kind)
    if kind != "kv_heads":
        return list(held)
    lower = {g for shard in shards[:rank] for g in shard.kv_heads}
    return [g for g in held if g not in lower]


def pack_into(
    out: torch.Tensor, t: torch.Tensor, spec: ParamSpec, index: torch.Tensor, scale: float = 1.0
) -> None:
    """Write the slices at `index` (along the split dim) into flat `out`, unit-major, scaled."""
    moved = t.movedim(spec.dim, 0)
    moved = moved.reshape(moved.shape[0], -1)  # a strided view: 2-D weights, 1-D biases
    gather_rows(moved, index, out.view(len(index), moved.shape[1]), scale)


def pack(t: torch.Tensor, spec: ParamSpec, index: torch.Tensor) -> torch.Tensor:
    """Flatten the slices at `index` (along the split dim) unit-major."""
    out = t.new_empty(len(index) * (t.numel() // max(t.shape[spec.dim], 1)))
    pack_into(out, t, spec, index)
    return out


def unpack(
    flat: torch.Tensor, t: torch.Tensor, spec: ParamSpec, index: torch.Tensor, add: bool = False
) -> None:
    """Inverse of `pack`: write (or add) `flat` into `t` at `index` along the split dim."""
    moved_shape = (len(index), *t.movedim(spec.dim, 0).shape[1:])
    values = flat.view(moved_shape).movedim(0, spec.dim)
    if add:
        t.index_add_(spec.dim, index, values)
    else:
        t.index_copy_(spec.dim, index, values)
