"""Failure traces and failed-GPU snapshots, and what they leave of each TP group.

A failure takes out one aligned block of `blast_radius` GPUs until it is repaired. Arrivals are
Poisson with the same rate on every block: the per-GPU rate, since a GPU goes down exactly when its
block does (so a larger blast radius means fewer, larger events and the same failed share on
average). The trace starts warm (failures from before t=0 that are
still under repair are in it) so that day 0 already looks like a cluster in steady state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera_sim.config import SimConfig

# Exponential repairs have no upper bound: a warm-up of this many of the longer mean repair times
# leaves out at most e^-8 (0.03%) of the failures that would still be down at t=0.
_EXPONENTIAL_WARMUP_MEANS = 8.0


@dataclass(frozen=True)
class Topology:
    """GPU -> TP group layout: the job's DP x PP groups first, then hot spare groups."""

    tp: int
    job_groups: int
    spare_groups: int
    blast_radius: int

    @classmethod
    def of(cls, cfg: SimConfig) -> Topology:
        return cls(cfg.tp, cfg.n_groups, cfg.spare_groups, cfg.failures.blast_radius)

    @property
    def groups(self) -> int:
        return self.job_groups + self.spare_groups

    @property
    def gpus(self) -> int:
        return self.groups * self.tp

    @property
    def blocks(self) -> int:
        return self.gpus // self.blast_radius

    def blocks_for(self, failed_fraction: float) -> int:
        """Whole failed blocks nearest to `failed_fraction` of the GPUs (at least that coarse)."""
        if not 0.0 <= failed_fraction <= 1.0:
            raise ValueError(f"failed fraction must be in [0, 1], got {failed_fraction}")
        return round(failed_fraction * self.blocks)

    def failed_share(self, blocks: int) -> float:
        """The share of GPUs actually down when `blocks` blocks are: what rows must report."""
        return blocks * self.blast_radius / self.gpus

    def survivors(self, down_blocks: np.ndarray) -> np.ndarray:
        """Working GPUs per group (length `groups`) when the given blocks are down."""
        gpus = (down_blocks[:, None] * self.blast_radius + np.arange(self.blast_radius)).ravel()
        down = np.bincount(gpus // self.tp, minlength=self.groups)
        return self.tp - down

    def block_overlaps(self, block: int) -> list[tuple[int, int]]:
        """(group, GPUs of the block inside it) for every group the block touches."""
        lo, hi = block * self.blast_radius, (block + 1) * self.blast_radius
        return [
            (g, min(hi, (g + 1) * self.tp) - max(lo, g * self.tp))
            for g in range(lo // self.tp, (hi - 1) // self.tp + 1)
        ]


@dataclass(frozen=True)
class FailureTrace:
    """Failure events sorted by start day; `start_day` < 0 are warm-up failures."""

    start_day: np.ndarray
    end_day: np.ndarray
    block: np.ndarray
    days: float

    def events(self) -> list[tuple[float, int, int]]:
        """(day, +1 failure / -1 repair, block) in time order; repairs first on equal days."""
        starts = [(float(t), 1, int(b)) for t, b in zip(self.start_day, self.block, strict=True)]
        ends = [
            (float(t), -1, int(b))
            for t, b in zip(self.end_day, self.block, strict=True)
            if t < self.days
        ]
        return sorted(starts + ends)


def warmup_days(cfg: SimConfig) -> float:
    """How far before day 0 a trace draws failures: whichever repair is slower sets how far back
    a failure can still be down at day 0."""
    f = cfg.failures
    slower = max(f.hardware_repair_days, f.software_repair_hours / 24.0)
    return slower * (_EXPONENTIAL_WARMUP_MEANS if f.repair_distribution == "exponential" else 1.0)


def failures_per_day(cfg: SimConfig, topo: Topology) -> float:
    """Expected failure events per day: one per block at the per-GPU rate."""
    return cfg.failures.rate_per_gpu_day * topo.blocks


def sample_trace(cfg: SimConfig, topo: Topology, rng: np.random.Generator) -> FailureTrace:
    """Draw one failure trace over `cfg.days` (plus a warm-up) for every GPU of `topo`."""
    f = cfg.failures
    hw_repair = f.hardware_repair_days
    sw_repair = f.software_repair_hours / 24.0
    warmup = warmup_days(cfg)
    n = int(rng.poisson(failures_per_day(cfg, topo) * (cfg.days + warmup)))
    start = np.sort(rng.uniform(-warmup, cfg.days, n))
    block = rng.integers(0, topo.blocks, n)
    hardware = rng.random(n) < f.hardware_share
    mean_repair = np.where(hardware, hw_repair, sw_repair)
    exponential = f.repair_distribution == "exponential"
    repair = rng.exponential(mean_repair) if exponential else mean_repair
    end = start + repair
    # Warm-up failures already repaired by day 0 cannot affect the trace.
    keep = end > 0
    return FailureTrace(start[keep], end[keep], block[keep], cfg.days)


def sample_down_blocks(topo: Topology, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct blocks, uniformly at random."""
    return rng.choice(topo.blocks, size=count, replace=False)
