"""The memory policy (pure): whether a job fits its GPUs' memory, decided before any of its pods
is made, and the lowest TP degree its replicas may shrink to while they still fit
(`tessera_core.memory.assess`: every layout the failure policy can reach, a step's peak and a
relayout's).

A GPU's memory is the spec's `gpuMemory`, else the least `nvidia.com/gpu.memory` label (MiB, as
GPU feature discovery publishes it) of the job's nodes; a label that is not a whole number of
MiB is left out, logged and said in FitsMemory. A healthy layout that does not fit is a
problem (MemoryDoesNotFit: nothing is made, and Ready says why); a degraded layout that does not
fit raises the effective minimum TP, which the planner then keeps to. The condition FitsMemory
says which, with the numbers: the layout, the rank and what it needs against what is usable.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.model_shape import PlanError
from tessera_core.memory import assess, human, parse_bytes, plan_inputs

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
DOES_NOT_FIT = "MemoryDoesNotFit"  # the reason of FitsMemory=False, and of Ready=False

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryFit:
    """What the memory plan says of a job on its GPUs."""

    fits: bool | None  # None: not known (no GPU memory given or published)
    reason: str
    message: str
    min_tp: int | None = None  # the effective minimum TP when the plan raises it


def gpu_memory(spec: NTPTrainingJobSpec, nodes: Iterable[Mapping[str, Any]]
               ) -> tuple[int | None, str, tuple[str, ...]]:
    """Each GPU's memory in bytes, where it comes from (None: nowhere), and the labels left out
    as malformed, each said in words."""
    if spec.gpu_memory is not None:
        return parse_bytes(spec.gpu_memory), "spec.gpuMemory", ()
    published = {}
    malformed = []
    for node in nodes:
        meta = node.get("metadata") or {}
        name = meta.get("name", "?")
        value = (meta.get("labels") or {}).get(GPU_MEMORY_LABEL)
        if value is None:
            continue
        if value.isdigit():
            published[name] = int(value)
        else:
            malformed.append(f"node {name}'s {GPU_MEMORY_LABEL} label {value!r} is not a whole "
                             "number of MiB: ignored")
    if not published:
        return None, "", tuple(malformed)
    name = min(published, key=lambda n: (published[n], n))
    return published[name] << 20, f"node {name}'s {GPU_MEMORY_LABEL} label", tuple(malformed)


def fit(spec: NTPTrainingJobSpec, nodes: Iterable[Mapping[str, Any]]) -> MemoryFit:
    """The job's memory plan against the GPUs of `nodes` (the nodes it is placed on)."""
    gpu_bytes, source, malformed = gpu_memory(spec, nodes)
    for note in malformed:
        log.warning(note)
    ignored = "".join(f"; {note}" for note in malformed)
    if gpu_bytes is None:
        return MemoryFit(None, "GPUMemoryUnknown", (
            f"neither spec.gpuMemory nor a {GPU_MEMORY_LABEL} label of the job's nodes says "
            f"how much memory a GPU has: the memory plan is not checked{ignored}"))
    try:
        job, training = plan_inputs(spec)
        assessed = assess(job, training, gpu_bytes)
    except (SpecError, PlanError) as exc:
        return MemoryFit(None, "MemoryNotPlanned", f"the memory plan cannot be made: {exc}")
    message = f"{assessed.message(job)} ({human(gpu_bytes)} from {source}){ignored}"
    if not assessed.fits:
        return MemoryFit(False, DOES_NOT_FIT, message)
    assert assessed.min_tp is not None
    if assessed.min_tp > job.min_tp:
        return MemoryFit(True, "MinimumTensorParallelRaised", message, assessed.min_tp)
    return MemoryFit(True, "Fits", message)
