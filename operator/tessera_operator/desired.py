"""A job's desired state (pure): from its spec, what was observed and the time, one `Desired`.

`desired(spec, observed, now)` takes the steps a reconcile decides on, with no I/O:
0. Where the job is in its life (`life.life`); under failurePolicy.mode CKPT-RESTART a GPU
   lost under the running attempt's layout fails it as a failed trainer pod does.
1. The spec the operator runs (`job_spec`, read once at the reconcile's edge: typed and
   defaulted, and the planner's view of it; else InvalidSpec, PipelineParallelNotSupported:
   nothing made).
2. Placement (`placement.place`): nodes for the trainer pods the job lacks, among the
   candidates observed (CKPT-RESTART: for an attempt that has none, on nodes without a failed
   GPU, spares as found); too few gives Unschedulable and no child at all. The children are
   every object the job runs, under deterministic names (`placement.children`).
3. Health: failed and unknown GPUs of its nodes from its sources (cordons, lost nodes, DCGM's
   GPUHealth), unknown ones held where the generation in force has them (`signal.health_of`).
4. The plan (`planner.plan`), its boosts stepped by the closed loop on the trainers' reported
   compute times (`planner.follow_compute`), its power targets, and the next generation
   document when the layout changed (`publish.to_publish`, once the rendezvous pod has an
   address); a layout the job may not publish (not its own, lost, too large) leaves it without
   a plan.
5. The status rebuilt from all that (`conditions.render`) and one event per decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tessera_contracts import progress
from tessera_contracts.generation import (
    Generation,
)
from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.powertarget import (
    PowerTarget,
    format_time,
)
from tessera_operator import conditions, health, planner, workload
from tessera_operator.lifecycle import Lifecycle, Stage
from tessera_operator.observed import Observed, Spec
from tessera_operator.policies import life, placement, power, publish, signal
from tessera_operator.power_planning import plan_sync


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
    layout_version: str | None = None  # the resourceVersion it replaces (None: it is created)
    targets: Mapping[str, PowerTarget] = field(default_factory=dict)  # empty: release them all
    held: tuple[str, ...] = ()  # nodes whose raise waits for a cut to be reported in effect
    status: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    # What an earlier attempt or a finished job leaves behind: pods and ConfigMaps by name.
    delete_pods: tuple[str, ...] = ()
    # Pods being deleted on a node that stopped reporting: deleted at once (grace 0).
    force_delete_pods: tuple[str, ...] = ()
    delete_configmaps: tuple[str, ...] = ()
    ended: bool = False  # an attempt ends: the status (its account) is written before the rest
    delete_job: bool = False  # ttlSecondsAfterFinished has passed
    requeue_after: float | None = None  # seconds until the job needs a reconcile of its own

    @property
    def waits_for_nodes(self) -> bool:
        """Too few nodes fit the job: any node change may let it be placed."""
        ready = next((c for c in self.status.get("conditions") or []
                      if c.get("type") == "Ready"), {})
        return ready.get("reason") == "Unschedulable"


@dataclass(frozen=True)
class _Planned:
    """Where the job runs and its plan there, or why there is none."""

    placement: Mapping[int, str] = field(default_factory=dict)
    plan: planner.JobPlan | None = None
    problems: tuple[planner.Problem, ...] = ()
    signal: health.Health = health.Health()  # its GPUs' health, all sources
    lost: health.Health = health.Health()  # the GPUs lost under their processes


def job_spec(job: Mapping[str, Any]) -> Spec | planner.Problem:
    """The job's spec as the operator reads it, once per reconcile: typed and defaulted, with
    what planning runs of it; a Problem when the schema would not store it."""
    try:
        whole = NTPTrainingJobSpec.from_spec(job["spec"])
    except SpecError as exc:
        return planner.Problem("InvalidSpec", str(exc))
    try:
        run = planner.JobSpec.of(whole)
    except SpecError as exc:
        return Spec(whole, planner.Problem("InvalidSpec", str(exc)))
    if run.pp > 1:
        return Spec(whole, planner.Problem("PipelineParallelNotSupported", (
            f"pipelineParallelSize {run.pp}: the trainer runs tensor and data parallelism "
            "only; set it to 1")))
    return Spec(whole, run)


def desired(spec: Spec | planner.Problem, observed: Observed, now: datetime,
            refused: str | None = None, rejected: str | None = None) -> Desired:
    """The desired state of `observed.job` (its spec as `job_spec` reads it) at `now`.
    `refused`: why the API server refused the power targets, when it did (Ready's message says
    so, and no raise is said to wait); `rejected`: why it refused the job's pods (the job has
    no plan then: Ready=False, reason PodRejected)."""
    if isinstance(spec, planner.Problem):
        return _unreadable(spec, observed, now)
    job = observed.job
    previous = job.get("status") or {}
    # 0. Where the job is in its life; what earlier attempts left behind goes.
    found, lost = life.life(spec, observed, now)
    if found.stage is not Stage.RUNNING:
        return _stopped(spec, observed, now, found, lost)
    stale = tuple(name for name, attempt in observed.configmap_attempts.items()
                  if attempt != found.attempt)
    observed = life.of_attempt(observed, found.attempt)
    # 1-3. Placement, health and the plan.
    planned = _plan(spec, observed, now)
    plan, problems = planned.plan, planned.problems
    if rejected is not None:
        plan, problems = None, (planner.Problem("PodRejected", rejected), *problems)
    # 4. The trainers' progress drives the boosts and the step a planned switch happens at.
    told = workload.steps_told(observed.pods, job)
    reports, refused_reports = publish.agreed(
        observed.reports_of(sorted(set(planned.placement.values()))), told)
    layout_generation = int(previous.get("layoutGeneration", 0))
    targets: dict[str, PowerTarget] = {}
    layout: dict[str, Any] | None = None
    in_force: Generation | None = None
    if plan is not None:
        try:
            plan, targets = power.boosted(plan, observed, reports, planned.lost.failed)
            layout, in_force = publish.to_publish(spec.whole, observed, plan, reports,
                                                  planned.lost.failed, now,
                                                  told or spec.whole.steps)
        except SpecError as exc:
            plan, problems = None, (planner.Problem("InvalidSpec", str(exc)), *problems)
            targets = {}
        except publish.LayoutBlocked as exc:
            plan, problems = None, (planner.Problem(exc.reason, str(exc)), *problems)
            targets, layout = {}, None
    if in_force is not None:
        layout_generation = in_force.generation
    # 5. The status, rebuilt; an event per decision.
    notes = (*planned.signal.problems, *refused_reports)
    held: tuple[str, ...] = ()
    if refused is None:
        held = plan_sync(observed.targets, list(targets.values())).held
    else:
        notes = (*notes, f"power targets refused: {refused}")
    trained = None if in_force is None else progress.summarize(
        reports, in_force.generation, sorted({g.node for g in in_force.gpus}), found.earlier)
    status = conditions.render(
        plan, problems, previous, now=format_time(now),
        generation=int(job["metadata"].get("generation", 0)),
        layout_generation=layout_generation, notes=notes, held=held, trained=trained,
        life=found, outdated=life.outdated(spec, observed),
        tp_layout=None if in_force is None else planner.format_layout(in_force.tp_degrees),
        why=planned.signal.reasons)
    events = []
    if layout_generation != int(previous.get("layoutGeneration", 0)) and plan is not None:
        events.append(Event("Normal", "LayoutChanged",
                            f"layout generation {layout_generation}: TP {plan.tp_layout or '-'}"))
    return Desired(planned.placement,
                   placement.children(job, spec.whole, planned.placement, found.attempt),
                   layout,
                   observed.layout.resource_version, targets, held, status,
                   (*events, *_condition_events(previous, status)), delete_configmaps=stale,
                   requeue_after=None if (recheck := planned.signal.recheck_at) is None
                   else recheck - now.timestamp())


def _stopped(spec: Spec, observed: Observed, now: datetime, found: Lifecycle,
             lost: Mapping[planner.GpuId, str]) -> Desired:
    """A job that runs no attempt (suspended, between two, finished): no child is made and
    every power target released; an attempt that ends takes its layout with it, a finished
    job keeps its last one (and its step and goodput) for the record. `lost`: the GPUs whose
    loss ended the attempt (CKPT-RESTART), named in an event."""
    job = observed.job
    previous = job.get("status") or {}
    finished = found.stage is Stage.FINISHED
    wall = found.earlier.wall_seconds
    trained = progress.JobProgress(
        progress.Phase.PENDING, int(previous.get("step", 0)), None,
        previous.get("goodput") if finished else (
            found.earlier.productive_seconds / wall if wall else None), "")
    status = conditions.render(
        None, (), previous, now=format_time(now),
        generation=int(job["metadata"].get("generation", 0)),
        layout_generation=int(previous.get("layoutGeneration", 0)) if finished else 0,
        trained=trained, life=found, outdated=life.outdated(spec, observed))
    if finished:  # the layout it ended on
        status |= {key: previous[key] for key in ("tpLayout", "replicas") if key in previous}
    ttl = found.delete_job_in
    events = _condition_events(previous, status)
    if lost:
        gpus = ", ".join(planner.gpu_name(gpu) + (f" ({why})" if why else "")
                         for gpu, why in sorted(lost.items()))
        then = "no restart left" if finished else \
            "every trainer pod is replaced and the job resumes from its last checkpoint"
        events = (Event("Warning", "LayoutGPULost", (
            f"GPU {gpus} of attempt {previous.get('attempt', 0)}'s layout lost: "
            f"failurePolicy.mode CKPT-RESTART ends the attempt; {then}")), *events)
    return Desired(status=status, events=events,
                   delete_pods=found.delete_pods, force_delete_pods=life.unconfirmable(observed),
                   delete_configmaps=() if finished else tuple(observed.configmap_attempts),
                   ended=found.ended, delete_job=ttl is not None and ttl <= 0,
                   requeue_after=ttl if ttl is not None and ttl > 0 else None)


def _unreadable(problem: planner.Problem, observed: Observed, now: datetime) -> Desired:
    """A job whose spec the schema would not store (it was stored under another schema): why,
    in its status; no child made or deleted, its power targets released."""
    previous = observed.job.get("status") or {}
    status = conditions.render(
        None, (problem,), previous, now=format_time(now),
        generation=int(observed.job["metadata"].get("generation", 0)),
        layout_generation=int(previous.get("layoutGeneration", 0)))
    return Desired(status=status, events=_condition_events(previous, status))


def _condition_events(previous: Mapping[str, Any], status: Mapping[str, Any]
                      ) -> tuple[Event, ...]:
    """One event per condition that changed."""
    events = []
    for c in conditions.changed(previous, status):
        bad = (c["type"], c["status"]) in {("Ready", "False"), ("Degraded", "True"),
                                           ("Failed", "True"), ("UpToDate", "False"),
                                           ("TrainingOnCPU", "True")}
        events.append(Event("Warning" if bad else "Normal", c["reason"],
                            f"{c['type']}={c['status']}: {c['message']}"))
    return tuple(events)


# ----------------------------------------------------------------------------------------------
# Placement, health, plan
# ----------------------------------------------------------------------------------------------


def _plan(spec: Spec, observed: Observed, now: datetime) -> _Planned:
    run = spec.planning
    if isinstance(run, planner.Problem):
        return _Planned(problems=(run,))
    placed = placement.place(spec.whole, run, observed, now)
    if isinstance(placed, planner.Problem):
        return _Planned(problems=(placed,))
    where, nodes = placed
    domains = planner.node_domains(nodes, run.domain_label)
    if (unpowered := planner.budget_problem(run, domains)) is not None:
        return _Planned(problems=(unpowered,))
    found, lost = signal.health_of(spec.whole, observed, where, nodes, now)
    if run.restarts_on_loss and (in_force := observed.layout.generation) is not None:
        # An attempt keeps its first layout: its plan is that layout's nodes, the spares idle.
        domains = {n: d for n, d in domains.items() if n in {g.node for g in in_force.gpus}}
    plan = planner.plan(run, domains, found.failed)
    return _Planned(where, plan, plan.problems, found, lost)
