"""The GPU power backend interface: device readings, typed errors, and the protocol backends meet.

Every backend (NVML on a real node, the simulated GPUs elsewhere) reports in milliwatts, like NVML,
and raises only the errors defined here, so the agent handles one vocabulary of failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# NVML's clock-event bit for "clocks lowered because of the software power cap".
SW_POWER_CAP = 0x4


class PowerError(Exception):
    """A backend operation failed; `index` names the GPU when the failure is specific to one."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class NoPermission(PowerError):
    """The caller may read but not change the setting (not root, or the driver forbids it)."""


class NotSupported(PowerError):
    """This GPU or driver has no such setting (e.g. power limits on a consumer part)."""


class GpuLost(PowerError):
    """The GPU fell off the bus or stopped answering; its state is unknown."""


class NotFound(PowerError):
    """No GPU with that identity on this node (replaced, or gone from the bus for good)."""


class InvalidArgument(PowerError):
    """The driver rejected the value (e.g. a limit outside the GPU's constraints)."""


class BackendUnavailable(PowerError):
    """The backend cannot be used at all: library missing, driver not loaded, not initialised."""


@dataclass(frozen=True)
class GpuId:
    """A GPU as the node sees it: its index on this node and its stable UUID, None while the GPU
    cannot be identified (lost before it was ever read)."""

    index: int
    uuid: str | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU's power state, all powers in milliwatts."""

    index: int
    uuid: str
    power_mw: int
    limit_mw: int
    enforced_mw: int
    default_mw: int
    min_mw: int
    max_mw: int
    sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None

    @property
    def power_capped(self) -> bool:
        """Whether the clocks are currently held down by the software power cap."""
        return bool(self.clock_event_reasons and self.clock_event_reasons & SW_POWER_CAP)


class PowerBackend(Protocol):
    """What the agent needs from a node's GPUs. Implementations raise only `PowerError`s.

    `gpus()` fails only when the whole backend does; one GPU's failure shows as its `uuid` None
    there, or as errors from `read`/`set_limit` on its index. `restore_default` finds the GPU by
    UUID (indices may change across reboots), reads its default limit from the device, sets it,
    and returns it.
    """

    def gpus(self) -> list[GpuId]: ...

    def restore_default(self, uuid: str) -> int: ...

    def read(self, index: int) -> GpuReading: ...

    def set_limit(self, index: int, milliwatts: int) -> None: ...

    def close(self) -> None: ...
