"""What one reconcile observed of a job's world (pure data): the `Observed` value that
`observe` reads and `desired` decides from, its inputs parsed once (progress reports, GPUHealth),
and the job's spec as the operator reads it (`Spec`); a test builds one by hand, no API server
needed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera_contracts import progress
from tessera_contracts.api import JOB_MANAGER
from tessera_contracts.generation import Generation
from tessera_contracts.gpuhealth import PublishedHealth
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.progress import NodeReport
from tessera_contracts.unreadable import Unreadable
from tessera_operator.dra_health import DeviceTaints
from tessera_operator.kueue_workload import PriorityRef
from tessera_operator.planner import JobSpec, Problem

ChildKey = tuple[str, str]  # (kind, name)


def ours(job: Mapping[str, Any]) -> bool:
    """Whether this operator reconciles the job (`spec.managedBy` absent or ours): read before
    the spec is, by the watches that skip another controller's jobs."""
    return (job.get("spec") or {}).get("managedBy") in (None, JOB_MANAGER)


@dataclass(frozen=True)
class Spec:
    """A job's spec as one reconcile reads it (`desired.job_spec`): typed and defaulted whole,
    and what planning runs of it, or why the operator cannot run it."""

    whole: NTPTrainingJobSpec
    planning: JobSpec | Problem


@dataclass(frozen=True)
class Layout:
    """The job's layout ConfigMap as read."""

    resource_version: str | None = None  # None: there is none
    owned: bool = True  # controlled by the job (one that is not is never written)
    generation: Generation | None = None  # None: none, or unreadable


@dataclass(frozen=True)
class Candidates:
    """What placement chooses among: the schedulable nodes the job's nodeSelector matches (as
    the node watch last saw them), and per node the GPUs other pods ask for there."""

    nodes: tuple[Mapping[str, Any], ...]
    taken: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    """What Kueue holds of a job labelled with a queue: its Workload (None: none yet), the
    ResourceFlavors its admission names, by name, and its priority class with the class's
    value (None: it names none), or the name of the one it names that does not exist."""

    workload: Mapping[str, Any] | None = None
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    priority: tuple[PriorityRef, int] | None = None
    priority_missing: str | None = None


@dataclass(frozen=True)
class Observed:
    """A job and what one reconcile observed of its world."""

    job: Mapping[str, Any]
    pods: tuple[Mapping[str, Any], ...] = ()  # the pods the job controls
    # The nodes its trainer pods are placed on, as the node watch last saw them (or the API,
    # for one not delivered yet); one gone from the API is left out.
    nodes: tuple[Mapping[str, Any], ...] = ()
    layout: Layout = Layout()
    # Every node's progress report in the progress ConfigMap, by node, as parsed.
    reports: Mapping[str, NodeReport | Unreadable] = field(default_factory=dict)
    targets: tuple[Mapping[str, Any], ...] = ()  # the job's GPUPowerTargets
    # The GPUHealth of its (candidate) nodes, as parsed (kopf's index holds them so).
    gpu_health: tuple[PublishedHealth | Unreadable, ...] = ()
    # The DRA device taints on its nodes' GPUs (their ResourceSlices, the DeviceTaintRules).
    devices: DeviceTaints = DeviceTaints()
    children: Mapping[ChildKey, Mapping[str, Any]] = field(default_factory=dict)
    candidates: Candidates | None = None  # observed only while a trainer pod is missing
    # The job's layout and progress ConfigMaps that exist: name -> the attempt they are of.
    configmap_attempts: Mapping[str, int] = field(default_factory=dict)
    queue: Queue | None = None  # observed only for a job labelled with a Kueue queue

    def reports_of(self, nodes: Iterable[str]) -> dict[str, NodeReport | None]:
        """Each of `nodes`' progress report; None where it has none or an unreadable one."""
        return progress.usable(self.reports, nodes)


def child_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator sets of a child other than a pod (its kind, name, labels and owner,
    and a Role's rules, a RoleBinding's subjects and role), to compare the child as it is
    with the one wanted. A ConfigMap's data is left out: the agents write the progress
    reports, and they would make every view as large as a job's reports."""
    meta = obj.get("metadata") or {}
    view = {"kind": obj.get("kind"),
            "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {}),
                         "ownerReferences": list(meta.get("ownerReferences") or [])}}
    return view | {k: obj[k] for k in ("rules", "roleRef", "subjects") if k in obj}


