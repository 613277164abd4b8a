"""Every flag of `tessera-dev simulate` and `tessera-dev bench sim` is bounded: refused, flag named,
exit 2, before the output folder exists; the bounds are the schema's and the simulator's own
(README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_contracts import api
from tessera_dev.cli import main as tessera
from tessera_sim.config import MAX_DP, MAX_GPUS, MAX_MODEL, MAX_PP, MAX_TP

pytestmark = pytest.mark.sim

TOO_MANY = ",".join(["0.001"] * 1001)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The three: each would have ended in a MemoryError after creating the folder.
        (["--rate", "1e9"], "(change --rate, --days, --traces"),
        (["--days", "1e12"], "days must be at most 50,000, got 1000000000000.0 (change --days)"),
        (
            ["--spare-domains", "1000000000"],
            "spare_domains 1,000,000,000 x 32 GPUs and the job's 32,768 make 32,000,032,768 GPUs; "
            "at most 1,048,576 together (change --spare-domains)",
        ),
        # The job: the NTPTrainingJob schema's bounds.
        (["--gpus", str(2 * MAX_GPUS)], "gpus must be at most 1,048,576, got 2097152 (change --gp"),
        (["--tp", "577"], "tp must be at most 576, got 577 (change --tp)"),
        (["--pp", "1025", "--dp", "1"], "pp must be at most 1,024, got 1025 (change --pp)"),
        (["--dp", "65537"], "dp must be at most 65,536, got 65537 (change --dp)"),
        (["--hidden", "524288"], "model.hidden must be at most 262,144, got 524288 (change --hid"),
        (
            ["--hidden", "262144", "--heads", "8192", "--kv-heads", "8192"],
            "model.n_heads must be at most 4,096, got 8192 (change --heads)",
        ),
        (["--ffn", "2000000"], "model.ffn must be at most 1,048,576, got 2000000 (change --ffn)"),
        (["--vocab", "5000000"], "model.vocab must be at most 4,194,304, got 5000000 (change --v"),
        (["--layers", "4097"], "model.n_layers must be at most 4,096, got 4097 (change --layers)"),
        (["--seq-len", str(2**25)], "model.seq_len must be at most 16,777,216, got 33554432 (ch"),
        # Integers study.json must carry exactly.
        (["--tokens-per-batch", str(2**54)], "at most 9,007,199,254,740,992, got 1801439850948"),
        (["--seed", str(2**60)], "seed must be at most 9,007,199,254,740,992, got 1152921504606"),
        # Durations: the clock's range.
        (["--hardware-repair-days", "1e6"], "hardware_repair_days must be at most 50,000, got 1"),
        (["--software-repair-hours", "1e9"], "software_repair_hours must be at most 1.2e+06, go"),
        (["--restart-minutes", "1e12"], "restart_minutes must be at most 7.2e+07, got 100000"),
        (["--checkpoint-minutes", "1e12"], "(change --checkpoint-minutes)"),
        (["--reconfigure-seconds", "1e13"], "at most 4.32e+09, got 10000000000000.0 (change --re"),
        (["--spare-swap-seconds", "1e13"], "at most 4.32e+09, got 10000000000000.0 (change --sp"),
        # The power model's peak.
        (["--headroom", "0.5"], "power_headroom must be at most 0.4004, got 0.5: the power mod"),
        # Memory and time of the study.
        (["--traces", "100000"], "the failure traces would replay about 5.73e+07 failure and re"),
        (["--blast-radius", "1", "--days", "40000"], "(change --rate, --days, --traces, --gpus,"),
        (["--trials", "100000"], "the snapshots need 3,200,000 draws and 66,803,200,000 group u"),
        (["--fractions", TOO_MANY], "at most 1000 fractions, got 1,001 (change --fractions)"),
        (["--tps", ",".join(["8"] * 1001)], "at most 1000 tps, got 1,001 (change --tps)"),
        # Already bounded by the job: each still gets its clear error.
        (["--domain-size", "64", "--gpus", "32800", "--dp", "1"], "tp x pp x dp = 32 x 8 x 1"),
        (["--blast-radius", "64"], "blast_radius 64 must divide domain_size 32 (change --blast"),
        (["--min-tp", "40"], "policy.min_tp must be in [0, tp=32], got 40 (change --min-tp)"),
        (["--hardware-share", "2"], "hardware_share must be in [0, 1], got 2.0 (change --hardw"),
    ],
)
def test_simulate_refuses_each_bound_before_creating_the_folder(
    tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    assert tessera(["simulate", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_simulate_help_states_the_bounds(capsys) -> None:
    with pytest.raises(SystemExit):
        tessera(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for bound in ("1,048,576 GPUs", "TP 576", "PP 1024", "DP 65,536", "50,000 days",
                  "0.400", "262,144 failure and repair events", "268,435,456 group updates",
                  "checked before anything is written"):  # fmt: skip
        assert bound in text, bound


def test_job_and_model_bounds_are_the_schemas() -> None:
    # The simulator covers exactly the jobs the operator accepts.
    spec = api.job_schema()
    fields = spec["properties"]
    model = fields["model"]["properties"]
    names = {"hidden": "hidden", "heads": "n_heads", "kvHeads": "n_kv_heads", "ffn": "ffn",
             "vocab": "vocab", "layers": "n_layers", "seqLen": "seq_len"}  # fmt: skip
    # the sizes the simulator computes with (a family's fields, such as headDim or qkNorm, are
    # not among them)
    assert {names[k]: model[k]["maximum"] for k in names} == MAX_MODEL
    assert fields["totalGPUs"]["maximum"] == MAX_GPUS
    assert fields["tensorParallelSize"]["maximum"] == MAX_TP
    assert fields["pipelineParallelSize"]["maximum"] == MAX_PP
    assert fields["dataParallelReplicas"]["maximum"] == MAX_DP


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--days", "1e12"], "days must be at most 50,000, got 1000000000000.0 (change --days)"),
        (["--repeat", "0"], "repeat must be >= 1, got 0 (change --repeat)"),
        # 3 x 10,000-day traces: about 1e6 events, 1e9 group updates.
        (["--days", "10000"], "(change --days or --repeat)"),
        (["--seed", str(2**60)], "(change --seed)"),
    ],
)
def test_bench_sim_refuses_each_bound_before_running(
    capsys, args: list[str], message: str
) -> None:
    assert tessera(["bench", "sim", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert "sim bench" not in captured.out
