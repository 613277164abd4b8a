"""Prometheus metrics of the power agent, rendered on each scrape from its latest status.

Rack metrics are this node's share: `sum by (rack)` over the rack's nodes gives the rack's
budget and use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class GpuStatus:
    """One GPU as last observed; None where it could not be read or there is no target."""

    index: int
    uuid: str
    power_mw: int | None
    limit_mw: int | None
    target_mw: int | None
    boosted: bool


@dataclass(frozen=True)
class NodeStatus:
    """The agent's view after one control step."""

    node: str
    rack: str = ""
    budget_mw: int | None = None
    holding: bool = True
    reason: str = "starting"
    gpus: tuple[GpuStatus, ...] = ()
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> count since start


def _w(mw: int) -> float:
    return mw / 1000


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
        usage = GaugeMetricFamily(
            "tessera_gpu_power_usage_watts", "GPU power draw", labels=gpu_labels
        )
        limit = GaugeMetricFamily(
            "tessera_gpu_power_limit_watts", "GPU power management limit", labels=gpu_labels
        )
        target = GaugeMetricFamily(
            "tessera_gpu_power_target_watts",
            "Limit the agent is moving the GPU to (after device bounds and budget)",
            labels=gpu_labels,
        )
        boosted = GaugeMetricFamily(
            "tessera_gpu_power_boosted",
            "1 if the GPU is targeted above the base cap",
            labels=gpu_labels,
        )
        for g in s.gpus:
            labels = [s.node, str(g.index), g.uuid]
            boosted.add_metric(labels, float(g.boosted))
            for family, value in ((usage, g.power_mw), (limit, g.limit_mw), (target, g.target_mw)):
                if value is not None:
                    family.add_metric(labels, _w(value))
        yield from (usage, limit, target, boosted)

        rack = {"rack": s.rack, "node": s.node}
        if s.budget_mw is not None:
            yield _one(
                "tessera_rack_power_budget_watts",
                "This node's share of its rack's power budget (sum by rack for the rack)",
                rack,
                _w(s.budget_mw),
            )
        for name, attr, help_ in (
            ("tessera_rack_power_limit_watts", "limit_mw", "Sum of this node's GPU power limits"),
            ("tessera_rack_power_usage_watts", "power_mw", "Sum of this node's GPU power draw"),
        ):
            values = [getattr(g, attr) for g in s.gpus if getattr(g, attr) is not None]
            yield _one(name, help_, rack, _w(sum(values)))
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
