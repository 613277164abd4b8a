"""The installed `tessera` console script: help, and `up`/`down` of a detached control plane."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tessera_dev import processes
from tessera_dev.controlplane import crds, launcher

pytestmark = pytest.mark.foundation

BIN = Path(sys.executable).parent
TESSERA, TESSERA_DEV = BIN / "tessera", BIN / "tessera-dev"


def run(command: Path, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(command), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def tessera(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The development command (`tessera-dev`), which most of these tests drive."""
    return run(TESSERA_DEV, *args, env=env)


@pytest.mark.parametrize(("command", "listed", "absent"), [
    (TESSERA, ("operator", "power-agent", "health-agent", "cordon-gpu", "uncordon-gpu",
               "prepare-data", "import-hf", "export-hf"),
     ("up", "demo", "simulate", "bench")),
    (TESSERA_DEV, ("build-controlplane", "up", "down", "sim-node", "fail-gpu", "restore-gpu",
                   "fail-node", "demo", "simulate", "bench"), ("operator", "cordon-gpu")),
])
def test_each_command_lists_its_own_subcommands(command, listed, absent):
    """Production verbs on `tessera`, the local cluster's and the benches' on `tessera-dev`."""
    shown = run(command, "--help")
    assert shown.returncode == 0, shown.stderr
    for name in listed:
        assert re.search(rf"^\s+{name}\s", shown.stdout, re.M), name
    for name in absent:
        assert not re.search(rf"^\s+{name}\s", shown.stdout, re.M), name


@pytest.mark.parametrize("command", [TESSERA, TESSERA_DEV])
def test_version_is_the_installed_distribution(command):
    shown = run(command, "--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"{command.name} {metadata.version('tessera')}"


@pytest.mark.parametrize("command", [TESSERA, TESSERA_DEV])
def test_unknown_subcommand_fails_with_usage(command):
    shown = run(command, "frobnicate")
    assert shown.returncode == 2
    assert "unknown command 'frobnicate'" in shown.stderr and "usage:" in shown.stderr


def test_bench_names_its_benchmarks_and_refuses_unknown_ones():
    shown = tessera("bench", "--help")
    names = "{ntp,sim,operator,training,recovery}"
    assert shown.returncode == 0 and names in shown.stdout, shown.stderr
    wrong = tessera("bench", "frobnicate")
    assert wrong.returncode == 2
    assert "unknown benchmark 'frobnicate'" in wrong.stderr


@pytest.fixture
def state_env(tmp_path) -> Iterator[dict[str, str]]:
    """An environment whose `tessera-dev up` state lives in tmp_path; `down` runs at the end."""
    env = dict(os.environ, TESSERA_STATE_DIR=str(tmp_path))
    yield env
    tessera("down", env=env)


def test_up_is_idempotent_and_down_stops_everything(state_env, tmp_path):
    state = tmp_path / "controlplane"
    first = tessera("up", env=state_env)
    assert first.returncode == 0, first.stderr
    export = first.stdout.strip().splitlines()[-1]
    kubeconfig = export.removeprefix("export KUBECONFIG=")
    crd = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "crd", "-o", "name"],
                         capture_output=True, text=True, timeout=60)
    expected = {f"customresourcedefinition.apiextensions.k8s.io/{doc['metadata']['name']}"
                for doc in crds.load()}
    assert set(crd.stdout.split()) == expected

    second = tessera("up", env=state_env)
    assert second.returncode == 0, second.stderr
    assert "already running" in second.stderr
    assert second.stdout.strip().splitlines()[-1] == export

    pids = launcher.ControlPlane.load(state).pids
    # a running apiserver that stops answering (a loaded machine) is waited on, never wiped
    os.kill(pids["kube-apiserver"], signal.SIGSTOP)
    try:
        stuck = tessera("up", "--ready-timeout", "2", env=state_env)
    finally:
        os.kill(pids["kube-apiserver"], signal.SIGCONT)
    assert stuck.returncode == 1
    assert "left it untouched" in stuck.stderr
    assert all(processes.runs(pid, name) for name, pid in pids.items())
    assert (state / "etcd").is_dir() and launcher.ControlPlane.load(state).pids == pids

    # and one that answers again within the wait is reused as it is
    os.kill(pids["kube-apiserver"], signal.SIGSTOP)
    slow = subprocess.Popen([str(TESSERA_DEV), "up"], env=state_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    said = []
    for line in slow.stderr:  # resumed only once `up` says it is waiting for the server
        said.append(line)
        if "does not answer; waiting" in line:
            break
    os.kill(pids["kube-apiserver"], signal.SIGCONT)
    out, rest = slow.communicate(timeout=60)
    err = "".join(said) + rest
    assert slow.returncode == 0, err
    assert "already running" in err and out.strip().splitlines()[-1] == export

    down = tessera("down", env=state_env)
    assert down.returncode == 0, down.stderr
    assert not any(processes.is_alive(pid) for pid in pids.values())
    assert not state.exists()


@pytest.mark.parametrize("command", ["up", "down"])
def test_a_data_dir_that_is_not_a_control_plane_is_refused(command, tmp_path):
    precious = tmp_path / "thesis.tex"
    precious.write_text("years of work")
    shown = tessera(command, "--data-dir", str(tmp_path))
    assert shown.returncode == 1
    assert "refusing" in shown.stderr and "Traceback" not in shown.stderr
    assert precious.read_text() == "years of work"


def test_down_clears_a_control_plane_that_never_finished_starting(tmp_path):
    state = tmp_path / "controlplane"
    state.mkdir()
    (state / launcher.MARKER).touch()  # what start() writes before anything else
    (state / "etcd.log").write_text("etcd: killed during startup")
    shown = tessera("down", "--data-dir", str(state))
    assert shown.returncode == 0, shown.stderr
    assert not state.exists()


def test_without_go_the_build_says_what_to_install(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), TESSERA_CACHE=str(tmp_path / "cache"))
    shown = tessera("build-controlplane", env=env)
    assert shown.returncode == 1
    assert "Go >= 1.26 is required to build the control plane" in shown.stderr
    assert "TESSERA_BIN_DIR" in shown.stderr
    # no release can build without Go: one clear error, no fall back through older releases
    assert "earlier minor" not in shown.stdout + shown.stderr
    assert "Traceback" not in shown.stderr
