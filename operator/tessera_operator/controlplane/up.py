"""`tessera up`: build if needed, start the local control plane detached and install the CRDs."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from rich.console import Console

from tessera_operator.controlplane import crds, launcher


def _announce(console: Console, plane: launcher.ControlPlane) -> None:
    console.print(f"server:     {plane.server}\nkubeconfig: [bold]{plane.kubeconfig}[/]")
    # plain print on stdout so that `eval "$(tessera up | tail -1)"` works
    print(f"export KUBECONFIG={plane.kubeconfig}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera up", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=launcher.default_data_dir(),
                        help="control plane state (default: %(default)s)")
    parser.add_argument("--crds", type=Path, default=crds.CRD_DIR,
                        help="directory of CRD manifests to install (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)

    # 1. idempotence: a running control plane is reused, a dead one's leftovers are cleared
    existing = launcher.ControlPlane.load(args.data_dir)
    if existing and existing.is_ready():
        console.print("[green]control plane already running[/]")
        _announce(console, existing)
        return 0
    if existing:
        console.print("found a stopped control plane; clearing its state")
        existing.stop()
    shutil.rmtree(args.data_dir, ignore_errors=True)

    # 2. binaries (built from the Go module registry on first use, then cached)
    with console.status("kube-apiserver and etcd: building from the Go module registry "
                        "if not cached (first time: many minutes)"):
        bins = launcher.binaries(log=console.log)
    console.print(f"binaries: {bins}")

    # 3. etcd + kube-apiserver, detached: they keep running after this command exits
    started = time.monotonic()
    with console.status("starting etcd and kube-apiserver"):
        plane = launcher.ControlPlane.start(args.data_dir, bins)
        plane.save()
    console.print(f"[green]control plane ready[/] in {time.monotonic() - started:.1f} s "
                  f"(logs in {args.data_dir})")

    # 4. CRDs, applied server-side and waited on until Established
    try:
        with console.status("installing CRDs"), plane.api_client() as api:
            names = crds.apply(api, crds.load(args.crds))
    except BaseException:
        plane.stop()
        shutil.rmtree(args.data_dir, ignore_errors=True)
        raise
    console.print(f"[green]CRDs established:[/] {', '.join(names)}")
    _announce(console, plane)
    return 0
