"""Prometheus metrics of the power agent, rendered on each scrape from its latest status.

Per rack: `tessera_rack_power_budget_watts{rack}` is the whole rack's budget as the operator set
it (every node of the rack reports the same value: `max by (rack)`); the node metrics carry the
rack label, so `sum by (rack) (tessera_node_power_limit_watts)` is the rack's use against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera_contracts.powertarget import LIMIT_METRIC, SETTLED_METRIC, TARGET_METRIC


@dataclass(frozen=True)
class GpuStatus:
    """One GPU as last observed; None where it could not be read or there is no target."""

    index: int
    uuid: str
    power_mw: int | None
    limit_mw: int | None
    target_mw: int | None
    boosted: bool
    enforced_mw: int | None = None  # what the driver enforces (may sit below the limit)
    sm_clock_mhz: int | None = None
    power_capped: bool | None = None  # clocks held down by the power cap; None: not reported


@dataclass(frozen=True)
class NodeStatus:
    """The agent's view after one control step."""

    node: str
    rack: str = ""
    budget_mw: int | None = None  # this node's share
    rack_budget_mw: int | None = None
    holding: bool = True
    reason: str = "starting"
    # no target (released) and every GPU that answers at the settled level: base cap inside
    # the node's last share
    settled: bool = False
    gpus: tuple[GpuStatus, ...] = ()
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> count since start


def _w(mw: int | None) -> float | None:
    return None if mw is None else mw / 1000


def _one(name: str, help_: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class AgentCollector(Collector):
    """Yields fresh metric families from `status()` on every scrape; keeps nothing itself."""

    def __init__(self, status: Callable[[], NodeStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        gpu_labels = ["node", "gpu", "uuid"]
        families = [
            (GaugeMetricFamily(name, help_, labels=gpu_labels), value)
            for name, help_, value in (
                ("tessera_gpu_power_usage_watts", "GPU power draw", lambda g: _w(g.power_mw)),
                (LIMIT_METRIC, "GPU power management limit",
                 lambda g: _w(g.limit_mw)),
                ("tessera_gpu_power_enforced_limit_watts",
                 "Power limit the driver enforces (the lowest of all limits in force)",
                 lambda g: _w(g.enforced_mw)),
                (TARGET_METRIC,
                 "Limit the agent is moving the GPU to (after device bounds and budget)",
                 lambda g: _w(g.target_mw)),
                ("tessera_gpu_power_boosted", "1 if the GPU is targeted above the base cap",
                 lambda g: float(g.boosted)),
                ("tessera_gpu_sm_clock_mhz", "SM clock", lambda g: g.sm_clock_mhz),
                ("tessera_gpu_power_capped", "1 while the power cap holds the clocks down",
                 lambda g: None if g.power_capped is None else float(g.power_capped)),
            )
        ]
        for g in s.gpus:
            for family, value in families:
                if (v := value(g)) is not None:
                    family.add_metric([s.node, str(g.index), g.uuid], v)
        yield from (family for family, _ in families)

        if s.rack_budget_mw is not None:
            yield _one("tessera_rack_power_budget_watts",
                       "The rack's power budget (the same from every node: max by rack)",
                       {"rack": s.rack}, _w(s.rack_budget_mw))
        node = {"rack": s.rack, "node": s.node}
        if s.budget_mw is not None:
            yield _one("tessera_node_power_budget_watts",
                       "This node's share of its rack's budget (sum by rack <= the rack budget)",
                       node, _w(s.budget_mw))
        for name, attr, help_ in (
            ("tessera_node_power_limit_watts", "limit_mw", "Sum of this node's GPU power limits"),
            ("tessera_node_power_usage_watts", "power_mw", "Sum of this node's GPU power draw"),
        ):
            values = [getattr(g, attr) for g in s.gpus if getattr(g, attr) is not None]
            yield _one(name, help_, node, _w(sum(values)))
        yield _one(
            SETTLED_METRIC,
            "1 while the node has no target and every GPU that answers is at its settled level "
            "(the base cap inside the node's last share)",
            {"node": s.node},
            float(s.settled),
        )
        yield _one(
            "tessera_power_agent_holding",
            "1 while the agent holds limits (no valid, fresh target)",
            {"node": s.node},
            float(s.holding),
        )
        errors = CounterMetricFamily(
            "tessera_power_agent_errors", "Backend and API errors by kind", labels=["node", "kind"]
        )
        for kind, count in sorted(dict(s.errors).items()):
            errors.add_metric([s.node, kind], count)
        yield errors
