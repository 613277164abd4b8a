"""A node's goodput from its ranks' JSON lines (`ntp.nodeagent.progress.NodeProgress`), on a fake
clock: each step counts once however many ranks report it, the step's own time is training and the
time before it the phase the node was in, and productive + badput equals wall time throughout.
Also the ledger events this needs: `at` (an event learned after the fact) and `joined`."""

from __future__ import annotations

import logging
import threading
from fractions import Fraction

import pytest

from ntp.model import FLAVORS
from ntp.nodeagent.progress import NodeProgress, Reporter
from tessera_contracts.generation import Generation, Gpu, Rendezvous, next_generation
from tessera_contracts.progress import NodeReport, State
from tessera_contracts.rank_events import RankEvent, StepRecord
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger

NODE = "gpu-node-0"
STEPS = 6
FIRST = Generation(1, FLAVORS["debug"].shape(), 8, "NTP", ((Gpu(NODE, 0), Gpu(NODE, 1)),),
                   Rendezvous("127.0.0.1", 29500))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(n: int, rank: int, *, generation: int = 1, step_s: float = 1.0) -> StepRecord:
    """What `ntp.report.RankRecord.log_step` prints."""
    return StepRecord(step=n, rank=rank, generation=generation, loss=1.0, step_s=step_s,
                      samples=8, tokens=8 * 64, tp_degrees=(2,))


def event(kind: str, n: int, rank: int, generation: int = 1) -> RankEvent:
    return RankEvent(kind, rank, generation, n, (2,), 100.0)


def balanced(report: NodeReport) -> float:
    """productive + badput - wall, in seconds (the report rounds each to a millisecond)."""
    return report.productive_seconds + sum(report.badput_seconds.values()) - report.wall_seconds


def test_each_step_counts_once_with_its_own_time_as_training():
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    assert progress.report().state is State.STARTING
    clock.now += 10  # startup: imports, rendezvous, the model; the first step takes 2 s of it
    for rank in (0, 1):
        progress.record(step(1, rank, step_s=2.0))
    clock.now += 1.0
    progress.record(step(2, 1))
    progress.record(step(2, 0))
    report = progress.report()
    assert (report.state, report.step, report.generation) == (State.TRAINING, 2, 1)
    assert (report.samples, report.tokens) == (16, 16 * 64)
    assert report.badput_seconds == {"startup": 8.0}
    assert (report.productive_seconds, report.wall_seconds) == (3.0, 11.0)
    assert report.step_seconds == 1.5
    assert progress.ledger.account().tp_degrees == {0: 2}


def test_a_failure_a_redone_step_a_checkpoint_and_the_end():
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    clock.now += 5
    progress.record(step(1, 0))
    clock.now += 0.5  # half of step 2, then a rank dies: the half step is lost
    progress.interrupted("pid 7 on gpu-node-0/1 killed by SIGKILL")
    assert progress.report().state is State.RECONFIGURING
    clock.now += 3  # reconfiguration, then the survivors redo step 2 (1 s of the 3)
    progress.entered(next_generation(FIRST, ((Gpu(NODE, 0),),), lost={Gpu(NODE, 1)}))
    progress.record(event("reconfigured", 1, 0, generation=2))
    progress.record(step(2, 0, generation=2))
    assert (progress.report().step, progress.report().generation) == (2, 2)
    progress.record(event("saving_checkpoint", 2, 0, generation=2))
    clock.now += 2
    progress.record(event("checkpointed", 2, 0, generation=2))
    clock.now += 1
    progress.record(step(3, 0, generation=2))
    clock.now += 1
    progress.record(event("restored", 2, 0, generation=2))  # a rollback to the checkpoint
    for n in range(3, STEPS + 1):
        clock.now += 1
        progress.record(step(n, 0, generation=2))
    clock.now += 0.25  # the ranks write their results and leave
    progress.finished()
    report = progress.report()
    assert (report.state, report.step) == (State.FINISHED, STEPS)
    assert report.badput_seconds == {"startup": 4.0, "reconfiguration": 2.0,
                                     "checkpoint_save": 2.0, "other": 0.25,
                                     "lost_progress": 2.5}  # half step 2, step 3 and 1 s
    assert report.productive_seconds == 6.0  # steps 1-6 of 1 s, step 3 redone
    assert abs(balanced(report)) < 1e-9
    assert progress.ledger.account().steps_lost == 1


def test_a_checkpoint_restore_after_a_failure_is_badput_of_its_own():
    """Where live resharding cannot work, the ranks restore the last checkpoint in place: from
    their "restoring" line to their next step that time is checkpoint_restore, not
    reconfiguration, and the steps since the checkpoint are lost progress."""
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    clock.now += 1
    progress.record(step(1, 0))
    progress.record(event("saving_checkpoint", 1, 0))
    progress.record(event("checkpointed", 1, 0))
    clock.now += 1
    progress.record(step(2, 0))
    clock.now += 1  # into step 3, a rank dies
    progress.interrupted("pid 7 on gpu-node-0/1 killed by SIGKILL")
    clock.now += 0.5  # the survivors find no live reshard
    for rank in (0, 1):  # every rank says so; the first line counts
        progress.record(event("restoring", 2, rank, generation=2))
    clock.now += 3  # loading the checkpoint of step 1
    progress.record(event("restored", 1, 0, generation=2))
    progress.record(event("reconfigured", 1, 0, generation=2))
    clock.now += 1
    progress.record(step(2, 0, generation=2))
    report = progress.report()
    assert report.badput_seconds == {"reconfiguration": 0.5, "checkpoint_restore": 3.0,
                                     "lost_progress": 2.0}  # step 2 and the start of 3
    assert report.productive_seconds == 2.0 and abs(balanced(report)) < 1e-9


@pytest.mark.parametrize("trained_on", [0, 2])
def test_a_planned_switch_reconfigures_after_the_step_the_ranks_switch_at(trained_on):
    """At its step, or `trained_on` steps later (the ranks train on until the ranks the
    generation adds have come): the time until then is training, and one reconfiguration."""
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    clock.now += 2
    progress.record(step(1, 0))
    progress.entered(next_generation(FIRST, FIRST.replicas, at_step=2))
    last = 2 + trained_on
    for n in range(2, last + 1):
        clock.now += 1
        progress.record(step(n, 0))
        assert progress.key()[:2] == (State.TRAINING, 1)
    for rank in (0, 1):  # every rank says so; the first line counts
        progress.record(event("switching", last, rank))
    assert progress.key()[:2] == (State.RECONFIGURING, 1)
    clock.now += 4
    progress.record(event("reconfigured", last, 0, generation=2))
    clock.now += 1
    progress.record(step(last + 1, 0, generation=2))
    report = progress.report()
    assert report.badput_seconds == {"startup": 1.0, "reconfiguration": 4.0}
    assert report.productive_seconds == last + 1.0
    assert (report.state, report.generation) == (State.TRAINING, 2)
    assert progress.ledger.account().reconfigurations == 1


def test_a_node_whose_ranks_join_mid_job_counts_only_its_own_steps():
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    clock.now += 3
    progress.record(step(5, 0, generation=3))
    account = progress.ledger.account()
    assert (account.step, account.steps_counted, account.steps_lost) == (5, 1, 0)
    assert progress.report().samples == 8


def test_garbage_lines_are_not_counted(caplog):
    progress = NodeProgress(NODE, STEPS, Clock())
    progress.read(b'{"step": "one", "loss": 1.0}\n')
    progress.read(step(1, 0).to_line().replace('"samples": 8', '"samples": -1').encode())
    progress.read(b'{"event": "restored"}\n')
    # a rank's other output is no record, and not a problem
    progress.read(b"{not json, a log line}\n")
    progress.read(b"loss 1.0 at step 1\n")
    assert progress.report().step == 0
    assert sum("not counted" in r.getMessage() for r in caplog.records) == 3
    progress.read(step(1, 0).to_line().encode())
    assert progress.report().step == 1


def test_a_report_is_due_on_a_change_and_otherwise_every_period():
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    reporter = Reporter(progress, None, clock)
    assert [reporter.due() for _ in range(3)] == [True, False, False]
    clock.now += 5
    progress.record(step(1, 0))  # Starting -> Training
    assert reporter.due()
    clock.now += 9.9
    progress.record(step(2, 0))
    assert not reporter.due()
    clock.now += 0.1
    assert reporter.due()
    reporter.job_nodes(1000)  # a big job stretches the period: 1000 nodes / 20 writes a second
    clock.now += 49.9
    assert not reporter.due()
    clock.now += 0.1
    assert reporter.due()
    progress.interrupted("a GPU failed")
    assert reporter.due()


def test_a_failing_write_is_logged_once_and_the_next_report_retries(caplog):
    caplog.set_level(logging.INFO, logger="ntp.nodeagent.agent")
    clock = Clock()
    progress = NodeProgress(NODE, STEPS, clock)
    tries: list[NodeReport] = []
    failed = [threading.Event(), threading.Event()]

    def flaky(report: NodeReport) -> None:
        tries.append(report)
        if len(tries) <= len(failed):
            failed[len(tries) - 1].set()
            raise ConnectionError("API server unreachable")

    reporter = Reporter(progress, flaky, clock)
    reporter.tick()
    assert failed[0].wait(10)
    clock.now += 10
    reporter.tick()
    assert failed[1].wait(10)
    clock.now += 3
    progress.record(step(1, 0))
    reporter.close()  # the final report, written from this thread
    assert [(r.state, r.step) for r in tries] == [
        (State.STARTING, 0), (State.STARTING, 0), (State.TRAINING, 1)]
    messages = [r.getMessage() for r in caplog.records if r.name == "ntp.nodeagent.agent"]
    assert messages == [
        "gpu-node-0: progress report not written (ConnectionError: API server unreachable); "
        "retrying with the next", "gpu-node-0: progress report written again"]


def test_an_event_learned_late_is_charged_when_it_happened():
    clock = Clock()
    ledger = Ledger(clock)
    clock.now += 10
    ledger.enter(Phase.TRAINING, at=clock.now - 2)
    ledger.step_done(1, samples=1, tokens=1)
    ledger.enter(Phase.OTHER, at=clock.now - 50)  # before the last event: no time passes
    account = ledger.account()
    assert (account.productive, account.badput["startup"]) == (2, 8)
    assert account.badput["other"] == 0


def test_joined_counts_the_steps_before_as_neither_done_nor_lost():
    clock = Clock()
    ledger = Ledger(clock)
    ledger.joined(7)
    ledger.enter(Phase.TRAINING)
    clock.now += 1
    ledger.step_done(8, samples=1, tokens=1)
    ledger.checkpointed(8)
    clock.now += 1
    ledger.step_done(9, samples=1, tokens=1)
    ledger.rollback(7)  # the join point is where a rollback may go, and no further
    account = ledger.account()
    assert (account.step, account.steps_counted, account.steps_lost) == (7, 0, 2)
    assert account.productive == 0 and account.badput["lost_progress"] == Fraction(2)
    with pytest.raises(ValueError, match="cannot roll back to step 0"):
        ledger.rollback(0)
    with pytest.raises(ValueError, match="call rollback"):
        ledger.joined(3)
