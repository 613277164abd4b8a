"""What one rank trains with: optimizer hyperparameters, gradient sync, device, precision,
micro-batches and activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass

from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS


@dataclass(frozen=True)
class TrainConfig:
    flavor: str | None = None  # None: the model the layout's shape describes
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    overlap: bool = True
    device: str = "cpu"
    max_grad_norm: float | None = None
    precision: str = "fp32"  # or "bf16": autocast compute, fp32 weights, moments and reductions
    micro_batch: int | None = None  # sequences per forward; None: the replica's whole share
    activation_checkpointing: str = "none"  # none, full, selective
    checkpoint_every: int = 2  # selective: layers 0, N, 2N, ... recompute
    measure_memory: bool = False  # each step's (and relayout's) peak tensor memory
