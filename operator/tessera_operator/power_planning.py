"""The operator's pure power planning: per-node targets for a rack, and the closed boost loop.

A rack is a scale-up domain (one HGX node, or the nodes of an NVL72). Healthy racks run every GPU
at the fleet base cap, below the maximum, so that headroom exists; in a degraded rack the failed
GPUs drop to the device minimum and the survivors are raised by a boost ratio, all within the
rack budget. The budget is enforced per node by the agents, so it is split into node shares
that add up to at most the rack budget; `stage` orders the writes so that a rack spanning several
nodes stays inside its budget while the shares move.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from tessera_contracts.powertarget import InvalidTarget, PowerTarget, budget_in_effect, parse_object
from tessera_core.perf_model import PAPER, PerfModel
from tessera_core.power_policy import fit_budget


@dataclass(frozen=True)
class PowerPolicy:
    """The job's power settings, in watts. `rack_budget_w` None means gpus x base cap."""

    base_w: int = 500
    boost_cap_w: int = 700
    min_w: int = 200
    rack_budget_w: int | None = None
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
    parked: Set[str] = frozenset(),
    stuck: Mapping[tuple[str, int], int] | None = None,
) -> dict[str, PowerTarget]:
    """Targets for every node of `rack` (`nodes`: node -> GPU count; `failed`: (node, index)).

    `parked` names nodes of `nodes` that left the job but still hold a share in the rack: their
    GPUs are planned at the minimum, like failed ones, without boosting anyone for it.

    `stuck` gives failed GPUs that may no longer take a limit (lost under their process: off the
    bus, or on a node that stopped reporting) the watts their agent still counts them at, its
    last limit: no cut can free those, so they are planned at them and the survivors are asked
    only for what the budget holds beyond. If even that cannot fit (a budget lowered since),
    they are planned at the minimum like any failed GPU, and the agent holds the difference."""
    if not nodes or min(nodes.values()) <= 0:
        raise ValueError(f"rack {rack!r} needs nodes with at least one GPU each, got {dict(nodes)}")
    if not parked <= nodes.keys():
        raise ValueError(f"parked nodes {sorted(parked - nodes.keys())} are not in rack {rack!r}")
    gpus = [(n, i) for n, count in sorted(nodes.items()) for i in range(count)]
    degraded = any(g in failed for g in gpus if g[0] not in parked)
    boost_w = min(policy.boost_cap_w, round(policy.base_w * max(boost_ratio, 1.0)))
    desired = {
        g: policy.min_w if g in failed or g[0] in parked
        else (boost_w if degraded else policy.base_w)
        for g in gpus
    }
    rack_budget = policy.budget(len(gpus))
    floors = dict.fromkeys(gpus, policy.min_w)
    held = {g: max(policy.min_w, w) for g, w in (stuck or {}).items() if g in failed}
    if sum((floors | held).values()) <= rack_budget:
        floors |= held
        desired |= held
    fitted = fit_budget(desired, floors, rack_budget)
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
            rack_budget_w=rack_budget,
            gpu_w={i: w for i, w in mine.items() if w != policy.base_w},
            ramp_step_w=policy.ramp_step_w,
        )
    return targets


def stage(
    desired: Mapping[str, PowerTarget],
    current: Mapping[str, PowerTarget | None],
    reported: Mapping[str, bool],
    named_racks: Mapping[str, str] | None = None,
) -> dict[str, PowerTarget]:
    """The targets to write now so that no rack goes over its budget while its shares move.

    `current` holds what the API holds per node (None: an object that does not parse, which
    counts as unknown; `named_racks` gives the rack such an object still names, if any),
    `reported` whether each node's agent reports the budget of its current target in effect.
    Agents act independently, so while a node has not reported, either its old or its new share
    may be in force. Hence:

    - a target whose share does not grow (a cut, or the same share split differently) is
      written at once;
    - a node without a (valid) target may still hold a share from an earlier one that nobody
      knows any more (its agent settles inside its last share): in a rack with other nodes it
      first gets its `entry` target (every GPU at its minimum: a cut, whatever it held) at once,
      and its real share later, as a raise; alone in its rack it gets its target at once;
    - a node at its entry target whose share shrinks gets the smaller entry target at once:
      its agent reports an entry in effect once its limits are within the entry's budget, not
      once every GPU is at its minimum (a GPU may refuse that cut), so the entry's budget is all
      that others' raises may count on;
    - a target whose share grows (a raise; an entry target's share counts as its floor for its
      own raise) is written only once every other node of its rack (and of the rack it leaves)
      reports its current target in effect and is neither written nor deleted in this pass
      (nor kept without being wanted: `plan_sync`); until then the node keeps its current
      target.

    When a raise goes out, every other node of the rack reports its limits within its current
    budget, which is at most its desired share (it is unchanged, or itself a raise: an entry
    larger than its real share is cut first), so the rack's sum is at most the sum of the
    desired shares, which `plan_rack` keeps within the rack budget, whatever share the raised
    node itself still runs at. A rack of one node (HGX) therefore never waits: its agent cuts
    before it raises within one step. Targets equal to the current ones are not written.
    """
    racks: dict[str, set[str]] = {}
    for node, target in [*desired.items(), *current.items()]:
        if target is not None:
            racks.setdefault(target.rack, set()).add(node)
    for node, rack in (named_racks or {}).items():
        racks.setdefault(rack, set()).add(node)

    def others(node: str) -> set[str]:
        now = current.get(node)
        return (racks[desired[node].rack] | (racks[now.rack] if now else set())) - {node}

    def share(target: PowerTarget) -> int:
        return 0 if target.at_floor else target.budget_w

    changed = {n for n, t in desired.items() if current.get(n) != t}
    entering = {n for n in changed if current.get(n) is None}
    entering |= {n for n in changed - entering
                 if current[n].at_floor and desired[n].budget_w < current[n].budget_w}
    raises = {n for n in changed - entering if desired[n].budget_w > share(current[n])}
    to_write = {n: desired[n] for n in changed - entering - raises}
    to_write |= {n: desired[n].entry() if others(n) else desired[n] for n in entering}
    # Nodes whose share in force is not known to be within their desired one: not reported
    # yet, written in this pass, or not wanted (losing their target, or kept by `plan_sync`).
    unsettled = {n for n in current if not reported.get(n) or n not in desired} | set(to_write)
    for node in raises:
        if not others(node) & unsettled:
            to_write[node] = desired[node]
    return to_write


@dataclass(frozen=True)
class SyncPlan:
    """One pass of bringing a job's targets to what it wants: what to write, what to delete,
    and the nodes not at their wanted target yet (raises held back until the cuts they depend
    on are reported in effect, entry targets written first, or a rack's raises held while a
    node the job no longer wants still holds a share in it)."""

    write: dict[str, PowerTarget]
    delete: tuple[str, ...]
    held: tuple[str, ...]


def plan_sync(objects: Iterable[Mapping[str, Any]], desired: Sequence[PowerTarget]) -> SyncPlan:
    """`stage` over the job's target objects as the API holds them (spec, generation, and the
    agents' status): an object that does not parse is rewritten.

    A node the job no longer wants settles inside its last share once its target is deleted,
    and goes on drawing that much in its rack. So its target is deleted only when no node of
    its rack is wanted any more (the job left the rack, or ended); until then it is kept,
    settled (`PowerTarget.settled`: no boost, the same share), and the rack's raises wait: the
    shares wanted for the rack's other nodes do not count it. The caller's plan lets them
    proceed by planning the node again, parked (`plan_rack(..., parked=...)`)."""
    current: dict[str, PowerTarget | None] = {}
    reported: dict[str, bool] = {}
    named: dict[str, str] = {}  # the rack an object that does not parse still names
    for obj in objects:
        node = obj["metadata"]["name"]
        try:
            current[node] = parse_object(obj, node)
        except InvalidTarget:  # rewritten from `desired`, and unsettled until reported again
            current[node] = None
            spec = obj.get("spec")
            rack = spec.get("rack") if isinstance(spec, dict) else None
            if isinstance(rack, str):
                named[node] = rack
        reported[node] = budget_in_effect(obj)
    wanted = {t.node: t for t in desired}
    if len(wanted) != len(desired):
        raise ValueError("desired names a node more than once")
    planned = {t.rack for t in desired}
    kept = {n for n in set(current) - set(wanted)
            if (t.rack if (t := current[n]) is not None else named.get(n)) in planned}
    write = stage(wanted, current, reported, {n: named[n] for n in kept & named.keys()})
    write |= {n: t.settled() for n in kept if (t := current[n]) is not None and t.settled() != t}
    # Raises not written, and entry targets written in place of what is wanted.
    held = sorted(n for n, t in wanted.items() if write.get(n, current.get(n)) != t)
    return SyncPlan(write, tuple(sorted(set(current) - set(wanted) - kept)), tuple(held))


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
