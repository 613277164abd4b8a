"""The placement policy (pure): the nodes a job's trainer pods run on, and the objects it runs.

Placement (`workload.place`) chooses nodes for the trainer pods the job lacks, among the
candidates observed (`Observed.candidates`); too few gives Unschedulable and no child at all.
Under failurePolicy.mode CKPT-RESTART an attempt is placed once, while it has no trainer pod, on
whole nodes none of whose GPUs its health sources fail, spares as found (`_healthy_nodes`). The
children are every object the job runs, under deterministic names (`children`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_operator import planner, workload
from tessera_operator.lifecycle import Stage
from tessera_operator.observed import Observed, Spec
from tessera_operator.policies import life, signal

Placed = tuple[dict[int, str], tuple[Mapping[str, Any], ...]]


def selector(spec: Spec | planner.Problem) -> dict[str, str]:
    """The labels every node of the job must carry (its template's nodeSelector; none for a
    spec the operator cannot read)."""
    return {} if isinstance(spec, planner.Problem) else workload.node_selector(spec.whole)


def needs_placement(spec: Spec | planner.Problem, observed: Observed, now: datetime) -> bool:
    """Whether the job runs an attempt and lacks a trainer pod: a reconcile then observes the
    placement candidates (`observe.with_candidates`)."""
    if isinstance(spec, planner.Problem) or isinstance(spec.planning, planner.Problem) \
            or life.life(spec, observed, now)[0].stage is not Stage.RUNNING:
        return False
    return bool(missing(spec.whole, workload.placed_nodes(observed.pods, observed.job)))


def missing(spec: NTPTrainingJobSpec, placed: Mapping[int, str]) -> list[int]:
    """The trainer pods to place: those the job lacks. Under CKPT-RESTART all of them for an
    attempt that has none, else none: an attempt keeps the nodes it started on (a pod gone
    from its layout's nodes ends it)."""
    wanted = range(spec.trainers)
    if spec.failure_policy.mode.restarts_on_loss:
        return [] if placed else list(wanted)
    return [i for i in wanted if i not in placed]


def chosen_nodes(spec: Spec | planner.Problem, observed: Observed) -> tuple[str, ...]:
    """The nodes placement chooses among `observed.candidates` for the trainer pods the job
    lacks; none when they do not fit."""
    if isinstance(spec, planner.Problem) or isinstance(spec.planning, planner.Problem):
        return ()
    placed = place(spec.whole, spec.planning, observed, None)
    if isinstance(placed, planner.Problem):
        return ()
    before = set(workload.placed_nodes(observed.pods, observed.job).values())
    return tuple(sorted(set(placed[0].values()) - before))


def place(spec: NTPTrainingJobSpec, run: planner.JobSpec, observed: Observed,
          now: datetime | None) -> Placed | planner.Problem:
    """Every trainer pod's node (those placed, and nodes chosen for the missing ones) and the
    job's nodes as observed; or why the missing ones cannot be placed. `now` None: the
    candidates' DCGM health is not read yet (`chosen_nodes`, which only picks the nodes whose
    other pods are read)."""
    placed = workload.placed_nodes(observed.pods, observed.job)
    lacking = missing(spec, placed)
    if not lacking:
        return placed, observed.nodes
    candidates = observed.candidates
    if candidates is None:
        raise ValueError("placing a job needs its candidates observed")
    views = [v for v in workload.node_views(candidates.nodes, candidates.taken,
                                            workload.node_selector(spec), run.domain_label)
             if v.name not in placed.values()]
    chosen = _healthy_nodes(spec, run, observed, views, len(lacking), now) \
        if run.restarts_on_loss else workload.place(run, len(lacking), views)
    if isinstance(chosen, planner.Problem):
        return chosen
    # CKPT-RESTART may find fewer nodes than pods asked for: the spares it lacks are left out.
    placement = placed | dict(zip(lacking, chosen, strict=False))
    return placement, tuple(n for n in candidates.nodes
                            if n["metadata"]["name"] in placement.values())


def _healthy_nodes(spec: NTPTrainingJobSpec, run: planner.JobSpec, observed: Observed,
                   views: list[workload.NodeView], wanted: int, now: datetime | None
                   ) -> tuple[str, ...] | planner.Problem:
    """CKPT-RESTART's placement of an attempt: whole nodes none of whose GPUs the job's health
    sources fail (a trainer pod needs every GPU of its node), `wanted` of them or as many as
    there are, at least those DP x TP x PP GPUs fill; or why not."""
    assert observed.candidates is not None
    found, _ = signal.health_of(spec, observed, {}, observed.candidates.nodes, now)
    bad = {node for node, _ in found.failed}
    chosen = workload.place(run, wanted, [v for v in views if v.name not in bad],
                            fewest=run.fewest_nodes)
    if isinstance(chosen, planner.Problem):
        return replace(chosen, message=(
            f"{chosen.message}; under failurePolicy.mode CKPT-RESTART a node with a failed or "
            f"cordoned GPU is no candidate ({len(bad)} such)"))
    return chosen


def children(job: Mapping[str, Any], spec: NTPTrainingJobSpec, placement: Mapping[int, str],
             attempt: int) -> tuple[dict[str, Any], ...]:
    """Every object the job runs once placed: its trainer identity, progress ConfigMap,
    rendezvous pod and trainer pods (none before it is placed)."""
    if not placement:
        return ()
    return (*workload.identity(job, spec), workload.progress_configmap(job, attempt),
            workload.rendezvous_pod(job, spec, attempt),
            *(workload.trainer_pod(job, spec, i, node, attempt)
              for i, node in sorted(placement.items())))
