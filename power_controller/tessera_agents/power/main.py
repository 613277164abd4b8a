"""`tessera power-agent`: the power agent's command line; wires the backend (NVML or the
simulated GPUs), the node's target source and the metrics server to `agent.Agent` and runs it
until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from tessera_agents.bounded import exit_abandoning_calls
from tessera_agents.kube import api_client, is_node_name
from tessera_agents.power.agent import Agent, TargetSource
from tessera_agents.power.devices import PowerBackend, PowerError
from tessera_agents.power.state import ManagedGpus, StateLocked
from tessera_core.power_policy import WATT

log = logging.getLogger("tessera.power-agent")


SIM_STATE_ENV = "TESSERA_SIM_GPU_STATE"


# --- command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from tessera_agents.power.sim_backend import SimGpuSpec
    from tessera_core.perf_model import PAPER

    sim = SimGpuSpec()
    p = argparse.ArgumentParser(
        prog="tessera power-agent",
        description="Node power agent: applies the operator's GPUPowerTarget to this node's GPUs.",
    )
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="node name (env NODE_NAME)")
    p.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/tessera-power"),
                   help="host directory recording the GPUs whose limits were changed")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between control steps")
    p.add_argument("--step-watts", type=int, default=50, help="largest raise per GPU per step")
    p.add_argument("--metrics-addr", default="0.0.0.0")
    p.add_argument("--metrics-port", type=int, default=9402, help="0 disables the endpoint")
    p.add_argument("--api-timeout", type=float, default=3.0, help="seconds per API server call")
    p.add_argument("--startup-wait", type=float, default=10.0,
                   help="seconds to try reading the target at start before holding recorded GPUs")
    p.add_argument("--restore-timeout", type=float, default=10.0,
                   help="seconds for restoring all GPUs (in parallel); late ones stay recorded")
    p.add_argument("--on-exit", choices=("restore", "hold"), default="restore",
                   help="on SIGTERM: settle at the base cap inside the node's last budget share "
                        "(the device defaults where none was ever given), or leave the limits to "
                        "the next agent (rolling updates)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    g = p.add_argument_group("simulated GPUs (--backend sim; an existing --sim-state file wins)")
    # A simulated node's container runtime names its GPUs' state file in this variable, as the
    # NVIDIA runtime injects the driver: the DaemonSet runs unchanged on a local cluster.
    g.add_argument("--sim-state", type=Path, default=os.environ.get(SIM_STATE_ENV) or None,
                   help=f"state file shared with other processes (env {SIM_STATE_ENV})")
    g.add_argument("--sim-gpus", type=int, default=8, help="GPU count")
    g.add_argument("--sim-min-watts", type=int, default=sim.min_w)
    g.add_argument("--sim-max-watts", type=int, default=sim.max_w)
    g.add_argument("--sim-default-watts", type=int, default=sim.default_w)
    g.add_argument("--sim-reference-watts", type=int, default=sim.reference_w,
                   help="power at which a GPU runs at speed 1.0 (the fleet base cap)")
    g.add_argument("--sim-perf-a", type=float, default=PAPER.a,
                   help="perf/W loss model: a(r-1) + b(r-1)^2 at power ratio r (perf_model)")
    g.add_argument("--sim-perf-b", type=float, default=PAPER.b)
    p.add_argument("--log-level", default="INFO")
    return p


def sim_backend(args: argparse.Namespace) -> PowerBackend:
    """The simulated GPUs the command line describes; ValueError naming a bad setting."""
    from tessera_agents.power.sim_backend import SimBackend, SimGpuSpec
    from tessera_core.perf_model import PerfModel

    if args.sim_gpus < 1 or args.sim_reference_watts < 1:
        raise ValueError("--sim-gpus and --sim-reference-watts must be positive")
    spec = SimGpuSpec(min_w=args.sim_min_watts, max_w=args.sim_max_watts,
                      default_w=args.sim_default_watts, reference_w=args.sim_reference_watts)
    model = PerfModel(args.sim_perf_a, args.sim_perf_b)
    return SimBackend(args.sim_gpus, args.node, spec, args.sim_state, model)


def _backend(args: argparse.Namespace) -> PowerBackend:
    if args.backend == "sim":
        return sim_backend(args)
    from tessera_agents.power.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    backend.open()
    return backend


def _source(args: argparse.Namespace) -> TargetSource:
    from tessera_agents.power.target_source import KubeTargetSource

    return KubeTargetSource(api_client(args.kubeconfig), args.node, args.api_timeout)


class _Unconfigured:
    """The source when the API client could not be configured: nothing can be read."""

    def __init__(self, err: Exception) -> None:
        self.err = err

    def fetch(self) -> dict[str, Any] | None:
        raise self.err

    def report(self, status: dict[str, Any], uid: str | None) -> None:
        raise self.err


def _serve_metrics(args: argparse.Namespace, agent: Agent) -> Callable[[], None]:
    if not args.metrics_port:
        return lambda: None
    from prometheus_client import CollectorRegistry, start_http_server

    from tessera_agents.power.metrics import AgentCollector

    registry = CollectorRegistry()
    registry.register(AgentCollector(lambda: agent.status))
    server, _ = start_http_server(args.metrics_port, args.metrics_addr, registry)
    return server.shutdown


# A Kubernetes node name is a DNS-1123 subdomain; anything else (say `../x`) must not reach a path.
def _bad_setting(args: argparse.Namespace) -> str | None:
    """Why the command line cannot run, naming the flag; None when it can."""
    if not is_node_name(args.node):
        return (f"--node {args.node!r} is not a Kubernetes node name (lowercase letters, digits, "
                f"'-' and '.', at most 253 characters)")
    if not (args.interval > 0 and math.isfinite(args.interval)):
        return f"--interval must be a positive number of seconds, got {args.interval}"
    return None


def serve(argv: list[str]) -> NoReturn:
    """The DaemonSet container's command (`tessera_agents.bounded.exit_abandoning_calls`)."""
    exit_abandoning_calls(main, argv)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if not args.node:
        parser.error("--node (or NODE_NAME) is required")
    bad = _bad_setting(args)
    if bad:
        log.error("%s", bad)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    # 1. the node's record, exclusively: two agents would undo each other's changes
    try:
        managed = ManagedGpus.open(args.state_dir / f"{args.node}.json")
    except StateLocked as err:
        log.error("%s", err)
        return 2
    except OSError as err:
        log.error("cannot open the node's record in --state-dir %s: %s", args.state_dir, err)
        return 1
    try:
        return _run(args, parser, managed, stop)
    finally:
        managed.close()


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    managed: ManagedGpus,
    stop: threading.Event,
) -> int:
    # 2. hardware
    try:
        backend = _backend(args)
    except PowerError as err:  # no library, no driver, or not even the GPU count answers
        log.error("no GPU backend: %s", err)
        return 1
    except ValueError as err:
        parser.error(str(err))

    # 3. what a previous agent left: settled before anything else that can fail on configuration
    try:
        source: TargetSource = _source(args)
    except Exception as err:  # no kubeconfig, no in-cluster environment, a malformed file
        source = _Unconfigured(err)
    agent = Agent(args.node, backend, source, managed, step_mw=args.step_watts * WATT,
                  restore_timeout_s=args.restore_timeout)
    if isinstance(source, _Unconfigured):
        log.error("cannot configure the API client: %s; settling recorded GPUs and exiting",
                  source.err)
        if managed.unreadable:
            agent.restore_all()
        if managed.gpus:
            agent.leave()
        backend.close()
        return 1
    agent.recover(args.startup_wait, stop.wait)
    stop_metrics = _serve_metrics(args, agent)
    log.info("power agent on node %s (%s backend) running", args.node, args.backend)

    # 4. control loop until SIGTERM
    while not stop.is_set():
        try:
            agent.step()
        except Exception:  # a bug in one step must not leave GPUs boosted with no one watching
            log.exception("control step failed; limits left as they are")
        stop.wait(args.interval)

    # 5. shutdown: no API calls on this path, bounded device calls
    stop_metrics()
    if args.on_exit == "hold":
        log.info("--on-exit hold: leaving %d GPU(s) at their limits for the next agent",
                 len(managed.gpus))
        backend.close()
        return 0
    left = agent.leave()
    backend.close()
    if left:
        log.error("could not settle %d GPU(s): %s (recorded for the next start)", len(left), left)
        return 1
    log.info("settled all GPUs; exiting")
    return 0
