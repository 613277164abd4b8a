"""`tessera-dev simulate` and `tessera-dev bench sim` end to end, and clear errors for impossible
jobs."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from tessera_dev.cli import main as tessera
from tessera_sim.config import (
    ConfigError,
    FailureConfig,
    ModelConfig,
    PolicyConfig,
    SimConfig,
)
from tessera_sim.policies import POLICY_NAMES

pytestmark = pytest.mark.sim

SMALL = [
    "--gpus",
    "1024",
    "--domain-size",
    "8",
    "--tp",
    "8",
    "--pp",
    "4",
    "--days",
    "3",
    "--traces",
    "1",
    "--trials",
    "2",
    "--fractions",
    "0,0.01",
    "--tps",
    "8,16",
]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SimConfig(dp=100), "tp x pp x dp = 32 x 8 x 100 = 25600, but gpus = 32768"),
        (SimConfig(domain_size=48), "domain_size 48 is not a multiple of tp 32"),
        (SimConfig(failures=FailureConfig(blast_radius=3)), "blast_radius 3 must divide"),
        (SimConfig(failures=FailureConfig(rate_per_gpu_day=-1)), "rate_per_gpu_day must be >= 0"),
        (SimConfig(failures=FailureConfig(hardware_share=1.5)), "hardware_share must be in [0, 1]"),
        (SimConfig(policy=PolicyConfig(min_tp=33)), "policy.min_tp must be in [0, tp=32]"),
        (SimConfig(model=ModelConfig(tokens_per_batch=0)), "tokens_per_batch must be positive"),
        (SimConfig(days=0), "days must be positive"),
    ],
)
def test_impossible_configs_are_rejected_with_the_field_named(config, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert message in str(info.value)


def test_simulate_writes_json_csv_and_plots(tmp_path: Path, capsys) -> None:
    out = tmp_path / "study"
    assert tessera(["simulate", *SMALL, "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["goodput"]] == list(POLICY_NAMES)
    assert doc["config"]["dp"] == 1024 // (8 * 4)
    for name in (
        "goodput.csv",
        "loss_vs_failed_fraction.csv",
        "availability_vs_tp.csv",
        "trace.csv",
        "study.json",
        "loss_vs_failed_fraction.png",
        "availability_vs_tp.png",
        "spares_vs_failed_fraction.png",
        "trace.png",
    ):
        assert (out / name).stat().st_size > 0, name
    with (out / "loss_vs_failed_fraction.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(POLICY_NAMES)
    healthy = [float(r["loss_mean"]) for r in rows if float(r["failed_fraction"]) == 0.0]
    assert healthy == [0.0] * len(POLICY_NAMES)
    assert json.loads((out / "study.json").read_text()) == doc


def test_stage_aware_regroup_flag_reaches_the_policies(tmp_path: Path, capsys) -> None:
    # At 1% failed on 1,024 GPUs (10 GPUs in 32 replicas of 4 stages) honouring stages can
    # only lose DP-DROP replicas, never win them, and the same seed draws the same failures for
    # both runs (here 9.0% against 12.9%); the unpacked policy does not regroup at all.
    loss = {}
    for flag in ([], ["--stage-aware-regroup"]):
        out = tmp_path / ("aware" if flag else "plain")
        args = [*SMALL, "--trials", "8", *flag, "--no-plots", "--json", "--out", str(out)]
        assert tessera(["simulate", *args]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["config"]["policy"]["stage_aware_regroup"] is bool(flag)
        loss[bool(flag)] = {
            r["policy"]: r["loss_mean"] for r in doc["loss_vs_failed_fraction"]
            if r["requested_fraction"] == 0.01
        }
    assert loss[True]["dp-drop"] > loss[False]["dp-drop"]
    assert loss[True]["dp-drop-unpacked"] == loss[False]["dp-drop-unpacked"]
    assert loss[False]["dp-drop"] < loss[False]["dp-drop-unpacked"]


def test_simulate_prints_tables_by_default(tmp_path: Path, capsys) -> None:
    assert tessera(["simulate", *SMALL, "--no-plots", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Over the failure traces" in text and "tessera" in text
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "1000", "--tp", "32", "--dp", "4"], "tp x pp x dp"),
        (["--trials", "0"], "trials must be >= 1, got 0 (change --trials)"),
        (["--fractions", "0.001,1.5"], "failed fractions must be in [0, 1)"),
        (["--headroom", "-0.1"], "policy.power_headroom must be >= 0"),
        (["--tps", "8,65536"], "TP sizes must be in [1, 32768] GPUs"),
        # 16M tokens of 16K sequences do not split over 96 replicas: name the flag and a value.
        (["--gpus", "24576"], "17301504 = 11 per replica) (change --tokens-per-batch)"),
        (["--heads", "100"], "must be a multiple of n_heads (100) (change --hidden, --heads"),
        (["--spare-swap-seconds", "-1"], "(change --spare-swap-seconds)"),
        (["--seed", "-5"], "seed must be >= 0, got -5 (change --seed)"),
        # NaN passes a `< 0` check and inf a `> 0` one: both must still be refused.
        (["--rate", "nan"], "rate_per_gpu_day must be >= 0 and finite, got nan (change --rate)"),
        (["--days", "inf"], "days must be positive and finite, got inf (change --days)"),
        (["--headroom", "inf"], "power_headroom must be >= 0 and finite, got inf (change --head"),
        (["--gpus", "100"], "gpus 100 is not a multiple of tp x pp = 32 x 8 = 256 (change --gpus"),
    ],
)
def test_simulate_rejects_bad_input_with_exit_2_and_writes_nothing(
    tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    assert tessera(["simulate", *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda tmp: tmp / "file", "exists and is not a directory"),
        (lambda tmp: tmp / "file" / "sub", "cannot create --out"),
    ],
)
def test_simulate_rejects_an_unusable_out_before_running(
    tmp_path: Path, capsys, make_out, message: str
) -> None:
    (tmp_path / "file").write_text("keep me")
    out = make_out(tmp_path)
    # --traces 100 would take minutes: the exit comes before the study starts.
    assert tessera(["simulate", "--traces", "100", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and message in err and "Traceback" not in err
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--days", "-1"], "days must be positive and finite, got -1.0 (change --days)"),
        (["--seed", "-1"], "seed must be >= 0, got -1 (change --seed)"),
    ],
)
def test_bench_sim_rejects_bad_input_with_exit_2(capsys, args: list[str], message: str) -> None:
    assert tessera(["bench", "sim", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "sim bench" not in captured.out


def test_simulate_takes_the_model_shape_and_batch_from_flags(tmp_path: Path, capsys) -> None:
    args = ["--gpus", "24576", "--tokens-per-batch", str(8 * 96 * 8192), "--days", "2"]
    args += ["--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn", "28672"]
    args += ["--layers", "80", "--seq-len", "8192", "--spare-swap-seconds", "30"]
    args += ["--traces", "1", "--trials", "2", "--fractions", "0.001", "--tps", "32"]
    assert tessera(["simulate", *args, "--no-plots", "--out", str(tmp_path), "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["dp"] == 96
    assert config["model"]["shape"] == {
        "hidden": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn": 28672, "vocab": 128_256,
        "n_layers": 80, "seq_len": 8192, "head_dim": 128, "qkv_bias": False, "qk_norm": False,
        "tied_embeddings": False, "sliding_window": None, "rope_scaling": None,
    }  # fmt: skip
    assert config["model"]["tokens_per_batch"] == 8 * 96 * 8192
    assert config["policy"]["spare_swap_seconds"] == 30


def test_bench_sim_prints_consistent_figures_against_its_baseline(capsys) -> None:
    # Not a timed test: whatever the machine's speed, the printed figures must agree with each
    # other and the exit status with the printed verdict.
    rc = tessera(["bench", "sim", "--days", "2", "--repeat", "1"])
    text = capsys.readouterr().out
    plan = float(re.search(r"planner, cold \(all TP degrees\): ([\d.]+) s", text)[1])
    base = re.search(r"baseline 1-day replay: (\d+) events, ([\d.]+) s", text)
    trace = re.search(r"  2-day replay: (\d+) events, ([\d.]+) s", text)
    per_day = float(re.search(r"2-day vs 1-day baseline: ([\d.]+)x", text)[1])
    target = re.search(r"cold planner ([\d.]+) s of 30 s \(([\d.]+) of the target\): (\w+)", text)
    assert int(trace[1]) > int(base[1]) > 0
    assert per_day == pytest.approx(float(trace[2]) / 2 / float(base[2]), abs=0.01, rel=0.02)
    total = float(target[1])
    assert total == pytest.approx(plan + float(trace[2]), abs=2e-4)
    assert float(target[2]) == pytest.approx(total / 30, abs=1e-4)
    assert (target[3], rc) in (("pass", 0), ("FAIL", 1))
