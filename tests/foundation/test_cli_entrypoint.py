"""The installed `tessera` console script: help, and `up`/`down` of a detached control plane."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tessera_operator.controlplane import crds, launcher, processes

pytestmark = pytest.mark.foundation

TESSERA = Path(sys.executable).parent / "tessera"


def tessera(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TESSERA), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_help_lists_the_subcommands():
    shown = tessera("--help")
    assert shown.returncode == 0, shown.stderr
    for command in ("up", "down", "demo", "simulate", "bench"):
        assert re.search(rf"^\s+{command}\s", shown.stdout, re.M), command


def test_unknown_subcommand_fails_with_usage():
    shown = tessera("frobnicate")
    assert shown.returncode == 2
    assert "unknown command 'frobnicate'" in shown.stderr


@pytest.fixture
def state_env(tmp_path) -> Iterator[dict[str, str]]:
    """An environment whose `tessera up` state lives in tmp_path; `down` runs whatever happens."""
    env = dict(os.environ, TESSERA_STATE_DIR=str(tmp_path))
    yield env
    tessera("down", env=env)


def test_up_is_idempotent_and_down_stops_everything(state_env, tmp_path):
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

    pids = launcher.ControlPlane.load(tmp_path / "controlplane").pids.values()
    down = tessera("down", env=state_env)
    assert down.returncode == 0, down.stderr
    assert not any(processes.is_alive(pid) for pid in pids)
    assert not (tmp_path / "controlplane").exists()
