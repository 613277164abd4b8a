"""The publish policy (pure): the generation document a job's plan asks for, and when.

A new generation follows the plan once the rendezvous pod has an address: a planned change
(a cordon, a GPU back) switches at a step the ranks have not reached yet (`planned_step`), a
failure under the processes at once (`workload.generation_for`), without the GPUs a pending
planned generation adds when the loss hits it (`held_back`); none once a rank reported the
job's last step, nor for a switch after it. A layout the job may not publish (someone else's
ConfigMap, a generation lost, one that outgrows a ConfigMap or cannot be trained) is
`LayoutBlocked`, and the job has no plan. The trainers' progress reports count only where they
agree with what the job's pods were told (`agreed`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from tessera_contracts import progress
from tessera_contracts.api import ATTEMPT_LABEL, JOB_LABEL
from tessera_contracts.generation import (
    LAYOUT_KEY,
    Generation,
    GenerationError,
    Gpu,
    Rendezvous,
    layout_configmap,
)
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.unreadable import Unreadable
from tessera_core.plan import generation_layout
from tessera_operator import health, planner, workload
from tessera_operator.observed import Observed

CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server's limit on a ConfigMap's data
# Between a report's reading and its generation reaching every rank: the status and document
# writes, the node agents' watch and their copy for the ranks.
PUBLISH_LEAD_S = 2.0


class LayoutBlocked(Exception):
    """The layout document cannot be published; `reason` is the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def agreed(reports: Mapping[str, progress.NodeReport | None], until: int | None
           ) -> tuple[dict[str, progress.NodeReport | None], tuple[str, ...]]:
    """The reports that agree with what the node's ranks were told (`until`: the job's steps,
    `workload.steps_told`), and a line for each one refused (read as no report): a node's pod
    writes its own report, so it can claim anything of itself, but not a job of other steps
    than its pods run, nor to have finished short of them. The job's step is then the lowest
    node's, and its success every trainer pod's."""
    kept: dict[str, progress.NodeReport | None] = {}
    refused = []
    for node, report in reports.items():
        kept[node] = report
        if report is None or until is None:
            continue
        if report.steps != until:
            why = f"it claims a job of {report.steps} steps, its pods run {until}"
        elif report.state is progress.State.FINISHED and report.step < until:
            why = f"it claims to have finished at step {report.step} of {until}"
        else:
            continue
        kept[node] = None
        refused.append(f"node {node}'s progress report refused: {why}")
    return kept, tuple(refused)


def unreadable(reports: Mapping[str, progress.NodeReport | Unreadable], nodes: Iterable[str]
               ) -> tuple[str, ...]:
    """A line for each of `nodes` whose report does not parse (read as no report): a bound it
    breaks (more time spent than its wall time), an agent of another version, a hand edit."""
    return tuple(f"node {node}'s progress report refused: {found.why}" for node in nodes
                 if isinstance(found := reports.get(node), Unreadable))


def held_back(published: Generation | None,
              reports: Mapping[str, progress.NodeReport | None],
              lost: frozenset[planner.GpuId]) -> health.Health:
    """The GPUs a planned generation adds (a GPU back, a spare: a fresh process each, its
    `origin` null) while it is pending (no node reports training in it yet) and a loss hits
    it: left out of the generation that follows the loss, whose survivors would otherwise
    wait at its rendezvous for processes still starting. They come back at a planned step
    after it. Nothing when no planned generation is pending, or the loss is not in it."""
    if published is None or published.at_step is None or published.origin is None:
        return health.Health()
    if not lost & {(g.node, g.index) for g in published.gpus}:
        return health.Health()
    if any(r is not None and r.generation >= published.generation for r in reports.values()):
        return health.Health()
    fresh = {(g.node, g.index) for g, o in zip(published.gpus, published.origin, strict=True)
             if o is None}
    if not fresh:
        return health.Health()
    why = (f"joining in generation {published.generation} when a loss came: back at a "
           "planned step after the generation that follows it")
    return health.Health(frozenset(fresh), (
        f"GPUs {', '.join(planner.gpu_name(g) for g in sorted(fresh))}: {why}",),
        reasons=dict.fromkeys(fresh, why))


def planned_step(reports: Mapping[str, progress.NodeReport | None], now: float) -> int:
    """The step a planned change is published for (`now`: Unix seconds): one the ranks have
    not reached yet, so that they switch exactly there. They may be past the last step reported
    by what they trained since (the report's age, at most one report period; the whole period
    for a report that does not say when it was made) and until the document reaches them
    (PUBLISH_LEAD_S), at the fastest pace reported. Before any pace, the step reported (the
    ranks switch at the first boundary after it)."""
    found = [r for r in reports.values() if r is not None]
    if not found:
        return 0
    newest = max(found, key=lambda r: r.step)
    paces = [r.step_seconds for r in found if r.step_seconds]
    if not paces:
        return newest.step
    period = progress.report_period(len(reports))
    age = period if newest.reported_at is None else min(max(now - newest.reported_at, 0.0),
                                                        period)
    return newest.step + math.ceil((age + PUBLISH_LEAD_S) / min(paces))


def to_publish(spec: NTPTrainingJobSpec, observed: Observed, plan: planner.JobPlan,
               reports: Mapping[str, progress.NodeReport | None],
               lost: frozenset[planner.GpuId], now: datetime, steps: int
               ) -> tuple[dict[str, Any] | None, Generation | None]:
    """The layout ConfigMap to publish (None: nothing new) and the generation in force then.

    A new generation follows the plan once the rendezvous pod has an address (planned changes
    at `planned_step`; `lost`: GPUs whose processes died with them), and never once a rank
    reported the job's last step (`steps`) or for a switch after it: the last step its ranks
    were told, which an edit of spec.steps moves only for the next attempt.
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
    # The status remembers what was published: a document deleted by someone cannot say so.
    published = int((job.get("status") or {}).get("layoutGeneration", 0))
    if previous is None and published:
        raise LayoutBlocked("LayoutLost", (
            f"ConfigMap {name} no longer holds generation {published} (deleted or changed by "
            "someone else): the running trainers cannot follow a layout derived from nothing. "
            "Restore it, or delete the job's trainer pods and the ConfigMap's data to restart "
            "from generation 1"))
    if previous is not None and plan.spec.restarts_on_loss \
            and workload.replicas_of(plan) != previous.replicas:
        return None, previous  # an attempt keeps its first layout: a GPU lost there restarts it
    rendezvous = _rendezvous(job, observed.pods)
    if previous is None:
        if rendezvous is None:
            return None, None  # its pod has no address yet; the pod's watch brings the job back
    else:
        rendezvous = rendezvous or previous.rendezvous
    following = workload.generation_for(plan, spec.global_batch, rendezvous, previous,
                                         [Gpu(n, i) for n, i in lost],
                                         at_step=planned_step(reports, now.timestamp()))
    if following is None:
        return None, previous
    reported = max((r.step for r in reports.values() if r is not None), default=0)
    if previous is not None and (reported >= steps or (following.at_step or 0) >= steps):
        # The ranks finish the job in the generation in force: a new one would start ranks (a
        # GPU back) that nobody comes to meet.
        return None, previous
    try:
        generation_layout(following)  # what every rank computes from it
    except GenerationError as exc:
        raise LayoutBlocked("LayoutUnplannable", (
            f"generation {following.generation} cannot be trained (globalBatch "
            f"{spec.global_batch}, TP {plan.tp_layout}): {exc}; it is not published")) from exc
    attempt = int((job.get("status") or {}).get("attempt", 0))
    return layout_document(job, following, attempt), following


def _rendezvous(job: Mapping[str, Any], pods: tuple[Mapping[str, Any], ...]
                ) -> Rendezvous | None:
    name = workload.rendezvous_name(job["metadata"]["name"])
    for pod in pods:
        if pod["metadata"]["name"] == name and (ip := (pod.get("status") or {}).get("podIP")):
            return Rendezvous(ip, workload.RENDEZVOUS_PORT)
    return None


def layout_document(job: Mapping[str, Any], generation: Generation, attempt: int = 0
                    ) -> dict[str, Any]:
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
                         "labels": {JOB_LABEL: meta["name"], ATTEMPT_LABEL: str(attempt)},
                         "ownerReferences": [workload.owner(job)]},
            "data": {LAYOUT_KEY: data}}
