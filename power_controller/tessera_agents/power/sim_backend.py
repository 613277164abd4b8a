"""Simulated GPUs for machines without one: power limit -> power draw -> SM clock -> throughput.

Defaults follow H100/H200 SXM (limits 200-700 W, default 700 W). Speed follows the paper-calibrated
`perf_model` against a reference power (the fleet base cap), so a simulated boost speeds a GPU up
exactly as the simulator and the operator's closed loop assume. Faults are injectable per GPU and
operation so the agent's error handling runs through the same interface as on real hardware.
The state may live in a JSON file so that several processes (the agent, a simulated DCGM
endpoint, a test) see and change the same GPUs.

Besides power, each GPU carries what DCGM reports and what a hardware failure changes:

- draw = min(limit, demand); SM clock from the perf model (as `read`), capped at the spec's max,
  0 while the GPU draws nothing (the perf model has no speed at zero power);
- temperature: steady state of a linear thermal resistance, `idle_temp_c + thermal_c_per_w *
  draw` (30 C + 0.06 C/W: 72 C at 700 W, 60 C at 500 W), rounded to whole degrees as DCGM does;
- utilization: 100% while the GPU has a workload (demand > 0), else 0%;
- energy: the integral of the draw since the state was created, in mJ, accrued on every change
  of the draw (the draw is constant in between) and extrapolated to the time of a `snapshot`;
- health `ok`/`failed`, the last XID (0 = none, as DCGM's gauge), every XID per code since the
  state was created (monotonic), and the times of the latest XIDs (for windowed counts).

`fail(index, xid)` is a GPU falling off the bus: health failed, the XID recorded, and every NVML
call on it fails with `GpuLost` (the `gpu_lost` fault, whatever operation it was injected for: a
lost GPU answers nothing). As with NVML (`nvml_backend`), a backend lists each GPU by the UUID it
read the first time the GPU answered: one that saw the GPU before it was lost still names it, one
started after (a restarted agent) lists it without UUID, by its index alone.
`restore(index)` clears the failure and every injected fault of that GPU. `snapshot()` is the
exporter's view: raw values of every GPU, failed or not, and never an injected fault.
State files written before these fields existed load with their defaults.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera_agents.power.devices import (
    SW_POWER_CAP,
    BackendUnavailable,
    GpuId,
    GpuLost,
    GpuReading,
    InvalidArgument,
    NoPermission,
    NotFound,
    NotSupported,
    PowerError,
)
from tessera_core.perf_model import PAPER, PerfModel
from tessera_kube.files import locked, read_json, write_json_atomic

FAULTS: dict[str, type[PowerError]] = {
    "no_permission": NoPermission,
    "not_supported": NotSupported,
    "gpu_lost": GpuLost,
    "invalid_argument": InvalidArgument,
    "unavailable": BackendUnavailable,
}
OPERATIONS = ("read", "set", "any")
HEALTH_OK, HEALTH_FAILED = "ok", "failed"
# Enough XID history for any exporter window: a GPU reporting more than this many XIDs within
# one window is failed many times over.
XID_HISTORY = 256
# Below DCGM's 32-bit blank sentinel (0x7ffffff0), so an XID can never read as "no value".
MAX_XID = 0x7FFFFFEF


@dataclass(frozen=True)
class SimGpuSpec:
    """One simulated GPU model. Powers in watts, as on a datasheet."""

    min_w: int = 200
    max_w: int = 700
    default_w: int = 700
    reference_w: int = 500  # power at which the GPU runs at speed 1.0 (the fleet base cap)
    reference_clock_mhz: int = 1500
    max_clock_mhz: int = 1980
    model_name: str = "NVIDIA H200"
    idle_temp_c: float = 30.0  # a GPU drawing nothing sits at the inlet temperature
    thermal_c_per_w: float = 0.06  # steady-state heating per watt drawn

    def __post_init__(self) -> None:
        if not 0 < self.min_w <= self.default_w <= self.max_w:
            raise ValueError(f"need 0 < min <= default <= max, got {self}")


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU as its exporter sees it at `taken_at` (Unix seconds): raw values, failed or not.

    Powers in watts, energy in millijoules, as NVML/DCGM 4.6 report them; `xid_totals` holds
    (xid, count since the state was created) by XID, `xid_events` (xid, Unix time) of the latest
    XIDs, oldest first. A field an exporter cannot read may be None (or NaN).
    """

    index: int
    uuid: str
    pci_bus_id: str
    model_name: str
    healthy: bool
    power_w: float | None
    limit_w: float | None
    enforced_limit_w: float | None
    sm_clock_mhz: float | None
    temp_c: float | None
    util_percent: float | None
    energy_mj: float | None
    last_xid: int
    xid_totals: tuple[tuple[int, int], ...]
    xid_events: tuple[tuple[int, float], ...]
    taken_at: float


def pci_bus_id(index: int) -> str:
    """The simulated GPU's PCI address, in NVML's form (domain:bus:device.function)."""
    return f"00000000:{0x10 + index:02X}:00.0"


def _new_state(node: str, specs: Sequence[SimGpuSpec], now: float) -> dict[str, Any]:
    state = {
        "node": node,
        "gpus": [
            {
                "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'tessera-sim/{node}/{i}')}",
                "spec": spec.__dict__,
                "limit_mw": spec.default_w * 1000,
                "demand_mw": spec.max_w * 1000,  # a training GPU draws all it is allowed
                "faults": {},
            }
            for i, spec in enumerate(specs)
        ],
        "rejected": [],
    }
    _complete(state, now)
    return state


def _complete(state: dict[str, Any], now: float) -> bool:
    """Give every GPU the fields added after its state file was written; True if any was added."""
    added = False
    for gpu in state["gpus"]:
        for key, default in (("health", HEALTH_OK), ("last_xid", 0), ("xid_totals", {}),
                             ("xid_events", []), ("energy_mj", 0.0), ("energy_at", now)):
            if key not in gpu:
                gpu[key] = default
                added = True
    return added


def _lost(gpu: dict[str, Any]) -> bool:
    return "gpu_lost" in gpu["faults"].values()


def _draw_mw(gpu: dict[str, Any]) -> int:
    return min(gpu["limit_mw"], gpu["demand_mw"])


def _energy_mj(gpu: dict[str, Any], now: float) -> float:
    """The energy counter at `now`, at the draw in force since its last update (mW * s = mJ)."""
    return gpu["energy_mj"] + _draw_mw(gpu) * max(0.0, now - gpu["energy_at"])


def _accrue(gpu: dict[str, Any], now: float) -> None:
    """Bring the energy counter up to `now`; call it before anything that changes the draw."""
    gpu["energy_mj"] = _energy_mj(gpu, now)
    gpu["energy_at"] = now


class SimBackend:
    """Simulated GPUs of one node, in memory or shared through `state_path`.

    `spec` is one model for every GPU or a list with one per GPU (then `count` is ignored). An
    existing state file wins over both: the GPUs are whatever it holds.
    """

    def __init__(
        self,
        count: int = 8,
        node: str = "sim-node",
        spec: SimGpuSpec | Sequence[SimGpuSpec] | None = None,
        state_path: Path | None = None,
        model: PerfModel = PAPER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = state_path
        self._model = model
        self._clock = clock
        self._uuids: dict[int, str] = {}  # read once per index, as NVML's backend does
        specs = [spec or SimGpuSpec()] * count if not isinstance(spec, Sequence) else list(spec)
        existing = read_json(state_path) if state_path is not None else None
        self._mem = existing or _new_state(node, specs, clock())
        if state_path is not None:
            with locked(state_path):
                current = read_json(state_path)
                if current is None:
                    write_json_atomic(state_path, self._mem)
                elif _complete(current, clock()):
                    # an older file starts its energy count now, once for every process
                    write_json_atomic(state_path, current)

    @contextlib.contextmanager
    def _state(self, write: bool = False) -> Iterator[dict[str, Any]]:
        if self._path is None:
            yield self._mem
            return
        with locked(self._path):
            state = read_json(self._path)
            if state is None:
                raise BackendUnavailable(f"simulated GPU state {self._path} disappeared")
            _complete(state, self._clock())
            yield state
            if write:
                write_json_atomic(self._path, state)

    def spec(self, index: int) -> SimGpuSpec:
        with self._state() as st:
            return SimGpuSpec(**st["gpus"][index]["spec"])

    def _gpu(self, st: dict[str, Any], index: int, op: str) -> dict[str, Any]:
        gpu = self._indexed(st, index)
        fault = "gpu_lost" if _lost(gpu) else gpu["faults"].get(op) or gpu["faults"].get("any")
        if fault:
            raise FAULTS[fault](f"GPU {index}: simulated {fault}", index)
        return gpu

    # --- the PowerBackend interface -------------------------------------------------------

    def gpus(self) -> list[GpuId]:
        """Like NVML: an unavailable library fails the listing, a lost GPU cannot be identified."""
        with self._state() as st:
            faults = [g["faults"] for g in st["gpus"]]
            if any("unavailable" in f.values() for f in faults):
                raise BackendUnavailable("simulated NVML library unavailable")
            for i, gpu in enumerate(st["gpus"]):
                if not _lost(gpu):
                    self._uuids.setdefault(i, gpu["uuid"])
            return [GpuId(i, self._uuids.get(i)) for i in range(len(st["gpus"]))]

    def _sm_clock_mhz(self, spec: SimGpuSpec, power_mw: int) -> int:
        if power_mw <= 0:  # an idle GPU's perf model has no speed; its clocks idle too
            return 0
        speed = self._model.speedup(power_mw / 1000 / spec.reference_w)
        return min(spec.max_clock_mhz, round(spec.reference_clock_mhz * speed))

    def read(self, index: int) -> GpuReading:
        with self._state() as st:
            gpu = self._gpu(st, index, "read")
            spec = SimGpuSpec(**gpu["spec"])
        power = _draw_mw(gpu)
        clock = self._sm_clock_mhz(spec, power)
        return GpuReading(
            index=index,
            uuid=gpu["uuid"],
            power_mw=power,
            limit_mw=gpu["limit_mw"],
            enforced_mw=gpu["limit_mw"],
            default_mw=spec.default_w * 1000,
            min_mw=spec.min_w * 1000,
            max_mw=spec.max_w * 1000,
            sm_clock_mhz=clock,
            clock_event_reasons=SW_POWER_CAP if gpu["demand_mw"] > gpu["limit_mw"] else 0,
        )

    def set_limit(self, index: int, milliwatts: int) -> None:
        with self._state(write=True) as st:
            gpu = self._gpu(st, index, "set")
            spec = SimGpuSpec(**gpu["spec"])
            if not spec.min_w * 1000 <= milliwatts <= spec.max_w * 1000:
                # Kept so tests can prove the agent never asks for an out-of-range limit.
                st["rejected"].append([index, milliwatts])
                raise InvalidArgument(
                    f"GPU {index}: {milliwatts} mW outside [{spec.min_w}, {spec.max_w}] W", index
                )
            _accrue(gpu, self._clock())
            # The driver keeps whole watts, rounding to the nearest: the worst case for a budget.
            gpu["limit_mw"] = (int(milliwatts) + 500) // 1000 * 1000

    def restore_default(self, uuid: str) -> int:
        with self._state(write=True) as st:
            index = next((i for i, g in enumerate(st["gpus"]) if g["uuid"] == uuid), None)
            if index is None:
                raise NotFound(f"no GPU with UUID {uuid} on this node")
            gpu = self._gpu(st, index, "set")
            _accrue(gpu, self._clock())
            gpu["limit_mw"] = SimGpuSpec(**gpu["spec"]).default_w * 1000
            return gpu["limit_mw"]

    def close(self) -> None:
        """Nothing to release: the state (if shared) stays in its file."""

    # --- simulation controls (tests, the simulated DCGM endpoint) -------------------------

    def inject(self, index: int, fault: str | None, op: str = "any") -> None:
        """Make `op` on GPU `index` fail with `fault` (None clears it)."""
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {sorted(FAULTS)}")
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; choose from {OPERATIONS}")
        with self._state(write=True) as st:
            faults = st["gpus"][index]["faults"]
            if fault is None:
                faults.pop(op, None)
            else:
                faults[op] = fault

    def set_demand(self, index: int, watts: float) -> None:
        """The power the GPU's workload would draw without a cap (0 for an idle GPU)."""
        with self._state(write=True) as st:
            _accrue(st["gpus"][index], self._clock())
            st["gpus"][index]["demand_mw"] = int(watts * 1000)

    def fail(self, index: int, xid: int = 79) -> None:
        """The GPU fails as hardware does: health failed, `xid` recorded as its last XID, and every
        NVML call on it fails as on a GPU that fell off the bus (`GpuLost`)."""
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid <= MAX_XID:
            raise ValueError(f"an XID is a positive integer up to {MAX_XID}, got {xid!r}")
        with self._state(write=True) as st:
            gpu = self._indexed(st, index)
            now = self._clock()
            _accrue(gpu, now)
            gpu["health"], gpu["last_xid"] = HEALTH_FAILED, xid
            gpu["xid_totals"][str(xid)] = gpu["xid_totals"].get(str(xid), 0) + 1
            gpu["xid_events"] = [*gpu["xid_events"], [xid, now]][-XID_HISTORY:]
            gpu["faults"]["any"] = "gpu_lost"

    def restore(self, index: int) -> None:
        """The GPU is back (reset or replaced in place): health ok, last XID 0, no faults. Its XID
        counts stay: they are counts since the state was created."""
        with self._state(write=True) as st:
            gpu = self._indexed(st, index)
            gpu["health"], gpu["last_xid"], gpu["faults"] = HEALTH_OK, 0, {}

    def snapshot(self) -> list[GpuSnapshot]:
        """Every GPU's raw state at this moment; injected faults and failures do not stop it."""
        with self._state() as st:
            now = self._clock()
            return [self._snapshot(i, gpu, now) for i, gpu in enumerate(st["gpus"])]

    def _snapshot(self, index: int, gpu: dict[str, Any], now: float) -> GpuSnapshot:
        spec = SimGpuSpec(**gpu["spec"])
        draw_mw = _draw_mw(gpu)
        energy_mj = _energy_mj(gpu, now)
        return GpuSnapshot(
            index=index,
            uuid=gpu["uuid"],
            pci_bus_id=pci_bus_id(index),
            model_name=spec.model_name,
            healthy=gpu["health"] == HEALTH_OK,
            power_w=draw_mw / 1000,
            limit_w=gpu["limit_mw"] / 1000,
            enforced_limit_w=gpu["limit_mw"] / 1000,
            sm_clock_mhz=self._sm_clock_mhz(spec, draw_mw),
            temp_c=round(spec.idle_temp_c + spec.thermal_c_per_w * draw_mw / 1000),
            util_percent=100 if gpu["demand_mw"] > 0 else 0,
            energy_mj=energy_mj,
            last_xid=gpu["last_xid"],
            xid_totals=tuple(sorted((int(x), n) for x, n in gpu["xid_totals"].items())),
            xid_events=tuple((int(x), float(t)) for x, t in gpu["xid_events"]),
            taken_at=now,
        )

    @staticmethod
    def _indexed(st: dict[str, Any], index: int) -> dict[str, Any]:
        if not 0 <= index < len(st["gpus"]):
            raise InvalidArgument(f"GPU {index}: no such GPU (this node has {len(st['gpus'])})",
                                  index)
        return st["gpus"][index]

    def limits_mw(self) -> list[int]:
        """Every GPU's limit, bypassing injected faults (the test's view of the hardware)."""
        with self._state() as st:
            return [g["limit_mw"] for g in st["gpus"]]

    def rejected(self) -> list[tuple[int, int]]:
        """Every out-of-range limit the backend was asked to set."""
        with self._state() as st:
            return [tuple(r) for r in st["rejected"]]

    def speed(self, index: int) -> float:
        """Throughput relative to a GPU drawing the reference power (the calibrated model)."""
        reading = self.read(index)
        return self._model.speedup(reading.power_mw / 1000 / self.spec(index).reference_w)
