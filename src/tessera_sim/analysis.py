"""Studies built on the engine: loss vs failed fraction, availability vs TP, spares, goodput.

Every study draws its randomness from one seed (split per study with numpy's SeedSequence), so a
seed reproduces the whole report bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera_sim.config import ConfigError, SimConfig
from tessera_sim.engine import TraceResult, run_trace, snapshot
from tessera_sim.failures import (
    Topology,
    failures_per_day,
    sample_down_blocks,
    sample_trace,
    warmup_days,
)
from tessera_sim.pauses import ScaledPauses, apply
from tessera_sim.policies import Policy, build_policies

DEFAULT_FRACTIONS: tuple[float, ...] = (
    0.0, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075, 0.01,
)  # fmt: skip
DEFAULT_TPS: tuple[int, ...] = (8, 16, 32, 64, 72)
AVAILABILITY_FRACTIONS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.004)

# What one study may cost, measured with tracemalloc and `tessera-dev bench sim` on this 2-core
# machine. Each replayed event or snapshot draw evaluates every policy: 0.15-0.7 ms of fixed cost
# plus 0.2-1 us per TP group. A replayed event holds about 0.8 KB while its trace replays and
# 0.3 KB once kept (the first trace's rows about 1.5 KB more in the report). So replay and
# snapshots may each make 2^18 evaluations and 2^28 group updates: at most a few minutes each
# and well under 1 GB (the bounds meet at the paper's 1,056 groups).
MAX_EVALUATIONS = 2**18
MAX_UPDATES = 2**28
# Each failed share and TP size is a row per policy in the tables and a point in every plot.
MAX_POINTS = 1000

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

    def validate(self, cfg: SimConfig) -> StudySettings:
        """Raise ConfigError naming the setting no study of `cfg`'s job can use, or one that
        would need more memory or time than MAX_EVALUATIONS / MAX_UPDATES; return self."""
        for name in ("trials", "traces"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("fractions", "tps"):
            if len(getattr(self, name)) > MAX_POINTS:
                raise ConfigError(
                    name, f"at most {MAX_POINTS} {name}, got {len(getattr(self, name)):,}"
                )
        for f in (*self.fractions, *self.availability_fractions):
            if not 0.0 <= f < 1.0:
                raise ConfigError("fractions", f"failed fractions must be in [0, 1), got {f}")
        if any(not 1 <= tp <= cfg.gpus for tp in self.tps):
            raise ConfigError("tps", f"TP sizes must be in [1, {cfg.gpus}] GPUs, got {self.tps}")
        check_replay(cfg, self.traces)
        groups = Topology.of(cfg).groups
        loss_draws = len(self.fractions) * self.trials
        availability_draws = len(self.tps) * len(self.availability_fractions) * self.trials
        updates = loss_draws * groups + availability_draws * cfg.gpus
        if loss_draws + availability_draws > MAX_EVALUATIONS or updates > MAX_UPDATES:
            raise ConfigError(
                "snapshots",
                f"the snapshots need {loss_draws + availability_draws:,} draws and {updates:,} "
                f"group updates ({len(self.fractions)} fractions x {self.trials} trials over "
                f"{groups:,} TP groups, {len(self.tps)} TP sizes x "
                f"{len(self.availability_fractions)} shares x {self.trials} trials over "
                f"{cfg.gpus:,} GPUs); a study makes at most {MAX_EVALUATIONS:,} draws and "
                f"{MAX_UPDATES:,} updates",
            )
        return self


def expected_events(cfg: SimConfig) -> float:
    """Failures and repairs one trace of `cfg` replays on average (warm-up failures included)."""
    return 2 * failures_per_day(cfg, Topology.of(cfg)) * (cfg.days + warmup_days(cfg))


def check_replay(cfg: SimConfig, traces: int) -> None:
    """Raise ConfigError when `traces` traces of `cfg` would exceed MAX_EVALUATIONS (an event
    each, plus one at day 0) or MAX_UPDATES (evaluations x TP groups)."""
    topo = Topology.of(cfg)
    evaluations = traces * (1 + expected_events(cfg))
    if evaluations > MAX_EVALUATIONS or evaluations * topo.groups > MAX_UPDATES:
        f = cfg.failures
        raise ConfigError(
            "replay",
            f"the failure traces would replay about {evaluations:.3g} failure and repair events "
            f"over {topo.groups:,} TP groups ({traces} traces x {f.rate_per_gpu_day:g} failures "
            f"per GPU-day x {topo.gpus:,} GPUs / blast radius {f.blast_radius} x "
            f"({cfg.days:g} days + {warmup_days(cfg):g} days of warm-up) x 2); a study replays "
            f"at most {MAX_EVALUATIONS:,} events and {MAX_UPDATES:,} event x group updates",
        )


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
    # With a pauses file: its pauses scaled to this job, and goodput charged them.
    pauses: ScaledPauses | None = None
    measured_goodput: list[dict[str, Any]] = field(default_factory=list)


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


def measured_goodput_rows(
    cfg: SimConfig,
    assumed: Sequence[Policy],
    measured: Sequence[Policy],
    pauses: ScaledPauses,
    assumed_rows: Sequence[dict[str, Any]],
    results: Sequence[TraceResult],
) -> list[dict[str, Any]]:
    """Per policy: the pauses charged and goodput with the assumed and the measured pauses
    (`results` replayed the same traces as `assumed_rows`, charging `measured`)."""
    rows = []
    for a, m, before, after in zip(
        assumed, measured, assumed_rows, goodput_rows(cfg, measured, results), strict=True
    ):
        scaled = pauses.policies.get(a.name)
        rows.append(
            {
                "policy": a.name,
                "pauses": "assumed" if scaled is None else "measured",
                "failure_stall_s_assumed": a.failure_stall_s,
                "repair_stall_s_assumed": a.repair_stall_s,
                "failure_stall_s": m.failure_stall_s,
                "repair_stall_s": m.repair_stall_s,
                "lost_work_s": 0.0 if scaled is None else scaled.lost_work_s,
                "goodput_mean_assumed": before["goodput_mean"],
                "goodput_mean_measured": after["goodput_mean"],
                "goodput_min_measured": after["goodput_min"],
                "stall_share_measured": after["stall_share"],
            }
        )
    return rows


def trace_stats(results: Sequence[TraceResult]) -> dict[str, float]:
    """Failed-GPU statistics over the traces (the paper: >0.1% failed 81% of a 15-day trace)."""
    mean = [float(r.length @ r.failed_fraction) / r.days for r in results]
    return {
        "failed_fraction_mean": float(np.mean(mean)),
        "failed_fraction_peak": float(max(r.failed_fraction.max() for r in results)),
        "time_above_0.1pct": float(
            np.mean([r.time_share(r.failed_fraction > 0.001) for r in results])
        ),
        "failures_per_day": float(np.mean([r.failures / r.days for r in results])),
    }


def run_study(
    cfg: SimConfig,
    settings: StudySettings | None = None,
    progress: StudyProgress = _no_progress,
    pauses: ScaledPauses | None = None,
) -> Study:
    """Every figure of the report for one config: 1. policies, 2. traces (again with `pauses`
    charged, when given, on the same draws), 3. snapshots."""
    cfg.validate()
    settings = (settings or StudySettings()).validate(cfg)
    policies = build_policies(cfg)
    trace_seed, loss_seed, availability_seed = np.random.SeedSequence(cfg.seed).spawn(3)
    study = Study(config=cfg, pauses=pauses)
    study.policies = [{"policy": p.name, "summary": p.summary} for p in policies]
    trace_seeds = trace_seed.spawn(settings.traces)
    results = run_traces(cfg, policies, trace_seeds, progress)
    study.trace = results[0]
    study.goodput = goodput_rows(cfg, policies, results)
    study.trace_stats = trace_stats(results)
    if pauses is not None:
        measured = apply(policies, pauses)

        def measured_progress(phase: str, done: int, total: int) -> None:
            progress(f"{phase}, measured pauses", done, total)

        replayed = run_traces(cfg, measured, trace_seeds, measured_progress)
        study.measured_goodput = measured_goodput_rows(
            cfg, policies, measured, pauses, study.goodput, replayed
        )
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
