"""`tessera up`: build if needed, start the local control plane detached and install the CRDs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from tessera_operator.controlplane import crds, launcher, probes

# how long a control plane whose servers run, but do not answer, gets before `up` gives up
READY_WAIT_S = 30.0


def _announce(console: Console, plane: launcher.ControlPlane) -> None:
    console.print(f"server:     {plane.server}\nkubeconfig: [bold]{plane.kubeconfig}[/]")
    # plain print on stdout so that `eval "$(tessera up | tail -1)"` works
    print(f"export KUBECONFIG={plane.kubeconfig}")


def _fail(console: Console, message: str) -> int:
    console.print(message, style="red", markup=False, highlight=False, soft_wrap=True)
    return 1


def _becomes_ready(console: Console, plane: launcher.ControlPlane, timeout: float) -> bool:
    with console.status(f"the control plane runs but does not answer; waiting up to "
                        f"{timeout:.0f} s"):
        try:
            probes.poll_until(plane.is_ready, timeout=timeout, interval=1.0,
                              error=lambda _: TimeoutError())
        except TimeoutError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera up", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=launcher.default_data_dir(),
                        help="control plane state (default: %(default)s)")
    parser.add_argument("--crds", type=Path, default=None,
                        help="directory of CRD manifests to install (default: crds/ of the "
                             "checkout)")
    parser.add_argument("--ready-timeout", type=float, default=READY_WAIT_S, metavar="SECONDS",
                        help="how long to wait for a running control plane that does not "
                             "answer before giving up, touching nothing (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)

    # 1. refuse a data dir that is not ours (it gets deleted) and CRDs we cannot read
    try:
        launcher.check_state_dir(args.data_dir)
        docs = crds.load(args.crds)
    except (launcher.NotAStateDir, FileNotFoundError) as exc:
        return _fail(console, str(exc))

    # 2. idempotence: a running control plane is reused, even a slow one; a dead one is cleared
    existing = launcher.ControlPlane.load(args.data_dir)
    if existing is not None:
        if existing.is_ready() or (
                existing.is_running() and _becomes_ready(console, existing, args.ready_timeout)):
            console.print("[green]control plane already running[/]")
            _announce(console, existing)
            return 0
        if existing.is_running():
            # its etcd holds the user's objects: a busy server is no reason to wipe them
            return _fail(console, (
                f"the control plane in {args.data_dir} runs (pids {existing.pids}) but has not "
                f"answered for {args.ready_timeout:.0f} s; left it untouched. See the logs "
                "there, try again, or stop it with `tessera down`."))
        console.print("found a stopped control plane; clearing its state")
        existing.stop()  # whichever of the pair still runs
    launcher.remove_state_dir(args.data_dir)

    # 3. binaries (built from the Go module registry on first use, then cached)
    with console.status("kube-apiserver and etcd: building from the Go module registry "
                        "if not cached (first time: many minutes)"):
        try:
            bins = launcher.binaries(log=console.log)
        except RuntimeError as exc:  # no Go, or no release built: the message says why
            return _fail(console, str(exc))
    console.print(f"binaries: {bins}")

    # 4. etcd + kube-apiserver, detached: they keep running after this command exits
    started = time.monotonic()
    with console.status("starting etcd and kube-apiserver"):
        plane = launcher.ControlPlane.start(args.data_dir, bins, detached=True)
        plane.save()
    console.print(f"[green]control plane ready[/] in {time.monotonic() - started:.1f} s "
                  f"(logs in {args.data_dir})")

    # 5. CRDs, applied server-side and waited on until Established
    try:
        with console.status("installing CRDs"), plane.api_client() as api:
            names = crds.apply(api, docs)
    except BaseException:
        plane.stop()
        launcher.remove_state_dir(args.data_dir)
        raise
    console.print(f"[green]CRDs established:[/] {', '.join(names)}")
    _announce(console, plane)
    return 0
