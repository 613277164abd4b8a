"""Goodput ledger: productive + badput equals wall time for any event sequence, the step-based
form on hand-computed runs, and rollbacks moving time from productive to lost progress."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera_contracts.vocabulary import BADPUT_CATEGORIES, LOST_PROGRESS, Phase
from tessera_core.goodput import Account, Ledger

pytestmark = pytest.mark.monitoring

START = 1_000.0  # a monotonic clock's reading when the trainer starts


class Clock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def total(account: Account) -> Fraction:
    return account.productive + sum(account.badput.values(), Fraction(0))


Event = tuple[str, float | int | Phase]
events = st.lists(st.one_of(
    st.tuples(st.just("wait"), st.floats(0, 1e4, allow_nan=False)),
    st.tuples(st.just("enter"), st.sampled_from(Phase)),
    st.tuples(st.just("step"), st.integers(0, 4096)),
    st.tuples(st.just("checkpoint"), st.just(0)),
    st.tuples(st.just("rollback"), st.integers(0, 10)),
    st.tuples(st.just("clock_back"), st.floats(0, 10, allow_nan=False)),
), max_size=60)


def run(clock: Clock, ledger: Ledger, script: list[Event]) -> None:
    """Apply the script's events, skipping those the ledger refuses (it says why, by a
    ValueError, and must stay consistent)."""
    checkpoints = [0]
    for kind, arg in script:
        try:
            if kind == "wait":
                clock.advance(float(arg))
            elif kind == "clock_back":
                clock.advance(-float(arg))
            elif kind == "enter":
                ledger.enter(Phase(arg))
            elif kind == "step":
                ledger.step_done(ledger.account().step + 1, samples=int(arg), tokens=int(arg) * 64)
            elif kind == "checkpoint":
                step = ledger.account().step
                ledger.checkpointed(step)
                checkpoints.append(step)
            else:
                ledger.rollback(checkpoints[int(arg) % len(checkpoints)])
        except ValueError:
            pass


@settings(max_examples=300, deadline=None)
@given(events)
def test_productive_and_badput_add_up_to_wall_time_exactly(script: list[Event]) -> None:
    clock = Clock()
    ledger = Ledger(clock)
    high_water = clock.now
    for i in range(len(script) + 1):
        run(clock, ledger, script[i:i + 1])
        high_water = max(high_water, clock.now)
        account = ledger.account()
        # the wall time is the clock's progress (a clock going back adds nothing)
        assert account.wall == Fraction(high_water) - Fraction(START)
        assert total(account) == account.wall
        assert account.productive >= 0
        assert all(seconds >= 0 for seconds in account.badput.values())
        assert set(account.badput) == set(BADPUT_CATEGORIES)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 100, allow_nan=False), min_size=1, max_size=20),
       st.integers(0, 19), st.floats(0, 100, allow_nan=False))
def test_a_rollback_moves_the_undone_steps_time_to_lost_progress(
        step_times: list[float], checkpoint_at: int, in_flight: float) -> None:
    clock = Clock()
    ledger = Ledger(clock)
    ledger.enter(Phase.TRAINING)
    checkpoint_at %= len(step_times)
    saved_at = clock.now  # the end of the step rolled back to (step 0: the start of training)
    for step, seconds in enumerate(step_times, start=1):
        clock.advance(seconds)
        ledger.step_done(step, samples=8, tokens=512)
        if step == checkpoint_at:
            ledger.checkpointed(step)
            saved_at = clock.now
    clock.advance(in_flight)
    before = ledger.account()
    ledger.rollback(checkpoint_at)
    after = ledger.account()
    # everything trained since the checkpoint, read off the clock
    undone = Fraction(clock.now) - Fraction(saved_at)
    moved = before.productive - after.productive
    assert moved == undone
    assert after.badput[LOST_PROGRESS] - before.badput[LOST_PROGRESS] == undone
    assert after.step == checkpoint_at
    assert after.steps_lost == len(step_times) - checkpoint_at
    assert after.samples == before.samples  # processed samples are throughput, not progress


def test_a_run_with_a_failure_and_a_restart_by_hand() -> None:
    """startup 10 s; steps 1-4 of 2 s; save 3 s; steps 5-6 of 2 s; 1 s into step 7 the GPU
    fails; restart 5 s; restore 2 s, back to step 4; steps 5-6 again, 2 s each.
    Wall 37 s. Productive: steps 1-4 and the redone 5-6, 12 s. Lost progress: the first steps
    5-6 and the aborted step 7, 5 s. Six steps count; at an ideal 1.5 s per step the step-based
    goodput is 6 x 1.5 / 37 = 9/37."""
    clock = Clock()
    ledger = Ledger(clock)
    clock.advance(10)
    ledger.enter(Phase.TRAINING)
    for step in range(1, 5):
        clock.advance(2)
        ledger.step_done(step, samples=4, tokens=4096)
    ledger.enter(Phase.CHECKPOINT_SAVE)
    clock.advance(3)
    ledger.checkpointed(4)
    ledger.enter(Phase.TRAINING)
    for step in (5, 6):
        clock.advance(2)
        ledger.step_done(step, samples=4, tokens=4096)
    clock.advance(1)
    ledger.enter(Phase.RESTART)
    clock.advance(5)
    ledger.enter(Phase.CHECKPOINT_RESTORE)
    clock.advance(2)
    ledger.rollback(4)
    ledger.enter(Phase.TRAINING)
    for step in (5, 6):
        clock.advance(2)
        ledger.step_done(step, samples=4, tokens=4096)

    account = ledger.account()
    assert account.wall == 37
    assert account.productive == 12
    assert dict(account.badput) == {"startup": 10, "reconfiguration": 0, "restart": 5,
                                    "checkpoint_save": 3, "checkpoint_restore": 2,
                                    "waiting_for_health": 0, "other": 0, "lost_progress": 5}
    assert account.goodput == pytest.approx(12 / 37, rel=1e-15)
    assert account.step_goodput(1.5) == pytest.approx(9 / 37, rel=1e-15)
    assert (account.step, account.steps_counted, account.steps_lost) == (6, 6, 2)
    assert (account.samples, account.tokens) == (32, 32 * 1024)


def test_a_live_reconfiguration_at_a_step_boundary_loses_nothing() -> None:
    """3 s startup, 5 steps of 1 s at TP 8,8, a 2 s relayout to 7,8 at the boundary, 5 steps of
    1.25 s (the degraded replica sets the pace): 16.25 s wall, 11.25 s productive; at the
    healthy 1 s step the step-based goodput is 10 / 16.25."""
    clock = Clock()
    ledger = Ledger(clock)
    ledger.set_layout({0: 8, 1: 8})
    clock.advance(3)
    ledger.enter(Phase.TRAINING)
    for step in range(1, 6):
        clock.advance(1)
        ledger.step_done(step, samples=2, tokens=256)
    ledger.enter(Phase.RECONFIGURATION)
    clock.advance(2)
    ledger.set_layout({0: 7, 1: 8})
    ledger.enter(Phase.TRAINING)
    for step in range(6, 11):
        clock.advance(1.25)
        ledger.step_done(step, samples=2, tokens=256)

    account = ledger.account()
    assert (account.wall, account.productive) == (Fraction("16.25"), Fraction("11.25"))
    assert account.badput["reconfiguration"] == 2 and account.badput["lost_progress"] == 0
    assert account.step_goodput(1.0) == pytest.approx(10 / 16.25, rel=1e-15)
    assert account.reconfigurations == 1
    assert account.tp_degrees == {0: 7, 1: 8}


@pytest.mark.hardening
def test_joined_with_a_step_in_flight_keeps_that_steps_time_with_the_step() -> None:
    """Step 1 done in 1 s, then 0.5 s into the next step (a scrape has just read the ledger, so
    that half second is accounted, in flight) the trainer learns it goes on after step 5 (its
    ranks joined there): the time in flight belongs to step 6, which completes 0.5 s later.
    Rolling back to step 5 (the join point) undoes step 6 whole: its 1 s moves to lost progress,
    and only step 1's second stays productive."""
    clock = Clock()
    ledger = Ledger(clock)
    ledger.enter(Phase.TRAINING)
    clock.advance(1)
    ledger.step_done(1, samples=1, tokens=1)
    clock.advance(0.5)
    assert ledger.account().productive == Fraction("1.5")  # the scrape
    ledger.joined(5)
    clock.advance(0.5)
    ledger.step_done(6, samples=1, tokens=1)
    assert ledger.account().productive == 2
    ledger.rollback(5)
    account = ledger.account()
    assert (account.productive, account.badput["lost_progress"]) == (1, 1)
    assert (account.step, account.steps_counted, account.steps_lost) == (5, 1, 1)
    assert total(account) == account.wall == 2


def test_bad_events_are_refused_with_the_reason() -> None:
    clock = Clock()
    ledger = Ledger(clock, step=100)
    with pytest.raises(ValueError, match="outside training"):
        ledger.step_done(101, samples=1, tokens=1)
    ledger.enter(Phase.TRAINING)
    with pytest.raises(ValueError, match="after step 100"):
        ledger.step_done(103, samples=1, tokens=1)
    with pytest.raises(ValueError, match="counts"):
        ledger.step_done(101, samples=-1, tokens=1)
    with pytest.raises(ValueError, match=r"\[100\]"):
        ledger.rollback(50)
    with pytest.raises(ValueError, match="last step that counts is 100"):
        ledger.checkpointed(99)
    with pytest.raises(ValueError):
        ledger.enter("napping")
    with pytest.raises(ValueError, match="positive"):
        ledger.account().step_goodput(0)
