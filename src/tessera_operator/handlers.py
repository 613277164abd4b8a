"""kopf handlers: reconcile each NTPTrainingJob from what is observed, level-triggered.

Every trigger (the job created, changed or resumed; one of its pods changing phase or address;
a node agent's progress report; a change to one of its nodes' labels, GPUs or cordons; an agent
reporting a cut in effect while a raise waits for it; the slow resync timer) runs the same
`reconcile(namespace, name)`, which never asks which event arrived: observe the job, its pods,
its nodes and its layout ConfigMap -> place it if it has no nodes yet and create what it runs
(`workload`) -> plan (pure) -> publish the next generation document if the layout changed, sync
the power targets (written only when they change) -> rebuild the status. Reconciles of one job
are serialised by a lock, so the watches and the job handlers can call it concurrently. A job's
nodes are those its trainer pods are placed on (`workload.placed_nodes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes import utils as kube_utils
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tessera_contracts import api, progress
from tessera_contracts.generation import (
    LAYOUT_KEY,
    Generation,
    GenerationError,
    Gpu,
    Rendezvous,
    layout_configmap,
)
from tessera_contracts.powertarget import (
    InvalidTarget,
    PowerTarget,
    format_time,
    parse_object,
    reported_limits,
)
from tessera_operator import conditions, health, planner, power_targets, workload
from tessera_operator.workload import JOB_LABEL

GROUP, VERSION, PLURAL = "tessera.dev", "v1alpha1", "ntptrainingjobs"
CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server's limit on a ConfigMap's data
# Watches drive every change; the timer only re-observes what a watch or a failed reconcile may
# have missed. Its cost is six reads per job per interval (five without a power policy),
# whatever the number of nodes.
RESYNC_INTERVAL_S = 300.0
API_TIMEOUT_S = 10.0
RETRY_DELAY_S = 5.0

Clock = Callable[[], datetime]
JobKey = tuple[str, str]


def api_client() -> client.ApiClient:
    """In the cluster: the pod's service account; elsewhere $KUBECONFIG (as kopf logs in)."""
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # One operator replica (a Deployment with Recreate), so no peering objects to keep.
    settings.peering.standalone = True
    # Our CRDs exist before the operator starts: no need to list CRDs and namespaces (which
    # least privilege does not grant) to discover resources appearing later.
    settings.scanning.disabled = True
    # Idle watches can go silent without an error: make the server end them, and re-list.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    # Only the jobs' own pods and ConfigMaps stream to the operator (filtered by the API server,
    # not here): a large cluster's other pods would otherwise each cost an event.
    for plural in ("pods", "configmaps"):
        settings.watching.label_selectors["", "v1", plural] = JOB_LABEL
    # Events come from our decisions; kopf's own log lines become events only when they warn.
    settings.posting.level = logging.WARNING
    # Keep kopf's bookkeeping in annotations under our own prefix, never in the pruned status.
    settings.persistence.finalizer = "tessera.dev/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tessera.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tessera.dev")
    memo.setdefault("api", api_client())
    memo.setdefault("clock", lambda: datetime.now(UTC))
    memo.setdefault("namespaces", None)  # the namespaces watched; None: all
    memo.locks = defaultdict(threading.Lock)
    memo.locks_guard = threading.Lock()  # guards locks, pending and nodes
    memo.placing = threading.Lock()  # one job's placement at a time
    memo.pending = set()  # jobs with a watch-triggered reconcile that has not started yet
    memo.nodes = {}  # node name -> (resourceVersion, what placement and health read of it)
    memo.node_jobs = defaultdict(set)  # node name -> keys of the jobs placed on it
    memo.unplaced = set()  # jobs waiting for nodes: any node change may let them be placed
    memo.pods = {}  # (namespace, pod) -> (phase, pod IP) last seen, for the jobs' pods
    memo.gpu_health = {}  # node name -> (its GPUHealth as last seen, what triggers a re-plan)
    memo.jobs = {}  # job UID -> job key, for the power targets that name their job by UID
    memo.held = set()  # jobs with power raises waiting for cuts to be reported in effect


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    memo.api.close()


# ----------------------------------------------------------------------------------------------
# Triggers
# ----------------------------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
def on_job(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    _retrying(lambda: reconcile(memo, namespace, name, logger))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_job_deleted(
    namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
    **_: Any,
) -> None:
    """The trainer is gone: its power targets are deleted, and each agent settles its GPUs at
    the base cap inside its last budget share. A finalizer holds the job until this ran, since
    the garbage collector cannot delete cluster-scoped targets for a namespaced owner."""
    # After any reconcile in flight: one that read the job before its deletion could otherwise
    # write a target after this released them (reconciles that start later see the deletion).
    with _lock(memo, (namespace, name)):
        _retrying(lambda: _sync_power(memo.api, dict(body), {}))
    logger.info(f"released the power targets of {namespace}/{name}")
    with memo.locks_guard:
        memo.locks.pop((namespace, name), None)
        memo.jobs.pop(body.metadata.uid, None)
        memo.held.discard((namespace, name))
        memo.unplaced.discard((namespace, name))
        for jobs in memo.node_jobs.values():
            jobs.discard((namespace, name))


@kopf.on.event("", "v1", "nodes")
async def on_node(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Reconcile the jobs placed on a node when what they read of it changes (labels, GPU
    capacity, cordons, schedulability), and the jobs waiting for nodes; other node updates
    (heartbeats, conditions) are ignored.

    The comparison runs on the event loop, only a reconcile in a thread: a storm of irrelevant
    node updates (a thousand nodes marked unreachable at once) then costs no thread hand-off
    each, and a cordon behind it waits for little more than its own reconcile."""
    name = body.metadata.name
    version = _version(body)
    seen = None if type == "DELETED" else _node_facts(body)
    with memo.locks_guard:
        before_version, before = memo.nodes.get(name, (None, None))
        if version is not None and before_version is not None and version < before_version:
            return  # older than what a reconcile read from the API meanwhile
        memo.nodes.pop(name, None)
        if seen is not None:
            memo.nodes[name] = (version, seen)
        if seen == before:
            return
        keys = set(memo.node_jobs.get(name, ())) | set(memo.unplaced)
    for key in keys:
        await asyncio.to_thread(_reconcile_once, memo, key, logger)


def _node_facts(node: Mapping[str, Any]) -> tuple[Any, ...]:
    """What placement and health read of a node (a watch event's body or an API read)."""
    meta = node["metadata"]
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return (dict(meta.get("labels") or {}),
            (meta.get("annotations") or {}).get(api.CORDON_ANNOTATION),
            allocatable.get(workload.GPU_RESOURCE),
            bool((node.get("spec") or {}).get("unschedulable")), health.node_lost(node))


def _version(node: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as a number, to tell a watch event older than an API read.
    The API server's are etcd revisions, which only grow; one that is not a number (another
    storage) is not compared, and the event is taken as it comes."""
    version = node["metadata"].get("resourceVersion")
    return int(version) if isinstance(version, str) and version.isdecimal() else None


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
async def on_pod(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Reconcile a job when one of its pods gets an address (the rendezvous: generation 1
    can be published), ends, or disappears."""
    key = (body.metadata.namespace, (body.metadata.labels or {})[JOB_LABEL])
    status = body.get("status") or {}
    seen = None if type == "DELETED" else (status.get("phase"), status.get("podIP"))
    pod_key = (body.metadata.namespace, body.metadata.name)
    with memo.locks_guard:
        before = memo.pods.pop(pod_key, None)
        if seen is not None:
            memo.pods[pod_key] = seen
    if seen != before:
        await asyncio.to_thread(_reconcile_once, memo, key, logger)


@kopf.on.event("", "v1", "configmaps", labels={JOB_LABEL: kopf.PRESENT},
               when=lambda name, **_: str(name).endswith("-progress"))
async def on_progress(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """A node agent reported: the job's phase, step and goodput follow."""
    key = (body.metadata.namespace, (body.metadata.labels or {})[JOB_LABEL])
    await asyncio.to_thread(_reconcile_once, memo, key, logger)


@kopf.on.event(GROUP, VERSION, "gpuhealths")
async def on_gpu_health(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Keep each node's GPU health as its agent last published it; reconcile the jobs on the
    node when a GPU's state or XIDs change (not on the periodic refresh that only says the
    object is current)."""
    name = body.metadata.name
    obj = None if type == "DELETED" else {"metadata": {"name": name},
                                          "status": dict(body.get("status") or {})}
    facts = None if obj is None else [(g.get("index"), g.get("state"), g.get("xids"))
                                      for g in obj["status"].get("gpus") or []]
    with memo.locks_guard:
        before = memo.gpu_health.pop(name, (None, None))[1]
        if obj is not None:
            memo.gpu_health[name] = (obj, facts)
        keys = set(memo.node_jobs.get(name, ())) if facts != before else set()
    for key in keys:
        await asyncio.to_thread(_reconcile_once, memo, key, logger)


@kopf.on.event(GROUP, VERSION, "gpupowertargets")
async def on_power_target(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Reconcile the job of a target whose raise waits for cuts, when an agent reports one in
    effect; and a job whose target someone else deleted. Our own writes trigger nothing more."""
    uid = (body.metadata.labels or {}).get(power_targets.JOB_UID_LABEL)
    with memo.locks_guard:
        key = memo.jobs.get(uid)
        wanted = key is not None and (key in memo.held or type == "DELETED")
    if wanted:
        await asyncio.to_thread(_reconcile_once, memo, key, logger)


def _reconcile_once(memo: kopf.Memo, key: JobKey, logger: logging.Logger) -> None:
    """A watch-triggered reconcile, unless one for the job is already waiting to start.

    Watch events come in storms (every node of a job at startup, a rack losing power): a change
    that arrives while a reconcile of its job is still waiting to start is covered by that one.
    """
    with memo.locks_guard:
        if key in memo.pending or not _watched(memo, key):
            return
        memo.pending.add(key)
    try:
        reconcile(memo, *key, logger)
    except (ApiException, HTTPError) as exc:
        # The job's resync timer runs the same reconcile within RESYNC_INTERVAL_S.
        logger.warning(f"reconcile of {key[0]}/{key[1]} after a watch event failed: {exc}")


def _watched(memo: kopf.Memo, key: JobKey) -> bool:
    return memo.namespaces is None or key[0] in memo.namespaces


def _retrying(action: Callable[[], None]) -> None:
    try:
        action()
    except ApiException as exc:
        raise kopf.TemporaryError(f"API server answered {exc.status}: {exc.reason}",
                                  delay=RETRY_DELAY_S) from exc
    except HTTPError as exc:
        raise kopf.TemporaryError(f"API server unreachable: {exc}", delay=RETRY_DELAY_S) from exc


# ----------------------------------------------------------------------------------------------
# Reconcile
# ----------------------------------------------------------------------------------------------


def _lock(memo: kopf.Memo, key: JobKey) -> threading.Lock:
    with memo.locks_guard:
        return memo.locks[key]


def _get_job(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


@dataclass
class World:
    """What one reconcile observed of a job beyond the job itself."""

    pods: list[dict[str, Any]]
    nodes: list[dict[str, Any]]  # the nodes its trainer pods are placed on
    placed: dict[int, str]  # trainer pod index -> node


def _items(listing: Callable[..., Any], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """A list call's items as the API sends them (plain dicts). The client's models cost
    several times the JSON they come from, and a placement lists every node and pod."""
    response = listing(*args, _preload_content=False, _request_timeout=API_TIMEOUT_S, **kwargs)
    return list(json.loads(response.data)["items"])


def _job_pods(api: client.ApiClient, job: dict[str, Any]) -> list[dict[str, Any]]:
    meta = job["metadata"]
    pods = _items(client.CoreV1Api(api).list_namespaced_pod, meta["namespace"],
                  label_selector=f"{JOB_LABEL}={meta['name']}")
    return [p for p in pods if workload.controlled_by(p, job)]


def _nodes_named(api: client.ApiClient, memo: kopf.Memo, names: list[str]
                 ) -> list[dict[str, Any]]:
    """The nodes as the node watch last saw them (what planning reads of them); a node the
    watch has not delivered yet (just created, or the operator just started) is read from the
    API, and kept, so that the watch's older events of it (its creation, delivered after the
    read) cannot take the plan back to a state the node has left."""
    with memo.locks_guard:
        seen = {n: memo.nodes.get(n, (None, None))[1] for n in names}
    found = []
    for name, facts in seen.items():
        if facts is None:
            try:
                node = api.sanitize_for_serialization(
                    client.CoreV1Api(api).read_node(name, _request_timeout=API_TIMEOUT_S))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue  # gone: its GPUs are not the job's any more
            with memo.locks_guard:  # a watch event that came meanwhile is newer: it stays
                _, facts = memo.nodes.setdefault(name, (_version(node), _node_facts(node)))
        found.append(_node_view(name, facts))
    return found


def _node_view(name: str, facts: tuple[Any, ...]) -> dict[str, Any]:
    labels, cordon, gpus, unschedulable, lost = facts
    ready = {"type": "Ready", "status": "Unknown", "reason": health.NODE_LOST_REASON}
    return {"metadata": {"name": name, "labels": labels,
                         "annotations": {} if cordon is None else {
                             api.CORDON_ANNOTATION: cordon}},
            "spec": {"unschedulable": unschedulable},
            "status": {"allocatable": {} if gpus is None else {workload.GPU_RESOURCE: gpus},
                       "conditions": [ready] if lost else []}}


def _place(api: client.ApiClient, placing: threading.Lock, job: dict[str, Any],
           spec: planner.JobSpec, world: World) -> planner.Problem | None:
    """Choose nodes for the trainer pods the job lacks and create everything it runs;
    nothing when there are not enough nodes (the Problem says why)."""
    count = int(job["spec"]["totalGPUs"]) // spec.gpus_per_node
    missing = [i for i in range(count) if i not in world.placed]
    if not missing:
        return None
    core = client.CoreV1Api(api)
    selector = dict(job["spec"].get("nodeSelector") or {})
    # One placement at a time: another job's, listing the pods before this one's exist, would
    # choose the same free GPUs (and its pods would stay Pending).
    with placing:
        nodes = _items(core.list_node,
                       label_selector=",".join(f"{k}={v}" for k, v in selector.items()))
        pods = _items(core.list_pod_for_all_namespaces,
                      field_selector="status.phase!=Succeeded,status.phase!=Failed")
        views = [v for v in workload.node_views(nodes, pods, selector, spec.domain_label)
                 if v.name not in world.placed.values()]
        chosen = workload.place(spec, len(missing), views)
        if isinstance(chosen, planner.Problem):
            return chosen
        for obj in [*workload.identity(job), workload.progress_configmap(job),
                    workload.rendezvous_pod(job),
                    *(workload.trainer_pod(job, i, n)
                      for i, n in zip(missing, chosen, strict=True))]:
            _create(api, obj)
    world.placed |= dict(zip(missing, chosen, strict=True))
    world.nodes = [n for n in nodes if n["metadata"]["name"] in world.placed.values()]
    return None


def _create(api: client.ApiClient, obj: dict[str, Any]) -> None:
    """Create a child under its deterministic name; one that exists is left as it is (none of
    them changes once made: a pod's spec is immutable, the others hold no state)."""
    try:
        # Under the placement lock: a stalled server must not hold every job's placement.
        kube_utils.create_from_dict(api, obj, namespace=obj["metadata"]["namespace"],
                                    _request_timeout=API_TIMEOUT_S)
    except kube_utils.FailToCreateError as exc:
        if any(e.status != 409 for e in exc.api_exceptions):
            raise exc.api_exceptions[0] from None


def _health(memo: kopf.Memo, job: dict[str, Any], spec: planner.JobSpec, world: World,
            in_force: Generation | None) -> tuple[health.Health, health.Health]:
    """The job's GPU health from its sources, merged (GPUs of unknown health held where the
    generation `in_force` has them), and the part lost under their processes rather than
    drained: the GPUs of nodes that stopped reporting, and those DCGM failed."""
    policy = job["spec"].get("failurePolicy") or {}
    sources = set(policy.get("healthSources", ("dcgm", "cordon")))
    placed = sorted(set(world.placed.values()))
    lost = health.from_lost_nodes(world.nodes, spec.gpus_per_node, placed=placed,
                                  leaving=workload.leaving_nodes(world.pods, job))
    signal = health.from_cordons(world.nodes, spec.gpus_per_node) if "cordon" in sources \
        else health.Health()
    signal = signal.merge(lost)
    if "dcgm" not in sources:
        return signal, lost
    nodes = sorted({n["metadata"]["name"] for n in world.nodes})
    with memo.locks_guard:
        objects = [memo.gpu_health[n][0] for n in nodes if n in memo.gpu_health]
    dcgm = health.from_gpu_health(objects, spec.gpus_per_node, policy.get("fatalXIDs"),
                                  now=memo.clock().timestamp(), nodes=nodes)
    kept = None if in_force is None else [(g.node, g.index) for g in in_force.gpus]
    reporting = [o["metadata"]["name"] for o in objects]
    return health.hold_unknown(signal.merge(dcgm), kept, reporting), lost.merge(dcgm)


def _observe(
    api: client.ApiClient, memo: kopf.Memo, job: dict[str, Any], world: World,
    in_force: Generation | None,
) -> tuple[planner.JobPlan | None, tuple[planner.Problem, ...], health.Health, health.Health]:
    """The plan for the world as it is (`in_force`: the generation published), or why there is
    none; plus the health it read (all sources, and the GPUs lost under their processes)."""
    try:
        spec = planner.JobSpec.from_spec(job["spec"])
    except planner.SpecError as exc:
        return None, (planner.Problem("InvalidSpec", str(exc)),), health.Health(), health.Health()
    if spec.pp > 1:
        return None, (planner.Problem("PipelineParallelNotSupported", (
            f"pipelineParallelSize {spec.pp}: the trainer runs tensor and data parallelism "
            "only; set it to 1")),), health.Health(), health.Health()
    problem = _place(api, memo.placing, job, spec, world)
    if problem is not None:
        return None, (problem,), health.Health(), health.Health()
    signal, lost = _health(memo, job, spec, world, in_force)
    plan = planner.plan(spec, planner.node_domains(world.nodes, spec.domain_label), signal.failed)
    return plan, plan.problems, signal, lost


class LayoutBlocked(Exception):
    """The layout document cannot be published; `reason` is the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _read_layout(api: client.ApiClient, job: dict[str, Any]
                 ) -> tuple[client.V1ConfigMap | None, Generation | None]:
    """The layout ConfigMap and the generation it holds (None: none yet, or unreadable).

    LayoutBlocked when a ConfigMap of that name exists that this job does not control (someone
    else's data is never overwritten nor adopted: an ownerReference would have the garbage
    collector delete it with the job)."""
    meta = job["metadata"]
    name = layout_configmap(meta["name"])
    try:
        current = client.CoreV1Api(api).read_namespaced_config_map(
            name, meta["namespace"], _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None, None
    if not workload.controlled_by(api.sanitize_for_serialization(current), job):
        raise LayoutBlocked("LayoutNotOwned", (
            f"ConfigMap {name} exists and is not controlled by this job; the layout is not "
            f"published until it is removed or the job renamed"))
    try:
        return current, Generation.from_dict(json.loads((current.data or {})[LAYOUT_KEY]))
    except (KeyError, ValueError, GenerationError):
        return current, None  # someone broke it: a new generation replaces it


def _write_layout(api: client.ApiClient, job: dict[str, Any], current: client.V1ConfigMap | None,
                  generation: Generation) -> None:
    """Publish `generation` (LayoutTooLarge when it outgrows a ConfigMap)."""
    meta = job["metadata"]
    # Compact: 32,768 GPUs (the paper's job, short node names) take about 650 kB.
    data = json.dumps(generation.to_dict(), separators=(",", ":"))
    size = len(LAYOUT_KEY) + len(data.encode())
    if size > CONFIGMAP_MAX_BYTES:
        raise LayoutBlocked("LayoutTooLarge", (
            f"the layout document takes {size} bytes, more than a ConfigMap holds "
            f"({CONFIGMAP_MAX_BYTES}): fewer GPUs per job, or shorter node names"))
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": layout_configmap(meta["name"]),
                         "labels": {JOB_LABEL: meta["name"]},
                         "ownerReferences": [workload.owner(job)]},
            "data": {LAYOUT_KEY: data}}
    core = client.CoreV1Api(api)
    if current is None:
        # Created, not applied: an apply would take over a ConfigMap someone made meanwhile
        # (the create fails instead, and the retry finds it is not the job's).
        core.create_namespaced_config_map(meta["namespace"], body,
                                          field_manager=power_targets.FIELD_MANAGER,
                                          _request_timeout=API_TIMEOUT_S)
    else:
        # resourceVersion: a concurrent writer makes this fail (409) and the retry re-observes.
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        core.patch_namespaced_config_map(
            body["metadata"]["name"], meta["namespace"], body,
            field_manager=power_targets.FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=API_TIMEOUT_S)


def _rendezvous(job: dict[str, Any], pods: list[dict[str, Any]]) -> Rendezvous | None:
    name = workload.rendezvous_name(job["metadata"]["name"])
    for pod in pods:
        if pod["metadata"]["name"] == name and (ip := (pod.get("status") or {}).get("podIP")):
            return Rendezvous(ip, workload.RENDEZVOUS_PORT)
    return None


def _reports(api: client.ApiClient, job: dict[str, Any]) -> dict[str, str]:
    """The node agents' progress reports as the ConfigMap holds them (node key -> JSON)."""
    meta = job["metadata"]
    try:
        cm = client.CoreV1Api(api).read_namespaced_config_map(
            progress.progress_configmap(meta["name"]), meta["namespace"],
            _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return {}
    return dict(cm.data or {})


def _publish(api: client.ApiClient, job: dict[str, Any], plan: planner.JobPlan,
             world: World, step: int, lost: frozenset[tuple[str, int]],
             layout: tuple[client.V1ConfigMap | None, Generation | None]) -> Generation | None:
    """Publish the generation the plan asks for, once the rendezvous has an address (planned
    changes at `step`, the last one reported; `lost`: GPUs whose processes died with them;
    `layout`: the ConfigMap as read, and its generation); returns the generation in force."""
    current, previous = layout
    published = int((job.get("status") or {}).get("layoutGeneration", 0))
    if previous is None and published:
        raise LayoutBlocked("LayoutLost", (
            f"ConfigMap {layout_configmap(job['metadata']['name'])} no longer holds "
            f"generation {published} (deleted or changed by someone else): the running trainers "
            "cannot follow a layout derived from nothing. Restore it, or delete the job's "
            "trainer pods and the ConfigMap's data to restart from generation 1"))
    rendezvous = _rendezvous(job, world.pods)
    if previous is None and rendezvous is None:
        return None  # its pod has no address yet; the pod's watch brings the job back
    batch = int(job["spec"].get("globalBatch", workload.DEFAULT_GLOBAL_BATCH))
    following = workload.generation_for(plan, batch, rendezvous or previous.rendezvous,
                                         previous, [Gpu(n, i) for n, i in lost], at_step=step)
    if following is None:
        return previous
    _write_layout(api, job, current, following)
    return following


def reconcile(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger) -> None:
    """Bring the job's workload, layout, power targets and status in line with the world."""
    with _lock(memo, (namespace, name)):
        with memo.locks_guard:
            memo.pending.discard((namespace, name))  # from here on, every change is observed
        api, now = memo.api, memo.clock()
        # 1. Observe the job (gone: nothing to do), its pods and nodes, and plan for them.
        job = _get_job(api, namespace, name)
        if job is None:
            with memo.locks_guard:  # a late watch event of a deleted job: keep no lock for it
                memo.locks.pop((namespace, name), None)
            return
        if job["metadata"].get("deletionTimestamp"):
            return
        previous = job.get("status") or {}
        pods = _job_pods(api, job)
        placed = workload.placed_nodes(pods, job)
        world = World(pods, _nodes_named(api, memo, sorted(set(placed.values()))), placed)
        try:
            layout: tuple[client.V1ConfigMap | None, Generation | None] | LayoutBlocked = \
                _read_layout(api, job)
        except LayoutBlocked as exc:
            layout = exc
        plan, problems, signal, lost = _observe(
            api, memo, job, world, None if isinstance(layout, LayoutBlocked) else layout[1])
        notes = signal.problems
        key = (namespace, name)
        with memo.locks_guard:
            memo.jobs[job["metadata"]["uid"]] = key
            for node in world.placed.values():
                memo.node_jobs[node].add(key)
            if world.placed:
                memo.unplaced.discard(key)
            else:
                memo.unplaced.add(key)
        # 2. Act: the generation document, then the power targets. Without a plan nothing asks
        #    for power any more: the job's targets are released, never left boosted.
        layout_generation = int(previous.get("layoutGeneration", 0))
        targets: dict[str, PowerTarget] = {}
        data = _reports(api, job) if world.placed else {}
        reports = progress.read_reports(data, sorted(set(world.placed.values())))
        step = max((r.step for r in reports.values() if r is not None), default=0)
        in_force: Generation | None = None
        with memo.locks_guard:  # an agent's report arriving once the targets are read is not lost
            memo.held.add(key)
        # The loop's ratio, the parked nodes and the lost GPUs' watts all need the targets as
        # they are; the sync then works from the same list.
        listed = None
        if plan is not None and plan.spec.power is not None:
            listed = power_targets.list_job_targets(api, (JOB_LABEL, name), job["metadata"]["uid"],
                                              API_TIMEOUT_S)
        if plan is not None:
            try:
                current = {obj["metadata"]["name"]: obj for obj in listed or ()}
                racks = {node: rack for node, obj in current.items()
                         if isinstance(spec := obj.get("spec"), dict)
                         and isinstance(rack := spec.get("rack"), str)}
                plan = replace(plan, stuck=_counted_watts(current, lost.failed))
                plan = planner.follow_compute(plan, reports, conditions.boosts(previous), racks)
                targets = plan.power_targets(racks)
                if isinstance(layout, LayoutBlocked):
                    raise layout
                in_force = _publish(api, job, plan, world, step, lost.failed, layout)
                layout_generation = in_force.generation if in_force else layout_generation
            except planner.SpecError as exc:
                plan, problems = None, (planner.Problem("InvalidSpec", str(exc)), *problems)
                targets = {}
            except LayoutBlocked as exc:
                plan, problems = None, (planner.Problem(exc.reason, str(exc)), *problems)
                targets = {}
        held: tuple[str, ...] = ()
        try:
            held = _sync_power(api, job, targets, listed)
        except ApiException as exc:
            if exc.status not in (400, 422):
                raise
            # Refused as invalid: retrying cannot help, the status says why (and the resync
            # timer tries again).
            notes = (*notes, f"power targets refused: {_api_message(exc)}")
        if not held:
            with memo.locks_guard:
                memo.held.discard(key)
        # 3. Status rebuilt from the observation; written only when it differs.
        trained = None if in_force is None else progress.summarize(
            reports, in_force.generation, sorted({g.node for g in in_force.gpus}))
        status = conditions.render(
            plan, problems, previous, now=format_time(now),
            generation=int(job["metadata"].get("generation", 0)),
            layout_generation=layout_generation, notes=notes, held=held,
            trained=trained, pods=_pod_outcome(pods, job))
        if {k: previous.get(k) for k in status} != status:
            client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": status},
                _request_timeout=API_TIMEOUT_S)
        # 4. One event per decision: a new layout, and each condition that changed.
        #    (kopf.event, not kopf.info: posting.level keeps kopf's own chatter out of Events.)
        if layout_generation != int(previous.get("layoutGeneration", 0)) and plan is not None:
            message = f"layout generation {layout_generation}: TP {plan.tp_layout or '-'}"
            kopf.event(job, type="Normal", reason="LayoutChanged", message=message)
            logger.info(message)
        for c in conditions.changed(previous, status):
            bad = (c["type"], c["status"]) in {("Ready", "False"), ("Degraded", "True")}
            kopf.event(job, type="Warning" if bad else "Normal", reason=c["reason"],
                       message=f"{c['type']}={c['status']}: {c['message']}")


def _pod_outcome(pods: list[dict[str, Any]], job: dict[str, Any]) -> conditions.PodOutcome:
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


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def _counted_watts(current: dict[str, dict[str, Any]], lost: frozenset[planner.GpuId]
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


def _sync_power(api: client.ApiClient, job: dict[str, Any], targets: dict[str, PowerTarget],
                listed: list[dict[str, Any]] | None = None) -> tuple[str, ...]:
    """Bring the job's power targets to `targets` (none: release them all), from the targets
    `listed` (None: listed now); returns the nodes not at their target yet, whose raises wait
    for cuts to be reported in effect (an agent's status report then triggers the rest)."""
    result = power_targets.sync_targets(api, list(targets.values()), job_owner=workload.owner(job),
                                  job_label=(JOB_LABEL, job["metadata"]["name"]),
                                  timeout_s=API_TIMEOUT_S, listed=listed)
    return result.held
