"""One container run as local processes: start through the shim, stop with a grace period, probe.

The container's processes live in their own mount and PID namespaces under `unshare`, which the
kernel kills when the node's thread that started it ends (PR_SET_PDEATHSIG); `unshare
--kill-child` passes that on to the shim, and the shim's death ends the whole PID namespace. So a
killed node takes all of its containers' processes with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera_dev.simnode import shim
from tessera_dev.simnode.kube import now_rfc3339
from tessera_kube import lifetime


def unshare_binary() -> str:
    found = shutil.which("unshare")
    if found is None:
        raise RuntimeError("the unshare command is required (Debian package util-linux)")
    return found


@dataclass
class Process:
    """A started container: the `unshare` process we spawned and the shim's files."""

    popen: subprocess.Popen
    pidfile: Path
    errorfile: Path
    started_at: str
    started_mono: float
    exited: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, *, run_dir: Path, log: Path, argv: Sequence[str], env: Mapping[str, str],
              cwd: str, mounts: Sequence[Mapping[str, Any]], devices: Sequence[Path],
              hostname: str, wake: threading.Event) -> Process:
        """Start argv in a fresh container; `wake` is set when it exits."""
        run_dir.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        pidfile, errorfile, specfile = (run_dir / n for n in ("pid", "error", "spec.json"))
        for stale in (pidfile, errorfile):
            stale.unlink(missing_ok=True)
        specfile.write_text(json.dumps({
            "argv": list(argv), "cwd": cwd, "mounts": list(mounts),
            "devices": [str(d) for d in devices], "pidfile": str(pidfile),
            "errorfile": str(errorfile), "hostname": hostname}))
        command = [unshare_binary(), "--mount", "--propagation", "private", "--pid", "--uts",
                   "--fork",
                   "--kill-child=SIGKILL", "--", sys.executable, "-I", "-m", shim.__name__,
                   str(specfile)]
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                command, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lifetime.die_with_parent())
        proc = cls(popen, pidfile, errorfile, now_rfc3339(), time.monotonic())

        def reap() -> None:
            popen.wait()
            proc.exited.set()
            wake.set()
        threading.Thread(target=reap, name=f"reap-{popen.pid}", daemon=True).start()
        return proc

    @property
    def exit_code(self) -> int | None:
        code = self.popen.returncode if self.exited.is_set() else None
        return None if code is None else (128 - code if code < 0 else code)

    @property
    def start_error(self) -> str | None:
        """Why the command could not be executed, when that is why it exited."""
        with contextlib.suppress(FileNotFoundError):
            return self.errorfile.read_text()
        return None

    def shim_pid(self) -> int | None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int(self.pidfile.read_text())
        return None

    def signal(self, signum: int) -> None:
        """SIGTERM goes to the shim, which passes it to the command; SIGKILL ends it all."""
        pid = self.shim_pid()
        targets = [pid] if pid is not None and signum != signal.SIGKILL else \
            [p for p in (self.popen.pid, pid) if p is not None]
        if signum != signal.SIGKILL and pid is None:
            targets = [self.popen.pid]  # not started yet: nothing to be graceful with
            signum = signal.SIGKILL
        for target in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signum)


def stop_all(procs: Sequence[Process], grace_s: float) -> None:
    """SIGTERM every process, SIGKILL those still running after grace_s (the kubelet's order)."""
    running = [p for p in procs if not p.exited.is_set()]
    for proc in running:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        proc.exited.wait(max(0.0, deadline - time.monotonic()))
    for proc in running:
        if not proc.exited.is_set():
            proc.signal(signal.SIGKILL)
    for proc in running:
        proc.exited.wait()


# -- probes


def probe(spec: Mapping[str, Any], *, pod_ip: str, ports: Mapping[str, int],
          env: Mapping[str, str], shim_pid: int | None) -> bool:
    """Run one readiness or liveness probe (httpGet, tcpSocket or exec) once."""
    timeout = float(spec.get("timeoutSeconds", 1))
    if "httpGet" in spec:
        get = spec["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else ports[get["port"]]
        url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or pod_ip}:{port}" \
              f"{get.get('path', '/')}"
        request = urllib.request.Request(url, headers={
            h["name"]: h["value"] for h in get.get("httpHeaders") or []})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return 200 <= answer.status < 400
        except urllib.error.HTTPError as exc:
            return 200 <= exc.code < 400
        except OSError:
            return False
    if "tcpSocket" in spec:
        tcp = spec["tcpSocket"]
        port = tcp["port"] if isinstance(tcp["port"], int) else ports[tcp["port"]]
        try:
            socket.create_connection((tcp.get("host") or pod_ip, port), timeout=timeout).close()
        except OSError:
            return False
        return True
    if "exec" in spec:
        if shim_pid is None:
            return False
        # inside the container's mount namespace, so the command sees its volumes
        argv = ["nsenter", f"--target={shim_pid}", "--mount", "--", *spec["exec"]["command"]]
        try:
            return subprocess.run(argv, env=dict(env), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=timeout).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    raise ValueError(f"unsupported probe {sorted(spec)}")


@dataclass
class Prober:
    """One container's probe of one kind, with the kubelet's thresholds and periods."""

    spec: Mapping[str, Any]
    started: float
    healthy: bool
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0

    def __post_init__(self) -> None:
        self.next_at = self.started + float(self.spec.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> bool:
        """Count one result; returns whether the probe's verdict changed."""
        self.next_at = now + float(self.spec.get("periodSeconds", 10))
        before = self.healthy
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.healthy = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.healthy = False
        return before != self.healthy
