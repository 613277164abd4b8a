"""The run's curves as TensorBoard event files beside its checkpoints (`<save>/tensorboard/`):
per step the loss, learning rate, gradient norm, tokens per second and goodput, per evaluation
the held-out loss. Global rank 0 writes them with torch.utils.tensorboard; `tensorboard --logdir`
(or any TensorBoard reader) reads them.

A run resumed from a checkpoint at step s starts a new event file that purges the steps after s
from the earlier ones (TensorBoard's `purge_step`): the steps redone since the checkpoint are
shown once, as the resumed run took them.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

DIRECTORY = "tensorboard"

# The tags, one name each wherever the curves are read.
LOSS = "loss/train"
EVAL_LOSS = "loss/held_out"
LEARNING_RATE = "optimizer/learning_rate"
GRAD_NORM = "optimizer/grad_norm"
TOKENS_PER_S = "throughput/tokens_per_s"
GOODPUT = "goodput/ratio"


class Curves:
    """TensorBoard scalars of one rank's view of the job (global rank 0's)."""

    def __init__(self, checkpoints: Path, resumed_at: int) -> None:
        # Steps are logged as the job's steps done (1 for the first): a run resumed at step s
        # logs s + 1 first, and drops what an earlier run logged from there on.
        self._writer = SummaryWriter(
            log_dir=str(checkpoints / DIRECTORY),
            purge_step=resumed_at + 1 if resumed_at > 0 else None,
        )

    def step(
        self,
        step: int,
        loss: float,
        learning_rate: float,
        grad_norm: float,
        tokens_per_s: float,
        goodput: float | None,
    ) -> None:
        w = self._writer
        w.add_scalar(LOSS, loss, step)
        w.add_scalar(LEARNING_RATE, learning_rate, step)
        w.add_scalar(GRAD_NORM, grad_norm, step)
        w.add_scalar(TOKENS_PER_S, tokens_per_s, step)
        if goodput is not None:
            w.add_scalar(GOODPUT, goodput, step)

    def evaluated(self, step: int, loss: float) -> None:
        self._writer.add_scalar(EVAL_LOSS, loss, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
