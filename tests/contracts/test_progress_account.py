"""A job's account of its earlier attempts (`progress.Account`): it adds up, folds an ended
attempt's reports in with the steps after its last checkpoint as lost progress, counts a restart's
gap as restart badput, survives the job's status as written, and weighs into the job's goodput."""

from __future__ import annotations

from typing import Any

import pytest

from tessera_contracts.progress import Account, NodeReport, State, summarize

pytestmark = pytest.mark.foundation


def _report(node: str, step: int, productive: float, wall: float,
            step_seconds: float | None = 2.0, **badput: float) -> NodeReport:
    return NodeReport(node, 1, step, 5000, State.TRAINING, step_seconds=step_seconds,
                      productive_seconds=productive, wall_seconds=wall, badput_seconds=badput)


def test_accounts_add_up_by_category() -> None:
    a = Account(100.0, 60.0, {"startup": 30.0, "restart": 10.0})
    b = Account(50.5, 40.0, {"restart": 2.5, "lost_progress": 8.0})
    assert a.plus(b) == Account(150.5, 100.0, {"startup": 30.0, "restart": 12.5,
                                               "lost_progress": 8.0})
    assert a.plus(Account()) == a == Account().plus(a)
    # Neither side is changed.
    assert a.badput_seconds == {"startup": 30.0, "restart": 10.0}
    assert b.badput_seconds == {"restart": 2.5, "lost_progress": 8.0}


def test_an_ended_attempt_moves_the_steps_after_its_checkpoint_to_lost_progress() -> None:
    reports = {
        # 1234 - 1000 = 234 steps done again at 2.0 s: 468 s of its 3000 productive
        "a": _report("a", 1234, 3000.0, 3600.0, startup=600.0),
        # 1020 - 1000 = 20 steps at 2.5 s: 50 s, added to the lost progress it reported
        "b": _report("b", 1020, 3100.0, 3600.0, step_seconds=2.5, startup=450.0,
                     lost_progress=50.0),
        # no step time yet: all its productive time is lost
        "c": _report("c", 1100, 40.0, 400.0, step_seconds=None, startup=360.0),
        # more steps to redo than it was productive: no more than that is lost
        "d": _report("d", 1400, 100.0, 500.0, startup=400.0),
        # at the checkpoint exactly: nothing lost
        "e": _report("e", 1000, 1000.0, 1200.0, startup=200.0),
        "f": None,
    }
    spent = Account.of_attempt(reports, 1000)
    assert spent == Account(
        3600.0 + 3600.0 + 400.0 + 500.0 + 1200.0,
        (3000.0 - 468.0) + (3100.0 - 50.0) + 0.0 + 0.0 + 1000.0,
        {"startup": 600.0 + 450.0 + 360.0 + 400.0 + 200.0,
         "lost_progress": 468.0 + (50.0 + 50.0) + 40.0 + 100.0})
    # The node-seconds stay the nodes': productive and badput still make up the wall time.
    assert spent.productive_seconds + sum(spent.badput_seconds.values()) == spent.wall_seconds
    assert Account.of_attempt({}, 0) == Account() == Account.of_attempt({"f": None}, 500)


def test_a_restarts_gap_is_restart_badput_on_each_node() -> None:
    assert Account.restart_gap(90.0, 2) == Account(180.0, 0.0, {"restart": 180.0})
    assert Account.restart_gap(0.0, 4) == Account()
    # a clock that went back counts nothing rather than a negative time
    assert Account.restart_gap(-5.0, 2) == Account()


def test_an_account_reads_back_from_the_status_as_written() -> None:
    account = Account(8200.125, 5732.5, {"startup": 820.0, "restart": 300.25,
                                         "lost_progress": 1068.0})
    status = account.to_status()
    assert status == {"wallSeconds": 8200.125, "productiveSeconds": 5732.5,
                      "badputSeconds": {"lost_progress": 1068.0, "restart": 300.25,
                                        "startup": 820.0}}
    assert list(status["badputSeconds"]) == sorted(status["badputSeconds"])
    assert Account.from_status(status) == account
    # Milliseconds are what the status keeps; a category without time is left out.
    fine = Account(1.23456, 0.5, {"restart": 0.7, "startup": 0.0}).to_status()
    assert fine == {"wallSeconds": 1.235, "productiveSeconds": 0.5,
                    "badputSeconds": {"restart": 0.7}}
    assert Account.from_status(Account().to_status()) == Account()


@pytest.mark.parametrize("value", [
    None, "8200", [], {"wallSeconds": -1.0}, {"wallSeconds": "a lot"},
    {"wallSeconds": 10.0, "productiveSeconds": True}, {"badputSeconds": ["restart"]},
    {"wallSeconds": 10.0, "badputSeconds": {"restart": -3.0}},
])
def test_a_status_that_does_not_read_as_an_account_is_none(value: Any) -> None:
    assert Account.from_status(value) == Account()


def test_a_hand_edited_category_no_reader_knows_is_dropped() -> None:
    assert Account.from_status({"wallSeconds": 10.0, "productiveSeconds": 4.0,
                                "badputSeconds": {"restart": 6.0, "coffee": 3.0}}) == \
        Account(10.0, 4.0, {"restart": 6.0})


def test_the_jobs_goodput_counts_its_earlier_attempts() -> None:
    reports = {"a": _report("a", 120, 300.0, 400.0), "b": _report("b", 118, 280.0, 400.0)}
    earlier = Account(1000.0, 500.0, {"restart": 500.0})
    # (P_earlier + P) / (W_earlier + W)
    assert summarize(reports, 1, ["a", "b"], earlier).goodput == pytest.approx(
        (500.0 + 300.0 + 280.0) / (1000.0 + 400.0 + 400.0))
    assert summarize(reports, 1, ["a", "b"]).goodput == pytest.approx(580.0 / 800.0)
    # Before the new attempt reports, the goodput is the earlier attempts'.
    assert summarize({}, 1, ["a", "b"], earlier).goodput == pytest.approx(0.5)
    assert summarize({}, 1, ["a", "b"]).goodput is None
