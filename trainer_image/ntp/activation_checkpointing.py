"""Activation checkpointing: chosen layers keep only their input in the forward pass and run it
again in backward (`apply_activation_checkpointing`), for less activation memory at the cost of
one more forward of those layers. The recomputation runs the same operators on the same inputs,
so the numerics do not change. Which layers: `tessera_core.memory.is_checkpointed`, the rule the
memory plan counts.

A checkpointed block keeps its module and parameter names (its `forward` is wrapped, not the
module), so checkpoints, sharding and the gradient sync see the same model. Its tensor-parallel
collectives run again in the recomputation, on every rank of the group alike: backward visits
the layers in the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ntp.model import Transformer
from tessera_core.memory import CHECKPOINTING, is_checkpointed


def _recomputed(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: torch.Tensor) -> torch.Tensor:
        # Non-reentrant: gradients of parameters inside reach their hooks (the gradient sync)
        # as they do without checkpointing.
        return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_activation_checkpointing(model: Transformer, mode: str, every: int = 2) -> None:
    """Make the layers `mode` chooses recompute their activations in backward."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {CHECKPOINTING}, got {mode!r}")
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    for i, block in enumerate(model.layers):
        if is_checkpointed(i, mode, every):
            block.forward = _recomputed(block.forward)
