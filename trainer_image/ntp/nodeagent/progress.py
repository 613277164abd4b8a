"""A node's progress from its ranks' lines: the goodput ledger they feed (`NodeProgress`) and
the node's progress report written from it (`Reporter`), at a rate the job's ConfigMap can bear."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from ntp.nodeagent.metrics import StepTimes
from tessera_contracts.generation import Generation
from tessera_contracts.progress import Device, NodeReport, RankDeath, State, report_period
from tessera_contracts.rank_events import (
    EvalRecord,
    EventKind,
    RankEvent,
    RecordError,
    StepRecord,
    parse_line,
)
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger

log = logging.getLogger("ntp.nodeagent.agent")

# The report's step time is the mean of this many recent steps, and its compute time that of
# every rank of the node over as many recent steps of the generation they run.
RECENT_STEPS = 20
# How long a rank's exit waits for the agent to read the rest of its output (a process it
# started could keep the pipe open).
RELAY_GRACE_S = 5.0
MAX_LOGGED_LINE = 300  # bytes of a rank's line quoted in a warning


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
        self.device: Device | None = None  # what the node's ranks train on, once one started
        self.loss: float | None = None  # of the last step that counts (the metrics' gauge)
        self.eval_loss: float | None = None  # of the newest evaluation (the metrics' gauge)
        self.step_times = StepTimes()  # of every step this node completed (the metrics')
        self.silent: tuple[str, ...] = ()  # the job's nodes whose agents went silent
        self.deaths: dict[int, RankDeath] = {}  # GPU index -> how its rank died
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        # (generation, step, seconds) from every rank's step line: one generation's only, since
        # a new one changes each rank's work (and the operator boosts by what it measures)
        self._compute: deque[tuple[int, int, float]] = deque()
        self._lock = threading.Lock()  # records come from one reader thread per rank

    def read(self, line: bytes) -> StepRecord | RankEvent | None:
        """One line a rank printed: its step records and events count, other output not.
        Returns the record it held, if any."""
        try:
            record = parse_line(line)
        except RecordError as exc:
            log.warning("%s: a rank's line not counted (%s): %s", self.node, exc,
                        line[:MAX_LOGGED_LINE])
            return None
        if record is not None:
            self.record(record)
        return record

    def record(self, record: StepRecord | RankEvent | EvalRecord) -> None:
        """A step a rank completed (`ntp.report.RankRecord.log_step`), an event
        (`ntp.relayout.RankState.event`), or an evaluation on the held-out split."""
        at = self.clock()
        with self._lock:
            try:
                if isinstance(record, EvalRecord):
                    # Every rank prints it; after a rollback the redone step's is the newest.
                    self.eval_loss = record.eval_loss
                elif isinstance(record, RankEvent):
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
        self.loss = record.loss
        ledger.set_layout(dict(enumerate(record.tp_degrees)))
        self._recent.append(record.step_s)
        self.step_times.observe(record.step_s)
        self._set(State.TRAINING, "")
        if step >= self.steps:
            ledger.enter(Phase.OTHER, at=at)  # the ranks write their results and leave

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
        if kind is EventKind.SWITCHING and step == ledger.step \
                and ledger.phase is not Phase.RECONFIGURATION:
            # A planned switch: at the step its generation names, or later, once the ranks it
            # adds have come (the ranks train on until then).
            ledger.enter(Phase.RECONFIGURATION, at=at)
            self._set(State.RECONFIGURING,
                      f"switching to generation {record.generation + 1} after step {step}")
        elif kind is EventKind.RECONFIGURED:
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
            if generation.at_step is None and generation.origin is not None:  # after a failure
                self._interrupt(f"generation {generation.generation} after a failure")

    def interrupted(self, why: str) -> None:
        """The generation the ranks run failed (a rank died, here or elsewhere)."""
        with self._lock:
            self._interrupt(why)

    def _interrupt(self, why: str) -> None:
        if self.ledger.phase is not Phase.RECONFIGURATION:
            self.ledger.enter(Phase.RECONFIGURATION)
        self._set(State.RECONFIGURING, why)

    def rank_died(self, gpu: int, why: str, death: RankDeath) -> None:
        """The rank on this node's GPU `gpu` died (`why`, `death`): its generation failed, and
        the report names the GPU for the operator to take out of the layout at once."""
        with self._lock:
            self.deaths[gpu] = death
            self._interrupt(why)

    def rank_started(self, gpu: int) -> None:
        """A rank starts on GPU `gpu`: whatever died there before is not its state any more."""
        with self._lock:
            self.deaths.pop(gpu, None)

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

    def ranks_on(self, device: Device) -> None:
        """A rank of this node starts on `device`: the node says cpu once any of its ranks
        trains on CPU."""
        with self._lock:
            if self.device is None or self.device.kind != "cpu":
                self.device = device

    def failed(self, why: str) -> None:
        with self._lock:
            self._set(State.FAILED, why)

    def silent_nodes(self, nodes: Sequence[str]) -> None:
        """The job's nodes whose agents this one finds silent now (`heartbeat`)."""
        with self._lock:
            self.silent = tuple(sorted(nodes))

    def _set(self, state: State, message: str) -> None:
        self.state, self.message = state, message

    def key(self) -> tuple[State, int, tuple[str, ...], tuple[int, ...]]:
        """What a report is due on as soon as it changes."""
        with self._lock:
            return self.state, self.generation, self.silent, tuple(sorted(self.deaths))

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
                device=self.device,
                silent_nodes=self.silent,
                rank_deaths={i: replace(d, at=round(d.at, 3)) for i, d in self.deaths.items()},
            )


class Reporter:
    """Publishes the node's report from a thread of its own, so that a slow or unreachable
    API never holds up the agent's loop (which reaps ranks and reports their deaths): at once
    when the state, the generation, the silent nodes or the GPUs whose rank died change,
    otherwise every `period_s`
    (`progress.report_period`). A failed write is logged; the next report retries."""

    def __init__(self, progress: NodeProgress, publish: Callable[[NodeReport], None] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.publish = publish
        self.clock = clock
        self.period_s = report_period(1)
        self._sent: tuple[tuple[State, int, tuple[str, ...], tuple[int, ...]], float] | None \
            = None
        self._pending: NodeReport | None = None
        self._closed = False
        self._error: str | None = None  # of the last write that failed
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        if publish is not None:
            self._thread.start()

    def job_nodes(self, count: int) -> None:
        """The job runs on `count` nodes: stretch the period to keep its writes bounded."""
        self.period_s = report_period(count)

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
            # stamped as it leaves: the operator reads from it how far the ranks may be past it
            self.publish(replace(report, reported_at=round(time.time(), 3)))
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
