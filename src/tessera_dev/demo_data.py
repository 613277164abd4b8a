"""The demo's dataset: where the example job reads it from (a claim its trainer container mounts)
and the command that prepares the interpreter's standard library there, as a user prepares a
corpus (`tessera prepare-data`, docs/data.md)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tessera_operator.workload import TRAINER

# A prefix of the standard library that prepares in a few seconds on 2 shared cores (2.3-2.6 s
# measured with the 512-token tokenizer trained: 236 files, 1.4M tokens). At the example's
# 8 x 32 tokens a step that is 5,400 steps to an epoch, more than a demo trains: the loss it
# shows falls on samples the job has not seen before.
STDLIB_BYTES = 3_000_000


@dataclass(frozen=True)
class DataClaim:
    """A job's dataset: on claim `name`, at `path` under the claim's root."""

    name: str
    path: PurePosixPath


def data_claim(job: Mapping[str, Any]) -> DataClaim:
    """The claim the trainer container mounts `spec.data.path` from, and the dataset's path in
    it (the API accepts only a path on a trainer mount)."""
    spec = job["spec"]
    wanted = PurePosixPath(spec["data"]["path"])
    pod = spec["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    (trainer,) = (c for c in pod["containers"] if c["name"] == TRAINER)
    for mount in trainer.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if mount["name"] in claims and wanted.is_relative_to(root):
            return DataClaim(claims[mount["name"]], wanted.relative_to(root))
    raise ValueError(f"spec.data.path {wanted} is on no claim the trainer container mounts")


def prepare_args(out: Path, vocab: int) -> list[str]:
    """`tessera prepare-data`'s arguments: the standard library's prefix into `out`, with a
    byte-level BPE of at most `vocab` tokens (the model's vocabulary) trained on it. The same
    arguments again find their own dataset there and change nothing."""
    return ["prepare-data", "--stdlib", "--max-bytes", str(STDLIB_BYTES),
            "--train-tokenizer", str(vocab), "--out", str(out)]


def without_dataset(job: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `job` on synthetic sequences: no spec.data, and neither the volume of its
    dataset's claim nor the trainer's mount of it (what tests whose references train without a
    dataset apply)."""
    out = copy.deepcopy(dict(job))
    claim = data_claim(out).name
    spec = out["spec"]
    del spec["data"]
    pod = spec["template"]["spec"]
    gone = {v["name"] for v in pod.get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in gone]
    for container in pod["containers"]:
        container["volumeMounts"] = [m for m in container.get("volumeMounts", [])
                                     if m["name"] not in gone]
    return out
