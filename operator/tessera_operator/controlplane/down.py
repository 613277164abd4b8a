"""`tessera down`: stop the control plane that `tessera up` started and remove its state."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from tessera_operator.controlplane import launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera down", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=launcher.default_data_dir(),
                        help="control plane state (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)

    try:
        launcher.check_state_dir(args.data_dir)
    except launcher.NotAStateDir as exc:
        console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        return 1
    plane = launcher.ControlPlane.load(args.data_dir)
    if plane is None:
        console.print("no control plane running")
    else:
        with console.status("stopping kube-apiserver and etcd"):
            plane.stop()
        console.print("[green]control plane stopped[/]")
    launcher.remove_state_dir(args.data_dir)
    return 0
