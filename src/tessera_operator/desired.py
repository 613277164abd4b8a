"""A job's desired state (pure): from its spec, what was observed and the time, one `Desired`.

`desired(spec, observed, now)` takes the steps a reconcile decides on, with no I/O:
1. The spec the operator runs (`job_spec`; else InvalidSpec, PipelineParallelNotSupported:
   nothing made).
2. Placement (`workload.place`): nodes for the trainer pods the job lacks, among the candidates
   observed; too few gives Unschedulable and no child at all. The children are every object
   the job runs, under deterministic names (`workload`).
3. Health: failed and unknown GPUs of its nodes from its sources (cordons, lost nodes, DCGM's
   GPUHealth), unknown ones held where the generation in force has them (`health`).
4. The plan (`planner.plan`), its boosts stepped by the closed loop on the trainers' reported
   compute times (`planner.follow_compute`), its power targets, and the next generation
   document when the layout changed (once the rendezvous pod has an address); a layout the
   job may not publish (not its own, lost, too large) leaves it without a plan.
5. The status rebuilt from all that (`conditions.render`) and one event per decision.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from tessera_contracts import progress
from tessera_contracts.api import JOB_LABEL
from tessera_contracts.generation import LAYOUT_KEY, Generation, Gpu, Rendezvous, layout_configmap
from tessera_contracts.powertarget import (
    InvalidTarget,
    PowerTarget,
    format_time,
    parse_object,
    reported_limits,
)
from tessera_operator import conditions, health, planner, workload
from tessera_operator.observed import Observed
from tessera_operator.power_planning import plan_sync

CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server's limit on a ConfigMap's data


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job: one per decision."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Desired:
    """What a job should be, as API objects and values to write."""

    placement: Mapping[int, str] = field(default_factory=dict)  # trainer pod index -> node
    # Every object the job runs (none when it is not placed): identity, progress ConfigMap,
    # rendezvous and trainer pods.
    children: tuple[dict[str, Any], ...] = ()
    layout: dict[str, Any] | None = None  # the layout ConfigMap with a new generation, or None
    targets: Mapping[str, PowerTarget] = field(default_factory=dict)  # empty: release them all
    held: tuple[str, ...] = ()  # nodes whose raise waits for a cut to be reported in effect
    status: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()


class LayoutBlocked(Exception):
    """The layout document cannot be published; `reason` is the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class _Planned:
    """Where the job runs and its plan there, or why there is none."""

    placement: Mapping[int, str] = field(default_factory=dict)
    plan: planner.JobPlan | None = None
    problems: tuple[planner.Problem, ...] = ()
    signal: health.Health = health.Health()  # its GPUs' health, all sources
    lost: health.Health = health.Health()  # the GPUs lost under their processes


def job_spec(job: Mapping[str, Any]) -> planner.JobSpec | planner.Problem:
    """The job's spec, if the operator can run it; else why not."""
    try:
        spec = planner.JobSpec.from_spec(job["spec"])
    except planner.SpecError as exc:
        return planner.Problem("InvalidSpec", str(exc))
    if spec.pp > 1:
        return planner.Problem("PipelineParallelNotSupported", (
            f"pipelineParallelSize {spec.pp}: the trainer runs tensor and data parallelism "
            "only; set it to 1"))
    return spec


def needs_placement(spec: planner.JobSpec | planner.Problem, observed: Observed) -> bool:
    """Whether the job runs and lacks a trainer pod: a reconcile then observes the placement
    candidates (`observe.with_candidates`)."""
    if isinstance(spec, planner.Problem):
        return False
    placed = workload.placed_nodes(observed.pods, observed.job)
    return any(i not in placed for i in range(_trainers(observed.job, spec)))


def desired(spec: planner.JobSpec | planner.Problem, observed: Observed, now: datetime,
            refused: str | None = None) -> Desired:
    """The desired state of `observed.job` (its spec as `job_spec` reads it) at `now`.
    `refused`: why the API server refused the power targets, when it did (Ready's message says
    so, and no raise is said to wait)."""
    job = observed.job
    previous = job.get("status") or {}
    # 1-3. Placement, health and the plan.
    planned = _plan(spec, observed, now)
    plan, problems = planned.plan, planned.problems
    # 4. The trainers' progress drives the boosts and the step a planned switch happens at.
    reports = progress.read_reports(observed.reports, sorted(set(planned.placement.values())))
    step = max((r.step for r in reports.values() if r is not None), default=0)
    layout_generation = int(previous.get("layoutGeneration", 0))
    targets: dict[str, PowerTarget] = {}
    layout: dict[str, Any] | None = None
    in_force: Generation | None = None
    if plan is not None:
        try:
            plan, targets = _power(plan, observed, reports, planned.lost.failed)
            layout, in_force = _generation(observed, plan, step, planned.lost.failed)
        except planner.SpecError as exc:
            plan, problems = None, (planner.Problem("InvalidSpec", str(exc)), *problems)
            targets = {}
        except LayoutBlocked as exc:
            plan, problems = None, (planner.Problem(exc.reason, str(exc)), *problems)
            targets, layout = {}, None
    if in_force is not None:
        layout_generation = in_force.generation
    # 5. The status, rebuilt; an event per decision.
    notes = planned.signal.problems
    held: tuple[str, ...] = ()
    if refused is None:
        held = plan_sync(observed.targets, list(targets.values())).held
    else:
        notes = (*notes, f"power targets refused: {refused}")
    trained = None if in_force is None else progress.summarize(
        reports, in_force.generation, sorted({g.node for g in in_force.gpus}))
    status = conditions.render(
        plan, problems, previous, now=format_time(now),
        generation=int(job["metadata"].get("generation", 0)),
        layout_generation=layout_generation, notes=notes, held=held, trained=trained,
        pods=_pod_outcome(observed.pods, job))
    events = []
    if layout_generation != int(previous.get("layoutGeneration", 0)) and plan is not None:
        events.append(Event("Normal", "LayoutChanged",
                            f"layout generation {layout_generation}: TP {plan.tp_layout or '-'}"))
    for c in conditions.changed(previous, status):
        bad = (c["type"], c["status"]) in {("Ready", "False"), ("Degraded", "True")}
        events.append(Event("Warning" if bad else "Normal", c["reason"],
                            f"{c['type']}={c['status']}: {c['message']}"))
    return Desired(planned.placement, _children(job, planned.placement), layout, targets, held,
                   status, tuple(events))


def layout_document(job: Mapping[str, Any], generation: Generation) -> dict[str, Any]:
    """The layout ConfigMap holding `generation`; LayoutTooLarge when it outgrows one."""
    meta = job["metadata"]
    # Compact: 32,768 GPUs (the paper's job, short node names) take about 650 kB.
    data = json.dumps(generation.to_dict(), separators=(",", ":"))
    size = len(LAYOUT_KEY) + len(data.encode())
    if size > CONFIGMAP_MAX_BYTES:
        raise LayoutBlocked("LayoutTooLarge", (
            f"the layout document takes {size} bytes, more than a ConfigMap holds "
            f"({CONFIGMAP_MAX_BYTES}): fewer GPUs per job, or shorter node names"))
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": layout_configmap(meta["name"]), "namespace": meta["namespace"],
                         "labels": {JOB_LABEL: meta["name"]},
                         "ownerReferences": [workload.owner(job)]},
            "data": {LAYOUT_KEY: data}}


# ----------------------------------------------------------------------------------------------
# Placement, health, plan
# ----------------------------------------------------------------------------------------------


def _trainers(job: Mapping[str, Any], spec: planner.JobSpec) -> int:
    return int(job["spec"]["totalGPUs"]) // spec.gpus_per_node


def _plan(spec: planner.JobSpec | planner.Problem, observed: Observed, now: datetime
          ) -> _Planned:
    if isinstance(spec, planner.Problem):
        return _Planned(problems=(spec,))
    placed = _place(observed, spec)
    if isinstance(placed, planner.Problem):
        return _Planned(problems=(placed,))
    placement, nodes = placed
    signal, lost = _health(observed, spec, placement, nodes, now)
    plan = planner.plan(spec, planner.node_domains(nodes, spec.domain_label), signal.failed)
    return _Planned(placement, plan, plan.problems, signal, lost)


def _place(observed: Observed, spec: planner.JobSpec
           ) -> tuple[dict[int, str], tuple[Mapping[str, Any], ...]] | planner.Problem:
    """Every trainer pod's node (those placed, and nodes chosen for the missing ones) and the
    job's nodes as observed; or why the missing ones cannot be placed."""
    job = observed.job
    placed = workload.placed_nodes(observed.pods, job)
    missing = [i for i in range(_trainers(job, spec)) if i not in placed]
    if not missing:
        return placed, observed.nodes
    candidates = observed.candidates
    if candidates is None:
        raise ValueError("placing a job needs its candidates observed")
    selector = dict(job["spec"].get("nodeSelector") or {})
    views = [v for v in workload.node_views(candidates.nodes, candidates.pods, selector,
                                            spec.domain_label)
             if v.name not in placed.values()]
    chosen = workload.place(spec, len(missing), views)
    if isinstance(chosen, planner.Problem):
        return chosen
    placement = placed | dict(zip(missing, chosen, strict=True))
    return placement, tuple(n for n in candidates.nodes
                            if n["metadata"]["name"] in placement.values())


def _health(observed: Observed, spec: planner.JobSpec, placement: Mapping[int, str],
            nodes: tuple[Mapping[str, Any], ...], now: datetime
            ) -> tuple[health.Health, health.Health]:
    """The job's GPU health from its sources, merged (GPUs of unknown health held where the
    generation in force has them), and the part lost under their processes rather than
    drained: the GPUs of nodes that stopped reporting, and those DCGM failed."""
    job = observed.job
    policy = job["spec"].get("failurePolicy") or {}
    sources = set(policy.get("healthSources", ("dcgm", "cordon")))
    lost = health.from_lost_nodes(nodes, spec.gpus_per_node,
                                  placed=sorted(set(placement.values())),
                                  leaving=workload.leaving_nodes(observed.pods, job))
    signal = health.from_cordons(nodes, spec.gpus_per_node) if "cordon" in sources \
        else health.Health()
    signal = signal.merge(lost)
    if "dcgm" not in sources:
        return signal, lost
    names = sorted({n["metadata"]["name"] for n in nodes})
    objects = sorted((o for o in observed.gpu_health if o["metadata"]["name"] in set(names)),
                     key=lambda o: o["metadata"]["name"])
    dcgm = health.from_gpu_health(objects, spec.gpus_per_node, policy.get("fatalXIDs"),
                                  now=now.timestamp(), nodes=names)
    in_force = observed.layout.generation
    kept = None if in_force is None else [(g.node, g.index) for g in in_force.gpus]
    reporting = [o["metadata"]["name"] for o in objects]
    return health.hold_unknown(signal.merge(dcgm), kept, reporting), lost.merge(dcgm)


def _children(job: Mapping[str, Any], placement: Mapping[int, str]) -> tuple[dict[str, Any], ...]:
    if not placement:
        return ()
    return (*workload.identity(job), workload.progress_configmap(job),
            workload.rendezvous_pod(job),
            *(workload.trainer_pod(job, i, node) for i, node in sorted(placement.items())))


# ----------------------------------------------------------------------------------------------
# Power and layout
# ----------------------------------------------------------------------------------------------


def _power(plan: planner.JobPlan, observed: Observed,
           reports: Mapping[str, progress.NodeReport | None], lost: frozenset[planner.GpuId]
           ) -> tuple[planner.JobPlan, dict[str, PowerTarget]]:
    """The plan with its boosts stepped by the closed loop, and its power targets. The loop's
    ratio, the parked nodes and the lost GPUs' watts all read the targets as they are."""
    current = {obj["metadata"]["name"]: obj for obj in observed.targets}
    racks = {node: rack for node, obj in current.items()
             if isinstance(spec := obj.get("spec"), dict)
             and isinstance(rack := spec.get("rack"), str)}
    plan = replace(plan, stuck=_counted_watts(current, lost))
    previous = observed.job.get("status") or {}
    plan = planner.follow_compute(plan, reports, conditions.boosts(previous), racks)
    return plan, plan.power_targets(racks)


def _counted_watts(current: Mapping[str, Mapping[str, Any]], lost: frozenset[planner.GpuId]
                   ) -> dict[planner.GpuId, int]:
    """The watts each agent still counts a GPU lost under its process at: the limit it reports,
    else what its target last asked for (no target: nothing was ever set, nothing is held)."""
    counted = {}
    for node, index in lost:
        obj = current.get(node)
        if obj is None:
            continue
        reported = reported_limits(obj)
        if index in reported:
            counted[(node, index)] = reported[index]
            continue
        try:
            counted[(node, index)] = parse_object(obj, node).watts_for(index)
        except InvalidTarget:
            continue
    return counted


def _generation(observed: Observed, plan: planner.JobPlan, step: int,
                lost: frozenset[planner.GpuId]
                ) -> tuple[dict[str, Any] | None, Generation | None]:
    """The layout ConfigMap to publish (None: nothing new) and the generation in force then.

    A new generation follows the plan once the rendezvous pod has an address (planned changes
    at `step`, the last one reported; `lost`: GPUs whose processes died with them).
    LayoutBlocked when the ConfigMap is someone else's (never overwritten nor adopted: an
    ownerReference would have the garbage collector delete it with the job), when the
    generation published is lost, or when the next one outgrows a ConfigMap."""
    job = observed.job
    name = layout_configmap(job["metadata"]["name"])
    if not observed.layout.owned:
        raise LayoutBlocked("LayoutNotOwned", (
            f"ConfigMap {name} exists and is not controlled by this job; the layout is not "
            f"published until it is removed or the job renamed"))
    previous = observed.layout.generation
    published = int((job.get("status") or {}).get("layoutGeneration", 0))
    if previous is None and published:
        raise LayoutBlocked("LayoutLost", (
            f"ConfigMap {name} no longer holds generation {published} (deleted or changed by "
            "someone else): the running trainers cannot follow a layout derived from nothing. "
            "Restore it, or delete the job's trainer pods and the ConfigMap's data to restart "
            "from generation 1"))
    rendezvous = _rendezvous(job, observed.pods)
    if previous is None:
        if rendezvous is None:
            return None, None  # its pod has no address yet; the pod's watch brings the job back
    else:
        rendezvous = rendezvous or previous.rendezvous
    batch = int(job["spec"].get("globalBatch", workload.DEFAULT_GLOBAL_BATCH))
    following = workload.generation_for(plan, batch, rendezvous, previous,
                                         [Gpu(n, i) for n, i in lost], at_step=step)
    if following is None:
        return None, previous
    return layout_document(job, following), following


def _rendezvous(job: Mapping[str, Any], pods: tuple[Mapping[str, Any], ...]
                ) -> Rendezvous | None:
    name = workload.rendezvous_name(job["metadata"]["name"])
    for pod in pods:
        if pod["metadata"]["name"] == name and (ip := (pod.get("status") or {}).get("podIP")):
            return Rendezvous(ip, workload.RENDEZVOUS_PORT)
    return None


def _pod_outcome(pods: tuple[Mapping[str, Any], ...], job: Mapping[str, Any]
                 ) -> conditions.PodOutcome | None:
    """How the trainer pods ended: all succeeded, or the first that failed and why."""
    trainers = workload.trainer_pods(pods, job)
    failed = [p for p in trainers if (p.get("status") or {}).get("phase") == "Failed"]
    if failed:
        pod = failed[0]
        why = next((s["state"]["terminated"] for s in
                    (pod.get("status") or {}).get("containerStatuses") or []
                    if (s.get("state") or {}).get("terminated")), {})
        return conditions.PodOutcome(False, f"trainer pod {pod['metadata']['name']} failed: "
                                            f"{why.get('reason', 'Error')} (exit code "
                                            f"{why.get('exitCode', '?')})")
    done = bool(trainers) and all((p.get("status") or {}).get("phase") == "Succeeded"
                                  for p in trainers)
    return conditions.PodOutcome(True, "every trainer pod finished") if done else None
