"""An NTPTrainingJob's status rebuilt from a plan: phase, TP layout, replicas and Conditions.

Pure: the operator passes what it observed (the plan, or why there is none; what the trainer
pods reported and how they ended) and the previous status, and gets the whole new status back.
A condition keeps its lastTransitionTime while its status stays the same, as metav1.Condition
requires.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tessera_contracts.jobspec import FailurePolicySpec
from tessera_contracts.progress import JobProgress, Phase, name_nodes
from tessera_contracts.vocabulary import FailurePolicy
from tessera_operator.lifecycle import Lifecycle, Stage, Starting
from tessera_operator.planner import (
    Boost,
    GpuId,
    JobPlan,
    Problem,
    ReplicaKey,
    below_base_cap,
    gpu_name,
)

# Far below the CRD's 32768: a status must stay small whatever the number of replicas.
MESSAGE_MAX = 2048
LAYOUT_IN_MESSAGE_MAX = 256
# A status must stay well inside etcd's 1.5 MiB request limit whatever the job's size (8,192
# replicas would take about 1 MB): past this budget replicas[] lists the reduced replicas first,
# then the others by index, and Ready's message says how many it leaves out.
REPLICAS_BYTES_MAX = 512 * 1024


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str


def _clip(message: str) -> str:
    tail = " ... (clipped)"
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - len(tail)] + tail


def refused(previous: Mapping[str, Any], why: str, now: str, generation: int
            ) -> dict[str, Any]:
    """The status `previous` (as the API server last took it) with Ready saying that the
    server refused the status the operator wrote after it (`why`, the server's message): the
    one thing a user then sees of the job changed. `now` is an RFC 3339 time."""
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == "Ready"), {})
    since = old.get("lastTransitionTime") if old.get("status") == "False" else None
    ready = {"type": "Ready", "status": "False", "reason": "StatusRefused",
             "message": _clip("the API server refused the job's status, which stays as it "
                              f"was: {why}"),
             "observedGeneration": generation, "lastTransitionTime": since or now}
    kept = [c for c in previous.get("conditions") or [] if c.get("type") != "Ready"]
    return dict(previous) | {"conditions": [ready, *kept]}


def _ready(plan: JobPlan | None, problems: Sequence[Problem], notes: Sequence[str]) -> Condition:
    suffix = "".join(f"; {n}" for n in notes)
    if plan is None or not plan.replicas:
        first = problems[0] if problems else Problem("NoGPUNodes", "no GPU node serves this job")
        return Condition("Ready", False, first.reason, first.message + suffix)
    if plan.degraded:
        layout = plan.tp_layout
        if len(layout) > LAYOUT_IN_MESSAGE_MAX:  # tpLayout holds it; the message stays readable
            reduced = sum(r.tp < plan.spec.tp for r in plan.replicas)
            layout = f"{plan.spec.tp}, {reduced} of them reduced (degrees in tpLayout)"
        return Condition("Ready", True, "RunningDegraded",
                         f"{len(plan.replicas)} replicas at TP {layout}" + suffix)
    return Condition("Ready", True, "AllReplicasHealthy",
                     f"{len(plan.replicas)} replicas at TP {plan.spec.tp}" + suffix)


def _degraded(plan: JobPlan | None, why: Mapping[GpuId, str]) -> Condition:
    if plan is None or not plan.replicas:
        return Condition("Degraded", False, "NotRunning", "no replica is running")
    reduced = [r for r in plan.replicas if r.tp < plan.spec.tp]
    if reduced:
        def failed(gpu: GpuId) -> str:
            return gpu_name(gpu) + (f": {why[gpu]}" if gpu in why else "")

        parts = [f"replica {r.index} at TP {r.tp} (failed "
                 f"{', '.join(map(failed, r.failed_gpus())) or 'none: packed with one'})"
                 for r in reduced]
        return Condition("Degraded", True, "ReducedTensorParallelism", "; ".join(parts))
    if len(plan.replicas) < plan.spec.dp:
        return Condition("Degraded", True, "ReplicasDropped",
                         f"{len(plan.replicas)} of {plan.spec.dp} replicas running")
    return Condition("Degraded", False, "AllReplicasHealthy", "every replica runs at full TP")


def _power(plan: JobPlan | None, held: Sequence[str]) -> Condition:
    if plan is None or plan.spec.power is None or plan.spec.mode is not FailurePolicy.NTP_PW:
        return Condition("PowerBoosted", False, "NotNTPPW",
                         "power boosts need failurePolicy.mode NTP-PW and a powerPolicy")
    boosted = [r for r in plan.replicas if r.power_ratio > 1.0]
    capped = below_base_cap(plan.spec, plan.racks)
    if capped is not None:
        return Condition("PowerBoosted", False, "BudgetBelowBaseCap", capped)
    if not boosted:
        return Condition("PowerBoosted", False, "NoReducedReplica", "every GPU at its base cap")
    parts = [f"replica {r.index} (TP {r.tp}): x{r.power_ratio:.3f} power, capped at "
             f"{plan.spec.power.boost_cap_w} W" for r in boosted]
    if held:  # asked for, not in effect yet: say so rather than claim it
        parts.append(f"raises on {', '.join(held)} wait for their racks' cuts to be reported "
                     "in effect")
    return Condition("PowerBoosted", True, "SurvivorsBoosted", "; ".join(parts))


# How many waiting pods PodsStarted's message names before it says how many more.
_PODS_NAMED = 3


def _started(starting: Starting, spec: FailurePolicySpec | None) -> Condition:
    """Whether every pod of the running attempt has started; else each waiting pod with why
    (the scheduler's, the kubelet's), and when the attempt gives up on them."""
    if not starting.pods:
        return Condition("PodsStarted", False, "NoPods", "no pod of the attempt is made yet")
    if not starting.waiting:
        return Condition("PodsStarted", True, "PodsRunning",
                         f"the attempt's {starting.pods} pods have started")
    named = [f"pod {pod}: {reason}: {message}"
             for pod, reason, message in starting.waiting[:_PODS_NAMED]]
    more = len(starting.waiting) - _PODS_NAMED
    then = ""
    if starting.gives_up_at is not None and spec is not None:
        at = datetime.fromtimestamp(starting.gives_up_at, UTC).isoformat(timespec="seconds")
        then = (f"; the attempt gives up on them at {at.replace('+00:00', 'Z')} "
                f"(failurePolicy.podStartTimeoutSeconds {spec.pod_start_timeout_seconds} s, "
                f"onPodStartTimeout {spec.on_pod_start_timeout})")
    return Condition("PodsStarted", False, _reason(starting.waiting[0][1]),
                     "; ".join(named) + (f"; and {more} more" if more > 0 else "") + then)


def _reason(text: str) -> str:
    """`text` as a condition reason (the schema's pattern): the kubelet's and the scheduler's
    reasons already are; anything else is kept to its letters and digits."""
    kept = "".join(c for c in text if c.isascii() and c.isalnum())
    return kept if kept[:1].isalpha() else f"Waiting{kept}"


def _training(trained: JobProgress) -> Condition:
    active = trained.phase in (Phase.RUNNING, Phase.RECONFIGURING)
    return Condition("Training", active, trained.phase.value, trained.message)


# Why a node's ranks train on CPU when CUDA sees all of the pod's GPUs.
_ASKED = "--device cpu"


def _cpu_cause(seen: int | None, gpus: int | None) -> str:
    """Why a node whose agent sees `seen` CUDA devices (None: not said) trains on CPU, its
    trainer pod holding `gpus` GPUs (None: not known here)."""
    if seen is None:
        return "CUDA devices not said"
    if seen < (gpus or 1):
        return f"CUDA sees {seen} of {gpus} GPUs" if gpus else f"CUDA sees {seen} devices"
    return _ASKED


def _on_cpu(plan: JobPlan | None, trained: JobProgress) -> Condition:
    """Whether ranks train on CPU although their trainer pods hold GPUs (every trainer pod
    asks for gpusPerNode nvidia.com/gpu), as the nodes' reports say: True naming those nodes,
    with what CUDA sees on each."""
    on_cpu = sorted(n for n, d in trained.devices.items() if d.kind == "cpu")
    if not on_cpu:
        if not trained.devices:
            return Condition("TrainingOnCPU", False, "NotReported",
                             "no trainer pod has said what its ranks train on yet")
        return Condition("TrainingOnCPU", False, "TrainingOnGPU",
                         "the ranks of every trainer pod that said train on its GPUs")
    gpus = plan.spec.gpus_per_node if plan is not None else None
    why = {n: _cpu_cause(trained.devices[n].cuda_devices, gpus) for n in on_cpu}
    held = f"each of their trainer pods holds {gpus} nvidia.com/gpu" if gpus \
        else "their trainer pods hold GPUs"
    if all(cause == _ASKED for cause in why.values()):
        reason, cause = "CPURequested", "the trainers' options (spec.args) ask for --device cpu"
    else:
        reason, cause = "NoCUDADevice", (
            "CUDA gives them no device (a trainer image whose PyTorch lacks CUDA, or a node "
            "without the NVIDIA driver or container runtime)")
    return Condition("TrainingOnCPU", True, reason,
                     f"the ranks on {name_nodes(on_cpu, why)} train on CPU though {held}: "
                     f"{cause}")


def _stopped(life: Lifecycle) -> tuple[Condition, ...]:
    """Ready, Degraded, PowerBoosted, Training and TrainingOnCPU of a job that runs no
    attempt."""
    if life.finish is not None:
        why = Problem("Finished", life.finish.message)
    elif life.stage is Stage.SUSPENDED and life.waiting is not None:
        why = Problem("WaitingForKueue", f"Kueue holds the job suspended: {life.waiting}")
    elif life.stage is Stage.SUSPENDED:
        why = Problem("Suspended", "spec.suspend is true: no pod runs and the job's power "
                                   "targets are released; the resume starts from the last "
                                   "checkpoint")
    elif life.restarting_since is not None:
        why = Problem("Restarting", f"restart {life.restarts}: the failed attempt's pods are "
                                    "stopping; the next attempt resumes from the last "
                                    "checkpoint")
    else:
        why = Problem("Resuming", "the earlier attempt's pods are stopping")
    return (Condition("Ready", False, why.reason, why.message),
            Condition("Degraded", False, "NotRunning", "no replica is running"),
            Condition("PowerBoosted", False, "NotRunning", "no GPU of the job is in use"),
            Condition("Training", False, why.reason, why.message),
            Condition("TrainingOnCPU", False, "NotRunning", "no rank is running"),
            Condition("PodsStarted", False, "NotRunning", "no attempt is running"))


def _lifecycle(life: Lifecycle, outdated: Sequence[str]) -> tuple[Condition, ...]:
    """Suspended, UpToDate, and Complete or Failed once the job finished."""
    if life.stage is not Stage.SUSPENDED:
        suspended = Condition("Suspended", False, "JobNotSuspended", "spec.suspend is false")
    elif life.waiting is not None:
        suspended = Condition("Suspended", True, "WaitingForKueue",
                              f"Kueue holds the job suspended: {life.waiting}")
    else:
        suspended = Condition("Suspended", True, "JobSuspended", "spec.suspend is true")
    if outdated:
        fields = ", ".join(f"spec.{name}" for name in outdated)
        current = Condition("UpToDate", False, "RestartPending", (
            f"{fields} changed since the running pods were made: they take effect at the "
            "job's next attempt (suspend and resume the job, or a restart)"))
    else:
        current = Condition("UpToDate", True, "PodsCurrent",
                            "the job's pods are made from its spec as it is")
    found = (suspended, current)
    if life.finish is None:
        return found
    kind = "Complete" if life.finish.succeeded else "Failed"
    return (*found, Condition(kind, True, life.finish.reason, life.finish.message))


def conditions(
    plan: JobPlan | None, problems: Sequence[Problem], notes: Sequence[str] = (),
    held: Sequence[str] = (), trained: JobProgress | None = None,
    life: Lifecycle | None = None, outdated: Sequence[str] = (),
    why: Mapping[GpuId, str] | None = None, starting: Starting | None = None,
    policy: FailurePolicySpec | None = None,
) -> tuple[Condition, ...]:
    """Ready, Degraded and PowerBoosted; `notes` (ignored health input) go into Ready's message,
    `held` (nodes whose power raise waits for a cut elsewhere in the rack) into PowerBoosted's.
    With the trainers' progress, also Training (what the trainers did, not only the plan) and
    TrainingOnCPU (what their ranks train on).
    With the job's lifecycle, Suspended and UpToDate (`outdated`: spec fields the pods lack),
    and Complete or Failed once it finished; a job that runs no attempt has no plan. `why`:
    what a health source says of a failed GPU, shown beside it in Degraded. With the running
    attempt's pods as started or not (`starting`), PodsStarted, and with the job's failure
    `policy`, when it gives up on them."""
    if life is not None and life.stage is not Stage.RUNNING:
        return (*_stopped(life), *_lifecycle(life, outdated))
    found = (_ready(plan, problems, notes), _degraded(plan, why or {}), _power(plan, held))
    if trained is not None:
        found = (*found, _training(trained), _on_cpu(plan, trained))
    if starting is not None:
        found = (*found, _started(starting, policy))
    return found if life is None else (*found, *_lifecycle(life, outdated))


def phase(plan: JobPlan | None, trained: JobProgress | None = None,
          life: Lifecycle | None = None) -> str:
    """Succeeded or Failed once the job finished, Suspended, Restarting between a failed
    attempt and the next (Pending between a suspended one and the resume); else Pending without
    a layout; else what the trainers report (Pending before they train, Reconfiguring while one
    has not reached the published generation); else Degraded or Running by the layout."""
    if life is not None and life.finish is not None:
        return Phase.SUCCEEDED.value if life.finish.succeeded else Phase.FAILED.value
    if life is not None and life.stage is Stage.SUSPENDED:
        return Phase.SUSPENDED.value
    if life is not None and life.stage is Stage.STOPPING:
        return Phase.RESTARTING.value if life.restarting_since else Phase.PENDING.value
    if plan is None or not plan.replicas:
        return "Pending"
    if trained is not None and trained.phase is not Phase.RUNNING:
        return trained.phase.value
    return "Degraded" if plan.degraded else "Running"


def _replicas(plan: JobPlan) -> list[dict[str, Any]]:
    """The replicas the status lists, within REPLICAS_BYTES_MAX, in index order."""
    listed, size = [], 0
    for r in sorted(plan.replicas, key=lambda r: (r.tp == plan.spec.tp, r.index)):
        entry = {
            "index": r.index,
            "tensorParallelSize": r.tp,
            "nodes": list(r.nodes()),
            "failedGPUs": [gpu_name(g) for g in r.failed_gpus()],
            "powerBoosted": plan.spec.mode is FailurePolicy.NTP_PW and r.power_ratio > 1.0,
        }
        # the closed loop's state
        if plan.spec.mode is FailurePolicy.NTP_PW and r.tp < plan.spec.tp:
            entry |= {"powerRatio": round(r.power_ratio, 4), "powerRatioStep": r.ratio_step}
        size += len(json.dumps(entry))
        if size > REPLICAS_BYTES_MAX:
            break
        listed.append(entry)
    return sorted(listed, key=lambda e: e["index"])


def boosts(previous: Mapping[str, Any]) -> dict[ReplicaKey, Boost]:
    """The closed loop's boosts as `render` left them in the status (what does not read as
    one, say a hand edit, is left out: that replica's loop starts from the open-loop seed)."""
    found = {}
    for entry in previous.get("replicas") or []:
        try:
            key = (entry["index"], entry["tensorParallelSize"], tuple(entry["nodes"]),
                   tuple(entry["failedGPUs"]))
            ratio, step = float(entry["powerRatio"]), int(entry["powerRatioStep"])
        except (KeyError, TypeError, ValueError):
            continue
        found[key] = Boost(ratio, step)
    return found


def render(
    plan: JobPlan | None,
    problems: Sequence[Problem],
    previous: Mapping[str, Any],
    *,
    now: str,
    generation: int,
    layout_generation: int,
    notes: Sequence[str] = (),
    held: Sequence[str] = (),
    trained: JobProgress | None = None,
    life: Lifecycle | None = None,
    outdated: Sequence[str] = (),
    tp_layout: str | None = None,
    why: Mapping[GpuId, str] | None = None,
    memory: Condition | None = None,
    starting: Starting | None = None,
    policy: FailurePolicySpec | None = None,
) -> dict[str, Any]:
    """The job's whole status. `previous` is the status as observed, `now` an RFC 3339 time;
    `trained` the trainers' progress (None: not observed), `life` where the job is in its life
    (None: running, its first attempt), `outdated` the spec fields its pods lack, `tp_layout`
    the layout of the generation in force (None: the plan's, none being published), `why` what
    a health source says of a failed GPU, `memory` the memory plan on its GPUs (FitsMemory,
    `policies.memory`), `starting` the attempt's pods not started (with the failure
    `policy` that gives up on them)."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    replicas = _replicas(plan) if plan else []
    if plan and len(replicas) < len(plan.replicas):
        notes = (*notes, f"status.replicas lists {len(replicas)} of {len(plan.replicas)} "
                         "replicas, the reduced ones first")
    rendered = []
    found = conditions(plan, problems, notes, held, trained, life, outdated, why, starting,
                       policy)
    if memory is not None and (life is None or life.stage is Stage.RUNNING):
        found = (*found, memory)
    for c in found:
        status = "Unknown" if c.status is None else "True" if c.status else "False"
        old = before.get(c.type) or {}
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        rendered.append({"type": c.type, "status": status, "reason": c.reason,
                         "message": _clip(c.message), "observedGeneration": generation,
                         "lastTransitionTime": since or now})
    status = {
        "observedGeneration": generation,
        # no layout published yet: nothing trains, whatever the plan
        "phase": phase(plan if layout_generation else None, trained, life),
        "layoutGeneration": layout_generation,
        "tpLayout": tp_layout if tp_layout is not None else plan.tp_layout if plan else "",
        "replicas": replicas,
        "conditions": rendered,
    }
    if trained is not None:
        status["step"] = trained.step
        if trained.goodput is not None:  # the schema's bounds: a value past them is refused
            status["goodput"] = round(min(max(trained.goodput, 0.0), 1.0), 4)
    if life is not None:
        status |= {"attempt": life.attempt, "restarts": life.restarts}
        if life.earlier.wall_seconds:
            status["earlierAttempts"] = life.earlier.to_status()
        if life.restarting_since is not None:
            status["restartingSince"] = life.restarting_since
    return status


def changed(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Conditions whose status or reason differ from before: one Event each. A message alone
    (a step count, a boost ratio moving) is no transition: an Event each would be a stream."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    key = ("status", "reason")
    return [c for c in current["conditions"]
            if tuple(c[k] for k in key) != tuple((before.get(c["type"]) or {}).get(k) for k in key)]
