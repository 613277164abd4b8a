"""Memory per GPU of an NTP job: what each rank allocates in a training step and in a relayout,
for the healthy layout and every degraded layout its failure policy can reach (pure).

Each term counts the tensors the trainer (trainer_image/ntp) allocates, not a textbook figure:

- weights: the model's parameters as it computes with them (fp32; bf16 under `bf16`) and its
  buffers (RoPE rotations, the vocabulary lookups);
- master: fp32 master weights kept apart from bf16 weights (`bf16` only; with sharded state
  only the units the rank owns, `tessera_core.sharded_state`);
- gradients: fp32, every local parameter's (persistent main gradients under `bf16`; under `fp32`
  allocated by the first backward of a step and freed after the optimizer step);
- optimizer: AdamW's two fp32 moments (only the owned units with sharded state);
- activations: what autograd saves for backward in one micro-batch, layer by layer, as
  `ntp.model` computes (flash attention: nothing quadratic in the sequence), with a checkpointed
  layer keeping only its input until its recomputation;
- loss: the vocabulary-parallel cross entropy's logits, softmax and gradient (per token, local
  vocabulary rows);
- communication: the gradient sync's buffers per bucket and stage (`ntp.grad_sync`: packed
  slices out, the owner's inbox, partition and return chunks), overlapped with backward;
- reshard: a live relayout onto the layout (`ntp.reshard.exchange_state`): the old state, the
  packed slices sent (twice: the chunks and their concatenation), those received, the moved
  state and the new shard's weights, all at once at its worst.

`peak` replays one step's allocations in order (forward, backward layer by layer with the buckets'
launches, the sync's drain, the optimizer step, and every micro-batch) and takes the most live
at once. `fits` compares it, and the reshard's, with the GPU's memory less `reserve` (the CUDA
context, NCCL's own buffers and the allocator's fragmentation, which no tensor count sees).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_contracts.vocabulary import FailurePolicy
from tessera_core.plan import (
    DEFAULT_BUCKET_ELEMENTS,
    JobLayout,
    RankShard,
    bucket_groups,
    plan_job,
    reshard_moves,
)
from tessera_core.sharded_state import owned_elements, owned_elements_by_rank

PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
CHECKPOINTING: tuple[str, ...] = ("none", "full", "selective")

GIB = 1 << 30
# Outside the allocator's count: the CUDA context and NCCL's buffers (fixed), and the caching
# allocator's fragmentation (a share of what it holds). Assumed, not measured here.
RESERVE_FIXED = 2 * GIB
RESERVE_SHARE = 0.05


@dataclass(frozen=True)
class Training:
    """What a job's spec says that changes its ranks' memory."""

    precision: str = "fp32"
    micro_batch: int | None = None  # sequences per forward; None: a replica's whole local batch
    checkpointing: str = "none"  # activation checkpointing: none, full or selective
    checkpoint_every: int = 2  # selective: one layer in every `checkpoint_every` is recomputed
    sharded_state: bool = False  # AdamW state (and master weights) sharded across replicas
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS  # the gradient sync's bucket cap (dense)
    overlap: bool = True  # the sync overlaps backward

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise PlanError(
                f"activation checkpointing must be one of {CHECKPOINTING}, "
                f"got {self.checkpointing!r}"
            )
        if self.micro_batch is not None and self.micro_batch < 1:
            raise PlanError(f"micro-batch size must be at least 1, got {self.micro_batch}")
        if self.checkpoint_every < 1:
            raise PlanError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")

    def checkpointed(self, layer: int) -> bool:
        """Whether `layer` keeps only its input and is recomputed in backward."""
        return is_checkpointed(layer, self.checkpointing, self.checkpoint_every)


def is_checkpointed(layer: int, mode: str, every: int) -> bool:
    """Whether activation checkpointing `mode` recomputes `layer`: every layer (full), layers 0,
    every, 2 x every, ... (selective), none (none)."""
    return mode == "full" or (mode == "selective" and layer % every == 0)


@dataclass(frozen=True)
class Bytes:
    """Bytes per element of each kind of tensor under a precision (`bf16`: the forward and
    backward under bfloat16 autocast over fp32 weights)."""

    activation: int  # the matmuls' outputs and inputs autograd saves, and the logits
    cast: int  # autocast's copy of each linear weight, from its forward to its backward


BYTES = {
    "fp32": Bytes(activation=4, cast=0),
    "bf16": Bytes(activation=2, cast=2),
}
WEIGHT = 4  # parameters are fp32 under every precision
MASTER = 4  # with sharded state: an fp32 copy of each owned unit, AdamW's own parameter
GRAD = 4  # gradients and their reductions are fp32 under every precision
MOMENTS = 8  # AdamW's exp_avg and exp_avg_sq, fp32
INDEX = 8  # int64


@dataclass(frozen=True)
class LocalModel:
    """One rank's shard in counts: per-layer units, vocabulary rows, parameter elements."""

    shape: ModelShape
    q_heads: int
    kv_heads: int
    mlp_cols: int
    vocab_rows: int

    @classmethod
    def of(cls, shape: ModelShape, shard: RankShard) -> LocalModel:
        return cls(shape, len(shard.q_heads), len(shard.kv_heads), len(shard.mlp_cols),
                   len(shard.vocab_rows))

    @property
    def layer_elements(self) -> int:
        """One layer's sharded parameter elements (norm gains apart)."""
        s = self.shape
        return (self.q_heads * s.unit_elements("q_heads") + self.kv_heads
                * s.unit_elements("kv_heads") + self.mlp_cols * s.unit_elements("mlp_cols"))

    @property
    def replicated_elements(self) -> int:
        """Norm gains: two per layer and the final one."""
        return (2 * self.shape.n_layers + 1) * self.shape.hidden

    @property
    def elements(self) -> int:
        s = self.shape
        return (s.n_layers * self.layer_elements + self.vocab_rows * s.unit_elements("vocab_rows")
                + self.replicated_elements)

    @property
    def largest_parameter(self) -> int:
        s = self.shape
        return s.hidden * max(self.q_heads * s.head_dim, self.kv_heads * s.head_dim,
                              self.mlp_cols, self.vocab_rows)

    @property
    def buffers(self) -> int:
        """RoPE rotations (complex128), the embedding's and LM head's vocabulary lookups and
        every layer's KV index (int64)."""
        s = self.shape
        rope = 16 * s.seq_len * (s.head_dim // 2)
        return rope + 2 * s.vocab * INDEX + s.n_layers * self.q_heads * INDEX

    # -- activations, per token of a micro-batch ----------------------------------------------

    def layer_activation(self, precision: str) -> int:
        """Bytes autograd saves per token in one layer (ntp.model.TransformerBlock).

        fp32: the layer input, both norms' normalized value and output, the block's mid
        residual (6 x hidden); the rotated queries, the keys and values expanded to the local
        query heads and the attention output (4 x local query width); the attention's
        log-sum-exp (one float per local head); the MLP's gate, its SiLU, the up projection and
        their product (4 x local columns); both norms' reciprocal RMS.
        bf16 (autocast): the fp32 input, normalized value and mid residual as in fp32, each
        projection's own bf16 copy of its norm's output (three for q, k, v; two for gate, up),
        the attention tensors and MLP products in bf16, the log-sum-exp in fp32: in bytes
        26 x hidden + 8 x local query width + 4 per local head + 8 x local columns.
        """
        s = self.shape
        q_width = self.q_heads * s.head_dim
        if precision == "fp32":
            return 4 * (6 * s.hidden + 4 * q_width + self.q_heads + 4 * self.mlp_cols) + 8
        return 26 * s.hidden + 8 * q_width + 4 * self.q_heads + 8 * self.mlp_cols + 8

    def layer_casts(self, precision: str) -> int:
        """Autocast's bf16 copies of one layer's linear weights (bf16; none in fp32)."""
        return BYTES[precision].cast * self.layer_elements

    def head_cast(self, precision: str) -> int:
        """Autocast's bf16 copy of the LM head."""
        return BYTES[precision].cast * self.vocab_rows * self.shape.hidden

    def residual(self) -> int:
        """Bytes per token of a layer's input, fp32 under every precision (the residual stream
        adds fp32 outputs): what a checkpointed layer keeps."""
        return 4 * self.shape.hidden

    def layer_constant(self, seq_len: int) -> int:
        """Per layer and micro-batch whatever its size: the RoPE rotations cast for q and k."""
        return 2 * 8 * seq_len * (self.shape.head_dim // 2)

    def final_norm(self, precision: str) -> int:
        """The final norm's input, normalized value and output (bf16: the output's cast for the
        LM head)."""
        return (12 if precision == "fp32" else 10) * self.shape.hidden + 4

    def embedding(self) -> int:
        """The token ids, the local rows looked up and the mask of rows held elsewhere."""
        return 3 * INDEX + 1


def _logit_bytes(precision: str) -> int:
    return BYTES[precision].activation


def _loss_forward(local: LocalModel, precision: str, tp: int) -> int:
    """Per token at the cross entropy's forward peak: the logits, their float32 copy under bf16,
    and (TP > 1) the shifted logits, their exponentials and the softmax it saves; TP 1 takes
    torch's log-softmax."""
    e = _logit_bytes(precision)
    upcast = 4 if e < 4 else 0
    return (e + upcast + (12 if tp > 1 else 4)) * local.vocab_rows


def _loss_saved(local: LocalModel) -> int:
    """Per token after the loss's forward: its softmax (or log-softmax), float32."""
    return 4 * local.vocab_rows


def _loss_backward(local: LocalModel, precision: str) -> int:
    """Per token at the loss's backward peak: the saved softmax, its copy with the targets
    subtracted, the product with the incoming gradient; under bf16, that cast back."""
    return (12 + (2 if precision == "bf16" else 0)) * local.vocab_rows


# ----------------------------------------------------------------------------------------------
# The gradient sync's buffers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketBuffers:
    """One bucket's sync on one rank, in fp32 elements (ntp.grad_sync)."""

    sent: int  # every local sharded element of the bucket, packed to its partition owner
    received: int  # owner: what its replica's ranks send it (KV copies included)
    partition: int  # owner: its partition of the bucket
    replicated: int  # norm gains, averaged over the world
    local: bool  # nothing crosses ranks (uniform TP): the exchange is a copy

    def stage(self, n: int) -> int:
        """Elements live after stage `n` (1: exchanged, 2: reduced, 3: returned; 4: written)."""
        out = 0 if self.local else self.sent
        return (
            out + self.received + self.replicated,
            self.received + self.partition + self.replicated,
            self.partition + (0 if self.local else self.received) + self.sent
            + self.replicated,
            0,
        )[n - 1]

    def running(self, n: int) -> int:
        """Elements live while stage `n` runs, its inputs and outputs both."""
        return (
            self.sent + self.received + 2 * self.replicated,
            self.received + self.partition + self.replicated,
            self.partition + 3 * self.received + self.sent + self.replicated,
            self.stage(3),
        )[n - 1]


def _group_elements(shape: ModelShape, shard: RankShard, group: str) -> int:
    """A shard's (or a sync piece's) sharded elements in one backward group."""
    if group == "head" or group == "embedding":
        return len(shard.vocab_rows) * shape.hidden
    return sum(len(shard.units(kind)) * shape.unit_elements(kind)
               for kind in ("q_heads", "kv_heads", "mlp_cols"))


def _groups(shape: ModelShape) -> list[tuple[str, int, int]]:
    """Backward groups in order (the LM head with the final norm, each layer from the last, the
    embedding): (kind, dense elements, replicated elements)."""
    h = shape.hidden
    layer = sum(shape.unit_count(kind) * shape.unit_elements(kind)
                for kind in ("q_heads", "kv_heads", "mlp_cols")) + 2 * h
    return (
        [("head", shape.vocab * h + h, h)]
        + [("layer", layer, 2 * h)] * shape.n_layers
        + [("embedding", shape.vocab * h, 0)]
    )


def sync_indices(layout: JobLayout, replica: int, rank: int) -> int:
    """Bytes of the sync's index tensors (int64, built once per layout): the local rows or
    columns of every unit it sends, and an owner's positions of every unit it receives."""
    shape = layout.shape
    rep = layout.replicas[replica]
    shard = rep.shards[rank]
    owner = rank < layout.sync_degree

    def rows(piece: RankShard, per_unit: bool) -> int:
        size = 1 if per_unit else shape.head_dim
        heads = 2 * (len(piece.q_heads) + len(piece.kv_heads)) * size
        return shape.n_layers * (heads + 3 * len(piece.mlp_cols)) + 2 * len(piece.vocab_rows)

    received = sum(rows(rep.sync.pieces[j][rank], True) for j in range(rep.tp)) if owner else 0
    return INDEX * (rows(shard, False) + received)


def bucket_buffers(layout: JobLayout, replica: int, rank: int, cap: int) -> list[BucketBuffers]:
    """Each gradient bucket's buffers on one rank, in backward order."""
    shape = layout.shape
    rep = layout.replicas[replica]
    shard = rep.shards[rank]
    owner = rank < layout.sync_degree
    part = layout.partitions[rank] if owner else RankShard()
    pieces = [rep.sync.pieces[j][rank] for j in range(rep.tp)] if owner else []
    groups = _groups(shape)
    out = []
    for bucket in bucket_groups([g[1] for g in groups], cap):
        kinds = [groups[i][0] for i in bucket]
        out.append(BucketBuffers(
            sent=sum(_group_elements(shape, shard, k) for k in kinds),
            received=sum(_group_elements(shape, p, k) for p in pieces for k in kinds),
            partition=sum(_group_elements(shape, part, k) for k in kinds),
            replicated=sum(groups[i][2] for i in bucket),
            local=rep.sync.is_local(),
        ))
    return out


# ----------------------------------------------------------------------------------------------
# One rank's memory
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory in bytes: each term standing alone, and the step's and the relayout's
    peaks (what is live at once)."""

    replica: int
    rank: int
    tp: int
    local_batch: int
    micro_batch: int
    weights: int
    master: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward in one micro-batch, all layers
    loss: int  # the cross entropy's peak
    communication: int  # the sync's buffers at their most, and its index tensors
    peak: int  # a training step
    peak_at: str  # when in the step
    reshard: int = 0  # a live relayout onto this layout (0: none planned)

    @property
    def most(self) -> int:
        return max(self.peak, self.reshard)


def activation_bytes(
    local: LocalModel, training: Training, tokens: int, seq_len: int
) -> int:
    """What one micro-batch of `tokens` saves for backward over all layers (at the end of its
    forward; a checkpointed layer holds its input), bf16 weight casts included."""
    p = training.precision
    full = (local.layer_activation(p) * tokens + local.layer_constant(seq_len)
            + local.layer_casts(p))
    kept = local.residual() * tokens
    layers = sum(kept if training.checkpointed(i) else full for i in range(local.shape.n_layers))
    return (layers + (local.embedding() + local.final_norm(p)) * tokens
            + local.head_cast(p))


class _Timeline:
    """The bytes live at each point of a step; keeps the most and where it was."""

    def __init__(self) -> None:
        self.most, self.at = 0, ""

    def see(self, live: int, at: str) -> None:
        if live > self.most:
            self.most, self.at = live, at


def rank_memory(
    layout: JobLayout,
    replica: int,
    rank: int,
    training: Training,
    owned: int | None = None,
) -> RankMemory:
    """One rank's memory in a steady training step on `layout` (AdamW state present); `owned`:
    the elements whose state it keeps with sharded state, when already counted."""
    shape = layout.shape
    rep = layout.replicas[replica]
    shard = rep.shards[rank]
    local = LocalModel.of(shape, shard)
    # 1. What lives across steps.
    elements = local.elements
    if not training.sharded_state:
        owned = elements
    elif owned is None:
        owned = owned_elements(layout, replica, rank)
    weights = WEIGHT * elements + local.buffers
    master = MASTER * owned if training.sharded_state else 0
    optimizer = MOMENTS * owned
    gradients = GRAD * elements
    indices = sync_indices(layout, replica, rank)
    persistent = weights + master + optimizer + indices
    # 2. The micro-batches a replica's local batch is cut into.
    micro = min(training.micro_batch or rep.local_batch, rep.local_batch)
    n_micro = math.ceil(rep.local_batch / micro)
    tokens = micro * shape.seq_len
    buckets = bucket_buffers(layout, replica, rank, training.bucket_elements)
    timeline = _Timeline()
    comm_most = 0
    # 3. The first micro-batch (gradients not yet there under fp32) and the last (gradients
    #    there from the earlier ones, and the sync overlapping its backward).
    for index in sorted({0, n_micro - 1}):
        later = index > 0
        comm_most = max(comm_most, _micro_batch(
            timeline, local, training, tokens, rep.tp, persistent,
            grads_before=gradients if later else 0,
            # accumulating into an earlier micro-batch's gradient makes a fresh one first
            grad_transient=GRAD * local.largest_parameter if later else 0,
            buckets=buckets if index == n_micro - 1 else [],
            label=f"micro-batch {index + 1} of {n_micro}",
        ))
    # 4. The optimizer step: AdamW's temporaries for one parameter at a time (its square root
    #    of exp_avg_sq and the denominator).
    timeline.see(persistent + gradients + 2 * 4 * local.largest_parameter, "optimizer step")
    return RankMemory(
        replica=replica,
        rank=rank,
        tp=rep.tp,
        local_batch=rep.local_batch,
        micro_batch=micro,
        weights=weights,
        master=master,
        gradients=gradients,
        optimizer=optimizer,
        activations=activation_bytes(local, training, tokens, shape.seq_len),
        loss=_loss_forward(local, training.precision, rep.tp) * tokens,
        communication=4 * comm_most + indices,
        peak=timeline.most,
        peak_at=timeline.at,
    )


def _micro_batch(
    timeline: _Timeline,
    local: LocalModel,
    training: Training,
    tokens: int,
    tp: int,
    persistent: int,
    *,
    grads_before: int,
    grad_transient: int,
    buckets: Sequence[BucketBuffers],
    label: str,
) -> int:
    """Replay one micro-batch's forward and backward; returns the sync's most elements."""
    shape = local.shape
    p = training.precision
    seq = shape.seq_len
    # Forward: each layer's saved tensors (bf16: its weights' casts among them) stay until its
    # backward; autocast holds every cast until the model's forward ends.
    casts = local.layer_casts(p)
    full = local.layer_activation(p) * tokens + local.layer_constant(seq) + casts
    kept = local.residual() * tokens
    saved = [kept if training.checkpointed(i) else full for i in range(shape.n_layers)]
    base = persistent + grads_before + local.embedding() * tokens
    head = local.final_norm(p) * tokens + local.head_cast(p)
    acts = sum(saved) + head
    recomputed = casts * sum(training.checkpointed(i) for i in range(shape.n_layers))
    logits = _logit_bytes(p) * local.vocab_rows * tokens
    timeline.see(base + acts + recomputed + logits, f"{label}: forward")
    timeline.see(base + acts + _loss_forward(local, p, tp) * tokens, f"{label}: loss forward")
    timeline.see(base + acts + _loss_backward(local, p) * tokens, f"{label}: loss backward")
    # Backward, group by group; a bucket's sync starts with its last group's gradients.
    grad_bytes = {"head": GRAD * local.vocab_rows * shape.hidden + GRAD * shape.hidden,
                  "layer": GRAD * (local.layer_elements + 2 * shape.hidden),
                  "embedding": GRAD * local.vocab_rows * shape.hidden}
    groups = _groups(shape)
    last_of_bucket = {}
    if buckets:
        for b, members in enumerate(bucket_groups([g[1] for g in groups],
                                                  training.bucket_elements)):
            last_of_bucket[members[-1]] = b
    inflight: list[tuple[BucketBuffers, int]] = []  # (bucket, stage done)
    most_comm = 0
    grown = 0  # gradients allocated so far in this backward
    acts -= head
    layer = shape.n_layers
    for g, (kind, _, _) in enumerate(groups):
        working = grad_transient
        if kind == "layer":
            layer -= 1
            if training.checkpointed(layer):
                # Recomputed: the layer's whole set beside its kept input.
                working += full
        grown += grad_bytes[kind] if not grads_before else 0
        comm = 4 * sum(b.stage(s) for b, s in inflight)
        timeline.see(base + acts + working + grown + comm, f"{label}: backward ({kind})")
        if kind == "layer":
            acts -= saved[layer]
        if g in last_of_bucket and training.overlap:
            most_comm = max(most_comm, _launch(
                timeline, inflight, buckets[last_of_bucket[g]],
                base + acts + grown, f"{label}: sync in backward"))
    # After backward: (without overlap, every bucket now) and the drain.
    base += grown
    if buckets and not training.overlap:
        for bucket in buckets:
            most_comm = max(most_comm, _launch(timeline, inflight, bucket, base, f"{label}: sync"))
    while inflight:
        most_comm = max(most_comm, _advance(timeline, inflight, base, f"{label}: sync drain"))
    return most_comm


def _launch(timeline: _Timeline, inflight: list[tuple[BucketBuffers, int]],
            bucket: BucketBuffers, base: int, at: str) -> int:
    """ntp.grad_sync's launch: advance the buckets in flight, then exchange this one."""
    most = _advance(timeline, inflight, base, at)
    others = sum(b.stage(s) for b, s in inflight)
    timeline.see(base + 4 * (others + bucket.running(1)), at)
    inflight.append((bucket, 1))
    return max(most, others + bucket.running(1))


def _advance(timeline: _Timeline, inflight: list[tuple[BucketBuffers, int]], base: int,
             at: str) -> int:
    """Every bucket in flight one stage on, oldest first; returns the most elements live."""
    most = 0
    for i, (bucket, stage) in enumerate(list(inflight)):
        others = sum(b.stage(s) for j, (b, s) in enumerate(inflight) if j != i)
        live = others + bucket.running(stage + 1)
        most = max(most, live)
        timeline.see(base + 4 * live, at)
        inflight[i] = (bucket, stage + 1)
    inflight[:] = [(b, s) for b, s in inflight if s < 4]
    return most


# ----------------------------------------------------------------------------------------------
# Relayouts
# ----------------------------------------------------------------------------------------------


# A layer's parameters in the order the exchange moves them (by name: attention.wk, .wo, .wq,
# .wv, attention_norm, feed_forward.w1, .w2, .w3, ffn_norm), as (unit kind or None for a norm,
# the share of the kind's unit each holds); then the final norm, the LM head, the embedding.
_LAYER_ORDER = (("kv_heads", 2), ("q_heads", 2), ("q_heads", 2), ("kv_heads", 2), (None, 1),
                ("mlp_cols", 3), ("mlp_cols", 3), ("mlp_cols", 3), (None, 1))
_TOP_ORDER = ((None, 1), ("vocab_rows", 2), ("vocab_rows", 2))


def _counts(pieces: Sequence[RankShard]) -> dict[str | None, int]:
    """Units of each kind in all of `pieces` (None, the norms: none)."""
    return {kind: sum(len(p.units(kind)) for p in pieces) for kind in
            ("q_heads", "kv_heads", "mlp_cols", "vocab_rows")} | {None: 0}


def reshard_bytes(old: JobLayout, new: JobLayout, origin: Sequence[int | None]) -> list[int]:
    """Each new rank's most bytes live in a live relayout from `old` (ntp.reshard), which moves
    one parameter at a time, in name order, and frees each one's old tensors once moved: the old
    state not yet moved, the new state moved so far, the parameter in flight (old and new, what
    it sends, receives and copies within); then the new shard built of the moved state."""
    # every precision moves fp32 weights and moments: the weight and both moments per element
    travel = WEIGHT + MOMENTS
    moves = reshard_moves(old, new, origin)
    shape = new.shape
    old_shards = {rep.global_rank(j): shard for rep in old.replicas
                  for j, shard in enumerate(rep.shards)}

    def size(kind: str | None, parts: int) -> int:  # one parameter's elements per unit
        return shape.hidden if kind is None else shape.unit_elements(kind) // parts

    out = []
    for d, row in enumerate(moves):
        replica, rank = new.locate(d)
        shard = new.replicas[replica].shards[rank]
        before = _counts([] if origin[d] is None else [old_shards[origin[d]]])
        after = _counts([shard])
        sent = _counts([moves[t][d] for t in range(len(moves)) if t != d])
        taken = _counts([piece for s, piece in enumerate(row) if s != d])
        kept = _counts([row[d]])
        # the norms: replicated, held whole, cloned and broadcast
        before[None], after[None] = (0 if origin[d] is None else 1), 1

        counts = (before, after, sent, taken, kept)
        # (old, new, sent, received, kept) elements of each parameter, in the exchange's order
        layer = [tuple(c[kind] * size(kind, parts) for c in counts)
                 for kind, parts in _LAYER_ORDER]
        top = [tuple(c[kind] * size(kind, parts) for c in counts) for kind, parts in _TOP_ORDER]
        still_old = shape.n_layers * sum(s[0] for s in layer) + sum(s[0] for s in top)
        moved, most = 0, 0
        # Each layer moves alike, so what is live at a given parameter changes by the same
        # amount from one layer to the next: the most is in the first layer or the last.
        layer_old, layer_new = sum(s[0] for s in layer), sum(s[1] for s in layer)
        for i in sorted({0, shape.n_layers - 1}):
            old_left = still_old - i * layer_old
            done = i * layer_new
            for o, n, out_, in_, copied in layer:
                most = max(most, travel * (old_left + done + n + out_ + in_) + 4 * copied)
                old_left -= o
                done += n
        still_old -= shape.n_layers * layer_old
        moved += shape.n_layers * layer_new
        for o, n, out_, in_, copied in top:
            most = max(most, travel * (still_old + moved + n + out_ + in_) + 4 * copied)
            still_old -= o
            moved += n
        new_local = LocalModel.of(shape, shard)
        most = max(most, travel * new_local.elements + sync_indices(new, replica, rank))
        out.append(most + new_local.buffers)
    return out


# ----------------------------------------------------------------------------------------------
# The layouts a failure policy can reach
# ----------------------------------------------------------------------------------------------


def tp_layout(degrees: Sequence[int]) -> str:
    """TP degree per replica as status.tpLayout writes it, a run of one degree as `6x7`."""
    parts: list[str] = []
    i = 0
    while i < len(degrees):
        j = i
        while j < len(degrees) and degrees[j] == degrees[i]:
            j += 1
        run = [str(degrees[i])] * (j - i)
        parts.append(f"{degrees[i]}x{j - i}" if j - i > 2 else ",".join(run))
        i = j
    return ",".join(parts)


@dataclass(frozen=True)
class Reachable:
    """A layout the failure policy can reach, and the one a relayout onto it comes from."""

    degrees: tuple[int, ...]
    previous: tuple[int, ...] | None  # None: reached by no live relayout
    tp: int  # the degree of the replica the row is about (replica 0)

    @property
    def name(self) -> str:
        return tp_layout(self.degrees)


@dataclass(frozen=True)
class Job:
    """The job's parallel layout as its spec sets it."""

    shape: ModelShape
    tp: int
    dp: int
    global_batch: int
    mode: FailurePolicy
    min_tp: int

    def layouts(self) -> list[Reachable]:
        """The healthy layout first, then each degraded one the policy can reach, worst case
        first for each degree: a replica at degree t with every other replica at the minimum
        has the largest batch share under NTP, the fewest ranks sharing the optimizer state
        and the largest sync partitions. A relayout onto each comes from the one before it (a
        GPU lost); onto the healthy layout, from one GPU short (a GPU back)."""
        healthy = (self.tp,) * self.dp
        if self.mode.reshapes:
            rows = [Reachable(healthy, (self.tp - 1, *healthy[1:]) if self.tp > self.min_tp
                              else None, self.tp)]
            others = (self.min_tp,) * (self.dp - 1)
            for t in range(self.tp, self.min_tp - 1, -1):
                degrees = (t, *others)
                if degrees != rows[-1].degrees:
                    rows.append(Reachable(degrees, rows[-1].degrees, t))
            return rows
        if self.mode in (FailurePolicy.DROP, FailurePolicy.SPARE) and self.dp > 1:
            # A replica sits out (SPARE: once no spare is left), down to one.
            rows = [Reachable(healthy, healthy[1:], self.tp)]
            for k in sorted({self.dp - 1, 1}, reverse=True):
                rows.append(Reachable((self.tp,) * k, rows[-1].degrees, self.tp))
            return rows
        return [Reachable(healthy, None, self.tp)]


@dataclass(frozen=True)
class LayoutMemory:
    """One reachable layout and its ranks' memory."""

    reachable: Reachable
    ranks: tuple[RankMemory, ...]

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.most)


def _origin(old: tuple[int, ...], new: tuple[int, ...]) -> list[int | None]:
    """Which old rank each new rank was, replica by replica: a shrunk replica lost its last
    ranks (a failure), a grown one gained fresh processes (GPUs back)."""
    origin: list[int | None] = []
    offset = 0
    for r, t in enumerate(new):
        was = old[r] if r < len(old) else 0
        origin += [offset + i if i < was else None for i in range(t)]
        offset += was
    return origin


@lru_cache(maxsize=16)  # a layout is a row's and the next row's relayout source
def _layout(shape: ModelShape, degrees: tuple[int, ...], global_batch: int, rule: str
            ) -> JobLayout:
    return plan_job(shape, degrees, global_batch, rule)


@lru_cache(maxsize=32)  # assess plans a row again for each minimum TP it tries
def layout_memory(job: Job, reachable: Reachable, training: Training) -> LayoutMemory:
    """Every rank's memory on one layout (without sharded state, replicas of one degree and
    batch are alike: the first stands for them), with a relayout onto it when one comes."""
    batch_rule = job.mode.batch_rule
    degrees = reachable.degrees
    layout = _layout(job.shape, degrees, job.global_batch, batch_rule)
    reshard: list[int] = []
    if reachable.previous is not None:
        old = _layout(job.shape, reachable.previous, job.global_batch, batch_rule)
        reshard = reshard_bytes(old, layout, _origin(reachable.previous, degrees))
    owned = owned_elements_by_rank(layout) if training.sharded_state else {}
    ranks = []
    seen: set[tuple[int, int]] = set()
    for rep in layout.replicas:
        if (rep.tp, rep.local_batch) in seen and not training.sharded_state:
            continue
        seen.add((rep.tp, rep.local_batch))
        for j in range(rep.tp):
            memory = rank_memory(layout, rep.index, j, training, owned.get((rep.index, j)))
            if reshard:
                memory = replace(memory, reshard=reshard[rep.global_rank(j)])
            ranks.append(memory)
    return LayoutMemory(reachable, tuple(ranks))


def plan_memory(job: Job, training: Training) -> list[LayoutMemory]:
    """The memory of the healthy layout and of every degraded one the policy can reach."""
    return [layout_memory(job, reachable, training) for reachable in job.layouts()]


def usable(gpu_bytes: int) -> int:
    """What the allocator may hold on a GPU of `gpu_bytes`: less the fixed reserve, and the
    fragmentation share of what it holds."""
    return int((gpu_bytes - RESERVE_FIXED) / (1 + RESERVE_SHARE))


def fits(memory: LayoutMemory, gpu_bytes: int) -> bool:
    return memory.worst.most <= usable(gpu_bytes)


def human(n: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1 (KiB at least)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class Assessment:
    """Whether a job fits GPUs of `gpu_bytes`: its healthy layout, and down to which TP degree
    its degraded ones do, with the figures that say so."""

    gpu_bytes: int
    plans: tuple[LayoutMemory, ...]
    min_tp: int | None  # the effective minimum TP; None: not even the healthy layout fits

    @property
    def fits(self) -> bool:
        return self.min_tp is not None

    def first_misfit(self) -> LayoutMemory | None:
        return next((m for m in self.plans if not fits(m, self.gpu_bytes)), None)

    def message(self, job: Job) -> str:
        """One line: what fits, or the layout that does not with its numbers."""
        room = usable(self.gpu_bytes)
        misfit = self.first_misfit()
        if misfit is None:
            most = max(m.worst.most for m in self.plans)
            return (f"every reachable layout fits down to TP {job.min_tp}: at most "
                    f"{human(most)} of {human(room)} usable per GPU")
        w = misfit.worst
        what = "a relayout onto it" if w.reshard > w.peak else "a training step"
        needs = (f"layout {misfit.reachable.name} needs {human(w.most)} on rank {w.rank} of "
                 f"replica {w.replica} (TP {w.tp}) for {what}, {human(room)} usable of "
                 f"{human(self.gpu_bytes)} per GPU")
        if not self.fits:
            return f"does not fit: {needs}"
        return (f"fits down to TP {self.min_tp}, not {job.min_tp}: {needs}; the effective "
                f"minimum TP is {self.min_tp}")


@lru_cache(maxsize=64)  # a job's spec rarely changes: its operator asks again every reconcile
def assess(job: Job, training: Training, gpu_bytes: int) -> Assessment:
    """The job's memory on every layout it can reach, against GPUs of `gpu_bytes`: the
    effective minimum TP is the smallest degree d, from the job's own minimum up, such that
    every layout reachable with no replica below d fits (rows mix degrees, so a misfit at one
    minimum says nothing of the next: each is planned whole)."""
    plans = tuple(plan_memory(job, training))
    if not fits(plans[0], gpu_bytes):
        return Assessment(gpu_bytes, plans, None)
    if not job.mode.reshapes:  # replicas never shrink: the minimum bounds no layout
        return Assessment(gpu_bytes, plans, job.min_tp if all(
            fits(m, gpu_bytes) for m in plans) else job.tp)
    for d in range(job.min_tp, job.tp + 1):
        raised = replace(job, min_tp=d)
        if all(fits(layout_memory(raised, reachable, training), gpu_bytes)
               for reachable in raised.layouts()):
            return Assessment(gpu_bytes, plans, d)
    raise AssertionError("unreachable: at the healthy degree only the healthy layout is left")


# ----------------------------------------------------------------------------------------------
# From a job's spec
# ----------------------------------------------------------------------------------------------

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def parse_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity such as `80Gi` or `141G`."""
    match = _QUANTITY.fullmatch(quantity.strip())
    if match is None:
        raise ValueError(f"{quantity!r} is not a memory quantity (e.g. 80Gi, 81559Mi, 141G)")
    return int(float(match.group(1)) * _SUFFIX[match.group(2)])


def plan_inputs(spec: NTPTrainingJobSpec) -> tuple[Job, Training]:
    """The job and its training options from its typed spec; SpecError names a field the plan
    cannot use."""
    try:
        shape = spec.model.shape()
    except PlanError as exc:
        raise SpecError("model", str(exc)) from exc
    checkpointing = spec.activation_checkpointing
    try:
        training = Training(
            precision=spec.precision,
            micro_batch=spec.micro_batch_size,
            checkpointing=checkpointing.mode,
            checkpoint_every=checkpointing.every,
            sharded_state=spec.optimizer.sharded_state,
        )
    except PlanError as exc:
        raise SpecError("activationCheckpointing", str(exc)) from exc
    job = Job(shape, spec.tensor_parallel_size, spec.data_parallel_replicas, spec.global_batch,
              spec.failure_policy.mode, spec.min_tensor_parallel_size)
    return job, training
