"""GPUs as NVIDIA's DRA driver (k8s-dra-driver-gpu) names them, for whoever reads or writes them:
the driver's name, its DeviceClass, its device names (`gpu-<minor>`), the device taints it sets
and the claim tolerations that keep a trainer pod on a tainted GPU (docs/dra.md)."""

from __future__ import annotations

import re

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
# The taints the driver sets: an XID (NoSchedule for a fatal one) and a GPU it lost.
XID_TAINT = "gpu.nvidia.com/xid"
LOST_TAINT = "gpu.nvidia.com/gpu-lost"
EFFECTS = ("None", "NoSchedule", "NoExecute")
_DEVICE = re.compile(r"gpu-(0|[1-9][0-9]{0,3})")


def device_name(index: int) -> str:
    return f"gpu-{index}"


def device_index(name: str) -> int | None:
    """The GPU index of a device the driver names (`gpu-3` -> 3); None for another name (a MIG
    device, another driver's)."""
    match = _DEVICE.fullmatch(name)
    return int(match.group(1)) if match else None


def claim_tolerations() -> list[dict[str, str]]:
    """What a trainer pod's claim request tolerates: every taint the driver sets, NoExecute
    included, so the device-taint eviction controller leaves the pod running and Tessera
    reshapes its replica instead. The effect is explicit: a toleration without one does not
    tolerate NoExecute device taints (unlike node taints)."""
    return [{"key": key, "operator": "Exists", "effect": "NoExecute"}
            for key in (XID_TAINT, LOST_TAINT)]
