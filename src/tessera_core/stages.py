"""Pipeline stages: each replica's layers cut into consecutive stages balanced by memory, every
stage a TP group of its own degree, and the stage that limits each replica (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_core.memory import (
    GRAD,
    MASTER,
    MOMENTS,
    WEIGHT,
    LocalModel,
    Training,
    _loss_forward,
)
from tessera_core.perf_model import PAPER, PerfModel
from tessera_core.plan import (
    JobLayout,
    layout_from_shards,
    plan_replica,
    rank_layer_flops,
    split_batch,
)

Layers = tuple[int, int]  # a stage's layers: [start, stop)


# ----------------------------------------------------------------------------------------------
# The split of layers into stages
# ----------------------------------------------------------------------------------------------


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B: the first stage
    starts `stages` forwards before its first backward, each later one fewer."""
    return max(1, min(stages - stage, micro_batches))


@dataclass(frozen=True)
class StageCosts:
    """One rank's bytes per stage part at TP `tp` (rank 0 of the healthy layout, the busiest)."""

    layer_state: int  # a layer's weights, gradients, optimizer state (and master weights)
    layer_activation: int  # what a layer saves for backward per micro-batch
    embedding_state: int  # the embedding's weights, gradients and optimizer state
    embedding: int  # the embedding's saved lookups per micro-batch
    head_state: int  # the final norm's and LM head's state
    head_activation: int  # the final norm's, LM head's and loss's per micro-batch

    def stage_bytes(self, layers: Layers, stage: int, stages: int, micro_batches: int) -> int:
        flight = in_flight(stage, stages, micro_batches)
        count = layers[1] - layers[0]
        total = count * (self.layer_state + flight * self.layer_activation)
        if stage == 0:
            total += self.embedding_state + self.embedding * flight
        if stage == stages - 1:
            total += self.head_state + flight * self.head_activation
        return total


def stage_costs(shape: ModelShape, tp: int, training: Training, micro_batch: int) -> StageCosts:
    """The memory plan's terms (tessera_core.memory) for one rank of a TP-`tp` stage. With
    sharded state its AdamW moments and master weights are counted whole (an upper bound: the
    rank keeps the share it owns)."""
    local = LocalModel.of(shape, plan_replica(shape, tp)[0])
    per_element = WEIGHT + GRAD + MOMENTS + (MASTER if training.sharded_state else 0)
    tokens = micro_batch * shape.seq_len
    p = training.precision
    layer_activation = (local.layer_activation(p) * tokens + local.layer_constant(shape.seq_len)
                        + local.layer_casts(p))
    vocab = local.vocab_rows * shape.hidden  # each of the embedding and the LM head
    return StageCosts(
        layer_state=per_element * (local.layer_elements + 2 * shape.hidden),
        layer_activation=layer_activation,
        embedding_state=per_element * vocab,
        embedding=local.embedding() * tokens,
        head_state=per_element * (vocab + shape.hidden),
        head_activation=(local.final_norm(p) + _loss_forward(local, p, tp)) * tokens
        + local.head_cast(p),
    )


def split_layers(shape: ModelShape, stages: int, costs: StageCosts, micro_batches: int
                 ) -> tuple[Layers, ...]:
    """Consecutive layers per stage, at least one each, minimizing the largest stage's bytes
    (the embedding counted in the first stage, the LM head and loss in the last, activations
    for the micro-batches each stage holds under 1F1B)."""
    n = shape.n_layers
    if not 1 <= stages <= n:
        raise PlanError(f"pipelineParallelSize {stages} must be between 1 and the {n} layers")

    @cache
    def best(stage: int, start: int) -> tuple[int, tuple[Layers, ...]]:
        # The least largest-stage bytes for stages `stage`.. over layers `start`..n-1.
        if stage == stages - 1:
            last = (start, n)
            return costs.stage_bytes(last, stage, stages, micro_batches), (last,)
        options = []
        for stop in range(start + 1, n - (stages - stage - 1) + 1):
            here = costs.stage_bytes((start, stop), stage, stages, micro_batches)
            rest, split = best(stage + 1, stop)
            options.append((max(here, rest), ((start, stop), *split)))
        return min(options, key=lambda o: o[0])

    return best(0, 0)[1]


def plan_stages(shape: ModelShape, stages: int, tp: int, training: Training,
                local_batch: int) -> tuple[Layers, ...]:
    """The job's split of layers into `stages` for a healthy replica at TP `tp` whose local
    batch is `local_batch` sequences (micro-batches of `training.micro_batch`)."""
    return tuple(s.layers for s in stage_memory(shape, stages, tp, training, local_batch))


@dataclass(frozen=True)
class StageMemory:
    """One stage of the healthy pipeline: its layers and its busiest rank's bytes."""

    stage: int
    layers: Layers
    in_flight: int  # micro-batches whose activations it holds at once under 1F1B
    state: int  # weights, gradients, optimizer state (and master weights)
    activations: int  # those micro-batches' saved activations, the loss's on the last stage


def stage_memory(shape: ModelShape, stages: int, tp: int, training: Training,
                 local_batch: int) -> tuple[StageMemory, ...]:
    """The balanced split of a healthy replica at TP `tp` into `stages` and what each stage's
    rank 0 holds (the memory plan's terms, tessera_core.memory)."""
    micro = min(training.micro_batch or local_batch, local_batch)
    micro_batches = math.ceil(local_batch / micro)
    costs = stage_costs(shape, tp, training, micro)
    split = split_layers(shape, stages, costs, micro_batches)
    out = []
    for k, layers in enumerate(split):
        flight = in_flight(k, stages, micro_batches)
        total = costs.stage_bytes(layers, k, stages, micro_batches)
        state = (layers[1] - layers[0]) * costs.layer_state
        state += costs.embedding_state if k == 0 else 0
        state += costs.head_state if k == stages - 1 else 0
        out.append(StageMemory(k, layers, flight, state, total - state))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Per-stage layouts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineLayout:
    """A job of DP replicas, each a pipeline of stages, each stage a TP group of its own degree.

    `stages[k]` is stage k's DP x TP layout across replicas (replica r's TP group of stage k),
    whose gradient sync is the mixed-TP sync of tessera_core.plan. Every stage of a replica
    sees the same local batch: the batch rule splits by each replica's slowest stage.
    World ranks run replica by replica, within a replica stage by stage.
    """

    layers: tuple[Layers, ...]
    stages: tuple[JobLayout, ...]

    @property
    def shape(self) -> ModelShape:
        return self.stages[0].shape

    @property
    def n_replicas(self) -> int:
        return len(self.stages[0].replicas)

    def degrees(self, replica: int) -> tuple[int, ...]:
        """TP degree of each stage of `replica`."""
        return tuple(stage.replicas[replica].tp for stage in self.stages)

    @property
    def world_size(self) -> int:
        return sum(stage.world_size for stage in self.stages)

    def world_rank(self, stage: int, replica: int, rank: int) -> int:
        before = sum(sum(self.degrees(r)) for r in range(replica))
        return before + sum(self.degrees(replica)[:stage]) + rank

    def locate(self, world_rank: int) -> tuple[int, int, int]:
        """(stage, replica, rank inside the stage's TP group) of a world rank."""
        offset = 0
        for r in range(self.n_replicas):
            for k, tp in enumerate(self.degrees(r)):
                if world_rank < offset + tp:
                    return k, r, world_rank - offset
                offset += tp
        raise PlanError(f"world rank {world_rank} outside a world of {self.world_size}")

    def stage_world_ranks(self, stage: int) -> tuple[int, ...]:
        """The world rank of each of stage `stage`'s layout ranks (its global ranks in order)."""
        return tuple(self.world_rank(stage, rep.index, j)
                     for rep in self.stages[stage].replicas for j in range(rep.tp))

    def to_dict(self) -> dict[str, Any]:
        batches = [r.local_batch for r in self.stages[0].replicas]
        return {"stages": [{"layers": list(layers), **layout.to_dict(), "local_batches": batches}
                           for layers, layout in zip(self.layers, self.stages, strict=True)]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineLayout:
        try:
            items = data["stages"]
            layers = tuple((int(s["layers"][0]), int(s["layers"][1])) for s in items)
            stages = tuple(JobLayout.from_dict(s) for s in items)
        except (KeyError, TypeError, IndexError) as exc:
            raise PlanError(f"malformed pipeline layout document: {exc!r}") from exc
        return checked(layers, stages)


def checked(layers: Sequence[Layers], stages: Sequence[JobLayout]) -> PipelineLayout:
    """A PipelineLayout after checking that its stages cover the layers in order, share one
    shape, one replica count and one batch split."""
    if not stages or len(layers) != len(stages):
        raise PlanError(f"{len(layers)} layer ranges for {len(stages)} stages")
    shape = stages[0].shape
    position = 0
    for start, stop in layers:
        if start != position or stop <= start:
            raise PlanError(f"stages must cover layers 0..{shape.n_layers - 1} in order, "
                            f"each at least one: {list(layers)}")
        position = stop
    if position != shape.n_layers:
        raise PlanError(f"stages cover {position} of {shape.n_layers} layers")
    batches = [tuple(r.local_batch for r in s.replicas) for s in stages]
    if any(s.shape != shape for s in stages) or len(set(batches)) != 1:
        raise PlanError("every stage must train one shape on the same local batches")
    return PipelineLayout(tuple(layers), tuple(stages))


def plan_pipeline(
    shape: ModelShape,
    layers: Sequence[Layers],
    degrees: Sequence[Sequence[int]],
    global_batch: int,
    mode: str = "ntp",
) -> PipelineLayout:
    """Per-stage layouts for replicas whose stages run at `degrees[r][k]`.

    Stage k's replicas get tessera_core.plan's balanced layouts aligned to its smallest degree;
    the batch rule (plain NTP: proportional to TP) takes each replica's slowest stage.
    """
    if not degrees or any(len(d) != len(layers) for d in degrees):
        raise PlanError(f"every replica needs a TP degree for each of its {len(layers)} stages")
    pace = [min(d) for d in degrees]
    batches = split_batch(global_batch, pace if mode == "ntp" else [1] * len(pace))
    stages = []
    for k in range(len(layers)):
        tps = [d[k] for d in degrees]
        base = plan_replica(shape, min(tps))
        by_degree = {tp: base if tp == min(tps) else plan_replica(shape, tp, align_to=base)
                     for tp in set(tps)}
        stages.append(layout_from_shards(shape, [by_degree[tp] for tp in tps], global_batch,
                                         mode, local_batches=batches))
    return checked(layers, stages)


# ----------------------------------------------------------------------------------------------
# The stage that limits a replica, and the power that goes to it
# ----------------------------------------------------------------------------------------------


def stage_work(shape: ModelShape, layers: Layers, tp: int, last: bool) -> float:
    """Forward FLOPs of the busiest rank of a TP-`tp` stage per sequence: its layers at
    tessera_core.plan's real split, the LM head on the last stage."""
    work = (layers[1] - layers[0]) * max(rank_layer_flops(shape, tp))
    if last:
        work += math.ceil(shape.vocab / tp) * shape.unit_flops("vocab_rows")
    return work


@dataclass(frozen=True)
class StagePower:
    """What each stage of one replica runs at: the stage that sets its pace and each stage's
    power ratio (above 1.0 only for a degraded stage slower than the healthy pipeline)."""

    limiting: int  # the stage whose step is the longest at the base cap
    slowdowns: tuple[float, ...]  # each stage's time against the healthy pipeline's pace
    power_ratios: tuple[float, ...]


def stage_power(
    shape: ModelShape,
    layers: Sequence[Layers],
    healthy_tp: int,
    degrees: Sequence[int],
    cap_ratio: float = 1.0,
    perf: PerfModel = PAPER,
) -> StagePower:
    """The limiting stage of a replica whose stages run at `degrees` and the boost of each:
    a pipeline runs at its slowest stage, and the healthy replicas at their slowest healthy
    one, so only a stage slower than that pace is boosted, just enough to keep it (up to
    `cap_ratio`); an uneven split's lighter stages absorb a loss without power."""
    last = len(layers) - 1
    healthy = [stage_work(shape, lay, healthy_tp, k == last) for k, lay in enumerate(layers)]
    pace = max(healthy)
    work = [stage_work(shape, lay, tp, k == last)
            for k, (lay, tp) in enumerate(zip(layers, degrees, strict=True))]
    slowdowns = tuple(w / pace for w in work)
    ratios = tuple(perf.ratio_for_slowdown(s, cap_ratio) if s > 1.0 else 1.0 for s in slowdowns)
    limiting = max(range(len(work)), key=lambda k: (work[k], -k))
    return StagePower(limiting, slowdowns, ratios)


# ----------------------------------------------------------------------------------------------
# The 1F1B schedule
# ----------------------------------------------------------------------------------------------

FORWARD, BACKWARD = "F", "B"


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """Stage `stage`'s order of forwards and backwards over the micro-batches under 1F1B: as
    many forwards as stages after it to fill the pipeline, then one forward, one backward,
    and the last backwards to drain it. Backwards run in micro-batch order on every stage."""
    if not 0 <= stage < stages or micro_batches < 1:
        raise PlanError(f"stage {stage} of {stages} with {micro_batches} micro-batches")
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [(FORWARD, warmup + i), (BACKWARD, i)]
    order += [(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
    return tuple(order)


def bubble_ratio(stages: int, micro_batches: int) -> float:
    """1F1B's idle share of a step with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
