"""Process groups for trainer ranks: device choice, per-generation rendezvous, failure notices.

A rank learns that its generation is over from a store key (`end_key`), not from its own
collectives: whoever sees a death first (the launcher whose child exited, a rank whose
collective failed) ends the generation there, and every rank's `FailureWatch` aborts what the
rank has in flight at once. The collective timeout stays long, the last resort for a peer that
hangs without anyone seeing it.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from tessera_contracts.generation import Rendezvous


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
    """The last resort against a peer that hangs unseen: PyTorch's default, 300 s, unless set."""
    return timedelta(seconds=float(os.environ.get("TESSERA_COLLECTIVE_TIMEOUT_S", "300")))


def leave_process_groups() -> None:
    """Abort every group of this generation, so that the next one can be joined.

    No garbage collection is forced: the old groups go with their last reference (a full
    `gc.collect()` here took 0.5-2.4 s per rank, most of a reconfiguration), and peers learn
    of the end from the store, not from these sockets closing.
    """
    try:
        _abort_process_group()
    except (RuntimeError, ValueError):
        dist.destroy_process_group()


def rendezvous_from_env() -> Rendezvous:
    return Rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def connect(rendezvous: Rendezvous) -> dist.TCPStore:
    """A client of the job's TCPStore (hosted by a launcher, never by a rank)."""
    return dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False)


# How often a rank waiting for the rest of its generation looks whether that generation ended:
# a few store requests a second per waiting rank, and a death there known within this long.
ARRIVAL_POLL_S = 0.1


class RendezvousEnded(RuntimeError):
    """A generation ended before all of its ranks came to its rendezvous: a process it counts
    on died (or never started), so it will never form."""

    def __init__(self, generation: int, reason: EndReason) -> None:
        super().__init__(f"generation {generation} ended before its rendezvous: {reason}")
        self.generation = generation
        self.reason = reason


def arrival_key(generation: int) -> str:
    """How many of `generation`'s ranks have come to its rendezvous (a counter)."""
    return f"gen{generation}/arrived"


def arrive(store: dist.Store, generation: int, world_size: int) -> None:
    """Wait until all `world_size` ranks of `generation` have come to its rendezvous; raises
    `RendezvousEnded` when the generation ends first. Process-group creation cannot be
    interrupted and would wait for a dead peer until the rendezvous timeout (600 s): only
    ranks that all arrived start it."""
    everyone = f"gen{generation}/all-arrived"
    if store.add(arrival_key(generation), 1) == world_size:
        store.set(everyone, "1")
    while True:
        try:
            store.wait([everyone], timedelta(seconds=ARRIVAL_POLL_S))
            return
        except dist.DistStoreError:
            pass  # not everyone yet
        if store.check([end_key(generation)]):
            raise RendezvousEnded(
                generation, EndReason.decode(store.get(end_key(generation)).decode()))


def ready_to_form(store: dist.Store, generation: int, joiners: int) -> bool:
    """Whether the `joiners` processes `generation` adds have come to its rendezvous, or it
    ended (nobody still to wait for). Survivors switching before that would wait while the
    joiners start (a process start, its imports), stalling every replica."""
    return (joiners == 0 or store.add(arrival_key(generation), 0) >= joiners
            or store.check([end_key(generation)]))


def init_distributed(
    device: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    generation: int,
) -> None:
    """Join `generation`'s default group, once every rank has arrived (`arrive`); each
    generation rendezvouses under its own store prefix, so survivors re-form groups on the
    same store after a failure."""
    arrive(store, generation, world_size)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # The default group only rendezvouses (and may wait for slow survivors); the job's
    # collectives run on groups with the collective timeout (groups.build_groups).
    timeout = float(os.environ.get("TESSERA_RENDEZVOUS_TIMEOUT_S", "600"))
    dist.init_process_group(
        backend="nccl" if device.startswith("cuda") else "gloo",
        store=dist.PrefixStore(f"gen{generation}", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


# ----------------------------------------------------------------------------------------------
# Failure notices
# ----------------------------------------------------------------------------------------------


class End(StrEnum):
    """How a generation ended."""

    FAILED = "failed"  # a rank died or a collective failed: its collectives are aborted
    SUPERSEDED = "superseded"  # a later generation took over (a rank has joined it)
    FINISHED = "finished"  # the job's last step is done (ntp.train.Trainer.finish)


@dataclass(frozen=True)
class EndReason:
    """Why a generation ended, as its end key holds it: the kind, then for a failure what
    failed (`failed: rank 2: ...`)."""

    kind: End
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.kind is End.FAILED

    def encode(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else str(self.kind)

    @classmethod
    def decode(cls, text: str) -> EndReason:
        """The reason an end key holds; ValueError for a text no trainer process writes."""
        kind, _, detail = text.partition(": ")
        if kind not in [k.value for k in End]:
            raise ValueError(f"not a generation's end reason: {text[:200]!r}")
        return cls(End(kind), detail)

    def __str__(self) -> str:
        return self.encode()


def end_key(generation: int) -> str:
    """Set once, by the first to know, when `generation` is over (its `EndReason`)."""
    return f"gen{generation}/end"


def process_key(host: str, pid: int) -> str:
    """The generation a process last joined, for its launcher to end when it dies."""
    return f"process/{host}/{pid}"


def end_generation(store: dist.Store, generation: int, reason: EndReason) -> EndReason:
    """End `generation` with `reason` unless it has ended already; returns the reason that
    stands (the first writer's)."""
    return EndReason.decode(store.compare_set(end_key(generation), "", reason.encode()).decode())


def register_process(store: dist.Store, generation: int) -> None:
    store.set(process_key(socket.gethostname(), os.getpid()), str(generation))


def generation_of(store: dist.Store, host: str, pid: int) -> int | None:
    """The generation process `pid` of `host` last joined (None: it has joined none)."""
    key = process_key(host, pid)
    return int(store.get(key)) if store.check([key]) else None


def report_death(store: dist.Store, host: str, pid: int, first_generation: int, why: str) -> int:
    """A launcher saw its child `pid` die: end the generation the child was in (the first one
    if it never joined any). Returns that generation."""
    joined = generation_of(store, host, pid)
    generation = first_generation if joined is None else joined
    end_generation(store, generation, EndReason(End.FAILED, f"process {host}/{pid} {why}"))
    return generation


def abort_in_flight(device: str, store_port: int) -> None:
    """Fail the collectives this process has in flight, so that its threads blocked in them
    return (and peers blocked on it learn at once).

    NCCL communicators abort. Gloo has no abort that releases a blocked collective (measured:
    `ProcessGroup.abort()` leaves an `all_reduce` blocked), so the transport's peer connections
    are shut down: pending operations fail as on a peer's death. Gloo does not check a pair's
    state when a send is posted, so a send posted after this may still block until the
    collective timeout: the trainer abandons the thread that posted it (`ntp.train`). The
    store's own connections (to `store_port`) stay.
    """
    if device.startswith("cuda"):
        _abort_process_group()
        return
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            try:
                if sock.getpeername()[1] != store_port:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # a listening or already closed socket


def wait_for_end(store: dist.Store, generation: int) -> EndReason:
    """Block until `generation` has ended; its end reason."""
    key = end_key(generation)
    while True:
        try:
            store.wait([key], timedelta(days=1))
            break
        except dist.DistStoreError:
            continue  # still running after a day
    return EndReason.decode(store.get(key).decode())


class FailureWatch:
    """Waits, on its own store connection, for `generation` to end; on a failure it calls
    `abort`, then (for any end) `on_end`."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        generation: int,
        abort: Callable[[], None],
        on_end: Callable[[], None],
    ):
        self.generation = generation
        self.reason: EndReason | None = None
        self._store = connect(rendezvous)
        self._abort = abort
        self._on_end = on_end
        self._thread = threading.Thread(
            target=self._watch, name=f"failure-watch-gen{generation}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        self.reason = wait_for_end(self._store, self.generation)
        if self.reason.failed:
            self._abort()
        self._on_end()

    def join(self) -> EndReason:
        """Once the generation has ended: why (after any abort has completed)."""
        self._thread.join()
        assert self.reason is not None
        return self.reason
