"""The Kueue Workload of a job labelled with a Kueue queue (pure): what Tessera asks Kueue to admit
for it, as Kueue's own job integrations build theirs for their kinds.

One Workload per job, `<job>-workload` (`workload_name`), controlled by the job (it goes with it),
labelled with the job and its queue. Two pod sets: `trainer`, one pod per node of the job (spares
included: each holds its node's GPUs) with the trainer pod's requests (GPUs, CPU, memory, claims),
and `rendezvous`, the job's one TCPStore pod. Its priority is the job's
`kueue.x-k8s.io/priority-class` label (a WorkloadPriorityClass), else the template's
`priorityClassName` (a PriorityClass), with the class's value as read (Kueue refuses a class
without its value).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera_contracts.api import JOB_LABEL
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_operator import workload

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
WORKLOADS = "workloads"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TRAINER_SET, RENDEZVOUS_SET = "trainer", "rendezvous"
# what a pod set's template keeps of a pod: what Kueue counts and matches flavors against
PLACING_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                  "resourceClaims")


@dataclass(frozen=True)
class PriorityRef:
    """The priority class a job names: a WorkloadPriorityClass (kueue.x-k8s.io) or a
    PriorityClass (scheduling.k8s.io)."""

    group: str
    kind: str
    name: str


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The Kueue LocalQueue the job is queued in (its label); None: Kueue does not hold it."""
    return ((job.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(job: str) -> str:
    return f"{job}-workload"


def priority_ref(job: Mapping[str, Any]) -> PriorityRef | None:
    """The priority class the job's Workload carries, if it names one."""
    labelled = ((job.get("metadata") or {}).get("labels") or {}).get(PRIORITY_LABEL)
    if labelled:
        return PriorityRef(KUEUE_GROUP, "WorkloadPriorityClass", labelled)
    template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    named = template.get("priorityClassName")
    return PriorityRef("scheduling.k8s.io", "PriorityClass", named) if named else None


def _requested(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's name, image and resources with each limit as the request it defaults to
    (the API server defaults a pod's so; an embedded template is not defaulted)."""
    resources = dict(container.get("resources") or {})
    requests = dict(resources.get("limits") or {}) | dict(resources.get("requests") or {})
    kept = {"requests": requests} | ({"claims": resources["claims"]}
                                     if resources.get("claims") else {})
    return {"name": container["name"], "image": container.get("image", ""), "resources": kept}


def _pod_set(name: str, count: int, pod: Mapping[str, Any],
             template_spec: Mapping[str, Any]) -> dict[str, Any]:
    """A pod set of `count` pods like `pod`, placed as the job's template places them (not the
    node affinity the operator pins a trainer pod with: that is placement's, after admission)."""
    spec = {k: template_spec[k] for k in PLACING_FIELDS if k in template_spec}
    spec["containers"] = [_requested(c) for c in pod["spec"]["containers"]]
    if pod["spec"].get("initContainers"):
        spec["initContainers"] = [_requested(c) for c in pod["spec"]["initContainers"]]
    return {"name": name, "count": count, "template": {"spec": spec}}


def build(job: Mapping[str, Any], spec: NTPTrainingJobSpec, queue: str,
          priority: tuple[PriorityRef, int] | None) -> dict[str, Any]:
    """The job's Workload in `queue`; `priority`: its class and the class's value."""
    meta = job["metadata"]
    _, template_spec = workload.template(spec)
    trainer = workload.trainer_pod(job, spec, 0, "", 0)
    rendezvous = workload.rendezvous_pod(job, spec, 0)
    body: dict[str, Any] = {
        "queueName": queue,
        "podSets": [_pod_set(TRAINER_SET, spec.trainers, trainer, template_spec),
                    _pod_set(RENDEZVOUS_SET, 1, rendezvous, template_spec)]}
    if priority is not None:
        ref, value = priority
        body |= {"priorityClassRef": {"group": ref.group, "kind": ref.kind, "name": ref.name},
                 "priority": value}
    return {"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "Workload",
            "metadata": {"name": workload_name(meta["name"]), "namespace": meta["namespace"],
                         "labels": {JOB_LABEL: meta["name"], QUEUE_LABEL: queue},
                         "ownerReferences": [workload.owner(job)]},
            "spec": body}
