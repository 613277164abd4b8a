"""Process 1 of a simulated container: bind its volumes, run its command, pass signals on.

The node starts it as `unshare --mount --propagation private --pid --uts --fork --kill-child --
python -m tessera_dev.simnode.shim SPEC`: a mount namespace of its own makes the bind mounts
private to the container, a PID namespace makes the kernel kill every process of the container
when this one dies, a UTS namespace gives it the pod's host name (as a real pod has: two pods'
processes are then never the same host and PID). As PID 1 it would ignore SIGTERM without a
handler, so it forwards SIGTERM and SIGINT to the command (as tini or `docker --init` do) and
exits with the command's status.

SPEC is a JSON file: {"argv": [...], "cwd": "/", "mounts": [{"source", "target", "readOnly"}],
"devices": [paths the command holds open], "pidfile": path, "errorfile": path, "hostname": name}.
An argv that cannot be executed writes the reason to errorfile and exits 128.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

_MS_RDONLY = 0x1
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
START_ERROR_EXIT = 128


def _mount(libc: ctypes.CDLL, source: str | None, target: str, flags: int) -> None:
    if libc.mount(source and source.encode(), target.encode(), None, flags, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _bind(libc: ctypes.CDLL, source: Path, target: Path, read_only: bool) -> None:
    # a missing mount point is created, as the kubelet does (on the host filesystem)
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    _mount(libc, str(source), str(target), _MS_BIND | _MS_REC)
    if read_only:
        _mount(libc, None, str(target), _MS_BIND | _MS_REMOUNT | _MS_RDONLY)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    errorfile = Path(spec["errorfile"])
    # the host's /proc names this process by its host PID: the node signals that one
    Path(spec["pidfile"]).write_text(os.readlink("/proc/self"))
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        socket.sethostname(spec["hostname"])
        # parents before children, so a volume mounted inside another lands on top of it
        for mount in sorted(spec["mounts"], key=lambda m: len(Path(m["target"]).parts)):
            _bind(libc, Path(mount["source"]), Path(mount["target"]), mount["readOnly"])
        Path(spec["cwd"]).mkdir(parents=True, exist_ok=True)  # as runc does for workingDir
        devices = [os.open(path, os.O_RDWR) for path in spec["devices"]]
        child = subprocess.Popen(spec["argv"], cwd=spec["cwd"], pass_fds=devices)
    except OSError as exc:
        errorfile.write_text(f"failed to start container: {exc}")
        print(errorfile.read_text(), file=sys.stderr)
        return START_ERROR_EXIT
    for fd in devices:
        os.close(fd)  # only the command holds the GPUs: fail-gpu kills it, not this process

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
