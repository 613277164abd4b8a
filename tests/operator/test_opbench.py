"""`tessera-dev bench operator` runs end to end on a small cluster of its own and prints its
figures; its exit status says whether they meet the targets it prints."""

from __future__ import annotations

import re

import pytest

from tessera_dev import opbench

pytestmark = pytest.mark.operator


def test_the_operator_bench_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    code = opbench.main(["--nodes", "6", "--jobs", "3", "--cordons", "2", "--window", "3"])
    out = capsys.readouterr().out
    p99 = re.search(r"p99 (\d+) ms \(target", out)
    rss = re.search(r"peak ([0-9.]+) of the 512 Mi limit", out)
    per_node = re.search(r"per node ([0-9.]+)/s -> ([0-9.]+)/s at 8192 nodes", out)
    assert p99 and rss and per_node, out
    assert "3 NTP-PW jobs" in out and "2 cordons" in out
    assert re.search(r"operator CPU per cordon: \d+ ms", out), out
    assert code == (0 if int(p99[1]) < 1000 and float(rss[1]) < 0.5 else 1), out
    assert "largest shape degraded" in out


@pytest.mark.parametrize(("argv", "words"), [
    (["--jobs", "0"], "--jobs must be between 1 and --nodes"),
    (["--nodes", "4", "--jobs", "5"], "--jobs must be between 1 and --nodes (4)"),
    (["--jobs", "2", "--cordons", "3"], "--cordons must be between 1 and --jobs (2)"),
    (["--window", "0"], "--window and --timeout must be in (0, 3600]"),
])
def test_bad_arguments_are_usage_errors(argv: list[str], words: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        opbench.main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err
