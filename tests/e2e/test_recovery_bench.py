"""`tessera-dev bench recovery`: its figures from a timeline written by hand, and a short run end to
end on a local cluster of its own, whose file the simulator takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera_dev.recovery_figures import (
    Fault,
    FiguresError,
    Step,
    fault_figures,
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


@pytest.mark.e2e
def test_the_bench_runs_a_short_sequence_and_writes_what_the_simulator_reads(tmp_path, capsys):
    done = subprocess.run(
        [sys.executable, "-m", "tessera_dev.cli", "bench", "recovery", "--policies", "NTP",
         "--faults", "gpu-lost,gpu-returned", "--settle", "3", "--warmup", "3",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    with capsys.disabled():
        print("\n" + done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "recovery.json").read_text())
    measured = pauses.parse(doc)  # the simulator's own validation
    lost, back = measured.policies["ntp"]
    assert (lost.kind, back.kind) == ("gpu-lost", "gpu-returned")
    # NTP goes on live: the job knew of the loss from its own agents, in seconds, and redid
    # no step it had done
    assert lost.detection_s is not None and lost.detection_s < 2.0
    assert lost.steps_redone == 0 and back.steps_redone == 0
    assert 0 < doc["runs"]["ntp"]["goodput_time"] <= 1
    assert (tmp_path / "recovery.png").stat().st_size > 0
