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
from tessera_contracts.model_shape import ModelShape
from tessera_operator.workload import rank_args


def trainer_options(spec: Mapping[str, Any]) -> list[str]:
    """The options the operator gives each rank of the job of `spec` (its recipe, precision,
    weights and dataset, then `spec.args`), less where the job keeps its checkpoints: a
    reference keeps its own."""
    typed = NTPTrainingJobSpec.from_spec(spec)
    typed = replace(typed, checkpoint_policy=replace(typed.checkpoint_policy, path=None))
    return [*rank_args(typed), *(typed.args or ())]


def failure_free_losses(spec: Mapping[str, Any], replicas: tuple[tuple[Gpu, ...], ...],
                        out: Path, timeout_s: float) -> dict[int, float]:
    """Step -> loss of the job of `spec` (its model, batch, mode, steps and trainer options)
    trained on `replicas` (each replica's GPUs in rank order), its files in `out`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = Generation(1, ModelShape.from_spec(spec["model"]), spec["globalBatch"],
                       spec["failurePolicy"]["mode"], replicas,
                       Rendezvous("127.0.0.1", store.port))
    launch_local(first, ["--until-step", str(spec["steps"]), "--out", str(out),
                         *trainer_options(spec)], timeout_s=timeout_s, store=store)
    ran = json.loads((out / "rank0.json").read_text())
    return dict(zip(sorted(map(int, ran["step_ends"])), ran["losses"], strict=True))
