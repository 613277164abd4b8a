"""Goodput accounting: where a trainer's wall time went, from events at its phase boundaries.

Pure: no torch, no I/O; the clock is injected. Definitions (docs/goodput.md says why):

- **Wall time** W: from the ledger's start to the latest clock reading.
- **Productive time** P: time spent in the `training` phase on steps that count, i.e. steps
  that completed and were not undone by a rollback, plus the step in flight (provisionally: if
  it is aborted, its time moves to lost progress).
- **Badput** B[c] for each category c, disjoint and exhaustive so that P + sum(B) == W exactly
  (time is kept as exact rationals of the clock's floats, so the identity holds bit for bit):
  `startup`, `reconfiguration`, `restart`, `checkpoint_save`, `checkpoint_restore`,
  `waiting_for_health`, `other` (time in the phase of that name) and `lost_progress` (time of
  training that did not count: an aborted step in flight and the steps a rollback undid).
- **Goodput** G = P / W; the step-based form is (steps that count) x (ideal step time) / W,
  which also charges slow steps (a degraded replica) against the job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from tessera_contracts.vocabulary import BADPUT_CATEGORIES, LOST_PROGRESS, Phase


@dataclass(frozen=True)
class Account:
    """The ledger at one instant. Seconds are exact rationals; `productive + sum(badput)` equals
    `wall` exactly."""

    wall: Fraction
    productive: Fraction
    badput: Mapping[str, Fraction]
    phase: Phase
    step: int  # the last step that counts
    steps_counted: int  # steps that count since the ledger started
    steps_lost: int  # steps undone by rollbacks
    samples: int  # processed by every completed step, redone ones included (throughput)
    tokens: int
    reconfigurations: int
    tp_degrees: Mapping[int, int] = field(default_factory=dict)  # replica -> TP degree

    @property
    def goodput(self) -> float:
        """Productive time over wall time; 0 before any time has passed."""
        return float(self.productive / self.wall) if self.wall > 0 else 0.0

    def step_goodput(self, ideal_step_seconds: float) -> float:
        """(steps that count) x (ideal step time) / wall time."""
        if ideal_step_seconds <= 0:
            raise ValueError(f"the ideal step time must be positive, got {ideal_step_seconds}")
        if self.wall <= 0:
            return 0.0
        return float(self.steps_counted * Fraction(ideal_step_seconds) / self.wall)


class Ledger:
    """Event-driven goodput ledger of one trainer; safe to read from another thread (a scrape).

    The trainer calls `enter(phase)` at each phase boundary, `step_done` after each optimizer
    step, `checkpointed(step)` after a save and `rollback(step)` when it resumes from a
    checkpoint; `joined(step)` when it takes up the job at a step it did not see done. An event
    learned after the fact (a record read from a process's output) passes `at`, the clock
    reading when it happened. A clock that goes back (one that is not monotonic, or an `at`
    before the last event) counts as no time passing.
    """

    def __init__(self, clock: Callable[[], float], *, step: int = 0,
                 phase: Phase = Phase.STARTUP) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._start = self._last = Fraction(clock())
        self._phase = Phase(phase)
        self._first_step = step
        self._step = step
        self._productive = Fraction(0)
        self._productive_at_step = Fraction(0)  # at the end of the last step that counts
        # the steps a rollback may return to (the first and each checkpoint) -> productive time
        # at the end of that step; one entry per checkpoint, not per step
        self._restore_points: dict[int, Fraction] = {step: Fraction(0)}
        self._in_flight = Fraction(0)  # training time since the last step boundary
        self._badput = {c: Fraction(0) for c in BADPUT_CATEGORIES}
        self._steps_lost = 0
        self._steps_skipped = 0  # steps done without this ledger (joined)
        self._samples = 0
        self._tokens = 0
        self._reconfigurations = 0
        self._tp: dict[int, int] = {}

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    @property
    def step(self) -> int:
        """The last step that counts."""
        with self._lock:
            return self._step

    def _advance(self, at: float | None = None) -> None:
        """Charge the time since the last event (until `at`, default now) to the current
        phase."""
        now = max(Fraction(self._clock() if at is None else at), self._last)
        elapsed, self._last = now - self._last, now
        if self._phase is Phase.TRAINING:
            self._productive += elapsed
            self._in_flight += elapsed
        else:
            self._badput[self._phase.value] += elapsed

    def enter(self, phase: Phase | str, *, at: float | None = None) -> None:
        """The trainer enters `phase`. Leaving training mid-step aborts the step in flight: its
        time moves to lost progress (a boundary exactly at a step end loses nothing)."""
        new = Phase(phase)
        with self._lock:
            self._advance(at)
            if self._phase is Phase.TRAINING and new is not Phase.TRAINING:
                self._lose(self._in_flight)
                self._in_flight = Fraction(0)
            if new is Phase.RECONFIGURATION and self._phase is not Phase.RECONFIGURATION:
                self._reconfigurations += 1
            self._phase = new

    def step_done(self, step: int, *, samples: int, tokens: int,
                  at: float | None = None) -> None:
        """Step `step` (the one after the last that counts) completed in the training phase."""
        if samples < 0 or tokens < 0:
            raise ValueError(f"samples and tokens are counts, got {samples} and {tokens}")
        with self._lock:
            if self._phase is not Phase.TRAINING:
                raise ValueError(f"step {step} completed outside training (in {self._phase})")
            if step != self._step + 1:
                raise ValueError(f"step {step} completed after step {self._step}: steps count "
                                 "one at a time (call rollback to redo earlier ones)")
            self._advance(at)
            self._step = step
            self._productive_at_step = self._productive
            self._in_flight = Fraction(0)
            self._samples += samples
            self._tokens += tokens

    def checkpointed(self, step: int) -> None:
        """The state after step `step`, the last that counts, is saved: a rollback may return
        to it."""
        with self._lock:
            if step != self._step:
                raise ValueError(f"checkpoint of step {step}, but the last step that counts is "
                                 f"{self._step}")
            self._restore_points[step] = self._productive_at_step

    def rollback(self, step: int) -> None:
        """Training resumes after `step` (the first step or a checkpoint): the steps after it no
        longer count, and their time, with any step in flight, moves from productive to lost
        progress."""
        with self._lock:
            if step not in self._restore_points or step > self._step:
                known = sorted(s for s in self._restore_points if s <= self._step)
                raise ValueError(f"cannot roll back to step {step}: the ledger can return to "
                                 f"steps {known} (its first step and its checkpoints)")
            self._advance()
            self._lose(self._productive - self._restore_points[step])
            self._steps_lost += self._step - step
            self._step = step
            self._productive_at_step = self._restore_points[step]
            self._restore_points = {s: p for s, p in self._restore_points.items() if s <= step}
            self._in_flight = Fraction(0)

    def joined(self, step: int) -> None:
        """The trainer goes on after step `step`, which it did not see done (its processes
        joined the job there, or it was out of the job meanwhile): the steps up to it count
        neither as this ledger's nor as lost, and a rollback may return to it (not before it)."""
        with self._lock:
            if step < self._step:
                raise ValueError(f"joined at step {step}, before the last step that counts "
                                 f"({self._step}): call rollback to redo steps")
            self._steps_skipped += step - self._step
            self._step = step
            self._productive_at_step = self._productive - self._in_flight
            # a rollback can return no further: the steps before were not this ledger's
            self._restore_points = {step: self._productive_at_step}

    def set_layout(self, tp_degrees: Mapping[int, int]) -> None:
        """The TP degree of each replica in the layout the trainer runs now."""
        with self._lock:
            self._tp = dict(tp_degrees)

    def _lose(self, seconds: Fraction) -> None:
        self._productive -= seconds
        self._badput[LOST_PROGRESS] += seconds

    def account(self) -> Account:
        """The ledger now, with the time since the last event charged to the current phase."""
        with self._lock:
            self._advance()
            return Account(
                wall=self._last - self._start,
                productive=self._productive,
                badput=dict(self._badput),
                phase=self._phase,
                step=self._step,
                steps_counted=self._step - self._first_step - self._steps_skipped,
                steps_lost=self._steps_lost,
                samples=self._samples,
                tokens=self._tokens,
                reconfigurations=self._reconfigurations,
                tp_degrees=dict(self._tp),
            )
