"""The NVML backend: real GPU power readings and limits through `nvidia-ml-py` (`pynvml`).

The `nvml` module is injectable so tests can drive every error path with pynvml's own exception
classes; production passes nothing and gets the real library, loaded on `open`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from tessera_agents.power.devices import (
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

T = TypeVar("T")

# pynvml exception class name -> our error. Checked by name so that a binding lacking one of the
# classes (older nvidia-ml-py) still maps the rest.
_ERRORS: tuple[tuple[str, type[PowerError]], ...] = (
    ("NVMLError_NoPermission", NoPermission),
    ("NVMLError_NotSupported", NotSupported),
    ("NVMLError_GpuIsLost", GpuLost),
    ("NVMLError_InvalidArgument", InvalidArgument),
    ("NVMLError_NotFound", NotFound),
    ("NVMLError_LibraryNotFound", BackendUnavailable),
    ("NVMLError_DriverNotLoaded", BackendUnavailable),
    ("NVMLError_Uninitialized", BackendUnavailable),
)

# NVML 13 renamed "throttle reasons" to "clock event reasons"; bindings carry one or both.
_REASON_FUNCS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)


def _as_str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlBackend:
    """GPUs of this node through NVML. Call `open()` first (or use it as a context manager)."""

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml = nvml
        self._handles: dict[int, Any] = {}
        # UUIDs read once per index: a GPU that falls off the bus later (XID 79) no longer
        # answers nvmlDeviceGetUUID, but must still be listed and restored by its UUID.
        self._uuids: dict[int, str] = {}

    def __enter__(self) -> NvmlBackend:
        self.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def open(self) -> None:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as err:
                raise BackendUnavailable(f"nvidia-ml-py is not installed: {err}") from err
        self._call(None, self._nvml.nvmlInit)
        self.gpus()

    def close(self) -> None:
        if self._nvml is not None:
            self._handles, self._uuids = {}, {}
            # Shutting down a library that is already gone has nothing left to release.
            with contextlib.suppress(PowerError):
                self._call(None, self._nvml.nvmlShutdown)

    def _call(self, index: int | None, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except self._nvml.NVMLError as err:
            raise self._translate(err, index) from err

    def _translate(self, err: Exception, index: int | None) -> PowerError:
        where = f"GPU {index}: " if index is not None else ""
        for name, ours in _ERRORS:
            cls = getattr(self._nvml, name, None)
            if cls is not None and isinstance(err, cls):
                return ours(f"{where}{err}", index)
        return PowerError(f"{where}NVML error: {err}", index)

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(index, self._nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def _uuid(self, index: int) -> str | None:
        if index not in self._uuids:
            try:
                handle = self._handle(index)
                self._uuids[index] = _as_str(
                    self._call(index, self._nvml.nvmlDeviceGetUUID, handle))
            except PowerError:
                return None  # not identified yet; asked again on the next listing
        return self._uuids[index]

    def gpus(self) -> list[GpuId]:
        count = self._call(None, self._nvml.nvmlDeviceGetCount)
        return [GpuId(i, self._uuid(i)) for i in range(count)]

    def restore_default(self, uuid: str) -> int:
        nv = self._nvml
        index = next((i for i, u in self._uuids.items() if u == uuid), None)
        handle = self._call(index, nv.nvmlDeviceGetHandleByUUID, uuid)
        default = int(self._call(index, nv.nvmlDeviceGetPowerManagementDefaultLimit, handle))
        self._call(index, nv.nvmlDeviceSetPowerManagementLimit, handle, default)
        return default

    def _clock_event_reasons(self, index: int, handle: Any) -> int | None:
        missing = getattr(self._nvml, "NVMLError_FunctionNotFound", ())
        for name in _REASON_FUNCS:
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            try:
                return int(fn(handle))
            except missing:
                continue  # a driver older than the binding lacks the newer symbol
            except self._nvml.NVMLError as err:
                mapped = self._translate(err, index)
                if isinstance(mapped, NotSupported):
                    return None
                raise mapped from err
        return None

    def read(self, index: int) -> GpuReading:
        nv, h = self._nvml, self._handle(index)
        lo, hi = self._call(index, nv.nvmlDeviceGetPowerManagementLimitConstraints, h)
        try:
            clock = int(self._call(index, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
        except NotSupported:
            clock = None
        return GpuReading(
            index=index,
            uuid=self._uuids.get(index) or _as_str(self._call(index, nv.nvmlDeviceGetUUID, h)),
            power_mw=int(self._call(index, nv.nvmlDeviceGetPowerUsage, h)),
            limit_mw=int(self._call(index, nv.nvmlDeviceGetPowerManagementLimit, h)),
            enforced_mw=int(self._call(index, nv.nvmlDeviceGetEnforcedPowerLimit, h)),
            default_mw=int(self._call(index, nv.nvmlDeviceGetPowerManagementDefaultLimit, h)),
            min_mw=int(lo),
            max_mw=int(hi),
            sm_clock_mhz=clock,
            clock_event_reasons=self._clock_event_reasons(index, h),
        )

    def set_limit(self, index: int, milliwatts: int) -> None:
        self._call(index, self._nvml.nvmlDeviceSetPowerManagementLimit, self._handle(index),
                   int(milliwatts))
