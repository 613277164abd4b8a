"""An NTPTrainingJob's status rebuilt from a plan: phase, TP layout, replicas and Conditions.

Pure: the operator passes what it observed (the plan, or why there is none) and the previous
status, and gets the whole new status back. A condition keeps its lastTransitionTime while its
status stays the same, as metav1.Condition requires.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera_operator.planner import JobPlan, Problem, gpu_name

# Far below the CRD's 32768: a status must stay small whatever the number of replicas.
MESSAGE_MAX = 2048


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


def _clip(message: str) -> str:
    tail = " ... (clipped)"
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - len(tail)] + tail


def _ready(plan: JobPlan | None, problems: Sequence[Problem], notes: Sequence[str]) -> Condition:
    suffix = "".join(f"; {n}" for n in notes)
    if plan is None or not plan.replicas:
        first = problems[0] if problems else Problem("NoGPUNodes", "no GPU node serves this job")
        return Condition("Ready", False, first.reason, first.message + suffix)
    if plan.degraded:
        return Condition("Ready", True, "RunningDegraded",
                         f"{len(plan.replicas)} replicas at TP {plan.tp_layout}" + suffix)
    return Condition("Ready", True, "AllReplicasHealthy",
                     f"{len(plan.replicas)} replicas at TP {plan.spec.tp}" + suffix)


def _degraded(plan: JobPlan | None) -> Condition:
    if plan is None or not plan.replicas:
        return Condition("Degraded", False, "NotRunning", "no replica is running")
    reduced = [r for r in plan.replicas if r.tp < plan.spec.tp]
    if reduced:
        parts = [f"replica {r.index} at TP {r.tp} (failed "
                 f"{', '.join(map(gpu_name, r.failed_gpus())) or 'none: packed with one'})"
                 for r in reduced]
        return Condition("Degraded", True, "ReducedTensorParallelism", "; ".join(parts))
    if len(plan.replicas) < plan.spec.dp:
        return Condition("Degraded", True, "ReplicasDropped",
                         f"{len(plan.replicas)} of {plan.spec.dp} replicas running")
    return Condition("Degraded", False, "AllReplicasHealthy", "every replica runs at full TP")


def _power(plan: JobPlan | None) -> Condition:
    if plan is None or plan.spec.power is None or plan.spec.mode != "NTP-PW":
        return Condition("PowerBoosted", False, "NotNTPPW",
                         "power boosts need failurePolicy.mode NTP-PW and a powerPolicy")
    boosted = [r for r in plan.replicas if r.power_ratio > 1.0]
    if not boosted:
        return Condition("PowerBoosted", False, "NoReducedReplica", "every GPU at its base cap")
    parts = [f"replica {r.index} (TP {r.tp}): x{r.power_ratio:.3f} power, capped at "
             f"{plan.spec.power.boost_cap_w} W" for r in boosted]
    return Condition("PowerBoosted", True, "SurvivorsBoosted", "; ".join(parts))


def conditions(
    plan: JobPlan | None, problems: Sequence[Problem], notes: Sequence[str] = ()
) -> tuple[Condition, ...]:
    """Ready, Degraded and PowerBoosted; `notes` (ignored health input) go into Ready's message."""
    return _ready(plan, problems, notes), _degraded(plan), _power(plan)


def phase(plan: JobPlan | None) -> str:
    if plan is None or not plan.replicas:
        return "Pending"
    return "Degraded" if plan.degraded else "Running"


def _replicas(plan: JobPlan) -> list[dict[str, Any]]:
    return [
        {
            "index": r.index,
            "tensorParallelSize": r.tp,
            "nodes": list(r.nodes()),
            "failedGPUs": [gpu_name(g) for g in r.failed_gpus()],
            "powerBoosted": plan.spec.mode == "NTP-PW" and r.power_ratio > 1.0,
        }
        for r in plan.replicas
    ]


def render(
    plan: JobPlan | None,
    problems: Sequence[Problem],
    previous: Mapping[str, Any],
    *,
    now: str,
    generation: int,
    layout_generation: int,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The job's whole status. `previous` is the status as observed, `now` an RFC 3339 time."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    rendered = []
    for c in conditions(plan, problems, notes):
        status = "True" if c.status else "False"
        old = before.get(c.type) or {}
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        rendered.append({"type": c.type, "status": status, "reason": c.reason,
                         "message": _clip(c.message), "observedGeneration": generation,
                         "lastTransitionTime": since or now})
    return {
        "observedGeneration": generation,
        "phase": phase(plan),
        "layoutGeneration": layout_generation,
        "tpLayout": plan.tp_layout if plan else "",
        "replicas": _replicas(plan) if plan else [],
        "conditions": rendered,
    }


def changed(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Conditions whose status, reason or message differ from before: one Event each."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    key = ("status", "reason", "message")
    return [c for c in current["conditions"]
            if tuple(c[k] for k in key) != tuple((before.get(c["type"]) or {}).get(k) for k in key)]
