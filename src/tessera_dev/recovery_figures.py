"""The recovery bench's figures from what it saw of one policy's run: pure, no I/O.

A run is the steps the job completed (each with the time it ended, the samples in it and the
layout it trained on: the attempt and the generation), the layouts (each replica's GPUs, as the
generation document names them) and the faults injected into it (each with the time it was
injected and the time the job itself first knew of it). From them, per fault, over its window
(until the next fault):

- detection: from the fault to the job's first notice of it (a node agent ending its generation
  as failed); None for a fault the job is told of (a cordon, a GPU returned). The fault counts
  from its injection, or from the last step the job ended before the notice where that came
  later: injecting takes a while on loaded cores (finding the processes holding a GPU reads all
  of /proc), and a step that ends after the injection began shows it had not yet hit the job;
- switches: every change of layout in the window, in order (a drop to the replicas the survivors
  form, then a spare's join, are two), each with what it did (`changes`: a replica dropped, one
  resharded on its own group at another TP degree, one joined on GPUs new to it, a restart), its
  pause (from the last step before it to the first on the new layout) and the steps it redoes
  (steps done before it that the new layout does again);
- layouts: the TP degree of every replica the job trained on, before the fault and after each
  switch;
- pause and steps redone: the switches', summed; with no switch, the gap around the fault (a
  step's time) and none;
- time at reduced capacity: the time in the window the job trained on fewer GPUs than its whole
  layout (pauses left out: they are the pause), up to the window's end when it trains so then.

And per run: the healthy throughput (samples/s before the first fault, past the warm-up),
throughput while degraded against it (after a GPU is lost, until the next fault), goodput in time
form (the share of the run not lost to pauses and redone steps, past one step's time per pause:
`FaultFigures.lost_s`)
and in step form (unique samples done against what the healthy rate does in the same time), and
energy per sample (the GPUs' energy over the run per unique sample done).

The bench injects a fault once the job `recovered` from the one before: it trains settled on the
layout the operator published in answer, or it trained on, unmoved, for QUIET_S after the fault
(steps that stop right after it are a restart under way, not a fault that changed nothing).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tessera_sim.pauses import CHANGES

# A fault after which the job trains this long on the same layout changed nothing for it.
QUIET_S = 20.0
# Seconds as the bench writes them: to 0.1 ms.
DIGITS = 4

# A layout's replicas: the GPU ("node/index") of each rank, replica by replica.
Replicas = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Step:
    time: float  # Unix seconds when the step ended
    step: int  # the job's steps done, this one included
    samples: int  # the job's global batch in it
    layout: tuple[int, int]  # (attempt, generation) it trained on
    tp_degrees: tuple[int, ...] = ()  # of every replica, as the rank that logged it says


@dataclass(frozen=True)
class Fault:
    kind: str  # gpu-lost, gpu-cordoned, node-lost, gpu-returned, ... (tessera_sim.pauses)
    at: float  # Unix seconds when it was injected
    noticed: float | None  # when the job itself first knew; None: told (cordon, return)


@dataclass(frozen=True)
class Switch:
    """One change of layout: what it did (tessera_sim.pauses.CHANGES), its pause, the steps it
    redoes and the TP degree of every replica after it."""

    changes: tuple[str, ...]
    pause_s: float
    steps_redone: int
    layout: tuple[int, ...]


@dataclass(frozen=True)
class FaultFigures:
    kind: str
    detection_s: float | None
    pause_s: float  # the switches' pauses summed; with none, the gap around the fault
    steps_redone: int
    layouts: tuple[tuple[int, ...], ...]  # TP degrees before the fault, then after each switch
    switches: tuple[Switch, ...]
    reduced_s: float  # trained on fewer GPUs than the whole layout, within the window

    @property
    def relaid(self) -> bool:
        """Whether the job went on in another layout."""
        return bool(self.switches)

    def lost_s(self, step_s: float) -> float:
        """The training time the fault cost at a healthy step of `step_s`: each pause past the
        step it would have taken anyway, and the steps redone."""
        pauses = [s.pause_s for s in self.switches] or [self.pause_s]
        return sum(max(0.0, p - step_s) for p in pauses) + self.steps_redone * step_s

    def to_dict(self) -> dict[str, object]:
        """The entry of a `tessera.recovery/v2` file (tessera_sim.pauses), seconds to 0.1 ms:
        the fault's pause is its switches' pauses as written, summed."""
        switches = [{"changes": list(s.changes), "pause_s": round(s.pause_s, DIGITS)}
                    for s in self.switches]
        pause = sum(s["pause_s"] for s in switches) if switches else self.pause_s
        return {"kind": self.kind,
                "detection_s": None if self.detection_s is None else round(self.detection_s,
                                                                            DIGITS),
                "pause_s": round(pause, DIGITS), "steps_redone": self.steps_redone,
                "layouts": [list(x) for x in self.layouts], "switches": switches,
                "reduced_s": round(self.reduced_s, DIGITS)}


@dataclass(frozen=True)
class RunFigures:
    healthy_samples_per_s: float
    healthy_step_s: float  # the median time between healthy steps
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


def changes(before: Replicas, after: Replicas, restarted: bool) -> tuple[str, ...]:
    """What the switch from `before` to `after` did (CHANGES, in their order; none when `after`
    runs on the same GPUs): a restart when the attempt changed; else a replica of `after` on
    GPUs none of `before`'s held joined, one that shares GPUs with a replica of `before` but not
    all was resharded on its own group, and a replica of `before` that shares none with `after`
    was dropped."""
    if restarted:
        return ("restart",)
    old, new = [frozenset(r) for r in before], [frozenset(r) for r in after]
    found = set()
    for replica in new:
        kept = [o for o in old if o & replica]
        if not kept:
            found.add("join")
        elif any(o != replica for o in kept):
            found.add("reshard")
    if any(not any(o & n for n in new) for o in old):
        found.add("drop")
    return tuple(c for c in CHANGES if c in found)


def fault_figures(steps: Sequence[Step], fault: Fault, layouts: Mapping[tuple[int, int], Replicas],
                  whole: int, until: float | None = None) -> FaultFigures:
    """`fault`'s figures from the run's steps (those ending after `until`, the next fault, left
    out); `layouts` holds the replicas of every layout the steps name, `whole` the GPUs of the
    job's whole layout."""
    steps = [s for s in ordered(steps) if until is None or s.time <= until]
    before = [s for s in steps if s.time <= fault.at]
    if not before:
        raise FiguresError(f"no step ended before the {fault.kind} at {fault.at:.3f}")
    last = before[-1]
    after = [s for s in steps if s.time > fault.at]
    if not after:
        raise FiguresError(f"no step ended after the {fault.kind} at {fault.at:.3f}")
    missing = {s.layout for s in (last, *after)} - set(layouts)
    if missing:
        raise FiguresError(f"no layout document seen for (attempt, generation) {sorted(missing)}")
    detection = None
    if fault.noticed is not None:
        hit = max([fault.at] + [s.time for s in steps if s.time < fault.noticed])
        detection = max(0.0, fault.noticed - hit)
    switches = []
    on = last.layout
    seen = {on}
    for first in after:  # each layout new to the window, in the order the job reached it
        if first.layout in seen:
            continue
        seen.add(first.layout)
        prior = [s for s in steps if s.time < first.time]
        switches.append(Switch(
            changes(layouts[on], layouts[first.layout], first.layout[0] != on[0]),
            first.time - prior[-1].time, max(0, max(s.step for s in prior) - first.step + 1),
            _degrees(layouts[first.layout])))
        on = first.layout
    return FaultFigures(
        kind=fault.kind, detection_s=detection,
        pause_s=sum(s.pause_s for s in switches) if switches else after[0].time - last.time,
        steps_redone=sum(s.steps_redone for s in switches),
        layouts=(_degrees(layouts[last.layout]), *(s.layout for s in switches)),
        switches=tuple(switches),
        reduced_s=_reduced_s([last, *after], layouts, whole, until))


def _degrees(replicas: Replicas) -> tuple[int, ...]:
    return tuple(len(r) for r in replicas)


def _reduced_s(steps: Sequence[Step], layouts: Mapping[tuple[int, int], Replicas], whole: int,
               until: float | None) -> float:
    """The time between consecutive `steps` on one layout of fewer than `whole` GPUs, and from
    the last of them to `until` when the job trains on one then."""
    small = {k for k, replicas in layouts.items() if sum(_degrees(replicas)) < whole}
    total = sum(b.time - a.time for a, b in zip(steps, steps[1:], strict=False)
                if a.layout == b.layout and b.layout in small)
    if until is not None and steps[-1].layout in small:
        total += until - steps[-1].time
    return total


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
    lost = sum(f.lost_s(healthy_step) for f in figures)
    done = unique_samples(steps, start)
    metered = done if energy_since is None else unique_samples(steps, energy_since)
    return RunFigures(
        healthy_samples_per_s=healthy,
        healthy_step_s=healthy_step,
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
