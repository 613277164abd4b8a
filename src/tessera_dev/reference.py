"""The reference a live test holds a job's losses to: global rank 0's loss at each step of the
same job trained without a failure, on its first layout throughout, by the local launcher (the
same trainer, same seed, on this machine's CPUs)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ntp.launch import launch_local
from tessera_contracts.generation import Generation, Gpu, Rendezvous
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_operator.workload import rank_args


def trainer_options(spec: NTPTrainingJobSpec) -> list[str]:
    """The options the operator gives each rank of the job of `spec` (its recipe, precision,
    weights and dataset, then `spec.args`), less where the job keeps its checkpoints: a
    reference keeps its own."""
    own = replace(spec, checkpoint_policy=replace(spec.checkpoint_policy, path=None))
    return [*rank_args(own), *(spec.args or ())]


def failure_free_losses(spec: Mapping[str, Any], replicas: tuple[tuple[Gpu, ...], ...],
                        out: Path, timeout_s: float) -> dict[int, float]:
    """Step -> loss of the job of `spec` (its model, batch, mode, steps and trainer options)
    trained on `replicas` (each replica's GPUs in rank order), its files in `out`."""
    typed = NTPTrainingJobSpec.from_spec(spec)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = Generation(1, typed.model.shape(), typed.global_batch, typed.failure_policy.mode,
                       replicas, Rendezvous("127.0.0.1", store.port))
    launch_local(first, ["--until-step", str(typed.steps), "--out", str(out),
                         *trainer_options(typed)], timeout_s=timeout_s, store=store)
    ran = json.loads((out / "rank0.json").read_text())
    return dict(zip(sorted(map(int, ran["step_ends"])), ran["losses"], strict=True))
