"""The agent's control step on simulated GPUs: boost, release, faults, outages and restores."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
from powertest import NOW, make_target
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from power_controller.agent import Agent
from power_controller.metrics import AgentCollector
from power_controller.sim_backend import SimBackend
from power_controller.state import ManagedGpus
from power_controller.targets import to_object

pytestmark = pytest.mark.power

W = 1000


class Source:
    """The agent's view of the API: an object, nothing (404), or an outage."""

    def __init__(self, obj=None) -> None:
        self.obj, self.down = obj, False

    def fetch(self):
        if self.down:
            raise ConnectionRefusedError("apiserver down")
        return self.obj


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self):
        return self.now


def _agent(tmp_path: Path, gpus: int = 4, **target) -> tuple[Agent, SimBackend, Source, Clock]:
    sim, clock = SimBackend(gpus, "node-a"), Clock()
    source = Source(to_object(make_target(**target)) if target else None)
    agent = Agent("node-a", sim, source, ManagedGpus(tmp_path / "state.json"), 50 * W, clock)
    return agent, sim, source, clock


def _run(agent: Agent, clock: Clock, steps: int) -> None:
    for _ in range(steps):
        agent.step()
        clock.now += timedelta(seconds=5)


def test_base_cap_then_boost_ramps_then_release(tmp_path: Path) -> None:
    agent, sim, source, clock = _agent(tmp_path, budget_w=2300, base_w=500)
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4  # cut from the 700 W default at once
    source.obj = to_object(make_target(budget_w=2300, base_w=500, renew_time=clock.now,
                                       gpu_w={0: 200, 1: 700, 2: 700, 3: 700}))
    agent.step()
    assert sim.limits_mw() == [200 * W, 550 * W, 550 * W, 550 * W]  # one 50 W step
    _run(agent, clock, 5)
    assert sim.limits_mw() == [200 * W, 700 * W, 700 * W, 700 * W]
    assert [g.boosted for g in agent.status.gpus] == [False, True, True, True]
    source.obj = to_object(make_target(budget_w=2300, base_w=500, renew_time=clock.now))
    agent.step()
    assert sim.limits_mw() == [250 * W, 500 * W, 500 * W, 500 * W]  # cuts at once, raise ramped
    _run(agent, clock, 5)
    assert sim.limits_mw() == [500 * W] * 4


def test_a_gpu_refusing_its_cut_makes_the_others_cut_deeper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, sim, _, clock = _agent(tmp_path, budget_w=2100, base_w=500, gpu_w={1: 600, 2: 600})
    sim.inject(0, "no_permission", op="set")  # GPU 0 stays at its 700 W default
    with caplog.at_level(logging.WARNING):
        _run(agent, clock, 3)
    assert "NoPermission" in caplog.text and agent.status.errors["NoPermission"] == 3
    assert [round(mw / W) for mw in sim.limits_mw()] == [700, 467, 467, 467]
    assert sum(sim.limits_mw()) <= 2100 * W
    sim.inject(0, None, op="set")
    _run(agent, clock, 4)
    assert sim.limits_mw() == [500 * W, 550 * W, 550 * W, 500 * W]


def test_lost_gpu_is_counted_at_its_last_known_limit(tmp_path: Path) -> None:
    agent, sim, source, clock = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    sim.inject(3, "gpu_lost")
    source.obj = to_object(make_target(budget_w=2000, base_w=500, renew_time=NOW,
                                       gpu_w={0: 700, 1: 700, 2: 700}))
    _run(agent, clock, 6)
    assert sim.limits_mw()[3] == 500 * W
    assert sum(sim.limits_mw()) <= 2000 * W and sim.limits_mw()[:3] == [500 * W] * 3
    assert agent.status.gpus[3].limit_mw is None and agent.status.errors["GpuLost"] >= 1


@pytest.mark.parametrize("fault", ["not_supported", "invalid_argument"])
def test_set_errors_leave_the_gpu_where_it_was(tmp_path: Path, fault: str) -> None:
    agent, sim, _, _ = _agent(tmp_path, budget_w=4000, base_w=500)
    sim.inject(2, fault, op="set")
    agent.step()
    assert sim.limits_mw() == [500 * W, 500 * W, 700 * W, 500 * W]


def test_backend_unavailable_holds_and_reports(tmp_path: Path) -> None:
    agent, sim, _, _ = _agent(tmp_path, budget_w=2000)
    for i in range(4):
        sim.inject(i, "unavailable")
    status = agent.step()
    assert sim.limits_mw() == [700 * W] * 4 and status.holding


def test_operator_outage_keeps_the_last_target_until_stale_then_holds(tmp_path: Path) -> None:
    agent, sim, source, clock = _agent(tmp_path, budget_w=2600, base_w=500, ttl_s=30,
                                       gpu_w={0: 700})
    sim.set_limit(0, 500 * W)
    _run(agent, clock, 1)
    source.down = True
    _run(agent, clock, 2)  # still fresh: the ramp goes on without the API server
    assert sim.limits_mw()[0] == 650 * W
    clock.now = NOW + timedelta(seconds=31)
    _run(agent, clock, 3)  # stale: held, neither released nor raised further
    assert sim.limits_mw() == [650 * W, 500 * W, 500 * W, 500 * W] and agent.status.holding
    assert agent.status.errors["ConnectionRefusedError"] == 5


def test_invalid_or_missing_target_holds(tmp_path: Path) -> None:
    agent, sim, source, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    source.obj = to_object(make_target(budget_w=2000, base_w=500, gpu_w={0: 650}))
    source.obj["spec"]["gpus"][0]["watts"] = "650"
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4 and agent.status.holding
    source.obj = None
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4 and agent.status.holding


def test_restore_puts_defaults_back_even_from_a_new_agent(tmp_path: Path) -> None:
    agent, sim, _, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4
    # A new agent (after a crash) only has the file on the host to go by.
    successor = Agent("node-a", sim, Source(), ManagedGpus.load(tmp_path / "state.json"))
    sim.inject(1, "gpu_lost")
    assert successor.restore() == [sim.gpus()[1].uuid]  # kept for the next attempt
    assert sim.limits_mw() == [700 * W, 500 * W, 700 * W, 700 * W]
    sim.inject(1, None)
    assert successor.restore() == []
    assert sim.limits_mw() == [700 * W] * 4
    assert ManagedGpus.load(tmp_path / "state.json").defaults == {}


def test_metrics_render_per_gpu_and_per_rack(tmp_path: Path) -> None:
    agent, sim, _, _ = _agent(tmp_path, budget_w=2300, base_w=500, gpu_w={1: 520})
    sim.set_demand(0, 300)
    agent.step()
    registry = CollectorRegistry()
    registry.register(AgentCollector(lambda: agent.status))
    samples = {(s.name, s.labels.get("gpu")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    assert samples[("tessera_gpu_power_limit_watts", "1")] == 520
    assert samples[("tessera_gpu_power_target_watts", "1")] == 520
    assert samples[("tessera_gpu_power_usage_watts", "0")] == 300
    assert samples[("tessera_gpu_power_boosted", "1")] == 1
    assert samples[("tessera_gpu_power_boosted", "0")] == 0
    assert samples[("tessera_rack_power_budget_watts", None)] == 2300
    assert samples[("tessera_rack_power_limit_watts", None)] == 2020
    assert samples[("tessera_rack_power_usage_watts", None)] == 300 + 520 + 500 + 500
    assert samples[("tessera_power_agent_holding", None)] == 0


def test_a_gpu_whose_change_cannot_be_recorded_is_not_changed(tmp_path: Path) -> None:
    agent, sim, _, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    (tmp_path / "state.json").mkdir()  # the host record cannot be written
    agent.step()
    assert sim.limits_mw() == [700 * W] * 4 and agent.status.errors["IsADirectoryError"] == 4
