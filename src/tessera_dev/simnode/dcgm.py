"""dcgm-exporter's /metrics page for simulated GPUs: Prometheus text as the exporter prints it.

`render(gpus, hostname=..., generation="4.8" | "4.9")` is pure: the same snapshots give the same
page. Two generations of field names, from dcgm-exporter's shipped counters (4.8: DCGM 4.6
names; 4.9: the DCGM 4.7 names of the renamed default fields, some with new units):

  value               4.8 family (unit)                          4.9 family (unit)
  SM clock            DCGM_FI_DEV_SM_CLOCK (MHz)                 DCGM_FI_DEV_SM_CLOCK_HERTZ (Hz)
  temperature         DCGM_FI_DEV_GPU_TEMP (C)                   DCGM_FI_DEV_GPU_TEMP_CELSIUS (C)
  power draw          DCGM_FI_DEV_POWER_USAGE (W)                DCGM_FI_DEV_BOARD_POWER_WATTS (W)
  energy, counter     DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)  DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL
                                                                   (J)
  utilization         DCGM_FI_DEV_GPU_UTIL (0-100)               DCGM_FI_DEV_GPU_UTIL_RATIO (0-1)
  last XID (0: none)  DCGM_FI_DEV_XID_ERRORS                     DCGM_FI_DEV_XID_ERROR
  power limit         DCGM_FI_DEV_POWER_MGMT_LIMIT (W)           unchanged
  enforced limit      DCGM_FI_DEV_ENFORCED_POWER_LIMIT (W)       unchanged
  XIDs in window      DCGM_EXP_XID_ERRORS_COUNT                  unchanged
                        {window_size_in_ms, xid}
  XIDs, counter       DCGM_EXP_XID_ERRORS_TOTAL {xid}            unchanged
  health per watch    DCGM_EXP_GPU_HEALTH_STATUS                 unchanged
                        {health_watch, health_error_code}

The other families are gauges. Clocks, temperature, percentages, XIDs and energy are whole
numbers, as DCGM's INT64 fields are (joules too); powers and ratios are doubles. The power-limit
rows are opt-in in the shipped CSV (from 4.8.4), the DCGM_EXP_* families opt-in exporter
collectors: a cluster that reads them enables them, as this page assumes. The help texts of the
renamed fields (the 4.8 text with the new unit) and of the power limits are this module's;
nothing should parse help texts.

Labels on every sample, in the exporter's order: `gpu`, `UUID`, `pci_bus_id`, `device`
(nvidia<i>), `modelName`, `hostname`, then the driver version label of the shipped CSV
(`DCGM_FI_DRIVER_VERSION` in 4.8, renamed `DCGM_FI_SYSTEM_DRIVER_VERSION` in 4.9), then the
family's own labels. The "4.8" generation is the 4.8.3/4.8.4 releases: the `Hostname` label was
renamed `hostname` in 4.8.3, and earlier releases (with `Hostname` and families in field-ID order)
are not rendered. Both generations sort families by name and samples by UUID, and print values as
Go's `%g` does (shortest round-trip digits, exponent form from 1e+06 up: `1.98e+09`).

A failed GPU (fallen off the bus) keeps only its XID families and its health status: DCGM returns
blank values for its other fields and the exporter skips blanks, so those series vanish. Any
value that is None, NaN, infinite or at or above DCGM's blank sentinels (2^47 for doubles,
0x7ffffffffffffff0 for integers) is skipped the same way. XID counts follow the exporter: a GPU
without XIDs in the window has one 0 sample without `xid`; the total has one sample per XID seen.
Health status is 0 (pass) on every watch of a healthy GPU; a failed GPU fails (20, with
DCGM_FR_XID_ERROR) on the PCIE watch for XID 79 (fallen off the bus) and on DRIVER for other
XIDs, a choice of this simulator: read the value and error code, not which watch carries them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from tessera_agents.power.sim_backend import GpuSnapshot

GENERATIONS = ("4.8", "4.9")
DRIVER_VERSION = "570.133.20"  # the simulated nodes' NVIDIA driver
XID_WINDOW_MS = 300_000  # dcgm-exporter's default --xid-count-window-size
FP64_BLANK = 2.0**47
INT64_BLANK = 0x7FFFFFFFFFFFFFF0
# DCGM_EXP_GPU_HEALTH_STATUS values and the watches the exporter reports, in its order.
HEALTH_PASS, HEALTH_WARN, HEALTH_FAIL = 0, 10, 20
HEALTH_WATCHES = ("PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER",
                  "DRIVER")
FALLEN_OFF_THE_BUS = 79


@dataclass(frozen=True)
class Field:
    """One per-GPU field: its family name, type, help text, and its value from a snapshot."""

    name: str
    type: str
    help: str
    value: Callable[[GpuSnapshot], float | None]


def _scaled(attr: str, factor: float, whole: bool = True) -> Callable[[GpuSnapshot], float | None]:
    def value(gpu: GpuSnapshot) -> float | None:
        raw = getattr(gpu, attr)
        if raw is None or not math.isfinite(raw):
            return raw
        scaled = raw * factor
        return float(math.floor(scaled)) if whole else scaled

    return value


_FIELDS_4_8 = (
    Field("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
          _scaled("sm_clock_mhz", 1)),
    Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", _scaled("temp_c", 1)),
    Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
          _scaled("power_w", 1, whole=False)),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
          "Total energy consumption since boot (in mJ).", _scaled("energy_mj", 1)),
    Field("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
          _scaled("util_percent", 1)),
    Field("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
          lambda gpu: gpu.last_xid),
    Field("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).",
          _scaled("limit_w", 1, whole=False)),
    Field("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "Enforced power limit (in W).",
          _scaled("enforced_limit_w", 1, whole=False)),
)
_FIELDS_4_9 = (
    Field("DCGM_FI_DEV_SM_CLOCK_HERTZ", "gauge", "SM clock frequency (in Hz).",
          _scaled("sm_clock_mhz", 1e6)),
    Field("DCGM_FI_DEV_GPU_TEMP_CELSIUS", "gauge", "GPU temperature (in C).",
          _scaled("temp_c", 1)),
    Field("DCGM_FI_DEV_BOARD_POWER_WATTS", "gauge", "Power draw (in W).",
          _scaled("power_w", 1, whole=False)),
    Field("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", "counter",
          "Total energy consumption since boot (in J).", _scaled("energy_mj", 1e-3)),
    Field("DCGM_FI_DEV_GPU_UTIL_RATIO", "gauge", "GPU utilization (ratio 0-1).",
          _scaled("util_percent", 1e-2, whole=False)),
    Field("DCGM_FI_DEV_XID_ERROR", "gauge", "Value of the last XID error encountered.",
          lambda gpu: gpu.last_xid),
    *_FIELDS_4_8[-2:],
)
_FIELDS = {"4.8": _FIELDS_4_8, "4.9": _FIELDS_4_9}
_DRIVER_LABEL = {"4.8": "DCGM_FI_DRIVER_VERSION", "4.9": "DCGM_FI_SYSTEM_DRIVER_VERSION"}
# Families a failed GPU still reports: its XID, which is how the failure shows.
_XID_FIELDS = {"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"}

XID_COUNT = ("DCGM_EXP_XID_ERRORS_COUNT", "gauge",
             "XID errors observed during the configured time window.")
XID_TOTAL = ("DCGM_EXP_XID_ERRORS_TOTAL", "counter",
             "Total XID errors observed since exporter start.")
HEALTH = ("DCGM_EXP_GPU_HEALTH_STATUS", "gauge", "Current DCGM-reported GPU health status.")

# one sample: the GPU it describes, the family's own labels, the value
Sample = tuple[GpuSnapshot, dict[str, str], float | None]


def render(gpus: Sequence[GpuSnapshot], *, hostname: str, generation: str) -> str:
    """The exporter's page for `gpus` on host `hostname`; ValueError for an unknown generation."""
    if generation not in _FIELDS:
        raise ValueError(f"unknown dcgm-exporter generation {generation!r}; "
                         f"choose from {', '.join(GENERATIONS)}")
    gpus = sorted(gpus, key=lambda gpu: gpu.uuid)
    families: list[tuple[str, str, str, list[Sample]]] = [
        (field.name, field.type, field.help,
         [(gpu, {}, field.value(gpu)) for gpu in gpus if gpu.healthy or field.name in _XID_FIELDS])
        for field in _FIELDS[generation]
    ]
    families.append((*XID_COUNT, [s for gpu in gpus for s in _xid_window(gpu)]))
    families.append((*XID_TOTAL, [(gpu, {"xid": str(xid)}, n) for gpu in gpus
                                  for xid, n in gpu.xid_totals]))
    families.append((*HEALTH, [s for gpu in gpus for s in _health(gpu)]))
    lines: list[str] = []
    for name, type_, help_, samples in sorted(families, key=lambda family: family[0]):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {type_}"]
        lines += [f"{name}{{{_labels(gpu, generation, hostname, extra)}}} {_go_g(value)}"
                  for gpu, extra, value in samples if _available(value)]
    return "\n".join(lines) + "\n"


def _xid_window(gpu: GpuSnapshot) -> list[Sample]:
    start = gpu.taken_at - XID_WINDOW_MS / 1000
    counts: dict[int, int] = {}
    for xid, at in gpu.xid_events:
        if at >= start:
            counts[xid] = counts.get(xid, 0) + 1
    window = {"window_size_in_ms": str(XID_WINDOW_MS)}
    if not counts:
        return [(gpu, window, 0)]
    return [(gpu, {**window, "xid": str(xid)}, n) for xid, n in sorted(counts.items())]


def _health(gpu: GpuSnapshot) -> list[Sample]:
    failing = None
    if not gpu.healthy:
        failing = "PCIE" if gpu.last_xid == FALLEN_OFF_THE_BUS else "DRIVER"
    return [
        (gpu, {"health_watch": watch,
               "health_error_code": "DCGM_FR_XID_ERROR" if watch == failing else "DCGM_FR_OK"},
         HEALTH_FAIL if watch == failing else HEALTH_PASS)
        for watch in HEALTH_WATCHES
    ]


def _labels(gpu: GpuSnapshot, generation: str, hostname: str, extra: dict[str, str]) -> str:
    labels = {
        "gpu": str(gpu.index),
        "UUID": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "device": f"nvidia{gpu.index}",
        "modelName": gpu.model_name,
        "hostname": hostname,
        _DRIVER_LABEL[generation]: DRIVER_VERSION,
        **extra,
    }
    return ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _available(value: float | None) -> bool:
    """False for what DCGM reports as blank: no value, NaN, infinities and the sentinels."""
    if value is None or not math.isfinite(value):
        return False
    return value < (INT64_BLANK if isinstance(value, int) else FP64_BLANK)


def _go_g(value: float) -> str:
    """`value` as Go's fmt %g prints it: shortest digits that round-trip, %e form when the
    decimal exponent is below -4 or at least 6 (`1.98e+09`, `700`, `612.5`)."""
    if value == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(float(value))).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    point = len(text) + exponent  # digits before the decimal point
    head = "-" if sign else ""
    if not -4 <= point - 1 < 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{head}{mantissa}e{point - 1:+03d}"
    if point <= 0:
        return f"{head}0.{'0' * -point}{text}"
    if point >= len(text):
        return head + text + "0" * (point - len(text))
    return f"{head}{text[:point]}.{text[point:]}"
