"""What a rank reports of itself: each step's line and phase times, its events, and the
record its `--out` file holds. Every rank prints its lines on stdout, so each node's agent
keeps its own goodput ledger from its ranks (`tessera_contracts.rank_events`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera_contracts.rank_events import EvalRecord, RankEvent, Record, StepRecord
from tessera_core.plan import JobLayout


@dataclass
class PhaseTimes:
    """Seconds per phase of each step this rank ran, for its step lines and its `--out` record;
    the node agent's `StepTimes` histogram counts whole steps for Prometheus."""

    compute_s: list[float] = field(default_factory=list)  # forward + backward (overlapped sync)
    sync_s: list[float] = field(default_factory=list)  # the sync tail after backward
    optimizer_s: list[float] = field(default_factory=list)  # the optimizer's own step
    step_s: list[float] = field(default_factory=list)  # whole step incl. optimizer


@dataclass
class RankRecord:
    """This rank's steps (losses, phase times, when each ended) and events."""

    times: PhaseTimes = field(default_factory=PhaseTimes)
    losses: dict[int, float] = field(default_factory=dict)  # step -> global loss (redone: over)
    step_ends: dict[int, float] = field(default_factory=dict)  # steps done -> wall-clock time
    events: list[RankEvent] = field(default_factory=list)
    # with --measure-memory: each step's and each relayout's peak tensor bytes, in order
    peak_bytes: list[int] = field(default_factory=list)
    relayout_peak_bytes: list[int] = field(default_factory=list)
    learning_rates: dict[int, float] = field(default_factory=dict)  # step -> the rate it took
    grad_norms: dict[int, float] = field(default_factory=dict)  # step -> the gradients' norm
    eval_losses: dict[int, float] = field(default_factory=dict)  # steps done -> held-out loss
    # who else reads this rank's records as they are printed (the rank's own goodput ledger)
    listeners: list[Callable[[Record], None]] = field(default_factory=list)

    def _print(self, record: Record) -> None:
        print(record.to_line(), flush=True)
        for listener in self.listeners:
            listener(record)

    def event(self, record: RankEvent) -> None:
        self.events.append(record)
        self._print(record)

    def log_step(
        self, step: int, rank: int, generation: int, layout: JobLayout, seq_len: int
    ) -> None:
        """One JSON line for the step just done, `step` (each node's agent counts it when the
        first of its ranks reports it)."""
        times = self.times
        record = StepRecord(
            step=step,
            rank=rank,
            generation=generation,
            loss=self.losses[step - 1],
            step_s=times.step_s[-1],
            samples=layout.global_batch,
            tokens=layout.global_batch * seq_len,
            compute_s=times.compute_s[-1] + times.optimizer_s[-1],
            tp_degrees=layout.tp_degrees,
            time=self.step_ends[step],
        )
        self._print(record)

    def log_eval(self, step: int, rank: int, generation: int, loss: float, samples: int) -> None:
        """The held-out loss after `step` steps, as a JSON line."""
        self.eval_losses[step] = loss
        self._print(EvalRecord(step, rank, generation, loss, samples, time.time()))

    def to_dict(self) -> dict:
        return {
            "losses": [self.losses[s] for s in sorted(self.losses)],
            "step_ends": self.step_ends,
            "events": [e.to_dict() for e in self.events],
            "peak_bytes": self.peak_bytes,
            "relayout_peak_bytes": self.relayout_peak_bytes,
            "learning_rates": self.learning_rates,
            "grad_norms": self.grad_norms,
            "eval_losses": self.eval_losses,
            **vars(self.times),
        }
