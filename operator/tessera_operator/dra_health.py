"""GPU health from DRA (pure): the device taints on the job's GPUs, in the nodes' ResourceSlices and
in DeviceTaintRules, and the devices' health in its trainer pods' `allocatedResourcesStatus`.

A taint's effect says how the GPU leaves the layout: NoSchedule (what NVIDIA's driver sets for a
fatal XID) drains it, a planned relayout; NoExecute (an administrator's DeviceTaintRule, or a
driver's) is a loss under the processes, an unplanned one, and the trainer pods tolerate it
(`dradevice.claim_tolerations`), so the replica is reshaped instead of the pod evicted; None
changes nothing. A device its pod's container status calls Unhealthy is lost; Unknown is neither
failed nor healthy. A job takes whole nodes, so device `gpu-<i>` of a node's pool is the job's
GPU i there. Objects are parsed once, as the watches deliver them (`read_slice`, `read_rule`);
what cannot be used is ignored and said in the problems.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera_contracts.dradevice import DRIVER, device_index
from tessera_operator.health import GpuId, Health


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str  # None, NoSchedule, NoExecute

    def shown(self) -> str:
        return f"{self.key}={self.value}:{self.effect}"


@dataclass(frozen=True)
class SliceView:
    """What health reads of a ResourceSlice: its node, driver and pool, and each device's
    taints by name."""

    node: str | None
    driver: str
    pool: str
    taints: Mapping[str, tuple[Taint, ...]]
    devices: tuple[str, ...]


@dataclass(frozen=True)
class RuleView:
    """A DeviceTaintRule: the devices it selects (None: any) and its taint."""

    name: str
    driver: str | None
    pool: str | None
    device: str | None
    taint: Taint


@dataclass(frozen=True)
class DeviceTaints:
    """The DRA objects a reconcile read for the job's nodes."""

    slices: tuple[SliceView, ...] = ()
    rules: tuple[RuleView, ...] = ()


def _taint(data: Any) -> Taint | None:
    if not isinstance(data, Mapping) or not data.get("key") or not data.get("effect"):
        return None
    return Taint(str(data["key"]), str(data.get("value") or ""), str(data["effect"]))


def read_slice(obj: Mapping[str, Any]) -> SliceView:
    """A ResourceSlice as the API sends it, reduced to what health reads."""
    spec = obj.get("spec") or {}
    taints: dict[str, tuple[Taint, ...]] = {}
    names = []
    for device in spec.get("devices") or []:
        name = str(device.get("name"))
        names.append(name)
        found = tuple(t for t in map(_taint, device.get("taints") or []) if t is not None)
        if found:
            taints[name] = found
    return SliceView(spec.get("nodeName"), str(spec.get("driver")),
                     str((spec.get("pool") or {}).get("name")), taints, tuple(names))


def read_rule(obj: Mapping[str, Any]) -> RuleView | None:
    """A DeviceTaintRule as the API sends it; None when it has no usable taint."""
    spec = obj.get("spec") or {}
    taint = _taint(spec.get("taint"))
    if taint is None:
        return None
    selector = spec.get("deviceSelector") or {}
    return RuleView(str((obj.get("metadata") or {}).get("name")), selector.get("driver"),
                    selector.get("pool"), selector.get("device"), taint)


def _selects(rule: RuleView, found: SliceView, device: str) -> bool:
    return all(want is None or want == have for want, have in (
        (rule.driver, found.driver), (rule.pool, found.pool), (rule.device, device)))


def from_device_taints(taints: DeviceTaints, nodes: Iterable[str], gpus_per_node: int
                       ) -> tuple[Health, Health]:
    """The job's GPUs on `nodes` that a device taint takes out, and the part of them lost under
    their processes (NoExecute) rather than drained (NoSchedule)."""
    wanted = set(nodes)
    drained: dict[GpuId, str] = {}
    lost: dict[GpuId, str] = {}
    for found in taints.slices:
        if found.driver != DRIVER or found.node not in wanted:
            continue
        for device in found.devices:
            index = device_index(device)
            if index is None or index >= gpus_per_node:
                continue
            on_device = [(t, "its DRA driver") for t in found.taints.get(device, ())]
            on_device += [(r.taint, f"DeviceTaintRule {r.name}") for r in taints.rules
                          if _selects(r, found, device)]
            for taint, source in on_device:
                why = f"device {device} tainted {taint.shown()} by {source}"
                if taint.effect == "NoExecute":
                    lost.setdefault((found.node, index), why)
                elif taint.effect == "NoSchedule":
                    drained.setdefault((found.node, index), why)
    failed = drained | lost
    return (Health(frozenset(failed), reasons=failed),
            Health(frozenset(lost), reasons=lost))


# The device a resource ID names: `<driver>/<pool>/<device>` (the kubelet's form without CDI) or a
# CDI device ID that ends in it (NVIDIA's: `k8s.gpu.nvidia.com/claim=<claim UID>-gpu-0`).
_RESOURCE_DEVICE = re.compile(r"[/-](gpu-[0-9]+)$")


def from_resource_health(pods: Iterable[Mapping[str, Any]], gpus_per_node: int) -> Health:
    """The GPUs the job's trainer pods' container statuses report Unhealthy (failed: lost under
    the process) or Unknown, by the node each pod runs on."""
    failed: dict[GpuId, str] = {}
    unknown: set[GpuId] = set()
    problems: list[str] = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        status = pod.get("status") or {}
        if not node:
            continue
        for container in status.get("containerStatuses") or []:
            for entry in container.get("allocatedResourcesStatus") or []:
                for resource in entry.get("resources") or []:
                    health = resource.get("health")
                    if health not in ("Unhealthy", "Unknown"):
                        continue
                    rid = str(resource.get("resourceID"))
                    match = _RESOURCE_DEVICE.search(rid)
                    index = device_index(match.group(1)) if match else None
                    if index is None or index >= gpus_per_node:
                        problems.append(f"node {node}: {entry.get('name')}: resource {rid!r} "
                                        f"reported {health} names no GPU of the job, ignored")
                    elif health == "Unhealthy":
                        failed[(node, index)] = (f"its pod reports device {match.group(1)} "
                                                 f"Unhealthy{_message(resource)}")
                    else:
                        unknown.add((node, index))
    return Health(frozenset(failed), tuple(problems), frozenset(unknown), failed)


def _message(resource: Mapping[str, Any]) -> str:
    message = str(resource.get("message") or "")[:200]
    return f": {message}" if message else ""
