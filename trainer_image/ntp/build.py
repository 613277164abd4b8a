"""This rank's part of one generation, built on the meta device and then materialized: the
model's arguments, its groups, its model shard, the optimizer and the gradient sync."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from ntp.activation_checkpointing import apply_activation_checkpointing
from ntp.config import TrainConfig
from ntp.distributed import collective_timeout
from ntp.grad_sync import GradSync
from ntp.groups import JobGroups, build_groups
from ntp.initialize import adopt, materialize
from ntp.model import FLAVORS, ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from ntp.recipe import parameter_groups
from ntp.sharded_optimizer import ShardedAdamW
from tessera_core.plan import JobLayout, RankShard, ReplicaLayout

# What a checkpoint's model arguments carry beyond the shape the layout gives.
CARRIED_ARGS = ("rope_theta", "norm_eps", "init_std")


def model_args(
    flavor: str | None, layout: JobLayout, carried: ModelArgs | None = None
) -> ModelArgs:
    """The model of the layout's shape, with what the model it starts from carries beyond it
    (`carried`: a checkpoint's RoPE base and norm epsilon); a named flavor must have that
    shape."""
    shape = layout.shape
    if flavor is None:
        args = ModelArgs.of_shape(shape)
        if carried is None:
            return args
        return replace(args, **{k: getattr(carried, k) for k in CARRIED_ARGS})
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(FLAVORS)}")
    if FLAVORS[flavor].shape() != shape:
        raise ValueError(
            f"flavor {flavor!r} has shape {FLAVORS[flavor].shape()}, layout has {shape}"
        )
    return FLAVORS[flavor]


@dataclass
class GenerationRank:
    """This rank's part of one generation: its groups, model shard, AdamW and gradient sync.

    A training thread holds its own reference: a thread abandoned in a collective (see
    `Trainer.run`) keeps its generation's objects and never touches the next one's.
    """

    layout: JobLayout
    args: ModelArgs
    groups: JobGroups
    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer | ShardedAdamW
    sync: GradSync
    abandoned: bool = False

    @property
    def replica(self) -> ReplicaLayout:
        return self.layout.replicas[self.groups.replica]

    @property
    def shard(self) -> RankShard:
        return self.replica.shards[self.groups.rank]


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, layout: JobLayout, groups: JobGroups
) -> torch.optim.Optimizer | ShardedAdamW:
    """AdamW over the local shards: it is elementwise, so each shard with its own state does
    exactly the dense update (moments travel with their units: `ntp.reshard`). Weight decay as
    the recipe says (`ntp.recipe.parameter_groups`); the learning rate is set every step. With
    `sharded_state`, over the units this rank owns (`ntp.sharded_optimizer`)."""
    if config.sharded_state:
        rank = layout.replicas[groups.replica].global_rank(groups.rank)
        return ShardedAdamW(model, layout, rank, groups.world, config)
    params = parameter_groups(model.named_parameters(), config.weight_decay,
                              config.weight_decay_all)
    return torch.optim.AdamW(params, lr=config.lr, foreach=False)


def build_rank(
    config: TrainConfig,
    layout: JobLayout,
    carried: ModelArgs | None,
    device: torch.device,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> GenerationRank:
    """Groups, this rank's shard of the model (allocated, not filled: the caller fills it; or
    made of `weights`, a relayout's moved tensors), the optimizer and the sync hooks for
    `layout` (collective: every rank of it calls this)."""
    # 1. Groups and this rank's place in the layout.
    args = model_args(config.flavor, layout, carried)
    groups = build_groups(layout, timeout=collective_timeout())
    shard = layout.replicas[groups.replica].shards[groups.rank]
    # 2. This rank's shard only: built on the meta device, given its local shapes, allocated.
    with torch.device("meta"):
        model = Transformer(args)
    loss_fn = apply_ntp(model, shard, groups.tp)
    apply_activation_checkpointing(model, config.activation_checkpointing,
                                   config.checkpoint_every)
    if weights is None:
        materialize(model, device)
    else:
        adopt(model, weights, device)
    # 3. The optimizer over the local shards.
    optimizer = build_optimizer(model, config, layout, groups)
    # 4. Gradient sync hooks.
    sync = GradSync(model, layout, groups, config.bucket_elements, overlap=config.overlap)
    return GenerationRank(layout, args, groups, model, loss_fn, optimizer, sync)
