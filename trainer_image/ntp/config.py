"""What one rank trains with: the optimizer and its schedule, gradient sync, device, precision,
micro-batches, activation checkpointing and evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS
from ntp.recipe import Schedule


@dataclass(frozen=True)
class TrainConfig:
    flavor: str | None = None  # None: the model the layout's shape describes
    lr: float = 1e-3  # the peak learning rate
    weight_decay: float = 0.1
    weight_decay_all: bool = False  # decay norms, biases and the embedding too
    schedule: Schedule = field(default_factory=Schedule)
    seed: int = 0
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    overlap: bool = True
    device: str = "cpu"
    max_grad_norm: float | None = None
    precision: str = "fp32"  # or "bf16": autocast compute, fp32 weights, moments and reductions
    micro_batch: int | None = None  # sequences per forward; None: the replica's whole share
    activation_checkpointing: str = "none"  # none, full, selective
    checkpoint_every: int = 2  # selective: layers 0, N, 2N, ... recompute
    sharded_state: bool = False  # AdamW state and master weights sharded across replicas
    measure_memory: bool = False  # each step's (and relayout's) peak tensor memory
    eval_every: int = 0  # evaluate on the held-out split every N steps and at the end (0: never)
    eval_samples: int = 0  # sequences in the held-out split
