"""`tessera-dev bench sim`: time a 15-day 32K-GPU trace through every policy.

The headline is a ratio against a baseline measured in the same run: the time per simulated day
of the 15-day trace over that of a 1-day trace of the same job. Replay costs one evaluation of
every policy per event, so it should grow linearly with the days (ratio about 1; below 1 as the
1-day run also carries the fixed warm-up); above 1 would mean per-event cost grows with the
trace. The issue's target is checked too: the whole 15-day trace (cold planner, trace draw,
replay) within 30 s; the exit status is 1 when it misses.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tessera_sim.analysis import MAX_EVALUATIONS, check_replay
from tessera_sim.cli import input_error
from tessera_sim.config import MAX_DAYS, ConfigError, SimConfig
from tessera_sim.engine import run_trace
from tessera_sim.failures import Topology, sample_trace
from tessera_sim.policies import POLICY_NAMES, build_policies

TARGET_S = 30.0
# Config field -> the flag of this command that sets it.
_FLAGS = {"days": "--days", "seed": "--seed", "repeat": "--repeat", "replay": "--days or --repeat"}


@dataclass(frozen=True)
class Timing:
    days: float
    # Failure and repair events replayed after day 0 (each one evaluates every policy).
    events: int
    plan_s: float
    replay_s: float


def time_trace(cfg: SimConfig) -> Timing:
    """Wall time to build the policies (the planner; cold on a process's first call) and replay."""
    t0 = time.perf_counter()
    policies = build_policies(cfg)
    t1 = time.perf_counter()
    topo = Topology.of(cfg)
    trace = sample_trace(cfg, topo, np.random.default_rng(cfg.seed))
    result = run_trace(cfg, topo, trace, policies)
    t2 = time.perf_counter()
    return Timing(cfg.days, len(result.start) - 1, t1 - t0, t2 - t1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera-dev bench sim",
        description=__doc__,
        epilog=f"Bounds: --days up to {MAX_DAYS:,g}, --repeat >= 1, --seed 0 to 2^53; the "
        f"--repeat traces of --days replay at most {MAX_EVALUATIONS:,} events, as in tessera "
        "simulate.",
    )
    parser.add_argument("--days", type=float, default=15.0, help="trace length in days")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; best is kept")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traces")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = SimConfig(days=args.days, seed=args.seed).validate()
        if args.repeat < 1:
            raise ConfigError("repeat", f"repeat must be >= 1, got {args.repeat}")
        check_replay(cfg, args.repeat)
    except ConfigError as exc:
        return input_error("tessera-dev bench sim", exc, _FLAGS)
    baseline_cfg = SimConfig(days=1.0, seed=args.seed).validate()

    # 1. The first run plans every TP degree from scratch: that planner time is the cold one.
    runs = [time_trace(cfg) for _ in range(args.repeat)]
    cold_plan = runs[0].plan_s
    replay = min(r.replay_s for r in runs)
    total = cold_plan + replay
    # 2. Same-run baseline: a 1-day trace of the same job (planner now warm).
    base = min(
        (time_trace(baseline_cfg) for _ in range(args.repeat)), key=lambda t: t.replay_s
    )
    per_day = (replay / cfg.days) / (base.replay_s / base.days)
    verdict = "pass" if total < TARGET_S else "FAIL"
    print(
        f"sim bench: {cfg.gpus:,} GPUs (+{cfg.policy.spare_domains} spare domains), "
        f"TP{cfg.tp} x PP{cfg.pp} x DP{cfg.dp}, {len(POLICY_NAMES)} policies, "
        f"replay best of {len(runs)}"
    )
    print(f"  planner, cold (all TP degrees): {cold_plan:.4f} s")
    print(f"  baseline {base.days:g}-day replay: {base.events} events, {base.replay_s:.4f} s")
    print(f"  {cfg.days:g}-day replay: {runs[0].events} events, {replay:.4f} s")
    print(
        f"  per simulated day, {cfg.days:g}-day vs {base.days:g}-day baseline: {per_day:.2f}x "
        f"(1 = linear in the days)"
    )
    print(
        f"  target: {cfg.days:g}-day trace with a cold planner {total:.4f} s of {TARGET_S:g} s "
        f"({total / TARGET_S:.4f} of the target): {verdict}"
    )
    return 0 if total < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
