"""The operator's pure power planning: per-node targets for a rack, and the closed boost loop.

A rack is a scale-up domain (one HGX node, or the nodes of an NVL72). Healthy racks run every GPU
at the fleet base cap, below the maximum, so that headroom exists; in a degraded rack the failed
GPUs drop to the device minimum and the survivors are raised by a boost ratio, all within the
rack budget. The budget is enforced per node by the agents, so it is split into node shares
that add up to at most the rack budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from datetime import datetime

from power_controller.perf_model import PAPER, PerfModel
from power_controller.policy import fit_budget
from power_controller.targets import PowerTarget


@dataclass(frozen=True)
class PowerPolicy:
    """The job's power settings, in watts. `rack_budget_w` None means gpus x base cap."""

    base_w: int = 500
    boost_cap_w: int = 700
    min_w: int = 200
    rack_budget_w: int | None = None
    ttl_s: int = 60
    ramp_step_w: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_w <= self.base_w <= self.boost_cap_w:
            raise ValueError(f"need 0 < min <= base <= boost cap, got {self}")
        if self.rack_budget_w is not None and self.rack_budget_w < self.min_w:
            raise ValueError(f"rack budget {self.rack_budget_w} W is below one GPU's minimum")

    def budget(self, gpus: int) -> int:
        """The rack budget for `gpus` GPUs; ValueError if it cannot hold them all at minimum
        (the node shares would then add up to more than the rack budget)."""
        budget = self.rack_budget_w if self.rack_budget_w is not None else gpus * self.base_w
        if budget < gpus * self.min_w:
            raise ValueError(
                f"rack budget {budget} W cannot hold {gpus} GPUs at their {self.min_w} W minimum"
                f" ({gpus * self.min_w} W)"
            )
        return budget


def ratio_for_tp(
    healthy_tp: int,
    reduced_tp: int,
    model: PerfModel = PAPER,
    *,
    planned_slowdown: float | None = None,
) -> float:
    """The power ratio at which a replica at `reduced_tp` keeps pace with one at `healthy_tp`;
    the model's peak if unreachable.

    Each survivor does healthy/reduced times the work unless the caller has the planner's
    `planned_slowdown` (its busiest rank at `reduced_tp` vs at `healthy_tp`, which includes the
    uneven split of whole heads): then that is what the boost must make up.
    """
    if not 0 < reduced_tp <= healthy_tp:
        raise ValueError(f"need 0 < reduced <= healthy TP, got {reduced_tp}, {healthy_tp}")
    slowdown = healthy_tp / reduced_tp if planned_slowdown is None else planned_slowdown
    return model.ratio_for_slowdown(slowdown, model.max_ratio())


def plan_rack(
    policy: PowerPolicy,
    rack: str,
    nodes: Mapping[str, int],
    failed: Set[tuple[str, int]],
    boost_ratio: float,
    now: datetime,
) -> dict[str, PowerTarget]:
    """Targets for every node of `rack` (`nodes`: node -> GPU count; `failed`: (node, index))."""
    if not nodes or min(nodes.values()) <= 0:
        raise ValueError(f"rack {rack!r} needs nodes with at least one GPU each, got {dict(nodes)}")
    gpus = [(n, i) for n, count in sorted(nodes.items()) for i in range(count)]
    degraded = any(g in failed for g in gpus)
    boost_w = min(policy.boost_cap_w, round(policy.base_w * max(boost_ratio, 1.0)))
    desired = {
        g: policy.min_w if g in failed else (boost_w if degraded else policy.base_w) for g in gpus
    }
    rack_budget = policy.budget(len(gpus))
    fitted = fit_budget(desired, dict.fromkeys(gpus, policy.min_w), rack_budget)
    # Each node's share is what its GPUs were given plus a GPU-count share of the slack, rounded
    # down, so the shares never add up to more than the rack budget.
    slack = max(0, rack_budget - sum(fitted.values()))
    targets = {}
    for node, count in sorted(nodes.items()):
        mine = {i: fitted[(node, i)] for i in range(count)}
        targets[node] = PowerTarget(
            node=node,
            rack=rack,
            budget_w=sum(mine.values()) + slack * count // len(gpus),
            base_w=policy.base_w,
            renew_time=now,
            ttl_s=policy.ttl_s,
            rack_budget_w=rack_budget,
            gpu_w={i: w for i, w in mine.items() if w != policy.base_w},
            ramp_step_w=policy.ramp_step_w,
        )
    return targets


def next_boost_ratio(
    ratio: float,
    degraded_step_s: float,
    healthy_step_s: float,
    *,
    max_ratio: float,
    tolerance: float = 0.01,
    max_change: float = 0.05,
    model: PerfModel = PAPER,
) -> float:
    """One step of the closed loop: the boost ratio that should make the degraded replica's
    step time match the healthy replicas', moved by at most `max_change`, within [1, max_ratio].

    Inside the tolerance band the ratio stays put, so the loop settles instead of hunting; a
    degraded replica that is already faster gets its boost lowered (no power spent for nothing).
    """
    if degraded_step_s <= 0 or healthy_step_s <= 0:
        raise ValueError(f"step times must be positive, got {degraded_step_s}, {healthy_step_s}")
    lag = degraded_step_s / healthy_step_s
    if abs(lag - 1.0) <= tolerance:
        return ratio
    top = min(max_ratio, model.max_ratio())
    try:
        wanted = model.ratio_for_speedup(model.speedup(ratio) * lag)
    except ValueError:
        wanted = top
    moved = ratio + max(-max_change, min(max_change, wanted - ratio))
    return max(1.0, min(top, moved))
