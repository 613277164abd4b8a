"""Child processes of the local stack: free ports, spawning, readiness waits, group kills."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tessera_dev import probes
from tessera_kube import lifetime

T = TypeVar("T")

_PORT_TAKEN = re.compile(r"address already in use", re.I)


class StartupError(RuntimeError):
    """A local server did not become ready; the message carries the tail of its log."""


class PortTaken(StartupError):
    """A server exited because another program bound its port after we chose it."""


def work_dir(given: Path | None, prefix: str) -> tuple[Path, bool]:
    """The directory to run in: the given one, or a fresh temporary one the caller then owns."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix=prefix)), True
    given.mkdir(parents=True, exist_ok=True)
    return given, False


def free_ports(count: int) -> list[int]:
    """Distinct TCP ports on 127.0.0.1 that nothing listens on right now.

    Every socket stays bound until all are chosen, so the picks cannot collide with each other.
    Another program may still take one before our server binds it: see `with_free_ports`.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def with_free_ports(count: int, launch: Callable[[list[int]], T], attempts: int = 2) -> T:
    """Run `launch(ports)`, and again with fresh ports if a server found one of them taken."""
    for _ in range(attempts - 1):
        with contextlib.suppress(PortTaken):
            return launch(free_ports(count))
    return launch(free_ports(count))


def spawn(argv: list[str], log_path: Path, *, die_with_parent: bool) -> subprocess.Popen:
    """Start argv in its own session (so it dies as a group), logging to a file.

    With die_with_parent the kernel SIGKILLs it when the spawning thread ends, so a killed test
    run leaves no servers behind; without, it outlives us (`tessera-dev up`).
    """
    preexec = lifetime.die_with_parent() if die_with_parent else None
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec,
        )


def log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {log_path})"
    return "\n".join(text.splitlines()[-lines:])


def is_alive(proc: subprocess.Popen | int) -> bool:
    """Whether the process runs. A zombie does not: a detached server's parent is gone, and it
    stays a zombie until init reaps it, which may take seconds."""
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    try:
        stat = Path(f"/proc/{proc}/stat").read_text()
    except OSError:
        return False
    # the state follows the command name, which is in parentheses and may contain any character
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] not in ("Z", "X")


def runs(pid: int, program: str) -> bool:
    """Whether process pid is running an executable named program (Linux /proc).

    False for a zombie too: its command line is empty.
    """
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == program


def command_line(pid: int) -> str:
    """Process pid's arguments joined by NUL ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def runs_command(pid: int, word: str) -> bool:
    """Whether process pid's command line (arguments joined by NUL) contains `word`: a pid
    recorded earlier may have been reused by another program since."""
    cmdline = command_line(pid)
    return bool(cmdline) and word in cmdline + "\0"


def wait_until(
    ready: Callable[[], bool], *, what: str, proc: subprocess.Popen, log_path: Path,
    timeout: float,
) -> None:
    """Poll `ready` until it holds; fail early, with the log tail, if the process exits.

    Raises PortTaken when the process exited because its port was in use, so the caller can
    retry with fresh ports.
    """
    def probe() -> bool:
        if ready():
            return True
        if is_alive(proc):
            return False
        tail = log_tail(log_path)
        error = PortTaken if _PORT_TAKEN.search(tail) else StartupError
        raise error(f"{what} exited with code {proc.returncode} before it was ready; "
                    f"last lines of {log_path}:\n{tail}")

    probes.poll_until(probe, timeout=timeout, error=lambda _: StartupError(
        f"{what} not ready after {timeout:.0f} s; last lines of {log_path}:\n{log_tail(log_path)}"))


def stop_group(proc: subprocess.Popen | int, timeout: float = 10.0) -> None:
    """SIGTERM the process group a spawned process leads; SIGKILL it if it lingers. A stopped
    group (a node `tessera-dev fail-node --freeze` froze) gets SIGCONT after the SIGTERM, as a
    shell's `kill` gives a stopped job, so that it handles the SIGTERM now."""
    pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        with contextlib.suppress(TimeoutError):
            probes.poll_until(lambda: not is_alive(proc), timeout=timeout, interval=0.05,
                              error=lambda _: TimeoutError())
            return
