"""Shared by the power tests: a fixed clock and a valid target to start from."""

from __future__ import annotations

from datetime import UTC, datetime

from power_controller.targets import PowerTarget

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def make_target(node: str = "node-a", **kw) -> PowerTarget:
    fields = dict(node=node, rack="rack-0", budget_w=4600, base_w=500, renew_time=NOW, ttl_s=60,
                  rack_budget_w=4600)
    fields.update(kw)
    return PowerTarget(**fields)
