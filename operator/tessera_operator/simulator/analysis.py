"""Studies built on the engine: loss vs failed fraction, availability vs TP, spares, goodput.

Every study draws its randomness from one seed (split per study with numpy's SeedSequence), so a
seed reproduces the whole report bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera_operator.simulator.config import SimConfig
from tessera_operator.simulator.engine import TraceResult, run_trace, snapshot
from tessera_operator.simulator.failures import Topology, sample_down_blocks, sample_trace
from tessera_operator.simulator.policies import Policy, build_policies

DEFAULT_FRACTIONS: tuple[float, ...] = (
    0.0, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075, 0.01,
)  # fmt: skip
DEFAULT_TPS: tuple[int, ...] = (8, 16, 32, 64, 72)
AVAILABILITY_FRACTIONS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.004)

# Called as (phase, done, total) while a study runs.
StudyProgress = Callable[[str, int, int], None]


def _no_progress(phase: str, done: int, total: int) -> None:
    del phase, done, total


@dataclass(frozen=True)
class StudySettings:
    """How much Monte Carlo each part of a study does."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    tps: tuple[int, ...] = DEFAULT_TPS
    availability_fractions: tuple[float, ...] = AVAILABILITY_FRACTIONS
    trials: int = 32
    traces: int = 8

    def validate(self, gpus: int) -> StudySettings:
        """Raise ValueError on settings no study of a `gpus`-GPU job can use; return self."""
        if self.trials < 1 or self.traces < 1:
            raise ValueError(f"trials and traces must be >= 1, got {self.trials}, {self.traces}")
        for f in (*self.fractions, *self.availability_fractions):
            if not 0.0 <= f < 1.0:
                raise ValueError(f"failed fractions must be in [0, 1), got {f}")
        if any(not 1 <= tp <= gpus for tp in self.tps):
            raise ValueError(f"TP sizes must be in [1, {gpus}] GPUs, got {self.tps}")
        return self


@dataclass
class Study:
    """A full comparison; rows are plain dicts so they go straight to CSV and JSON."""

    config: SimConfig
    policies: list[dict[str, Any]] = field(default_factory=list)
    loss: list[dict[str, Any]] = field(default_factory=list)
    availability: list[dict[str, Any]] = field(default_factory=list)
    goodput: list[dict[str, Any]] = field(default_factory=list)
    trace_stats: dict[str, float] = field(default_factory=dict)
    # The first trace, kept whole for the time-series plot.
    trace: TraceResult | None = None


def spares_needed(deficit_groups: np.ndarray, groups_per_domain: int) -> np.ndarray:
    """Standby domains that cover a deficit given in TP-group equivalents."""
    return np.ceil(np.maximum(deficit_groups, 0.0) / groups_per_domain - 1e-9).astype(int)


def loss_curve(
    cfg: SimConfig,
    policies: Sequence[Policy],
    fractions: Sequence[float],
    trials: int,
    rng: np.random.Generator,
    progress: StudyProgress = _no_progress,
) -> list[dict[str, Any]]:
    """Throughput loss and spares needed per policy at each share of failed GPUs.

    Failures come in whole blocks, so a requested share is rounded to a number of blocks; rows
    report the share actually failed (`failed_fraction`) next to the one asked for.
    """
    topo = Topology.of(cfg)
    rows = []
    for k, fraction in enumerate(fractions):
        blocks = topo.blocks_for(fraction)
        draws = snapshot(cfg, topo, policies, blocks, trials, rng)
        spares = spares_needed(draws["deficit_groups"], cfg.groups_per_domain)
        for j, policy in enumerate(policies):
            loss = 1.0 - draws["throughput"][:, j]
            rows.append(
                {
                    "requested_fraction": fraction,
                    "failed_fraction": topo.failed_share(blocks),
                    "failed_gpus": blocks * topo.blast_radius,
                    "policy": policy.name,
                    "loss_mean": float(loss.mean()),
                    "loss_std": float(loss.std()),
                    "loss_max": float(loss.max()),
                    "spares_mean": float(spares[:, j].mean()),
                    "spares_max": int(spares[:, j].max()),
                    "extra_power_mean": float(draws["extra_power"][:, j].mean()),
                    "peak_group_power": float(draws["peak_group_power"][:, j].max()),
                }
            )
        progress("loss vs failed fraction", k + 1, len(fractions))
    return rows


def availability_curve(
    gpus: int,
    tps: Sequence[int],
    fractions: Sequence[float],
    trials: int,
    rng: np.random.Generator,
    progress: StudyProgress = _no_progress,
) -> list[dict[str, Any]]:
    """Share of GPUs in intact TP groups (= intact domains when TP fills the domain).

    Single-GPU failures, `gpus // tp` groups (so NVL72 uses 72 x 455 GPUs of 32,768).
    """
    rows = []
    for k, tp in enumerate(tps):
        topo = Topology(tp=tp, job_groups=gpus // tp, spare_groups=0, blast_radius=1)
        for fraction in fractions:
            failed = topo.blocks_for(fraction)
            intact = [
                float(np.mean(topo.survivors(sample_down_blocks(topo, failed, rng)) == tp))
                for _ in range(trials)
            ]
            actual = topo.failed_share(failed)
            rows.append(
                {
                    "tp": tp,
                    "requested_fraction": fraction,
                    "failed_fraction": actual,
                    "intact_share": float(np.mean(intact)),
                    "intact_share_std": float(np.std(intact)),
                    "closed_form": (1.0 - actual) ** tp,
                }
            )
        progress("availability vs TP", k + 1, len(tps))
    return rows


def run_traces(
    cfg: SimConfig,
    policies: Sequence[Policy],
    seeds: Sequence[np.random.SeedSequence],
    progress: StudyProgress = _no_progress,
) -> list[TraceResult]:
    """One full trace per seed, every policy replayed on each."""
    topo = Topology.of(cfg)
    results = []
    for k, seed in enumerate(seeds):
        trace = sample_trace(cfg, topo, np.random.default_rng(seed))
        results.append(run_trace(cfg, topo, trace, policies))
        progress("failure traces", k + 1, len(seeds))
    return results


def goodput_rows(
    cfg: SimConfig, policies: Sequence[Policy], results: Sequence[TraceResult]
) -> list[dict[str, Any]]:
    """Per policy: goodput, throughput and spares over the traces (mean and worst trace)."""
    goodput = np.array([r.goodput() for r in results])
    mean = np.array([r.mean_throughput() for r in results])
    low = np.array([r.throughput.min(axis=0) for r in results])
    spares = np.array(
        [spares_needed(r.deficit_groups.max(axis=0), cfg.groups_per_domain) for r in results]
    )
    stall = np.array([r.stall_loss / r.days for r in results])
    power = np.array([(r.length @ r.extra_power) / r.days for r in results])
    peak = np.array([r.peak_group_power.max(axis=0) for r in results])
    return [
        {
            "policy": p.name,
            "goodput_mean": float(goodput[:, j].mean()),
            "goodput_min": float(goodput[:, j].min()),
            "throughput_mean": float(mean[:, j].mean()),
            "throughput_min": float(low[:, j].min()),
            "stall_share": float(stall[:, j].mean()),
            "spares_needed_max": int(spares[:, j].max()),
            "extra_power_mean": float(power[:, j].mean()),
            "peak_group_power": float(peak[:, j].max()),
        }
        for j, p in enumerate(policies)
    ]


def trace_stats(results: Sequence[TraceResult]) -> dict[str, float]:
    """Failed-GPU statistics over the traces (the paper: >0.1% failed 81% of a 15-day trace)."""
    mean = [float(r.length @ r.failed_fraction) / r.days for r in results]
    return {
        "failed_fraction_mean": float(np.mean(mean)),
        "failed_fraction_peak": float(max(r.failed_fraction.max() for r in results)),
        "time_above_0.1pct": float(
            np.mean([r.time_share(r.failed_fraction > 0.001) for r in results])
        ),
        "failures_per_day": float(
            np.mean([np.count_nonzero(np.diff(r.failed_fraction) > 0) / r.days for r in results])
        ),
    }


def run_study(
    cfg: SimConfig,
    settings: StudySettings | None = None,
    progress: StudyProgress = _no_progress,
) -> Study:
    """Every figure of the report for one config: 1. policies, 2. traces, 3. snapshots."""
    cfg.validate()
    settings = (settings or StudySettings()).validate(cfg.gpus)
    policies = build_policies(cfg)
    trace_seed, loss_seed, availability_seed = np.random.SeedSequence(cfg.seed).spawn(3)
    study = Study(config=cfg)
    study.policies = [{"policy": p.name, "summary": p.summary} for p in policies]
    results = run_traces(cfg, policies, trace_seed.spawn(settings.traces), progress)
    study.trace = results[0]
    study.goodput = goodput_rows(cfg, policies, results)
    study.trace_stats = trace_stats(results)
    study.loss = loss_curve(
        cfg,
        policies,
        settings.fractions,
        settings.trials,
        np.random.default_rng(loss_seed),
        progress,
    )
    study.availability = availability_curve(
        cfg.gpus,
        settings.tps,
        settings.availability_fractions,
        settings.trials,
        np.random.default_rng(availability_seed),
        progress,
    )
    return study
