"""Power targets as data: the `GPUPowerTarget` spec, its validation, and its rendering.

Pure (no Kubernetes client): the operator renders targets with `to_object`, the agent re-validates
whatever it reads with `parse_object` -- the CRD schema is a first line of defence, not the only
one, because the agent must not trust anything a misconfigured API server would let through. The
agent reports what is in effect in the object's `status` (`render_status`), and the operator
reads back whether a node's budget is met (`budget_in_effect`) before raising any node that
depends on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from tessera_contracts.api import GROUP, VERSION
from tessera_contracts.api import POWER_TARGET_KIND as KIND

# Sanity bounds, far outside any real GPU (the device's own [min, max] is applied later): they
# exist to reject garbage, e.g. a watts value given in milliwatts.
MAX_GPU_WATTS = 5000
MAX_GPUS_PER_NODE = 64
_NAME_MAX = 253
OPTIONAL_FIELDS = ("rampStepWatts",)
FLOOR_W = 1  # a base cap below any GPU's range: the agent clamps it up to each GPU's minimum
# What a node's power agent serves on its metrics endpoint (container port `metrics`) that another
# process reads: `tessera uninstall` waits for the settled gauge of every node a job used, and
# names the GPUs that are not at their target.
SETTLED_METRIC = "tessera_power_agent_settled"
LIMIT_METRIC = "tessera_gpu_power_limit_watts"
TARGET_METRIC = "tessera_gpu_power_target_watts"


class InvalidTarget(ValueError):
    """A target object that must not be acted on; the message says which field and why."""


@dataclass(frozen=True)
class PowerTarget:
    """What the operator asks of one node's GPUs.

    `budget_w` caps the sum of the power limits of this node's GPUs (the node's share of its
    rack's budget); `base_w` applies to every GPU not listed in `gpu_w`. A target holds until
    it is changed or deleted.
    """

    node: str
    rack: str
    budget_w: int
    base_w: int
    rack_budget_w: int
    gpu_w: dict[int, int] = field(default_factory=dict)
    ramp_step_w: int | None = None  # None: the agent's own setting

    def watts_for(self, index: int) -> int:
        return self.gpu_w.get(index, self.base_w)

    def boosted(self, index: int) -> bool:
        return self.watts_for(index) > self.base_w

    def entry(self) -> PowerTarget:
        """The first target of a node joining a rack that spans nodes: every GPU at its device
        minimum (a base cap of FLOOR_W, below any GPU's range), inside this target's share.
        Whatever share the node's agent still holds from an earlier target, this is a cut."""
        return replace(self, base_w=FLOOR_W, gpu_w={}, ramp_step_w=None)

    @property
    def at_floor(self) -> bool:
        """An entry target: its GPUs hold no more than their minimum, whatever its budget."""
        return self.base_w == FLOOR_W and not self.gpu_w

    def settled(self) -> PowerTarget:
        """The node's non-boosted level inside this target's budget share: every GPU at the base
        cap, no boost list, no ramp of its own. What the agent settles to when nothing
        asks for a boost any more (target deleted or invalid, agent leaving)."""
        return replace(self, gpu_w={}, ramp_step_w=None)


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
    return parse_spec(obj["spec"], node)


def parse_spec(spec: dict[str, Any], node: str) -> PowerTarget:
    """Validate a target's `spec` for `node`; raise InvalidTarget naming the field."""
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
        rack_budget_w=_int(spec, "rackBudgetWatts", budget, 2**31 - 1),
        gpu_w=gpu_w,
        ramp_step_w=None if spec.get("rampStepWatts") is None else _int(
            spec, "rampStepWatts", 1, MAX_GPU_WATTS),
    )


def format_time(t: datetime, timespec: str = "seconds") -> str:
    """`t` in UTC as the API writes times (a `Z`, to the second); `timespec` as `isoformat`'s
    for a finer one."""
    return t.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def to_object(target: PowerTarget) -> dict[str, Any]:
    """The API object for `target` (cluster-scoped, named after the node). The rack is in the
    spec (and a printer column), not a label: a rack named after a node may be longer than a
    label value may be."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": target.node, "labels": {}},
        "spec": {
            "rack": target.rack,
            "rackBudgetWatts": target.rack_budget_w,
            "budgetWatts": target.budget_w,
            "baseWatts": target.base_w,
            "gpus": [{"index": i, "watts": w} for i, w in sorted(target.gpu_w.items())],
        }
        | ({} if target.ramp_step_w is None else {"rampStepWatts": target.ramp_step_w}),
    }


# --- status: what the node's agent reports in effect ---------------------------------------


def render_status(
    *,
    generation: int | None,
    in_effect: bool,
    state: str,
    message: str,
    limits_mw: Mapping[int, int | None],
) -> dict[str, Any]:
    """The `status` the agent writes: the spec generation it acts on (`observedGeneration`),
    the one whose budget its GPUs' limits are within (`appliedGeneration`, None while they are
    not), its state (Applied, Ramping, Holding, Infeasible, Settled) and why, and the limits
    in effect per GPU (whole watts, rounded up: what the budget must hold)."""
    known = {i: -(-mw // 1000) for i, mw in sorted(limits_mw.items()) if mw is not None}
    return {
        "observedGeneration": generation,
        "appliedGeneration": generation if in_effect else None,
        "state": state,
        "message": message[:1024],
        "limitWatts": sum(known.values()),
        "gpus": [{"index": i, "limitWatts": w} for i, w in known.items()],
    }


def reported_limits(obj: Mapping[str, Any]) -> dict[int, int]:
    """GPU index -> the limit in whole watts the node's agent reports it counts (`status.gpus`),
    for the entries that are well formed; {} without a status."""
    gpus = (obj.get("status") or {}).get("gpus")
    if not isinstance(gpus, list):
        return {}
    return {g["index"]: g["limitWatts"] for g in gpus
            if isinstance(g, dict) and type(g.get("index")) is int
            and type(g.get("limitWatts")) is int and g["limitWatts"] > 0}


def budget_in_effect(obj: Mapping[str, Any]) -> bool:
    """Whether the node's agent reports its GPUs within the budget of the spec this object holds
    now (a spec written since has not been acted on yet)."""
    generation = (obj.get("metadata") or {}).get("generation")
    applied = (obj.get("status") or {}).get("appliedGeneration")
    return isinstance(generation, int) and applied == generation
