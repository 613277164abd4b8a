"""`tessera-dev down`: stop the local cluster that `tessera-dev up` started (Prometheus, discovery,
the simulated nodes and their pods, the control plane) and remove its state."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from tessera_dev import paths
from tessera_dev.controlplane import cluster, launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev down", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=paths.default_data_dir(),
                        help="control plane state (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)

    try:
        launcher.check_state_dir(args.data_dir)
    except launcher.NotAStateDir as exc:
        console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        return 1
    running = cluster.Cluster.load(args.data_dir)
    if running is None:
        console.print("no control plane running")
    else:
        with console.status("stopping Prometheus, the nodes and the control plane"):
            running.stop(stop_plane=True)
        console.print("[green]cluster stopped[/]")
    launcher.remove_state_dir(args.data_dir)
    return 0
