"""One training step of the trainer's NTP model on every rank of a job, as real gloo processes:
each rank builds its shard on the meta device, reads its units of a Hugging Face directory,
runs forward and backward on its replica's rows of the global batch, synchronizes gradients with
every replica (`ntp.grad_sync`), and saves its local logits, loss and gradients.

Several models run one after the other in the same processes (each with the layout planned for
its shape at the same TP degrees), so one launch covers every family.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ntp.checkpoint import load_state, read_args
from ntp.grad_sync import GradSync
from ntp.groups import build_groups
from ntp.initialize import materialize
from ntp.model import ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import plan_job


@dataclass(frozen=True)
class Job:
    name: str
    weights: Path  # a Hugging Face directory
    spec: dict  # spec.model
    tokens: Path  # (global batch, seq + 1) token ids, torch.save'd


def _rank(rank: int, world: int, port: int, degrees: list[int], jobs: list[Job], out: Path,
          log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for job in jobs:
        shape = ModelShape.from_spec(job.spec)
        # the trainer's model: spec.model's, with the RoPE base and norm epsilon the weights carry
        carried = read_args(job.weights)
        args = replace(ModelArgs.of_shape(shape), rope_theta=carried.rope_theta,
                       norm_eps=carried.norm_eps)
        tokens = torch.load(job.tokens)
        layout = plan_job(shape, degrees, global_batch=len(tokens))
        groups = build_groups(layout)
        replica = layout.replicas[groups.replica]
        shard = replica.shards[groups.rank]
        with torch.device("meta"):
            model = Transformer(args)
        loss_fn = apply_ntp(model, shard, groups.tp)
        materialize(model, "cpu")
        load_state(job.weights, model, None, shape, shard)
        # a cap every rank's buckets straddle: several buckets, overlapped with backward
        sync = GradSync(model, layout, groups, bucket_elements=3000)
        rows = tokens[replica.batch_offset : replica.batch_offset + replica.local_batch]
        logits = model(rows[:, :-1])
        loss = loss_fn(logits, rows[:, 1:])
        loss.backward()
        sync.finish()
        torch.save({"logits": logits.detach(), "loss": loss.detach(),
                    "grads": {n: p.grad for n, p in model.named_parameters()},
                    "layout": layout.to_dict(), "replica": groups.replica, "rank": groups.rank},
                   out / f"{job.name}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


def run(degrees: list[int], jobs: list[Job], out: Path, timeout_s: float = 300.0) -> None:
    """Run every job on replicas of `degrees`, one process per rank; raise with the log of a
    rank that failed."""
    world = sum(degrees)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("forkserver")
    # Ranks fork from a server that has imported torch and the trainer once (launch_local's,
    # if it runs already).
    ctx.set_forkserver_preload(["ntp.train", "family_ranks"])
    procs = []
    for rank in range(world):
        log = out / f"rank{rank}.log"
        proc = ctx.Process(target=_rank, args=(rank, world, store.port, degrees, jobs, out, log))
        proc.start()
        procs.append((proc, log))
    try:
        for proc, log in procs:
            proc.join(timeout_s)
            if proc.exitcode != 0:
                raise RuntimeError(f"a rank exited with {proc.exitcode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
    finally:
        for proc, _ in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
