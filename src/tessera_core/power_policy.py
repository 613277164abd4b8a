"""The agent's pure power policy: from devices and a validated target to the limits to set.

Safety contract (power_controller/tessera_agents/README.md): every limit is inside its device's
[min, max]; the sum of the node's power limits never exceeds the target's budget when the budget
can be met at all;
raises are ramped by at most `step_mw` per decision while cuts apply at once (lowering power is the
safe direction); with no target nothing changes (the last safe state is held). Every limit asked for
is a whole watt (`WATT`), because the driver keeps whole watts and would round a fraction up as
readily as down. All powers in milliwatts. No I/O (`decide_after_cuts` makes its cuts through the
caller's function): the agent, the simulator and the tests drive this directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from tessera_contracts.powertarget import PowerTarget

WATT = 1000  # milliwatts: the driver's granularity
K = TypeVar("K")


@dataclass(frozen=True)
class DeviceView:
    """What the policy knows of one GPU. An uncontrollable GPU (lost, unreadable) keeps its
    believed limit and is counted against the budget at that value."""

    index: int
    min_mw: int
    max_mw: int
    limit_mw: int
    controllable: bool = True


@dataclass(frozen=True)
class Decision:
    """The limits to change now: `lower` first, then `raise_` (see `decide_after_cuts`)."""

    reason: str  # "apply", "hold: <why>", or "infeasible: <why>"
    goals: dict[int, int] = field(default_factory=dict)
    lower: dict[int, int] = field(default_factory=dict)
    raise_: dict[int, int] = field(default_factory=dict)

    @property
    def holding(self) -> bool:
        """Nothing is applied: no valid target."""
        return self.reason.startswith("hold")

    @property
    def infeasible(self) -> bool:
        """Even every GPU at its minimum exceeds the budget."""
        return self.reason.startswith("infeasible")


def clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def floor_to(value: int, quantum: int) -> int:
    return value // quantum * quantum


def ceil_to(value: int, quantum: int) -> int:
    return -(-value // quantum) * quantum


def fit_budget(
    desired: Mapping[K, int], floors: Mapping[K, int], budget: int, quantum: int = 1
) -> dict[K, int]:
    """Cut the highest requests first (water-filling from the top) until the sum fits `budget`.

    Returns `desired` unchanged when it fits, and `floors` when even they do not: nothing goes
    below its floor (the device minimum), so the caller must report that case. With `quantum`,
    the cut level is a multiple of it, so whole-quantum inputs give whole-quantum outputs.
    """
    if sum(desired.values()) <= budget:
        return dict(desired)

    def at(level: int) -> dict[K, int]:
        return {i: max(floors[i], min(d, level * quantum)) for i, d in desired.items()}

    lo, hi = 0, max(desired.values(), default=0) // quantum
    if sum(at(lo).values()) > budget:
        return {i: floors[i] for i in desired}
    while lo < hi:  # the highest level whose allocation still fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(at(mid).values()) <= budget else (lo, mid - 1)
    return at(lo)


def decide(devices: list[DeviceView], target: PowerTarget | None, step_mw: int) -> Decision:
    """The limits to move toward `target` in one control step (the target's ramp step, if it
    sets one, overrides `step_mw`)."""
    if target is None:
        return Decision("hold: no valid target")
    if target.ramp_step_w is not None:
        step_mw = target.ramp_step_w * 1000
    fixed = sum(d.limit_mw for d in devices if not d.controllable)
    live = {d.index: d for d in devices if d.controllable}
    # Whole watts inside the device's range (a fractional minimum rounds up into it).
    floors = {i: ceil_to(d.min_mw, WATT) for i, d in live.items()}
    desired = {
        i: clamp(target.watts_for(i) * WATT, floors[i], floor_to(d.max_mw, WATT))
        for i, d in live.items()
    }
    budget = target.budget_w * WATT - fixed
    goals = fit_budget(desired, floors, budget, WATT)
    reason = "apply"
    if sum(goals.values()) > budget:
        reason = f"infeasible: minimum limits need {sum(goals.values()) + fixed} mW > budget"
    lower = {i: g for i, g in goals.items() if g < live[i].limit_mw}
    raise_ = {
        i: min(g, floor_to(live[i].limit_mw + step_mw, WATT))
        for i, g in goals.items()
        if g > live[i].limit_mw
    }
    return Decision(reason, goals, lower, {i: v for i, v in raise_.items() if v > live[i].limit_mw})


def decide_after_cuts(
    devices: list[DeviceView],
    target: PowerTarget | None,
    step_mw: int,
    cut: Callable[[dict[int, int]], Mapping[int, int]],
) -> Decision:
    """Decide, make the cuts through `cut`, and admit raises only against the limits the GPUs
    then hold.

    `cut` applies cuts and returns the limit each GPU it tried holds afterwards (read back; the
    higher of its old and asked limit when that cannot be known). A GPU left above what it was
    asked refused its cut: it is counted where it is, uncontrollable, and the others are cut
    deeper, round after round, until a decision needs no cut. That decision's raises fit the
    budget with every GPU where it really is, however many GPUs refused in however many rounds.
    Each round ends the loop or fixes one more GPU, so there are at most len(devices) + 1.
    Returns the last decision (`lower` empty: its cuts are made).
    """
    views = list(devices)
    while True:
        decision = decide(views, target, step_mw)
        if not decision.lower:
            return decision
        held = cut(decision.lower)
        views = [_after_cut(v, decision.lower, held) for v in views]


def _after_cut(view: DeviceView, asked: Mapping[int, int], held: Mapping[int, int]) -> DeviceView:
    if view.index not in asked:
        return view
    now = held[view.index]
    if now > asked[view.index]:
        return DeviceView(view.index, 0, 0, now, controllable=False)
    return replace(view, limit_mw=now)
