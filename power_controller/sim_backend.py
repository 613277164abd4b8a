"""Simulated GPUs for machines without one: power limit -> power draw -> SM clock -> throughput.

Defaults follow H100/H200 SXM (limits 200-700 W, default 700 W). Speed follows the paper-calibrated
`perf_model` against a reference power (the fleet base cap), so a simulated boost speeds a GPU up
exactly as the simulator and the operator's closed loop assume. Faults are injectable per GPU and
operation so the agent's error handling runs through the same interface as on real hardware.
The state may live in a JSON file so that several processes (the agent, a simulated DCGM
endpoint, a test) see and change the same GPUs.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from power_controller.devices import (
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
from power_controller.files import locked, read_json, write_json_atomic
from power_controller.perf_model import PAPER, PerfModel

FAULTS: dict[str, type[PowerError]] = {
    "no_permission": NoPermission,
    "not_supported": NotSupported,
    "gpu_lost": GpuLost,
    "invalid_argument": InvalidArgument,
    "unavailable": BackendUnavailable,
}
OPERATIONS = ("read", "set", "any")


@dataclass(frozen=True)
class SimGpuSpec:
    """One simulated GPU model. Powers in watts, as on a datasheet."""

    min_w: int = 200
    max_w: int = 700
    default_w: int = 700
    reference_w: int = 500  # power at which the GPU runs at speed 1.0 (the fleet base cap)
    reference_clock_mhz: int = 1500
    max_clock_mhz: int = 1980

    def __post_init__(self) -> None:
        if not 0 < self.min_w <= self.default_w <= self.max_w:
            raise ValueError(f"need 0 < min <= default <= max, got {self}")


def _new_state(node: str, specs: Sequence[SimGpuSpec]) -> dict[str, Any]:
    return {
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
    ) -> None:
        self._path = state_path
        self._model = model
        specs = [spec or SimGpuSpec()] * count if not isinstance(spec, Sequence) else list(spec)
        existing = read_json(state_path) if state_path is not None else None
        self._mem = existing or _new_state(node, specs)
        if state_path is not None and existing is None:
            with locked(state_path):
                if read_json(state_path) is None:
                    write_json_atomic(state_path, self._mem)

    @contextlib.contextmanager
    def _state(self, write: bool = False) -> Iterator[dict[str, Any]]:
        if self._path is None:
            yield self._mem
            return
        with locked(self._path):
            state = read_json(self._path)
            if state is None:
                raise BackendUnavailable(f"simulated GPU state {self._path} disappeared")
            yield state
            if write:
                write_json_atomic(self._path, state)

    def spec(self, index: int) -> SimGpuSpec:
        with self._state() as st:
            return SimGpuSpec(**st["gpus"][index]["spec"])

    def _gpu(self, st: dict[str, Any], index: int, op: str) -> dict[str, Any]:
        if not 0 <= index < len(st["gpus"]):
            raise InvalidArgument(f"GPU {index}: no such GPU", index)
        gpu = st["gpus"][index]
        fault = gpu["faults"].get(op) or gpu["faults"].get("any")
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
            return [
                GpuId(i, None if "gpu_lost" in (f.get("read"), f.get("any")) else g["uuid"])
                for i, (g, f) in enumerate(zip(st["gpus"], faults, strict=True))
            ]

    def read(self, index: int) -> GpuReading:
        with self._state() as st:
            gpu = self._gpu(st, index, "read")
            spec = SimGpuSpec(**gpu["spec"])
        power = min(gpu["limit_mw"], gpu["demand_mw"])
        clock = min(
            spec.max_clock_mhz,
            round(spec.reference_clock_mhz * self._model.speedup(power / 1000 / spec.reference_w)),
        )
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
            # The driver keeps whole watts, rounding to the nearest: the worst case for a budget.
            gpu["limit_mw"] = (int(milliwatts) + 500) // 1000 * 1000

    def restore_default(self, uuid: str) -> int:
        with self._state(write=True) as st:
            index = next((i for i, g in enumerate(st["gpus"]) if g["uuid"] == uuid), None)
            if index is None:
                raise NotFound(f"no GPU with UUID {uuid} on this node")
            gpu = self._gpu(st, index, "set")
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
            st["gpus"][index]["demand_mw"] = int(watts * 1000)

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
