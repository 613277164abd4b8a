"""The recovery bench's figures from what it saw of one policy's run: pure, no I/O.

A run is the steps the job completed (each with the time it ended, the samples in it and the
layout it trained on: the attempt and the generation) and the faults injected into it (each with
the time it was injected and the time the job itself first knew of it). From them, per fault:

- detection: from the fault to the job's first notice of it (a node agent ending its generation
  as failed); None for a fault the job is told of (a cordon, a GPU returned). The fault counts
  from its injection, or from the last step the job ended before the notice where that came
  later: injecting takes a while on loaded cores (finding the processes holding a GPU reads all
  of /proc), and a step that ends after the injection began shows it had not yet hit the job;
- pause: from the last step on the layout before the change to the first step on the one after
  it; with no change of layout, the gap around the fault (a step's time);
- steps redone: steps done before the change that the layout after it does again.

And per run: the healthy throughput (samples/s before the first fault, past the warm-up),
throughput while degraded against it (after a GPU is lost, until the next fault), goodput in time
form (the share of the run not lost to pauses and redone steps, past one step's time per pause)
and in step form (unique samples done against what the healthy rate does in the same time), and
energy per sample (the GPUs' energy over the run per unique sample done).

The bench injects a fault once the job `recovered` from the one before: it trains settled on the
layout the operator published in answer, or it trained on, unmoved, for QUIET_S after the fault
(steps that stop right after it are a restart under way, not a fault that changed nothing).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# A fault after which the job trains this long on the same layout changed nothing for it.
QUIET_S = 20.0


@dataclass(frozen=True)
class Step:
    time: float  # Unix seconds when the step ended
    step: int  # the job's steps done, this one included
    samples: int  # the job's global batch in it
    layout: tuple[int, int]  # (attempt, generation) it trained on


@dataclass(frozen=True)
class Fault:
    kind: str  # gpu-lost, gpu-cordoned, node-lost, gpu-returned, ... (tessera_sim.pauses)
    at: float  # Unix seconds when it was injected
    noticed: float | None  # when the job itself first knew; None: told (cordon, return)


@dataclass(frozen=True)
class FaultFigures:
    kind: str
    detection_s: float | None
    pause_s: float
    steps_redone: int
    relaid: bool  # whether the job went on in another layout

    def to_dict(self) -> dict[str, object]:
        """The entry of a `tessera.recovery/v1` file (tessera_sim.pauses)."""
        return {"kind": self.kind, "detection_s": self.detection_s, "pause_s": self.pause_s,
                "steps_redone": self.steps_redone}


@dataclass(frozen=True)
class RunFigures:
    healthy_samples_per_s: float
    degraded_over_healthy: float | None  # None: no GPU lost in the run
    goodput_time: float
    goodput_step: float
    energy_j_per_sample: float | None

    def to_dict(self) -> dict[str, float | None]:
        return dict(vars(self))


class FiguresError(ValueError):
    """The run does not hold what a figure needs (no step before a fault, too few steps)."""


def ordered(steps: Sequence[Step]) -> list[Step]:
    return sorted(steps, key=lambda s: s.time)


def fault_figures(steps: Sequence[Step], fault: Fault, until: float | None = None
                  ) -> FaultFigures:
    """`fault`'s figures from the run's steps (those ending after `until`, the next fault,
    left out)."""
    steps = [s for s in ordered(steps) if until is None or s.time <= until]
    before = [s for s in steps if s.time <= fault.at]
    if not before:
        raise FiguresError(f"no step ended before the {fault.kind} at {fault.at:.3f}")
    last = before[-1]
    changed = [s for s in steps if s.time > fault.at and s.layout != last.layout]
    detection = None
    if fault.noticed is not None:
        hit = max([fault.at] + [s.time for s in steps if s.time < fault.noticed])
        detection = max(0.0, fault.noticed - hit)
    if not changed:
        later = [s for s in steps if s.time > fault.at]
        if not later:
            raise FiguresError(f"no step ended after the {fault.kind} at {fault.at:.3f}")
        return FaultFigures(fault.kind, detection, later[0].time - last.time, 0, False)
    first = changed[0]
    prior = [s for s in steps if s.time < first.time]
    redone = max(0, max(s.step for s in prior) - first.step + 1)
    return FaultFigures(fault.kind, detection, first.time - prior[-1].time, redone, True)


def step_time(steps: Sequence[Step], start: float, end: float) -> float:
    """The median time between consecutive steps ending in [start, end]."""
    times = [s.time for s in ordered(steps) if start <= s.time <= end]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if not gaps:
        raise FiguresError(f"fewer than two steps between {start:.3f} and {end:.3f}")
    return statistics.median(gaps)


def rate(steps: Sequence[Step], start: float, end: float) -> float:
    """Samples per second over the steps ending in [start, end], first step's end to last's."""
    inside = [s for s in ordered(steps) if start <= s.time <= end]
    if len(inside) < 2:
        raise FiguresError(f"fewer than two steps between {start:.3f} and {end:.3f}")
    return sum(s.samples for s in inside[1:]) / (inside[-1].time - inside[0].time)


def unique_samples(steps: Sequence[Step], start: float) -> int:
    """Samples of the distinct steps ending after `start`: each step counted once, at the
    last time it was done (a redone step's earlier run was lost)."""
    final: dict[int, Step] = {}
    for s in ordered(steps):
        final[s.step] = s
    return sum(s.samples for s in final.values() if s.time > start)


def run_figures(steps: Sequence[Step], faults: Sequence[Fault], figures: Sequence[FaultFigures],
                warmup: int, energy_j: float | None, energy_since: float | None = None
                ) -> RunFigures:
    """The run's figures; `figures` are `faults`' figures in the same order, `warmup` the steps left
    out of the healthy rate, `energy_j` the GPUs' energy from `energy_since` (the first counted
    step, if not given) to the last step."""
    if len(faults) != len(figures):
        raise FiguresError(f"{len(faults)} faults, figures for {len(figures)}")
    steps = ordered(steps)
    if len(steps) <= warmup + 1:
        raise FiguresError(f"{len(steps)} steps, not more than the {warmup} of warm-up")
    first_fault = min((f.at for f in faults), default=steps[-1].time)
    start, end = steps[warmup].time, steps[-1].time
    healthy = rate(steps, start, first_fault)
    healthy_step = step_time(steps, start, first_fault)
    degraded = None
    for i, fault in enumerate(faults):
        if fault.kind != "gpu-lost":
            continue
        until = faults[i + 1].at if i + 1 < len(faults) else end
        after = [s for s in steps if fault.at < s.time <= until]
        settled = [s for s in after if s.layout == after[-1].layout] if after else []
        if len(settled) >= 2:
            degraded = rate(settled, settled[0].time, settled[-1].time) / healthy
    window = end - start
    lost = sum(max(0.0, f.pause_s - healthy_step) + f.steps_redone * healthy_step
               for f in figures)
    done = unique_samples(steps, start)
    metered = done if energy_since is None else unique_samples(steps, energy_since)
    return RunFigures(
        healthy_samples_per_s=healthy,
        degraded_over_healthy=degraded,
        goodput_time=max(0.0, 1 - lost / window),
        goodput_step=done / (healthy * window),
        energy_j_per_sample=None if energy_j is None or metered == 0 else energy_j / metered,
    )


def recovered(steps: Sequence[Step], at: float, settle: int,
              published: tuple[int, int] | None, since: float) -> bool:
    """Whether the job trains again after a fault at `at` (for a fault its health source takes
    time to agree with, such as a GPU back from XID 79, from when it does). `published` is the
    layout the operator publishes now, (attempt, generation) (None between CKPT-RESTART's
    attempts), first seen at `since`. Published after the fault: the operator answered it, and
    the job trains again once `settle` steps ran on it (a planned switch comes at its step).
    Published before: the fault changed nothing once the job trained on it for QUIET_S since."""
    if published is None:
        return False
    on = [s for s in steps if s.time > at and s.layout == published]
    if since > at:
        return len(on) >= settle
    return bool(on) and on[-1].time - at > QUIET_S
