"""Mixed-TP data-parallel gradient sync, executing the plan's exchange from gradient hooks.

Per bucket (a few layers' parameters, in backward order) the sync runs four stages:
  0. every rank packs its gradient slices per sync partition, scaled by its replica's sample
     weight, and sends them to the partition owners (all_to_all_single inside the TP group);
  1. each owner sums what it received (KV copies add up) into its partition buffer and
     all-reduces it with the owners of the same partition in the other replicas;
  2. the owner sends every rank its units' synced gradients back (reverse all_to_all_single);
  3. ranks write them into .grad. Replicated parameters (norms) are averaged over the world:
     a norm before a TP region has the same gradient on every rank of a replica, which its
     rank 0 contributes; a per-head QK norm's gradient is partial on each rank, and all of
     them contribute.
Each bucket's stage 0 starts when its last gradient is accumulated; every launch advances the
older buckets by one stage, so the exchange overlaps the rest of backward. The order of
collectives on each group is the same on all its ranks because it only depends on bucket order.
With micro-batches, the backward passes before the last run under `no_sync`: their gradients
accumulate locally and the sync overlaps the last one's backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ntp.groups import JobGroups
from ntp.sharding import (
    ParamSpec,
    dense_shape,
    is_partial,
    local_index,
    local_positions,
    pack_into,
    slice_elements,
    spec_of,
    unit_size,
    unpack,
)
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import DEFAULT_BUCKET_ELEMENTS, JobLayout, RankShard, bucket_groups


@dataclass
class _Route:
    """One sharded parameter's part in the exchange."""

    param: nn.Parameter
    spec: ParamSpec
    unit_elements: int
    send_index: list[torch.Tensor]  # per TP rank: split-dim indices of the units sent there
    send_units: list[int]
    recv_pos: list[torch.Tensor]  # owner only, per TP rank: unit positions in the partition
    partition_units: int


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    routes: list[_Route]
    replicated: list[nn.Parameter]
    replicated_weights: list[float] = field(default_factory=list)  # each one's share
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    ready: int = 0
    stage: int = 0
    work: dist.Work | None = None
    replicated_work: dist.Work | None = None
    partition: torch.Tensor | None = None
    inbox: torch.Tensor | None = None
    replicated_flat: torch.Tensor | None = None


Named = list[tuple[str, nn.Parameter]]


def bucket_parameters(named: Named, shape: ModelShape, cap: int) -> list[Named]:
    """A shard's parameters in gradient buckets, in the order backward produces them.

    Groups (the LM head with the final norm, each layer, the embedding) are merged by their
    dense sizes, so the buckets are the same on every rank whatever its shard. A tied LM head
    is the embedding, whose gradient is complete only once the embedding's use is.
    """
    by_layer: dict[str, Named] = {}
    for name, p in named:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        by_layer.setdefault(key, []).append((name, p))
    # A pipeline stage holds the head only if last, the embedding only if first.
    head = by_layer.pop("output.weight", []) + by_layer.pop("norm.weight", [])
    embedding = by_layer.pop("tok_embeddings.weight", [])
    groups = [g for g in (head, *reversed(list(by_layer.values())), embedding) if g]
    sizes = [sum(dense_shape(shape, n, p.shape).numel() for n, p in g) for g in groups]
    return [[item for i in bucket for item in groups[i]] for bucket in bucket_groups(sizes, cap)]


class GradSync:
    """Synchronizes one rank's gradients with every replica of a mixed-TP job."""

    def __init__(
        self,
        model: nn.Module,
        layout: JobLayout,
        groups: JobGroups,
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
        overlap: bool = True,
    ) -> None:
        self.layout = layout
        self.overlap = overlap
        self.groups = groups
        replica = layout.replicas[groups.replica]
        self.shape = layout.shape
        self.shard = replica.shards[groups.rank]
        self.sync = replica.sync
        self.is_owner = groups.rank < layout.sync_degree
        # Every rank owning exactly its own units (uniform TP) leaves nothing to exchange.
        self.local_exchange = self.sync.is_local()
        self.weight = layout.sample_weight(groups.replica)
        # Replicated gradients identical across a TP group are contributed by its rank 0 alone;
        # partial ones (per-head QK norms) by every rank, so they add up to the replica's.
        self.replicated_weight = self.weight if groups.rank == 0 else 0.0
        named = list(model.named_parameters())
        self._buckets = [
            self._build_bucket(bucket)
            for bucket in bucket_parameters(named, self.shape, bucket_elements)
        ]
        self._inflight: list[_Bucket] = []
        self._accumulating = False
        self._empty = torch.zeros(0, device=next(model.parameters()).device)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad(b))
            for bucket in self._buckets
            for p in bucket.params
        ]

    # -- setup ----------------------------------------------------------------------------------

    def _route(self, p: nn.Parameter, spec: ParamSpec) -> _Route:
        kind, tp = spec.kind, self.sync.tp
        held = self.shard.units(kind)
        sends = self.sync.sends(self.groups.rank)
        receives = self.sync.receives(self.groups.rank)
        partition: RankShard = (
            self.layout.partitions[self.groups.rank] if self.is_owner else RankShard()
        )
        part_units = partition.units(kind)
        return _Route(
            param=p,
            spec=spec,
            # From the other dimensions, so a rank holding no unit of this kind works too.
            unit_elements=unit_size(self.shape, kind) * slice_elements(p, spec.dim),
            send_index=[
                local_index(self.shape, kind, held, sends[d].units(kind), p.device)
                for d in range(tp)
            ],
            send_units=[len(sends[d].units(kind)) for d in range(tp)],
            recv_pos=[
                torch.tensor(
                    local_positions(part_units, receives[s].units(kind)),
                    dtype=torch.long,
                    device=p.device,
                )
                for s in range(tp)
            ],
            partition_units=len(part_units),
        )

    def _build_bucket(self, named: list[tuple[str, nn.Parameter]]) -> _Bucket:
        routes, replicated, weights = [], [], []
        for name, p in named:
            spec = spec_of(name)
            if spec is None:
                replicated.append(p)
                weights.append(self.weight if is_partial(name) else self.replicated_weight)
            else:
                routes.append(self._route(p, spec))
        bucket = _Bucket(params=[p for _, p in named], routes=routes, replicated=replicated,
                         replicated_weights=weights)
        tp = self.sync.tp
        bucket.send_splits = [
            sum(r.send_units[d] * r.unit_elements for r in routes) for d in range(tp)
        ]
        bucket.recv_splits = [
            sum(len(r.recv_pos[s]) * r.unit_elements for r in routes) for s in range(tp)
        ]
        return bucket

    # -- the pipeline ---------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients locally and sync nothing: the
        micro-batches before the last."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _on_grad(self, bucket: _Bucket) -> None:
        if self._accumulating:
            return
        bucket.ready += 1
        if self.overlap and bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        self._advance()
        self._exchange(bucket)
        self._inflight.append(bucket)

    def _advance(self) -> None:
        for bucket in list(self._inflight):
            stage = (self._reduce, self._return, self._write)[bucket.stage - 1]
            stage(bucket)
            if bucket.stage == 4:
                self._inflight.remove(bucket)

    def _all_to_all(
        self, bucket: _Bucket, data: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        out = data.new_empty(sum(out_splits))
        if self.local_exchange:
            out.copy_(data)
            bucket.work = None
        else:
            bucket.work = dist.all_to_all_single(
                out, data, out_splits, in_splits, group=self.groups.tp_sync, async_op=True
            )
        return out

    def _exchange(self, bucket: _Bucket) -> None:
        """Stage 0: send weighted gradient slices to the partition owners."""
        outgoing = self._empty.new_empty(sum(bucket.send_splits))
        offset = 0
        for d in range(self.sync.tp):
            for r in bucket.routes:
                size = r.send_units[d] * r.unit_elements
                pack_into(
                    outgoing[offset : offset + size],
                    r.param.grad,
                    r.spec,
                    r.send_index[d],
                    self.weight,
                )
                offset += size
        bucket.inbox = self._all_to_all(bucket, outgoing, bucket.recv_splits, bucket.send_splits)
        if bucket.replicated:
            bucket.replicated_flat = torch.cat([
                p.grad.reshape(-1) * w
                for p, w in zip(bucket.replicated, bucket.replicated_weights, strict=True)
            ])
            bucket.replicated_work = dist.all_reduce(
                bucket.replicated_flat, group=self.groups.world, async_op=True
            )
        bucket.stage = 1

    def _partition_views(self, bucket: _Bucket) -> list[torch.Tensor]:
        assert bucket.partition is not None
        views, offset = [], 0
        for r in bucket.routes:
            size = r.partition_units * r.unit_elements
            views.append(bucket.partition[offset : offset + size].view(-1, r.unit_elements))
            offset += size
        return views

    def _reduce(self, bucket: _Bucket) -> None:
        """Stage 1: owners sum the received slices and all-reduce them across replicas."""
        if bucket.work is not None:
            bucket.work.wait()
        bucket.work = None
        if self.is_owner:
            assert bucket.inbox is not None
            total = sum(r.partition_units * r.unit_elements for r in bucket.routes)
            bucket.partition = bucket.inbox.new_zeros(total)
            views = self._partition_views(bucket)
            offset = 0
            for s in range(self.sync.tp):
                for r, view in zip(bucket.routes, views, strict=True):
                    size = len(r.recv_pos[s]) * r.unit_elements
                    chunk = bucket.inbox[offset : offset + size].view(-1, r.unit_elements)
                    view.index_add_(0, r.recv_pos[s], chunk)
                    offset += size
            if len(self.layout.replicas) > 1:
                assert self.groups.dp_owner is not None
                bucket.work = dist.all_reduce(
                    bucket.partition, group=self.groups.dp_owner, async_op=True
                )
        bucket.stage = 2

    def _return(self, bucket: _Bucket) -> None:
        """Stage 2: owners send each rank the synced gradients of the units it holds."""
        if bucket.work is not None:
            bucket.work.wait()
        chunks: list[torch.Tensor] = []
        if self.is_owner:
            views = self._partition_views(bucket)
            chunks = [
                view.index_select(0, r.recv_pos[s]).reshape(-1)
                for s in range(self.sync.tp)
                for r, view in zip(bucket.routes, views, strict=True)
            ]
        outgoing = torch.cat(chunks) if chunks else self._empty
        bucket.inbox = self._all_to_all(bucket, outgoing, bucket.send_splits, bucket.recv_splits)
        bucket.stage = 3

    def _write(self, bucket: _Bucket) -> None:
        """Stage 3: write synced gradients into .grad."""
        if bucket.work is not None:
            bucket.work.wait()
        assert bucket.inbox is not None
        offset = 0
        for d in range(self.sync.tp):
            for r in bucket.routes:
                size = r.send_units[d] * r.unit_elements
                unpack(bucket.inbox[offset : offset + size], r.param.grad, r.spec, r.send_index[d])
                offset += size
        if bucket.replicated_work is not None:
            bucket.replicated_work.wait()
            offset = 0
            for p in bucket.replicated:
                p.grad.copy_(bucket.replicated_flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        bucket.work = bucket.replicated_work = None
        bucket.inbox = bucket.partition = bucket.replicated_flat = None
        bucket.stage = 4

    def close(self) -> None:
        """Remove the gradient hooks. They are held by the parameters from outside Python's
        reach, so without this the sync and the model it hooks keep each other alive after the
        generation is left."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def finish(self) -> None:
        """Complete every bucket's sync; call after backward, before the optimizer step."""
        missing = [b for b in self._buckets if b.ready != len(b.params)]
        if missing:
            raise RuntimeError(
                f"{len(missing)} gradient bucket(s) never became ready: every parameter must "
                "receive a gradient in each backward pass"
            )
        if not self.overlap:
            for bucket in self._buckets:
                self._launch(bucket)
        while self._inflight:
            self._advance()
        for bucket in self._buckets:
            bucket.ready = bucket.stage = 0
