"""Fault injection on the local cluster's simulated nodes: `tessera-dev fail-gpu`, `restore-gpu`,
`fail-node`.

A node's state lives in NODE_DIR = <data dir>/nodes/<node>/: `gpus.json` (its GPUs, shared with
the node process and its power agent through `SimBackend`), `dev/nvidia<i>` (one file per GPU,
held open by every process using that GPU, as /dev/nvidia<i> is on a real node) and `node.pid`.

- `fail-gpu NODE GPU [--xid 79]` marks the GPU failed with that XID (the exporter shows it, NVML
  calls on it fail), then SIGKILLs every process holding its device file open, as a GPU falling
  off the bus takes its CUDA processes down with it. With `--dra-taint [EFFECT]` only the node's
  DRA driver reacts instead: it taints the device in its ResourceSlice (`gpu.nvidia.com/xid=XID`,
  NoSchedule by default, as NVIDIA's driver does; driver.py), the GPU itself untouched.
- `restore-gpu NODE GPU` brings it back: health ok, the last-XID gauge back to 0, NVML working,
  no device taint.
- `fail-node NODE` SIGKILLs the node process (its pods die with it, and its heartbeat stops), but
  only while node.pid still names a `sim-node` process for NODE: a reused pid is never killed.
  With `--freeze` it SIGSTOPs the node process and every process it started (its pods'), as a
  node that hangs whole or drops off the network: nothing dies, no connection closes, nobody
  reports anything; `--thaw` SIGCONTs them all again. The cluster's stop kills a frozen node
  (SIGKILL ends stopped processes too).

Errors (unknown node, GPU out of range, bad XID, missing or unreadable state) print one line and
exit 1; usage errors exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tessera_agents.power.devices import PowerError
from tessera_agents.power.sim_backend import MAX_XID, SimBackend
from tessera_dev import paths
from tessera_dev.simnode import dra
from tessera_dev.simnode.driver import set_taint

GPU_STATE = "gpus.json"
NODE_PID = "node.pid"
NODE_COMMAND = "sim-node"  # the `tessera` subcommand that runs a node process
# How long a command waits for a SIGKILLed process to be gone before saying it is not.
EXIT_WAIT_S = 5.0


class FaultError(Exception):
    """A fault that cannot be injected; the message is the one line the user sees."""


def node_dir(data_dir: Path, node: str) -> Path:
    """NODE_DIR of `node` in the cluster whose data dir is `data_dir`."""
    return data_dir / "nodes" / node


def device_file(directory: Path, gpu: int) -> Path:
    """The file a process using GPU `gpu` of the node in `directory` keeps open."""
    return directory / "dev" / f"nvidia{gpu}"


def fail_gpu(argv: list[str]) -> int:
    """`tessera-dev fail-gpu NODE GPU [--xid 79] [--dra-taint [EFFECT]] [--data-dir D]`."""
    parser = _parser("fail-gpu", "make a simulated GPU fail as hardware does: the exporter "
                     "shows the XID, NVML calls on it fail, the processes using it die at once")
    parser.add_argument("gpu", metavar="GPU", type=int, help="GPU index on the node")
    parser.add_argument("--xid", default="79",
                        help="the XID the GPU reports (default 79: fallen off the bus)")
    parser.add_argument("--dra-taint", nargs="?", const="NoSchedule", choices=dra.EFFECTS,
                        metavar="EFFECT",
                        help="instead, only the node's DRA driver reacts to the XID: it taints "
                             f"the device in its ResourceSlice ({dra.XID_TAINT}=XID) with "
                             "EFFECT (None, NoSchedule (the default, as NVIDIA's driver does for "
                             "a fatal XID) or NoExecute); the GPU and its processes are left as "
                             "they are")
    args = parser.parse_args(argv)
    try:
        xid = _xid(args.xid)
        directory, gpus = _gpus(args)
        _check_index(gpus, args.node, args.gpu)
        if args.dra_taint is not None:
            set_taint(directory, args.gpu, dra.Taint(str(xid), args.dra_taint))
            print(f"{args.node} GPU {args.gpu}: device {dra.device_name(args.gpu)} tainted "
                  f"{dra.XID_TAINT}={xid}:{args.dra_taint} by the node's DRA driver")
            return 0
        gpus.fail(args.gpu, xid)
        killed = kill_holders(device_file(directory, args.gpu))
    except FaultError as exc:
        return _error("fail-gpu", exc)
    held = ", ".join(f"{pid} ({name})" for pid, name in killed) or "none"
    print(f"{args.node} GPU {args.gpu}: failed with XID {xid}; "
          f"killed the processes holding it: {held}")
    return 0


def restore_gpu(argv: list[str]) -> int:
    """`tessera-dev restore-gpu NODE GPU [--data-dir D]`."""
    parser = _parser("restore-gpu", "bring a failed simulated GPU back: health ok, XID cleared, "
                     "NVML calls work again, its DRA device taint removed")
    parser.add_argument("gpu", metavar="GPU", type=int, help="GPU index on the node")
    args = parser.parse_args(argv)
    try:
        directory, gpus = _gpus(args)
        _check_index(gpus, args.node, args.gpu)
        gpus.restore(args.gpu)
        set_taint(directory, args.gpu, None)
    except FaultError as exc:
        return _error("restore-gpu", exc)
    print(f"{args.node} GPU {args.gpu}: restored (health ok, last XID 0, no device taint)")
    return 0


def fail_node(argv: list[str]) -> int:
    """`tessera-dev fail-node NODE [--freeze] [--data-dir D]`."""
    parser = _parser("fail-node", "stop a simulated node at once (SIGKILL): its pods die with "
                     "it and its heartbeat stops, so the cluster marks it NotReady")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--freeze", action="store_true",
                     help="SIGSTOP the node and its pods' processes instead: a node that "
                          "hangs whole, where nothing dies and no connection closes")
    how.add_argument("--thaw", action="store_true",
                     help="SIGCONT a frozen node and its pods' processes")
    args = parser.parse_args(argv)
    signum = signal.SIGSTOP if args.freeze else signal.SIGCONT if args.thaw else None
    try:
        directory = _node(args)
        pid = _node_pid(directory / NODE_PID)
        # The pidfd pins the process: once the check passes, the signal cannot reach another
        # process that inherited the pid.
        with _pidfd(pid) as pidfd:
            if pidfd is None or not is_node_process(pid, args.node):
                raise FaultError(f"node {args.node!r} is not running (pid {pid} in "
                                 f"{directory / NODE_PID} is not its node process)")
            if signum is not None:
                signalled = signal_tree(pid, pidfd, signum)
            else:
                gone = _kill([(pid, pidfd)])
    except FaultError as exc:
        return _error("fail-node", exc)
    if signum is not None:
        print(f"{args.node}: {'froze' if args.freeze else 'thawed'} node process {pid} and "
              f"{len(signalled) - 1} process(es) it started")
        return 0
    print(f"{args.node}: killed node process {pid}" + ("" if gone else
          f" (still exiting after {EXIT_WAIT_S:.0f} s)"))
    return 0


def signal_tree(pid: int, pidfd: int, signum: int, proc: Path = Path("/proc")) -> set[int]:
    """Send `signum` to `pid` (pinned by `pidfd`) and all its descendants; the pids signalled.

    The root goes first, then each newly found child, until a pass finds none: under SIGSTOP a
    stopped process starts nothing, so the tree stops growing. A child is signalled through a
    pidfd checked to be its parent's child still, so a reused pid is never reached.
    """
    signal.pidfd_send_signal(pidfd, signum)
    signalled = {pid}
    while True:
        found = [(child, parent) for child, parent in _parents(proc)
                 if parent in signalled and child not in signalled]
        if not found:
            return signalled
        for child, parent in found:
            signalled.add(child)
            with _pidfd(child) as fd:
                if fd is None or _parent(proc / str(child)) != parent:
                    continue  # exited meanwhile
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signum)


def _parents(proc: Path) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process."""
    found = []
    for pid in _pids(proc):
        parent = _parent(proc / str(pid))
        if parent is not None:
            found.append((pid, parent))
    return found


def _parent(process: Path) -> int | None:
    try:
        stat = (process / "stat").read_text()
    except OSError:  # exited meanwhile
        return None
    # the command name (2nd field) is in parentheses and may hold spaces or ')'
    return int(stat[stat.rindex(")") + 2:].split()[1])


def kill_holders(path: Path, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """SIGKILL every process with `path` open (as `fuser -k` does) and wait until they are gone;
    returns (pid, name) of each."""
    with contextlib.ExitStack() as stack:
        targets = []
        for pid in holders(path, proc):
            pidfd = stack.enter_context(_pidfd(pid))
            if pidfd is not None:  # None: it exited meanwhile, which is what we wanted
                targets.append((pid, pidfd, _comm(proc / str(pid))))
        _kill([(pid, pidfd) for pid, pidfd, _ in targets])
    return [(pid, name) for pid, _, name in targets]


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    """A pidfd for `pid`, None if no such process."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _kill(targets: list[tuple[int, int]]) -> bool:
    """SIGKILL each (pid, pidfd) and wait up to EXIT_WAIT_S for all to exit; False if some have
    not (a process stuck in the kernel dies when it leaves it)."""
    poll = select.poll()
    for _, pidfd in targets:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        poll.register(pidfd, select.POLLIN)
    pending = {pidfd for _, pidfd in targets}
    deadline = time.monotonic() + EXIT_WAIT_S
    while pending and (left := deadline - time.monotonic()) > 0:
        for pidfd, _ in poll.poll(left * 1000):  # a pidfd turns readable when its process exits
            pending.discard(pidfd)
            poll.unregister(pidfd)
    return not pending


def holders(path: Path, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes (other than this one) with `path` open, found through proc/*/fd.

    Open files are matched by device and inode, as `fuser` does, not by the name the link shows:
    a container process in a mount namespace of its own may see the file under another path.
    """
    try:
        target = _identity(path)
    except FileNotFoundError:  # no device file: nothing can hold it
        return []
    me = os.getpid()
    return [pid for pid in _pids(proc)
            if pid != me and target in _open_files(proc / str(pid))]


def is_node_process(pid: int, node: str, proc: Path = Path("/proc")) -> bool:
    """Whether `pid` runs `tessera-dev sim-node` for `node`: its command line holds the subcommand
    and the node name as arguments (`NODE`, or `--name NODE` / `--name=NODE` forms)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    args = raw.decode(errors="replace").split("\0")
    names = {arg.partition("=")[2] if arg.startswith("--") else arg for arg in args}
    return NODE_COMMAND in args and node in names


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"tessera {command}", description=description)
    parser.add_argument("node", metavar="NODE", help="simulated node name")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help=f"the cluster's data dir (default {paths.default_data_dir()})")
    return parser


def _node(args: argparse.Namespace) -> Path:
    data_dir = args.data_dir or paths.default_data_dir()
    # the name becomes a path: a separator or a dot name must not walk out of nodes/
    if not args.node or "/" in args.node or args.node in (".", "..") or "\0" in args.node:
        raise FaultError(f"{args.node!r} is not a node name")
    directory = node_dir(data_dir, args.node)
    if not directory.is_dir():
        known = sorted(p.name for p in (data_dir / "nodes").glob("*") if p.is_dir())
        raise FaultError(f"no simulated node {args.node!r} in {data_dir} (nodes: "
                         f"{', '.join(known) or 'none; is the cluster up?'})")
    return directory


def _gpus(args: argparse.Namespace) -> tuple[Path, SimBackend]:
    directory = _node(args)
    state = directory / GPU_STATE
    if not state.is_file():
        raise FaultError(f"node {args.node!r} has no GPU state ({state} is missing)")
    try:
        return directory, SimBackend(state_path=state)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise FaultError(f"cannot read the GPU state {state}: {exc}") from None


def _check_index(gpus: SimBackend, node: str, gpu: int) -> None:
    try:
        count = len(gpus.snapshot())
    except (PowerError, ValueError, KeyError, TypeError) as exc:
        raise FaultError(f"cannot read the GPU state of node {node!r}: {exc}") from None
    if not 0 <= gpu < count:
        raise FaultError(f"node {node!r} has GPUs 0-{count - 1}, not {gpu}")


def _xid(text: str) -> int:
    try:
        xid = int(text)
    except ValueError:
        xid = 0
    if not 0 < xid <= MAX_XID:
        raise FaultError(f"--xid must be a positive integer up to {MAX_XID}, got {text!r}")
    return xid


def _node_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except FileNotFoundError:
        raise FaultError(f"no {path}: the node was never started here") from None
    except (ValueError, OSError) as exc:
        raise FaultError(f"cannot read the node's pid from {path}: {exc}") from None


def _pids(proc: Path) -> Iterator[int]:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield int(entry.name)


def _identity(path: Path | str) -> tuple[int, int]:
    st = os.stat(path)  # through /proc/PID/fd/N: the open file itself
    return st.st_dev, st.st_ino


def _open_files(process: Path) -> set[tuple[int, int]]:
    """(device, inode) of every file `process` has open."""
    try:
        fds = list(os.scandir(process / "fd"))
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return set()
    found = set()
    for fd in fds:
        try:
            found.add(_identity(fd.path))
        except OSError:  # closed meanwhile, or not ours to read
            continue
    return found


def _comm(process: Path) -> str:
    try:
        return (process / "comm").read_text().strip()
    except OSError:
        return "?"


def _error(command: str, exc: FaultError) -> int:
    print(f"tessera {command}: {exc}", file=sys.stderr)
    return 1

