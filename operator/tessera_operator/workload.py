"""What a job runs, as API objects (pure): where its trainer pods go, and the pods themselves.

The operator owns every object a job needs to train, each controlled by the job (the garbage
collector removes them with it) under a name derived from the job's:

- `<job>-trainer`: the trainer pods' ServiceAccount, and a Role + RoleBinding that let it read
  the job's layout ConfigMap and patch its progress ConfigMap, nothing else;
- `<job>-progress`: the ConfigMap the node agents report into (one key per node);
- `<job>-rendezvous`: a pod that hosts the job's TCPStore (`ntp.rendezvous`); its pod IP, read
  from the API (no DNS is assumed), goes into every generation document;
- `<job>-node-<i>`: one trainer pod per node (`ntp.nodeagent.agent`), asking for all `gpusPerNode`
  GPUs of the node it is placed on (the extended resource, or the template's claim that
  `gpuResourceClaim` names).

Placement is the set of trainer pods: each one names its node (node affinity on the node's
name, as the DaemonSet controller pins its pods; the scheduler still binds it, checking the
GPUs are free), so once placed a job keeps its nodes however the operator restarts. Nodes are
chosen by `place`: free GPUs and scale-up domain.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera_contracts.api import ATTEMPT_LABEL, INPUTS_ANNOTATION, JOB_LABEL, ROLE_LABEL
from tessera_contracts.generation import (
    Generation,
    Gpu,
    Rendezvous,
    layout_configmap,
    next_generation,
)
from tessera_contracts.invocation import AgentInvocation, InvocationError
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.progress import progress_configmap as progress_name
from tessera_operator.planner import JobPlan, JobSpec, Problem

GPU_RESOURCE = "nvidia.com/gpu"
# On a trainer pod that holds its GPUs through a claim: how many, for placement's count of the
# GPUs taken on its node (the pod asks for no extended resource).
CLAIMED_GPUS_ANNOTATION = "tessera.dev/claimed-gpus"
TRAINER, RENDEZVOUS = "trainer", "rendezvous"
FINISHED = ("Succeeded", "Failed")  # pod phases that hold no GPU
RENDEZVOUS_PORT = 29400
METRICS_PORT = 9300
_TRAINER_POD = re.compile(r"-node-(\d+)$")
# The trainers' shared memory, unless the template mounts its own at SHM_PATH.
SHM_VOLUME, SHM_PATH = "tessera-shm", "/dev/shm"
# The spec fields a pod is made from (`pod_inputs`).
POD_INPUTS = ("image", "command", "args", "steps", "checkpointPolicy", "data", "initialWeights",
              "precision", "microBatchSize", "activationCheckpointing", "optimizer", "eval",
              "template", "gpuResourceClaim")
# What the rendezvous pod takes of the template's pod spec.
RENDEZVOUS_FIELDS = ("nodeSelector", "tolerations", "priorityClassName", "schedulerName",
                     "imagePullSecrets", "securityContext")


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
    gpus: int  # allocatable GPUs


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


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """The GPUs a pod asks for: the extended resource, else those a trainer pod of the
    operator's holds through its claim."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        asked = (resources.get("limits") or {}).get(GPU_RESOURCE) or (
            resources.get("requests") or {}).get(GPU_RESOURCE)
        total += _gpus(asked or 0)
    claimed = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        CLAIMED_GPUS_ANNOTATION)
    return total or _gpus(claimed or 0)


def taken_gpus(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per node, the GPUs that running or pending pods (bound, or pinned by name as this
    operator's are) ask for."""
    taken: dict[str, int] = {}
    for pod in pods:
        node = pod_node(pod)
        if node and (pod.get("status") or {}).get("phase") not in FINISHED:
            taken[node] = taken.get(node, 0) + pod_gpus(pod)
    return taken


def node_views(nodes: Iterable[Mapping[str, Any]], taken: Mapping[str, int],
               selector: Mapping[str, str], domain_label: str) -> list[NodeView]:
    """Schedulable nodes matching `selector`, with the GPUs other pods have not `taken`."""
    views = []
    for node in nodes:
        meta, spec = node["metadata"], node.get("spec") or {}
        labels = meta.get("labels") or {}
        if spec.get("unschedulable") or any(labels.get(k) != v for k, v in selector.items()):
            continue
        allocatable = _gpus(((node.get("status") or {}).get("allocatable") or {}).get(
            GPU_RESOURCE, 0))
        views.append(NodeView(meta["name"], labels.get(domain_label) or meta["name"],
                              allocatable - taken.get(meta["name"], 0), allocatable))
    return views


def place(spec: JobSpec, nodes: int, candidates: Sequence[NodeView], fewest: int | None = None
          ) -> tuple[str, ...] | Problem:
    """`nodes` nodes for the job, whole TP groups inside scale-up domains; or why not. With
    `fewest`, as many as it finds up to `nodes`, and at least `fewest`.

    A job takes whole nodes: each with exactly gpusPerNode GPUs, none of them asked for by
    another pod. Its plan, cordons, health and power target all name a node's GPUs by index
    0..gpusPerNode-1, and a node has one power target: a job sharing a node with another
    would act on GPUs the kubelet gave to the other.
    Domains with the most usable nodes go first (a job spreads over as few NVLink domains as
    it can), and from a domain only as many nodes as make whole TP groups are taken when a
    group spans nodes; within a domain, nodes by name, so placement is reproducible.
    """
    usable = [n for n in candidates if n.gpus == n.free_gpus == spec.gpus_per_node]
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
    least = nodes if fewest is None else fewest
    if len(chosen) < least:
        return Problem("Unschedulable", (
            f"needs {least} whole nodes with {spec.gpus_per_node} {GPU_RESOURCE} each, none "
            f"taken by another pod (whole TP groups of {spec.tp} GPUs inside one scale-up "
            f"domain); found {len(usable)} such nodes of {len(candidates)} matching the job's "
            f"nodeSelector, in {len(domains)} domains"))
    return tuple(chosen)


def until_step(pod: Mapping[str, Any]) -> int | None:
    """The job's last step as a trainer pod's node agent was told it (None: not a trainer pod
    this operator made, or args it cannot read)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == TRAINER:
            try:
                return AgentInvocation.from_args(container.get("args") or []).until_step
            except InvocationError:
                return None
    return None


def steps_told(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any]) -> int | None:
    """The job's last step as its trainer pods among `pods` were all told it: what the ranks in
    force train to, which an edit of spec.steps changes only for the next attempt (None: no
    trainer pod, or pods told different steps)."""
    told = {until_step(pod) for pod in trainer_pods(pods, job)}
    return told.pop() if len(told) == 1 else None


def trainer_pods(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any]
                 ) -> list[Mapping[str, Any]]:
    """The pods among `pods` that are trainer pods of `job`."""
    return [pod for pod in pods if controlled_by(pod, job) and (
        (pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == TRAINER]


def is_trainer(pod: Mapping[str, Any]) -> bool:
    """A trainer pod of any of the operator's jobs (by its labels)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return JOB_LABEL in labels and labels.get(ROLE_LABEL) == TRAINER


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


def identity(job: Mapping[str, Any], spec: NTPTrainingJobSpec) -> list[dict[str, Any]]:
    """The trainer pods' rights: a Role to read the layout (a watch by name) and patch the
    progress report, nothing else, bound to their ServiceAccount; that account too unless the
    template names its own."""
    name, jobname = identity_name(job["metadata"]["name"]), job["metadata"]["name"]
    account = service_account(job, spec)
    own = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name)}] \
        if account == name else []
    return [
        *own,
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
         "subjects": [{"kind": "ServiceAccount", "name": account,
                       "namespace": job["metadata"]["namespace"]}]},
    ]


def progress_configmap(job: Mapping[str, Any], attempt: int = 0) -> dict[str, Any]:
    meta = _meta(job, progress_name(job["metadata"]["name"]))
    meta["labels"][ATTEMPT_LABEL] = str(attempt)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {}}


def template(spec: NTPTrainingJobSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spec's pod template: its metadata and its pod spec (copies)."""
    tpl = spec.template
    return (copy.deepcopy(dict(tpl.get("metadata") or {})),
            copy.deepcopy(dict(tpl.get("spec") or {})))


def node_selector(spec: NTPTrainingJobSpec) -> dict[str, str]:
    """The labels every node of the job must carry (the template's nodeSelector)."""
    return dict(template(spec)[1].get("nodeSelector") or {})


def service_account(job: Mapping[str, Any], spec: NTPTrainingJobSpec) -> str:
    """The trainer pods' identity: the template's, else the one the operator makes."""
    return str((spec.template.get("spec") or {}).get("serviceAccountName")
               or identity_name(job["metadata"]["name"]))


def pod_inputs(spec: NTPTrainingJobSpec) -> dict[str, str]:
    """A digest of each spec field a pod is made from, as the API server stores it: a running
    pod keeps what it was made with, so a changed one waits for the job's next attempt
    (`outdated`)."""
    stored = spec.to_spec()
    return {name: hashlib.sha256(json.dumps(stored.get(name), sort_keys=True).encode())
            .hexdigest()[:16] for name in POD_INPUTS}


def outdated(pod: Mapping[str, Any], spec: NTPTrainingJobSpec) -> list[str]:
    """The spec fields whose value `pod` was not made with (all of them for a pod that does
    not say)."""
    try:
        made = json.loads(((pod.get("metadata") or {}).get("annotations") or {})[
            INPUTS_ANNOTATION])
    except (KeyError, TypeError, ValueError):
        made = {}
    wanted = pod_inputs(spec)
    return [name for name in POD_INPUTS if not isinstance(made, dict)
            or made.get(name) != wanted[name]]


def attempt_of(obj: Mapping[str, Any]) -> int | None:
    """The attempt an object of the job belongs to (its label); None when it has none."""
    try:
        return int(((obj.get("metadata") or {}).get("labels") or {})[ATTEMPT_LABEL])
    except (KeyError, TypeError, ValueError):
        return None


def _env(container: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The operator's variables first, so the user's may refer to them as $(NODE_NAME)."""
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    own = [{"name": "NODE_NAME"} | field("spec.nodeName"),
           {"name": "POD_IP"} | field("status.podIP"),
           {"name": "POD_NAMESPACE"} | field("metadata.namespace")]
    return own + list(container.get("env") or [])


def _labelled(job: Mapping[str, Any], name: str, role: str, attempt: int,
              labels: Mapping[str, str]) -> dict[str, Any]:
    meta = _meta(job, name, role)
    meta["labels"] = dict(labels) | meta["labels"] | {ATTEMPT_LABEL: str(attempt)}
    return meta


def trainer_pod(job: Mapping[str, Any], spec: NTPTrainingJobSpec, index: int, node: str,
                attempt: int = 0) -> dict[str, Any]:
    """The node agent on `node`, with every GPU of the node: it runs one rank per GPU the
    current generation gives it; the template merged around it (docs/jobapi.md).

    Container args: the agent's invocation (the job, its steps in all), then `--`, then the
    trainer options for every rank: `rank_args`, the spec's `args`. A memory-backed /dev/shm
    unless the template mounts one (the data loaders' and NCCL's shared memory)."""
    name = job["metadata"]["name"]
    tmeta, pod_spec = template(spec)
    containers = list(pod_spec.get("containers") or [])
    own = next((c for c in containers if c.get("name") == TRAINER), {})
    sidecars = [c for c in containers if c.get("name") != TRAINER]
    resources = gpu_resources(own, spec)
    agent = AgentInvocation(until_step=spec.steps, job=name,
                            trainer_args=(*rank_args(spec), *(spec.args or ())))
    mounts = list(own.get("volumeMounts") or [])
    volumes = list(pod_spec.get("volumes") or [])
    if not any(m.get("mountPath", "").rstrip("/") == SHM_PATH for m in mounts):
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    container = own | {
        "name": TRAINER, "image": spec.image, "args": agent.to_args(), "env": _env(own),
        "resources": resources, "volumeMounts": mounts,
        "ports": [*(own.get("ports") or []), {"name": "metrics", "containerPort": METRICS_PORT}],
    }
    if spec.command:
        container["command"] = list(spec.command)
    meta = _labelled(job, trainer_name(name, index), TRAINER, attempt, tmeta.get("labels") or {})
    meta["annotations"] = dict(tmeta.get("annotations") or {}) | {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
        INPUTS_ANNOTATION: json.dumps(pod_inputs(spec), sort_keys=True)}
    if spec.gpu_resource_claim is not None:
        meta["annotations"][CLAIMED_GPUS_ANNOTATION] = str(spec.gpus_per_node)
    affinity = dict(pod_spec.get("affinity") or {}) | _pinned(node)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec | {
        "serviceAccountName": service_account(job, spec),
        # A failed trainer restarts the whole job from its checkpoint (the operator's
        # restart budget), never alone: its ranks cannot rejoin running collectives.
        "restartPolicy": "Never",
        "affinity": affinity, "volumes": volumes, "containers": [container, *sidecars]}}


def gpu_resources(own: Mapping[str, Any], spec: NTPTrainingJobSpec) -> dict[str, Any]:
    """The trainer container's resources: the template's, with the node's GPUs asked for as
    the extended resource, or through the pod's claim `gpuResourceClaim` names (DRA,
    docs/dra.md), which the container then names too."""
    resources = {k: dict(v) if k in ("requests", "limits") else v
                 for k, v in (own.get("resources") or {}).items()}
    claim = spec.gpu_resource_claim
    if claim is not None:
        claims = list(resources.get("claims") or [])
        if not any(c.get("name") == claim for c in claims):
            resources["claims"] = [*claims, {"name": claim}]
        return resources
    gpus = str(spec.gpus_per_node)
    resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    if "requests" in resources:
        resources["requests"][GPU_RESOURCE] = gpus
    return resources


def rank_args(spec: NTPTrainingJobSpec) -> list[str]:
    """Trainer options every rank gets from the spec: checkpoints where the job keeps them, the
    weights it starts from, the dataset it reads, its precision, micro-batches, activation
    checkpointing, the optimizer and its schedule (its state sharded across replicas when
    the spec says so), the evaluation (`spec.args` come after them, and so win over them)."""
    args: list[str] = []
    checkpoint = spec.checkpoint_policy
    if checkpoint.path:
        args += ["--save", checkpoint.path, "--resume",
                 "--save-every", str(checkpoint.interval_steps), "--keep", str(checkpoint.keep)]
    if spec.initial_weights:
        args += ["--init", spec.initial_weights]
    if spec.data is not None:
        args += ["--data", spec.data.path]
        if spec.data.tokenizer:
            args += ["--tokenizer", spec.data.tokenizer]
    args += ["--precision", spec.precision]
    if spec.micro_batch_size is not None:
        args += ["--micro-batch-size", str(spec.micro_batch_size)]
    recompute, optimizer = spec.activation_checkpointing, spec.optimizer
    schedule = optimizer.schedule
    args += ["--activation-checkpointing", recompute.mode,
             "--activation-checkpointing-every", str(recompute.every),
             "--lr", str(optimizer.learning_rate), "--weight-decay", str(optimizer.weight_decay),
             "--lr-schedule", schedule.type, "--warmup-steps", str(schedule.warmup_steps),
             "--decay-steps", str(schedule.decay_steps),
             "--min-lr-ratio", str(schedule.min_ratio)]
    if optimizer.weight_decay_all:
        args.append("--weight-decay-all")
    if optimizer.sharded_state:
        args.append("--sharded-state")
    if spec.eval is not None:
        args += ["--eval-every", str(spec.eval.every_steps),
                 "--eval-samples", str(spec.eval.samples)]
    return args


def rendezvous_pod(job: Mapping[str, Any], spec: NTPTrainingJobSpec, attempt: int = 0
                   ) -> dict[str, Any]:
    """The job's TCPStore host: no GPU, no API access, no privilege; from the template only
    what places it and lets it start (node selector, tolerations, priority, scheduler, pull
    secrets, the pod's security context), so it lands where the trainers may and passes the
    same Pod Security level. No pod affinity: a rule written for the trainers could keep it
    from any node, or a trainer from its own."""
    name = job["metadata"]["name"]
    tmeta, pod_spec = template(spec)
    kept = {k: pod_spec[k] for k in RENDEZVOUS_FIELDS if k in pod_spec}
    container = {"name": RENDEZVOUS, "image": spec.image,
                 "command": ["python", "-m", "ntp.rendezvous"],
                 # Its pod IP only: pods that share the host's network (hostNetwork, the
                 # local cluster's simulated nodes) then never share the store's port.
                 "args": ["--host", "$(POD_IP)", "--port", str(RENDEZVOUS_PORT)],
                 "env": [{"name": "POD_IP",
                          "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                 "ports": [{"name": "store", "containerPort": RENDEZVOUS_PORT}],
                 "securityContext": {"allowPrivilegeEscalation": False,
                                     "capabilities": {"drop": ["ALL"]}}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _labelled(job, rendezvous_name(name), RENDEZVOUS, attempt,
                                  tmeta.get("labels") or {}),
            "spec": kept | {
                "serviceAccountName": service_account(job, spec),
                "automountServiceAccountToken": False,
                "restartPolicy": "Always", "containers": [container]}}


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

    `lost`: GPUs whose processes are gone (a failure, not a drain): a generation that loses one
    is not planned (`at_step` None): its survivors are already out of their collectives. It keeps
    the plan's replicas the survivors form alone, where there are any: the others (a spare, a
    lost GPU's rank started afresh) come in the planned generation after it, so that no survivor
    waits for a process to start. Planned changes (a cordon, a GPU back) switch at the first
    step boundary at or after `at_step` where the processes they add have come.
    """
    replicas = replicas_of(plan)
    if previous is None:
        return Generation(1, plan.spec.shape, global_batch, plan.spec.mode, replicas, rendezvous)
    lost = frozenset(lost) & frozenset(previous.gpus)
    survivors = frozenset(previous.gpus) - lost
    if lost and (formed := tuple(r for r in replicas if survivors.issuperset(r))):
        replicas = formed
    if (previous.replicas == replicas and previous.model == plan.spec.shape
            and previous.global_batch == global_batch and previous.mode == plan.spec.mode):
        return None
    successor = next_generation(previous, replicas, lost, None if lost else at_step)
    return replace(successor, model=plan.spec.shape, global_batch=global_batch,
                   mode=plan.spec.mode)
