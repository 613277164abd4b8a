"""The NVML backend: every error path through pynvml's own exception classes, then read-only
against the real library where a GPU exists."""

from __future__ import annotations

import pynvml
import pytest
from fake_nvml import FakeGpu, FakeNvml

from tessera_agents.power.devices import (
    BackendUnavailable,
    GpuId,
    GpuLost,
    InvalidArgument,
    NoPermission,
    NotFound,
    NotSupported,
    PowerError,
)
from tessera_agents.power.nvml_backend import NvmlBackend

pytestmark = pytest.mark.power

EVENT = "nvmlDeviceGetCurrentClocksEventReasons"
THROTTLE = "nvmlDeviceGetCurrentClocksThrottleReasons"


def _backend(**kw) -> tuple[NvmlBackend, FakeNvml]:
    nvml = FakeNvml([FakeGpu("GPU-aaa"), FakeGpu("GPU-bbb", limit_mw=650_000)], **kw)
    backend = NvmlBackend(nvml)
    backend.open()
    return backend, nvml


@pytest.mark.parametrize("as_bytes", [False, True])
def test_lists_gpus_with_uuid_as_str_whatever_the_binding_returns(as_bytes: bool) -> None:
    backend, _ = _backend(uuid_as_bytes=as_bytes)
    assert backend.gpus() == [GpuId(0, "GPU-aaa"), GpuId(1, "GPU-bbb")]


def test_reads_milliwatts_constraints_clock_and_power_cap_reason() -> None:
    backend, _ = _backend()
    r = backend.read(1)
    assert (r.uuid, r.power_mw, r.limit_mw, r.enforced_mw, r.default_mw) == (
        "GPU-bbb", 480_000, 650_000, 650_000, 700_000)
    assert (r.min_mw, r.max_mw, r.sm_clock_mhz) == (200_000, 700_000, 1400)
    assert r.power_capped


@pytest.mark.parametrize("funcs", [(EVENT,), (THROTTLE,), (EVENT, THROTTLE)])
def test_clock_event_reasons_under_either_name(funcs: tuple[str, ...]) -> None:
    backend, _ = _backend(reason_funcs=funcs)
    assert backend.read(0).clock_event_reasons == 0x4


def test_falls_back_to_throttle_reasons_when_the_driver_lacks_the_new_symbol() -> None:
    backend, nvml = _backend(reason_funcs=(EVENT, THROTTLE))
    nvml.fail[(EVENT, None)] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert backend.read(0).clock_event_reasons == 0x4
    assert (THROTTLE, (0,)) in nvml.calls


def test_unsupported_optional_fields_read_as_none() -> None:
    backend, nvml = _backend()
    nvml.fail[("nvmlDeviceGetClockInfo", 0)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.fail[(EVENT, 0)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    r = backend.read(0)
    assert r.sm_clock_mhz is None and r.clock_event_reasons is None and not r.power_capped


def test_set_limit_passes_milliwatts() -> None:
    backend, nvml = _backend()
    backend.set_limit(0, 612_000)
    assert nvml.gpus[0].limit_mw == 612_000


@pytest.mark.parametrize(
    ("code", "ours"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, NoPermission),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NotSupported),
        (pynvml.NVML_ERROR_GPU_IS_LOST, GpuLost),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, InvalidArgument),
    ],
)
@pytest.mark.parametrize(
    "func",
    ["nvmlDeviceSetPowerManagementLimit", "nvmlDeviceGetPowerManagementLimit",
     "nvmlDeviceGetPowerUsage", "nvmlDeviceGetPowerManagementLimitConstraints"],
)
def test_nvml_errors_become_typed_errors_naming_the_gpu(code: int, ours: type, func: str) -> None:
    backend, nvml = _backend()
    nvml.fail[(func, 1)] = code
    op = (lambda: backend.set_limit(1, 600_000)) if "Set" in func else (lambda: backend.read(1))
    with pytest.raises(ours) as info:
        op()
    assert info.value.index == 1 and "GPU 1" in str(info.value)
    assert isinstance(info.value.__cause__, pynvml.NVMLError)
    backend.read(0)  # the other GPU is unaffected


def test_out_of_range_limit_rejected_by_the_driver_is_invalid_argument() -> None:
    backend, nvml = _backend()
    with pytest.raises(InvalidArgument):
        backend.set_limit(0, 900_000)
    assert nvml.gpus[0].limit_mw == 500_000


def test_a_gpu_lost_after_start_is_still_listed_by_its_uuid() -> None:
    backend, nvml = _backend()
    nvml.lost.add(1)
    assert backend.gpus() == [GpuId(0, "GPU-aaa"), GpuId(1, "GPU-bbb")]
    with pytest.raises(GpuLost):
        backend.read(1)
    assert backend.read(0).limit_mw == 500_000


def test_a_gpu_lost_before_start_is_listed_unidentified_until_it_answers() -> None:
    nvml = FakeNvml([FakeGpu("GPU-aaa"), FakeGpu("GPU-bbb")], lost={1})
    backend = NvmlBackend(nvml)
    backend.open()
    assert backend.gpus() == [GpuId(0, "GPU-aaa"), GpuId(1, None)]
    nvml.lost.clear()
    assert backend.gpus()[1] == GpuId(1, "GPU-bbb")


def test_restore_default_finds_the_gpu_by_uuid_and_sets_its_default() -> None:
    backend, nvml = _backend()
    nvml.gpus[1].default_mw = 640_000
    assert backend.restore_default("GPU-bbb") == 640_000
    assert [g.limit_mw for g in nvml.gpus] == [500_000, 640_000]
    nvml.lost.add(0)
    with pytest.raises(GpuLost):
        backend.restore_default("GPU-aaa")
    with pytest.raises(NotFound):
        backend.restore_default("GPU-gone")


@pytest.mark.parametrize(
    "code",
    [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
     pynvml.NVML_ERROR_UNINITIALIZED],
)
def test_missing_library_or_driver_is_backend_unavailable(code: int) -> None:
    nvml = FakeNvml([FakeGpu("GPU-aaa")], fail={("nvmlInit", None): code})
    with pytest.raises(BackendUnavailable):
        NvmlBackend(nvml).open()


def test_unknown_nvml_error_is_a_generic_power_error() -> None:
    backend, nvml = _backend()
    nvml.fail[("nvmlDeviceGetPowerUsage", 0)] = pynvml.NVML_ERROR_TIMEOUT
    with pytest.raises(PowerError) as info:
        backend.read(0)
    assert type(info.value) is PowerError and "Timeout" in str(info.value)


def test_close_tolerates_a_library_that_is_already_gone() -> None:
    backend, nvml = _backend()
    nvml.fail[("nvmlShutdown", None)] = pynvml.NVML_ERROR_UNINITIALIZED
    backend.close()


def test_real_library_read_only() -> None:
    """Against the installed driver, if any: list and read, never set."""
    backend = NvmlBackend()
    try:
        backend.open()
    except BackendUnavailable as err:
        pytest.skip(f"no NVIDIA driver here: {err}")
    try:
        gpus = backend.gpus()
        if not gpus:
            pytest.skip("NVML works but reports no GPU")
        for gpu in gpus:
            try:
                r = backend.read(gpu.index)
            except NotSupported as err:
                pytest.skip(f"GPU {gpu.index} has no power management: {err}")
            assert r.uuid == gpu.uuid and r.uuid.startswith(("GPU-", "MIG-"))
            assert 0 < r.min_mw <= r.limit_mw <= r.max_mw
            assert r.enforced_mw <= r.max_mw and r.default_mw <= r.max_mw
            assert 0 <= r.power_mw < 2 * r.max_mw
    finally:
        backend.close()
