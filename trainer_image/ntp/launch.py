"""Run a whole job's ranks as local processes around a TCPStore hosted by the launcher."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch.distributed as dist

from ntp.plan import JobLayout


class LaunchError(RuntimeError):
    """A rank failed or the job ran past its deadline."""


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _rank_main(argv: list[str], env: dict[str, str], log: str) -> None:
    """Body of one rank's process: redirect output, set the rank's environment, train."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    from ntp import train

    sys.exit(train.main(argv))


def _context() -> multiprocessing.context.BaseContext:
    # Ranks fork from a server that has already imported torch: starting ten ranks costs one
    # import instead of ten, which matters on a small CPU box.
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo is imported lazily by the first optimizer (seconds per process otherwise).
    ctx.set_forkserver_preload(["ntp.train", "torch._dynamo"])
    return ctx


def launch_local(
    layout: JobLayout,
    train_args: Sequence[str],
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    env: Mapping[str, str] | None = None,
    may_fail: Collection[int] = (),
    joiners: Sequence[tuple[Sequence[str], Mapping[str, str]]] = (),
) -> None:
    """Run one trainer process per rank of `layout` and wait for all of them.

    The store lives in this process, not in a rank, so any rank can die without taking the
    rendezvous down. On the first failure of a rank not in `may_fail` the other ranks are
    stopped and the error raised. `env` is added to every rank's environment. `joiners` are
    extra processes (trainer arguments appended to `train_args`, their own RANK/WORLD_SIZE) that
    join a later layout generation, as a returning GPU would.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="ntp-launch-") as tmp:
        layout_file = Path(tmp) / "layout.json"
        layout_file.write_text(json.dumps(layout.to_dict()))
        argv = ["--layout", str(layout_file), *train_args]
        rank_env = {
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(layout.world_size),
            "OMP_NUM_THREADS": str(threads_per_rank),
        }
        procs: list[tuple[multiprocessing.process.BaseProcess, Path]] = []
        try:
            starts = [(argv, rank_env | {"RANK": str(r)}) for r in range(layout.world_size)]
            starts += [([*argv, *extra], rank_env | dict(own)) for extra, own in joiners]
            for i, (args, proc_env) in enumerate(starts):
                log = Path(tmp) / f"process{i}.log"
                proc = ctx.Process(target=_rank_main, args=(args, proc_env, str(log)))
                proc.start()
                procs.append((proc, log))
            _wait_all(procs, time.monotonic() + timeout_s, may_fail)
        finally:
            for proc, _ in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()


def _wait_all(
    procs: list[tuple[multiprocessing.process.BaseProcess, Path]],
    deadline: float,
    may_fail: Collection[int],
) -> None:
    pending = list(procs)
    while pending:
        for proc, log in list(pending):
            if proc.exitcode is None:
                continue
            pending.remove((proc, log))
            rank = procs.index((proc, log))
            if proc.exitcode != 0 and rank not in may_fail:
                raise LaunchError(f"rank {rank} exited with {proc.exitcode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"job ran past its deadline; rank 0 log:\n{_tail(procs[0][1])}")
        time.sleep(0.05)
