"""`tessera-dev up`: build if needed, start the local cluster detached (control plane, simulated GPU
nodes, Prometheus) and install the CRDs; with `--kueue`, Kueue too."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from tessera_dev import paths, probes
from tessera_dev.controlplane import build, cluster, crds, kueue, launcher

# how long a control plane whose servers run, but do not answer, gets before `up` gives up
READY_WAIT_S = 30.0


def _announce(console: Console, running: cluster.Cluster) -> None:
    plane = running.plane
    console.print(f"server:     {plane.server}\nkubeconfig: [bold]{plane.kubeconfig}[/]\n"
                  f"nodes:      {', '.join(running.nodes) or '-'}\n"
                  f"prometheus: {running.prometheus_url or '-'}\n"
                  f"kueue:      {'running' if running.kueue_pid else '-'}")
    # plain print on stdout so that `eval "$(tessera-dev up | tail -1)"` works
    print(f"export KUBECONFIG={plane.kubeconfig}")


def _fail(console: Console, message: str) -> int:
    console.print(message, style="red", markup=False, highlight=False, soft_wrap=True)
    return 1


def _becomes_ready(console: Console, plane: launcher.ControlPlane, timeout: float) -> bool:
    # a line of its own, not only a spinner: a console that is no terminal shows no spinner
    console.print(f"the control plane runs but does not answer; waiting up to {timeout:.0f} s")
    with console.status("waiting for the control plane"):
        try:
            probes.poll_until(plane.is_ready, timeout=timeout, interval=1.0,
                              error=lambda _: TimeoutError())
        except TimeoutError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev up", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=paths.default_data_dir(),
                        help="control plane state (default: %(default)s)")
    parser.add_argument("--crds", type=Path, default=None,
                        help="directory of CRD manifests to install (default: those "
                             "tessera_contracts ships)")
    parser.add_argument("--ready-timeout", type=float, default=READY_WAIT_S, metavar="SECONDS",
                        help="how long to wait for a running control plane that does not "
                             "answer before giving up, touching nothing (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=cluster.DEFAULT_NODES,
                        help="simulated GPU nodes (default: %(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=cluster.DEFAULT_GPUS,
                        help="simulated GPUs per node (default: %(default)s)")
    parser.add_argument("--nodes-per-domain", type=int, default=1,
                        help="nodes sharing one NVLink domain, as the nodes of an NVL72 rack do "
                             "(default: %(default)s, an HGX node per domain)")
    parser.add_argument("--dcgm-generation", choices=cluster.DCGM_GENERATIONS, default="4.9",
                        help="field names of the nodes' DCGM exporters (default: %(default)s)")
    parser.add_argument("--kueue", action="store_true",
                        help=f"also run Kueue {build.KUEUE_VERSION}, managing the namespaces "
                             f"labelled {kueue.MANAGED_LABEL}=true (built from the Go module "
                             "registry on first use, many minutes; $TESSERA_KUEUE_BIN: a "
                             "prebuilt controller); added to a running cluster that lacks it")
    args = parser.parse_args(argv)
    console = Console(stderr=True)

    # 1. refuse a data dir that is not ours (it gets deleted), CRDs we cannot read, a bad size
    try:
        launcher.check_state_dir(args.data_dir)
        docs = crds.load(args.crds)
        specs = cluster.node_specs(args.nodes, args.gpus_per_node, args.nodes_per_domain)
    except (launcher.NotAStateDir, FileNotFoundError) as exc:
        return _fail(console, str(exc))
    except ValueError as exc:
        parser.error(str(exc))

    # 2. idempotence: a running control plane is reused, even a slow one; a dead one is cleared
    existing = launcher.ControlPlane.load(args.data_dir)
    if existing is not None:
        if existing.is_ready() or (
                existing.is_running() and _becomes_ready(console, existing, args.ready_timeout)):
            return _reuse(console, existing, args, specs)
        if existing.is_running():
            # its etcd holds the user's objects: a busy server is no reason to wipe them
            return _fail(console, (
                f"the control plane in {args.data_dir} runs (pids {existing.pids}) but has not "
                f"answered for {args.ready_timeout:.0f} s; left it untouched. See the logs "
                "there, try again, or stop it with `tessera-dev down`."))
        console.print("found a stopped control plane; clearing its state")
        (cluster.Cluster.load(args.data_dir) or cluster.Cluster(existing)).stop(
            stop_plane=True)  # whatever of it still runs
    launcher.remove_state_dir(args.data_dir)

    # 3. binaries (built from the Go module registry on first use, then cached)
    with console.status("control plane binaries: building from the Go module registry "
                        "if not cached (first time: many minutes)"):
        try:
            bins = launcher.binaries(log=console.log)
        except RuntimeError as exc:  # no Go, or no release built: the message says why
            return _fail(console, str(exc))
    console.print(f"binaries: {bins}")

    # 4. the control plane, detached: it keeps running after this command exits
    started = time.monotonic()
    with console.status("starting etcd, kube-apiserver, kube-controller-manager, "
                        "kube-scheduler"):
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
    # 6. the simulated GPU nodes, discovery and Prometheus
    return _start_cluster(console, plane, args, specs, started_plane=True)


def _start_cluster(console: Console, plane: launcher.ControlPlane, args: argparse.Namespace,
                   specs: list[cluster.NodeSpec], *, started_plane: bool) -> int:
    """Start the nodes and Prometheus; if that fails, a control plane this call started goes
    with them, one that was running already (the user's objects) is left as it was."""
    started = time.monotonic()
    with console.status(f"starting {len(specs)} simulated GPU nodes and Prometheus"):
        try:
            running = cluster.Cluster.start(plane, specs, dcgm_generation=args.dcgm_generation,
                                            detached=True)
        except BaseException:
            if started_plane:
                plane.stop()
                launcher.remove_state_dir(args.data_dir)
            raise
        running.save()
    console.print(f"[green]{len(specs)} nodes Ready[/] and Prometheus up in "
                  f"{time.monotonic() - started:.1f} s")
    if args.kueue:
        try:
            _start_kueue(console, running)
        except RuntimeError as exc:  # no Go, or the build failed: the message says why
            return _fail(console, str(exc))
    _announce(console, running)
    return 0


def _start_kueue(console: Console, running: cluster.Cluster) -> None:
    """Kueue's controller and release on the running cluster, recorded with it."""
    with console.status("Kueue: building from the Go module registry if not cached (first "
                        "time: many minutes)"):
        binary = launcher.kueue(log=console.log)
        release = build.ensure_kueue_manifests(log=console.log)
    started = time.monotonic()
    with console.status("starting Kueue"):
        running.start_kueue(binary, release, detached=True)
        running.save()
    console.print(f"[green]Kueue ready[/] in {time.monotonic() - started:.1f} s, managing the "
                  f"namespaces labelled {kueue.MANAGED_LABEL}=true (log in "
                  f"{running.plane.data_dir / kueue.STATE_DIR})")


def _reuse(console: Console, plane: launcher.ControlPlane, args: argparse.Namespace,
           specs: list[cluster.NodeSpec]) -> int:
    """A running control plane is kept (it holds the user's objects); nodes or monitoring that
    died since are started again."""
    console.print("[green]control plane already running[/]")
    running = cluster.Cluster.load(args.data_dir) or cluster.Cluster(plane)
    if running.is_running() and running.nodes:
        if args.kueue and running.kueue_pid is None:
            try:
                _start_kueue(console, running)
            except RuntimeError as exc:
                return _fail(console, str(exc))
        _announce(console, running)
        return 0
    running.stop()
    return _start_cluster(console, plane, args, specs, started_plane=False)
