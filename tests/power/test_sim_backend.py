"""The simulated GPUs as DCGM and a hardware failure see them: fail/restore, snapshots, energy,
and state files written before those fields existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera_agents.power.devices import BackendUnavailable, GpuLost, InvalidArgument
from tessera_agents.power.sim_backend import SimBackend

pytestmark = pytest.mark.power

W = 1000


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_failed_gpu_fails_every_nvml_call_but_not_the_snapshot(tmp_path: Path) -> None:
    gpus = SimBackend(4, "node-a", state_path=tmp_path / "gpus.json")
    uuids = [g.uuid for g in gpus.gpus()]
    gpus.fail(2, xid=79)
    # another process's view of the same GPUs: the failure is in the shared state
    other = SimBackend(state_path=tmp_path / "gpus.json")
    with pytest.raises(GpuLost):
        other.read(2)
    with pytest.raises(GpuLost):
        other.set_limit(2, 500 * W)
    with pytest.raises(GpuLost):
        other.restore_default(uuids[2])
    assert [g.uuid for g in other.gpus()] == [uuids[0], uuids[1], None, uuids[3]]
    assert other.read(1).limit_mw == 700 * W  # its neighbours work on
    snaps = other.snapshot()
    assert [s.healthy for s in snaps] == [True, True, False, True]
    assert (snaps[2].uuid, snaps[2].last_xid, snaps[2].xid_totals) == (uuids[2], 79, ((79, 1),))
    assert [s.last_xid for s in snaps if s.index != 2] == [0, 0, 0]

    other.restore(2)
    assert gpus.read(2).limit_mw == 700 * W
    gpus.set_limit(2, 450 * W)
    assert gpus.read(2).limit_mw == 450 * W
    assert [g.uuid for g in gpus.gpus()] == uuids
    after = gpus.snapshot()[2]
    # the last-XID gauge clears, the count since the state began never goes down
    assert (after.healthy, after.last_xid, after.xid_totals) == (True, 0, ((79, 1),))
    gpus.fail(2, xid=48)
    gpus.fail(2, xid=79)
    again = gpus.snapshot()[2]
    assert (again.last_xid, again.xid_totals) == (79, ((48, 1), (79, 2)))
    assert [x for x, _ in again.xid_events] == [79, 48, 79]


def test_restore_clears_injected_faults_and_the_snapshot_ignores_them() -> None:
    gpus = SimBackend(2)
    gpus.inject(0, "unavailable")  # the whole library down: listing fails...
    with pytest.raises(BackendUnavailable):
        gpus.gpus()
    assert [s.index for s in gpus.snapshot()] == [0, 1]  # ...the exporter's view does not
    gpus.restore(0)
    assert len(gpus.gpus()) == 2


@pytest.mark.parametrize("xid", [0, -1, True, 1.5, "79", 2**31])
def test_fail_refuses_what_is_not_an_xid(xid: object) -> None:
    gpus = SimBackend(1)
    with pytest.raises(ValueError, match="XID"):
        gpus.fail(0, xid=xid)  # type: ignore[arg-type]
    assert gpus.snapshot()[0].healthy


def test_fail_and_restore_refuse_a_gpu_the_node_lacks() -> None:
    gpus = SimBackend(2)
    for call in (lambda: gpus.fail(2), lambda: gpus.restore(-1)):
        with pytest.raises(InvalidArgument, match="no such GPU"):
            call()


def test_energy_integrates_the_draw_between_changes() -> None:
    clock = Clock()
    gpus = SimBackend(2, clock=clock)
    clock.now += 10
    gpus.set_limit(0, 500 * W)  # 700 W for 10 s, then 500 W
    clock.now += 20
    gpus.set_demand(0, 0)  # idle from here
    clock.now += 30
    snap = gpus.snapshot()
    # GPU 0: 700 W * 10 s + 500 W * 20 s = 17 kJ; GPU 1 drew 700 W throughout the 60 s.
    assert snap[0].energy_mj == 17_000_000
    assert snap[1].energy_mj == 700 * 60 * 1000
    assert (snap[0].power_w, snap[0].util_percent, snap[0].sm_clock_mhz) == (0, 0, 0)
    assert (snap[1].power_w, snap[1].util_percent) == (700, 100)


def test_temperature_follows_the_draw() -> None:
    gpus = SimBackend(3)
    gpus.set_limit(1, 500 * W)
    gpus.set_demand(2, 0)
    # the documented model: 30 C at rest plus 0.06 C per watt drawn
    assert [s.temp_c for s in gpus.snapshot()] == [72, 60, 30]


def test_snapshot_reports_what_nvml_reads() -> None:
    gpus = SimBackend(2)
    gpus.set_limit(0, 640 * W)
    for snap in gpus.snapshot():
        reading = gpus.read(snap.index)
        assert (snap.uuid, snap.power_w * W, snap.limit_w * W, snap.sm_clock_mhz) == (
            reading.uuid, reading.power_mw, reading.limit_mw, reading.sm_clock_mhz)


def test_a_state_file_from_before_health_and_energy_still_loads(tmp_path: Path) -> None:
    # exactly what the previous SimBackend wrote: no health, XID, energy or model name
    old = {
        "node": "node-a",
        "rejected": [[1, 900000]],
        "gpus": [
            {"uuid": f"GPU-old-{i}", "limit_mw": 600000, "demand_mw": 700000, "faults": {},
             "spec": {"min_w": 200, "max_w": 700, "default_w": 700, "reference_w": 500,
                      "reference_clock_mhz": 1500, "max_clock_mhz": 1980}}
            for i in range(2)
        ],
    }
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(old))
    clock = Clock()
    gpus = SimBackend(state_path=path, clock=clock)
    assert gpus.read(1).limit_mw == 600 * W
    assert gpus.rejected() == [(1, 900000)]
    snap = gpus.snapshot()[0]
    assert (snap.uuid, snap.healthy, snap.last_xid, snap.xid_totals, snap.energy_mj) == (
        "GPU-old-0", True, 0, (), 0)
    assert snap.model_name == "NVIDIA H200"
    # the energy count starts when the old file is first opened, for every reader alike
    clock.now += 5
    assert SimBackend(state_path=path, clock=clock).snapshot()[0].energy_mj == 600 * 5 * 1000
    gpus.fail(0)
    assert SimBackend(state_path=path).snapshot()[0].last_xid == 79
