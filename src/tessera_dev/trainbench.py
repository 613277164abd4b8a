"""`tessera-dev bench training`: the demo model on the real corpus, through the real trainer.

One run measures (interleaved rounds, medians): tokens/s per replica of a TP4 + TP3 job (plain
NTP, so the TP3 replica takes 3/7 of the batch) from each replica's own forward+backward time;
the same job's step time with one sequence per micro-batch, and with every layer recomputed
(full activation checkpointing), each as a ratio against each replica's share in one pass; and
the loop's wait for a checkpoint saved every step, blocking against asynchronous (the loop
waits only for the copy to CPU memory), as a ratio. On a CPU box the ranks share the cores, so
the figures include that contention; they are compared only within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml

from ntp import prepare
from ntp.bench import median_over_steps
from ntp.launch import launch_local
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import plan_job
from tessera_dev.demo import EXAMPLE


def _events(metrics: dict, kind: str) -> list[float]:
    return [e["time"] for e in metrics["events"] if e["event"] == kind]


def run(shape: ModelShape, data: Path, degrees: list[int], batch: int, steps: int,
        extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        layout = plan_job(shape, degrees, global_batch=batch, mode="ntp")
        args = ["--steps", str(steps), "--out", tmp, "--data", str(data), "--device", "cpu",
                *extra]
        launch_local(layout, args, timeout_s=600)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text())
                for r in range(layout.world_size)]


def tokens_per_s(metrics: list[dict], seq_len: int, warmup: int) -> dict[int, float]:
    """Replica -> local tokens over its slowest rank's median forward+backward time."""
    by_replica: dict[int, list[dict]] = {}
    for m in metrics:
        by_replica.setdefault(m["replica"], []).append(m)
    out = {}
    for r, ms in by_replica.items():
        compute_s = median_over_steps([m["compute_s"] for m in ms], warmup)
        out[r] = ms[0]["local_batch"] * seq_len / compute_s
    return out


def step_s(metrics: list[dict], warmup: int) -> float:
    """The job's median step time: each step's slowest rank's."""
    return median_over_steps([m["step_s"] for m in metrics], warmup)


# The recipe's variants timed against each replica's share in one pass.
RECIPES = {"one sequence per micro-batch": ["--micro-batch-size", "1"],
           "every layer recomputed": ["--activation-checkpointing", "full"]}


def save_waits(metrics: list[dict]) -> list[float]:
    """Rank 0's waits from "saving a checkpoint" to "checkpointed", each save."""
    m = metrics[0]
    return [b - a for a, b in zip(_events(m, "saving_checkpoint"), _events(m, "checkpointed"),
                                  strict=True)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera-dev bench training", description=__doc__)
    parser.add_argument("--max-bytes", type=int, default=2_000_000,
                        help="how much of the standard library's source to prepare")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    shape = ModelShape.from_spec(spec["model"])
    with tempfile.TemporaryDirectory(prefix="train-bench-data-") as tmp:
        data = Path(tmp) / "stdlib"
        prepare.main(["--stdlib", "--max-bytes", str(opts.max_bytes), "--train-tokenizer",
                      str(shape.vocab), "--out", str(data)])
        rounds = []
        for round_ in range(opts.rounds):
            mixed = run(shape, data, [4, 3], 14, opts.steps + opts.warmup, [])
            recipes = {name: step_s(run(shape, data, [4, 3], 14, opts.steps + opts.warmup,
                                        extra), opts.warmup) / step_s(mixed, opts.warmup)
                       for name, extra in RECIPES.items()}
            ckpt = Path(tmp) / f"ckpt-{round_}"  # each round saves its steps afresh
            timed = {}
            for mode, extra in (("blocking", ["--blocking-save"]), ("async", [])):
                got = run(shape, data, [4, 3], 14, opts.steps,
                          ["--save", str(ckpt / mode), "--save-every", "1", *extra])
                timed[mode] = statistics.median(save_waits(got))
            rounds.append((tokens_per_s(mixed, shape.seq_len, opts.warmup), timed, recipes))
    tps = {r: statistics.median(t[r] for t, _, _ in rounds) for r in rounds[0][0]}
    waits = {k: statistics.median(w[k] for _, w, _ in rounds) for k in ("blocking", "async")}
    ratios = {k: statistics.median(r[k] for _, _, r in rounds) for k in RECIPES}
    print(f"the demo model ({EXAMPLE.name}: hidden {shape.hidden}, {shape.n_heads} heads / "
          f"{shape.n_kv_heads} KV, ffn {shape.ffn}, vocab {shape.vocab}, {shape.n_layers} "
          f"layers, seq {shape.seq_len}) on {opts.max_bytes:,} bytes of the standard library; "
          f"gloo on CPU, {os.cpu_count()} cores shared by 7 ranks")
    batches = plan_job(shape, [4, 3], global_batch=14, mode="ntp").replicas
    split = " + ".join(str(r.local_batch) for r in batches)
    print(f"tokens/s per replica, TP4 + TP3 (plain NTP, batch {split}): TP4 {tps[0]:,.0f}, "
          f"TP3 {tps[1]:,.0f} (TP3 / TP4 {tps[1] / tps[0]:.3f}; 3/4 when every rank keeps the "
          "same pace: each has 2 samples)")
    for name, value in ratios.items():
        print(f"step time with {name} / the share in one pass: {value:.3f}")
    ratio = waits["async"] / waits["blocking"]
    print(f"checkpoint wait per save: blocking {waits['blocking'] * 1e3:.1f} ms, asynchronous "
          f"{waits['async'] * 1e3:.1f} ms; async / blocking {ratio:.3f}")
    return 0
