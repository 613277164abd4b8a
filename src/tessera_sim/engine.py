"""Discrete-event engine: replay one failure trace through every policy at once, or score snapshots.

Simulated time is the trace's own clock (days); nothing here reads the wall clock or does I/O.
All policies see the same failed GPUs at the same instants, so their differences are the
policies', not the dice's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from tessera_sim.config import SimConfig
from tessera_sim.failures import FailureTrace, Topology, sample_down_blocks
from tessera_sim.policies import Capacity, Policy

SECONDS_PER_DAY = 86_400.0
_CAPACITY_FIELDS = tuple(f.name for f in fields(Capacity))


@dataclass(frozen=True)
class TraceResult:
    """Piecewise-constant throughput of every policy over one trace."""

    policies: tuple[str, ...]
    # Interval i spans [start[i], start[i] + length[i]) in days.
    start: np.ndarray
    length: np.ndarray
    failed_fraction: np.ndarray
    # (interval, policy) arrays.
    throughput: np.ndarray
    deficit_groups: np.ndarray
    extra_power: np.ndarray
    peak_group_power: np.ndarray
    # Per policy: throughput-days lost to whole-job pauses (restarts, reconfigurations).
    stall_loss: np.ndarray
    days: float
    # Failure events from day 0 on, a failure on a block already down included.
    failures: int

    def goodput(self) -> np.ndarray:
        """Per policy: useful work over the trace as a share of the healthy job's."""
        work = self.length @ self.throughput
        return (work - self.stall_loss) / self.days

    def mean_throughput(self) -> np.ndarray:
        return (self.length @ self.throughput) / self.days

    def time_share(self, condition: np.ndarray) -> float:
        """Share of the trace's time during which `condition` (per interval) holds."""
        return float(self.length @ condition) / self.days


def _evaluate(
    policies: Sequence[Policy],
    survivors: np.ndarray,
    cfg: SimConfig,
    columns: dict[str, np.ndarray],
    row: int,
) -> list[np.ndarray]:
    """Record every policy's capacity in `row` of `columns`; each policy's groups in use."""
    results = [p.evaluate(survivors, cfg.dp, cfg.pp) for p in policies]
    for name, column in columns.items():
        column[row] = [getattr(capacity, name) for capacity, _ in results]
    return [in_use for _, in_use in results]


class _ClusterState:
    """Failed-block counters and the survivors per TP group they leave, updated per event."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.down = np.zeros(topo.blocks, dtype=np.int32)
        self.survivors = np.full(topo.groups, topo.tp, dtype=np.int64)
        self.failed_gpus = 0

    def apply(self, kind: int, block: int) -> list[tuple[int, int]]:
        """Apply a failure (+1) or repair (-1); (group, survivors before) for each group changed."""
        before = self.down[block]
        after = before + kind
        self.down[block] = after
        if (before > 0) == (after > 0):
            # A failure on a block that is already down, or the repair of one of two overlapping.
            return []
        self.failed_gpus += kind * self.topo.blast_radius
        changed = []
        for group, gpus in self.topo.block_overlaps(block):
            changed.append((group, int(self.survivors[group])))
            self.survivors[group] -= kind * gpus
        return changed


def _pauses_charged(
    policies: Sequence[Policy],
    changed: list[tuple[int, int]],
    now: np.ndarray,
    used_before: list[np.ndarray],
    used_after: list[np.ndarray],
) -> np.ndarray:
    """Per policy: whether the event changed the layout of a group it uses, before or after the
    event (then it reconfigures).

    A second failure in a group the policy already dropped, or repairing one of two failures in
    it, changes nothing for uniform TP and costs it no pause; NTP reshards at every change. A
    group serving in no replica (an idle standby domain, an intact group left over from
    regrouping) changes no replica: its failure costs nothing.
    """
    return np.array(
        [
            any(
                p.layout(old) != p.layout(now[g]) and (before[g] or after[g])
                for g, old in changed
            )
            for p, before, after in zip(policies, used_before, used_after, strict=True)
        ],
        dtype=bool,
    )


def _merged_pause_time(starts: list[float], ends: list[float], at: np.ndarray) -> np.ndarray:
    """Paused time before each instant of `at` for pauses [start, end) merged where they overlap
    (a reconfiguration during another one extends it; it does not add to it)."""
    merged: list[list[float]] = []
    for a, b in sorted(zip(starts, ends, strict=True)):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return np.zeros(len(at))
    lo, hi = np.array(merged).T
    before = np.concatenate([[0.0], np.cumsum(hi - lo)])
    # The last pause starting at or before each instant; instants before every pause have none.
    k = np.searchsorted(lo, at, side="right") - 1
    last = np.maximum(k, 0)
    inside = np.clip(at - lo[last], 0.0, hi[last] - lo[last])
    return np.where(k >= 0, before[last] + inside, 0.0)


def run_trace(
    cfg: SimConfig,
    topo: Topology,
    trace: FailureTrace,
    policies: Sequence[Policy],
) -> TraceResult:
    """Replay `trace` from its warm-up to its last day, evaluating every policy after each event."""
    state = _ClusterState(topo)
    events = trace.events()
    # 1. Warm-up: failures from before day 0 that are still being repaired at day 0.
    first = 0
    while first < len(events) and events[first][0] < 0:
        state.apply(events[first][1], events[first][2])
        first += 1
    # 2. Sweep: one interval from day 0 and one after every later event.
    times = [0.0] + [e[0] for e in events[first:]]
    n = len(times)
    columns = {name: np.empty((n, len(policies))) for name in _CAPACITY_FIELDS}
    failed = np.empty(n)
    pause_s = {
        1: np.array([p.failure_stall_s for p in policies]) / SECONDS_PER_DAY,
        -1: np.array([p.repair_stall_s for p in policies]) / SECONDS_PER_DAY,
    }
    pauses: list[tuple[list[float], list[float]]] = [([], []) for _ in policies]
    used = _evaluate(policies, state.survivors, cfg, columns, 0)
    failed[0] = state.failed_gpus / topo.gpus
    for i in range(1, n):
        day, kind, block = events[first + i - 1]
        changed = state.apply(kind, block)
        used_before, used = used, _evaluate(policies, state.survivors, cfg, columns, i)
        # 3. A policy whose groups changed pauses whole while it reconfigures.
        charged = _pauses_charged(policies, changed, state.survivors, used_before, used)
        for j in np.flatnonzero(charged & (pause_s[kind] > 0)):
            pauses[j][0].append(day)
            pauses[j][1].append(day + pause_s[kind][j])
        failed[i] = state.failed_gpus / topo.gpus
    start = np.array(times)
    length = np.diff(np.append(start, trace.days))
    # 4. The work a paused job would have done is lost; pauses end at the trace's end at latest.
    bounds = np.append(start, trace.days)
    paused = np.zeros((n, len(policies)))
    for j, (pause_start, pause_end) in enumerate(pauses):
        paused[:, j] = np.diff(_merged_pause_time(pause_start, pause_end, bounds))
    return TraceResult(
        policies=tuple(p.name for p in policies),
        start=start,
        length=length,
        failed_fraction=failed,
        stall_loss=(paused * columns["throughput"]).sum(axis=0),
        **columns,
        days=trace.days,
        failures=sum(1 for _, kind, _ in events[first:] if kind > 0),
    )


def snapshot(
    cfg: SimConfig,
    topo: Topology,
    policies: Sequence[Policy],
    blocks: int,
    trials: int,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Capacity fields, each (trials, policies), with `blocks` random failed blocks."""
    columns = {name: np.empty((trials, len(policies))) for name in _CAPACITY_FIELDS}
    for t in range(trials):
        survivors = topo.survivors(sample_down_blocks(topo, blocks, rng))
        _evaluate(policies, survivors, cfg, columns, t)
    return columns
