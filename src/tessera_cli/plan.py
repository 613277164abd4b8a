"""`tessera plan JOB.yaml [--gpu-memory 80Gi]`: a job's memory per GPU for its healthy layout
and every degraded one its failure policy can reach, without a cluster (tessera_core.memory)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tessera_contracts.api import JOB_KIND
from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.model_shape import PlanError
from tessera_core.memory import (
    CHECKPOINTING,
    GIB,
    RESERVE_FIXED,
    RESERVE_SHARE,
    Job,
    LayoutMemory,
    LocalModel,
    Training,
    activation_bytes,
    assess,
    fits,
    human,
    parse_bytes,
    plan_inputs,
    plan_memory,
    usable,
)
from tessera_core.plan import plan_replica
from tessera_core.stages import stage_memory

COLUMNS = ("layout", "rank", "TP", "batch", "weights", "master", "grads", "optimizer",
           "activations", "loss", "comm", "step peak", "relayout")


def unit_for(largest: int) -> tuple[str, int]:
    """The unit a table's figures read best in: GiB, else MiB, else KiB."""
    for name, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if largest >= size:
            return name, size
    return "KiB", 1 << 10


def describe(job: Job, training: Training) -> str:
    s = job.shape
    micro = training.micro_batch or "whole share"
    checkpointing = training.checkpointing + (
        f" (every {training.checkpoint_every})" if training.checkpointing == "selective" else "")
    state = "sharded across replicas" if training.sharded_state else "on every replica"
    return (
        f"model: hidden {s.hidden}, {s.n_layers} layers, {s.n_heads} heads ({s.n_kv_heads} KV), "
        f"FFN {s.ffn}, vocabulary {s.vocab}, sequence {s.seq_len}\n"
        f"TP {job.tp} x DP {job.dp}, global batch {job.global_batch}, failure policy "
        f"{job.mode} (minimum TP {job.min_tp}); {training.precision}, micro-batch {micro}, "
        f"activation checkpointing {checkpointing}, optimizer state {state}"
    )


def table(plans: Sequence[LayoutMemory], gpu_bytes: int | None) -> tuple[str, str]:
    """One row per reachable layout: its worst rank's terms and peaks; and the unit."""
    unit, size = unit_for(max(m.worst.most for m in plans))

    def fmt(n: int) -> str:
        return f"{n / size:.1f}"

    header = [*COLUMNS, *(["fits"] if gpu_bytes is not None else [])]
    rows = [header]
    for memory in plans:
        w = memory.worst
        row = [memory.reachable.name, f"{w.replica}/{w.rank}", str(w.tp),
               f"{w.micro_batch}/{w.local_batch}", fmt(w.weights), fmt(w.master),
               fmt(w.gradients), fmt(w.optimizer), fmt(w.activations), fmt(w.loss),
               fmt(w.communication), fmt(w.peak), fmt(w.reshard) if w.reshard else "-"]
        if gpu_bytes is not None:
            row.append("yes" if fits(memory, gpu_bytes) else "NO")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return unit, "\n".join(
        "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                  for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in rows
    )


def activation_modes(job: Job, training: Training) -> str:
    """One micro-batch's activations on the healthy layout's rank 0 under each mode."""
    local = LocalModel.of(job.shape, plan_replica(job.shape, job.tp)[0])
    local_batch = -(-job.global_batch // job.dp)
    micro = min(training.micro_batch or local_batch, local_batch)
    tokens = micro * job.shape.seq_len
    sizes = {}
    for mode in CHECKPOINTING:
        options = Training(training.precision, micro, mode, training.checkpoint_every)
        sizes[mode] = activation_bytes(local, options, tokens, job.shape.seq_len)
    unit, size = unit_for(max(sizes.values()))
    each = ", ".join(f"{mode} {n / size:.1f}" for mode, n in sizes.items())
    return f"activations per micro-batch of {micro} on a TP {job.tp} rank ({unit}): {each}"


def pipeline_stages(job: Job, training: Training, stages: int) -> str:
    """The healthy replica's split into pipeline stages (tessera_core.stages) and each stage's
    rank 0: its state and the activations of the micro-batches it holds under 1F1B."""
    local_batch = -(-job.global_batch // job.dp)
    rows = stage_memory(job.shape, stages, job.tp, training, local_batch)
    unit, size = unit_for(max(r.state + r.activations for r in rows))
    lines = [f"pipeline stages ({unit}; the table above holds every layer on each rank):"]
    for r in rows:
        lines.append(f"  stage {r.stage}: layers {r.layers[0]}-{r.layers[1] - 1}, state "
                     f"{r.state / size:.1f}, activations {r.activations / size:.1f} "
                     f"(micro-batches in flight: {r.in_flight})")
    return "\n".join(lines)


def jobs_in(path: Path) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, spec) of every NTPTrainingJob in a YAML file."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    found = [((d.get("metadata") or {}).get("name", "?"), d.get("spec") or {})
             for d in documents if d.get("kind") == JOB_KIND]
    if not found:
        raise ValueError(f"{path}: no {JOB_KIND} in it")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera plan", description=__doc__,
        epilog="Exit status 1 when a job's healthy layout does not fit its GPUs' memory.")
    parser.add_argument("job", type=Path, help="a YAML file holding NTPTrainingJobs")
    parser.add_argument("--gpu-memory", metavar="QUANTITY",
                        help="each GPU's memory, e.g. 80Gi (default: the spec's gpuMemory)")
    opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        jobs = jobs_in(opts.job)
        override = None if opts.gpu_memory is None else parse_bytes(opts.gpu_memory)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"tessera plan: {exc}", file=sys.stderr)
        return 1
    status = 0
    for name, spec in jobs:
        try:
            typed = NTPTrainingJobSpec.from_spec(spec)
            job, training = plan_inputs(typed)
            gpu_bytes = override if override is not None else (
                None if typed.gpu_memory is None else parse_bytes(typed.gpu_memory))
            if gpu_bytes is None:
                assessment, plans = None, plan_memory(job, training)
            else:
                assessment = assess(job, training, gpu_bytes)
                plans = list(assessment.plans)
        except (SpecError, PlanError, ValueError) as exc:
            print(f"tessera plan: {name}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}\n{describe(job, training)}")
        if gpu_bytes is not None:
            print(f"GPU memory {human(gpu_bytes)}, {human(usable(gpu_bytes))} usable (less "
                  f"{human(RESERVE_FIXED)} and {RESERVE_SHARE:.0%} for what the allocator does "
                  "not count)")
        unit, rows = table(plans, gpu_bytes)
        print(f"\nper GPU, {unit} (each layout's rank that needs the most; batch: micro-batch / "
              f"local batch):\n{rows}\n\n{activation_modes(job, training)}")
        if typed.pipeline_parallel_size > 1:
            try:
                print(pipeline_stages(job, training, typed.pipeline_parallel_size))
            except PlanError as exc:
                print(f"tessera plan: {name}: {exc}", file=sys.stderr)
                status = 1
        if assessment is None:
            print("no GPU memory given (--gpu-memory or spec.gpuMemory): nothing checked\n")
            continue
        print(assessment.message(job) + "\n")
        status = status or (0 if assessment.fits else 1)
    return status
