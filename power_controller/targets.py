"""Power targets as data: the `GPUPowerTarget` spec, its validation, and its rendering.

Pure (no Kubernetes client): the operator renders targets with `to_object`, the agent re-validates
whatever it reads with `parse_object` -- the CRD schema is a first line of defence, not the only
one, because the agent must not trust anything a misconfigured API server would let through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

GROUP = "tessera.dev"
VERSION = "v1alpha1"
KIND = "GPUPowerTarget"
PLURAL = "gpupowertargets"

# Sanity bounds, far outside any real GPU (the device's own [min, max] is applied later): they
# exist to reject garbage, e.g. a watts value given in milliwatts.
MAX_GPU_WATTS = 5000
MAX_GPUS_PER_NODE = 64
TTL_RANGE_S = (5, 86_400)
_NAME_MAX = 253
OPTIONAL_FIELDS = ("rampStepWatts",)


class InvalidTarget(ValueError):
    """A target object that must not be acted on; the message says which field and why."""


@dataclass(frozen=True)
class PowerTarget:
    """What the operator asks of one node's GPUs.

    `budget_w` caps the sum of the power limits of this node's GPUs (the node's share of its
    rack's budget); `base_w` applies to every GPU not listed in `gpu_w`; the target is only
    acted on until `renew_time + ttl_s`.
    """

    node: str
    rack: str
    budget_w: int
    base_w: int
    renew_time: datetime
    ttl_s: int
    rack_budget_w: int
    gpu_w: dict[int, int] = field(default_factory=dict)
    ramp_step_w: int | None = None  # None: the agent's own setting

    def watts_for(self, index: int) -> int:
        return self.gpu_w.get(index, self.base_w)

    def boosted(self, index: int) -> bool:
        return self.watts_for(index) > self.base_w

    def stale(self, now: datetime) -> bool:
        age = (now - self.renew_time).total_seconds()
        return age > self.ttl_s or age < -self.ttl_s  # a far-future renewTime is as suspect


def _int(obj: dict[str, Any], key: str, lo: int, hi: int, where: str = "spec") -> int:
    value = obj.get(key)
    # bool is an int in Python; a YAML `true` must not pass as 1 W.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTarget(f"{where}.{key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidTarget(f"{where}.{key}={value} outside [{lo}, {hi}]")
    return value


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= _NAME_MAX:
        raise InvalidTarget(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise InvalidTarget(f"spec.renewTime must be an RFC 3339 string, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise InvalidTarget(f"spec.renewTime {value!r} is not RFC 3339: {err}") from err
    if parsed.tzinfo is None:
        raise InvalidTarget(f"spec.renewTime {value!r} has no time zone")
    return parsed


def parse_object(obj: Any, node: str) -> PowerTarget:
    """Validate a `GPUPowerTarget` object read from the API for `node`; raise InvalidTarget."""
    if not isinstance(obj, dict) or not isinstance(obj.get("spec"), dict):
        raise InvalidTarget("object has no spec")
    if obj.get("apiVersion") != f"{GROUP}/{VERSION}" or obj.get("kind") != KIND:
        got = f"{obj.get('apiVersion')} {obj.get('kind')}"
        raise InvalidTarget(f"not a {GROUP}/{VERSION} {KIND}: {got}")
    name = (obj.get("metadata") or {}).get("name")
    if name != node:
        raise InvalidTarget(f"target is for node {name!r}, this agent runs on {node!r}")
    spec = obj["spec"]
    gpus = spec.get("gpus", [])
    if not isinstance(gpus, list) or len(gpus) > MAX_GPUS_PER_NODE:
        raise InvalidTarget(f"spec.gpus must be a list of at most {MAX_GPUS_PER_NODE} entries")
    gpu_w: dict[int, int] = {}
    for i, entry in enumerate(gpus):
        if not isinstance(entry, dict):
            raise InvalidTarget(f"spec.gpus[{i}] must be an object, got {entry!r}")
        index = _int(entry, "index", 0, MAX_GPUS_PER_NODE - 1, f"spec.gpus[{i}]")
        if index in gpu_w:
            raise InvalidTarget(f"spec.gpus lists GPU {index} twice")
        gpu_w[index] = _int(entry, "watts", 1, MAX_GPU_WATTS, f"spec.gpus[{i}]")
    budget = _int(spec, "budgetWatts", 1, MAX_GPU_WATTS * MAX_GPUS_PER_NODE)
    return PowerTarget(
        node=node,
        rack=_str(spec, "rack", "spec"),
        budget_w=budget,
        base_w=_int(spec, "baseWatts", 1, MAX_GPU_WATTS),
        renew_time=_time(spec.get("renewTime")),
        ttl_s=_int(spec, "ttlSeconds", *TTL_RANGE_S),
        rack_budget_w=_int(spec, "rackBudgetWatts", budget, 2**31 - 1),
        gpu_w=gpu_w,
        ramp_step_w=None if spec.get("rampStepWatts") is None else _int(
            spec, "rampStepWatts", 1, MAX_GPU_WATTS),
    )


def format_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def to_object(target: PowerTarget) -> dict[str, Any]:
    """The API object for `target` (cluster-scoped, named after the node)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": target.node, "labels": {f"{GROUP}/rack": target.rack}},
        "spec": {
            "rack": target.rack,
            "rackBudgetWatts": target.rack_budget_w,
            "budgetWatts": target.budget_w,
            "baseWatts": target.base_w,
            "gpus": [{"index": i, "watts": w} for i, w in sorted(target.gpu_w.items())],
            "renewTime": format_time(target.renew_time),
            "ttlSeconds": target.ttl_s,
        }
        | ({} if target.ramp_step_w is None else {"rampStepWatts": target.ramp_step_w}),
    }
