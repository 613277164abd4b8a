"""The agent on simulated GPUs (and NVML over fake devices): boost, release, faults, outages,
status reports, settling when nothing asks for a boost, leaving, restores and restarts."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNvml
from powertest import make_target
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tessera_agents.power.agent import Agent
from tessera_agents.power.devices import GpuLost, NoPermission
from tessera_agents.power.main import _parser, main, sim_backend
from tessera_agents.power.metrics import AgentCollector
from tessera_agents.power.nvml_backend import NvmlBackend
from tessera_agents.power.sim_backend import SimBackend
from tessera_agents.power.state import ManagedGpus
from tessera_contracts.powertarget import to_object

pytestmark = pytest.mark.power

W = 1000


class Source:
    """The agent's view of the API: an object, nothing (404), or an outage; and the statuses
    the agent wrote."""

    def __init__(self, obj=None) -> None:
        self.obj, self.down, self.reports = obj, False, []

    def fetch(self):
        if self.down:
            raise ConnectionRefusedError("apiserver down")
        return self.obj

    def report(self, status, uid) -> None:
        if self.down:
            raise ConnectionRefusedError("apiserver down")
        self.reports.append(status)


def _agent(tmp_path: Path, gpus: int = 4, **target) -> tuple[Agent, SimBackend, Source]:
    sim = SimBackend(gpus, "node-a")
    source = Source(to_object(make_target(**target)) if target else None)
    agent = Agent("node-a", sim, source, ManagedGpus(tmp_path / "state.json"), 50 * W)
    return agent, sim, source


def _run(agent: Agent, steps: int) -> None:
    for _ in range(steps):
        agent.step()


def test_base_cap_then_boost_ramps_then_release(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=2300, base_w=500)
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4  # cut from the 700 W default at once
    source.obj = to_object(make_target(budget_w=2300, base_w=500,
                                       gpu_w={0: 200, 1: 700, 2: 700, 3: 700}))
    agent.step()
    assert sim.limits_mw() == [200 * W, 550 * W, 550 * W, 550 * W]  # one 50 W step
    _run(agent, 5)
    assert sim.limits_mw() == [200 * W, 700 * W, 700 * W, 700 * W]
    assert [g.boosted for g in agent.status.gpus] == [False, True, True, True]
    source.obj = to_object(make_target(budget_w=2300, base_w=500))
    agent.step()
    assert sim.limits_mw() == [250 * W, 500 * W, 500 * W, 500 * W]  # cuts at once, raise ramped
    _run(agent, 5)
    assert sim.limits_mw() == [500 * W] * 4


def test_a_gpu_refusing_its_cut_makes_the_others_cut_deeper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2100, base_w=500, gpu_w={1: 600, 2: 600})
    sim.inject(0, "no_permission", op="set")  # GPU 0 stays at its 700 W default
    with caplog.at_level(logging.WARNING):
        _run(agent, 3)
    assert "NoPermission" in caplog.text and agent.status.errors["NoPermission"] == 3
    # 1400 W over three GPUs: 466 W each, whole watts, so no driver rounding can break the budget.
    assert sim.limits_mw() == [700 * W, 466 * W, 466 * W, 466 * W]
    sim.inject(0, None, op="set")
    _run(agent, 4)
    assert sim.limits_mw() == [500 * W, 550 * W, 550 * W, 500 * W]


def test_lost_gpu_is_counted_at_its_last_known_limit(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    sim.inject(3, "gpu_lost")
    source.obj = to_object(make_target(budget_w=2000, base_w=500,
                                       gpu_w={0: 700, 1: 700, 2: 700}))
    _run(agent, 6)
    assert sim.limits_mw()[3] == 500 * W
    assert sum(sim.limits_mw()) <= 2000 * W and sim.limits_mw()[:3] == [500 * W] * 3
    assert agent.status.gpus[3].limit_mw is None and agent.status.errors["GpuLost"] >= 1


class LostInItsCut:
    """The simulated GPUs, GPU `index` refusing its cut and then not answering (it fell off the
    bus in the call): the agent cannot read back the limit it holds."""

    def __init__(self, sim: SimBackend, index: int) -> None:
        self.sim, self.index, self.refused = sim, index, False

    def gpus(self):
        return self.sim.gpus()

    def read(self, index: int):
        if index == self.index and self.refused:
            raise GpuLost(f"GPU {index}: lost", index)
        return self.sim.read(index)

    def set_limit(self, index: int, milliwatts: int) -> None:
        if index == self.index:
            self.refused = True
            raise NoPermission(f"GPU {index}: refused", index)
        self.sim.set_limit(index, milliwatts)

    def restore_default(self, uuid: str) -> int:
        return self.sim.restore_default(uuid)

    def close(self) -> None:
        self.sim.close()


@pytest.mark.hardening
def test_a_refused_cut_that_cannot_be_read_back_counts_at_the_old_limit(tmp_path: Path) -> None:
    """GPU 0 at its 700 W default refuses its cut to 500 W and cannot be read back: it counts
    at the higher of its old and asked limits, 700 W, and the others are cut deeper in the same
    step, so the node holds its 2,000 W budget with GPU 0 where it really is."""
    sim = SimBackend(4, "node-a")
    source = Source(to_object(make_target(budget_w=2000, base_w=500)))
    agent = Agent("node-a", LostInItsCut(sim, 0), source, ManagedGpus(tmp_path / "state.json"),
                  50 * W)
    agent.step()
    assert sim.limits_mw() == [700 * W, 433 * W, 433 * W, 433 * W]
    assert sum(sim.limits_mw()) <= 2000 * W


@pytest.mark.parametrize("fault", ["not_supported", "invalid_argument"])
def test_set_errors_leave_the_gpu_where_it_was(tmp_path: Path, fault: str) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=4000, base_w=500)
    sim.inject(2, fault, op="set")
    agent.step()
    assert sim.limits_mw() == [500 * W, 500 * W, 700 * W, 500 * W]


def test_backend_unavailable_holds_and_reports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2000)
    sim.inject(0, "unavailable")  # the library itself: nothing can be listed
    with caplog.at_level(logging.WARNING):
        agent.step()
        agent.step()
    assert sim.limits_mw() == [700 * W] * 4 and agent.status.holding
    assert agent.status.reason.startswith("hold: ") and agent.status.gpus == ()
    assert caplog.text.count("backend: BackendUnavailable") == 1  # logged once, not every step
    assert _metrics(agent)[("tessera_power_agent_errors_total", None)] == 2
    sim.inject(0, None)
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4


def test_api_outage_keeps_the_last_target_in_force(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=2600, base_w=500, gpu_w={0: 700})
    sim.set_limit(0, 500 * W)
    _run(agent, 1)
    source.down = True
    _run(agent, 3)
    assert sim.limits_mw() == [700 * W, 500 * W, 500 * W, 500 * W] and not agent.status.holding
    assert agent.status.errors["ConnectionRefusedError"] == 3


def test_an_invalid_then_deleted_target_settles_at_base_inside_the_last_share(
    tmp_path: Path,
) -> None:
    """No boost outlives its target, and no GPU goes back to its 700 W default on a budgeted
    node: the node settles at the base cap, inside the last budget share it was given."""
    agent, sim, source = _agent(tmp_path, budget_w=1900, base_w=450,
                                       gpu_w={0: 650, 1: 250})
    _run(agent, 6)
    assert sim.limits_mw() == [650 * W, 250 * W, 450 * W, 450 * W]
    source.obj = to_object(make_target(budget_w=1900, base_w=450, gpu_w={0: 650}))
    source.obj["spec"]["gpus"][0]["watts"] = "650"
    source.obj["metadata"]["generation"] = 4
    agent.step()
    # cut and raised at once: the settled level is inside the share, with no job left to draw it
    assert sim.limits_mw() == [450 * W] * 4
    assert source.reports[-1]["state"] == "Settled"
    assert "watts must be an integer" in source.reports[-1]["message"]
    assert source.reports[-1]["appliedGeneration"] is None
    source.obj = None  # deleted
    agent.step()
    assert sim.limits_mw() == [450 * W] * 4 and agent.status.settled
    assert _metrics(agent)[("tessera_power_agent_settled", None)] == 1


def test_settling_fits_the_share_when_base_caps_do_not(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=1600, base_w=500,
                                       gpu_w={0: 200, 1: 200, 2: 600, 3: 600})
    _run(agent, 3)
    assert sim.limits_mw() == [200 * W, 200 * W, 600 * W, 600 * W]
    source.obj = None
    for _ in range(6):
        agent.step()
        assert sum(sim.limits_mw()) <= 1600 * W
    assert sim.limits_mw() == [400 * W] * 4


def test_a_node_never_given_a_share_holds_without_a_target(tmp_path: Path) -> None:
    agent, sim, _ = _agent(tmp_path)
    agent.step()
    assert sim.limits_mw() == [700 * W] * 4 and agent.status.holding


def test_status_reports_the_generation_whose_budget_is_in_effect(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=2200, base_w=500, gpu_w={0: 650})
    source.obj["metadata"]["generation"] = 7
    sim.set_limit(0, 500 * W)
    agent.step()  # the others cut from their 700 W defaults at once, GPU 0 raised by one step
    assert source.reports == [{
        "observedGeneration": 7, "appliedGeneration": 7, "state": "Ramping",
        "message": "within budget, raising toward the targets", "limitWatts": 2050,
        "gpus": [{"index": 0, "limitWatts": 550}, {"index": 1, "limitWatts": 500},
                 {"index": 2, "limitWatts": 500}, {"index": 3, "limitWatts": 500}]}]
    _run(agent, 5)
    assert [r["state"] for r in source.reports] == ["Ramping", "Ramping", "Applied"]  # changes

    # Two GPUs refuse their cuts: the others go to their minimum, and the budget cannot be met.
    source.obj = to_object(make_target(budget_w=1000, base_w=500, gpu_w={0: 650}))
    source.obj["metadata"]["generation"] = 8
    for i in (1, 2):
        sim.inject(i, "no_permission", op="set")
    agent.step()
    assert sim.limits_mw() == [200 * W, 500 * W, 500 * W, 200 * W]
    assert {k: source.reports[-1][k] for k in ("observedGeneration", "appliedGeneration",
                                               "state")} == {
        "observedGeneration": 8, "appliedGeneration": None, "state": "Infeasible"}
    for i in (1, 2):
        sim.inject(i, None, op="set")
    agent.step()
    assert source.reports[-1]["appliedGeneration"] == 8 and sum(sim.limits_mw()) <= 1000 * W


@pytest.mark.hardening
@pytest.mark.parametrize(("start_w", "ramp_w", "end_w"), [
    # No raise: GPU 1's refusal of the second round's cut must be made up by a third round
    # (without one the node stays at 1,700 W, step after step).
    ((700, 400, 400, 400), None, [700, 400, 250, 250]),
    # GPU 3 asks for a raise in every round: admitted only against what the GPUs then hold
    # (1,700 W with the second round's raise, 1,750 W with the first's).
    ((700, 400, 400, 200), 500, [700, 400, 250, 250]),
])
def test_gpus_refusing_cuts_in_successive_rounds_keep_the_node_within_its_budget(
    tmp_path: Path, start_w: tuple[int, ...], ramp_w: int | None, end_w: list[int]
) -> None:
    agent, sim, source = _agent(tmp_path)
    for i, w in enumerate(start_w):
        sim.set_limit(i, w * W)
    source.obj = to_object(make_target(budget_w=1600, base_w=400, ramp_step_w=ramp_w))
    sim.inject(0, "no_permission", op="set")
    sim.inject(1, "no_permission", op="set")
    for _ in range(3):
        agent.step()
        assert sim.limits_mw() == [w * W for w in end_w]
        assert sim.rejected() == []
    assert source.reports[-1]["state"] == "Applied" and source.reports[-1]["limitWatts"] == 1600


@pytest.mark.hardening
def test_leaving_with_gpus_refusing_cuts_in_successive_rounds_keeps_the_share(
    tmp_path: Path,
) -> None:
    """On SIGTERM the share holds as in a step: GPUs 0, 2 and 3 back at their 700 W default
    (a driver reload) and GPUs 0 and 1 refusing every change; cuts that stop after one deeper
    round leave 1,700 W on the 1,600 W share."""
    agent, sim, _ = _agent(tmp_path, budget_w=1600, base_w=400)
    agent.step()
    for i in (0, 2, 3):
        sim.restore_default(sim.gpus()[i].uuid)
    sim.inject(0, "no_permission", op="set")
    sim.inject(1, "no_permission", op="set")
    assert agent.leave() == sorted(g.uuid for g in sim.gpus()[:2])
    assert sim.limits_mw() == [700 * W, 400 * W, 250 * W, 250 * W]


def test_a_failed_status_write_is_retried_on_the_next_step(tmp_path: Path) -> None:
    agent, sim, source = _agent(tmp_path, budget_w=2000, base_w=500)
    source.obj["metadata"]["generation"] = 1

    def refused(status, uid) -> None:
        raise ConnectionResetError("reset")

    source.report, written = refused, source.reports
    agent.step()
    assert agent.status.errors["ConnectionResetError"] == 1 and written == []
    del source.report  # the class's own again
    agent.step()
    assert written[-1]["appliedGeneration"] == 1


def test_restore_puts_defaults_back_even_from_a_new_agent(tmp_path: Path) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    assert sim.limits_mw() == [500 * W] * 4
    # A new agent (after a crash) only has the file on the host to go by.
    successor = Agent("node-a", sim, Source(), ManagedGpus.load(tmp_path / "state.json"))
    lost = sim.gpus()[1].uuid
    sim.inject(1, "gpu_lost")
    assert successor.restore() == [lost]  # kept for the next attempt
    assert sim.limits_mw() == [700 * W, 500 * W, 700 * W, 700 * W]
    sim.inject(1, None)
    assert successor.restore() == []
    assert sim.limits_mw() == [700 * W] * 4
    assert ManagedGpus.load(tmp_path / "state.json").gpus == {}


def test_restore_goes_on_when_the_record_cannot_be_rewritten(tmp_path: Path) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    agent.step()
    record = tmp_path / "state.json"
    record.unlink()
    record.mkdir()  # the atomic rename onto it fails: every discard raises
    assert agent.restore() == []
    assert sim.limits_mw() == [700 * W] * 4
    assert agent.status.errors.get("IsADirectoryError") == 4


def _metrics(agent: Agent) -> dict[tuple[str, str | None], float]:
    registry = CollectorRegistry()
    registry.register(AgentCollector(lambda: agent.status))
    return {(s.name, s.labels.get("gpu")): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples}


def test_metrics_render_per_gpu_and_per_rack(tmp_path: Path) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2300, base_w=500, gpu_w={1: 520},
                              rack_budget_w=9200)
    sim.set_demand(0, 300)
    agent.step()
    samples = _metrics(agent)
    assert samples[("tessera_gpu_power_limit_watts", "1")] == 520
    assert samples[("tessera_gpu_power_enforced_limit_watts", "1")] == 520
    assert samples[("tessera_gpu_power_target_watts", "1")] == 520
    assert samples[("tessera_gpu_power_usage_watts", "0")] == 300
    assert samples[("tessera_gpu_power_boosted", "1")] == 1
    assert samples[("tessera_gpu_power_boosted", "0")] == 0
    # GPU 0 draws less than its cap; the others are held down by theirs, GPU 1 less so.
    assert samples[("tessera_gpu_power_capped", "0")] == 0
    assert samples[("tessera_gpu_power_capped", "1")] == 1
    assert samples[("tessera_gpu_sm_clock_mhz", "1")] > samples[("tessera_gpu_sm_clock_mhz", "2")]
    assert samples[("tessera_rack_power_budget_watts", None)] == 9200
    assert samples[("tessera_node_power_budget_watts", None)] == 2300
    assert samples[("tessera_node_power_limit_watts", None)] == 2020
    assert samples[("tessera_node_power_usage_watts", None)] == 300 + 520 + 500 + 500
    assert samples[("tessera_power_agent_holding", None)] == 0


def test_a_gpu_whose_change_cannot_be_recorded_is_not_changed(tmp_path: Path) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2000, base_w=500)
    (tmp_path / "state.json").mkdir()  # the host record cannot be written
    agent.step()
    # the share, then each of the 4 GPUs: none recorded, none changed
    assert sim.limits_mw() == [700 * W] * 4 and agent.status.errors["IsADirectoryError"] == 5


def test_target_naming_gpus_the_node_does_not_have_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, sim, _ = _agent(tmp_path, budget_w=2000, base_w=500, gpu_w={6: 700, 9: 200})
    with caplog.at_level(logging.WARNING):
        agent.step()
        agent.step()
    assert caplog.text.count("target names GPU(s) [6, 9], but this node has 4 GPU(s)") == 1
    assert sim.limits_mw() == [500 * W] * 4


# --- a GPU lost on real hardware (NVML over fake devices) ----------------------------------


def test_a_lost_gpu_does_not_stop_the_survivors_boost_or_their_restore(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(f"GPU-{i}", limit_mw=700 * W) for i in range(4)])
    backend = NvmlBackend(nvml)
    backend.open()
    source = Source(to_object(make_target(budget_w=2000, base_w=500)))
    agent = Agent("node-a", backend, source, ManagedGpus(tmp_path / "state.json"), 50 * W)
    agent.step()
    nvml.lost.add(3)  # XID 79: GPU 3 fell off the bus, UUID and all
    source.obj = to_object(make_target(budget_w=2300, base_w=500,
                                       gpu_w={0: 600, 1: 600, 2: 600, 3: 200}))
    _run(agent, 3)
    assert [g.limit_mw for g in nvml.gpus] == [600 * W] * 3 + [500 * W]  # GPU 3 counted at 500
    assert [g.uuid for g in agent.status.gpus] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]

    # SIGTERM: the others settle at the base cap, GPU 3 counted at its last known 500 W
    assert agent.leave() == ["GPU-3"]
    assert [g.limit_mw for g in nvml.gpus] == [500 * W] * 4
    assert len(ManagedGpus.load(tmp_path / "state.json").gpus) == 4  # left for the next agent


def test_restore_reads_the_default_from_the_device_not_the_record(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu("GPU-0", limit_mw=500 * W, default_mw=650 * W)])
    backend = NvmlBackend(nvml)
    backend.open()
    record = tmp_path / "state.json"
    record.write_text('{"format": 1, "defaults": {"GPU-0": 700000, "GPU-replaced": 700000}}')
    agent = Agent("node-a", backend, Source(), ManagedGpus.load(record))
    assert agent.restore() == []  # a GPU no longer on the node has nothing left to restore
    assert nvml.gpus[0].limit_mw == 650 * W
    assert ManagedGpus.load(record).gpus == {}


def test_a_hanging_gpu_cannot_hold_up_the_restore_of_the_others(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(f"GPU-{i}") for i in range(3)])
    release = nvml.hang["nvmlDeviceSetPowerManagementLimit", 1] = threading.Event()
    backend = NvmlBackend(nvml)
    backend.open()
    managed = ManagedGpus(tmp_path / "state.json")
    for i in range(3):
        managed.record(f"GPU-{i}", 500 * W)
    agent = Agent("node-a", backend, Source(), managed, restore_timeout_s=2)
    try:
        # restore returns while GPU 1's call is still blocked: it did not wait for it
        assert agent.restore() == ["GPU-1"]
        assert not release.is_set()
    finally:
        release.set()
    assert [nvml.gpus[i].limit_mw for i in (0, 2)] == [700 * W, 700 * W]
    assert agent.status.errors["TimeoutError"] == 1


def test_a_hanging_gpu_cannot_hold_up_the_others_settling_on_the_way_out(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(f"GPU-{i}", limit_mw=650 * W) for i in range(3)])
    backend = NvmlBackend(nvml)
    backend.open()
    source = Source(to_object(make_target(budget_w=1800, base_w=500, gpu_w={0: 650, 1: 650})))
    agent = Agent("node-a", backend, source, ManagedGpus(tmp_path / "state.json"),
                  restore_timeout_s=2)
    agent.step()
    assert [g.limit_mw for g in nvml.gpus] == [650 * W, 650 * W, 500 * W]
    release = nvml.hang["nvmlDeviceSetPowerManagementLimit", 1] = threading.Event()
    try:
        left = agent.leave()
        assert not release.is_set()
    finally:
        release.set()
    # GPU 1 kept its 650 W; the others settled at the base cap and the share still holds.
    assert left == ["GPU-1"] and agent.status.errors["TimeoutError"] >= 1
    assert nvml.gpus[0].limit_mw + 650 * W + nvml.gpus[2].limit_mw <= 1800 * W
    assert nvml.gpus[0].limit_mw <= 500 * W and nvml.gpus[2].limit_mw <= 500 * W


# --- restart: adopt, restore or hold what a previous agent left ----------------------------


def _left_boosted(tmp_path: Path) -> tuple[SimBackend, Path]:
    """A previous agent boosted GPU 0 to 600 W and died."""
    agent, sim, _ = _agent(tmp_path, budget_w=2200, base_w=500, gpu_w={0: 600})
    _run(agent, 3)
    assert sim.limits_mw() == [600 * W, 500 * W, 500 * W, 500 * W]
    return sim, tmp_path / "state.json"


def test_restart_with_a_fresh_target_adopts_the_gpus(tmp_path: Path) -> None:
    sim, record = _left_boosted(tmp_path)
    source = Source(to_object(make_target(budget_w=2200, gpu_w={0: 650})))
    successor = Agent("node-a", sim, source, ManagedGpus.load(record), 50 * W)
    successor.recover(wait_s=0)
    assert sim.limits_mw() == [600 * W, 500 * W, 500 * W, 500 * W]  # no detour to 700 W
    successor.step()
    assert sim.limits_mw()[0] == 650 * W and not successor.recovering


def test_restart_without_a_target_settles_inside_the_recorded_share(tmp_path: Path) -> None:
    sim, record = _left_boosted(tmp_path)
    successor = Agent("node-a", sim, Source(None), ManagedGpus.load(record))
    successor.recover(wait_s=0)
    successor.step()
    assert sim.limits_mw() == [500 * W] * 4  # the boost ends; no GPU back at its 700 W default
    assert not successor.recovering and len(ManagedGpus.load(record).gpus) == 4


def test_restart_without_a_target_or_any_share_restores_the_defaults(tmp_path: Path) -> None:
    sim, record = _left_boosted(tmp_path)
    legacy = ManagedGpus.load(record)
    legacy.share = None  # a record from before shares were kept: no budget known
    successor = Agent("node-a", sim, Source(None), legacy)
    successor.recover(wait_s=0)
    assert sim.limits_mw() == [700 * W] * 4
    assert ManagedGpus.load(record).gpus == {}


def test_restart_during_an_outage_holds_the_last_limits_until_it_can_tell(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim, record = _left_boosted(tmp_path)
    for i in range(4):
        sim.set_limit(i, 700 * W)  # a driver reload in between put every GPU at its default
    source = Source()
    source.down = True
    successor = Agent("node-a", sim, source, ManagedGpus.load(record), 50 * W)
    with caplog.at_level(logging.WARNING):
        successor.recover(wait_s=0.2, sleep=lambda s: None)
    assert "holding their last limits" in caplog.text
    assert sim.limits_mw() == [600 * W, 500 * W, 500 * W, 500 * W]
    _run(successor, 2)
    assert sim.limits_mw() == [600 * W, 500 * W, 500 * W, 500 * W] and successor.recovering
    source.down, source.obj = False, None  # back, and the operator has released the node
    successor.step()
    assert sim.limits_mw() == [500 * W] * 4 and not successor.recovering  # settled in the share


@pytest.mark.hardening
@pytest.mark.parametrize(("boot", "survivors_w"), [
    # the same boot: GPU 3 counted at its recorded 200 W, the survivors back at 600 W
    (None, 600),
    # a record from an earlier boot: indices may name other GPUs, and the driver put every GPU
    # at its default since; GPU 3 counts at the 700 W maximum and the survivors share the rest
    ("an-earlier-boot", 433),
])
def test_a_restart_with_a_gpu_off_the_bus_counts_it_at_its_recorded_limit(
    tmp_path: Path, boot: str | None, survivors_w: int
) -> None:
    """GPU 3 cordoned at 200 W, the others boosted to 600 W on a 2,000 W share, then GPU 3 falls
    off the bus (XID 79) and the agent restarts (SIGTERM's settling, then a new process whose
    NVML cannot read GPU 3's UUID): the successor counts GPU 3 by its index at the limit its
    predecessor recorded, not at the device's maximum, so the survivors get their boost back and
    the share still holds with GPU 3 where it really is."""
    gpus, record = tmp_path / "gpus.json", tmp_path / "state.json"
    sim = SimBackend(4, "node-a", state_path=gpus)
    source = Source(to_object(make_target(budget_w=2000, base_w=500,
                                          gpu_w={0: 600, 1: 600, 2: 600, 3: 200})))
    first = Agent("node-a", sim, source, ManagedGpus(record), 50 * W)
    _run(first, 3)
    assert sim.limits_mw() == [600 * W] * 3 + [200 * W]
    sim.fail(3, xid=79)
    first.step()
    assert first.leave() == [sim.gpus()[3].uuid]  # settled at the base cap but GPU 3
    assert sim.limits_mw() == [500 * W] * 3 + [200 * W]
    if boot is not None:
        record.write_text(record.read_text().replace(ManagedGpus.load(record).boot, boot))

    restarted = SimBackend(state_path=gpus)
    assert restarted.gpus()[3].uuid is None  # NVML cannot name a lost GPU to a new process
    successor = Agent("node-a", restarted, source, ManagedGpus.load(record), 50 * W)
    successor.recover(wait_s=0)
    _run(successor, 3)
    assert sim.limits_mw() == [survivors_w * W] * 3 + [200 * W]
    assert sum(sim.limits_mw()) <= 2000 * W
    assert source.reports[-1]["state"] == "Applied"


def test_unreadable_record_without_a_target_restores_every_gpu(tmp_path: Path, caplog) -> None:
    sim, record = _left_boosted(tmp_path)
    record.write_text("{not json")
    with caplog.at_level(logging.ERROR):
        successor = Agent("node-a", sim, Source(None), ManagedGpus.load(record))
        successor.recover(wait_s=0)
    assert "every GPU counts as changed" in caplog.text
    assert sim.limits_mw() == [700 * W] * 4  # no share survives, and nothing asks for one
    assert ManagedGpus.load(record).gpus == {} and not ManagedGpus.load(record).unreadable


def test_unreadable_record_with_a_target_adopts_every_gpu(tmp_path: Path) -> None:
    sim, record = _left_boosted(tmp_path)
    record.write_text("{not json")
    source = Source(to_object(make_target(budget_w=2200, base_w=500)))
    successor = Agent("node-a", sim, source, ManagedGpus.load(record))
    successor.recover(wait_s=0)
    successor.step()
    assert sim.limits_mw() == [500 * W] * 4  # straight to the target, never the 700 W defaults
    assert len(ManagedGpus.load(record).gpus) == 4 and ManagedGpus.load(record).share


def test_record_entries_are_validated(tmp_path: Path) -> None:
    record = tmp_path / "state.json"
    record.write_text('{"format": 2, "gpus": {"GPU-a": 500000, "GPU-b": "lots", "junk": 1}}')
    assert ManagedGpus.load(record).gpus == {"GPU-a": 500000, "GPU-b": None}
    record.write_text('{"format": 99, "gpus": {}}')
    assert ManagedGpus.load(record).unreadable


def test_a_broken_api_configuration_still_settles_first(tmp_path: Path) -> None:
    sim, _ = _left_boosted(tmp_path)
    sim_state = tmp_path / "gpus.json"
    shared = SimBackend(4, "node-a", state_path=sim_state)
    for i, mw in enumerate(sim.limits_mw()):
        shared.set_limit(i, mw)
    (tmp_path / "node-a.json").write_text((tmp_path / "state.json").read_text())
    code = main(["--node", "node-a", "--backend", "sim", "--sim-state", str(sim_state),
                 "--state-dir", str(tmp_path), "--kubeconfig", str(tmp_path / "missing"),
                 "--metrics-port", "0"])
    assert code == 1
    assert shared.limits_mw() == [500 * W] * 4  # the boost ended inside the recorded share


def test_simulated_gpus_are_configured_from_the_command_line(tmp_path: Path) -> None:
    args = _parser().parse_args(["--node", "n", "--backend", "sim", "--sim-gpus", "2",
                                 "--sim-min-watts", "100", "--sim-max-watts", "400",
                                 "--sim-default-watts", "350", "--sim-reference-watts", "300"])
    r = sim_backend(args).read(1)
    assert (r.min_mw, r.max_mw, r.default_mw, r.limit_mw) == (100 * W, 400 * W, 350 * W, 350 * W)
    args.sim_default_watts = 500
    with pytest.raises(ValueError, match="min <= default <= max"):
        sim_backend(args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node", "../evil"], "--node '../evil' is not a Kubernetes node name"),
        (["--node", "Node_A"], "--node 'Node_A' is not a Kubernetes node name"),
        (["--node", "n", "--interval", "0"], "--interval must be a positive number"),
        (["--node", "n", "--interval", "nan"], "--interval must be a positive number"),
    ],
)
def test_bad_flags_exit_before_touching_the_state_dir(
    tmp_path: Path, caplog, args: list[str], message: str
) -> None:
    state_dir = tmp_path / "state" / "dir"
    code = main([*args, "--backend", "sim", "--state-dir", str(state_dir), "--metrics-port", "0"])
    assert code == 2
    assert message in caplog.text
    assert not (tmp_path / "state").exists() and not (tmp_path / "evil.json.lock").exists()


def test_a_state_dir_that_cannot_hold_the_record_is_a_clear_error(tmp_path: Path, caplog) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("keep me")
    code = main(["--node", "node-a", "--backend", "sim", "--state-dir", str(not_a_dir),
                 "--sim-state", str(tmp_path / "gpus.json"), "--metrics-port", "0"])
    assert code == 1
    assert f"cannot open the node's record in --state-dir {not_a_dir}" in caplog.text
    assert not_a_dir.read_text() == "keep me"
