"""The node power agent (`tessera power-agent`): collect -> decide -> actuate -> serve metrics.

Each step reads the node's GPUs and its `GPUPowerTarget`, lets the pure policy decide, lowers
limits first and raises only into the headroom that is really there. On SIGTERM it puts every GPU
it changed back to its default limit; the set of changed GPUs is persisted on the host before
each change, so an agent that was killed restores them when it starts again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from power_controller.devices import BackendUnavailable, GpuId, GpuReading, PowerBackend, PowerError
from power_controller.metrics import GpuStatus, NodeStatus
from power_controller.policy import DeviceView, admit_raises, decide
from power_controller.state import ManagedGpus
from power_controller.targets import InvalidTarget, PowerTarget, parse_object

log = logging.getLogger("tessera.power-agent")


class TargetSource(Protocol):
    """Where the agent reads its node's target object (the API server in production)."""

    def fetch(self) -> dict[str, Any] | None: ...


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Agent:
    """One node's control loop state; `step()` runs one collect -> decide -> actuate cycle."""

    node: str
    backend: PowerBackend
    source: TargetSource
    managed: ManagedGpus
    step_mw: int = 50_000
    clock: Callable[[], datetime] = utc_now
    target: PowerTarget | None = None
    status: NodeStatus = field(init=False)
    # Limits last seen per GPU index: a GPU that stops answering is counted at this value.
    _known_mw: dict[int, int] = field(default_factory=dict, init=False)
    _last_error: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.status = NodeStatus(node=self.node)

    def _error(self, where: str, err: Exception) -> None:
        kind = type(err).__name__
        self.status.errors[kind] = self.status.errors.get(kind, 0) + 1
        if self._last_error.get(where) != str(err):  # log changes, not every repeat
            log.warning("%s: %s: %s", where, kind, err)
            self._last_error[where] = str(err)

    def _ok(self, where: str) -> None:
        if self._last_error.pop(where, None) is not None:
            log.info("%s: recovered", where)

    # 1. collect -----------------------------------------------------------------------------

    def _read_all(self, gpus: list[GpuId]) -> dict[int, GpuReading | None]:
        readings: dict[int, GpuReading | None] = {}
        for gpu in gpus:
            where = f"GPU {gpu.index}"
            try:
                readings[gpu.index] = r = self.backend.read(gpu.index)
                self._known_mw[gpu.index] = r.limit_mw
                self._ok(where)
            except PowerError as err:
                readings[gpu.index] = None
                self._error(where, err)
        return readings

    def _refresh_target(self) -> None:
        try:
            obj = self.source.fetch()
            self._ok("target")
        except Exception as err:  # outage: keep acting on the last valid target until it is stale
            self._error("target", err)
            return
        try:
            self.target = None if obj is None else parse_object(obj, self.node)
        except InvalidTarget as err:
            self.target = None
            self._error("target", err)

    # 2. decide ------------------------------------------------------------------------------

    def _views(self, readings: dict[int, GpuReading | None]) -> list[DeviceView]:
        worst = max((r.max_mw for r in readings.values() if r), default=0)
        views = []
        for index, r in readings.items():
            if r is None:
                # Unknown is counted at its last limit, or the node's largest maximum: we cannot
                # show it draws less, and the budget must hold whatever it does.
                views.append(DeviceView(index, 0, 0, self._known_mw.get(index, worst), False))
            else:
                views.append(DeviceView(index, r.min_mw, r.max_mw, r.limit_mw))
        return views

    # 3. actuate -----------------------------------------------------------------------------

    def _apply(
        self, changes: dict[int, int], readings: dict[int, GpuReading | None]
    ) -> set[int]:
        """Set limits (recording each GPU first), refreshing `readings`; the GPUs that failed."""
        failed = set()
        for index, milliwatts in changes.items():
            gpu, where = readings[index], f"GPU {index}"
            assert gpu is not None  # the policy only changes GPUs it could read
            try:
                # Write-ahead: a GPU that cannot be recorded is not changed.
                self.managed.add(gpu.uuid, gpu.default_mw)
                self.backend.set_limit(index, milliwatts)
            except (PowerError, OSError) as err:
                self._error(where, err)
                failed.add(index)
                continue
            self._known_mw[index] = milliwatts
            try:
                readings[index] = after = self.backend.read(index)  # the driver may round
                self._known_mw[index] = after.limit_mw
                self._ok(where)
            except PowerError as err:
                readings[index] = replace(gpu, limit_mw=milliwatts)
                self._error(where, err)
        return failed

    def step(self) -> NodeStatus:
        try:
            gpus = self.backend.gpus()
        except PowerError as err:
            self._error("backend", err)
            self.status = replace(self.status, holding=True, reason=f"hold: {err}", gpus=())
            return self.status
        readings = self._read_all(gpus)
        self._refresh_target()
        views, now = self._views(readings), self.clock()
        decision = decide(views, self.target, now, self.step_mw)
        if decision.reason.startswith("infeasible"):
            log.warning("%s", decision.reason)

        stuck = self._apply(decision.lower, readings)
        if stuck:
            # A GPU that refused its cut keeps its limit: decide again with it fixed, so the
            # others are cut further and the budget still holds.
            views = [
                DeviceView(v.index, 0, 0, v.limit_mw, False) if v.index in stuck else v
                for v in views
            ]
            decision = decide(views, self.target, now, self.step_mw)
            self._apply(decision.lower, readings)
        if self.target is not None and decision.raise_:
            limits = {v.index: self._limit(v, readings) for v in views}
            budget_mw = self.target.budget_w * 1000
            self._apply(admit_raises(limits, decision.raise_, budget_mw), readings)

        self.status = self._render(gpus, readings, decision.goals, decision.reason)
        return self.status

    def _limit(self, view: DeviceView, readings: dict[int, GpuReading | None]) -> int:
        reading = readings[view.index]
        return reading.limit_mw if reading is not None else view.limit_mw

    def _render(
        self,
        gpus: list[GpuId],
        readings: dict[int, GpuReading | None],
        goals: dict[int, int],
        reason: str,
    ) -> NodeStatus:
        t = self.target
        rows = tuple(
            GpuStatus(
                index=g.index,
                uuid=g.uuid,
                power_mw=r.power_mw if (r := readings[g.index]) else None,
                limit_mw=r.limit_mw if r else None,
                target_mw=goals.get(g.index),
                boosted=bool(t and goals and t.boosted(g.index)),
            )
            for g in gpus
        )
        return replace(
            self.status,
            rack=t.rack if t else self.status.rack,
            budget_mw=t.budget_w * 1000 if t else self.status.budget_mw,
            holding=not goals,
            reason=reason,
            gpus=rows,
        )

    # restore -------------------------------------------------------------------------------

    def restore(self) -> list[str]:
        """Put every GPU this agent (or a predecessor) changed back to its default limit.

        Returns the UUIDs that could not be restored; they stay recorded for the next attempt.
        """
        try:
            where = {g.uuid: g.index for g in self.backend.gpus()}
        except PowerError as err:
            self._error("restore", err)
            return sorted(self.managed.defaults)
        left = []
        for uuid, default_mw in sorted(self.managed.defaults.items()):
            try:
                if uuid not in where:
                    raise PowerError(f"GPU {uuid} is not on this node any more")
                self.backend.set_limit(where[uuid], default_mw)
            except PowerError as err:
                self._error(f"restore {uuid}", err)
                left.append(uuid)
                continue
            self.managed.discard(uuid)
            log.info("restored GPU %s (index %d) to %d mW", uuid, where[uuid], default_mw)
        return left


# --- command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--sim-state", type=Path, help="simulated GPUs' shared state file (sim backend)")
    p.add_argument("--sim-gpus", type=int, default=8, help="simulated GPU count (sim backend)")
    p.add_argument("--log-level", default="INFO")
    return p


def _backend(args: argparse.Namespace) -> PowerBackend:
    if args.backend == "sim":
        from power_controller.sim_backend import SimBackend

        return SimBackend(count=args.sim_gpus, node=args.node, state_path=args.sim_state)
    from power_controller.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    backend.open()
    return backend


def _source(args: argparse.Namespace) -> TargetSource:
    from kubernetes import client, config

    from power_controller.channel import KubeTargetSource

    configuration = client.Configuration()
    if args.kubeconfig:
        config.load_kube_config(config_file=args.kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = 0  # one bounded attempt per step; the loop is the retry
    return KubeTargetSource(client.ApiClient(configuration), args.node, args.api_timeout)


def _serve_metrics(args: argparse.Namespace, agent: Agent) -> Callable[[], None]:
    if not args.metrics_port:
        return lambda: None
    from prometheus_client import CollectorRegistry, start_http_server

    from power_controller.metrics import AgentCollector

    registry = CollectorRegistry()
    registry.register(AgentCollector(lambda: agent.status))
    server, _ = start_http_server(args.metrics_port, args.metrics_addr, registry)
    return server.shutdown


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if not args.node:
        _parser().error("--node (or NODE_NAME) is required")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    # 1. hardware and a restore of whatever a killed predecessor left changed
    try:
        backend = _backend(args)
    except BackendUnavailable as err:
        log.error("no GPU backend: %s", err)
        return 1
    managed = ManagedGpus.load(args.state_dir / f"{args.node}.json")
    agent = Agent(args.node, backend, _source(args), managed, step_mw=args.step_watts * 1000)
    if managed.defaults:
        log.info("restoring %d GPU(s) left changed by a previous agent", len(managed.defaults))
        agent.restore()
    stop_metrics = _serve_metrics(args, agent)
    log.info("power agent on node %s (%s backend) running", args.node, args.backend)

    # 2. control loop until SIGTERM
    while not stop.is_set():
        try:
            agent.step()
        except Exception:  # a bug in one step must not leave GPUs boosted with no one watching
            log.exception("control step failed; limits left as they are")
        stop.wait(args.interval)

    # 3. shutdown: defaults back before the grace period ends; no API calls on this path
    left = agent.restore()
    stop_metrics()
    backend.close()
    if left:
        log.error("could not restore %d GPU(s): %s (recorded for the next start)", len(left), left)
        return 1
    log.info("restored all GPUs; exiting")
    return 0
