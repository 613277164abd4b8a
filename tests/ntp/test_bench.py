"""`tessera bench ntp` runs both layouts through the trainer and prints its ratios."""

from __future__ import annotations

import re

import pytest

from ntp import bench

pytestmark = pytest.mark.parity


def test_bench_prints_overhead_and_share(capsys):
    argv = ["--flavor", "debug", "--healthy-tp", "2", "--reduced-tp", "1"]
    assert bench.main([*argv, "--steps", "2", "--warmup", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    ratios = re.findall(r"ratio, .*?: (\d+\.\d+)", out)
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios)
    share = re.search(r"throughput / healthy: (\d+\.\d+) \(target >= 0.97 x 1/2 = 0.485\)", out)
    assert share and float(share.group(1)) > 0
