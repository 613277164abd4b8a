"""`tessera-dev bench ntp`: uniform TP against a mixed-TP layout of the same model, in one run.

Prints the healthy replicas' step-time ratio (mixed / uniform; target on GPUs under 1.01) and the
reduced replica's throughput as a share of a healthy replica's (target at least 0.97 x N2/N1
with plain NTP). Both layouts run through the real trainer processes; on a CPU box the ranks
share the cores, so the figures include that contention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ntp.launch import launch_local
from ntp.model import FLAVORS
from tessera_core.plan import JobLayout, layout_from_shards, plan_job, plan_replica

TARGET_OVERHEAD = 1.01
TARGET_SHARE_FACTOR = 0.97


@dataclass(frozen=True)
class RunFigures:
    step_s: float  # median over measured steps of the slowest rank's step time
    compute_s: dict[int, float]  # replica -> median forward+backward time (its slowest rank)
    local_batch: dict[int, int]


def median_over_steps(per_rank: list[list[float]], warmup: int) -> float:
    slowest = [max(values) for values in zip(*per_rank, strict=True)][warmup:]
    return statistics.median(slowest)


def run_layout(layout: JobLayout, flavor: str, steps: int, warmup: int, device: str) -> RunFigures:
    with tempfile.TemporaryDirectory(prefix="ntp-bench-") as tmp:
        args = ["--flavor", flavor, "--steps", str(steps + warmup), "--out", tmp]
        args += ["--device", device]
        launch_local(layout, args, timeout_s=600)
        metrics = [
            json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(layout.world_size)
        ]
    by_replica: dict[int, list[dict]] = {}
    for m in metrics:
        by_replica.setdefault(m["replica"], []).append(m)
    return RunFigures(
        step_s=median_over_steps([m["step_s"] for m in metrics], warmup),
        compute_s={
            r: median_over_steps([m["compute_s"] for m in ms], warmup)
            for r, ms in by_replica.items()
        },
        local_batch={r: ms[0]["local_batch"] for r, ms in by_replica.items()},
    )


def _median_run(runs: list[RunFigures]) -> RunFigures:
    return RunFigures(
        step_s=statistics.median(r.step_s for r in runs),
        compute_s={k: statistics.median(r.compute_s[k] for r in runs) for k in runs[0].compute_s},
        local_batch=runs[0].local_batch,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera-dev bench ntp", description=__doc__)
    parser.add_argument("--flavor", default="bench", choices=sorted(FLAVORS))
    parser.add_argument("--healthy-tp", type=int, default=4, help="N1")
    parser.add_argument("--reduced-tp", type=int, default=3, help="N2")
    parser.add_argument("--replicas", type=int, default=2, help="DP replicas (one is reduced)")
    parser.add_argument("--batch-per-rank", type=int, default=2, help="samples per TP rank")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    n1, n2, replicas = opts.healthy_tp, opts.reduced_tp, opts.replicas
    if not 1 <= n2 <= n1 or replicas < 2:
        raise SystemExit("need 1 <= reduced TP <= healthy TP and at least two replicas")
    shape = FLAVORS[opts.flavor].shape()
    k = opts.batch_per_rank
    uniform = plan_job(shape, [n1] * replicas, global_batch=k * n1 * replicas, mode="ntp")
    mixed_degrees = [n1] * (replicas - 1) + [n2]
    mixed = plan_job(shape, mixed_degrees, global_batch=k * sum(mixed_degrees), mode="ntp")

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus >= uniform.world_size else "cpu"
    where = (
        f"NCCL on {gpus} GPUs"
        if device == "cuda"
        else f"gloo on CPU ({gpus} GPUs, too few for {uniform.world_size} ranks), "
        f"{os.cpu_count()} cores shared by up to {uniform.world_size} ranks"
    )
    print(
        f"model {opts.flavor} (hidden {shape.hidden}, {shape.n_heads} heads / {shape.n_kv_heads} "
        f"KV, ffn {shape.ffn}, {shape.n_layers} layers, seq {shape.seq_len}); {where}"
    )
    # The healthy replicas alone, synchronized through the mixed job's core/extra mapping: same
    # ranks and work as the uniform run, so the ratio isolates the mapping's cost.
    partitions = plan_replica(shape, n2)
    core_extra = layout_from_shards(
        shape,
        [mixed.replicas[0].shards] * replicas,
        uniform.global_batch,
        "ntp",
        sync_shards=partitions,
    )
    # Interleaved rounds, so drifting load on a shared machine hits every layout alike.
    rounds = [
        [
            run_layout(job, opts.flavor, opts.steps, opts.warmup, device)
            for job in (uniform, core_extra, mixed)
        ]
        for _ in range(opts.rounds)
    ]
    base, isolated, got = (_median_run([r[i] for r in rounds]) for i in range(3))
    reduced = replicas - 1

    overhead = got.step_s / base.step_s
    healthy_batch, b2 = got.local_batch[0], got.local_batch[reduced]
    b1 = base.local_batch[0]
    # Synchronized, every replica waits for the slowest each step: under plain NTP this share is
    # (N2/N1) / overhead by construction. The unsynchronized share (forward+backward alone, both
    # replicas from the same mixed run) says whether the reduced replica keeps pace by itself.
    synced_share = (b2 / got.step_s) / (b1 / base.step_s)
    own_share = (b2 / got.compute_s[reduced]) / (healthy_batch / got.compute_s[0])
    target_share = TARGET_SHARE_FACTOR * n2 / n1
    exchanged = max(
        mixed.replicas[0].sync.exchanged_elements(shape, j) for j in range(mixed.replicas[0].tp)
    )
    print(f"uniform TP {[n1] * replicas}: step {base.step_s * 1e3:.1f} ms (batch {b1}/replica)")
    print(
        f"mixed TP {mixed_degrees}: step {got.step_s * 1e3:.1f} ms; forward+backward healthy "
        f"{got.compute_s[0] * 1e3:.1f} ms (batch {healthy_batch}), reduced "
        f"{got.compute_s[reduced] * 1e3:.1f} ms (batch {b2}); "
        f"max gradient elements exchanged per healthy rank {exchanged:,}"
    )
    print(
        f"healthy step-time ratio, same ranks synced through {n2} partitions / uniform: "
        f"{isolated.step_s / base.step_s:.3f} (GPU target < {TARGET_OVERHEAD})"
    )
    contention = (
        ""
        if device == "cuda"
        else f" (on CPU the mixed job runs {sum(mixed_degrees)} processes, the uniform one "
        f"{uniform.world_size}: they contend for the cores differently)"
    )
    print(f"healthy step-time ratio, mixed job / uniform job: {overhead:.3f}{contention}")
    print(
        f"reduced replica throughput / healthy, forward+backward alone (same run): "
        f"{own_share:.3f} (target >= {TARGET_SHARE_FACTOR} x {n2}/{n1} = {target_share:.3f})"
    )
    print(
        f"reduced replica throughput / healthy, synchronized steps: {synced_share:.3f} "
        f"(plain NTP: {n2}/{n1} / the mixed/uniform ratio, the same figure restated)"
    )
    return 0
