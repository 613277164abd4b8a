"""Property: for any sequence of operator requests, faults and clock jumps, the agent keeps every
limit inside its device's range and the node's limits within the budget whenever it can."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from powertest import NOW, make_target

from power_controller.agent import Agent
from power_controller.sim_backend import FAULTS, SimBackend, SimGpuSpec
from power_controller.state import ManagedGpus
from power_controller.targets import to_object

pytestmark = pytest.mark.power

SPEC = SimGpuSpec(min_w=200, max_w=700, default_w=700)
GPUS = 4


class Source:
    obj = None

    def fetch(self):
        return self.obj


requests = st.fixed_dictionaries({
    "budget_w": st.integers(1, 4000),
    "base_w": st.integers(1, 1500),
    "gpu_w": st.dictionaries(st.integers(0, GPUS + 1), st.integers(1, 3000), max_size=GPUS),
    "ramp_step_w": st.none() | st.integers(1, 400),
})
events = st.one_of(
    st.tuples(st.just("request"), requests),
    st.tuples(st.just("fault"), st.tuples(st.integers(0, GPUS - 1),
                                          st.sampled_from([None, *sorted(FAULTS)]),
                                          st.sampled_from(["read", "set", "any"]))),
    st.tuples(st.just("wait"), st.integers(0, 120)),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(events, min_size=1, max_size=25))
def test_budget_and_device_range_hold_for_any_sequence(tmp_path: Path, sequence) -> None:
    sim, source = SimBackend(GPUS, "node-a", SPEC), Source()
    clock = {"now": NOW}
    agent = Agent("node-a", sim, source, ManagedGpus(tmp_path / f"{id(sequence)}.json"),
                  50_000, lambda: clock["now"])
    faults: dict[tuple[int, str], str] = {}
    for kind, arg in sequence:
        if kind == "request":
            source.obj = to_object(make_target(renew_time=clock["now"], rack_budget_w=10**6, **arg))
        elif kind == "fault":
            index, fault, op = arg
            sim.inject(index, fault, op)
            faults.pop((index, op), None) if fault is None else faults.update({(index, op): fault})
        else:
            clock["now"] += timedelta(seconds=arg)
        before = sim.limits_mw()
        agent.step()
        after = sim.limits_mw()

        assert sim.rejected() == [], "the agent asked for a limit outside the device's range"
        assert all(SPEC.min_w * 1000 <= mw <= SPEC.max_w * 1000 for mw in after)
        target = agent.target
        if target is None or target.stale(clock["now"]):
            assert after == before, "without a fresh target nothing may change"
            continue
        budget = target.budget_w * 1000
        assert sum(after) <= max(budget, sum(before)), "a step raised an over-budget node"
        # GPUs the agent cannot set keep their limit; everything else can go to the minimum.
        stuck = {i for (i, op), f in faults.items() if op in ("set", "any") or f == "unavailable"}
        stuck |= {i for (i, op) in faults if op == "read"}
        floor = sum(after[i] if i in stuck else SPEC.min_w * 1000 for i in range(GPUS))
        if floor <= budget:
            assert sum(after) <= budget, "the budget was reachable but not met"
