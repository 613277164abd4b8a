"""The queueing policy (pure): a job labelled with a Kueue queue runs only while Kueue admits its
Workload, as Kueue's job integrations run theirs.

- Not admitted yet (no Workload, quota not reserved, or its flavor not read yet): the job is held
  suspended, its condition saying it waits for Kueue and why (Kueue's own message).
- Admitted: the job runs with the admission's flavor applied to its pod template: the flavors'
  node labels join its nodeSelector (placement chooses among those nodes) and their tolerations
  its tolerations, for the trainer and rendezvous pods alike (the trainer pod set's flavors: one
  resource group covers both pod sets).
- Evicted (preempted, or any other reason Kueue evicts for): the job is held suspended, which ends
  its attempt through the suspend path (pods deleted, the account folded in, the next attempt
  resuming from the last checkpoint); once no pod of it is left, the quota is given back: the
  admission is cleared from the Workload's status with the conditions Kueue's integrations write
  (`QuotaReserved` and `Admitted` false, `Requeued`), and Kueue admits it again when it can.
- Finished (Complete or Failed): the Workload is marked `Finished`, which releases the quota.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera_operator import kueue_workload, lifecycle
from tessera_operator.kueue_workload import TRAINER_SET
from tessera_operator.observed import Observed, Queue, Spec

WAITING = "WaitingForKueue"
# the eviction reasons after which Kueue's integrations mark a Workload requeued at once
REQUEUED_AT_ONCE = ("Preempted", "NodeFailures")


@dataclass(frozen=True)
class Verdict:
    """What the job's queue decides for this reconcile."""

    spec: Spec  # the spec to run: suspended until admitted, with the admission's flavor
    waiting: str | None = None  # why the job waits for Kueue (None: it is not held)
    workload: dict[str, Any] | None = None  # the Workload to apply (None: none wanted)
    # JSON patch operations on the Workload's status (empty: none to write)
    workload_status: tuple[dict[str, Any], ...] = ()


def _conditions(obj: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _true(conds: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return (conds.get(kind) or {}).get("status") == "True"


def decide(spec: Spec, observed: Observed, now: str) -> Verdict:
    """The queue's verdict on `observed.job` (its spec: `spec`) at `now` (RFC 3339)."""
    job, queue = observed.job, observed.queue
    name = kueue_workload.queue_name(job)
    if name is None or queue is None:
        return Verdict(spec)
    status = job.get("status") or {}
    wl = queue.workload
    conds = _conditions(wl)
    finish = lifecycle.finished(status)
    if finish is not None:
        if wl is None or _true(conds, "Finished"):
            return Verdict(spec)
        return Verdict(spec, workload_status=_patch(wl, [*_others(conds, ("Finished",)), {
            "type": "Finished", "status": "True",
            "reason": "Succeeded" if finish.succeeded else "Failed",
            "message": finish.message, "lastTransitionTime": now}]))
    wanted = None if queue.priority_missing else kueue_workload.build(
        job, spec.whole, name, queue.priority)
    held = replace(spec, whole=replace(spec.whole, suspend=True))
    if queue.priority_missing:
        return Verdict(held, f"its priority class {queue.priority_missing} does not exist")
    if wl is None:
        return Verdict(held, f"its Workload {wanted['metadata']['name']} is being created",
                       wanted)
    if _true(conds, "Evicted") and (wl.get("status") or {}).get("admission"):
        evicted = conds["Evicted"]
        why = f"Kueue evicted it ({evicted.get('reason')}: {evicted.get('message')})"
        if observed.pods:
            return Verdict(held, f"{why}; its pods are stopping", wanted)
        return Verdict(held, f"{why}; its quota is given back", wanted,
                       _released(wl, conds, evicted, now))
    if not _true(conds, "Admitted"):
        pending = conds.get("QuotaReserved") or {}
        return Verdict(held, f"Kueue has not admitted its Workload {wl['metadata']['name']}"
                       + (f": {pending['message']}" if pending.get("message") else ""), wanted)
    flavored = _flavored(spec, wl, queue)
    if isinstance(flavored, str):
        return Verdict(held, flavored, wanted)
    return Verdict(flavored, None, wanted)


def _flavored(spec: Spec, wl: Mapping[str, Any], queue: Queue) -> Spec | str:
    """`spec` with its admission's flavor (the trainer pod set's) in its pod template; why not,
    while a ResourceFlavor it names is not read."""
    assignments = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    trainer = next((a for a in assignments if a.get("name") == TRAINER_SET), {})
    labels: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for flavor in sorted(set((trainer.get("flavors") or {}).values())):
        found = queue.flavors.get(flavor)
        if found is None:
            return f"admitted on ResourceFlavor {flavor}, which is not read yet"
        labels |= dict((found.get("spec") or {}).get("nodeLabels") or {})
        tolerations += [t for t in (found.get("spec") or {}).get("tolerations") or []
                        if t not in tolerations]
    if not labels and not tolerations:
        return spec
    template = dict(spec.whole.template)
    pod = dict(template.get("spec") or {})
    pod["nodeSelector"] = dict(pod.get("nodeSelector") or {}) | labels
    own = list(pod.get("tolerations") or [])
    pod["tolerations"] = own + [t for t in tolerations if t not in own]
    return replace(spec, whole=replace(spec.whole, template=template | {"spec": pod}))


def _others(conds: Mapping[str, Mapping[str, Any]], kinds: Sequence[str]
            ) -> list[Mapping[str, Any]]:
    return [c for kind, c in conds.items() if kind not in kinds]


def _released(wl: Mapping[str, Any], conds: Mapping[str, Mapping[str, Any]],
              evicted: Mapping[str, Any], now: str) -> tuple[dict[str, Any], ...]:
    """The status write that gives an evicted Workload's quota back, as Kueue's integrations
    write it: no admission, QuotaReserved and Admitted false, Requeued."""
    reason = str(evicted.get("reason") or "Evicted")
    message = str(evicted.get("message") or "")
    kept = _others(conds, ("QuotaReserved", "Admitted", "Requeued"))
    changed = [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message,
         "lastTransitionTime": now},
        {"type": "Admitted", "status": "False", "reason": "NoReservation",
         "message": "The workload has no reservation", "lastTransitionTime": now},
        {"type": "Requeued", "status": "True" if reason in REQUEUED_AT_ONCE else "False",
         "reason": reason, "message": message, "lastTransitionTime": now}]
    return (*_patch(wl, [*kept, *changed]), {"op": "remove", "path": "/status/admission"})


def _patch(wl: Mapping[str, Any], conditions: list[Mapping[str, Any]]
           ) -> tuple[dict[str, Any], ...]:
    """JSON patch operations writing the Workload's conditions, only onto the version read."""
    return ({"op": "test", "path": "/metadata/resourceVersion",
             "value": wl["metadata"]["resourceVersion"]},
            {"op": "replace", "path": "/status/conditions", "value": conditions})
