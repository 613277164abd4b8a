"""The README's first command: `tessera-dev demo --yes` runs end to end on a cluster of its own, and
what it shows the user holds: the figure and its data, the job reconfigured, a loss that falls
on the prepared corpus, queries that answer, a cluster that outlives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml

from tessera_dev import demo_data, paths
from tessera_dev.controlplane import cluster

pytestmark = pytest.mark.foundation

TESSERA = Path(sys.executable).with_name("tessera-dev")
JOB = "tiny-llama"
BASE_WATTS, BUDGET_WATTS = 500, 2200  # manifests/examples/ntpjob-local.yaml
EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-local.yaml").read_text())


def _query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
                                timeout=10) as response:
        return json.load(response)["data"]["result"]


def _printed_queries(out: str) -> tuple[str, list[str]]:
    """Prometheus' URL and the PromQL lines the demo prints for the user to paste."""
    _, _, rest = out.partition("PromQL: paste at ")
    assert rest, out[-3000:]
    url = rest.split("/graph", 1)[0]
    section = rest.split("\n", 1)[1].split("───", 1)[0]
    return url, [line for line in section.splitlines() if line and not line.startswith("#")]


def _unigram_entropy(dataset: Path) -> float:
    """The entropy (nats) of the dataset's token frequencies: the loss of a model that learned
    how often each token occurs and nothing of its context."""
    index = json.loads((dataset / "index.json").read_text())
    dtype = np.dtype(index["dtype"]).newbyteorder("<")  # docs/data.md: little-endian shards
    tokens = np.concatenate([np.fromfile(dataset / shard["file"], dtype=dtype)
                             for shard in index["shards"]])
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def test_demo_trains_reconfigures_and_leaves_a_figure(tmp_path: Path) -> None:
    env = {**os.environ, "TESSERA_STATE_DIR": str(tmp_path), "COLUMNS": "200"}
    figure = tmp_path / "demo" / "tessera-demo.png"
    try:
        demo = subprocess.run([str(TESSERA), "demo", "--yes"], env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)
        out = demo.stdout + demo.stderr
        assert demo.returncode == 0, out[-5000:]
        assert "Traceback" not in out
        assert f"figure: {figure}" in out

        # the figure: four panels' data over the demo, the faults marked
        assert matplotlib.image.imread(figure).ndim == 3
        data = json.loads(figure.with_suffix(".json").read_text())
        goodput, tp, power, loss = data["panels"].values()
        assert [e["label"] for e in data["events"]] == ["cordon-gpu gpu-node-0 3",
                                                       "fail-gpu gpu-node-1 2"]
        assert max(v for series in goodput.values() for _, v in series) > 0
        assert {name: {v for _, v in series} for name, series in tp.items()} == {
            "replica 0": {4.0, 3.0}, "replica 1": {4.0, 3.0}}
        cordoned = {v for _, v in power["gpu-node-0 GPU 3"]}
        survivor = [v for _, v in power["gpu-node-0 GPU 0"]]
        assert min(cordoned) == 200 and survivor[-1] > BASE_WATTS, power
        # the lost GPU cannot be cut: counted at its last limit (the base cap), it leaves its
        # three survivors the rest of the node's budget
        lost_node = [v for _, v in power["gpu-node-1 GPU 0"]]
        assert BASE_WATTS < lost_node[-1] <= (BUDGET_WATTS - BASE_WATTS) // 3, power
        # the loss, per node, on the corpus the demo prepared onto the job's claim: it starts
        # above what token frequencies alone give and falls below it (the last 5 scrapes' mean
        # of 256-token batches), so the model learned from context in the text it was given
        where = demo_data.data_claim(EXAMPLE)
        running = cluster.Cluster.load(tmp_path / "controlplane")
        assert running is not None
        frequencies = _unigram_entropy(running.shared_path(where.name, "default") / where.path)
        assert set(loss) == {"gpu-node-0", "gpu-node-1"}, loss.keys()
        for node, series in loss.items():
            values = [v for _, v in series]
            assert max(values) > frequencies > sum(values[-5:]) / 5, (node, frequencies, values)

        # the job reconfigured twice and trains on after the demo
        kubectl = ["kubectl", f"--kubeconfig={tmp_path / 'controlplane' / 'kubeconfig'}"]
        status = json.loads(subprocess.run([*kubectl, "get", "ntpjob", JOB, "-o", "json"],
                                           capture_output=True, text=True, timeout=60,
                                           check=True).stdout)["status"]
        assert (status["phase"], status["tpLayout"]) == ("Degraded", "3,3"), status
        assert status["layoutGeneration"] == 3, status

        # every query printed for the user answers with data
        url, queries = _printed_queries(out)
        assert len(queries) >= 5, queries
        empty = [q for q in queries if not _query(url, q)]
        assert not empty, empty
        assert any("TesseraGPULost" in q for q in queries)
        assert any("tessera_loss" in q for q in queries)
    finally:
        subprocess.run([str(TESSERA), "down"], env=env, capture_output=True, timeout=120)
    assert not (tmp_path / "controlplane").exists()


def test_demo_says_what_is_missing_without_a_traceback(tmp_path: Path) -> None:
    # a PATH with this environment's commands but no kubectl
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "TESSERA_STATE_DIR": str(tmp_path / "state"), "PATH": str(bin_dir)}
    demo = subprocess.run([str(TESSERA), "demo", "--yes"], env=env, capture_output=True,
                          text=True, timeout=120)
    out = demo.stdout + demo.stderr
    assert demo.returncode == 1, out
    assert "kubectl is not on the PATH" in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "state" / "controlplane").exists()
