"""This rank's pipeline stage: its layers of the model at its stage's TP degree, the stage's
groups and gradient sync, and the peers of the stages beside it that it exchanges with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from ntp.grad_sync import GradSync
from ntp.groups import JobGroups, layout_groups
from ntp.initialize import init_parameters, materialize
from ntp.model import ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import DEFAULT_BUCKET_ELEMENTS
from tessera_core.stages import Layers, PipelineLayout

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StageRank:
    """One rank of one stage of one replica, built for a PipelineLayout."""

    pipe: PipelineLayout
    stage: int
    groups: JobGroups  # the stage's groups: TP inside its replica, sync across replicas
    model: Transformer  # only the stage's parameters (global names kept)
    loss_fn: LossFn
    sync: GradSync

    @property
    def layers(self) -> Layers:
        return self.pipe.layers[self.stage]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.pipe.layers) - 1

    @property
    def local_batch(self) -> int:
        return self.pipe.stages[self.stage].replicas[self.groups.replica].local_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or the previous stage's hidden states -> the next stage's
        hidden states, or logits (last stage)."""
        model = self.model
        h = model.tok_embeddings(x) if self.first else x
        for i in range(*self.layers):
            h = model.layers[i](h, model.rope)
        return model.output(model.norm(h)) if self.last else h

    def previous_peer(self) -> int:
        """The world rank of the previous stage this rank receives hidden states from (and
        returns their gradient to): ranks pair up modulo the smaller degree, so TP groups of
        any two degrees spread the transfers over all their ranks."""
        before = self.pipe.degrees(self.groups.replica)[self.stage - 1]
        return self.pipe.world_rank(self.stage - 1, self.groups.replica,
                                    self.groups.rank % before)

    def next_peers(self) -> tuple[int, ...]:
        """The world ranks of the next stage this rank sends its hidden states to."""
        replica, rank = self.groups.replica, self.groups.rank
        mine, after = self.pipe.degrees(replica)[self.stage : self.stage + 2]
        return tuple(self.pipe.world_rank(self.stage + 1, replica, j)
                     for j in range(after) if j % mine == rank)

    def gradient_peer(self) -> int:
        """The world rank of the next stage whose input gradient this rank receives (every
        rank of a TP group holds the same one: the TP regions' backward sums it)."""
        after = self.pipe.degrees(self.groups.replica)[self.stage + 1]
        return self.pipe.world_rank(self.stage + 1, self.groups.replica,
                                    self.groups.rank % after)

    def gradient_receivers(self) -> tuple[int, ...]:
        """The world ranks of the previous stage this rank sends its input gradient to."""
        replica, rank = self.groups.replica, self.groups.rank
        before, mine = self.pipe.degrees(replica)[self.stage - 1 : self.stage + 1]
        return tuple(self.pipe.world_rank(self.stage - 1, replica, i)
                     for i in range(before) if i % mine == rank)


def _keep_stage(model: Transformer, layers: Layers, first: bool, last: bool) -> None:
    """Drop every parameter outside the stage; the kept ones keep their global names, so
    seeded initialization, sync buckets and checkpoints see the same units as the dense
    model's."""
    for i, _ in enumerate(model.layers):
        if not layers[0] <= i < layers[1]:
            model.layers[i] = nn.Module()
    if not first:
        model.tok_embeddings = None  # type: ignore[assignment]
    if not last:
        model.norm = None  # type: ignore[assignment]
        model.output = None  # type: ignore[assignment]


def build_stage(
    pipe: PipelineLayout,
    args: ModelArgs,
    device: torch.device,
    seed: int,
    timeout: timedelta | None = None,
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
) -> StageRank:
    """This rank's stage of `pipe` with the seeded initial weights (collective: every rank of
    the world calls this)."""
    # 1. Every stage's groups, created in stage order on every rank; this rank keeps its own.
    mine = None
    for k in range(len(pipe.stages)):
        groups = layout_groups(pipe.stages[k], pipe.stage_world_ranks(k), timeout)
        if groups is not None:
            mine = (k, groups)
    assert mine is not None, "every world rank is in one stage"
    stage, groups = mine
    layout = pipe.stages[stage]
    shard = layout.replicas[groups.replica].shards[groups.rank]
    # 2. The stage's shard of the model, built on meta, cut to the stage, then allocated.
    with torch.device("meta"):
        model = Transformer(args)
    loss_fn = apply_ntp(model, shard, groups.tp)
    first, last = stage == 0, stage == len(pipe.stages) - 1
    _keep_stage(model, pipe.layers[stage], first, last)
    materialize(model, device)
    init_parameters(model, args, shard, seed)
    # 3. The stage's gradient sync across replicas (tessera_core.plan's mixed-TP mapping).
    sync = GradSync(model, layout, groups, bucket_elements)
    return StageRank(pipe, stage, groups, model, loss_fn, sync)
