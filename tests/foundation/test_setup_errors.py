"""A missing setup step is reported plainly: fixtures without servers, a package off its tree."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_dev import paths

pytestmark = pytest.mark.foundation

HERE = Path(__file__).resolve().parent


def test_fixtures_without_servers_fail_at_once_naming_the_setup_step(tmp_path):
    """No skip that would hide a broken CI, and no build that pytest-timeout would cut short."""
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_BIN_DIR"}
    env.update(TESSERA_CACHE=str(tmp_path / "empty-cache"), PATH=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{HERE}/test_controlplane.py::test_kubectl_talks_to_the_server_as_admin",
         f"{HERE}/test_prometheus_fixture.py::test_bad_promql_reports_prometheus_error"],
        env=env, capture_output=True, text=True, timeout=120, cwd=paths.repo_root())
    assert run.returncode == 1, run.stdout
    assert "2 errors" in run.stdout
    assert "run `make setup` (or `tessera-dev build-controlplane`) first" in run.stdout
    assert "the prometheus binary is not on PATH: run `make setup`" in run.stdout
    assert not (tmp_path / "empty-cache").exists()  # nothing started building


def test_repo_root_outside_a_checkout_says_how_to_install(tmp_path):
    """A non-editable install has no manifests/ next to the package: say so, naming the fix."""
    copy = tmp_path / "site-packages" / "tessera_dev" / "paths.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(paths.__file__, copy)
    spec = importlib.util.spec_from_file_location("installed_paths", copy)
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    with pytest.raises(FileNotFoundError,
                       match=r"no manifests/ folder .*\(pip install -e \. in the"):
        installed.repo_root()
    assert (paths.repo_root() / "manifests" / "install" / "kustomization.yaml").is_file()
