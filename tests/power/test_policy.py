"""The agent's pure policy: device bounds, the budget, the ramp, holding without a target, and
raises admitted only against the limits the GPUs hold after their cuts."""

from __future__ import annotations

import pytest
from powertest import make_target

from tessera_core.power_policy import DeviceView, decide, decide_after_cuts, fit_budget

pytestmark = pytest.mark.power

W = 1000  # milliwatts per watt


def _gpus(*limits_w: int, lo: int = 200, hi: int = 700) -> list[DeviceView]:
    return [DeviceView(i, lo * W, hi * W, w * W) for i, w in enumerate(limits_w)]


def test_fit_budget_cuts_the_highest_requests_first() -> None:
    desired = {0: 700, 1: 700, 2: 500, 3: 200}
    fitted = fit_budget(desired, dict.fromkeys(desired, 200), 1900)
    assert fitted == {0: 600, 1: 600, 2: 500, 3: 200}


def test_fit_budget_returns_floors_when_nothing_fits() -> None:
    assert fit_budget({0: 700, 1: 700}, {0: 200, 1: 200}, 300) == {0: 200, 1: 200}


def test_targets_are_clamped_into_each_devices_range() -> None:
    t = make_target(budget_w=10_000, base_w=5000, gpu_w={1: 1})
    d = decide(_gpus(500, 500, 500), t, step_mw=10_000 * W)
    assert d.goals == {0: 700 * W, 1: 200 * W, 2: 700 * W}


def test_over_budget_request_is_fitted_and_cuts_apply_at_once() -> None:
    t = make_target(budget_w=2000, base_w=700, gpu_w={3: 200})
    d = decide(_gpus(700, 700, 700, 700), t, step_mw=50 * W)
    assert sum(d.goals.values()) <= 2000 * W
    assert d.lower == d.goals and not d.raise_  # cutting is the safe direction: no ramp


def test_raises_are_ramped_by_the_step() -> None:
    t = make_target(budget_w=4000, gpu_w={0: 650, 1: 520})
    d = decide(_gpus(500, 500), t, step_mw=50 * W)
    assert d.raise_ == {0: 550 * W, 1: 520 * W}
    assert d.goals == {0: 650 * W, 1: 520 * W}


def test_targets_ramp_step_overrides_the_agents() -> None:
    t = make_target(budget_w=4000, gpu_w={0: 650}, ramp_step_w=10)
    assert decide(_gpus(500), t, step_mw=50 * W).raise_ == {0: 510 * W}


def test_no_target_holds_everything() -> None:
    held = decide(_gpus(700, 300), None, 50 * W)
    assert held.holding and not held.lower and not held.raise_


def test_uncontrollable_gpus_count_against_the_budget_at_their_limit() -> None:
    gpus = [*_gpus(500, 500), DeviceView(2, 0, 0, 700 * W, controllable=False)]
    d = decide(gpus, make_target(budget_w=1700, gpu_w={0: 700, 1: 700}), 500 * W)
    assert sum(d.goals.values()) == 1000 * W and set(d.goals) == {0, 1}


def test_infeasible_budget_puts_everything_at_its_minimum_and_says_so() -> None:
    d = decide(_gpus(500, 500), make_target(budget_w=300), 50 * W)
    assert d.reason.startswith("infeasible") and d.lower == {0: 200 * W, 1: 200 * W}


def test_goals_and_raises_are_whole_watts() -> None:
    # 1400 W over three GPUs is 466.67 W each: a driver rounding to the nearest watt would land
    # at 1401 W, so the agent must ask for whole watts that fit.
    t = make_target(budget_w=1400, base_w=700)
    d = decide(_gpus(700, 700, 700), t, 50 * W)
    assert d.goals == {0: 466 * W, 1: 466 * W, 2: 466 * W}
    odd = [DeviceView(0, 200_500, 699_500, 500_250)]  # a part with fractional constraints
    d = decide(odd, make_target(budget_w=4000, base_w=5000), 50 * W)
    assert d.goals == {0: 699 * W} and d.raise_ == {0: 550 * W}
    assert decide(odd, make_target(base_w=1), 50 * W).goals == {0: 201 * W}


class Node:
    """GPUs for `decide_after_cuts`: each holds what it is asked, except those in `refusing`,
    which keep their limit, and those in `over`, which hold that many mW more than asked."""

    def __init__(self, *limits_w: int, refusing: set[int] = frozenset(),
                 over: dict[int, int] | None = None) -> None:
        self.devices = _gpus(*limits_w)
        self.limits = {d.index: d.limit_mw for d in self.devices}
        self.refusing, self.over, self.rounds = refusing, over or {}, 0

    def cut(self, cuts: dict[int, int]) -> dict[int, int]:
        self.rounds += 1
        for i, mw in cuts.items():
            if i not in self.refusing:
                self.limits[i] = mw + self.over.get(i, 0)
        return {i: self.limits[i] for i in cuts}

    def after(self, raises: dict[int, int]) -> list[int]:
        return [raises.get(i, mw) // W for i, mw in sorted(self.limits.items())]


@pytest.mark.hardening
def test_raises_are_admitted_against_what_gpus_hold_after_refusals_in_successive_rounds() -> None:
    """GPU 0 refuses its cut; the others are cut deeper, and then GPU 1 refuses that deeper cut.
    GPU 3, below its share, asks for a raise in every round: only the last round's, decided
    with both refusals counted, fits. Raising as the first round planned ends at 1,750 W, as
    the second at 1,700 W, on a 1,600 W budget that every GPU but the two can still meet."""
    node = Node(700, 400, 400, 200, refusing={0, 1})
    d = decide_after_cuts(node.devices, make_target(budget_w=1600, base_w=400), 500 * W,
                          node.cut)
    assert node.rounds == 3 and not d.lower and d.raise_ == {3: 250 * W}
    assert node.after(d.raise_) == [700, 400, 250, 250]


@pytest.mark.hardening
def test_a_gpu_that_holds_more_than_it_was_asked_counts_as_refusing() -> None:
    """A driver that rounds a cut up (or silently keeps part of it): the GPU is counted where it
    holds, and the budget is met by the others."""
    node = Node(700, 700, 700, 700, over={0: 30 * W})
    d = decide_after_cuts(node.devices, make_target(budget_w=1600, base_w=400), 50 * W,
                          node.cut)
    assert node.after(d.raise_) == [430, 390, 390, 390]
    assert sum(node.after(d.raise_)) <= 1600
