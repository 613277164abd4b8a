"""A stand-in for the `pynvml` module over simulated devices, raising pynvml's real exceptions.

Only the GPU is fake: the NVML backend's code runs unchanged against it, including its error
translation, because every failure is an instance of the installed pynvml's own error classes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    limit_mw: int = 500_000
    default_mw: int = 700_000
    min_mw: int = 200_000
    max_mw: int = 700_000
    power_mw: int = 480_000
    clock_mhz: int = 1400
    reasons: int = 0x4


@dataclass
class FakeNvml:
    """Module-like object: the functions and names the backend uses, and failures to inject.

    `fail` maps (function name, GPU index or None for any) -> NVML error code; a GPU in `lost`
    fails every call with GPU_IS_LOST (fallen off the bus); a call in `hang` blocks until that
    event is set. `uuid_as_bytes` mimics older bindings; `reason_funcs` the clock-event function
    names present.
    """

    gpus: list[FakeGpu]
    fail: dict[tuple[str, int | None], int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    hang: dict[tuple[str, int], threading.Event] = field(default_factory=dict)
    uuid_as_bytes: bool = False
    reason_funcs: tuple[str, ...] = ("nvmlDeviceGetCurrentClocksEventReasons",)
    calls: list[tuple[str, tuple]] = field(default_factory=list)

    NVMLError = pynvml.NVMLError
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM

    def __getattr__(self, name: str):
        if name.startswith("NVMLError_"):
            return getattr(pynvml, name)
        if name in ("nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if name not in self.reason_funcs:
                raise AttributeError(name)
            return lambda h: self._dev(name, h).reasons
        raise AttributeError(name)

    def _check(self, name: str, index: int | None) -> None:
        self.calls.append((name, (index,)))
        if (name, index) in self.hang:
            self.hang[name, index].wait()
        code = self.fail.get((name, index), self.fail.get((name, None)))
        if index in self.lost:
            code = pynvml.NVML_ERROR_GPU_IS_LOST
        if code is not None:
            raise pynvml.NVMLError(code)

    def _dev(self, name: str, handle: int) -> FakeGpu:
        self._check(name, handle)
        return self.gpus[handle]

    def nvmlInit(self) -> None:
        self._check("nvmlInit", None)

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown", None)

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount", None)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        index = next((i for i, g in enumerate(self.gpus) if g.uuid == uuid), None)
        if index is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        self._check("nvmlDeviceGetHandleByUUID", index)
        return index

    def nvmlDeviceGetUUID(self, h: int) -> str | bytes:
        uuid = self._dev("nvmlDeviceGetUUID", h).uuid
        return uuid.encode() if self.uuid_as_bytes else uuid

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self._dev("nvmlDeviceGetPowerManagementLimit", h).limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", h).limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return self._dev("nvmlDeviceGetPowerManagementDefaultLimit", h).default_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: int) -> list[int]:
        g = self._dev("nvmlDeviceGetPowerManagementLimitConstraints", h)
        return [g.min_mw, g.max_mw]

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._dev("nvmlDeviceGetClockInfo", h).clock_mhz

    def nvmlDeviceSetPowerManagementLimit(self, h: int, limit: int) -> None:
        g = self._dev("nvmlDeviceSetPowerManagementLimit", h)
        if not g.min_mw <= limit <= g.max_mw:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g.limit_mw = limit
