"""A pipeline job's training on a static PipelineLayout (`python -m ntp.train --layout FILE` with
a `tessera_core.stages.PipelineLayout.to_dict()` document): each stage's 1F1B step and gradient
sync, the clip by the norm over every stage, each stage's optimizer step, the loss from the last
stage."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ntp.build import build_optimizer, model_args
from ntp.cli import config_from, open_data
from ntp.clip import clip_grad_norm_, grad_norm
from ntp.config import TrainConfig
from ntp.data import replica_rows
from ntp.dataset import TokenDataset
from ntp.distributed import collective_timeout, connect, init_distributed, rendezvous_from_env
from ntp.pipeline_schedule import forward_backward
from ntp.pipeline_stage import StageRank, build_stage
from ntp.report import PhaseTimes, RankRecord
from tessera_contracts.invocation import RankInvocation
from tessera_contracts.model_shape import PlanError
from tessera_core.stages import PipelineLayout

# The trainer's options a pipeline does not take yet, each with the value that means "not set".
NOT_YET: dict[str, Any] = {
    "sharded_state": False, "precision": "fp32", "activation_checkpointing": "none",
    "eval_every": 0, "init": None, "save": None, "resume": False, "dump": False,
    "measure_memory": False,
}


def is_pipeline(document: Mapping[str, Any]) -> bool:
    """Whether a layout document is a PipelineLayout's (it lists stages)."""
    return "stages" in document


def refused(opts: argparse.Namespace) -> list[str]:
    """The options given that a pipeline job does not take yet, as they are spelt."""
    return ["--" + name.replace("_", "-") for name, unset in NOT_YET.items()
            if getattr(opts, name) != unset]


def global_norm(stage: StageRank) -> torch.Tensor:
    """The whole model's gradient norm (a collective over the job): each stage's norm from its
    synchronized shards (`ntp.clip.grad_norm`, replica 0's on every replica), squared and
    summed over the stages, each counted by its first rank."""
    pipe, groups = stage.pipe, stage.groups
    shards = pipe.stages[stage.stage].replicas[groups.replica].shards
    norm = grad_norm(stage.model, pipe.shape, shards, groups.rank, groups.tp, world=groups.world)
    counted = norm.square() if dist.get_rank() == pipe.stage_world_ranks(stage.stage)[0] \
        else torch.zeros_like(norm)
    dist.all_reduce(counted)
    return counted.sqrt()


def global_loss(stage: StageRank, local: torch.Tensor) -> float:
    """The global batch's mean loss (a collective over the job): each replica's last stage
    holds its local batch's, weighted by the replica's share of the batch."""
    weight = stage.pipe.stages[stage.stage].sample_weight(stage.groups.replica)
    counted = local * weight if stage.last and stage.groups.rank == 0 else torch.zeros_like(local)
    dist.all_reduce(counted)
    return float(counted)


def train_step(stage: StageRank, optimizer: torch.optim.Optimizer, config: TrainConfig,
               rows: torch.Tensor, rate: float, times: PhaseTimes) -> tuple[float, float]:
    """One synchronized step of this rank's stage on its replica's `rows` at learning rate
    `rate`, its phases' seconds appended to `times`; returns the global loss and the
    gradients' global norm before clipping."""
    # 1. Forwards and backwards under 1F1B, the stage's gradient sync.
    t0 = time.perf_counter()
    local = forward_backward(stage, rows, config.micro_batch)
    t1 = time.perf_counter()
    stage.sync.finish()
    t2 = time.perf_counter()
    # 2. Every stage clips by the same norm, the whole model's.
    norm = global_norm(stage)
    if config.max_grad_norm is not None:
        clip_grad_norm_(stage.model, config.max_grad_norm, norm)
    # 3. The stage's own optimizer step.
    for group in optimizer.param_groups:
        group["lr"] = rate
    t_opt = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    t3 = time.perf_counter()
    loss = global_loss(stage, local)
    times.compute_s.append(t1 - t0)
    times.sync_s.append(t2 - t1)
    times.optimizer_s.append(t3 - t_opt)
    times.step_s.append(t3 - t0)
    return loss, float(norm)


def local_rows(stage: StageRank, config: TrainConfig, data: TokenDataset | None, step: int
               ) -> torch.Tensor:
    """This replica's rows of step `step`'s global batch (the same on every stage)."""
    layout, args = stage.pipe.stages[stage.stage], stage.model.args
    return replica_rows(data, layout.replicas[stage.groups.replica], step * layout.global_batch,
                        layout.global_batch, step, args.vocab_size, args.max_seq_len,
                        config.seed)


def run_pipeline(invocation: RankInvocation, opts: argparse.Namespace,
                 document: Mapping[str, Any]) -> int:
    """Train one rank of a static pipeline job (RANK, WORLD_SIZE, MASTER_ADDR/PORT) for the
    invocation's steps; with --out, its record as rank{G}.json."""
    # 1. The layout, what it cannot do yet, and the job's world.
    pipe = PipelineLayout.from_dict(document)
    if refused(opts):
        raise PlanError(f"a pipeline job does not take {', '.join(refused(opts))} yet")
    if invocation.join:
        raise PlanError("a pipeline job's layout is static: no process joins it")
    config = config_from(opts)
    rank = int(os.environ["RANK"])
    store = connect(rendezvous_from_env())
    init_distributed(config.device, store, rank, pipe.world_size, 0)
    # 2. This rank's stage, seeded as the dense model is, and its optimizer.
    args = model_args(config.flavor, pipe.stages[0])
    stage = build_stage(pipe, args, torch.device(config.device), config.seed,
                        collective_timeout(), config.bucket_elements)
    optimizer = build_optimizer(stage.model, config, pipe.stages[stage.stage], stage.groups)
    data = open_data(opts, pipe.stages[0], None)
    # 3. The steps, each reported as a JSON line by every rank.
    record, until = RankRecord(), invocation.until(0)
    layout = pipe.stages[stage.stage]
    for step in range(until):
        rows = local_rows(stage, config, data, step).to(config.device)
        rate = config.lr * config.schedule.factor(step, until)
        loss, norm = train_step(stage, optimizer, config, rows, rate, record.times)
        record.losses[step], record.grad_norms[step] = loss, norm
        record.learning_rates[step] = rate
        record.step_ends[step + 1] = time.time()
        record.log_step(step + 1, rank, 0, layout, args.max_seq_len)
    # 4. The record, then leave together.
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        doc = {"stage": stage.stage, "replica": stage.groups.replica, "rank": stage.groups.rank,
               **record.to_dict()}
        (opts.out / f"rank{rank}.json").write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()
    return 0
