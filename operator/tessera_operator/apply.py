"""Bring the API in line with a `Desired` (writes only), idempotently: every child has a
deterministic name, and a write is made only where the world differs from what is wanted.

- Children: the pods the job lacks are created, with strict field validation (a pod's spec cannot
  change once made: one that exists is left as it is); every other child (the trainer identity, the
  progress ConfigMap) is server-side applied under the field manager `tessera-operator` whenever the
  watches saw it differ from the one wanted (missing, or its labels, owner, rules, subjects or role
  changed by someone or by a newer operator), so a change reaches running jobs.
- The layout ConfigMap: created for generation 1, server-side applied for each later one with
  the resourceVersion it was read at (a concurrent writer makes the write fail, and the retry
  re-observes).
- The power targets: the pass of writes decided (`Desired.sync`, `power_targets.write_sync`):
  only those that changed, cuts first.
- The status: one JSON merge patch, with an explicit null for each key the previous status had
  and the new one has not, so a key the status no longer holds is cleared; none when equal.
  One the API server refuses as invalid is returned, not raised: retrying it cannot help.
- A queued job's Kueue Workload: server-side applied when the one observed lacks what is
  wanted; its status written by a JSON patch that holds only on the version read (Kueue writes
  the same conditions: a conflict is retried from the next observation).
- One Kubernetes Event per decision.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_contracts.api import GROUP, JOB_LABEL, JOB_PLURAL, OPERATOR_MANAGER, VERSION
from tessera_operator import power_targets, workload
from tessera_operator.desired import Desired, Event
from tessera_operator.kueue_workload import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from tessera_operator.observed import Observed, child_view
from tessera_operator.settings import API_TIMEOUT_S

APPLY = "application/apply-patch+yaml"
# The finalizer of operators that released power targets in a delete handler (`drop_finalizer`).
FINALIZER = "tessera.dev/operator"
REFUSED = (400, 403, 422)  # the API server's answers to a write it will not admit as written
# Pod creations in flight at once: within the client's connection pool (5 connections per core
# by default, so 10 on the smallest machine).
CREATE_WORKERS = 8

# The API call that server-side applies each kind of child other than a pod.
_APPLIERS: dict[str, Callable[[client.ApiClient], Callable[..., Any]]] = {
    "ServiceAccount": lambda api: client.CoreV1Api(api).patch_namespaced_service_account,
    "ConfigMap": lambda api: client.CoreV1Api(api).patch_namespaced_config_map,
    "Role": lambda api: client.RbacAuthorizationV1Api(api).patch_namespaced_role,
    "RoleBinding": lambda api: client.RbacAuthorizationV1Api(api).patch_namespaced_role_binding,
}


def children(api: client.ApiClient, observed: Observed, wanted: Desired) -> str | None:
    """Apply every child but pods that differs from the one wanted; then create the pods the
    job lacks, all or none: returns why the API server refused one (its validation, Pod
    Security admission, a quota), after trying each without making it."""
    existing = {pod["metadata"]["name"] for pod in observed.pods}
    missing = [obj for obj in wanted.children
               if obj["kind"] == "Pod" and obj["metadata"]["name"] not in existing]
    for obj in wanted.children:
        meta = obj["metadata"]
        if obj["kind"] != "Pod" and not _covers(observed.children.get((obj["kind"], meta["name"])),
                                                child_view(obj)):
            _APPLIERS[obj["kind"]](api)(
                meta["name"], meta["namespace"], obj, field_manager=OPERATOR_MANAGER,
                force=True, _content_type=APPLY, _request_timeout=API_TIMEOUT_S)
    # Side by side: a placement creates a pod per node of the job, each a round trip the API
    # server spends most of in admission and storage.
    with ThreadPoolExecutor(CREATE_WORKERS) as pool:
        refused = next((r for r in pool.map(lambda p: _create_pod(api, p, dry_run=True), missing)
                        if r is not None), None)
        if refused is not None:
            return refused
        list(pool.map(lambda p: _create_pod(api, p), missing))
    return None


def _covers(live: object, wanted: object) -> bool:
    """Whether `live` holds everything `wanted` sets: every key of a mapping (others may hold
    more), every item of a list in order, equal values."""
    if isinstance(wanted, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and _covers(live[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(
            _covers(a, b) for a, b in zip(live, wanted, strict=True))
    return live == wanted


def _create_pod(api: client.ApiClient, pod: Mapping[str, Any], dry_run: bool = False
                ) -> str | None:
    """Create a pod under its deterministic name (or only try: `dry_run`); one someone else
    made of that name is left as it is (the job's pods are those it controls). Returns why it
    was refused: by the API server as invalid or forbidden, or a field the pod schema does not
    have (a misspelt one of the job's template), named by its path, never dropped. The client
    refuses such a field itself before sending (its pod model forbids unknown fields); strict
    field validation has the API server refuse any its own schema lacks."""
    name = pod["metadata"]["name"]
    try:
        # The answer, read as bytes: the client's models of a pod cost more than the request.
        client.CoreV1Api(api).create_namespaced_pod(
            pod["metadata"]["namespace"], pod, field_manager=OPERATOR_MANAGER,
            field_validation="Strict",
            _request_timeout=API_TIMEOUT_S, _preload_content=False,
            **({"dry_run": "All"} if dry_run else {})).read()
    except ApiException as exc:
        if exc.status in REFUSED:
            return f"pod {name}: {api_message(exc)}"
        if exc.status != 409:
            raise
    except ValueError as exc:  # the client's validation of the pod (pydantic's error)
        return f"pod {name}: {_unknown_fields(exc)}"
    return None


def _unknown_fields(exc: ValueError) -> str:
    """The client's refusal of a pod, each unknown field named by its path as the API server
    names it (`spec.containers[0].imagePullPolicyy`); any other refusal as the client says."""
    errors = getattr(exc, "errors", None)
    found = errors() if callable(errors) else []
    paths = []
    for error in found:
        if error.get("type") != "extra_forbidden":
            return str(exc)
        # the first item of the location is the call's argument (the pod)
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                       for part in error["loc"][1:]).lstrip(".")
        paths.append(f'unknown field "{path}"')
    return ", ".join(paths) or str(exc)


def leftovers(api: client.ApiClient, job: Mapping[str, Any], wanted: Desired) -> None:
    """Delete what an earlier attempt or a finished job leaves behind: pods (each stops within
    its grace period; those on a node that stopped reporting at once), then ConfigMaps. One
    already gone is no error."""
    namespace = job["metadata"]["namespace"]
    core = client.CoreV1Api(api)
    for name in wanted.delete_pods:
        _gone(lambda n=name: core.delete_namespaced_pod(n, namespace,
                                                        _request_timeout=API_TIMEOUT_S))
    for name in wanted.force_delete_pods:
        _gone(lambda n=name: core.delete_namespaced_pod(n, namespace, grace_period_seconds=0,
                                                        _request_timeout=API_TIMEOUT_S))
    for name in wanted.delete_configmaps:
        _gone(lambda n=name: core.delete_namespaced_config_map(n, namespace,
                                                               _request_timeout=API_TIMEOUT_S))


def delete_job(api: client.ApiClient, job: Mapping[str, Any]) -> None:
    """Delete the finished job (ttlSecondsAfterFinished): the garbage collector takes its
    children (its power targets are released already)."""
    meta = job["metadata"]
    _gone(lambda: client.CustomObjectsApi(api).delete_namespaced_custom_object(
        GROUP, VERSION, meta["namespace"], JOB_PLURAL, meta["name"],
        body={"preconditions": {"uid": meta["uid"]}}, _request_timeout=API_TIMEOUT_S))


def drop_finalizer(api: client.ApiClient, job: Mapping[str, Any]) -> None:
    """Remove FINALIZER, which an operator that released power targets from a delete handler
    put on the jobs it made: nothing removes it any more, and it would hold their deletion."""
    meta = job["metadata"]
    kept = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
    # the resourceVersion makes a concurrent change of the list fail rather than be undone
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, meta["namespace"], JOB_PLURAL, meta["name"],
        {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}},
        _content_type="application/merge-patch+json", _request_timeout=API_TIMEOUT_S)


def _gone(delete: Callable[[], Any]) -> None:
    try:
        delete()
    except ApiException as exc:
        if exc.status != 404:
            raise


def layout(api: client.ApiClient, body: Mapping[str, Any], resource_version: str | None
           ) -> None:
    """Publish the layout ConfigMap `body`, read at `resource_version` (None: there was
    none)."""
    meta = body["metadata"]
    core = client.CoreV1Api(api)
    if resource_version is None:
        # Created, not applied: an apply would take over a ConfigMap someone made meanwhile
        # (the create fails instead, and the retry finds it is not the job's).
        core.create_namespaced_config_map(meta["namespace"], body,
                                          field_manager=OPERATOR_MANAGER,
                                          _request_timeout=API_TIMEOUT_S)
        return
    # resourceVersion: a concurrent writer makes this fail (409) and the retry re-observes.
    fenced = dict(body) | {"metadata": dict(meta) | {"resourceVersion": resource_version}}
    core.patch_namespaced_config_map(meta["name"], meta["namespace"], fenced,
                                     field_manager=OPERATOR_MANAGER, force=True,
                                     _content_type=APPLY, _request_timeout=API_TIMEOUT_S)


def power(api: client.ApiClient, observed: Observed, wanted: Desired) -> str | None:
    """Make the wanted pass of power target writes (`Desired.sync`, planned from the targets
    observed); returns why the API server refused them as invalid, when it did (retrying
    cannot help: the status says so, and the resync timer tries again)."""
    job = observed.job
    try:
        power_targets.write_sync(api, wanted.sync, observed.targets,
                                 job_owner=workload.owner(job),
                                 job_label=(JOB_LABEL, job["metadata"]["name"]),
                                 timeout_s=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status not in (400, 422):
            raise
        return api_message(exc)
    return None


def release_power(api: client.ApiClient, job: Mapping[str, Any]) -> None:
    """Delete every power target of the job (it is gone): each agent then settles its GPUs at
    the base cap inside its last budget share."""
    power_targets.sync_targets(api, [], job_owner=workload.owner(job),
                               job_label=(JOB_LABEL, job["metadata"]["name"]),
                               timeout_s=API_TIMEOUT_S)


def queue(api: client.ApiClient, observed: Observed, wanted: Desired,
          logger: logging.Logger) -> None:
    """Apply the job's Kueue Workload where the one observed lacks what is wanted, then write
    its status; a status write that met a newer version (Kueue wrote it meanwhile) waits for
    the reconcile that version's event brings."""
    custom = client.CustomObjectsApi(api)
    live = None if observed.queue is None else observed.queue.workload
    body = wanted.workload
    if body is not None and not _covers(live, body):
        meta = body["metadata"]
        try:
            custom.patch_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, meta["namespace"], WORKLOADS, meta["name"], body,
                field_manager=OPERATOR_MANAGER, force=True, _content_type=APPLY,
                _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            # Kueue refuses a change to the pod sets of an admitted Workload: the job runs on
            # what was admitted, and its next Workload (a new job) asks anew.
            if exc.status != 422:
                raise
            logger.warning(f"Workload {meta['namespace']}/{meta['name']} not changed: "
                           f"{api_message(exc)}")
    if wanted.workload_status and live is not None:
        meta = live["metadata"]
        try:
            custom.patch_namespaced_custom_object_status(
                KUEUE_GROUP, KUEUE_VERSION, meta["namespace"], WORKLOADS, meta["name"],
                list(wanted.workload_status), _content_type="application/json-patch+json",
                _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status not in (409, 422):
                raise
            logger.info(f"Workload {meta['namespace']}/{meta['name']} changed meanwhile: "
                        f"{api_message(exc)}")


def status(api: client.ApiClient, job: Mapping[str, Any], wanted: Mapping[str, Any]
           ) -> str | None:
    """Write the job's status when it differs from the one observed, in one merge patch that
    also clears the keys it no longer holds. Returns why the API server refused it as invalid
    (its schema, an admission policy): the same write would be refused again, so it is not
    retried; the caller says so."""
    previous = job.get("status") or {}
    if previous == wanted:
        return None
    patch = dict(wanted) | {key: None for key in previous if key not in wanted}
    meta = job["metadata"]
    try:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], JOB_PLURAL, meta["name"], {"status": patch},
            _content_type="application/merge-patch+json", _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status not in REFUSED:
            raise
        return api_message(exc)
    return None


def events(job: Mapping[str, Any], found: tuple[Event, ...], logger: logging.Logger) -> None:
    """Post each event on the job (kopf.event, not kopf.info: the posting level keeps kopf's
    own chatter out of Events); a new layout is logged too, naming the job (the logger may be
    another object's: the event that triggered the reconcile)."""
    meta = job["metadata"]
    for event in found:
        kopf.event(job, type=event.type, reason=event.reason, message=event.message)
        if event.reason == "LayoutChanged":
            logger.info(f"job {meta['namespace']}/{meta['name']}: {event.message}")


def api_message(exc: ApiException) -> str:
    """What the API server said (its Status message), else the status and reason."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"
