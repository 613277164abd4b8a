"""`tessera-dev bench recovery`: its figures from a timeline written by hand, and a short run end to
end on a local cluster of its own, whose file the simulator takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera_dev import recoverybench
from tessera_dev.recovery_figures import (
    QUIET_S,
    Fault,
    FaultFigures,
    FiguresError,
    RunFigures,
    Step,
    Switch,
    changes,
    fault_figures,
    recovered,
    run_figures,
)
from tessera_sim import pauses

pytestmark = pytest.mark.recovery

BATCH = 8
T = 0.5  # the healthy step's time


def steps(first: int, last: int, start: float, every: float, layout: tuple[int, int]
          ) -> list[Step]:
    """Steps `first`..`last` ending every `every` s from `start`."""
    return [Step(start + i * every, n, BATCH, layout) for i, n in enumerate(range(first, last + 1))]


A = ("a/0", "a/1", "a/2")  # TP3 groups of nodes a, b and c
B = ("b/0", "b/1", "b/2")
C = ("c/0", "c/1", "c/2")
WHOLE = 6  # GPUs of the whole layout, TP3 x DP2
# (attempt, generation) -> replicas: the job on a and b; a's replica at TP2 on its survivors;
# b's replica alone; b's and the spare c's; a restarted attempt on b and c.
LAYOUTS = {(0, 1): (A, B), (0, 2): (A[:2], B), (0, 3): (B,), (0, 4): (B, C), (1, 1): (B, C)}


# 20 healthy steps (ends at 0.5 ... 10.0); a GPU lost at 10.2, noticed at 10.6; the job goes on
# in generation 2 from step 21 at 12.0, at 2/3 of the pace (0.75 s a step), until step 40.
LIVE = steps(1, 20, T, T, (0, 1)) + steps(21, 40, 12.0, 0.75, (0, 2))
LOST = Fault("gpu-lost", 10.2, 10.6)
# The same fault under a restart from the checkpoint of step 15: the next attempt's first step
# (16) ends at 30.0, then at the healthy pace until step 45.
RESTART = steps(1, 20, T, T, (0, 1)) + steps(16, 45, 30.0, T, (1, 1))
# The same fault under a policy that drops the hit replica at once (generation 3, half the
# samples a step, from 11.0 to 15.5) and takes the spare's in the generation after, whose first
# step ends 0.8 s after the last one before it.
SPARE = steps(1, 20, T, T, (0, 1)) + steps(21, 30, 11.0, T, (0, 3)) + \
    steps(31, 40, 16.3, T, (0, 4))


def figures(timeline: list[Step], fault: Fault = LOST, until: float | None = None
            ) -> FaultFigures:
    return fault_figures(timeline, fault, LAYOUTS, WHOLE, until)


def test_a_live_relayout_pauses_from_the_last_step_before_to_the_first_after_and_redoes_none():
    got = figures(LIVE)
    assert got.detection_s == pytest.approx(0.4)
    assert got.pause_s == pytest.approx(12.0 - 10.0)
    assert (got.steps_redone, got.relaid) == (0, True)
    # the hit replica went on at TP2 on its own group: a reshard, and it trained reduced from
    # its first step to its last (19 steps of 0.75 s), and on until the window's end
    assert got.layouts == ((3, 3), (2, 3))
    assert got.switches == (Switch(("reshard",), pytest.approx(2.0), 0, (2, 3)),)
    assert got.reduced_s == pytest.approx(19 * 0.75)
    assert figures(LIVE, until=30.0).reduced_s == pytest.approx(30.0 - 12.0)


def test_every_switch_a_fault_causes_is_charged_to_it():
    # The drop to the replica the survivors form, then the spare's join: two switches, both
    # pauses, and the time between them at half the job's GPUs.
    got = figures(SPARE)
    assert [s.changes for s in got.switches] == [("drop",), ("join",)]
    assert [s.pause_s for s in got.switches] == pytest.approx([11.0 - 10.0, 16.3 - 15.5])
    assert got.pause_s == pytest.approx(1.0 + 0.8)
    assert got.layouts == ((3, 3), (3,), (3, 3))
    assert got.reduced_s == pytest.approx(15.5 - 11.0)
    # each pause past the step it would have taken anyway
    assert got.lost_s(T) == pytest.approx((1.0 - T) + (0.8 - T))
    # the next fault's window ends before the join: it is not this fault's
    early = figures(SPARE, until=16.0)
    assert early.layouts == ((3, 3), (3,)) and early.pause_s == pytest.approx(1.0)
    assert early.reduced_s == pytest.approx(16.0 - 11.0)


def test_what_a_switch_did_is_read_from_each_replicas_gpus():
    assert changes((A, B), (A[:2], B), restarted=False) == ("reshard",)
    assert changes((A[:2], B), (A, B), restarted=False) == ("reshard",)  # a GPU back
    assert changes((A, B), (B,), restarted=False) == ("drop",)
    assert changes((B,), (B, C), restarted=False) == ("join",)
    # a spare group standing in for a hit one in one generation
    assert changes((A, B), (C, B), restarted=False) == ("drop", "join")
    # a new attempt is a restart whatever GPUs it runs on
    assert changes((A, B), (A, B), restarted=True) == ("restart",)
    assert changes((A, B), (A, B), restarted=False) == ()


def test_a_layout_without_its_document_has_no_figures():
    with pytest.raises(FiguresError, match=r"no layout document seen for .*\(0, 9\)"):
        fault_figures(steps(1, 20, T, T, (0, 1)) + steps(21, 30, 12.0, T, (0, 9)), LOST,
                      LAYOUTS, WHOLE)


def test_a_step_ended_after_the_injection_began_delays_the_fault_for_its_detection():
    # A loaded machine took 0.3 s to reach the processes: step 21 ended 0.2 s after the
    # injection began, on the layout before; the pause still holds the detection.
    late = steps(1, 21, T, T, (0, 1)) + steps(22, 40, 12.0, 0.75, (0, 2))
    got = figures(late, Fault("gpu-lost", 10.3, 10.9))
    assert got.detection_s == pytest.approx(10.9 - 10.5)
    assert got.pause_s == pytest.approx(12.0 - 10.5)
    assert got.pause_s >= got.detection_s


def test_a_restart_redoes_the_steps_since_its_checkpoint():
    got = figures(RESTART)
    assert got.pause_s == pytest.approx(30.0 - 10.0)
    assert got.steps_redone == 20 - 16 + 1
    assert [s.changes for s in got.switches] == [("restart",)]
    assert (got.layouts, got.reduced_s) == (((3, 3), (3, 3)), 0.0)
    # the time it cost: the pause past one step, and the redone steps at the healthy pace
    assert got.lost_s(T) == pytest.approx((20.0 - T) + 5 * T)


def test_a_fault_that_changes_no_layout_pauses_one_step():
    got = figures(steps(1, 30, T, T, (0, 1)), Fault("gpu-returned", 7.1, None))
    assert (got.detection_s, got.pause_s, got.steps_redone, got.relaid) == (None, T, 0, False)
    assert (got.layouts, got.switches, got.reduced_s) == (((3, 3),), (), 0.0)


def test_the_run_figures_follow_their_definitions():
    live = run_figures(LIVE, [LOST], [figures(LIVE)], warmup=2, energy_j=400.0)
    assert live.healthy_samples_per_s == pytest.approx(BATCH / T)
    assert live.healthy_step_s == pytest.approx(T)
    assert live.degraded_over_healthy == pytest.approx(T / 0.75)
    window = (12.0 + 19 * 0.75) - 1.5  # from the warm-up's end (step 3) to the last step
    assert live.goodput_time == pytest.approx(1 - (2.0 - T) / window)
    # steps 4..40 done once each, against the healthy pace over the same window
    assert live.goodput_step == pytest.approx(37 * BATCH / (BATCH / T * window))
    assert live.energy_j_per_sample == pytest.approx(400.0 / (37 * BATCH))
    # energy metered from just before the fault, when no step had ended since: steps 21..40
    metered = run_figures(LIVE, [LOST], [figures(LIVE)], 2, 400.0, 10.1)
    assert metered.energy_j_per_sample == pytest.approx(400.0 / (20 * BATCH))
    restart = run_figures(RESTART, [LOST], [figures(RESTART)], 2, None)
    window = (30.0 + 29 * T) - 1.5
    assert restart.goodput_time == pytest.approx(1 - ((20.0 - T) + 5 * T) / window)
    assert restart.goodput_step == pytest.approx(42 * BATCH / (BATCH / T * window))
    assert restart.energy_j_per_sample is None


def test_a_fault_before_any_step_has_no_figures():
    with pytest.raises(FiguresError, match="no step ended before"):
        figures(LIVE, Fault("gpu-lost", 0.1, None))


def test_the_benchs_fault_entry_is_what_the_simulator_reads():
    doc = {"format": pauses.FORMAT, "job": {
        "gpus": 6, "nodes": 2, "gpus_per_node": 3, "tp": 3, "pp": 1, "dp": 2, "parameters": 1,
        "step_seconds": T, "checkpoint_interval_steps": 50, "checkpoint_interval_seconds": 25.0},
        "policies": {"spares": {"faults": [figures(SPARE).to_dict()]}}}
    (got,) = pauses.parse(doc).policies["spares"]
    assert got.layouts == ((3, 3), (3,), (3, 3))
    assert [(s.changes, s.pause_s) for s in got.switches] == [(("drop",), 1.0), (("join",), 0.8)]
    assert (got.pause_s, got.reduced_s, got.detection_s) == (1.8, 4.5, 0.4)


def result(policy: str, fault: FaultFigures, step_s: float) -> recoverybench.Result:
    run = RunFigures(BATCH / step_s, step_s, None, 1.0, 1.0, None)
    return recoverybench.Result(policy, [], {}, [], [fault], run, None, (0.0, 0.0))


def test_the_ratio_counts_the_restarts_redone_steps():
    # NTP paused 0.4 s at a 0.1 s step; the restart 2.0 s and redid 20 steps of 0.1 s: its
    # time lost is 1.9 + 2.0 s, not its pause alone (which would make the ratio 0.158).
    ntp = FaultFigures("gpu-lost", 0.05, 0.4, 0, ((3, 3), (2, 3)),
                       (Switch(("reshard",), 0.4, 0, (2, 3)),), 30.0)
    ckpt = FaultFigures("gpu-lost", 0.05, 2.0, 20, ((3, 3), (3, 3)),
                        (Switch(("restart",), 2.0, 20, (3, 3)),), 0.0)
    lines = recoverybench.ratios([result("NTP", ntp, 0.1), result("CKPT-RESTART", ckpt, 0.1)])
    assert "NTP / CKPT-RESTART = 0.077" in lines[0], lines
    assert "3,3 -reshard 0.40-> 2,3" in lines[0]


def test_the_next_fault_waits_until_the_job_settles_on_the_layout_that_answers_it():
    def done(until: float, published: tuple[int, int] | None, since: float) -> bool:
        return recovered([s for s in LIVE if s.time <= until], LOST.at, 3, published, since)
    assert not done(12.0, (0, 1), 0.0)  # generation 2 not yet published
    assert not done(12.0 + 0.75, (0, 2), 11.0)  # two steps on it
    assert done(12.0 + 1.5, (0, 2), 11.0)
    # between a restart's attempts nothing is published, whatever the steps say
    assert not done(40.0, None, 11.0)
    # generation 2 published for a planned switch: the steps of generation 1 that go on until
    # the switch do not count
    assert not recovered(steps(1, 80, T, T, (0, 1)), LOST.at, 3, (0, 2), 11.0)


def test_a_fault_that_changes_nothing_is_over_once_the_job_trained_on_for_the_quiet_time():
    unmoved = steps(1, 80, T, T, (0, 1))
    assert not recovered([s for s in unmoved if s.time <= LOST.at + QUIET_S], LOST.at, 3,
                         (0, 1), 0.0)
    assert recovered(unmoved, LOST.at, 3, (0, 1), 0.0)
    # a job that stopped right after the fault (a restart under way) has not recovered, however
    # long nothing follows
    assert not recovered([s for s in unmoved if s.time <= LOST.at + 1], LOST.at, 3, (0, 1), 0.0)


@pytest.mark.parametrize(("faults", "why"), [
    ("gpu-uncordoned,gpu-cordoned", "gpu-uncordoned needs a gpu-cordoned before it"),
    ("gpu-returned", "gpu-returned needs a gpu-lost before it"),
    ("gpu-melted", "--faults: one or more of"),
])
def test_the_bench_refuses_a_sequence_it_cannot_inject(faults, why, capsys):
    with pytest.raises(SystemExit):
        recoverybench.parse_args(["--faults", faults])
    assert why in capsys.readouterr().err


@pytest.mark.e2e
def test_the_bench_runs_a_short_sequence_and_writes_what_the_simulator_reads(tmp_path, capsys):
    done = subprocess.run(
        [sys.executable, "-m", "tessera_dev.cli", "bench", "recovery", "--policies", "NTP",
         "--faults", "gpu-lost", "--settle", "3", "--warmup", "3",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    with capsys.disabled():
        print("\n" + done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "recovery.json").read_text())
    measured = pauses.parse(doc)  # the simulator's own validation
    (lost,) = measured.policies["ntp"]
    assert lost.kind == "gpu-lost"
    # NTP goes on live: the job knew of the loss from its own agents, in seconds, and redid
    # no step it had done
    assert lost.detection_s is not None and lost.detection_s < 2.0
    assert lost.steps_redone == 0
    # what was measured is a reshard: the hit replica trains on at TP2 on its group's survivors,
    # beside the whole one, and the switch into it moved units between TP ranks
    assert lost.layouts[0] == (3, 3)
    assert sorted(lost.layouts[-1]) == [2, 3]
    assert any("reshard" in s.changes for s in lost.switches)
    assert lost.reduced_s > 0
    # every switch is charged to the fault: the layouts the job trained on after it, as its
    # trainers logged them, are the fault's, and its pause is theirs
    run = doc["runs"]["ntp"]
    (at,) = run["faults_at"]
    after = [t["tp_degrees"] for t in run["trained"] if t["first_at"] > at]
    assert [list(x) for x in lost.layouts[1:]] == after
    assert lost.pause_s == pytest.approx(sum(s.pause_s for s in lost.switches), abs=1e-6)
    assert 0 < run["goodput_time"] <= 1
    assert (tmp_path / "recovery.png").stat().st_size > 0
