"""Fault injection on simulated nodes: `tessera-dev fail-gpu` kills what holds the GPU within 1 s
and fails it as NVML sees it, `restore-gpu` brings it back, `fail-node` kills only the node process,
and every mistake gets one line and exit 1 (usage: exit 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nodeharness import exited_within

from tessera_agents.power.devices import GpuLost
from tessera_agents.power.sim_backend import SimBackend
from tessera_dev import cli
from tessera_dev.simnode.faults import device_file, node_dir

pytestmark = pytest.mark.cluster

NODE = "gpu-node-0"
W = 1000

# Opens the file named in argv[1] (and hands it to a child when argv[2] says so), prints its pid
# (and the child's), then blocks on stdin: it ends when the test closes its stdin or kills it.
HOLDER = """
import os, subprocess, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
pids = [os.getpid()]
if sys.argv[2] == "child":
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             pass_fds=[fd], stdin=subprocess.PIPE)
    pids.append(child.pid)
print(*pids, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A cluster data dir with one 4-GPU node as the node process lays it out."""
    directory = node_dir(tmp_path, NODE)
    SimBackend(4, NODE, state_path=directory / "gpus.json")
    for gpu in range(4):
        device_file(directory, gpu).parent.mkdir(parents=True, exist_ok=True)
        device_file(directory, gpu).touch()
    return tmp_path


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Factory for child processes, each ended at teardown if the test did not."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True))
        return procs[-1]

    yield start
    for proc in procs:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def _holder(spawn, path: Path, with_child: bool = False) -> tuple[subprocess.Popen, list[int]]:
    proc = spawn("-c", HOLDER, str(path), "child" if with_child else "alone")
    pids = [int(p) for p in proc.stdout.readline().split()]  # it holds the file from here on
    return proc, pids


def _tessera(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fail_gpu_kills_what_holds_the_gpu_within_a_second(data_dir, spawn, capsys) -> None:
    directory = node_dir(data_dir, NODE)
    holder, (pid, grandchild) = _holder(spawn, device_file(directory, 2), with_child=True)
    bystander, _ = _holder(spawn, device_file(directory, 3))
    start = time.monotonic()
    code, out, err = _tessera(capsys, "fail-gpu", NODE, "2", "--xid", "79",
                              "--data-dir", str(data_dir))
    # "the process using it dies at once": the bound is the behaviour
    holder.wait(timeout=max(0.0, 1.0 - (time.monotonic() - start)))
    assert exited_within(grandchild, 1.0 - (time.monotonic() - start))
    assert (code, err) == (0, "")
    assert holder.returncode == -signal.SIGKILL
    assert f"{pid} (python" in out and f"{grandchild} (python" in out and "XID 79" in out
    assert bystander.poll() is None  # a process on another GPU runs on

    gpus = SimBackend(state_path=directory / "gpus.json")
    with pytest.raises(GpuLost):
        gpus.read(2)
    snap = gpus.snapshot()[2]
    assert (snap.healthy, snap.last_xid) == (False, 79)
    assert gpus.read(3).limit_mw == 700 * W


def test_fail_gpu_finds_the_gpu_under_another_name(data_dir, spawn, capsys, tmp_path) -> None:
    # a container sees its GPU at a path of its own; the file is the same (device and inode)
    alias = tmp_path / "container-root" / "nvidia0"
    alias.parent.mkdir()
    os.link(device_file(node_dir(data_dir, NODE), 1), alias)
    holder, _ = _holder(spawn, alias)
    assert _tessera(capsys, "fail-gpu", NODE, "1", "--data-dir", str(data_dir))[0] == 0
    assert holder.wait(timeout=5) == -signal.SIGKILL


def test_restore_gpu_brings_it_back(data_dir, capsys) -> None:
    gpus = SimBackend(state_path=node_dir(data_dir, NODE) / "gpus.json")
    assert _tessera(capsys, "fail-gpu", NODE, "1", "--xid", "48",
                    "--data-dir", str(data_dir))[0] == 0
    assert gpus.snapshot()[1].last_xid == 48
    code, out, err = _tessera(capsys, "restore-gpu", NODE, "1", "--data-dir", str(data_dir))
    assert (code, err) == (0, "") and "restored" in out
    gpus.set_limit(1, 500 * W)  # NVML works again
    assert gpus.read(1).limit_mw == 500 * W
    snap = gpus.snapshot()[1]
    assert (snap.healthy, snap.last_xid, snap.xid_totals) == (True, 0, ((48, 1),))


def test_fail_node_kills_the_node_process_and_nothing_else(data_dir, spawn, capsys) -> None:
    pid_file = node_dir(data_dir, NODE) / "node.pid"
    block = "import sys; print(1, flush=True); sys.stdin.read()"
    other_node = spawn("-c", block, "sim-node", "gpu-node-1")
    stranger = spawn("-c", block, "gpu-node-0")  # the name, but not a node process
    node = spawn("-c", block, "sim-node", "--name", NODE)
    for proc in (other_node, stranger, node):
        proc.stdout.readline()

    for proc in (other_node, stranger):  # node.pid naming a pid now used by someone else
        pid_file.write_text(f"{proc.pid}\n")
        code, _, err = _tessera(capsys, "fail-node", NODE, "--data-dir", str(data_dir))
        assert code == 1 and "is not running" in err and err.count("\n") == 1
        assert proc.poll() is None

    pid_file.write_text(f"{node.pid}\n")
    code, out, err = _tessera(capsys, "fail-node", NODE, "--data-dir", str(data_dir))
    assert (code, err) == (0, "") and str(node.pid) in out
    assert node.wait(timeout=5) == -signal.SIGKILL
    assert other_node.poll() is None and stranger.poll() is None
    # the pid is gone now: a second call says so rather than killing anything
    code, _, err = _tessera(capsys, "fail-node", NODE, "--data-dir", str(data_dir))
    assert code == 1 and "is not running" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["fail-gpu", "gpu-node-9", "0"], "no simulated node 'gpu-node-9'"),
    (["fail-gpu", "../etc", "0"], "'../etc' is not a node name"),
    (["fail-gpu", "..", "0"], "'..' is not a node name"),
    (["fail-gpu", NODE, "4"], f"node '{NODE}' has GPUs 0-3, not 4"),
    (["fail-gpu", NODE, "-1"], f"node '{NODE}' has GPUs 0-3, not -1"),
    (["restore-gpu", NODE, "7"], f"node '{NODE}' has GPUs 0-3, not 7"),
    (["fail-gpu", NODE, "0", "--xid", "0"], "--xid must be a positive integer"),
    (["fail-gpu", NODE, "0", "--xid", "-79"], "--xid must be a positive integer"),
    (["fail-gpu", NODE, "0", "--xid", "XID79"], "--xid must be a positive integer"),
    (["fail-gpu", NODE, "0", "--xid", "99999999999"], "--xid must be a positive integer"),
    (["fail-node", NODE], "the node was never started here"),
])
def test_mistakes_get_one_line_and_exit_1(data_dir, capsys, argv, message) -> None:
    code, out, err = _tessera(capsys, *argv, "--data-dir", str(data_dir))
    assert (code, out) == (1, "")
    assert err.startswith(f"tessera {argv[0]}: ") and message in err
    assert err.count("\n") == 1
    # nothing changed
    assert all(s.healthy for s in SimBackend(
        state_path=node_dir(data_dir, NODE) / "gpus.json").snapshot())


@pytest.mark.parametrize(("state", "pid", "message"), [
    (None, None, "has no GPU state"),
    ("{not json", None, "cannot read the GPU state"),
    ('{"gpus": 3}', None, "cannot read the GPU state"),
    ("[]", None, "cannot read the GPU state"),
    ('{"node": "x", "gpus": [], "rejected": []}', "no pid", "cannot read the node's pid"),
])
def test_missing_or_broken_state_gets_one_line(tmp_path, capsys, state, pid, message) -> None:
    directory = node_dir(tmp_path, NODE)
    directory.mkdir(parents=True)
    if state is not None:
        (directory / "gpus.json").write_text(state)
    if pid is not None:
        (directory / "node.pid").write_text(pid)
    command = ["fail-node", NODE] if pid is not None else ["fail-gpu", NODE, "0"]
    code, _, err = _tessera(capsys, *command, "--data-dir", str(tmp_path))
    assert code == 1 and message in err and err.count("\n") == 1


def test_usage_errors_exit_2_through_the_tessera_command(data_dir) -> None:
    run = [sys.executable, "-m", "tessera_dev.cli"]
    for argv in (["fail-gpu", NODE], ["fail-gpu", NODE, "two"], ["restore-gpu"], ["fail-node"]):
        done = subprocess.run([*run, *argv, "--data-dir", str(data_dir)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, argv
        assert "usage: tessera " in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([*run, "fail-gpu", NODE, "0", "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert "failed with XID 79" in done.stdout
