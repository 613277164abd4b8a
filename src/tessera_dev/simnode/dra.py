"""The simulated node's GPUs as NVIDIA's DRA driver (k8s-dra-driver-gpu) shows them, and a pod's
claims as the kubelet resolves them (pure: no API, no files).

The driver publishes one ResourceSlice per node (driver gpu.nvidia.com, the pool named after
the node), one device `gpu-<minor>` per GPU with the driver's attributes (type, uuid,
productName, brand, architecture, cudaComputeCapability, driverVersion, cudaDriverVersion,
pcieBusID, addressingMode, resource.kubernetes.io/pcieRoot) and its memory as capacity; a GPU
the driver finds faulty carries a device taint `gpu.nvidia.com/xid=<XID>` (NoSchedule for a
fatal XID, as the driver sets it). The scheduler allocates devices to a pod's ResourceClaims;
the kubelet gives each container the devices of the claims it names (`resources.claims`), and
reports their health in the container's `allocatedResourcesStatus`, one entry per claim (and
request, when the container names one), each device by its resource ID
`<driver>/<pool>/<device>` (what the kubelet uses where the driver gives no CDI device ID).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tessera_contracts.dradevice import (
    DEVICE_CLASS,
    DRIVER,
    EFFECTS,
    XID_TAINT,
    device_index,
    device_name,
)

__all__ = ["DEVICE_CLASS", "DRIVER", "EFFECTS", "XID_TAINT", "device_index", "device_name"]
# as the driver writes them: semantic versions, without leading zeros (NVML says 580.95.05)
DRIVER_VERSION = "580.95.5"
CUDA_DRIVER_VERSION = "13.0.0"
# model name -> (architecture, CUDA compute capability, memory), as NVML reports them
MODELS = {
    "NVIDIA H100": ("Hopper", "9.0.0", "80Gi"),
    "NVIDIA H200": ("Hopper", "9.0.0", "141Gi"),
    "NVIDIA B200": ("Blackwell", "10.0.0", "180Gi"),
}


class Gpu(Protocol):
    """What the slice says of one GPU (tessera_agents.power.sim_backend.GpuSnapshot has it)."""

    index: int
    uuid: str
    pci_bus_id: str
    model_name: str


@dataclass(frozen=True)
class Taint:
    """A device taint, as the driver writes it into its slice."""

    value: str
    effect: str = "NoSchedule"
    key: str = XID_TAINT

    def __post_init__(self) -> None:
        if self.effect not in EFFECTS:
            raise ValueError(f"a device taint's effect is one of {', '.join(EFFECTS)}, "
                             f"not {self.effect!r}")

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Taint:
        return cls(str(data["value"]), str(data["effect"]), str(data["key"]))


class ClaimNotReady(Exception):
    """A claim of the pod is not allocated yet, or not yet known to the pod."""


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"


def resource_slice(node: str, gpus: Iterable[Gpu], taints: Mapping[int, Taint],
                   generation: int) -> dict[str, Any]:
    """The node's ResourceSlice: every GPU a device, tainted where `taints` says."""
    devices = []
    for gpu in gpus:
        architecture, capability, memory = MODELS.get(gpu.model_name,
                                                      ("Unknown", "0.0.0", "0"))
        domain, bus = gpu.pci_bus_id.split(":", 1)
        device: dict[str, Any] = {
            "name": device_name(gpu.index),
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": gpu.uuid},
                "productName": {"string": gpu.model_name},
                "brand": {"string": "Nvidia"},
                "architecture": {"string": architecture},
                "cudaComputeCapability": {"version": capability},
                "driverVersion": {"version": DRIVER_VERSION},
                "cudaDriverVersion": {"version": CUDA_DRIVER_VERSION},
                # the driver's form of the address: a 4-digit domain, lower case
                "pcieBusID": {"string": f"{domain[-4:]}:{bus}".lower()},
                "addressingMode": {"string": "None"},
                "resource.kubernetes.io/pcieRoot": {"string": f"pci{domain[-4:]}:00"},
            },
            "capacity": {"memory": {"value": memory}},
        }
        if gpu.index in taints:
            device["taints"] = [taints[gpu.index].to_dict()]
        devices.append(device)
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                 "devices": devices},
    }


def pod_claims(pod: Mapping[str, Any]) -> dict[str, str]:
    """The pod's claims: the name the pod gives each -> its ResourceClaim's name (a claim made
    from a template is named in the pod's status once the controller-manager made it);
    ClaimNotReady while one is not known yet."""
    named = {s.get("name"): s.get("resourceClaimName") for s in
             (pod.get("spec") or {}).get("resourceClaims") or []}
    made = {s.get("name"): s.get("resourceClaimName") for s in
            (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    claims = {}
    for name, direct in named.items():
        claim = direct or made.get(name)
        if not claim:
            raise ClaimNotReady(f"claim {name!r} of the pod has no ResourceClaim yet")
        claims[name] = claim
    return claims


@dataclass(frozen=True)
class Device:
    """A device allocated to one of a pod's claims, on this node's pool."""

    request: str  # the claim's request it serves ("req", or "req/subrequest")
    name: str  # gpu-N
    index: int
    resource_id: str  # <driver>/<pool>/<device>


def allocated(claim: Mapping[str, Any], node: str) -> list[Device]:
    """The devices of this node's driver and pool the scheduler allocated to `claim`;
    ClaimNotReady while it has no allocation."""
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        name = (claim.get("metadata") or {}).get("name")
        raise ClaimNotReady(f"ResourceClaim {name!r} is not allocated yet")
    devices = []
    for result in (allocation.get("devices") or {}).get("results") or []:
        index = device_index(str(result.get("device")))
        if result.get("driver") == DRIVER and result.get("pool") == node and index is not None:
            devices.append(Device(str(result.get("request")), result["device"], index,
                                  f"{DRIVER}/{node}/{result['device']}"))
    return devices


def container_devices(container: Mapping[str, Any],
                      devices: Mapping[str, Sequence[Device]]) -> list[tuple[str, list[Device]]]:
    """The devices a container sees, by the entry its `allocatedResourcesStatus` gives them:
    `claim:<name>` for a whole claim, `claim:<name>/<request>` for one request of it (a device
    allocated for a subrequest `req/sub` serves the request `req`)."""
    seen = []
    for ref in (container.get("resources") or {}).get("claims") or []:
        name, request = ref.get("name"), ref.get("request")
        found = [d for d in devices.get(name, ())
                 if request is None or d.request.split("/", 1)[0] == request]
        seen.append((f"claim:{name}" if request is None else f"claim:{name}/{request}", found))
    return seen


def resource_health(entries: Sequence[tuple[str, Sequence[Device]]],
                    healthy: set[int]) -> list[dict[str, Any]]:
    """A container's `allocatedResourcesStatus`: each device Healthy or Unhealthy as the
    driver sees its GPU."""
    return [{"name": name, "resources": [
        {"resourceID": d.resource_id, "health": "Healthy" if d.index in healthy else "Unhealthy"}
        for d in found]} for name, found in entries]
