"""Run a whole job's ranks as local processes around a TCPStore hosted by the launcher.

The launcher plays the per-node agent's part: it sees a child die (its process sentinel, at
once) and ends the generation that child was in on the store, which every surviving rank
watches (`ntp.distributed.FailureWatch`).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ntp.distributed import report_death
from ntp.rendezvous import serve
from tessera_contracts.generation import Generation
from tessera_core.plan import JobLayout
from tessera_core.stages import PipelineLayout


class LaunchError(RuntimeError):
    """A rank failed or the job ran past its deadline."""


@dataclass
class LaunchReport:
    """What the launcher saw: each death as (process index, wall-clock time, exit code)."""

    deaths: list[tuple[int, float, int]] = field(default_factory=list)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _rank_main(argv: list[str], env: dict[str, str], log: str, kill_at_step: int | None) -> None:
    """Body of one rank's process: redirect output, set the rank's environment, train.

    `kill_at_step`: a failure drill, from outside the training loop: the process kills itself
    (SIGKILL, as a GPU failure does) when its first generation reaches that step.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    from ntp import train

    first: list[int] = []

    def drill(trainer: train.Trainer) -> None:
        first.append(trainer.generation)
        if trainer.generation == first[0] and trainer.step == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.exit(train.main(argv, drill if kill_at_step is not None else None))


def _context() -> multiprocessing.context.BaseContext:
    # Ranks fork from a server that has already imported torch: starting ten ranks costs one
    # import instead of ten, which matters on a small CPU box.
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo is imported lazily by the first optimizer (seconds per process otherwise).
    ctx.set_forkserver_preload(["ntp.train", "torch._dynamo"])
    return ctx


def launch_local(
    layout: JobLayout | PipelineLayout | Generation,
    train_args: Sequence[str],
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    env: Mapping[str, str] | None = None,
    may_fail: Collection[int] = (),
    joiners: Sequence[tuple[Sequence[str], Mapping[str, str]]] = (),
    faults: Mapping[int, int] | None = None,
    store: dist.TCPStore | None = None,
) -> LaunchReport:
    """Run one trainer process per rank of `layout` and wait for all of them.

    `layout` is an explicit JobLayout or a generation document (whose rendezvous must be
    `store`'s). The store lives in this process, not in a rank, so any rank can die without
    taking the rendezvous down; when one dies, the launcher ends its generation on the store.
    On the first failure of a process not in `may_fail` the others are stopped and the error
    raised. `env` is added to every rank's environment. `joiners` are extra processes (trainer
    arguments appended to `train_args`, their own RANK/WORLD_SIZE) that join a later layout
    generation, as a returning GPU would. `faults` maps process indices to the step at which
    each kills itself (SIGKILL) in its first generation.
    """
    if store is None:
        store = serve("127.0.0.1", 0)
    if isinstance(layout, Generation):
        if layout.rendezvous.port != store.port:
            raise ValueError(
                f"the generation's rendezvous port {layout.rendezvous.port} is not the store's "
                f"({store.port})"
            )
        document, world, generation = layout.to_dict(), len(layout.gpus), layout.generation
    else:
        document, world, generation = layout.to_dict(), layout.world_size, 0
    drills = dict(faults or {})
    ctx = _context()
    report = LaunchReport()
    with tempfile.TemporaryDirectory(prefix="ntp-launch-") as tmp:
        layout_file = Path(tmp) / "layout.json"
        layout_file.write_text(json.dumps(document))
        argv = ["--layout", str(layout_file), *train_args]
        rank_env = {
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads_per_rank),
        }
        procs: list[tuple[multiprocessing.process.BaseProcess, Path]] = []
        try:
            starts = [(argv, rank_env | {"RANK": str(r)}) for r in range(world)]
            starts += [([*argv, *extra], rank_env | dict(own)) for extra, own in joiners]
            for i, (args, proc_env) in enumerate(starts):
                log = Path(tmp) / f"process{i}.log"
                proc = ctx.Process(
                    target=_rank_main, args=(args, proc_env, str(log), drills.get(i))
                )
                proc.start()
                procs.append((proc, log))
            _wait_all(procs, time.monotonic() + timeout_s, may_fail, store, generation, report)
        finally:
            for proc, _ in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
    return report


def _wait_all(
    procs: list[tuple[multiprocessing.process.BaseProcess, Path]],
    deadline: float,
    may_fail: Collection[int],
    store: dist.Store,
    first_generation: int,
    report: LaunchReport,
) -> None:
    pending = dict(enumerate(procs))
    host = socket.gethostname()
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchError(f"job ran past its deadline; rank 0 log:\n{_tail(procs[0][1])}")
        sentinels = {proc.sentinel: i for i, (proc, _) in pending.items()}
        for ready in multiprocessing.connection.wait(list(sentinels), timeout=remaining):
            i = sentinels[ready]  # type: ignore[index]
            proc, log = pending.pop(i)
            proc.join()
            if proc.exitcode == 0:
                continue
            assert proc.pid is not None and proc.exitcode is not None
            report.deaths.append((i, time.time(), proc.exitcode))
            # Survivors learn of it from the store, not from their collectives.
            report_death(store, host, proc.pid, first_generation, f"exited with {proc.exitcode}")
            if i not in may_fail:
                raise LaunchError(f"process {i} exited with {proc.exitcode}:\n{_tail(log)}")
