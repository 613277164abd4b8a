"""Optimizer state sharded across data-parallel replicas (ZeRO-1 over a nonuniform layout): which
rank keeps each unit's AdamW moments and master weights (pure).

Every unit has one owner replica, chosen by the unit alone, so every rank of every layout agrees
without talking: replicas own shares in proportion to their TP degree, so each rank owns about
1 / (the job's ranks) of the model whatever its replica's degree. Within the owner replica the
rank holding the unit owns it (a KV head: its lowest holder). A head's state is large (2 x
head_dim x hidden a layer) and a rank holds few heads, so a head is owned layer by layer; MLP
columns and vocabulary rows are small and many, owned by id in every layer alike. Consecutive
ids are spread by a golden-ratio sequence, so the run of units one rank holds is split nearly
exactly in proportion. Replicated tensors (norm gains) are owned whole, each by rank 0 of its
owner replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import UNIT_KINDS, JobLayout, RankShard

# 2**32 over the golden ratio: unit u lands at the fraction {u / phi}, a sequence whose every
# run of consecutive ids covers [0, 1) nearly evenly (the three-distance theorem).
_GOLDEN = 0x9E3779B9
# Each kind starts at another point of the sequence, so unit 0 of every kind does not land on
# the same replica.
_KIND_OFFSET = {kind: i * 0x3C6EF372 for i, kind in enumerate((*UNIT_KINDS, "replicated"))}
HEAD_KINDS = ("q_heads", "kv_heads")
# A head's place in the sequence: its layer times this many, plus its id (more than any
# model's heads, so no two heads of a job share a place).
_HEADS_PER_LAYER = 1 << 16


def owner_replica(kind: str, unit: int, degrees: Sequence[int], layer: int = 0) -> int:
    """The replica that keeps the state of `unit` (of `kind`, or the index of a replicated
    tensor for "replicated") in `layer` (heads only: other kinds are owned alike in every
    layer), in a job whose replicas run at `degrees`."""
    world = sum(degrees)
    index = layer * _HEADS_PER_LAYER + unit if kind in HEAD_KINDS else unit
    slot = (((index * _GOLDEN + _KIND_OFFSET[kind]) & 0xFFFFFFFF) * world) >> 32
    for replica, tp in enumerate(degrees):
        if slot < tp:
            return replica
        slot -= tp
    raise AssertionError("unreachable: slot < sum(degrees)")


def _owned(layout: JobLayout, replica: int, rank: int, kind: str, layer: int) -> tuple[int, ...]:
    shards = layout.replicas[replica].shards
    lower_kv = {g for shard in shards[:rank] for g in shard.kv_heads} if kind == "kv_heads" else ()
    degrees = layout.tp_degrees
    return tuple(
        u for u in shards[rank].units(kind)
        if owner_replica(kind, u, degrees, layer) == replica and u not in lower_kv
    )


def owned_units(layout: JobLayout, replica: int, rank: int, layer: int = 0) -> RankShard:
    """The units of rank `rank` of `replica` whose AdamW state (and master weights) it keeps in
    `layer` (vocabulary rows: the embedding's and the LM head's, whatever `layer`)."""
    return RankShard(**{kind: _owned(layout, replica, rank, kind, layer) for kind in UNIT_KINDS})


def owns_replicated(layout: JobLayout, replica: int, rank: int, index: int) -> bool:
    """Whether this rank keeps the state of the `index`-th replicated tensor."""
    return rank == 0 and owner_replica("replicated", index, layout.tp_degrees) == replica


def owned_elements(layout: JobLayout, replica: int, rank: int) -> int:
    """Parameter elements whose state this rank keeps, over the whole model."""
    shape: ModelShape = layout.shape
    total = shape.n_layers * shape.unit_elements("mlp_cols") * len(
        _owned(layout, replica, rank, "mlp_cols", 0))
    total += shape.unit_elements("vocab_rows") * len(_owned(layout, replica, rank, "vocab_rows", 0))
    for kind in HEAD_KINDS:
        total += shape.unit_elements(kind) * sum(
            len(_owned(layout, replica, rank, kind, layer)) for layer in range(shape.n_layers))
    replicated = sum(owns_replicated(layout, replica, rank, i)
                     for i in range(2 * shape.n_layers + 1))
    return total + shape.hidden * replicated


def _owners(kind: str, count: int, degrees: tuple[int, ...], layer: int) -> list[int]:
    """The owner replica of every unit of `kind` in `layer`, each computed once."""
    return [owner_replica(kind, u, degrees, layer) for u in range(count)]


def owned_elements_by_rank(layout: JobLayout) -> dict[tuple[int, int], int]:
    """`owned_elements` of every (replica, rank) of `layout` in one pass: each unit's owner is
    computed once, and only the owner replica's holder counts it (a KV head: its lowest)."""
    shape: ModelShape = layout.shape
    degrees = layout.tp_degrees
    out = {(rep.index, j): 0 for rep in layout.replicas for j in range(rep.tp)}
    holder: dict[str, list[dict[int, int]]] = {kind: [] for kind in UNIT_KINDS}
    for rep in layout.replicas:
        for kind in UNIT_KINDS:
            held: dict[int, int] = {}
            for j, shard in enumerate(rep.shards):
                for u in shard.units(kind):
                    held.setdefault(u, j)  # ranks in order: a KV head's lowest holder first
            holder[kind].append(held)

    def add(kind: str, layer: int, elements: int) -> None:
        for u, owner in enumerate(_owners(kind, shape.unit_count(kind), degrees, layer)):
            rank = holder[kind][owner].get(u)
            if rank is not None:
                out[owner, rank] += elements

    add("mlp_cols", 0, shape.n_layers * shape.unit_elements("mlp_cols"))
    add("vocab_rows", 0, shape.unit_elements("vocab_rows"))
    for kind in HEAD_KINDS:
        for layer in range(shape.n_layers):
            add(kind, layer, shape.unit_elements(kind))
    for i in range(2 * shape.n_layers + 1):
        out[owner_replica("replicated", i, degrees), 0] += shape.hidden
    return out
