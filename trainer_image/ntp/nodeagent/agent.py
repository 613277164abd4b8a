"""The trainer pod's per-node agent (`python -m ntp.nodeagent`): runs this node's ranks of each
generation, in the role of torchrun's elastic agent.

The agent follows the job's generation documents (the layout ConfigMap's watch, or a directory
of `gen{N}.json`), mirrors each one into its work directory as `gen{N}.json`, where its ranks
read them (`FileGenerationSource`), and keeps one `ntp.train` process per GPU of this node that
the current generation lists:

- the first generation starts every rank; a rank that carries on into the next generation
  keeps running (it reconfigures itself); a rank whose GPU the next generation drops exits by
  itself; a GPU the next generation adds (`origin` null: a GPU back) gets a new rank with
  `--join`, which learns the step it joins at from the survivors (a planned generation's
  `atStep`, or the step a failure interrupted); every rank trains until the job's last step
  (the agent's `--until-step`, which it gives each rank), whatever step it starts at. The
  command lines are `tessera_contracts.invocation`'s;
- a rank that dies (its GPU failed) ends the generation it was in on the job's store (the
  failure notice every survivor watches); the other ranks keep running. The node's report
  names its GPU with the step it had reached and its last error line, and says when it died
  again: the GPU's previous rank died too and this one got no step past that one's
  (`died_again`), a fault of the job's rather than the GPU's. A rank stranded after a
  failure (no later generation within its reconfiguration timeout: nobody plans one) stops the
  agent with that reason, so the pod fails and the job restarts from its checkpoint;
- each rank holds its GPU: `CUDA_VISIBLE_DEVICES` on a real node; on the local cluster's
  simulated nodes the device file `$TESSERA_SIM_DEVICES/nvidia<INDEX>`, open for the rank's
  lifetime as a CUDA process holds /dev/nvidia<INDEX>, so `tessera-dev fail-gpu` kills exactly it.
  What the rank trains on follows from it before it starts (`rank_device`: CUDA when CUDA has its
  device, else CPU), and the node's progress report says so;
- the agent beats on the job's store and watches other agents' beats (`heartbeat`): a node
  whose agent goes silent (the node froze or died whole, with nobody left to report its ranks'
  deaths) ends the generations this agent's ranks are in and the one in force, as failed, and
  is listed in the node's progress report (`silentNodes`) for the operator to plan without it;
  the agent of a finished job says so before it stops beating;
- ranks die with the agent (PR_SET_PDEATHSIG). The agent exits 0 once the job has finished
  (a generation ended `End.FINISHED` on the store) and its ranks have exited, non-zero with one
  line saying why when it cannot go on;
- the ranks' stdout passes through the agent's unchanged; their JSON lines (`ntp.train`'s step
  records and events, printed by every rank) feed this node's goodput ledger
  (`NodeProgress`), which the agent serves as Prometheus metrics (`ntp.nodeagent.metrics`, labels
  `ntpjob` and `node`) and publishes as the node's progress report (`tessera_contracts.progress`):
  into the job's ConfigMap `<job>-progress`, key `<node>.json`, or with `--generations DIR` into
  `DIR/../progress/<node>.json`.

The TCPStore lives in a rendezvous process of its own (`ntp.rendezvous`), never in an agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ntp.distributed import (
    End,
    EndReason,
    connect,
    end_generation,
    generation_of,
    report_death,
    wait_for_end,
)
from ntp.nodeagent.heartbeat import Heartbeat, Settings
from ntp.nodeagent.progress import RELAY_GRACE_S, NodeProgress, Reporter
from ntp.sources import FileGenerationSource
from tessera_contracts.generation import Generation, GenerationError, Gpu, Rendezvous
from tessera_contracts.invocation import (
    STRANDED_EXIT,
    RankInvocation,
)
from tessera_contracts.progress import ERROR_MAX, Device, NodeReport, RankDeath
from tessera_contracts.rank_events import StepRecord
from tessera_kube import lifetime
from tessera_kube.files import write_atomic

log = logging.getLogger("ntp.nodeagent.agent")

# How often the agent looks for a new generation: a file has no change events, and a rank
# waits for the agent's mirror, so this adds to every reconfiguration.
POLL_S = 0.02



class AgentError(RuntimeError):
    """The agent cannot go on; the message is the line it exits with."""


class Generations(Protocol):
    """Where the agent learns the job's generations: `get(n)` as in `GenerationSource`, and
    the newest generation it holds."""

    def get(self, generation: int) -> Mapping[str, Any] | None: ...

    def latest(self) -> int | None: ...


class DirectorySource(FileGenerationSource):
    """`gen{N}.json` files that someone else writes into a directory (polled)."""

    def latest(self) -> int | None:
        found = (re.fullmatch(r"gen(\d+)\.json", p.name) for p in self.directory.glob("gen*.json"))
        return max((int(m.group(1)) for m in found if m), default=None)


@dataclass(frozen=True)
class Devices:
    """How a rank holds its GPU on this node.

    `visible`: the node's GPU indices this pod was given (`NVIDIA_VISIBLE_DEVICES`; None: all),
    which the container runtime exposes to CUDA in that order. `sim_dir`: the simulated node's
    device files (`TESSERA_SIM_DEVICES`), None on a real node.
    """

    visible: tuple[int, ...] | None = None
    sim_dir: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Devices:
        listed = env.get("NVIDIA_VISIBLE_DEVICES", "all").split(",")
        # "all", "none", "void" or GPU UUIDs: no index list to map through
        indices = tuple(int(i) for i in listed) if all(i.isdigit() for i in listed) else None
        sim = env.get("TESSERA_SIM_DEVICES")
        return cls(indices, Path(sim) if sim else None)

    def release_inherited(self) -> None:
        """Close the simulated device files this process was started holding: the simulated
        container runtime gives a GPU container's process every GPU of the pod, as a CUDA
        process holds them, but the agent itself is not one; its ranks hold their own GPU
        each, so that `tessera-dev fail-gpu` kills the rank on that GPU and not the agent."""
        if self.sim_dir is None:
            return
        sim_dir = self.sim_dir.resolve()
        for entry in list(Path("/proc/self/fd").iterdir()):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone already
                if Path(os.readlink(entry)).parent == sim_dir:
                    os.close(int(entry.name))

    def cuda_index(self, index: int) -> int:
        """The CUDA device of the node's GPU `index` in this pod (CUDA numbers the pod's GPUs
        in NVIDIA_VISIBLE_DEVICES' order)."""
        if self.visible is not None and index not in self.visible:
            raise AgentError(
                f"the generation puts a rank on GPU {index}, but this pod was given GPUs "
                f"{','.join(map(str, self.visible))} (NVIDIA_VISIBLE_DEVICES)"
            )
        return self.visible.index(index) if self.visible is not None else index

    def bind(self, index: int) -> tuple[dict[str, str], int | None]:
        """The environment that gives a rank GPU `index`, and the device file descriptor it
        must inherit (None on a real node)."""
        cuda = self.cuda_index(index)
        env = {"CUDA_VISIBLE_DEVICES": str(cuda), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        if self.sim_dir is None:
            return env, None
        path = self.sim_dir / f"nvidia{index}"
        try:
            return env, os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise AgentError(f"cannot open the simulated GPU {index} ({path}): {exc}") from None


def cuda_devices() -> int:
    """The CUDA devices this process sees, counted as `ntp.distributed.pick_device` counts
    them (0 where CUDA is not available: a CPU-only PyTorch, no driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requested_device(trainer_args: Sequence[str]) -> str:
    """The `--device` the ranks are given, as `ntp.train` reads it: the last one; auto."""
    found = "auto"
    for i, arg in enumerate(trainer_args):
        if arg == "--device" and i + 1 < len(trainer_args):
            found = trainer_args[i + 1]
        elif arg.startswith("--device="):
            found = arg.removeprefix("--device=")
    return found


def rank_device(requested: str, cuda_index: int, visible: int) -> str:
    """What a rank trains on when `Devices.bind` gives it CUDA device `cuda_index` alone, of
    the `visible` ones: `ntp.distributed.pick_device`'s rule for one rank per host, which sees
    one CUDA device or none. CPU when asked for, or under auto when CUDA lacks that device;
    else CUDA (under `--device cuda` a rank without one fails rather than train)."""
    if requested == "cpu" or (requested == "auto" and cuda_index >= visible):
        return "cpu"
    return "cuda"


@dataclass
class RankProcess:
    """One trainer process: the GPU it holds, its global rank in the generation it started in,
    and what its output said so far."""

    gpu: Gpu
    rank: int
    generation: int
    proc: subprocess.Popen
    joining: bool = False  # it waits for the survivors of the generation before its own
    last_step: int | None = None  # the job's last step it completed; None: none yet
    last_error: str = ""  # its last line on stderr


def died_again(previous: int | None, last_step: int | None) -> bool:
    """Whether a rank that died on a GPU whose previous rank died after completing step
    `previous` (None: no step) died again for the same cause: it completed no step at all
    (`last_step` None), or none past `previous`. A GPU that fails kills its ranks at any
    step; a cause of the job's own (a data path, a tokenizer, an exception at a step) kills
    them before they get past it."""
    return last_step is None or (previous is not None and last_step <= previous)


class NodeAgent:
    """Runs this node's ranks across the job's generations (see the module docstring)."""

    def __init__(
        self,
        node: str,
        source: Generations,
        work_dir: Path,
        until_step: int,
        trainer_args: Sequence[str] = (),
        devices: Devices = Devices(),
        publish: Callable[[NodeReport], None] | None = None,
        cuda_count: int | None = None,
        heartbeat: Settings | None = None,
    ) -> None:
        """`publish` writes the node's progress report (None: nowhere); `cuda_count`: the
        CUDA devices on this node (`cuda_devices`), from which the report says what the ranks
        train on (None: it does not say); `heartbeat`: how often it beats, how long a silence
        is a loss (None: the defaults)."""
        self.node = node
        self.source = source
        self.work_dir = work_dir
        self.until_step = until_step
        self.trainer_args = tuple(trainer_args)
        self.devices = devices
        self.cuda_count = cuda_count
        self.requested_device = requested_device(self.trainer_args)
        self.current: Generation | None = None
        self.ranks: dict[int, RankProcess] = {}  # running, by pid
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.store: dist.TCPStore | None = None
        self.heartbeat_settings = heartbeat or Settings()
        self.heartbeat: Heartbeat | None = None  # once the first generation names the store
        # The nodes whose ranks the job's work waits on: the generation in force's, and until
        # a planned switch to it, its predecessor's too.
        self.peers: tuple[str, ...] = ()
        self.finished = False
        self.failed_after_finish: list[str] = []
        self.abandoned: set[int] = set()  # joiners stopped because the job finished first
        # GPU index -> the last step the rank that died there last had completed (None: none)
        self.died_at: dict[int, int | None] = {}
        self._unusable: set[int] = set()  # generations whose document was logged as bad
        self.progress = NodeProgress(node, until_step)
        self.reporter = Reporter(self.progress, publish)
        self._output = threading.Lock()  # one rank's line at a time on the agent's stdout

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Follow the job until it has finished; 0, or 1 if a rank failed after it finished."""
        try:
            while not (self.finished and not self.ranks):
                self.reporter.tick()
                self.follow()
                self.watch_peers()
                try:
                    kind, detail = self.events.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if kind == "exit":
                    self.exited(detail)
                elif kind == "end":
                    self.ended(*detail)
                elif not self.finished:  # no rank can start or reconfigure without it
                    raise AgentError(f"lost the job's rendezvous: {detail}")
            if self.heartbeat is not None:
                # the job is over: a store already gone leaves nobody to judge the silence
                with contextlib.suppress(dist.DistError):
                    self.heartbeat.done()
            failed = "; ".join(self.failed_after_finish)
            self.progress.finished(f"the job finished, but {failed}" if failed else "")
        except AgentError as exc:
            self.progress.failed(str(exc))
            raise
        finally:
            self.stop()
            self.reporter.close()
        if self.failed_after_finish:
            log.error("%s: the job finished, but %s", self.node, failed)
            return 1
        log.info("%s: the job has finished", self.node)
        return 0

    def stop(self) -> None:
        for rank in self.ranks.values():
            with contextlib.suppress(ProcessLookupError):
                rank.proc.kill()
        for rank in self.ranks.values():
            rank.proc.wait()

    # -- generations ---------------------------------------------------------------------------

    def follow(self) -> None:
        """Enter every generation the source has past the current one, in order."""
        latest = self.source.latest()
        if latest is None or (self.current is not None and latest <= self.current.generation):
            return
        # An agent that starts late begins at the newest generation.
        first = latest if self.current is None else self.current.generation + 1
        for number in range(first, latest + 1):
            document = self.source.get(number)
            if document is None:
                continue  # gone from the source (a watch that relisted), or being written
            try:
                generation = Generation.from_dict(document)
                if generation.generation != number:
                    raise GenerationError("generation", f"published as {number}")
            except GenerationError as exc:
                if number not in self._unusable:
                    self._unusable.add(number)
                    log.warning("%s: generation %d is malformed, waiting for a valid one: %s",
                                self.node, number, exc)
                return
            self.enter(generation, document)

    def enter(self, generation: Generation, document: Mapping[str, Any]) -> None:
        """Mirror `generation` for the ranks and start the ranks it adds on this node."""
        previous, number = self.current, generation.generation
        if previous is None:
            self.store = self.connect(generation.rendezvous)
            self.heartbeat = Heartbeat(self.store, self.node, self.heartbeat_settings)
            before = self.source.get(number - 1) if number > 1 else None
            if before is not None:  # a joining rank reads the layout it joins from
                self.mirror(number - 1, before)
                # its survivors may finish the job there, and then never come to this one
                self.watch_end(number - 1, generation.rendezvous, finish_only=True)
        elif generation.rendezvous != previous.rendezvous:
            raise AgentError(
                f"generation {number} moves the rendezvous to {generation.rendezvous}; running "
                f"ranks stay on {previous.rendezvous}"
            )
        self.mirror(number, document)
        peers = {gpu.node for gpu in generation.gpus}
        if previous is not None and generation.at_step is not None:
            peers |= {gpu.node for gpu in previous.gpus}
        self.peers = tuple(sorted(peers))
        self.current = generation
        self.watch_end(number, generation.rendezvous)
        self.reporter.job_nodes(len({gpu.node for gpu in generation.gpus}))
        if previous is not None:
            self.progress.entered(generation)
        log.info("%s: generation %d (TP %s%s)", self.node, number,
                 ",".join(map(str, generation.tp_degrees)),
                 "" if generation.at_step is None else f" after step {generation.at_step}")
        if previous is not None and generation.at_step is None and generation.origin is not None:
            self.end_running(number)
        running = {rank.gpu for rank in self.ranks.values() if rank.proc.poll() is None}
        for rank, gpu in enumerate(generation.gpus):
            if gpu.node != self.node:
                continue
            if generation.origin is None:  # the job's first layout: every rank starts fresh
                self.start(generation, rank, gpu, join=False)
            elif generation.origin[rank] is None:  # a GPU (back) in the job: a new process
                self.start(generation, rank, gpu, join=True)
            elif gpu not in running:
                # The document has a process on this GPU carry on, but there is none (it died
                # after the document was written, or this agent started late): the survivors
                # would wait for it in vain.
                reason = EndReason(End.FAILED, f"{self.node}: no process on {gpu} to carry on "
                                                f"as rank {rank}")
                assert self.store is not None
                end_generation(self.store, number, reason)
                log.warning("%s: generation %d %s", self.node, number, reason)

    def end_running(self, number: int) -> None:
        """Generation `number` follows a loss (it is not planned): end the generations this
        node's ranks are still in, as failed, and every one after them before `number` (a
        planned switch still pending, whose rendezvous the survivors would otherwise wait at
        for the lost ranks until its timeout). Whoever saw the loss first (a node's agent, or
        the operator for a node that died whole or a GPU that DCGM failed under a live
        process) may not be anyone who can end them: the ranks would wait on the lost ones
        until their collective timeout. Ending one that has ended already changes nothing."""
        assert self.store is not None
        for old in range(min(self.joined(), default=number), number):
            reason = end_generation(self.store, old, EndReason(
                End.FAILED, f"generation {number} follows a loss"))
            log.info("%s: generation %d ended (%s) for generation %d", self.node, old, reason,
                     number)

    def joined(self) -> set[int]:
        """The generations this node's running ranks last joined."""
        assert self.store is not None
        host = socket.gethostname()
        joined = {generation_of(self.store, host, pid) for pid, process in self.ranks.items()
                  if process.proc.poll() is None}
        return {g for g in joined if g is not None}

    def watch_peers(self) -> None:
        """Beat, and end the work of any node whose agent went silent (`heartbeat`): the
        generation in force and those this node's ranks are in, which the silent node's ranks
        would hold up until a collective's timeout. A finished job's agent watches nobody."""
        if self.heartbeat is None or self.current is None:
            return
        try:
            lost = self.heartbeat.tick(() if self.finished else self.peers)
        except dist.DistError as exc:
            if self.finished:
                return  # the rendezvous may go first once the job is over
            raise AgentError(f"lost the job's rendezvous: {str(exc).splitlines()[0]}") from None
        if set(self.heartbeat.silent) != set(self.progress.silent):
            self.progress.silent_nodes(list(self.heartbeat.silent))
        if not lost:
            return
        assert self.store is not None
        timeout = self.heartbeat_settings.timeout_s
        for node in lost:
            detail = f"node {node}: its agent went silent (no heartbeat for over {timeout:g} s)"
            for number in sorted(self.joined() | {self.current.generation}):
                reason = end_generation(self.store, number, EndReason(End.FAILED, detail))
                log.warning("%s: generation %d ended: %s (silent for %.2f s)", self.node,
                            number, reason, self.heartbeat.silent[node])
            self.progress.interrupted(detail)

    def connect(self, where: Rendezvous) -> dist.TCPStore:
        """A new connection to the job's store."""
        try:
            return connect(where)
        except dist.DistError as exc:
            raise AgentError(
                f"cannot reach the job's rendezvous at {where.host}:{where.port}: {exc}"
            ) from None

    def mirror(self, number: int, document: Mapping[str, Any]) -> None:
        """Write `gen{N}.json` for the ranks, atomically: a rank never reads half of it."""
        write_atomic(self.layout_path(number), json.dumps(document))

    def layout_path(self, number: int) -> Path:
        return self.work_dir / f"gen{number}.json"

    def watch_end(self, number: int, rendezvous: Rendezvous, finish_only: bool = False) -> None:
        """A thread waiting, on its own store connection, for generation `number`'s end (with
        `finish_only`, only an end that finished the job counts)."""
        store = self.connect(rendezvous)

        def wait() -> None:
            try:
                reason = wait_for_end(store, number)
            except dist.DistNetworkError as exc:
                self.events.put(("lost", str(exc).splitlines()[0]))
                return
            if reason.kind is End.FINISHED or not finish_only:
                self.events.put(("end", (number, reason)))

        threading.Thread(target=wait, name=f"end-gen{number}", daemon=True).start()

    def ended(self, number: int, reason: EndReason) -> None:
        log.info("%s: generation %d ended: %s", self.node, number, reason)
        if reason.kind is End.FINISHED:
            self.finished = True
            # A rank joining a later generation waits for survivors that trained the last
            # step in this one and left: nobody will ever come.
            for pid, rank in self.ranks.items():
                if rank.joining and rank.generation > number and pid not in self.abandoned:
                    self.abandoned.add(pid)
                    log.info("%s: the job finished in generation %d; stopping pid %d, which "
                             "waited to join generation %d", self.node, number, pid,
                             rank.generation)
                    with contextlib.suppress(ProcessLookupError):
                        rank.proc.terminate()
        elif reason.failed and number >= self.progress.generation:
            self.progress.interrupted(f"generation {number} {reason}")

    # -- ranks ---------------------------------------------------------------------------------

    def start(self, generation: Generation, rank: int, gpu: Gpu, join: bool) -> None:
        """One trainer process for global rank `rank` of `generation`, holding `gpu`."""
        if join:
            if self.finished or self.progress.ledger.step >= self.until_step or (
                    generation.at_step is not None and generation.at_step >= self.until_step):
                log.info("%s: generation %d adds %s after the job's last step; not started",
                         self.node, generation.generation, gpu)
                return
            if not self.layout_path(generation.generation - 1).exists():
                raise AgentError(
                    f"generation {generation.generation} adds {gpu}, and its joining rank needs "
                    f"generation {generation.generation - 1}, which this agent never saw"
                )
        invocation = RankInvocation(self.layout_path(generation.generation), self.work_dir,
                                    until_step=self.until_step, join=join,
                                    options=self.trainer_args)
        argv = [sys.executable, "-m", "ntp.train", *invocation.to_args()]
        env, device = self.devices.bind(gpu.index)
        if self.cuda_count is not None:
            kind = rank_device(self.requested_device, self.devices.cuda_index(gpu.index),
                               self.cuda_count)
            self.progress.ranks_on(Device(kind, self.cuda_count))
        env |= {"RANK": str(rank), "WORLD_SIZE": str(len(generation.gpus))}
        try:
            proc = subprocess.Popen(
                argv,
                env=os.environ | env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=() if device is None else (device,),
                preexec_fn=lifetime.die_with_parent(),  # forked from the main thread only
            )
        finally:
            if device is not None:
                os.close(device)  # the rank holds the GPU now, not the agent
        process = RankProcess(gpu, rank, generation.generation, proc, join)
        self.ranks[proc.pid] = process
        self.progress.rank_started(gpu.index)
        log.info("%s: rank %d of generation %d on %s: pid %d%s", self.node, rank,
                 generation.generation, gpu, proc.pid, " (joining)" if join else "")

        relays = [threading.Thread(target=relay, args=(process,), name=f"{name}-{proc.pid}",
                                   daemon=True)
                  for relay, name in ((self.relay, "relay"), (self.relay_errors, "errors"))]
        for relay in relays:
            relay.start()

        def reap() -> None:
            proc.wait()
            for relay in relays:
                relay.join(RELAY_GRACE_S)  # its last lines count before its exit does
            self.events.put(("exit", process))

        threading.Thread(target=reap, name=f"reap-{proc.pid}", daemon=True).start()

    def relay(self, process: RankProcess) -> None:
        """Pass the rank's stdout through unchanged (`kubectl logs` shows it) and feed its
        JSON lines to the node's progress."""
        assert process.proc.stdout is not None
        for line in process.proc.stdout:
            with self._output:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            record = self.progress.read(line)
            if isinstance(record, StepRecord):
                process.last_step = max(record.step, process.last_step or 0)

    def relay_errors(self, process: RankProcess) -> None:
        """Pass the rank's stderr through unchanged, keeping its last line: what its death is
        reported with (a Python exception's last line is its type and message)."""
        assert process.proc.stderr is not None
        for line in process.proc.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            if text := line.decode(errors="replace").strip():
                process.last_error = text[:ERROR_MAX]

    def exited(self, process: RankProcess) -> None:
        """A rank exited: a dropped rank leaves with 0; any other exit is a death, which ends
        the generation it was in, and the node's other ranks carry on."""
        pid, code = process.proc.pid, process.proc.returncode
        del self.ranks[pid]
        if pid in self.abandoned:
            self.abandoned.discard(pid)
            log.info("%s: pid %d on %s stopped before joining: the job had finished", self.node,
                     pid, process.gpu)
            return
        if code == 0:
            log.info("%s: pid %d on %s exited", self.node, pid, process.gpu)
            if not self.ranks and not self.finished and self.current is not None:
                self.progress.idle(self.current.generation)
            return
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        if self.finished:
            self.failed_after_finish.append(f"pid {pid} on {process.gpu} {why}")
            return
        if code == STRANDED_EXIT:
            raise AgentError(
                f"pid {pid} on {process.gpu}: its generation failed and no later one was "
                "published within its reconfiguration timeout; the job cannot go on live")
        assert self.store is not None
        index = process.gpu.index
        again = index in self.died_at and died_again(self.died_at[index], process.last_step)
        self.died_at[index] = process.last_step
        error = f"{why}: {process.last_error}" if process.last_error else why
        self.progress.rank_died(index, f"pid {pid} on {process.gpu} {why}", RankDeath(
            time.time(), process.last_step, error[:ERROR_MAX], again))
        # Ranks record the generation they are in under this host's name (register_process).
        number = report_death(self.store, socket.gethostname(), pid, process.generation, why)
        log.warning("%s: pid %d on %s %s: generation %d failed; %d rank(s) here carry on",
                    self.node, pid, process.gpu, why, number, len(self.ranks))
        # A later generation, published before the death was known, still has this process
        # carry on: its other ranks would wait for it at that generation's rendezvous.
        later = self.current
        if later is not None and later.generation > number and later.origin is not None:
            rank = later.rank_of(process.gpu)
            if rank is not None and later.origin[rank] is not None:
                end_generation(self.store, later.generation, EndReason(
                    End.FAILED, f"process {socket.gethostname()}/{pid} {why} before joining as "
                    f"rank {rank}"))
                log.warning("%s: generation %d failed too: it counted on pid %d", self.node,
                            later.generation, pid)
