"""Property: for any GPUs (each with its own range and default), any sequence of operator requests,
targets deleted or refused, and faults (listing, reads, sets, the whole library), on a driver that
rounds limits to whole watts, the agent keeps every limit inside its device's range, raises by at
most one ramp step while a target asks for a boost, brings an over-budget node under the budget in
one step whenever that is reachable, raises no GPU above the base cap once its target is gone, and
on the way out leaves every GPU at or below the base cap inside the node's last share, and every
GPU at the base cap when the share holds them all there."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from powertest import make_target

from tessera_agents.power.agent import Agent
from tessera_agents.power.sim_backend import FAULTS, OPERATIONS, SimBackend, SimGpuSpec
from tessera_agents.power.state import ManagedGpus
from tessera_contracts.powertarget import to_object

pytestmark = pytest.mark.power

GPUS = 4
AGENT_STEP_W = 50


class Source:
    obj = None

    def fetch(self):
        return self.obj

    def report(self, status, uid) -> None:
        """Status writes are the channel's business: not part of this property."""


@st.composite
def specs(draw) -> SimGpuSpec:
    lo = draw(st.integers(100, 300))
    hi = draw(st.integers(lo + 50, 1000))
    return SimGpuSpec(min_w=lo, max_w=hi, default_w=draw(st.integers(lo, hi)))


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
                                          st.sampled_from(OPERATIONS))),
    st.tuples(st.sampled_from(["delete", "refuse"]), st.none()),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(specs(), min_size=GPUS, max_size=GPUS), st.lists(events, min_size=1, max_size=25))
def test_range_ramp_budget_settling_and_leaving_hold_for_any_sequence(
    tmp_path: Path, gpu_specs: list[SimGpuSpec], sequence
) -> None:
    sim, source = SimBackend(node="node-a", spec=gpu_specs), Source()
    agent = Agent("node-a", sim, source, ManagedGpus(tmp_path / f"{id(sequence)}.json"),
                  AGENT_STEP_W * 1000)
    agent.step()  # no target yet: nothing changes, but every GPU's limit is known from here on
    faults: dict[tuple[int, str], str] = {}
    for kind, arg in sequence:
        if kind == "request":
            source.obj = to_object(make_target(rack_budget_w=10**6, **arg))
        elif kind == "fault":
            index, fault, op = arg
            sim.inject(index, fault, op)
            faults.pop((index, op), None) if fault is None else faults.update({(index, op): fault})
        elif kind == "delete":
            source.obj = None
        elif source.obj is not None:  # refused: a field no agent accepts
            source.obj["spec"]["budgetWatts"] = "all of it"
        before = sim.limits_mw()
        agent.step()
        after = sim.limits_mw()

        assert sim.rejected() == [], "the agent asked for a limit outside the device's range"
        assert all(s.min_w * 1000 <= mw <= s.max_w * 1000 for s, mw in zip(gpu_specs, after,
                                                                          strict=True))
        target = agent.target or agent.settled()
        if target is None:
            assert after == before, "without any target nothing may change"
            continue
        if agent.target is None:  # settling: no GPU raised above the base cap
            assert all(a <= max(b, s.min_w * 1000, target.base_w * 1000)
                       for a, b, s in zip(after, before, gpu_specs, strict=True))
        if agent.target is not None:  # settling raises at once, to the base cap at most
            step_w = target.ramp_step_w or AGENT_STEP_W
            assert all(a - b <= step_w * 1000 for a, b in zip(after, before, strict=True)), "ramp"
        budget = target.budget_w * 1000
        assert sum(after) <= max(budget, sum(before)), "a step raised an over-budget node"
        if "unavailable" in faults.values():
            assert after == before, "with the library gone nothing may change"
            continue
        # A GPU the agent cannot read or set keeps its limit; every other can go to its minimum
        # at once: if that meets the budget, the budget is met after this one step.
        stuck = {i for (i, op) in faults}
        floor = sum(after[i] if i in stuck else s.min_w * 1000 for i, s in enumerate(gpu_specs))
        if floor <= budget:
            assert sum(after) <= budget, "the budget was reachable but not met in one step"

    for index, op in faults:
        sim.inject(index, None, op)
    before, share = sim.limits_mw(), agent.settled()
    assert agent.leave() == []  # SIGTERM
    after = sim.limits_mw()
    if share is None:  # never given a budget: the defaults
        assert after == [s.default_w * 1000 for s in gpu_specs] and agent.managed.gpus == {}
        return
    floors = [s.min_w * 1000 for s in gpu_specs]
    assert all(a <= max(share.base_w * 1000, f) for a, f in zip(after, floors, strict=True))
    assert sum(after) <= max(share.budget_w * 1000, sum(floors))
    # the base cap inside each device's range: where the share holds every GPU there, none is
    # left below it (a GPU cordoned at its minimum, or ramping, included)
    bases = [min(max(share.base_w, s.min_w), s.max_w) * 1000 for s in gpu_specs]
    if sum(bases) <= share.budget_w * 1000:
        assert after == bases, "left below the base cap"
