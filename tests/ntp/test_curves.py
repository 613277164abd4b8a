"""TensorBoard's own reader reads the curves the trainer writes, and a resumed run's replace the
steps it redoes."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ntp.curves import (
    DIRECTORY,
    EVAL_LOSS,
    GOODPUT,
    GRAD_NORM,
    LEARNING_RATE,
    LOSS,
    TOKENS_PER_S,
    Curves,
)

pytestmark = pytest.mark.checkpoint


def read(path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(path / DIRECTORY))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_reads_every_curve_and_a_resume_replaces_the_redone_steps(tmp_path):
    first = Curves(tmp_path, resumed_at=0)
    for step in range(1, 6):
        first.step(step, loss=10.0 - step, learning_rate=0.001 * step, grad_norm=2.0,
                   tokens_per_s=1000.0, goodput=0.5 if step > 1 else None)
    first.evaluated(4, 7.5)
    first.close()
    # Resumed from the checkpoint of step 3: steps 4 and 5 are redone, with other values.
    again = Curves(tmp_path, resumed_at=3)
    for step in (4, 5, 6):
        again.step(step, loss=100.0 + step, learning_rate=0.001 * step, grad_norm=1.0,
                   tokens_per_s=900.0, goodput=0.75)
    again.evaluated(6, 50.0)
    again.close()
    curves = read(tmp_path)
    assert curves[LOSS] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert [s for s, _ in curves[LEARNING_RATE]] == [1, 2, 3, 4, 5, 6]
    assert curves[LEARNING_RATE][5][1] == pytest.approx(0.006)
    assert curves[GRAD_NORM][-1] == (6, 1.0)
    assert curves[TOKENS_PER_S][0] == (1, 1000.0)
    assert curves[GOODPUT][0] == (2, 0.5)
    assert curves[EVAL_LOSS] == [(6, 50.0)]  # the first run's step-4 evaluation was redone
