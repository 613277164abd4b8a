"""Building the control plane: a failing go command reports what went wrong, not just a status."""

from __future__ import annotations

import os

import pytest

from tessera_dev.controlplane import build

pytestmark = pytest.mark.foundation


def test_a_failed_go_command_keeps_its_errors_in_the_exception(tmp_path):
    (tmp_path / "go.mod").write_text("module example.com/broken\n\ngo 1.26\n")
    (tmp_path / "main.go").write_text(
        'package main\n\nimport "example.com/nowhere/gone"\n\nfunc main() { gone.Run() }\n')
    env = dict(os.environ, GOFLAGS="-mod=mod", GOPROXY="off", GOTOOLCHAIN="local",
               GOCACHE=str(tmp_path / "gocache"), GOMODCACHE=str(tmp_path / "gomodcache"))
    logged: list[str] = []
    with pytest.raises(build.GoFailed) as err:
        build.run_go(["build", "."], tmp_path, env, logged.append)
    message = str(err.value)
    assert "`go build .` exited with status 1" in message
    # the missing module the user has to fix is named in the exception itself
    assert "example.com/nowhere/gone" in message and "GOPROXY=off" in message
    assert logged == [f"$ go build .  (in {tmp_path})"]
