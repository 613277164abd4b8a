"""The training recipe: the learning rate of every step (a linear warmup, then constant, cosine or
warmup-stable-decay) and which parameters weight decay applies to.

The learning rate is a function of the step alone, set before each optimizer step, so a run
resumed from a checkpoint at step s takes exactly the rate an uninterrupted run took there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

SCHEDULES = ("constant", "cosine", "wsd")


@dataclass(frozen=True)
class Schedule:
    """`spec.optimizer.schedule`: the peak learning rate's multiplier over the job's steps."""

    kind: str = "constant"  # constant, cosine, wsd (warmup-stable-decay)
    warmup_steps: int = 0  # linear from 1/warmup to 1 over these first steps
    decay_steps: int = 0  # wsd: the last steps, decaying linearly to the floor
    min_ratio: float = 0.0  # cosine and wsd end at this fraction of the peak

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.kind!r}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup and decay steps must be at least 0")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be within [0, 1], got {self.min_ratio}")

    def factor(self, step: int, steps: int) -> float:
        """The multiplier of the optimizer update that makes step `step` (0-based) of a job of
        `steps` steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            span = max(1, steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_from = max(self.warmup_steps, steps - self.decay_steps)
        if step < decay_from:
            return 1.0
        progress = min(1.0, (step - decay_from + 1) / max(1, steps - decay_from))
        return 1.0 - (1 - self.min_ratio) * progress


# Parameters weight decay leaves alone unless asked: norm gains, biases and embeddings.
def decays(name: str, parameter: nn.Parameter) -> bool:
    """Whether the recipe's weight decay applies to this parameter by default: matrices other
    than the token embedding."""
    return parameter.dim() >= 2 and not name.startswith("tok_embeddings.")


def parameter_groups(
    named: Iterable[tuple[str, nn.Parameter]], weight_decay: float, decay_all: bool
) -> list[dict[str, Any]]:
    """AdamW's parameter groups: weight decay on `decays`' parameters (on all with
    `decay_all`), none on the rest; each group names its parameters (`names`), in the model's
    order."""
    with_decay: dict[str, Any] = {"params": [], "names": [], "weight_decay": weight_decay}
    without: dict[str, Any] = {"params": [], "names": [], "weight_decay": 0.0}
    for name, p in named:
        group = with_decay if decay_all or decays(name, p) else without
        group["params"].append(p)
        group["names"].append(name)
    return [g for g in (with_decay, without) if g["params"]]
