"""`tessera-dev bench ntp` runs both layouts through the trainer and prints its ratios."""

from __future__ import annotations

import re

import pytest

from ntp import bench
from tessera_dev import trainbench

pytestmark = pytest.mark.parity


def test_bench_prints_overhead_and_share(capsys):
    argv = ["--flavor", "debug", "--healthy-tp", "2", "--reduced-tp", "1"]
    assert bench.main([*argv, "--steps", "2", "--warmup", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    ratios = re.findall(r"step-time ratio, .*?: (\d+\.\d+)", out)
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios)
    assert "processes, the uniform one 4" in out  # CPU: says the process counts differ
    own = re.search(r"alone \(same run\): (\d+\.\d+) \(target >= 0.97 x 1/2 = 0.485\)", out)
    synced = re.search(r"synchronized steps: (\d+\.\d+)", out)
    assert own and float(own.group(1)) > 0
    # Under plain NTP the synchronized share is N2/N1 over the mixed/uniform step-time ratio.
    assert synced and float(synced.group(1)) == pytest.approx(0.5 / float(ratios[1]), rel=0.01)


def test_training_bench_measures_throughput_and_the_checkpoint_wait(capsys):
    argv = ["--max-bytes", "100000", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    assert trainbench.main(argv) == 0
    out = capsys.readouterr().out
    tps = re.search(r"TP4 ([\d,]+), TP3 ([\d,]+) \(TP3 / TP4 (\d+\.\d+)", out)
    assert tps and all(float(g.replace(",", "")) > 0 for g in tps.groups())
    waits = re.search(r"blocking (\d+\.\d) ms, asynchronous (\d+\.\d) ms; async / blocking "
                      r"(\d+\.\d+)", out)
    assert waits
    blocking, background, ratio = map(float, waits.groups())
    # Printed to 0.1 ms (0.05 ms off at most each) and the ratio to 0.001.
    drift = background / blocking * (0.05 / background + 0.05 / blocking) + 0.0005
    assert ratio == pytest.approx(background / blocking, abs=drift)
