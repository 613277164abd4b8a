"""`tessera-dev bench ntp` runs both layouts through the trainer and prints its ratios."""

from __future__ import annotations

import re

import pytest

from ntp import bench

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
