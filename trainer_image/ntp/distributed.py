"""Process groups for trainer ranks: device choice, per-generation rendezvous, timeouts."""

from __future__ import annotations

import gc
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group


def pick_device(requested: str) -> str:
    """`cpu` (gloo) or this rank's GPU (NCCL); `auto` takes GPUs when each rank can have one."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and gpus < ranks_here):
        return "cpu"
    if gpus < ranks_here:
        raise ValueError(f"--device cuda needs {ranks_here} GPUs on this host, found {gpus}")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    return f"cuda:{local_rank % gpus}"


# How a lost or hung peer reads in gloo's transport errors, NCCL's watchdog and abort messages
# and the store's: connections closed or reset, timeouts. Anything else (a size mismatch, a bad
# argument) is a bug that waiting for a new layout would only hide.
_PEER_LOSS = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed out|timeout|"
    r"remote process exited|communicator was aborted",
    re.IGNORECASE,
)


def is_communication_failure(exc: BaseException) -> bool:
    """A lost or hung peer, as opposed to a bug: only these wait for a new layout generation."""
    return isinstance(exc, dist.DistNetworkError) or bool(_PEER_LOSS.search(str(exc)))


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("TESSERA_COLLECTIVE_TIMEOUT_S", "300")))


def leave_process_groups() -> None:
    """Abort every group so peers still blocked on this rank fail now rather than time out."""
    try:
        _abort_process_group()
    except (RuntimeError, ValueError):
        dist.destroy_process_group()
    gc.collect()


def init_distributed(
    device: str, rank: int | None = None, world_size: int | None = None, prefix: str | None = None
) -> None:
    """Join the job through a TCPStore hosted outside the ranks (MASTER_ADDR/PORT).

    Each layout generation rendezvouses under its own store prefix, so survivors can re-form
    groups on the same store after a failure.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # The default group only rendezvouses (and may wait for slow survivors); the job's
    # collectives run on groups with the short collective timeout (groups.build_groups).
    timeout = float(os.environ.get("TESSERA_RENDEZVOUS_TIMEOUT_S", "600"))
    dist.init_process_group(
        backend="nccl" if device.startswith("cuda") else "gloo",
        store=dist.PrefixStore(prefix or os.environ.get("TESSERA_GENERATION", "gen0"), store),
        rank=int(os.environ["RANK"]) if rank is None else rank,
        world_size=int(os.environ["WORLD_SIZE"]) if world_size is None else world_size,
        timeout=timedelta(seconds=timeout),
    )
