"""Discrete-event engine: replay one failure trace through every policy at once, or score snapshots.

Simulated time is the trace's own clock (days); nothing here reads the wall clock or does I/O.
All policies see the same failed GPUs at the same instants, so their differences are the
policies', not the dice's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from tessera_operator.simulator.config import SimConfig
from tessera_operator.simulator.failures import FailureTrace, Topology, sample_down_blocks
from tessera_operator.simulator.policies import Capacity, Policy

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

    def goodput(self) -> np.ndarray:
        """Per policy: useful work over the trace as a share of the healthy job's."""
        work = self.length @ self.throughput
        return (work - self.stall_loss) / self.days

    def mean_throughput(self) -> np.ndarray:
        return (self.length @ self.throughput) / self.days

    def time_share(self, condition: np.ndarray) -> float:
        """Share of the trace's time during which `condition` (per interval) holds."""
        return float(self.length @ condition) / self.days


def _record(columns: dict[str, np.ndarray], row: int, capacities: list[Capacity]) -> None:
    for name, column in columns.items():
        column[row] = [getattr(c, name) for c in capacities]


class _ClusterState:
    """Failed-block counters and the survivors per TP group they leave, updated per event."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.down = np.zeros(topo.blocks, dtype=np.int32)
        self.survivors = np.full(topo.groups, topo.tp, dtype=np.int64)
        self.failed_gpus = 0

    def apply(self, kind: int, block: int) -> bool:
        """Apply a failure (+1) or repair (-1); True when a job group's survivors changed."""
        before = self.down[block]
        after = before + kind
        self.down[block] = after
        if (before > 0) == (after > 0):
            # A failure on a block that is already down, or the repair of one of two overlapping.
            return False
        self.failed_gpus += kind * self.topo.blast_radius
        touched = False
        for group, gpus in self.topo.block_overlaps(block):
            self.survivors[group] -= kind * gpus
            touched |= group < self.topo.job_groups
        return touched


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
    stall = np.zeros(len(policies))
    failure_stall = np.array([p.failure_stall_s for p in policies]) / SECONDS_PER_DAY
    repair_stall = np.array([p.repair_stall_s for p in policies]) / SECONDS_PER_DAY
    for i in range(n):
        touched = False
        kind = 0
        if i > 0:
            _, kind, block = events[first + i - 1]
            touched = state.apply(kind, block)
        _record(columns, i, [p.evaluate(state.survivors, cfg.dp, cfg.pp) for p in policies])
        failed[i] = state.failed_gpus / topo.gpus
        if touched:
            # 3. The job pauses whole while it reconfigures; the work it would have done is lost.
            stall += (failure_stall if kind > 0 else repair_stall) * columns["throughput"][i]
    start = np.array(times)
    length = np.diff(np.append(start, trace.days))
    return TraceResult(
        policies=tuple(p.name for p in policies),
        start=start,
        length=length,
        failed_fraction=failed,
        stall_loss=stall,
        **columns,
        days=trace.days,
    )


def snapshot(
    cfg: SimConfig,
    topo: Topology,
    policies: Sequence[Policy],
    failed_fraction: float,
    trials: int,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Capacity fields, each (trials, policies), with a fixed share of GPUs failed."""
    columns = {name: np.empty((trials, len(policies))) for name in _CAPACITY_FIELDS}
    for t in range(trials):
        survivors = topo.survivors(sample_down_blocks(topo, failed_fraction, rng))
        _record(columns, t, [p.evaluate(survivors, cfg.dp, cfg.pp) for p in policies])
    return columns
