"""kopf handlers: reconcile each NTPTrainingJob from what is observed, level-triggered.

Every trigger (the job created, changed or resumed; the renewal timer; a change to one of its
nodes' labels or GPU cordons) runs the same `reconcile(namespace, name)`, which never asks which
event arrived: observe the job, its nodes and its layout ConfigMap -> plan (pure) -> write the
layout document if its fingerprint changed, publish the power targets -> rebuild the status.
Reconciles of one job are serialised by a lock, so the node watch and the job handlers can call
it concurrently. A node serves a job when it carries both labels `tessera.dev/job=<name>` and
`tessera.dev/job-namespace=<namespace>` (what a placement step writes).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from power_controller import channel
from power_controller.targets import format_time
from tessera_operator import conditions, health, planner

GROUP, VERSION, PLURAL = "tessera.dev", "v1alpha1", "ntptrainingjobs"
JOB_LABEL = "tessera.dev/job"
JOB_NAMESPACE_LABEL = "tessera.dev/job-namespace"
LAYOUT_KEY = "layout.json"
# Targets live TARGET_TTL_S; the timer renews them three times within that.
TARGET_TTL_S = 60
RENEW_INTERVAL_S = 20.0
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
    memo.pending = set()  # jobs with a node-triggered reconcile that has not started yet
    memo.nodes = {}  # node name -> (job key, labels, cordon) last seen


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    memo.api.close()


# ----------------------------------------------------------------------------------------------
# Triggers
# ----------------------------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, interval=RENEW_INTERVAL_S, initial_delay=RENEW_INTERVAL_S)
def on_job(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    _retrying(lambda: reconcile(memo, namespace, name, logger))


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_job_deleted(
    namespace: str, name: str, spec: kopf.Spec, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """The trainer is gone: its GPUs go back to the base cap (the agent then holds there)."""
    _retrying(lambda: release_power(memo, namespace, name, dict(spec), logger))
    with memo.locks_guard:
        memo.locks.pop((namespace, name), None)


@kopf.on.event("", "v1", "nodes")
def on_node(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Reconcile the jobs a node serves (before and after) when its labels or cordons change;
    other node updates (status, heartbeats) are ignored.

    Node events come in storms (every node of a job at startup, a rack losing power): a change
    that arrives while a reconcile of its job is still waiting to start is covered by that one.
    """
    labels = dict(body.metadata.labels or {})
    seen = None if type == "DELETED" else (
        _job_of(labels), labels, (body.metadata.annotations or {}).get(health.CORDON_ANNOTATION))
    with memo.locks_guard:
        before = memo.nodes.pop(body.metadata.name, None)
        if seen is not None:
            memo.nodes[body.metadata.name] = seen
    if seen == before:
        return
    for key in {v[0] for v in (before, seen) if v is not None and v[0] is not None}:
        with memo.locks_guard:
            if key in memo.pending or not _watched(memo, key):
                continue
            memo.pending.add(key)
        try:
            reconcile(memo, *key, logger)
        except (ApiException, HTTPError) as exc:
            # The job's timer runs the same reconcile within RENEW_INTERVAL_S.
            logger.warning(f"reconcile of {key[0]}/{key[1]} after node change failed: {exc}")


def _job_of(labels: dict[str, str]) -> JobKey | None:
    if JOB_LABEL in labels and JOB_NAMESPACE_LABEL in labels:
        return labels[JOB_NAMESPACE_LABEL], labels[JOB_LABEL]
    return None


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


def _job_nodes(api: client.ApiClient, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"{JOB_LABEL}={name},{JOB_NAMESPACE_LABEL}={namespace}"
    nodes = client.CoreV1Api(api).list_node(label_selector=selector,
                                            _request_timeout=API_TIMEOUT_S)
    return [api.sanitize_for_serialization(n) for n in nodes.items]


def _observe(
    api: client.ApiClient, job: dict[str, Any]
) -> tuple[planner.JobPlan | None, tuple[planner.Problem, ...], tuple[str, ...]]:
    """The plan for the world as it is, or why there is none; plus ignored health input."""
    meta = job["metadata"]
    try:
        spec = planner.JobSpec.from_spec(job["spec"], ttl_s=TARGET_TTL_S)
    except planner.SpecError as exc:
        return None, (planner.Problem("InvalidSpec", str(exc)),), ()
    nodes = _job_nodes(api, meta["namespace"], meta["name"])
    if not nodes:
        return None, (planner.Problem("NoGPUNodes", (
            f"no node is labelled {JOB_LABEL}={meta['name']} and "
            f"{JOB_NAMESPACE_LABEL}={meta['namespace']}")),), ()
    signal = health.from_cordons(nodes, spec.gpus_per_node)
    plan = planner.plan(spec, planner.node_domains(nodes, spec.domain_label), signal.failed)
    return plan, plan.problems, signal.problems


def _write_layout(api: client.ApiClient, job: dict[str, Any], plan: planner.JobPlan) -> int:
    """Publish the layout document if its fingerprint changed; returns its generation."""
    meta = job["metadata"]
    core, cm_name = client.CoreV1Api(api), f"{meta['name']}-layout"
    try:
        current = core.read_namespaced_config_map(cm_name, meta["namespace"],
                                                  _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 404:
            raise
        current = None
    try:
        old = json.loads((current.data or {})[LAYOUT_KEY]) if current else {}
    except (KeyError, ValueError):
        old = {}  # someone broke it: replace it with a new generation
    if old.get("fingerprint") == plan.fingerprint:
        return int(old["generation"])
    generation = max(int(old.get("generation", 0)),
                     int((job.get("status") or {}).get("layoutGeneration", 0))) + 1
    document = plan.document(f"{meta['namespace']}/{meta['name']}", generation)
    body = {
        "metadata": {
            "name": cm_name,
            "labels": {JOB_LABEL: meta["name"]},
            "ownerReferences": [{"apiVersion": job["apiVersion"], "kind": job["kind"],
                                 "name": meta["name"], "uid": meta["uid"], "controller": True}],
        },
        # Compact: 32,768 GPUs (the paper's job) take about 650 kB of the ConfigMap's 1 MiB.
        "data": {LAYOUT_KEY: json.dumps(document, separators=(",", ":"))},
    }
    if current is None:
        core.create_namespaced_config_map(meta["namespace"], body, _request_timeout=API_TIMEOUT_S)
    else:
        # resourceVersion: a concurrent writer makes this fail (409) and the retry re-observes.
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        core.replace_namespaced_config_map(cm_name, meta["namespace"], body,
                                           _request_timeout=API_TIMEOUT_S)
    return generation


def reconcile(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger) -> None:
    """Bring the job's layout, power targets and status in line with the observed world."""
    with _lock(memo, (namespace, name)):
        with memo.locks_guard:
            memo.pending.discard((namespace, name))  # from here on, every change is observed
        api, now = memo.api, memo.clock()
        # 1. Observe the job (gone: nothing to do) and plan for its nodes as they are.
        job = _get_job(api, namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return
        previous = job.get("status") or {}
        plan, problems, notes = _observe(api, job)
        # 2. Act: the layout document, then the power targets (renewed on every pass).
        layout_generation = int(previous.get("layoutGeneration", 0))
        if plan is not None:
            try:
                targets = plan.power_targets(now)
            except planner.SpecError as exc:
                plan, problems = None, (*problems, planner.Problem("InvalidSpec", str(exc)))
            else:
                layout_generation = _write_layout(api, job, plan)
                channel.publish_all(api, targets, timeout_s=API_TIMEOUT_S)
        # 3. Status rebuilt from the observation; written only when it differs.
        status = conditions.render(
            plan, problems, previous, now=format_time(now),
            generation=int(job["metadata"].get("generation", 0)),
            layout_generation=layout_generation, notes=notes)
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


def release_power(
    memo: kopf.Memo, namespace: str, name: str, spec: dict[str, Any], logger: logging.Logger
) -> None:
    """Base caps on every node of a deleted job."""
    try:
        job_spec = planner.JobSpec.from_spec(spec, ttl_s=TARGET_TTL_S)
    except planner.SpecError:
        return
    nodes = _job_nodes(memo.api, namespace, name)
    healthy = planner.plan(job_spec, planner.node_domains(nodes, job_spec.domain_label), set())
    try:
        targets = healthy.power_targets(memo.clock())
    except planner.SpecError as exc:
        logger.warning(f"no power targets to release: {exc}")
        return
    channel.publish_all(memo.api, targets, timeout_s=API_TIMEOUT_S)
    logger.info(f"released power on {len(nodes)} nodes")
