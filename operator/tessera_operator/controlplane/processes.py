"""Child processes of the local stack: free ports, spawning, readiness waits, group kills."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


class StartupError(RuntimeError):
    """A local server did not become ready; the message carries the tail of its log."""


def work_dir(given: Path | None, prefix: str) -> tuple[Path, bool]:
    """The directory to run in: the given one, or a fresh temporary one the caller then owns."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix=prefix)), True
    given.mkdir(parents=True, exist_ok=True)
    return given, False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start argv in its own session (so it outlives us and dies as a group), logging to a file."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {log_path})"
    return "\n".join(text.splitlines()[-lines:])


def is_alive(proc: subprocess.Popen | int) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    try:
        os.kill(proc, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def runs(pid: int, program: str) -> bool:
    """Whether process pid is running an executable named program (Linux /proc)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == program


def wait_until(
    ready: Callable[[], bool], *, what: str, proc: subprocess.Popen, log_path: Path,
    timeout: float,
) -> None:
    """Poll `ready` until it holds; fail early, with the log tail, if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not is_alive(proc):
            raise StartupError(
                f"{what} exited with code {proc.returncode} before it was ready; "
                f"last lines of {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.1)
    raise StartupError(
        f"{what} not ready after {timeout:.0f} s; last lines of {log_path}:\n{log_tail(log_path)}"
    )


def stop_group(proc: subprocess.Popen | int, timeout: float = 10.0) -> None:
    """SIGTERM the process group a spawned process leads; SIGKILL it if it lingers."""
    pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not is_alive(proc):
                return
            time.sleep(0.05)
