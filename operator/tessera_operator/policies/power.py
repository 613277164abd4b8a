"""The power policy (pure): the boosts a plan's reduced replicas run at, the power targets that
ask for them, and the one pass of writes that brings the job's targets there.

The closed loop (`planner.follow_compute`) steps each reduced replica's boost from the compute
times its nodes report, starting where the status left it (`conditions.boosts`: the loop's
state is the operator's own output, kept where users read it). The targets read the job's
targets as they are: the racks they name, the watts a GPU lost under its process is still
counted at. `sync` is the pass of writes, cuts before the raises that need them
(`power_planning.plan_sync`), computed once and applied as it is (`power_targets.write_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tessera_contracts.powertarget import InvalidTarget, PowerTarget, parse_object, reported_limits
from tessera_contracts.progress import NodeReport
from tessera_operator import conditions, planner
from tessera_operator.observed import Observed
from tessera_operator.power_planning import SyncPlan, plan_sync


def boosted(plan: planner.JobPlan, observed: Observed,
            reports: Mapping[str, NodeReport | None], lost: frozenset[planner.GpuId]
            ) -> tuple[planner.JobPlan, dict[str, PowerTarget]]:
    """The plan with its boosts stepped by the closed loop, and its power targets. The loop's
    ratio, the parked nodes and the lost GPUs' watts all read the targets as they are."""
    current = {obj["metadata"]["name"]: obj for obj in observed.targets}
    racks = {node: rack for node, obj in current.items()
             if isinstance(spec := obj.get("spec"), dict)
             and isinstance(rack := spec.get("rack"), str)}
    plan = replace(plan, stuck=_counted_watts(current, lost))
    previous = observed.job.get("status") or {}
    plan = planner.follow_compute(plan, reports, conditions.boosts(previous), racks)
    return plan, plan.power_targets(racks)


def _counted_watts(current: Mapping[str, Mapping[str, Any]], lost: frozenset[planner.GpuId]
                   ) -> dict[planner.GpuId, int]:
    """The watts each agent still counts a GPU lost under its process at: the limit it reports,
    else what its target last asked for (no target: nothing was ever set, nothing is held)."""
    counted = {}
    for node, index in lost:
        obj = current.get(node)
        if obj is None:
            continue
        reported = reported_limits(obj)
        if index in reported:
            counted[(node, index)] = reported[index]
            continue
        try:
            counted[(node, index)] = parse_object(obj, node).watts_for(index)
        except InvalidTarget:
            continue
    return counted


def sync(observed: Observed, targets: Mapping[str, PowerTarget]) -> SyncPlan:
    """The one pass of writes that brings the job's targets as observed towards `targets`
    (empty: release them all)."""
    return plan_sync(observed.targets, list(targets.values()))
