"""kopf handlers: each maps an event to the jobs it concerns and reconciles them
(`reconcile.reconcile`); and kopf's indices, which the mapping and the reconciles read.

Triggers: the job seen (created, or listed when the operator starts) or its spec changed, and
its slow resync (`jobqueue.JobQueue.after`); one of its pods changing phase or address (the
rendezvous gets one: generation 1 can be published; a trainer ends) or why it waits to start;
a node agent's progress report; a change to one of its nodes' labels, GPUs, cordons or
schedulability (and any node change for the jobs too few nodes fit); a GPU's state or
XIDs in its nodes' GPUHealth; a device taint on its nodes' GPUs (their ResourceSlices, any
DeviceTaintRule) or a device its pod reports not Healthy; Kueue admitting or evicting
its Workload; a change to one of its children (its
trainer identity, its progress ConfigMap: they converge back); an agent reporting a cut in
effect while a raise waits for it, or a target someone else deleted. Watch-triggered reconciles
go through the job queue (`jobqueue`): one at a time per job, a storm of events covered by one.

Indices (kept by kopf from its watches, complete before any handler runs): jobs by UID, the
jobs by phase (the metrics' gauge), the jobs placed on each node and the GPUs they hold there
(from their trainer pods), each node's GPUHealth (parsed), its GPUs' ResourceSlices and the
DeviceTaintRules (parsed: `dra_health`), and each job's children as
`observed.child_view` sees them. The jobs too few nodes fit are the job queue's
(`JobQueue.wait_for_nodes`), set by their reconcile before it last reads the node cache.
Every handler is a coroutine: kopf runs a plain function in a thread, a hand-off per watch
event that a storm of them (a thousand pods marked not ready) would pay each; only a reconcile
and the writes it does not make go to a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tessera_contracts import api, gpuhealth
from tessera_contracts.api import JOB_LABEL, ROLE_LABEL
from tessera_contracts.dradevice import DRIVER
from tessera_contracts.unreadable import Unreadable
from tessera_operator import (
    apply,
    dra_health,
    lifecycle,
    metrics,
    observe,
    power_targets,
    reconcile,
    workload,
)
from tessera_operator.jobqueue import JobKey
from tessera_operator.kueue_workload import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from tessera_operator.observed import child_view, ours
from tessera_operator.workload import TRAINER

GROUP, VERSION, PLURAL = api.GROUP, api.VERSION, api.JOB_PLURAL
RBAC = "rbac.authorization.k8s.io"
DRA = "resource.k8s.io"
RETRY_DELAY_S = 5.0

JOBS_OWN = {JOB_LABEL: kopf.PRESENT}
TRAINERS = {JOB_LABEL: kopf.PRESENT, ROLE_LABEL: TRAINER}


# ----------------------------------------------------------------------------------------------
# Indices
# ----------------------------------------------------------------------------------------------


@kopf.index(GROUP, VERSION, PLURAL)
async def job_keys(namespace: str, name: str, uid: str, **_: Any) -> dict[str, JobKey]:
    """Job UID -> job, for the power targets, which name their job by UID."""
    return {uid: (namespace, name)}


@kopf.index(GROUP, VERSION, PLURAL)
async def job_phases(namespace: str, name: str, status: kopf.Status, body: kopf.Body, **_: Any
                     ) -> dict[str, JobKey]:
    """Phase -> the operator's jobs in it (none written yet: Pending), for its metrics."""
    return {status.get("phase") or "Pending": (namespace, name)} if ours(body) else {}


@kopf.index("", "v1", "pods", labels=TRAINERS)
async def node_jobs(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
              ) -> dict[str, JobKey]:
    """Node -> the jobs whose trainer pods are placed on it."""
    node = workload.pod_node(body)
    return {} if node is None else {node: (namespace, labels[JOB_LABEL])}


@kopf.index("", "v1", "pods", labels=TRAINERS)
async def held_gpus(body: kopf.Body, status: kopf.Status, **_: Any) -> dict[str, int]:
    """Node -> the GPUs an unfinished trainer pod of the operator's asks for there: placement's
    index of taken GPUs, so it never lists the cluster's pods."""
    node = workload.pod_node(body)
    if node is None or status.get("phase") in workload.FINISHED:
        return {}
    return {node: workload.pod_gpus(body)}


@kopf.index(GROUP, VERSION, "gpuhealths")
async def gpu_health(name: str, status: kopf.Status, **_: Any
                     ) -> dict[str, gpuhealth.PublishedHealth | Unreadable]:
    """Node -> its GPUHealth as its health agent last published it, parsed once as it arrives
    (or why it does not parse)."""
    return {name: gpuhealth.read({"metadata": {"name": name}, "status": dict(status)})}


@kopf.index(DRA, "v1", "resourceslices")
async def resource_slices(spec: kopf.Spec, body: kopf.Body, **_: Any
                          ) -> dict[str, dra_health.SliceView]:
    """Node -> the ResourceSlices of its GPUs' DRA driver, reduced to their device taints."""
    node = spec.get("nodeName")
    return {node: dra_health.read_slice(body)} if node and spec.get("driver") == DRIVER else {}


@kopf.index(DRA, "v1", "devicetaintrules")
async def device_taint_rules(body: kopf.Body, **_: Any
                             ) -> dict[str, dra_health.RuleView | None]:
    """Every DeviceTaintRule, parsed (None: one without a usable taint)."""
    return {observe.RULES: dra_health.read_rule(body)}


@kopf.index("", "v1", "serviceaccounts", labels=JOBS_OWN)
@kopf.index("", "v1", "configmaps", labels=JOBS_OWN)
@kopf.index(RBAC, "v1", "roles", labels=JOBS_OWN)
@kopf.index(RBAC, "v1", "rolebindings", labels=JOBS_OWN)
async def children(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
             ) -> dict[JobKey, dict[str, Any]]:
    """Job -> what the operator sets of each of its children but pods."""
    return {(namespace, labels[JOB_LABEL]): child_view(body)}


# ----------------------------------------------------------------------------------------------
# The job's own events
# ----------------------------------------------------------------------------------------------


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_job(type: str | None, namespace: str, name: str, body: kopf.Body, memo: kopf.Memo,
                 logger: logging.Logger, job_phases: kopf.Index, **indices: Any) -> None:
    """Reconcile a job when it appears (also at the operator's start) or its spec changes
    (`metadata.generation`; our own status writes do not count); release its power targets when
    it is gone. The job carries nothing of kopf's, no diff base, progress annotation nor
    finalizer: an object of any size the API server stores is reconciled and deleted alike, and
    a deletion never waits for the operator."""
    metrics.count_jobs(job_phases)
    key = (namespace, name)
    if type == "DELETED":
        memo.seen.changed(("NTPTrainingJob", namespace, name), None)
        await asyncio.to_thread(_released, memo, key, dict(body), logger)
        return
    if not ours(body):
        return
    if apply.FINALIZER in (body["metadata"].get("finalizers") or ()):
        await asyncio.to_thread(_attempt, lambda: apply.drop_finalizer(memo.api, dict(body)),
                                f"removing the finalizer of job {namespace}/{name}", logger)
    facts = (body["metadata"].get("uid"), body["metadata"].get("generation"))
    if memo.seen.changed(("NTPTrainingJob", namespace, name), facts):
        await _reconcile_soon(memo, key, logger, _indices(indices))


def _released(memo: kopf.Memo, key: JobKey, job: dict[str, Any], logger: logging.Logger) -> None:
    """The job is gone: its power targets are deleted (the garbage collector cannot delete
    cluster-scoped targets for a namespaced owner), and each agent settles its GPUs at the base
    cap inside its last budget share. After any reconcile in flight: one that read the job
    before its deletion could otherwise write a target after this released them."""
    # On failure, the targets' handler deletes those no job owns on their next event, or when
    # the operator starts.
    with memo.queue.running(key):
        if _attempt(lambda: apply.release_power(memo.api, job),
                    f"releasing the power targets of deleted job {key[0]}/{key[1]}", logger):
            logger.info(f"job {key[0]}/{key[1]} deleted; released its power targets")
    memo.queue.forget(key)


def _reconcile(memo: kopf.Memo, key: JobKey, logger: logging.Logger,
               indices: observe.Indices) -> None:
    """Reconcile the job, and again at the time it asks for (its resync, its TTL)."""
    later = reconcile.reconcile(memo, key, logger, indices)
    if later is not None:
        memo.queue.after(key, later, lambda: _reconcile_watched(memo, key, logger, indices))


def _attempt(action: Callable[[], None], what: str, logger: logging.Logger) -> bool:
    """Run an API write that a later event or the operator's restart tries again; a failure
    is logged with the API server's reason."""
    try:
        action()
    except (ApiException, HTTPError) as exc:
        metrics.api_error(exc)
        logger.warning(f"{what} failed: {_reason(exc)}")
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Events of other kinds, mapped to their jobs
# ----------------------------------------------------------------------------------------------


@kopf.on.event("", "v1", "nodes")
async def on_node(type: str, name: str, body: kopf.Body, memo: kopf.Memo,
                  logger: logging.Logger, node_jobs: kopf.Index, **indices: Any) -> None:
    """Reconcile the jobs placed on a node when what they read of it changes (labels, GPU
    capacity, cordons, schedulability), and the jobs too few nodes fit; other node updates
    (heartbeats, conditions) are ignored, and so is an event older than an API read of the
    node (`cache.NodeCache`).

    The comparison runs on the event loop, only a reconcile in a thread: a storm of irrelevant
    node updates (a thousand nodes marked unreachable at once) then costs no thread hand-off
    each, and a cordon behind it waits for little more than its own reconcile."""
    if not memo.nodes.deliver(name, None if type == "DELETED" else body):
        return
    for key in set(node_jobs.get(name, ())) | memo.queue.waiting_for_nodes():
        await _reconcile_soon(memo, key, logger, _indices(indices))


@kopf.on.event("", "v1", "pods", labels=JOBS_OWN)
async def on_pod(type: str, namespace: str, name: str, labels: kopf.Labels,
                 status: kopf.Status, memo: kopf.Memo, logger: logging.Logger,
                 **indices: Any) -> None:
    """Reconcile a job when one of its pods gets an address (the rendezvous: generation 1
    can be published), ends, disappears, reports a device of its claims not Healthy, or waits
    to start for another reason (unschedulable, an image not pulled: the job's PodsStarted says
    so)."""
    waits = lifecycle.waiting({"metadata": {}, "status": dict(status)})
    facts = None if type == "DELETED" else (status.get("phase"), status.get("podIP"),
                                            _resource_health(status), waits and waits[0])
    if memo.seen.changed(("Pod", namespace, name), facts):
        await _reconcile_soon(memo, (namespace, labels[JOB_LABEL]), logger, _indices(indices))


def _resource_health(status: kopf.Status) -> list[tuple[str, str]]:
    """The health of the pod's allocated devices (`allocatedResourcesStatus`) other than
    Healthy."""
    return sorted((str(r.get("resourceID")), str(r.get("health")))
                  for c in status.get("containerStatuses") or []
                  for e in c.get("allocatedResourcesStatus") or []
                  for r in e.get("resources") or [] if r.get("health") != "Healthy")


@kopf.on.event("", "v1", "configmaps", labels=JOBS_OWN,
               when=lambda name, **_: str(name).endswith("-progress"))
async def on_progress(namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                      logger: logging.Logger, **indices: Any) -> None:
    """A node agent reported: the job's phase, step and goodput follow (and a progress
    ConfigMap changed or deleted by someone converges back)."""
    await _reconcile_soon(memo, (namespace, labels[JOB_LABEL]), logger, _indices(indices))


def _changed(type: str | None, **_: Any) -> bool:
    """A change or a deletion: not a creation (the operator's own, at placement), nor what the
    first listing finds (each job's resume handler reconciles it)."""
    return type in ("MODIFIED", "DELETED")


@kopf.on.event("", "v1", "serviceaccounts", labels=JOBS_OWN, when=_changed)
@kopf.on.event(RBAC, "v1", "roles", labels=JOBS_OWN, when=_changed)
@kopf.on.event(RBAC, "v1", "rolebindings", labels=JOBS_OWN, when=_changed)
async def on_identity(namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                      logger: logging.Logger, **indices: Any) -> None:
    """One of the trainer identity's objects changed or went: the job's reconcile compares it
    with the one wanted (its own writes compare equal) and applies it back if it differs."""
    await _reconcile_soon(memo, (namespace, labels[JOB_LABEL]), logger, _indices(indices))


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, labels=JOBS_OWN)
async def on_workload(type: str, namespace: str, name: str, labels: kopf.Labels,
                      status: kopf.Status, memo: kopf.Memo, logger: logging.Logger,
                      **indices: Any) -> None:
    """Reconcile a queued job when Kueue admits, evicts or requeues its Workload (a condition
    or the admission changed), or the Workload went. Served only where Kueue's API is when the
    operator starts (kopf reads the API groups then)."""
    facts = None if type == "DELETED" else (
        sorted((c.get("type"), c.get("status")) for c in status.get("conditions") or []),
        bool(status.get("admission")))
    if memo.seen.changed(("Workload", namespace, name), facts):
        await _reconcile_soon(memo, (namespace, labels[JOB_LABEL]), logger, _indices(indices))


@kopf.on.event(GROUP, VERSION, "gpuhealths")
async def on_gpu_health(type: str, name: str, status: kopf.Status, memo: kopf.Memo,
                        logger: logging.Logger, node_jobs: kopf.Index, **indices: Any) -> None:
    """Reconcile the jobs on a node when a GPU's state or XIDs change in its GPUHealth (not on
    the periodic refresh that only says the object is current), and the jobs too few nodes fit:
    a GPU healthy again may make its node one (CKPT-RESTART places only on healthy nodes)."""
    facts = None if type == "DELETED" else [(g.get("index"), g.get("state"), g.get("xids"))
                                            for g in status.get("gpus") or []]
    if memo.seen.changed(("GPUHealth", name), facts):
        for key in set(node_jobs.get(name, ())) | memo.queue.waiting_for_nodes():
            await _reconcile_soon(memo, key, logger, _indices(indices))


@kopf.on.event(DRA, "v1", "resourceslices")
async def on_resource_slice(type: str, name: str, spec: kopf.Spec, body: kopf.Body,
                            memo: kopf.Memo, logger: logging.Logger, node_jobs: kopf.Index,
                            **indices: Any) -> None:
    """Reconcile the jobs on a node when a device taint of its GPUs' slice changes."""
    node = spec.get("nodeName")
    if not node or spec.get("driver") != DRIVER:
        return
    facts = None if type == "DELETED" else dra_health.read_slice(body).taints
    if memo.seen.changed(("ResourceSlice", name), facts):
        for key in set(node_jobs.get(node, ())):
            await _reconcile_soon(memo, key, logger, _indices(indices))


@kopf.on.event(DRA, "v1", "devicetaintrules")
async def on_device_taint_rule(type: str, name: str, body: kopf.Body, memo: kopf.Memo,
                               logger: logging.Logger, node_jobs: kopf.Index,
                               **indices: Any) -> None:
    """Reconcile every placed job when a DeviceTaintRule's selector or taint changes (a rule
    may select any node's devices)."""
    facts = None if type == "DELETED" else dra_health.read_rule(body)
    if memo.seen.changed(("DeviceTaintRule", name), facts):
        for key in {key for keys in node_jobs.values() for key in keys}:
            await _reconcile_soon(memo, key, logger, _indices(indices))


@kopf.on.event(GROUP, VERSION, api.POWER_TARGET_PLURAL)
async def on_power_target(type: str | None, name: str, labels: kopf.Labels, memo: kopf.Memo,
                          logger: logging.Logger, job_keys: kopf.Index, **indices: Any) -> None:
    """Reconcile the job of a target whose raise waits for cuts, when an agent reports one in
    effect; and a job whose target someone else deleted. Our own writes trigger nothing more.
    A target whose job is gone is deleted."""
    uid = labels.get(power_targets.JOB_UID_LABEL)
    keys = set(job_keys.get(uid, ()))
    # A job's target whose job no longer exists (the indices are complete before any handler
    # runs): the job went while the operator was away, or its release failed. Nothing asks for
    # this power. A target no job made is someone else's.
    if uid and not keys and type != "DELETED" and await asyncio.to_thread(
            _attempt, lambda: power_targets.withdraw(memo.api, name),
            f"deleting power target {name} of a gone job", logger):
        logger.info(f"deleted power target {name}: its job (uid {uid}) is gone")
    for key in keys:
        if type == "DELETED" or memo.queue.holds(key):
            await _reconcile_soon(memo, key, logger, _indices(indices))


def _indices(given: Mapping[str, Any]) -> observe.Indices:
    """What a reconcile reads of kopf's indices, from those kopf passes every handler."""
    return observe.Indices(given["gpu_health"], given["children"], given["held_gpus"],
                           given["resource_slices"], given["device_taint_rules"])


async def _reconcile_soon(memo: kopf.Memo, key: JobKey, logger: logging.Logger,
                          indices: observe.Indices) -> None:
    """A watch-triggered reconcile in a thread, unless one for the job is already waiting to
    start (`JobQueue.add`: it will observe this change too)."""
    if memo.queue.add(key):
        await asyncio.to_thread(_reconcile_watched, memo, key, logger, indices)


def _reconcile_watched(memo: kopf.Memo, key: JobKey, logger: logging.Logger,
                       indices: observe.Indices) -> None:
    try:
        with metrics.reconciling(api.JOB_KIND):
            _reconcile(memo, key, logger, indices)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"reconcile of job {key[0]}/{key[1]} failed, again in "
                       f"{RETRY_DELAY_S:.0f} s: {_reason(exc)}")
        memo.queue.after(key, RETRY_DELAY_S,
                         lambda: _reconcile_watched(memo, key, logger, indices))
    except Exception:
        # A fault of the operator's, not of the API: retried at the resync, not in a loop.
        logger.exception(f"reconcile of job {key[0]}/{key[1]} failed, again in "
                         f"{reconcile.RESYNC_INTERVAL_S:.0f} s")
        memo.queue.after(key, reconcile.RESYNC_INTERVAL_S,
                         lambda: _reconcile_watched(memo, key, logger, indices))


def _reason(exc: Exception) -> str:
    return apply.api_message(exc) if isinstance(exc, ApiException) else str(exc)
