"""Nonuniform tensor-parallel plan: unit ownership, mixed-TP sync mapping, batch split (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Literal

from tessera_contracts.generation import Generation, GenerationError
from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_contracts.vocabulary import FailurePolicy

Mode = Literal["ntp", "ntp-pw"]
MODES: tuple[str, ...] = ("ntp", "ntp-pw")

# The four kinds of sharding unit. kv_heads are never assigned directly: a rank holds a copy of
# every KV head whose query heads it holds.
UNIT_KINDS: tuple[str, ...] = ("q_heads", "kv_heads", "mlp_cols", "vocab_rows")
ASSIGNED_KINDS: tuple[str, ...] = ("q_heads", "mlp_cols", "vocab_rows")
LAYER_KINDS: tuple[str, ...] = ("q_heads", "kv_heads", "mlp_cols")


@dataclass(frozen=True)
class RankShard:
    """A set of sharding units (sorted ids per kind); a rank's shard or a piece of one.

    Local parameter slices follow the ids' ascending order, whatever the ids are.
    """

    q_heads: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    mlp_cols: tuple[int, ...] = ()
    vocab_rows: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        shape: ModelShape,
        q_heads: Iterable[int],
        mlp_cols: Iterable[int],
        vocab_rows: Iterable[int],
    ) -> RankShard:
        """A rank's shard, with the KV copies its query heads need."""
        q = tuple(sorted(q_heads))
        return cls(
            q_heads=q,
            kv_heads=tuple(sorted({shape.kv_of(h) for h in q})),
            mlp_cols=tuple(sorted(mlp_cols)),
            vocab_rows=tuple(sorted(vocab_rows)),
        )

    def units(self, kind: str) -> tuple[int, ...]:
        return getattr(self, kind)

    def is_empty(self) -> bool:
        return not any(self.units(kind) for kind in UNIT_KINDS)

    def elements(self, shape: ModelShape) -> int:
        """Parameter elements of these units over the whole model."""
        total = 0
        for kind in UNIT_KINDS:
            layers = 1 if kind == "vocab_rows" else shape.n_layers
            total += len(self.units(kind)) * shape.unit_elements(kind) * layers
        return total

    def to_dict(self) -> dict[str, list[int]]:
        return {kind: list(self.units(kind)) for kind in ASSIGNED_KINDS}


EMPTY = RankShard()


def layer_flops(shape: ModelShape, shard: RankShard) -> float:
    """Forward FLOPs of one transformer layer on this rank over one sequence."""
    return _counted_flops(shape, {kind: len(shard.units(kind)) for kind in LAYER_KINDS})


def _counted_flops(shape: ModelShape, counts: Mapping[str, int]) -> float:
    return sum(counts[kind] * shape.unit_flops(kind) for kind in LAYER_KINDS)


def imbalance(shape: ModelShape, shards: Sequence[RankShard]) -> float:
    """Max over mean of per-layer FLOPs across a replica's ranks (1.0 is perfect)."""
    flops = [layer_flops(shape, s) for s in shards]
    mean = sum(flops) / len(flops)
    return max(flops) / mean


def validate_replica(shape: ModelShape, shards: Sequence[RankShard]) -> None:
    """Raise PlanError unless the shards cover every unit exactly once with consistent KV copies."""
    if not shards:
        raise PlanError("a replica needs at least one rank")
    for kind in ASSIGNED_KINDS:
        seen: list[int] = sorted(u for s in shards for u in s.units(kind))
        if seen != list(range(shape.unit_count(kind))):
            missing = sorted(set(range(shape.unit_count(kind))) - set(seen))
            raise PlanError(
                f"{kind} must be covered exactly once across the replica's {len(shards)} ranks "
                f"(missing {missing[:8]}, {len(seen) - len(set(seen))} duplicated)"
            )
    for rank, shard in enumerate(shards):
        for kind in ASSIGNED_KINDS:
            if not shard.units(kind):
                raise PlanError(
                    f"rank {rank} holds no {kind}; every rank needs at least one unit of each "
                    f"kind ({', '.join(ASSIGNED_KINDS)})"
                )
        expected = RankShard.build(shape, shard.q_heads, shard.mlp_cols, shard.vocab_rows)
        if shard != expected:
            raise PlanError(f"rank {rank}: kv_heads must be exactly those of its query heads")


# ----------------------------------------------------------------------------------------------
# Planning one replica
# ----------------------------------------------------------------------------------------------


def _even_counts(total: int, n: int) -> list[int]:
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _integerize(real: Sequence[float], total: int) -> list[int]:
    """Round non-negative reals to integers with the given sum (largest remainder)."""
    floors = [int(x) for x in real]
    short = total - sum(floors)
    by_remainder = sorted(range(len(real)), key=lambda i: (floors[i] - real[i], i))
    for i in by_remainder[:short]:
        floors[i] += 1
    return floors


def _fill_counts(loads: Sequence[float], units: int, unit_cost: float) -> list[int]:
    """Spread `units` equal-cost units so that load + count * cost is as level as possible."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    level = 0.0
    for k in range(1, len(order) + 1):
        # Water level when only the k least-loaded ranks take units.
        level = (units * unit_cost + sum(loads[i] for i in order[:k])) / k
        if k == len(order) or level <= loads[order[k]]:
            break
    real = [max(0.0, (level - load) / unit_cost) for load in loads]
    return _integerize(real, units)


def _assign(counts: Sequence[int], align: Sequence[tuple[int, ...]] | None) -> list[list[int]]:
    """Unit ids per rank for the given counts.

    Without `align` each rank takes a contiguous block. With `align` (the sync partitions), rank p
    first takes the head of partition p and the partitions' tails are dealt to the ranks that still
    have room, so that most units are already on their partition's owner.
    """
    if align is None:
        out, start = [], 0
        for c in counts:
            out.append(list(range(start, start + c)))
            start += c
        return out
    out = [[] for _ in counts]
    pool: list[int] = []
    for p, part in enumerate(align):
        take = min(counts[p], len(part)) if p < len(counts) else 0
        out[p].extend(part[:take])
        pool.extend(part[take:])
    pos = 0
    for rank, c in enumerate(counts):
        room = c - len(out[rank])
        out[rank].extend(pool[pos : pos + room])
        pos += room
    return out


def _check_degree(shape: ModelShape, tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise PlanError(f"TP degree must be a positive integer, got {tp!r}")
    for kind in ASSIGNED_KINDS:
        if tp > shape.unit_count(kind):
            raise PlanError(
                f"TP degree {tp} exceeds the number of {kind} ({shape.unit_count(kind)}); "
                "every rank needs at least one of each"
            )


def _mlp_counts(shape: ModelShape, q_counts: Sequence[int], kv_counts: Sequence[int]) -> list[int]:
    """MLP columns per rank: each rank filled up to a common level of per-layer compute, so a
    rank holding an extra head or extra KV copies holds fewer columns. Every rank keeps at least
    one column (attention-heavy shapes would otherwise leave none)."""
    attention = [
        q * shape.unit_flops("q_heads") + kv * shape.unit_flops("kv_heads")
        for q, kv in zip(q_counts, kv_counts, strict=True)
    ]
    col = shape.unit_flops("mlp_cols")
    extra_cols = _fill_counts([a + col for a in attention], shape.ffn - len(q_counts), col)
    return [1 + c for c in extra_cols]


# A job runs at a few TP degrees at once, and each entry holds every unit id of the shape
# (about 36 bytes per id, up to 5.3 million ids at the CRD's largest shape): few entries.
@lru_cache(maxsize=8)
def _plan_replica(
    shape: ModelShape, tp: int, align_to: tuple[RankShard, ...] | None
) -> tuple[RankShard, ...]:
    def parts(kind: str) -> list[tuple[int, ...]] | None:
        return None if align_to is None else [s.units(kind) for s in align_to]

    # 1. Query heads: within one head of even; which heads follows the partitions.
    q = _assign(_even_counts(shape.n_heads, tp), parts("q_heads"))
    kv = [{shape.kv_of(h) for h in heads} for heads in q]
    # 2. MLP columns level the per-layer compute.
    mlp = _assign(_mlp_counts(shape, [len(h) for h in q], [len(g) for g in kv]), parts("mlp_cols"))
    # 3. Vocabulary rows: the LM head is its own barrier-separated stage, so it is split evenly
    #    on its own rather than traded against layer compute.
    vocab = _assign(_even_counts(shape.vocab, tp), parts("vocab_rows"))
    return tuple(RankShard.build(shape, q[i], mlp[i], vocab[i]) for i in range(tp))


def rank_layer_flops(shape: ModelShape, tp: int) -> tuple[float, ...]:
    """`layer_flops` of each rank of `plan_replica(shape, tp)`, from unit counts alone.

    What a planner needs (the busiest rank's work) without materializing the unit ids, whose
    size grows with the vocabulary and FFN: memory O(tp + heads) whatever the shape.
    """
    _check_degree(shape, tp)
    q_counts = _even_counts(shape.n_heads, tp)
    kv_counts, start = [], 0
    for count in q_counts:  # contiguous blocks of query heads, as `_assign` deals them
        kv_counts.append(len({shape.kv_of(h) for h in range(start, start + count)}))
        start += count
    mlp_counts = _mlp_counts(shape, q_counts, kv_counts)
    return tuple(
        _counted_flops(shape, {"q_heads": q, "kv_heads": kv, "mlp_cols": m})
        for q, kv, m in zip(q_counts, kv_counts, mlp_counts, strict=True)
    )


def plan_replica(
    shape: ModelShape, tp: int, align_to: Sequence[RankShard] | None = None
) -> tuple[RankShard, ...]:
    """Balanced shards for one replica at TP degree `tp`.

    With `align_to` (sync partitions, at most `tp` of them) the layout keeps per-rank compute equal
    while placing most of partition p on rank p, which minimizes gradient bytes exchanged.
    """
    _check_degree(shape, tp)
    if align_to is not None and len(align_to) > tp:
        raise PlanError(f"cannot align {tp} ranks to {len(align_to)} sync partitions")
    return _plan_replica(shape, tp, None if align_to is None else tuple(align_to))


# ----------------------------------------------------------------------------------------------
# Mixed-TP data parallelism
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSync:
    """Gradient exchange inside one replica's TP group.

    pieces[j][p] is the set of units rank j holds that belong to sync partition p. Rank p (p < P)
    owns partition p: every rank j sends it pieces[j][p] (KV copies are summed there), the owners
    all-reduce across replicas, and the owner sends pieces[j][p] back to rank j.
    """

    pieces: tuple[tuple[RankShard, ...], ...]

    @property
    def tp(self) -> int:
        return len(self.pieces)

    @property
    def n_partitions(self) -> int:
        return len(self.pieces[0])

    def sends(self, rank: int) -> tuple[RankShard, ...]:
        """What `rank` sends to each rank of its TP group (to owners; empty for non-owners)."""
        row = self.pieces[rank]
        return tuple(row[d] if d < len(row) else EMPTY for d in range(self.tp))

    def receives(self, rank: int) -> tuple[RankShard, ...]:
        """What `rank` receives from each TP-group rank (all empty unless it owns a partition)."""
        if rank >= self.n_partitions:
            return tuple(EMPTY for _ in range(self.tp))
        return tuple(self.pieces[src][rank] for src in range(self.tp))

    def is_local(self) -> bool:
        """True when every rank's units all belong to its own partition (nothing moves)."""
        return all(
            piece.is_empty()
            for j, row in enumerate(self.pieces)
            for p, piece in enumerate(row)
            if p != j
        )

    def exchanged_elements(self, shape: ModelShape, rank: int) -> int:
        """Gradient elements `rank` sends to other ranks per step (each way)."""
        return sum(
            piece.elements(shape) for dst, piece in enumerate(self.sends(rank)) if dst != rank
        )


@dataclass(frozen=True)
class ReplicaLayout:
    """One DP replica: its shards, its share of the batch and its sync exchange."""

    index: int
    tp: int
    shards: tuple[RankShard, ...]
    local_batch: int
    batch_offset: int
    rank_offset: int
    sync: ReplicaSync

    def global_rank(self, rank: int) -> int:
        return self.rank_offset + rank


@dataclass(frozen=True)
class JobLayout:
    """A whole job: replicas at possibly different TP degrees training one model."""

    shape: ModelShape
    mode: str
    global_batch: int
    partitions: tuple[RankShard, ...]
    replicas: tuple[ReplicaLayout, ...]

    @property
    def sync_degree(self) -> int:
        """P: the number of sync partitions (the smallest TP degree in the job)."""
        return len(self.partitions)

    @property
    def world_size(self) -> int:
        return sum(r.tp for r in self.replicas)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(r.tp for r in self.replicas)

    def sample_weight(self, replica: int) -> float:
        """The replica's gradient weight: its share of the global batch's samples."""
        return self.replicas[replica].local_batch / self.global_batch

    def locate(self, global_rank: int) -> tuple[int, int]:
        """(replica index, rank inside the replica) of a global rank."""
        for r in self.replicas:
            if r.rank_offset <= global_rank < r.rank_offset + r.tp:
                return r.index, global_rank - r.rank_offset
        raise PlanError(f"global rank {global_rank} outside a world of {self.world_size}")

    def owner_ranks(self, partition: int) -> tuple[int, ...]:
        """Global ranks that all-reduce partition p across replicas (rank p of each replica)."""
        return tuple(r.global_rank(partition) for r in self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": asdict(self.shape),
            "mode": self.mode,
            "global_batch": self.global_batch,
            "replicas": [[s.to_dict() for s in r.shards] for r in self.replicas],
            "sync_shards": [p.to_dict() for p in self.partitions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobLayout:
        try:
            shape = ModelShape(**data["shape"])

            def shards(items: Sequence[Mapping[str, Sequence[int]]]) -> list[RankShard]:
                return [
                    RankShard.build(shape, s["q_heads"], s["mlp_cols"], s["vocab_rows"])
                    for s in items
                ]

            return layout_from_shards(
                shape,
                [shards(r) for r in data["replicas"]],
                data["global_batch"],
                data["mode"],
                sync_shards=shards(data["sync_shards"]) if "sync_shards" in data else None,
                local_batches=data.get("local_batches"),
            )
        except (KeyError, TypeError) as exc:
            raise PlanError(f"malformed layout document: {exc!r}") from exc


def split_batch(global_batch: int, weights: Sequence[float]) -> list[int]:
    """Integer local batches proportional to `weights`, summing exactly to `global_batch`."""
    if not isinstance(global_batch, int) or global_batch < len(weights):
        raise PlanError(
            f"global batch {global_batch!r} must be an integer >= the number of replicas "
            f"({len(weights)})"
        )
    total = sum(weights)
    batches = _integerize([global_batch * w / total for w in weights], global_batch)
    if min(batches) < 1:
        raise PlanError(f"global batch {global_batch} leaves a replica without samples: {batches}")
    return batches


def sync_partitions(shape: ModelShape, shards: Sequence[RankShard]) -> tuple[RankShard, ...]:
    """Sync partitions defined by one (smallest) replica's shards.

    Each KV head goes to exactly one partition: the one holding most of its query heads.
    """
    counts = [[0] * len(shards) for _ in range(shape.n_kv_heads)]
    for p, s in enumerate(shards):
        for h in s.q_heads:
            counts[shape.kv_of(h)][p] += 1
    kv_home = {
        g: max(range(len(shards)), key=lambda p: (counts[g][p], -p))
        for g in range(shape.n_kv_heads)
    }
    return tuple(
        RankShard(
            q_heads=s.q_heads,
            kv_heads=tuple(g for g in range(shape.n_kv_heads) if kv_home[g] == p),
            mlp_cols=s.mlp_cols,
            vocab_rows=s.vocab_rows,
        )
        for p, s in enumerate(shards)
    )


def _replica_sync(shards: tuple[RankShard, ...], partitions: tuple[RankShard, ...]) -> ReplicaSync:
    home = {
        kind: {u: p for p, part in enumerate(partitions) for u in part.units(kind)}
        for kind in UNIT_KINDS
    }
    pieces = []
    for shard in shards:
        split: list[dict[str, list[int]]] = [{k: [] for k in UNIT_KINDS} for _ in partitions]
        for kind in UNIT_KINDS:
            for u in shard.units(kind):
                split[home[kind][u]][kind].append(u)
        pieces.append(tuple(RankShard(**{k: tuple(v) for k, v in d.items()}) for d in split))
    return ReplicaSync(pieces=tuple(pieces))


def layout_from_shards(
    shape: ModelShape,
    replica_shards: Sequence[Sequence[RankShard]],
    global_batch: int,
    mode: str,
    sync_shards: Sequence[RankShard] | None = None,
    local_batches: Sequence[int] | None = None,
) -> JobLayout:
    """A job layout from explicit per-replica shards (any valid layouts, contiguous or not).

    The sync partitions come from `sync_shards` (a full layout with at most as many ranks as the
    smallest replica), by default from the smallest replica itself. `local_batches` overrides
    the batch rule's split (a pipeline stage takes its replica's, tessera_core.stages).
    """
    if mode not in MODES:
        raise PlanError(f"mode must be one of {MODES}, got {mode!r}")
    if not replica_shards:
        raise PlanError("a job needs at least one replica")
    # Replicas at one degree usually share one layout: validate and map each distinct one once.
    distinct = {tuple(shards) for shards in replica_shards}
    for shards in distinct:
        validate_replica(shape, shards)
    smallest = min(replica_shards, key=len)
    if sync_shards is None:
        sync_shards = smallest
    elif len(sync_shards) > len(smallest):
        raise PlanError(
            f"{len(sync_shards)} sync partitions need every replica to have at least as many ranks"
        )
    if tuple(sync_shards) not in distinct:
        validate_replica(shape, sync_shards)
    partitions = sync_partitions(shape, sync_shards)
    degrees = [len(s) for s in replica_shards]
    if local_batches is None:
        batches = split_batch(global_batch, degrees if mode == "ntp" else [1] * len(degrees))
    elif len(local_batches) != len(degrees) or sum(local_batches) != global_batch \
            or min(local_batches) < 1:
        raise PlanError(f"local batches {list(local_batches)} must give each of the "
                        f"{len(degrees)} replicas samples, {global_batch} in all")
    else:
        batches = list(local_batches)
    syncs: dict[tuple[RankShard, ...], ReplicaSync] = {}
    replicas, rank_offset, batch_offset = [], 0, 0
    for i, shards in enumerate(replica_shards):
        key = tuple(shards)
        if key not in syncs:
            syncs[key] = _replica_sync(key, partitions)
        replicas.append(
            ReplicaLayout(
                index=i,
                tp=len(key),
                shards=key,
                local_batch=batches[i],
                batch_offset=batch_offset,
                rank_offset=rank_offset,
                sync=syncs[key],
            )
        )
        rank_offset += len(key)
        batch_offset += batches[i]
    return JobLayout(
        shape=shape,
        mode=mode,
        global_batch=global_batch,
        partitions=partitions,
        replicas=tuple(replicas),
    )


def plan_job(
    shape: ModelShape, tp_degrees: Sequence[int], global_batch: int, mode: str = "ntp"
) -> JobLayout:
    """Plan a mixed-TP data-parallel job.

    The smallest degree P defines the sync partitions (its contiguous balanced layout); every
    larger replica gets a balanced layout aligned to them: core ranks 0..P-1 hold most of their
    partition, extra ranks the partitions' tails. Plain NTP gives each replica a local batch
    proportional to its TP degree, NTP-PW equal batches.
    """
    if not tp_degrees:
        raise PlanError("a job needs at least one replica")
    p = min(tp_degrees)
    base = plan_replica(shape, p)
    by_degree = {
        tp: base if tp == p else plan_replica(shape, tp, align_to=base) for tp in set(tp_degrees)
    }
    return layout_from_shards(shape, [by_degree[tp] for tp in tp_degrees], global_batch, mode)


# The gradient sync's bucket cap, in dense elements (about 1/TP of it on each rank).
DEFAULT_BUCKET_ELEMENTS = 50_000_000


def bucket_groups(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Consecutive parameter groups merged into gradient buckets of about `cap` elements.

    `sizes` are the groups' DENSE element counts in backward order, so every rank of every
    layout cuts the same buckets (the collectives of a bucket must match across ranks). A bucket
    takes groups until it holds at least `cap` elements; the last one may be smaller.
    """
    if not isinstance(cap, int) or cap < 1:
        raise PlanError(f"bucket size must be a positive integer, got {cap!r}")
    buckets: list[list[int]] = []
    filled = cap
    for i, size in enumerate(sizes):
        if filled >= cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


# ----------------------------------------------------------------------------------------------
# Live reconfiguration
# ----------------------------------------------------------------------------------------------


def reshard_moves(
    old: JobLayout, new: JobLayout, origin: Sequence[int | None]
) -> tuple[tuple[RankShard, ...], ...]:
    """Where every rank of the new layout gets the units (weights and optimizer state) it holds.

    `origin[d]` is the old global rank of the process that becomes new global rank d, or None
    for a process that held nothing (a returning GPU). Returns moves[d][s]: the units new rank d
    receives from new rank s (s == d: already held). A missing unit comes from a survivor holding
    it, preferably in the process's own old replica (the same scale-up domain), otherwise from a
    DP peer, spreading the load over the holders.
    """
    if old.shape != new.shape:
        raise PlanError(f"cannot reshard between shapes {old.shape} and {new.shape}")
    survivors = [o for o in origin if o is not None]
    if len(origin) != new.world_size or len(set(survivors)) != len(survivors):
        raise PlanError(f"origin must name {new.world_size} ranks, survivors distinct")
    if not survivors or any(not 0 <= o < old.world_size for o in survivors):
        raise PlanError(f"origin needs survivors, all within the old world of {old.world_size}")
    new_rank = {o: d for d, o in enumerate(origin) if o is not None}
    old_shard = {}
    old_replica = {}
    for rep in old.replicas:
        for j, shard in enumerate(rep.shards):
            old_shard[rep.global_rank(j)] = shard
            old_replica[rep.global_rank(j)] = rep.index
    # 1. What each new rank keeps and what it lacks (set work: most units stay where they are).
    new_ranks = [(rep, j, shard) for rep in new.replicas for j, shard in enumerate(rep.shards)]
    kept: list[dict[str, list[int]]] = []
    lacking: list[dict[str, list[int]]] = []
    for rep, j, shard in new_ranks:
        me = origin[rep.global_rank(j)]
        held = {k: set() if me is None else set(old_shard[me].units(k)) for k in UNIT_KINDS}
        kept.append({k: [u for u in shard.units(k) if u in held[k]] for k in UNIT_KINDS})
        lacking.append({k: [u for u in shard.units(k) if u not in held[k]] for k in UNIT_KINDS})
    # 2. The survivors holding each lacking unit.
    holders: dict[str, dict[int, list[int]]] = {kind: {} for kind in UNIT_KINDS}
    # and those in each old replica: one there is the source whatever the load
    near: dict[str, dict[tuple[int, int], list[int]]] = {kind: {} for kind in UNIT_KINDS}
    for kind in UNIT_KINDS:
        wanted = {u for need in lacking for u in need[kind]}
        for o in survivors:
            for u in old_shard[o].units(kind):
                if u in wanted:
                    holders[kind].setdefault(u, []).append(o)
                    near[kind].setdefault((u, old_replica[o]), []).append(o)
    # 3. A source for each lacking unit, in rank, kind and unit order, spreading the load.
    load = dict.fromkeys(survivors, 0)
    moves = []
    for (rep, j, _), keep, need in zip(new_ranks, kept, lacking, strict=True):
        me = origin[rep.global_rank(j)]
        mine = old_replica.get(me)
        got: dict[int, dict[str, list[int]]] = {}
        for kind in UNIT_KINDS:
            if keep[kind]:
                got.setdefault(new_rank[me], {})[kind] = list(keep[kind])
            for u in need[kind]:
                if u not in holders[kind]:
                    raise PlanError(f"{kind} {u} survives on no rank: restore from a checkpoint")
                # the least loaded holder in its own old replica, else the least loaded of all
                candidates = near[kind].get((u, mine)) or holders[kind][u]
                src = candidates[0] if len(candidates) == 1 else min(
                    candidates, key=lambda o: (load[o], o))
                load[src] += 1
                got.setdefault(new_rank[src], {}).setdefault(kind, []).append(u)
        moves.append(
            tuple(
                RankShard(**{k: tuple(v) for k, v in got.get(s, {}).items()})
                for s in range(new.world_size)
            )
        )
    return tuple(moves)


def generation_layout(gen: Generation) -> JobLayout:
    """The unit layout every rank computes alike from a generation document."""
    try:
        return plan_job(gen.model, gen.tp_degrees, gen.global_batch,
                        FailurePolicy(gen.mode).batch_rule)
    except PlanError as exc:
        raise GenerationError("replicas", f"cannot be planned: {exc}") from exc
