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
    FiguresError,
    Step,
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


# 20 healthy steps (ends at 0.5 ... 10.0); a GPU lost at 10.2, noticed at 10.6; the job goes on
# in generation 2 from step 21 at 12.0, at 2/3 of the pace (0.75 s a step), until step 40.
LIVE = steps(1, 20, T, T, (0, 1)) + steps(21, 40, 12.0, 0.75, (0, 2))
LOST = Fault("gpu-lost", 10.2, 10.6)
# The same fault under a restart from the checkpoint of step 15: the next attempt's first step
# (16) ends at 30.0, then at the healthy pace until step 45.
RESTART = steps(1, 20, T, T, (0, 1)) + steps(16, 45, 30.0, T, (1, 1))


def test_a_live_relayout_pauses_from_the_last_step_before_to_the_first_after_and_redoes_none():
    got = fault_figures(LIVE, LOST)
    assert got.detection_s == pytest.approx(0.4)
    assert got.pause_s == pytest.approx(12.0 - 10.0)
    assert (got.steps_redone, got.relaid) == (0, True)


def test_a_step_ended_after_the_injection_began_delays_the_fault_for_its_detection():
    # A loaded machine took 0.3 s to reach the processes: step 21 ended 0.2 s after the
    # injection began, on the layout before; the pause still holds the detection.
    late = steps(1, 21, T, T, (0, 1)) + steps(22, 40, 12.0, 0.75, (0, 2))
    got = fault_figures(late, Fault("gpu-lost", 10.3, 10.9))
    assert got.detection_s == pytest.approx(10.9 - 10.5)
    assert got.pause_s == pytest.approx(12.0 - 10.5)
    assert got.pause_s >= got.detection_s


def test_a_restart_redoes_the_steps_since_its_checkpoint():
    got = fault_figures(RESTART, LOST)
    assert got.pause_s == pytest.approx(30.0 - 10.0)
    assert got.steps_redone == 20 - 16 + 1


def test_a_fault_that_changes_no_layout_pauses_one_step():
    got = fault_figures(steps(1, 30, T, T, (0, 1)), Fault("gpu-returned", 7.1, None))
    assert (got.detection_s, got.pause_s, got.steps_redone, got.relaid) == (None, T, 0, False)


def test_the_run_figures_follow_their_definitions():
    live = run_figures(LIVE, [LOST], [fault_figures(LIVE, LOST)], warmup=2, energy_j=400.0)
    assert live.healthy_samples_per_s == pytest.approx(BATCH / T)
    assert live.degraded_over_healthy == pytest.approx(T / 0.75)
    window = (12.0 + 19 * 0.75) - 1.5  # from the warm-up's end (step 3) to the last step
    assert live.goodput_time == pytest.approx(1 - (2.0 - T) / window)
    # steps 4..40 done once each, against the healthy pace over the same window
    assert live.goodput_step == pytest.approx(37 * BATCH / (BATCH / T * window))
    assert live.energy_j_per_sample == pytest.approx(400.0 / (37 * BATCH))
    # energy metered from just before the fault, when no step had ended since: steps 21..40
    metered = run_figures(LIVE, [LOST], [fault_figures(LIVE, LOST)], 2, 400.0, 10.1)
    assert metered.energy_j_per_sample == pytest.approx(400.0 / (20 * BATCH))
    restart = run_figures(RESTART, [LOST], [fault_figures(RESTART, LOST)], 2, None)
    window = (30.0 + 29 * T) - 1.5
    assert restart.goodput_time == pytest.approx(1 - ((20.0 - T) + 5 * T) / window)
    assert restart.goodput_step == pytest.approx(42 * BATCH / (BATCH / T * window))
    assert restart.energy_j_per_sample is None


def test_a_fault_before_any_step_has_no_figures():
    with pytest.raises(FiguresError, match="no step ended before"):
        fault_figures(LIVE, Fault("gpu-lost", 0.1, None))


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
    assert 0 < doc["runs"]["ntp"]["goodput_time"] <= 1
    assert (tmp_path / "recovery.png").stat().st_size > 0
