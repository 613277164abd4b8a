"""A job's desired state (pure): from its spec, what was observed and the time, one `Desired`.

`desired(spec, observed, now)` takes the steps a reconcile decides on, with no I/O, each policy
in a room of its own (`tessera_operator.policies`):
0. Its Kueue queue, for a job labelled with one (`queueing.decide`): held suspended until Kueue
   admits its Workload, run with the admission's flavor; its Workload and what its status is
   to say. Then where the job is in its life (`life.life`); a job that runs no attempt gets no
   plan and no child (`_stopped`).
1. The spec the operator runs (`job_spec`, read once at the reconcile's edge; else InvalidSpec,
   PipelineParallelNotSupported: nothing made).
2. Placement (`placement.place`): nodes for the trainer pods the job lacks; too few gives
   Unschedulable and no child at all. The memory plan on those nodes' GPUs
   (`memory.fit`): a healthy layout that does not fit gives MemoryDoesNotFit and no child; a
   degraded one raises the minimum TP the planner keeps to. The children are every object the
   job runs.
3. Health: failed and unknown GPUs of its nodes from its sources (`signal.health_of`).
4. The plan (`planner.plan`), its boosts and power targets (`power.boosted`), and the next
   generation document (`publish.to_publish`); a layout the job may not publish leaves it
   without a plan.
5. Written up (`_written`): the status rebuilt from all that (`conditions.render`), one event
   per decision, and the one pass of power target writes (`power.sync`).

What applying it then meets is fed back without deciding again: pods the API server refused
(`Desired.pods_rejected`: the job has no plan) and power targets it refused
(`Desired.power_refused`) only write step 5 up anew.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from tessera_contracts import progress
from tessera_contracts.generation import Generation
from tessera_contracts.jobspec import NTPTrainingJobSpec, SpecError
from tessera_contracts.powertarget import PowerTarget, format_time
from tessera_operator import conditions, health, planner, workload
from tessera_operator.lifecycle import Lifecycle, Stage
from tessera_operator.observed import Observed, Spec
from tessera_operator.planner import Problem
from tessera_operator.policies import life, placement, power, publish, queueing, signal
from tessera_operator.policies import memory as memory_policy
from tessera_operator.power_planning import SyncPlan

# Ready's reasons a node change may clear.
WAITS_FOR_NODES = frozenset({"Unschedulable", memory_policy.DOES_NOT_FIT})


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job: one per decision."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class _Planned:
    """Where the job runs and its plan there, or why there is none."""

    placement: Mapping[int, str] = field(default_factory=dict)
    plan: planner.JobPlan | None = None
    problems: tuple[Problem, ...] = ()
    signal: health.Health = health.Health()  # its GPUs' health, all sources
    lost: health.Health = health.Health()  # the GPUs lost under their processes
    memory: memory_policy.MemoryFit | None = None  # the memory plan on its GPUs


@dataclass(frozen=True)
class Decision:
    """What steps 0-4 decided for a running attempt, and what applying it met: the status,
    events and power writes are written up from it (`_written`)."""

    spec: Spec
    observed: Observed  # as the attempt sees it (`life.of_attempt`)
    previous: Mapping[str, Any]  # the status as observed
    now: datetime
    life: Lifecycle
    planned: _Planned
    children: tuple[dict[str, Any], ...]
    stale: tuple[str, ...]  # ConfigMaps of an earlier attempt
    outdated: tuple[str, ...]  # spec fields the running pods were not made with
    reports: Mapping[str, progress.NodeReport | None]  # those that agree with the pods
    refused_reports: tuple[str, ...]
    plan: planner.JobPlan | None  # boosted; None without one, or `blocked`
    blocked: Problem | None  # why a plan made cannot be carried out
    targets: Mapping[str, PowerTarget]
    layout: dict[str, Any] | None  # the layout ConfigMap with a new generation, or None
    in_force: Generation | None  # the generation in force once it is published
    rejected: str | None = None  # why the API server refused the job's pods
    refused: str | None = None  # why it refused the power targets


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
    # The one pass of writes that brings the job's power targets to `targets`.
    sync: SyncPlan = field(default_factory=lambda: SyncPlan({}, (), ()))
    decision: Decision | None = None  # a running attempt's, to write up anew
    # A job labelled with a Kueue queue: its Workload to apply (None: none), and JSON patch
    # operations on the Workload's status (empty: nothing to write).
    workload: dict[str, Any] | None = None
    workload_status: tuple[dict[str, Any], ...] = ()

    @property
    def waits_for_nodes(self) -> bool:
        """Too few nodes fit the job, or their GPUs' memory (`nvidia.com/gpu.memory`) does not
        hold it: any node change may let it be placed."""
        ready = next((c for c in self.status.get("conditions") or []
                      if c.get("type") == "Ready"), {})
        return ready.get("reason") in WAITS_FOR_NODES

    def pods_rejected(self, why: str) -> Desired:
        """This decision once the API server refused the job's pods (`why`): no plan
        (Ready=False, reason PodRejected), no layout, its power targets released."""
        if self.decision is None:
            return self
        return self._queued(_written(replace(self.decision, rejected=why)))

    def power_refused(self, why: str) -> Desired:
        """This decision once the API server refused its power targets (`why`): Ready's
        message says so, and no raise is said to wait (the writes were made as they are)."""
        if self.decision is None:
            return self
        return self._queued(_written(replace(self.decision, refused=why), self.sync))

    def _queued(self, other: Desired) -> Desired:
        """`other` with this decision's Workload writes."""
        return replace(other, workload=self.workload, workload_status=self.workload_status)


def job_spec(job: Mapping[str, Any]) -> Spec | Problem:
    """The job's spec as the operator reads it, once per reconcile: typed and defaulted, with
    what planning runs of it; a Problem when the schema would not store it."""
    try:
        whole = NTPTrainingJobSpec.from_spec(job["spec"])
    except SpecError as exc:
        return Problem("InvalidSpec", str(exc))
    try:
        run = planner.JobSpec.of(whole)
    except SpecError as exc:
        return Spec(whole, Problem("InvalidSpec", str(exc)))
    if run.pp > 1:
        return Spec(whole, Problem("PipelineParallelNotSupported", (
            f"pipelineParallelSize {run.pp}: the trainer runs tensor and data parallelism "
            "only; set it to 1")))
    return Spec(whole, run)


def desired(spec: Spec | Problem, observed: Observed, now: datetime,
            queued: queueing.Verdict | None = None) -> Desired:
    """The desired state of `observed.job` (its spec as `job_spec` reads it) at `now`;
    `queued`: its queue's verdict, when the reconcile took it already (placement chose its
    nodes by the spec to run)."""
    if isinstance(spec, Problem):
        return _unreadable(spec, observed, now)
    # 0. Its queue; where the job is in its life; what earlier attempts left behind goes.
    queued = queued or queueing.decide(spec, observed, format_time(now))
    spec = queued.spec
    found, lost = life.life(spec, observed, now)
    if queued.waiting is not None:
        found = replace(found, waiting=queued.waiting)
    writes = {"workload": queued.workload, "workload_status": queued.workload_status}
    if found.stage is not Stage.RUNNING:
        return replace(_stopped(spec, observed, now, found, lost), **writes)
    stale = tuple(name for name, attempt in observed.configmap_attempts.items()
                  if attempt != found.attempt)
    previous = observed.job.get("status") or {}
    outdated = tuple(life.outdated(spec, observed))
    observed = life.of_attempt(observed, found.attempt)
    # 1-3. Placement, health and the plan.
    planned = _plan(spec, observed, now)
    # 4. The trainers' progress drives the boosts and the step a planned switch happens at.
    told = workload.steps_told(observed.pods, observed.job)
    placed = sorted(set(planned.placement.values()))
    reports, refused_reports = publish.agreed(observed.reports_of(placed), told)
    refused_reports = (*publish.unreadable(observed.reports, placed), *refused_reports)
    plan, blocked = planned.plan, None
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
            plan, blocked, targets = None, Problem("InvalidSpec", str(exc)), {}
        except publish.LayoutBlocked as exc:
            plan, blocked, targets, layout = None, Problem(exc.reason, str(exc)), {}, None
    children = placement.children(observed.job, spec.whole, planned.placement, found.attempt)
    # 5. Written up: the status, the events, the power writes.
    return replace(_written(Decision(
        spec, observed, previous, now, found, planned, children, stale, outdated, reports,
        refused_reports, plan, blocked, targets, layout, in_force)), **writes)


def _plan(spec: Spec, observed: Observed, now: datetime) -> _Planned:
    run = spec.planning
    if isinstance(run, Problem):
        return _Planned(problems=(run,))
    placed = placement.place(spec.whole, run, observed, now)
    if isinstance(placed, Problem):
        return _Planned(problems=(placed,))
    where, nodes = placed
    # Before any pod: a job whose healthy layout does not fit its GPUs is not made at all; a
    # degraded one that does not fit raises the minimum TP the planner keeps to.
    fits = memory_policy.fit(spec.whole, nodes)
    if fits.fits is False:
        return _Planned(problems=(Problem(fits.reason, fits.message),), memory=fits)
    if fits.min_tp is not None and fits.min_tp > run.min_tp_or_default:
        run = replace(run, min_tp=fits.min_tp)
    domains = planner.node_domains(nodes, run.domain_label)
    if (unpowered := planner.budget_problem(run, domains)) is not None:
        return _Planned(problems=(unpowered,))
    found, lost = signal.health_of(spec.whole, observed, where, nodes, now)
    published = observed.layout.generation
    if run.restarts_on_loss and published is not None:
        # An attempt keeps its first layout: its plan is that layout's nodes, the spares idle.
        domains = {n: d for n, d in domains.items() if n in {g.node for g in published.gpus}}
    found = found.merge(publish.held_back(
        published, observed.reports_of(sorted(set(where.values()))), lost.failed))
    plan = planner.plan(run, domains, found.failed)
    return _Planned(where, plan, plan.problems, found, lost, fits)


def _written(decision: Decision, sync: SyncPlan | None = None) -> Desired:
    """The running attempt's `Desired` from what was decided and what applying it met; `sync`:
    the power writes already made (not planned again)."""
    d = decision
    job, signal_ = d.observed.job, d.planned.signal
    plan, targets, layout, in_force = d.plan, d.targets, d.layout, d.in_force
    problems = d.planned.problems if d.blocked is None else (d.blocked, *d.planned.problems)
    if d.rejected is not None:
        plan, targets, layout, in_force = None, {}, None, None
        problems = (Problem("PodRejected", d.rejected), *d.planned.problems)
    layout_generation = int(d.previous.get("layoutGeneration", 0)) if in_force is None \
        else in_force.generation
    sync = power.sync(d.observed, targets) if sync is None else sync
    notes, held = (*signal_.problems, *d.refused_reports), sync.held
    if d.refused is not None:
        notes, held = (*notes, f"power targets refused: {d.refused}"), ()
    trained = None if in_force is None else progress.summarize(
        d.reports, in_force.generation, sorted({g.node for g in in_force.gpus}), d.life.earlier)
    spec = d.spec.whole
    starting = life.starting(spec, d.observed, d.life.attempt)
    status = conditions.render(
        plan, problems, d.previous, now=format_time(d.now),
        generation=int(job["metadata"].get("generation", 0)),
        layout_generation=layout_generation, notes=notes, held=held, trained=trained,
        life=d.life, outdated=d.outdated,
        tp_layout=None if in_force is None else planner.format_layout(in_force.tp_degrees),
        why=signal_.reasons, memory=_fits_memory(d.planned.memory), starting=starting,
        policy=spec.failure_policy)
    events = []
    if layout_generation != int(d.previous.get("layoutGeneration", 0)) and plan is not None:
        events.append(Event("Normal", "LayoutChanged",
                            f"layout generation {layout_generation}: TP {plan.tp_layout or '-'}"))
    recheck = min((t for t in (signal_.recheck_at, starting.gives_up_at) if t is not None),
                  default=None)
    return Desired(d.planned.placement, d.children, layout, d.observed.layout.resource_version,
                   targets, held, status, (*events, *_condition_events(d.previous, status)),
                   delete_configmaps=d.stale,
                   requeue_after=None if recheck is None else recheck - d.now.timestamp(),
                   sync=sync, decision=d)


def _fits_memory(fits: memory_policy.MemoryFit | None) -> conditions.Condition | None:
    return None if fits is None else conditions.Condition(
        "FitsMemory", fits.fits, fits.reason, fits.message)


def _stopped(spec: Spec, observed: Observed, now: datetime, found: Lifecycle,
             lost: Mapping[planner.GpuId, str]) -> Desired:
    """A job that runs no attempt (suspended, between two, finished): no child is made and
    every power target released; an attempt that ends takes its layout with it, a finished
    job keeps its last one (and its step and goodput) for the record. `lost`: the GPUs whose
    loss ended the attempt (CKPT-RESTART), named in an event."""
    previous = observed.job.get("status") or {}
    finished = found.stage is Stage.FINISHED
    wall = found.earlier.wall_seconds
    trained = progress.JobProgress(
        progress.Phase.PENDING, int(previous.get("step", 0)), None,
        previous.get("goodput") if finished else (
            found.earlier.productive_seconds / wall if wall else None), "")
    status = conditions.render(
        None, (), previous, now=format_time(now),
        generation=int(observed.job["metadata"].get("generation", 0)),
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
                   requeue_after=ttl if ttl is not None and ttl > 0 else None,
                   sync=power.sync(observed, {}))


def _unreadable(problem: Problem, observed: Observed, now: datetime) -> Desired:
    """A job whose spec the schema would not store (it was stored under another schema): why,
    in its status; no child made or deleted, its power targets released."""
    previous = observed.job.get("status") or {}
    status = conditions.render(
        None, (problem,), previous, now=format_time(now),
        generation=int(observed.job["metadata"].get("generation", 0)),
        layout_generation=int(previous.get("layoutGeneration", 0)))
    return Desired(status=status, events=_condition_events(previous, status),
                   sync=power.sync(observed, {}))


def _condition_events(previous: Mapping[str, Any], status: Mapping[str, Any]
                      ) -> tuple[Event, ...]:
    """One event per condition that changed."""
    events = []
    for c in conditions.changed(previous, status):
        bad = (c["type"], c["status"]) in {("Ready", "False"), ("Degraded", "True"),
                                           ("Failed", "True"), ("UpToDate", "False"),
                                           ("TrainingOnCPU", "True"), ("FitsMemory", "False")}
        events.append(Event("Warning" if bad else "Normal", c["reason"],
                            f"{c['type']}={c['status']}: {c['message']}"))
    return tuple(events)
