"""`tessera-dev simulate --pauses`: a recovery bench's measured pauses, scaled to the simulated job
by the README's model, charged to the policies the file lists, goodput reported both ways."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tessera_dev.cli import main as tessera
from tessera_sim import pauses
from tessera_sim.analysis import StudySettings, run_study
from tessera_sim.config import FailureConfig, SimConfig
from tessera_sim.policies import POLICY_NAMES, build_policies

pytestmark = [pytest.mark.sim, pytest.mark.recovery]

SAMPLE = Path(__file__).parent / "data" / "recovery-sample.json"
# `tessera-dev bench recovery`'s file as it wrote it (the README's "Measured on this machine")
MEASURED = Path(__file__).parent / "data" / "recovery-measured.json"
TESSERA_DEV = Path(sys.executable).with_name("tessera-dev")
# A 1,024-GPU job (TP8 x PP4 x DP32) of the paper's model: a run takes well under a second.
SMALL = ["--gpus", "1024", "--domain-size", "8", "--tp", "8", "--pp", "4", "--days", "3"]
SMALL += ["--traces", "1", "--trials", "1", "--fractions", "0", "--tps", "8", "--no-plots"]


def sample() -> dict[str, Any]:
    return json.loads(SAMPLE.read_text())


def fault(kind: str, detection: float | None, pause: float, redone: int, changes: list[str]
          ) -> dict[str, Any]:
    """A fault entry whose one switch did `changes` (a TP2 x DP2 layout before and after)."""
    return {"kind": kind, "detection_s": detection, "pause_s": pause, "steps_redone": redone,
            "layouts": [[2, 2], [2, 2]], "switches": [{"changes": changes, "pause_s": pause}],
            "reduced_s": 0.0}


def model_parameters(cfg: SimConfig) -> int:
    """The paper model's parameter count written out: per layer Q and O (h x h each), K and V
    (kv_heads x head_dim x h each), the SwiGLU gate, up and down (3 x h x ffn); then the
    embedding and the untied LM head (2 x vocab x h)."""
    s = cfg.model.shape
    head_dim = s.hidden // s.n_heads
    per_layer = 2 * s.hidden * s.hidden + 2 * s.n_kv_heads * head_dim * s.hidden
    per_layer += 3 * s.hidden * s.ffn
    return s.n_layers * per_layer + 2 * s.vocab * s.hidden


def test_the_paper_model_has_its_487b_parameters() -> None:
    assert pauses.parameters(SimConfig()) == model_parameters(SimConfig()) == 487_598_325_760


def test_scaled_pauses_are_the_documented_model(paper_config: SimConfig) -> None:
    # The README's model, written out: detection and checkpoint load held; the rest times
    # R = log2(2 x nodes), sim (32,768 GPUs / 8 per node) over bench; plus, per switch, the
    # simulated shard, P / (tp x pp) x 12 bytes, over the link of what the switch did: from
    # storage at 2 GB/s (a restart), from a DP peer over 50 GB/s scale-out (a join; a reshard:
    # 1/(tp - 1) of it for a survivor, the whole shard for a returned GPU), nothing (a drop).
    # A restart also loses half the simulated checkpoint interval. Per policy the mean over the
    # failure kinds present.
    doc = sample()
    job = doc["job"]
    r = math.log2(2 * 32_768 / 8) / math.log2(2 * job["nodes"])
    shard = model_parameters(paper_config) / (32 * 8) * 12
    storage, scale_out = shard / 2e9, shard / 50e9
    survivor = shard / 31 / 50e9
    restart = [
        3.0 + 2.5 + (31.0 - 3.0 - 2.5) * r + storage,  # gpu-lost
        3.5 + 2.5 + (36.0 - 3.5 - 2.5) * r + storage,  # node-lost
        0.0 + 2.4 + (24.0 - 2.4) * r + storage,  # gpu-cordoned: announced, not detected
    ]
    expected = {
        "ckpt-restart": (sum(restart) / 3 + 60 * 30 / 2, 0.0),
        "ntp": (((3.0 + (4.2 - 3.0) * r) + 0.9 * r) / 2 + survivor, 1.1 * r + scale_out),
        "ntp-pw": (((3.0 + (4.3 - 3.0) * r) + 1.0 * r) / 2 + survivor, 1.1 * r + scale_out),
        # A drop moves nothing; the replica's join when the GPU is back moves a whole shard.
        "dp-drop": (3.0 + (4.6 - 3.0) * r, 1.2 * r + scale_out),
        # A drop, then the spare's join: both pauses, and the join's shard. No repair
        # measured: the assumed one (none) stays.
        "spares": (3.0 + (6.0 - 3.0) * r + scale_out, 0.0),
    }
    assumed = {p.name: p for p in build_policies(paper_config)}
    scaled = pauses.scale(pauses.parse(doc), paper_config)
    charged = {p.name: p for p in pauses.apply(tuple(assumed.values()), scaled)}
    for name, (failure, repair) in expected.items():
        assert charged[name].failure_stall_s == pytest.approx(failure, rel=1e-12), name
        assert charged[name].repair_stall_s == pytest.approx(repair, rel=1e-12), name
    for name in ("dp-drop-unpacked", "tessera"):
        assert charged[name] == assumed[name]
    # The factors study.json carries: R = 13 / 2 for 4,096 nodes against 2; a 22.9 GB shard.
    f = scaled.factors
    assert (f.restart, f.bench_nodes, f.sim_nodes) == (6.5, 2, 4096)
    assert f.shard_bytes == pytest.approx(shard, rel=1e-12)
    links = {"drop": (0.0, 0.0), "reshard": (survivor, scale_out), "join": (scale_out, scale_out),
             "restart": (storage, storage)}  # fmt: skip
    assert set(f.transfer_s) == set(links) == set(pauses.CHANGES)
    for name, (failure, repair) in links.items():
        assert f.transfer_s[name]["failure"] == pytest.approx(failure, rel=1e-12), name
        assert f.transfer_s[name]["repair"] == pytest.approx(repair, rel=1e-12), name
    # The measured pauses replace the assumed 25-min restart and 60 s reconfiguration.
    assert assumed["ckpt-restart"].failure_stall_s == 1500.0
    assert assumed["ntp"].failure_stall_s == assumed["ntp"].repair_stall_s == 60.0


def test_a_live_relayout_moves_far_fewer_bytes_than_a_restart(paper_config: SimConfig) -> None:
    # The same measured pause as a reshard and as a restart: both keep detection and grow the
    # rest alike, but a reshard survivor receives 1/31 of a shard from its DP peers where a
    # restarted GPU reads the whole 22.9 GB shard from storage.
    doc = sample()
    doc["policies"] = {"ntp": {"faults": [fault("gpu-lost", 3.0, 3.5, 0, ["reshard"])]},
                       "ckpt-restart": {"faults": [fault("gpu-lost", 3.0, 3.5, 0, ["restart"])]}}
    scaled = pauses.scale(pauses.parse(doc), paper_config)
    shard = model_parameters(paper_config) / (32 * 8) * 12
    r = 13 / 2
    ntp = scaled.policies["ntp"].faults[0].scaled_s
    restart = scaled.policies["ckpt-restart"].faults[0].scaled_s
    assert ntp == pytest.approx(3.0 + 0.5 * r + shard / 31 / 50e9, rel=1e-12)
    assert restart == pytest.approx(3.0 + 0.5 * r + shard / 2e9, rel=1e-12)
    assert restart > 2.5 * ntp
    transfer = scaled.factors.transfer_s
    assert transfer["reshard"]["failure"] < transfer["restart"]["failure"] / 500


def test_only_what_was_measured_as_a_reshard_is_scaled_as_one(paper_config: SimConfig) -> None:
    # One NTP policy's faults, the same pauses, each switch a different change: what moves is
    # what the switch did, not the policy's name. A fault that switched nothing moves nothing;
    # a switch of several changes moves the costliest's bytes; a fault of two switches both.
    doc = sample()
    shard = model_parameters(paper_config) / (32 * 8) * 12
    drop_join = fault("gpu-lost", 0.5, 2.0, 0, ["drop"])
    drop_join["layouts"].append([2, 2])
    drop_join["switches"] = [{"changes": ["drop"], "pause_s": 1.5},
                             {"changes": ["join"], "pause_s": 0.5}]  # fmt: skip
    none = fault("gpu-returned", None, 0.2, 0, [])
    none["layouts"], none["switches"] = [[2, 2]], []
    doc["policies"] = {"ntp": {"faults": [
        fault("gpu-lost", 0.5, 2.0, 0, ["reshard"]), fault("gpu-lost", 0.5, 2.0, 0, ["drop"]),
        fault("gpu-lost", 0.5, 2.0, 0, ["drop", "join"]), drop_join, none]}}  # fmt: skip
    scaled = [f.scaled_s for f in pauses.scale(pauses.parse(doc), paper_config)
              .policies["ntp"].faults]  # fmt: skip
    held = 0.5 + 1.5 * 13 / 2
    assert scaled == pytest.approx([held + shard / 31 / 50e9, held, held + shard / 50e9,
                                    held + shard / 50e9, 0.2 * 13 / 2], rel=1e-12)


def test_the_transfer_follows_the_scaling_models_bandwidths(paper_config: SimConfig) -> None:
    measured = pauses.parse(sample())
    default = pauses.scale(measured, paper_config).factors.transfer_s
    model = pauses.ScalingModel(
        bytes_per_parameter=2.0, storage_gbps=4.0, scale_out_gbps=10.0
    )
    changed = pauses.scale(measured, paper_config, model).factors.transfer_s
    # Bytes 12 -> 2 (a sixth), each link's bandwidth changed by its own ratio.
    ratios = {"restart": 4.0 / 2.0, "join": 10.0 / 50.0, "reshard": 10.0 / 50.0}
    for name, ratio in ratios.items():
        for which in ("failure", "repair"):
            want = default[name][which] / 6 / ratio
            assert changed[name][which] == pytest.approx(want, rel=1e-12), (name, which)
    # A drop moves nothing, whatever the links.
    assert default["drop"] == changed["drop"] == {"failure": 0.0, "repair": 0.0}
    # TP1 has no survivor to share a lost GPU's units among: the whole shard moves.
    tp1 = SimConfig(gpus=1024, domain_size=8, tp=1, pp=4, dp=256).validate()
    whole = model_parameters(tp1) / 4 * 12 / 50e9
    transfer = pauses.factors(measured.job, tp1).transfer_s["reshard"]
    assert transfer == pytest.approx({"failure": whole, "repair": whole}, rel=1e-12)
    # A storage slow enough pushes the restart past the simulator's clock: refused, named.
    slow = pauses.ScalingModel(storage_gbps=1e-9)
    with pytest.raises(pauses.PausesError, match=r"policies\.ckpt-restart: the failure pause "
                       r"scales to 2\.29e\+10 s"):  # fmt: skip
        pauses.scale(measured, paper_config, slow)
    with pytest.raises(ValueError, match="ScalingModel.scale_out_gbps must be > 0, got 0"):
        pauses.ScalingModel(scale_out_gbps=0)


def test_shorter_measured_pauses_raise_goodput_and_absent_policies_keep_theirs() -> None:
    # 10 failures per day on 1,024 GPUs for 5 days: every policy pauses dozens of times.
    cfg = SimConfig(
        gpus=1024, domain_size=8, tp=8, pp=4, dp=32, days=5.0,
        failures=FailureConfig(rate_per_gpu_day=0.01),
    ).validate()  # fmt: skip
    doc = sample()
    quick = fault("gpu-lost", 0.05, 0.1, 1, ["reshard"])
    slow = fault("gpu-lost", 5.0, 600.0, 50, ["restart"])
    doc["policies"] = {"ntp": {"faults": [quick]}, "ckpt-restart": {"faults": [slow]}}
    scaled = pauses.scale(pauses.parse(doc), cfg)
    assumed = {p.name: p for p in build_policies(cfg)}
    assert scaled.policies["ntp"].failure_stall_s < assumed["ntp"].failure_stall_s
    assert scaled.policies["ckpt-restart"].failure_stall_s > assumed["ckpt-restart"].failure_stall_s
    settings = StudySettings(fractions=(0.0,), tps=(8,), trials=1, traces=2)
    study = run_study(cfg, settings, pauses=scaled)
    rows = {r["policy"]: r for r in study.measured_goodput}
    assert [r["policy"] for r in study.measured_goodput] == list(POLICY_NAMES)
    assert {r["policy"]: r["goodput_mean"] for r in study.goodput} == {
        name: r["goodput_mean_assumed"] for name, r in rows.items()
    }
    assert rows["ntp"]["goodput_mean_measured"] > rows["ntp"]["goodput_mean_assumed"]
    assert (
        rows["ckpt-restart"]["goodput_mean_measured"] < rows["ckpt-restart"]["goodput_mean_assumed"]
    )
    for name in ("dp-drop", "dp-drop-unpacked", "spares", "ntp-pw", "tessera"):
        assert rows[name]["pauses"] == "assumed"
        assert rows[name]["goodput_mean_measured"] == rows[name]["goodput_mean_assumed"], name
        assert rows[name]["failure_stall_s"] == rows[name]["failure_stall_s_assumed"], name


def test_the_benchs_own_file_charges_every_policy_its_measured_pauses(
        paper_config: SimConfig) -> None:
    """What the bench writes is what the simulator reads, all of it: every policy it runs and
    every fault kind it injects, the repairs (a GPU back, a cordon lifted) included."""
    measured = pauses.parse(json.loads(MEASURED.read_text()))
    assert set(measured.policies) == {"ntp", "ntp-pw", "dp-drop", "spares", "ckpt-restart"}
    for faults in measured.policies.values():
        assert {f.kind for f in faults} == {*pauses.FAILURE_KINDS, *pauses.REPAIR_KINDS}
    scaled = pauses.scale(measured, paper_config)
    for name, charged in scaled.policies.items():
        assert charged.failure_stall_s is not None and charged.repair_stall_s is not None, name
    # the claim the bench exists for: a live relayout against the restart everyone runs
    assert scaled.policies["ntp"].failure_stall_s < \
        0.1 * scaled.policies["ckpt-restart"].failure_stall_s


def _mutate(path: str, value: Any, *more: Any) -> dict[str, Any]:
    """The sample with the value at a dotted path (list indices as [i]) set, and at each further
    (path, value) pair; `...` removes it."""
    doc = copy.deepcopy(sample())
    pairs = [(path, value), *zip(more[::2], more[1::2], strict=True)]
    for where, what in pairs:
        keys = where.replace("[", ".").replace("]", "").split(".")
        node: Any = doc
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        last: Any = int(keys[-1]) if isinstance(node, list) else keys[-1]
        if what is ...:
            del node[last]
        else:
            node[last] = what
    return doc


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read: No such file or directory"),
        ("{", "not JSON: Expecting property name"),
        ([1, 2], "must be a JSON object"),
        (_mutate("format", "tessera.recovery/v1"), "format: must be 'tessera.recovery/v2', got"),
        (_mutate("job", ...), "job: is missing"),
        (_mutate("job.tp", 4), "job.gpus: tp x pp x dp = 4 x 1 x 2 = 8, but gpus = 4"),
        (_mutate("job.parameters", 0), "job.parameters: must be an integer >= 1, got 0"),
        (_mutate("policies.ntp-magic", {"faults": []}), "policies.ntp-magic: unknown policy"),
        (_mutate("policies.ntp.faults", []), "policies.ntp.faults: must be a non-empty list"),
        (_mutate("policies.ntp.faults[1].pause_s", -1), "policies.ntp.faults[1].pause_s: must be "
         "a number >= 0, got -1"),
        (_mutate("policies.ntp.faults[0].pause_s", "fast"), "policies.ntp.faults[0].pause_s: "
         "must be a number >= 0, got 'fast'"),
        (_mutate("policies.ntp.faults[0].pause_s", ...), "policies.ntp.faults[0].pause_s: is "
         "missing"),
        (_mutate("policies.ntp.faults[0].steps_redone", True), "policies.ntp.faults[0]."
         "steps_redone: must be an integer >= 0, got True"),
        (_mutate("policies.ntp.faults[0].steps_redone", 1.5), "policies.ntp.faults[0].steps_"
         "redone: must be an integer >= 0, got 1.5"),
        (_mutate("policies.dp-drop.faults[0].kind", "gpu-melted"), "policies.dp-drop.faults[0]."
         "kind: must be one of gpu-lost, gpu-cordoned, node-lost, gpu-returned, gpu-uncordoned"),
        (_mutate("policies.ntp.faults[0].detection_s", 5.0), "policies.ntp.faults[0].pause_s: "
         "must be at least detection_s + checkpoint_load_s = 5, got 4.2"),
        (_mutate("policies.ntp.faults[0].pause_seconds", 4.2), "policies.ntp.faults[0]."
         "pause_seconds: unknown key"),
        # A repair within the clock, 2e9 s, grows x4 (128 nodes against 2) past its 4.32e9 s.
        (_mutate("policies.ntp.faults[2].pause_s", 2e9,
                 "policies.ntp.faults[2].switches[0].pause_s", 2e9),
         "policies.ntp: the repair pause scales to 8e+09 s"),
        # Every switch is charged: a fault's pause is its switches', summed.
        (_mutate("policies.spares.faults[0].pause_s", 3.5), "policies.spares.faults[0].pause_s: "
         "must be the sum of its switches' pauses, 6, got 3.5"),
        (_mutate("policies.spares.faults[0].switches[1]", ...), "policies.spares.faults[0]."
         "switches: must be one per layout after the first: 2, got 1"),
        (_mutate("policies.ntp.faults[0].switches[0].changes", ["shuffle"]), "policies.ntp."
         "faults[0].switches[0].changes[0]: must be one of drop, reshard, join, restart, each "
         "once, got 'shuffle'"),
        (_mutate("policies.ntp.faults[0].switches[0].changes", ["join", "join"]), "policies.ntp."
         "faults[0].switches[0].changes[1]: must be one of drop, reshard, join, restart, each "
         "once, got 'join'"),
        (_mutate("policies.ntp.faults[0].layouts[1]", [3, 2]), "policies.ntp.faults[0]."
         "layouts[1][0]: must be an integer in 1..2 (job.tp), got 3"),
        (_mutate("policies.ntp.faults[0].layouts[1]", [2, 2, 2]), "policies.ntp.faults[0]."
         "layouts[1]: must list the TP degree of 1 to 2 (job.dp) replicas, got [2, 2, 2]"),
        (_mutate("policies.ntp.faults[0].reduced_s", ...), "policies.ntp.faults[0].reduced_s: "
         "is missing"),
        # 2 GPUs a node: one node cannot hold the bench's 4 GPUs (two nodes just can: the sample)
        pytest.param(_mutate("job.nodes", 1), "job.nodes: 1 nodes of 2 GPUs cannot hold 4 GPUs",
                     marks=pytest.mark.hardening, id="nodes-cannot-hold-the-job"),
        pytest.param(_mutate("policies", {}), "policies: is empty: a pauses file measures at "
                     "least one policy", marks=pytest.mark.hardening, id="no-policy"),
        pytest.param('{"format": "tessera.recovery/v2", "job": ' + "[" * 100_000 + "]" * 100_000
                     + "}", "job[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: nested deeper than "
                     "16 levels", marks=pytest.mark.hardening, id="nested-too-deep"),
        pytest.param(json.dumps(_mutate("job.gpus", 7)).replace('"gpus": 7', '"gpus": '
                                                                + "9" * 5000),
                     "job.gpus: must be an integer >= 1, got an integer of 5000 digits",
                     marks=pytest.mark.hardening, id="integer-too-long"),
    ],
)  # fmt: skip
def test_a_malformed_pauses_file_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys, content: Any, message: str
) -> None:
    path = tmp_path / "bench.json"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(json.dumps(content))
    out = tmp_path / "never"
    assert tessera(["simulate", *SMALL, "--pauses", str(path), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"--pauses {path}: {message}" in lines[0]
    assert not out.exists()


def test_nan_in_a_pauses_file_is_refused(tmp_path: Path, capsys) -> None:
    # Python's JSON reader takes NaN, which passes no comparison: it must still be refused.
    path = tmp_path / "bench.json"
    path.write_text(SAMPLE.read_text().replace('"pause_s": 4.2', '"pause_s": NaN'))
    assert tessera(["simulate", *SMALL, "--pauses", str(path), "--out", str(tmp_path / "x")]) == 2
    assert (
        "policies.ntp.faults[0].pause_s: must be a number >= 0, got nan" in capsys.readouterr().err
    )


def test_the_command_writes_both_goodputs_into_study_json(tmp_path: Path) -> None:
    out = tmp_path / "study"
    run = subprocess.run(
        [str(TESSERA_DEV), "simulate", *SMALL, "--pauses", str(SAMPLE), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "Goodput with the measured pauses" in run.stdout
    doc = json.loads((out / "study.json").read_text())
    section = doc["measured_pauses"]
    assert section["bench_job"] == sample()["job"]
    rows = {r["policy"]: r for r in section["goodput"]}
    assert list(rows) == list(POLICY_NAMES)
    assert {r["policy"]: r["goodput_mean"] for r in doc["goodput"]} == {
        name: r["goodput_mean_assumed"] for name, r in rows.items()
    }
    for name in sample()["policies"]:
        assert rows[name]["pauses"] == "measured"
        assert 0.0 < rows[name]["goodput_mean_measured"] <= 1.0
    # The pauses charged are the scaled ones: on the 1,024-GPU TP8 x PP4 job (128 nodes against
    # the bench's 2, R = 8 / 2), ntp's repair (a reshard) is its 1.1 s bench pause times R plus
    # a whole 12-byte-per-parameter shard over 50 GB/s scale-out; a cordon moves a seventh of a
    # shard.
    shard = model_parameters(SimConfig()) / 32 * 12
    assert rows["ntp"]["repair_stall_s"] == pytest.approx(1.1 * 4 + shard / 50e9, rel=1e-12)
    assert rows["tessera"]["failure_stall_s"] == rows["tessera"]["failure_stall_s_assumed"] == 60
    scaled = {f["kind"]: f["scaled_pause_s"] for f in section["faults"]["ntp"]}
    assert scaled["gpu-cordoned"] == pytest.approx(0.9 * 4 + shard / 7 / 50e9, rel=1e-12)
    assert section["faults"]["spares"][0]["layouts"] == [[2, 2], [2], [2, 2]]
    factors = section["factors"]
    assert (factors["restart"], factors["bench_nodes"], factors["sim_nodes"]) == (4.0, 2, 128)
    assert factors["shard_bytes"] == pytest.approx(shard, rel=1e-12)
    assert factors["transfer_s"]["restart"]["failure"] == pytest.approx(shard / 2e9)
    assert factors["model"] == {"gpus_per_node": 8, "bytes_per_parameter": 12.0,
                                "storage_gbps": 2.0, "scale_out_gbps": 50.0}  # fmt: skip
    assert (out / "goodput_measured_pauses.csv").read_text().startswith("policy,pauses,")


def test_without_pauses_the_study_is_unchanged(tmp_path: Path, capsys) -> None:
    assert tessera(["simulate", *SMALL, "--json", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "measured_pauses" not in doc
    assert not (tmp_path / "goodput_measured_pauses.csv").exists()
