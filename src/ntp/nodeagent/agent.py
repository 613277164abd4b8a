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
  failure notice every survivor watches); the other ranks keep running;
- each rank holds its GPU: `CUDA_VISIBLE_DEVICES` on a real node; on the local cluster's
  simulated nodes the device file `$TESSERA_SIM_DEVICES/nvidia<INDEX>`, open for the rank's
  lifetime as a CUDA process holds /dev/nvidia<INDEX>, so `tessera-dev fail-gpu` kills exactly it;
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
import ctypes
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
from ntp.nodeagent import metrics
from ntp.sources import FileGenerationSource
from tessera_contracts.generation import Generation, GenerationError, Gpu
from tessera_contracts.invocation import (
    AgentInvocation,
    InvocationError,
    RankInvocation,
    agent_parser,
)
from tessera_contracts.progress import NodeReport, State, report_key
from tessera_contracts.rank_events import (
    EventKind,
    RankEvent,
    RecordError,
    StepRecord,
    parse_line,
)
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger

log = logging.getLogger("ntp.nodeagent.agent")

# How often the agent looks for a new generation: a file has no change events, and a rank
# waits for the agent's mirror, so this adds to every reconfiguration.
POLL_S = 0.02
_PR_SET_PDEATHSIG = 1
# The report's step time is the mean of this many recent steps, and its compute time that of
# every rank of the node over as many recent steps of the generation they run.
RECENT_STEPS = 20
# Every node writes its report into one ConfigMap, and every write sends the whole object
# (all nodes' reports, ~400 B each) to etcd and to each watcher: at 2,000 nodes that object is
# ~800 kB, so a write per node per 1 s step would be 1.6 GB/s, and even one per node every
# 10 s 160 MB/s. So a node writes when its state or generation changes and otherwise every
# REPORT_EVERY_S, stretched so that the job's nodes together write at most JOB_WRITES_PER_S
# times a second (16 MB/s there).
REPORT_EVERY_S = 10.0
JOB_WRITES_PER_S = 20.0
# How long a rank's exit waits for the agent to read the rest of its output (a process it
# started could keep the pipe open).
RELAY_GRACE_S = 5.0
MAX_LOGGED_LINE = 300  # bytes of a rank's line quoted in a warning


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

    def bind(self, index: int) -> tuple[dict[str, str], int | None]:
        """The environment that gives a rank GPU `index`, and the device file descriptor it
        must inherit (None on a real node)."""
        if self.visible is not None and index not in self.visible:
            raise AgentError(
                f"the generation puts a rank on GPU {index}, but this pod was given GPUs "
                f"{','.join(map(str, self.visible))} (NVIDIA_VISIBLE_DEVICES)"
            )
        cuda = self.visible.index(index) if self.visible is not None else index
        env = {"CUDA_VISIBLE_DEVICES": str(cuda), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        if self.sim_dir is None:
            return env, None
        path = self.sim_dir / f"nvidia{index}"
        try:
            return env, os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise AgentError(f"cannot open the simulated GPU {index} ({path}): {exc}") from None


def die_with_parent() -> Callable[[], None]:
    """A preexec_fn that makes the child die (SIGKILL) when the thread that forks it ends."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the agent died before prctl: no signal would come
            os._exit(1)

    return preexec


@dataclass
class RankProcess:
    """One trainer process: the GPU it holds, its global rank in the generation it started in."""

    gpu: Gpu
    rank: int
    generation: int
    proc: subprocess.Popen


class NodeProgress:
    """This node's goodput ledger and progress report, from its ranks' JSON lines (`read`:
    `tessera_contracts.rank_events`) and what the agent itself sees (`entered`,
    `interrupted`, `idle`, `finished`, `failed`).

    Every rank prints the same step lines: a step counts when the first rank of this node
    reports it. A step line carries the step's duration, so the step's time is training and
    the time before it the phase the node was in (startup, reconfiguration, a checkpoint save).
    The time between steps counts as training; after the job's last step, as `other`.
    """

    def __init__(self, node: str, steps: int, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.node = node
        self.steps = steps
        self.clock = clock
        self.ledger = Ledger(clock)
        self.generation = 0  # that the node's ranks run
        self.state = State.STARTING
        self.message = ""
        self._switch: tuple[int, int] | None = None  # (after step, to generation): planned
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        # (generation, step, seconds) from every rank's step line: one generation's only, since
        # a new one changes each rank's work (and the operator boosts by what it measures)
        self._compute: deque[tuple[int, int, float]] = deque()
        self._lock = threading.Lock()  # records come from one reader thread per rank

    def read(self, line: bytes) -> None:
        """One line a rank printed: its step records and events count, other output not."""
        try:
            record = parse_line(line)
        except RecordError as exc:
            log.warning("%s: a rank's line not counted (%s): %s", self.node, exc,
                        line[:MAX_LOGGED_LINE])
            return
        if record is not None:
            self.record(record)

    def record(self, record: StepRecord | RankEvent) -> None:
        """A step a rank completed (`ntp.train.log_step`), or an event (`Trainer.event`)."""
        at = self.clock()
        with self._lock:
            try:
                if isinstance(record, RankEvent):
                    self._event(record, at)
                else:
                    self._step(record, at)
            except ValueError as exc:  # the ledger refuses a record out of order
                log.warning("%s: a rank's record not counted (%s): %s", self.node, exc, record)

    def _step(self, record: StepRecord, at: float) -> None:
        step, ledger = record.step, self.ledger
        self.generation = max(self.generation, record.generation)
        if record.compute_s is not None:  # a trainer that does not measure it: the report has none
            self._computed(record.generation, step, record.compute_s)
        if step <= ledger.step:
            return  # another rank of this node reported it first
        if step > ledger.step + 1:  # this node's ranks joined the job after step - 1
            ledger.joined(step - 1)
        if ledger.phase is not Phase.TRAINING:
            ledger.enter(Phase.TRAINING, at=at - record.step_s)
        ledger.step_done(step, samples=record.samples, tokens=record.tokens, at=at)
        ledger.set_layout(dict(enumerate(record.tp_degrees)))
        self._recent.append(record.step_s)
        self._set(State.TRAINING, "")
        if step >= self.steps:
            ledger.enter(Phase.OTHER, at=at)  # the ranks write their results and leave
        elif self._switch is not None and self._switch[0] == step:
            ledger.enter(Phase.RECONFIGURATION, at=at)
            self._set(State.RECONFIGURING,
                      f"switching to generation {self._switch[1]} after step {step}")

    def _computed(self, generation: int, step: int, seconds: float) -> None:
        compute = self._compute
        if compute and generation > compute[-1][0]:
            compute.clear()
        elif compute and generation < compute[-1][0]:
            return  # a line of a generation already left
        compute.append((generation, step, seconds))
        newest = max(s for _, s, _ in compute)
        while compute[0][1] <= newest - RECENT_STEPS:
            compute.popleft()

    def _event(self, record: RankEvent, at: float) -> None:
        ledger, step, kind = self.ledger, record.step, record.kind
        if kind is EventKind.RECONFIGURED:
            self.generation = max(self.generation, record.generation)
            if ledger.phase is Phase.TRAINING:  # a change this agent did not see coming
                ledger.enter(Phase.RECONFIGURATION, at=at)
        elif kind is EventKind.RESTORING and ledger.phase is not Phase.CHECKPOINT_RESTORE:
            # live resharding cannot work: until the ranks train again, a checkpoint restore
            ledger.enter(Phase.CHECKPOINT_RESTORE, at=at)
        elif kind is EventKind.RESTORED and step < ledger.step:
            ledger.rollback(step)
        elif kind is EventKind.SAVING_CHECKPOINT and step == ledger.step \
                and ledger.phase in (Phase.TRAINING, Phase.OTHER):
            ledger.enter(Phase.CHECKPOINT_SAVE, at=at)
        elif kind is EventKind.CHECKPOINTED and step == ledger.step:
            # the save lasts, for this node, until its ranks train again (the next step line)
            ledger.checkpointed(step)
            if step >= self.steps:
                ledger.enter(Phase.OTHER, at=at)

    def entered(self, generation: Generation) -> None:
        """The agent entered `generation` (published after the one its ranks run)."""
        with self._lock:
            if generation.at_step is not None:
                self._switch = (generation.at_step, generation.generation)
            elif generation.origin is not None:  # the one after a failure
                self._interrupt(f"generation {generation.generation} after a failure")

    def interrupted(self, why: str) -> None:
        """The generation the ranks run failed (a rank died, here or elsewhere)."""
        with self._lock:
            self._interrupt(why)

    def _interrupt(self, why: str) -> None:
        if self.ledger.phase is not Phase.RECONFIGURATION:
            self.ledger.enter(Phase.RECONFIGURATION)
        self._set(State.RECONFIGURING, why)

    def idle(self, generation: int) -> None:
        """No rank of this node runs: generation `generation` has none of its GPUs."""
        with self._lock:
            self.generation = max(self.generation, generation)
            self.ledger.enter(Phase.WAITING_FOR_HEALTH)
            self._set(State.RECONFIGURING, f"no GPU of {self.node} in generation {generation}")

    def finished(self, message: str = "") -> None:
        with self._lock:
            if self.ledger.phase is not Phase.OTHER:
                self.ledger.enter(Phase.OTHER)
            self._set(State.FINISHED, message)

    def failed(self, why: str) -> None:
        with self._lock:
            self._set(State.FAILED, why)

    def _set(self, state: State, message: str) -> None:
        self.state, self.message = state, message

    def key(self) -> tuple[State, int]:
        """What a report is due on as soon as it changes."""
        with self._lock:
            return self.state, self.generation

    def report(self) -> NodeReport:
        a = self.ledger.account()
        with self._lock:
            recent = list(self._recent)
            compute = [seconds for _, _, seconds in self._compute]
            return NodeReport(
                node=self.node,
                generation=self.generation,
                step=min(a.step, self.steps),
                steps=self.steps,
                state=self.state,
                message=self.message,
                step_seconds=round(sum(recent) / len(recent), 4) if recent else None,
                compute_seconds=round(sum(compute) / len(compute), 4) if compute else None,
                samples=a.samples,
                tokens=a.tokens,
                goodput=round(a.goodput, 4),
                productive_seconds=round(float(a.productive), 3),
                wall_seconds=round(float(a.wall), 3),
                badput_seconds={c: round(float(s), 3) for c, s in a.badput.items()},
            )


class Reporter:
    """Publishes the node's report from a thread of its own, so that a slow or unreachable
    API never holds up the agent's loop (which reaps ranks and reports their deaths): at once
    when the state or generation changes, otherwise every `period_s` (see REPORT_EVERY_S).
    A failed write is logged; the next report retries."""

    def __init__(self, progress: NodeProgress, publish: Callable[[NodeReport], None] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.publish = publish
        self.clock = clock
        self.period_s = REPORT_EVERY_S
        self._sent: tuple[tuple[State, int], float] | None = None
        self._pending: NodeReport | None = None
        self._closed = False
        self._error: str | None = None  # of the last write that failed
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        if publish is not None:
            self._thread.start()

    def job_nodes(self, count: int) -> None:
        """The job runs on `count` nodes: stretch the period to keep its writes bounded."""
        self.period_s = max(REPORT_EVERY_S, count / JOB_WRITES_PER_S)

    def due(self) -> bool:
        """Whether a report is due now; if so, it counts as sent."""
        key, now = self.progress.key(), self.clock()
        if self._sent is not None and self._sent[0] == key and now - self._sent[1] < self.period_s:
            return False
        self._sent = key, now
        return True

    def tick(self) -> None:
        """Hand the thread a report if one is due."""
        if self.publish is None or not self.due():
            return
        with self._wake:
            self._pending = self.progress.report()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                report, self._pending = self._pending, None
            self._write(report)

    def _write(self, report: NodeReport) -> None:
        assert self.publish is not None
        try:
            self.publish(report)
        except Exception as exc:  # the API, a full disk: the next report retries
            status = getattr(exc, "status", None)  # an API error's HTTP status and reason
            why = f"{status} {getattr(exc, 'reason', '')}" if status is not None \
                else (str(exc).splitlines() or [""])[0]
            error = f"{type(exc).__name__}: {why}"
            # once per kind of error: a ConfigMap that is never created must not fill the log
            level = logging.DEBUG if error == self._error else logging.WARNING
            log.log(level, "%s: progress report not written (%s); retrying with the next",
                    report.node, error)
            self._error = error
            return
        if self._error is not None:
            log.info("%s: progress report written again", report.node)
            self._error = None

    def close(self) -> None:
        """Stop the thread and write the final report from the calling thread."""
        if self.publish is None:
            return
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(RELAY_GRACE_S)
        self._write(self.progress.report())


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
    ) -> None:
        """`publish` writes the node's progress report (None: nowhere)."""
        self.node = node
        self.source = source
        self.work_dir = work_dir
        self.until_step = until_step
        self.trainer_args = tuple(trainer_args)
        self.devices = devices
        self.current: Generation | None = None
        self.ranks: dict[int, RankProcess] = {}  # running, by pid
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.store: dist.TCPStore | None = None
        self.finished = False
        self.failed_after_finish: list[str] = []
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
            self.store = self.connect(generation)
            before = self.source.get(number - 1) if number > 1 else None
            if before is not None:  # a joining rank reads the layout it joins from
                self.mirror(number - 1, before)
        elif generation.rendezvous != previous.rendezvous:
            raise AgentError(
                f"generation {number} moves the rendezvous to {generation.rendezvous}; running "
                f"ranks stay on {previous.rendezvous}"
            )
        self.mirror(number, document)
        self.current = generation
        self.watch_end(generation)
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
        node's ranks are still in, as failed. Whoever saw the loss first (a node's agent, or the
        operator for a node that died whole or a GPU that DCGM failed under a live process)
        may not be anyone who can end them: the ranks would wait on the lost ones until their
        collective timeout. Ending one that has ended already changes nothing."""
        assert self.store is not None
        host = socket.gethostname()
        joined = {generation_of(self.store, host, pid) for pid, process in self.ranks.items()
                  if process.proc.poll() is None}
        for old in sorted(g for g in joined if g is not None and g < number):
            reason = end_generation(self.store, old, EndReason(
                End.FAILED, f"generation {number} follows a loss"))
            log.info("%s: generation %d ended (%s) for generation %d", self.node, old, reason,
                     number)

    def connect(self, generation: Generation) -> dist.TCPStore:
        """A new connection to the job's store."""
        where = generation.rendezvous
        try:
            return connect(where)
        except dist.DistError as exc:
            raise AgentError(
                f"cannot reach the job's rendezvous at {where.host}:{where.port}: {exc}"
            ) from None

    def mirror(self, number: int, document: Mapping[str, Any]) -> None:
        """Write `gen{N}.json` for the ranks, atomically: a rank never reads half of it."""
        _write_atomic(self.layout_path(number), json.dumps(document))

    def layout_path(self, number: int) -> Path:
        return self.work_dir / f"gen{number}.json"

    def watch_end(self, generation: Generation) -> None:
        """A thread waiting, on its own store connection, for the generation's end reason."""
        store = self.connect(generation)

        def wait() -> None:
            try:
                reason = wait_for_end(store, generation.generation)
            except dist.DistNetworkError as exc:
                self.events.put(("lost", str(exc).splitlines()[0]))
                return
            self.events.put(("end", (generation.generation, reason)))

        threading.Thread(target=wait, name=f"end-gen{generation.generation}", daemon=True).start()

    def ended(self, number: int, reason: EndReason) -> None:
        log.info("%s: generation %d ended: %s", self.node, number, reason)
        if reason.kind is End.FINISHED:
            self.finished = True
        elif reason.failed and number >= self.progress.generation:
            self.progress.interrupted(f"generation {number} {reason}")

    # -- ranks ---------------------------------------------------------------------------------

    def start(self, generation: Generation, rank: int, gpu: Gpu, join: bool) -> None:
        """One trainer process for global rank `rank` of `generation`, holding `gpu`."""
        if join:
            if generation.at_step is not None and generation.at_step >= self.until_step:
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
        env |= {"RANK": str(rank), "WORLD_SIZE": str(len(generation.gpus))}
        try:
            proc = subprocess.Popen(
                argv,
                env=os.environ | env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                pass_fds=() if device is None else (device,),
                preexec_fn=die_with_parent(),  # forked from the main thread only
            )
        finally:
            if device is not None:
                os.close(device)  # the rank holds the GPU now, not the agent
        process = RankProcess(gpu, rank, generation.generation, proc)
        self.ranks[proc.pid] = process
        log.info("%s: rank %d of generation %d on %s: pid %d%s", self.node, rank,
                 generation.generation, gpu, proc.pid, " (joining)" if join else "")

        relay = threading.Thread(target=self.relay, args=(proc,), name=f"relay-{proc.pid}",
                                 daemon=True)
        relay.start()

        def reap() -> None:
            proc.wait()
            relay.join(RELAY_GRACE_S)  # its last lines count before its exit does
            self.events.put(("exit", process))

        threading.Thread(target=reap, name=f"reap-{proc.pid}", daemon=True).start()

    def relay(self, proc: subprocess.Popen) -> None:
        """Pass the rank's stdout through unchanged (`kubectl logs` shows it) and feed its
        JSON lines to the node's progress."""
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._output:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            self.progress.read(line)

    def exited(self, process: RankProcess) -> None:
        """A rank exited: a dropped rank leaves with 0; any other exit is a death, which ends
        the generation it was in, and the node's other ranks carry on."""
        pid, code = process.proc.pid, process.proc.returncode
        del self.ranks[pid]
        if code == 0:
            log.info("%s: pid %d on %s exited", self.node, pid, process.gpu)
            if not self.ranks and not self.finished and self.current is not None:
                self.progress.idle(self.current.generation)
            return
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        if self.finished:
            self.failed_after_finish.append(f"pid {pid} on {process.gpu} {why}")
            return
        assert self.store is not None
        self.progress.interrupted(f"pid {pid} on {process.gpu} {why}")
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


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str], env: Mapping[str, str] = os.environ
               ) -> tuple[str, AgentInvocation]:
    """This node's name (`--node`, else NODE_NAME in `env`) and the agent's invocation. A
    command line that does not follow the contract ends the agent with its usage (status 2)."""
    try:
        invocation = AgentInvocation.from_args(argv)
        node = invocation.node or env.get("NODE_NAME")
        if not node:
            raise InvocationError("--node (or NODE_NAME) is required")
    except InvocationError as exc:
        agent_parser().error(str(exc))
    return node, invocation


def report_file(directory: Path) -> Callable[[NodeReport], None]:
    """Writes a node's report to `directory/<node>.json`, atomically."""

    def write(report: NodeReport) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(directory / report_key(report.node), report.to_json())

    return write


def _write_atomic(path: Path, text: str) -> None:
    """Write `path` through a hidden partial file beside it, so no reader sees half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def serve_metrics(ledger: Ledger, addr: str, port: int, labels: Mapping[str, str]) -> None:
    """The node's goodput metrics at http://addr:port/metrics; a port that cannot be had is
    logged, not fatal (training matters more than its metrics)."""
    try:
        server = metrics.serve(ledger, addr, port, labels)
    except OSError as exc:
        log.error("no metrics: cannot serve on %s:%d: %s", addr, port, exc)
        return
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port)


def main(argv: list[str] | None = None) -> int:
    node, opts = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM (the pod is deleted) runs the cleanup that kills the ranks, as PDEATHSIG would.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    devices = Devices.from_env(os.environ)
    devices.release_inherited()
    try:
        source: Generations
        if opts.generations is not None:
            source = DirectorySource(opts.generations)
            job = opts.job or opts.generations.resolve().parent.name
            publish = report_file(opts.generations.resolve().parent / "progress")
        else:
            from ntp.nodeagent import kube_source

            assert opts.job is not None  # the invocation has --job or --generations
            try:
                api, namespace = kube_source.connect(opts.namespace)
            except kube_source.SourceError as exc:
                raise AgentError(str(exc)) from None
            job = opts.job
            source = kube_source.KubeGenerationSource(api, namespace, job).start()
            publish = kube_source.progress_writer(api, namespace, job)
        work_dir = opts.work_dir or Path(tempfile.mkdtemp(prefix="ntp-agent-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        agent = NodeAgent(node, source, work_dir, opts.until_step, opts.trainer_args,
                          devices, publish)
        if opts.metrics_port:
            serve_metrics(agent.progress.ledger, os.environ.get("POD_IP") or "0.0.0.0",
                          opts.metrics_port, {"ntpjob": job, "node": node})
        return agent.run()
    except AgentError as exc:
        print(f"ntp.nodeagent: {node}: {exc}", file=sys.stderr)
        return 1
