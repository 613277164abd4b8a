"""What a job runs, as API objects (pure): where its trainer pods go, and the pods themselves.

The operator owns every object a job needs to train, each controlled by the job (the garbage
collector removes them with it) under a name derived from the job's:

- `<job>-trainer`: the trainer pods' ServiceAccount, and a Role + RoleBinding that let it read
  the job's layout ConfigMap and patch its progress ConfigMap, nothing else;
- `<job>-progress`: the ConfigMap the node agents report into (one key per node);
- `<job>-rendezvous`: a pod that hosts the job's TCPStore (`ntp.rendezvous`); its pod IP, read
  from the API (no DNS is assumed), goes into every generation document;
- `<job>-node-<i>`: one trainer pod per node (`ntp.nodeagent.agent`), asking for all `gpusPerNode`
  GPUs of the node it is placed on.

Placement is the set of trainer pods: each one names its node (node affinity on the node's
name, as the DaemonSet controller pins its pods; the scheduler still binds it, checking the
GPUs are free), so once placed a job keeps its nodes however the operator restarts. Nodes are
chosen by `place`: free GPUs and scale-up domain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera_contracts.api import JOB_LABEL, ROLE_LABEL
from tessera_contracts.generation import (
    Generation,
    Gpu,
    Rendezvous,
    layout_configmap,
    next_generation,
)
from tessera_contracts.invocation import AgentInvocation
from tessera_contracts.progress import progress_configmap as progress_name
from tessera_operator.planner import JobPlan, JobSpec, Problem

GPU_RESOURCE = "nvidia.com/gpu"
TRAINER, RENDEZVOUS = "trainer", "rendezvous"
RENDEZVOUS_PORT = 29400
METRICS_PORT = 9300
DEFAULT_STEPS = 1000
DEFAULT_GLOBAL_BATCH = 64
_TRAINER_POD = re.compile(r"-node-(\d+)$")


def owner(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def _meta(job: Mapping[str, Any], name: str, role: str | None = None) -> dict[str, Any]:
    labels = {JOB_LABEL: job["metadata"]["name"]} | ({ROLE_LABEL: role} if role else {})
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": labels,
            "ownerReferences": [owner(job)]}


def controlled_by(obj: Mapping[str, Any], job: Mapping[str, Any]) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == job["metadata"]["uid"] and r.get("controller") for r in refs)


def identity_name(job: str) -> str:
    return f"{job}-trainer"


def rendezvous_name(job: str) -> str:
    return f"{job}-rendezvous"


def trainer_name(job: str, index: int) -> str:
    return f"{job}-node-{index}"


# ----------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeView:
    """What placement needs of a node."""

    name: str
    domain: str
    free_gpus: int  # allocatable GPUs less those that other pods asked for


def _gpus(quantity: object) -> int:
    try:
        return int(str(quantity))
    except ValueError:
        return 0


def _pinned(node: str) -> dict[str, Any]:
    """Node affinity to the node named `node` (a node name may be longer than a label value,
    so not its hostname label)."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}


def pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node a pod runs on, or is pinned to before the scheduler binds it."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if (field.get("key"), field.get("operator")) == ("metadata.name", "In") and len(
                    field.get("values") or []) == 1:
                return str(field["values"][0])
    return None


def _pod_gpus(pod: Mapping[str, Any]) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        asked = (resources.get("limits") or {}).get(GPU_RESOURCE) or (
            resources.get("requests") or {}).get(GPU_RESOURCE)
        total += _gpus(asked or 0)
    return total


def node_views(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
               selector: Mapping[str, str], domain_label: str) -> list[NodeView]:
    """Schedulable nodes matching `selector`, with the GPUs that running or pending pods (bound,
    or pinned by name as this operator's are) have not taken."""
    taken: dict[str, int] = {}
    for pod in pods:
        node = pod_node(pod)
        if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            taken[node] = taken.get(node, 0) + _pod_gpus(pod)
    views = []
    for node in nodes:
        meta, spec = node["metadata"], node.get("spec") or {}
        labels = meta.get("labels") or {}
        if spec.get("unschedulable") or any(labels.get(k) != v for k, v in selector.items()):
            continue
        allocatable = _gpus(((node.get("status") or {}).get("allocatable") or {}).get(
            GPU_RESOURCE, 0))
        views.append(NodeView(meta["name"], labels.get(domain_label) or meta["name"],
                              allocatable - taken.get(meta["name"], 0)))
    return views


def place(spec: JobSpec, nodes: int, candidates: Sequence[NodeView]) -> tuple[str, ...] | Problem:
    """`nodes` nodes for the job, whole TP groups inside scale-up domains; or why not.

    Domains with the most usable nodes go first (a job spreads over as few NVLink domains as
    it can), and from a domain only as many nodes as make whole TP groups are taken when a
    group spans nodes; within a domain, nodes by name, so placement is reproducible.
    """
    usable = [n for n in candidates if n.free_gpus >= spec.gpus_per_node]
    domains: dict[str, list[str]] = {}
    for n in sorted(usable, key=lambda n: n.name):
        domains.setdefault(n.domain, []).append(n.name)
    # Nodes per TP group when a group spans nodes; 1 when a node holds whole groups.
    per_group = -(-spec.tp // spec.gpus_per_node) if spec.tp > spec.gpus_per_node else 1
    chosen: list[str] = []
    for _, names in sorted(domains.items(), key=lambda d: (-len(d[1]), d[0])):
        room = nodes - len(chosen)
        if room <= 0:
            break
        take = min(room, len(names)) // per_group * per_group
        chosen.extend(names[:take])
    if len(chosen) < nodes:
        return Problem("Unschedulable", (
            f"needs {nodes} nodes with {spec.gpus_per_node} free {GPU_RESOURCE} each "
            f"(whole TP groups of {spec.tp} GPUs inside one scale-up domain); "
            f"found {len(usable)} such nodes of {len(candidates)} matching the job's "
            f"nodeSelector, in {len(domains)} domains"))
    return tuple(chosen)


def trainer_pods(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any]
                 ) -> list[Mapping[str, Any]]:
    """The pods among `pods` that are trainer pods of `job`."""
    return [pod for pod in pods if controlled_by(pod, job) and (
        (pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == TRAINER]


def placed_nodes(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any]) -> dict[int, str]:
    """The job's placement as its trainer pods record it: pod index -> node."""
    placed = {}
    for pod in trainer_pods(pods, job):
        match = _TRAINER_POD.search((pod.get("metadata") or {}).get("name", ""))
        node = pod_node(pod)
        if match and node:
            placed[int(match.group(1))] = node
    return placed


def leaving_nodes(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any]) -> set[str]:
    """Nodes whose trainer pod of `job` is being deleted (evicted from a node that stopped
    reporting, or deleted by someone): its ranks are on their way out."""
    return {node for pod in trainer_pods(pods, job)
            if (pod.get("metadata") or {}).get("deletionTimestamp")
            and (node := pod_node(pod)) is not None}


# ----------------------------------------------------------------------------------------------
# Objects
# ----------------------------------------------------------------------------------------------


def identity(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trainer pods' ServiceAccount, Role and RoleBinding: read the layout (a watch by
    name), patch the progress report; nothing else."""
    name, jobname = identity_name(job["metadata"]["name"]), job["metadata"]["name"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(job, name),
         "rules": [
             {"apiGroups": [""], "resources": ["configmaps"],
              "resourceNames": [layout_configmap(jobname)], "verbs": ["get", "list", "watch"]},
             {"apiGroups": [""], "resources": ["configmaps"],
              "resourceNames": [progress_name(jobname)], "verbs": ["get", "patch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(job, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name,
                       "namespace": job["metadata"]["namespace"]}]},
    ]


def progress_configmap(job: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, progress_name(job["metadata"]["name"])), "data": {}}


def _env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    own = [{"name": "NODE_NAME"} | field("spec.nodeName"),
           {"name": "POD_IP"} | field("status.podIP"),
           {"name": "POD_NAMESPACE"} | field("metadata.namespace")]
    names = {e["name"] for e in own}
    return own + [dict(e) for e in spec.get("env") or [] if e.get("name") not in names]


def _pod(job: Mapping[str, Any], name: str, role: str, container: dict[str, Any],
         node: str | None) -> dict[str, Any]:
    spec = job["spec"]
    meta = _meta(job, name, role)
    if role == TRAINER:
        meta["annotations"] = {"prometheus.io/scrape": "true",
                               "prometheus.io/port": str(METRICS_PORT)}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {
            "serviceAccountName": identity_name(job["metadata"]["name"]),
            # A trainer that exits non-zero cannot rejoin its job's generations: the job
            # fails and says why, rather than a restart loop.
            "restartPolicy": "Never" if role == TRAINER else "Always",
            "nodeSelector": dict(spec.get("nodeSelector") or {}),
            "tolerations": [dict(t) for t in spec.get("tolerations") or []],
            "containers": [{"name": role, "image": spec["image"],
                            "env": _env(spec)} | container],
        } | ({"affinity": _pinned(node)} if node else {}),
    }


def trainer_pod(job: Mapping[str, Any], index: int, node: str) -> dict[str, Any]:
    """The node agent on `node`, with every GPU of the node: it runs one rank per GPU the
    current generation gives it. Container args: the agent's invocation (the job, its steps in
    all), then `--`, then the trainer options for every rank: checkpoints, the spec's `args`."""
    spec, name = job["spec"], job["metadata"]["name"]
    resources = {k: dict(v) for k, v in (spec.get("resources") or {}).items()}
    gpus = str(spec.get("gpusPerNode", 8))
    resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    if "requests" in resources:
        resources["requests"][GPU_RESOURCE] = gpus
    agent = AgentInvocation(until_step=spec.get("steps", DEFAULT_STEPS), job=name,
                            trainer_args=(*rank_args(spec), *(spec.get("args") or [])))
    container = {"args": agent.to_args(), "resources": resources,
                 "ports": [{"name": "metrics", "containerPort": METRICS_PORT}]}
    if spec.get("command"):
        container["command"] = list(spec["command"])
    return _pod(job, trainer_name(name, index), TRAINER, container, node)


def rank_args(spec: Mapping[str, Any]) -> list[str]:
    """Trainer options every rank gets from the spec: checkpoints where the job keeps them."""
    checkpoint = spec.get("checkpointPolicy") or {}
    if not checkpoint.get("path"):
        return []
    return ["--save", f"{checkpoint['path'].rstrip('/')}/dense.pt", "--resume",
            "--save-every", str(checkpoint.get("intervalSteps", 1000))]


def rendezvous_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    """The job's TCPStore host: no GPU, on any node the job's selector and tolerations allow."""
    container = {"command": ["python", "-m", "ntp.rendezvous"],
                 "args": ["--port", str(RENDEZVOUS_PORT)],
                 "ports": [{"name": "store", "containerPort": RENDEZVOUS_PORT}]}
    return _pod(job, rendezvous_name(job["metadata"]["name"]), RENDEZVOUS, container, None)


# ----------------------------------------------------------------------------------------------
# Generations
# ----------------------------------------------------------------------------------------------


def replicas_of(plan: JobPlan) -> tuple[tuple[Gpu, ...], ...]:
    """Each replica's GPUs in rank order (PP 1: one stage per replica)."""
    return tuple(tuple(Gpu(n, i) for n, i in r.stage_gpus()[0]) for r in plan.replicas)


def generation_for(
    plan: JobPlan,
    global_batch: int,
    rendezvous: Rendezvous,
    previous: Generation | None,
    lost: Iterable[Gpu] = (),
    at_step: int | None = None,
) -> Generation | None:
    """The generation to publish for `plan`, or None when `previous` already has its layout.

    `lost`: GPUs whose processes are gone (a failure, not a drain): their ranks start afresh if
    the layout keeps the GPU, and a generation that loses one is not planned (`at_step` None):
    its survivors are already out of their collectives. Planned changes (a cordon, a GPU back)
    switch at the first step boundary at or after `at_step`.
    """
    replicas = replicas_of(plan)
    if previous is None:
        return Generation(1, plan.spec.shape, global_batch, plan.spec.mode, replicas, rendezvous)
    if (previous.replicas == replicas and previous.model == plan.spec.shape
            and previous.global_batch == global_batch and previous.mode == plan.spec.mode):
        return None
    lost = frozenset(lost) & frozenset(previous.gpus)
    successor = next_generation(previous, replicas, lost, None if lost else at_step)
    return replace(successor, model=plan.spec.shape, global_batch=global_batch,
                   mode=plan.spec.mode)
