"""Observe a job's world, reads only: one frozen `Observed` value per reconcile.

From the API: the job, its pods, its layout and progress ConfigMaps (the reports parsed here,
once), its power targets, and, while a trainer pod is missing, the pods on the nodes placement
would choose. From the watches: its nodes and the placement candidates (`cache.NodeCache`),
their GPUHealth and DRA device taints (parsed by kopf's indices as they arrive), the GPUs the
operator's trainer pods hold and the job's children (kopf's indices, as `Indices`).
A placed job's reconcile reads five objects or lists from the API whatever its size; one queued
in Kueue also its Workload, the ResourceFlavors its admission names and its priority class.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_contracts import progress
from tessera_contracts.api import GROUP, JOB_LABEL, JOB_PLURAL, VERSION
from tessera_contracts.generation import LAYOUT_KEY, Generation, GenerationError, layout_configmap
from tessera_contracts.gpuhealth import PublishedHealth
from tessera_contracts.unreadable import Unreadable
from tessera_operator import kueue_workload, power_targets, workload
from tessera_operator.cache import NodeCache
from tessera_operator.dra_health import DeviceTaints, RuleView, SliceView
from tessera_operator.jobqueue import JobKey
from tessera_operator.kueue_workload import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from tessera_operator.observed import Candidates, Layout, Observed, Queue
from tessera_operator.settings import API_TIMEOUT_S


@dataclass(frozen=True)
class Indices:
    """kopf's indices that a reconcile reads (live views: read, never kept)."""

    gpu_health: Mapping[str, Iterable[PublishedHealth | Unreadable]]  # node -> its GPUHealth
    children: Mapping[JobKey, Iterable[Mapping[str, Any]]]  # job -> `child_view` of each child
    # node -> the GPUs each unfinished trainer pod of the operator's there asks for
    held: Mapping[str, Iterable[int]]
    # node -> its ResourceSlices, and RULES -> every DeviceTaintRule (DRA's device taints)
    slices: Mapping[str, Iterable[SliceView]] = field(default_factory=dict)
    rules: Mapping[str, Iterable[RuleView | None]] = field(default_factory=dict)


RULES = "rules"  # the one key of the DeviceTaintRules' index


def device_taints(indices: Indices, nodes: Iterable[str]) -> DeviceTaints:
    """The device taints on `nodes`' GPUs: their slices, and every DeviceTaintRule."""
    return DeviceTaints(
        tuple(s for node in nodes for s in list(indices.slices.get(node, ()))),
        tuple(r for r in list(indices.rules.get(RULES, ())) if r is not None))


def job(api: client.ApiClient, key: JobKey) -> dict[str, Any] | None:
    """The job as the API holds it; None when it is gone."""
    try:
        return client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, key[0], JOB_PLURAL, key[1],
            _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def world(api: client.ApiClient, cache: NodeCache, indices: Indices,
          job: Mapping[str, Any]) -> Observed:
    """Everything a reconcile of `job` reads but the placement candidates (`candidates`)."""
    meta = job["metadata"]
    pods = tuple(_job_pods(api, job))
    placed = sorted(set(workload.placed_nodes(pods, job).values()))
    children = {(c["kind"], c["metadata"]["name"]): c
                for c in list(indices.children.get((meta["namespace"], meta["name"]), ()))}
    layout, layout_attempt = _layout(api, job)
    reports, reports_attempt = _reports(api, job)
    attempts = {name: attempt for name, attempt in (
        (layout_configmap(meta["name"]), layout_attempt),
        (progress.progress_configmap(meta["name"]), reports_attempt)) if attempt is not None}
    return Observed(
        job=job, pods=pods, nodes=tuple(nodes(api, cache, placed)),
        layout=layout, reports=reports, configmap_attempts=attempts,
        targets=tuple(power_targets.list_job_targets(api, (JOB_LABEL, meta["name"]),
                                                     meta["uid"], API_TIMEOUT_S)),
        gpu_health=_gpu_health(indices, placed), devices=device_taints(indices, placed),
        children=children, queue=queue(api, job))


def _get(read: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """What `read` gets; None when it is not there (404)."""
    try:
        return read()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def queue(api: client.ApiClient, job: Mapping[str, Any]) -> Queue | None:
    """What Kueue holds of a job labelled with a queue (None for one that is not): its
    Workload, the ResourceFlavors its admission names, its priority class's value."""
    if kueue_workload.queue_name(job) is None:
        return None
    custom = client.CustomObjectsApi(api)
    meta = job["metadata"]
    found = _get(lambda: custom.get_namespaced_custom_object(
        KUEUE_GROUP, KUEUE_VERSION, meta["namespace"], WORKLOADS,
        kueue_workload.workload_name(meta["name"]), _request_timeout=API_TIMEOUT_S))
    owned = found if found is not None and workload.controlled_by(found, job) else None
    assignments = (((owned or {}).get("status") or {}).get("admission") or {}).get(
        "podSetAssignments") or []
    flavors = {}
    for name in sorted({f for a in assignments for f in (a.get("flavors") or {}).values()}):
        flavor = _get(lambda name=name: custom.get_cluster_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", name, _request_timeout=API_TIMEOUT_S))
        if flavor is not None:
            flavors[name] = flavor
    ref = kueue_workload.priority_ref(job)
    if ref is None:
        return Queue(owned, flavors)
    if ref.kind == "PriorityClass":
        value = _get(lambda: client.SchedulingV1Api(api).read_priority_class(
            ref.name, _request_timeout=API_TIMEOUT_S).to_dict())
    else:
        value = _get(lambda: custom.get_cluster_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses", ref.name,
            _request_timeout=API_TIMEOUT_S))
    if value is None:
        return Queue(owned, flavors, priority_missing=f"{ref.kind} {ref.name}")
    return Queue(owned, flavors, (ref, int(value["value"])))


def with_candidates(api: client.ApiClient, cache: NodeCache, indices: Indices,
                    observed: Observed, selector: Mapping[str, str],
                    choose: Callable[[Observed], Iterable[str]]) -> Observed:
    """`observed` with the nodes placement chooses among (those `selector` matches) and the
    GPUs other pods hold there, and their GPUHealth. The nodes come from the node watch, the
    GPUs from the operator's own trainer pods (`Indices.held`); only the nodes placement would
    choose (`choose`) are asked for other pods, one list each, until it chooses no node it has
    not asked about. So a placement costs reads in the job's nodes, not the cluster's nodes
    and pods."""
    matching = tuple(facts.node(name) for name, facts in cache.matching(selector))
    taken = {name: held for name in (n["metadata"]["name"] for n in matching)
             if (held := sum(indices.held.get(name, ())))}
    asked: set[str] = set()
    while True:
        candidates = Candidates(matching, dict(taken))
        fresh = [n for n in choose(replace(observed, candidates=candidates)) if n not in asked]
        if not fresh:
            break
        for name in fresh:
            asked.add(name)
            if others := _others_gpus(api, name):
                taken[name] = taken.get(name, 0) + others
    named = sorted({n["metadata"]["name"] for n in matching} | {
        n["metadata"]["name"] for n in observed.nodes})
    return replace(observed, candidates=candidates, gpu_health=_gpu_health(indices, named))


def _others_gpus(api: client.ApiClient, node: str) -> int:
    """The GPUs that pods bound to `node`, other than the operator's trainer pods (which
    `Indices.held` counts), ask for."""
    pods = _items(client.CoreV1Api(api).list_pod_for_all_namespaces, field_selector=(
        f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"))
    return workload.taken_gpus(p for p in pods if not workload.is_trainer(p)).get(node, 0)


def _items(listing: Callable[..., Any], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """A list call's items as the API sends them (plain dicts): the client's models cost
    several times the JSON they come from."""
    response = listing(*args, _preload_content=False, _request_timeout=API_TIMEOUT_S, **kwargs)
    return list(json.loads(response.data)["items"])


def _job_pods(api: client.ApiClient, job: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = job["metadata"]
    pods = _items(client.CoreV1Api(api).list_namespaced_pod, meta["namespace"],
                  label_selector=f"{JOB_LABEL}={meta['name']}")
    return [p for p in pods if workload.controlled_by(p, job)]


def nodes(api: client.ApiClient, cache: NodeCache, names: list[str]) -> list[dict[str, Any]]:
    """The nodes as the node watch last saw them; one it has not delivered yet is read from
    the API and offered to the cache (`NodeCache.offer`: its older events are then skipped)."""
    found = []
    for name in names:
        facts = cache.get(name)
        if facts is None:
            try:
                node = api.sanitize_for_serialization(
                    client.CoreV1Api(api).read_node(name, _request_timeout=API_TIMEOUT_S))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue  # gone: its GPUs are not the job's any more
            facts = cache.offer(node)
        found.append(facts.node(name))
    return found


def _gpu_health(indices: Indices, nodes: Iterable[str]
                ) -> tuple[PublishedHealth | Unreadable, ...]:
    return tuple(obj for node in nodes for obj in list(indices.gpu_health.get(node, ())))


def _layout(api: client.ApiClient, job: Mapping[str, Any]) -> tuple[Layout, int | None]:
    """The layout ConfigMap as read, and the attempt it is of (None: none, or not the job's)."""
    meta = job["metadata"]
    try:
        current = client.CoreV1Api(api).read_namespaced_config_map(
            layout_configmap(meta["name"]), meta["namespace"], _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return Layout(), None
    version = current.metadata.resource_version
    body = api.sanitize_for_serialization(current)
    if not workload.controlled_by(body, job):
        return Layout(version, owned=False), None
    try:
        document = Generation.from_dict(json.loads((current.data or {})[LAYOUT_KEY]))
    except (KeyError, ValueError, GenerationError):
        document = None  # someone broke it
    return Layout(version, generation=document), workload.attempt_of(body) or 0


def _reports(api: client.ApiClient, job: Mapping[str, Any]
             ) -> tuple[dict[str, progress.NodeReport | Unreadable], int | None]:
    """The node agents' progress reports in the ConfigMap, parsed (node -> its report, or why
    it is unreadable), and the attempt they are of (None: no ConfigMap, or not the job's)."""
    meta = job["metadata"]
    try:
        cm = client.CoreV1Api(api).read_namespaced_config_map(
            progress.progress_configmap(meta["name"]), meta["namespace"],
            _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return {}, None
    body = api.sanitize_for_serialization(cm)
    if not workload.controlled_by(body, job):
        return {}, None
    return progress.parse_reports(cm.data), workload.attempt_of(body) or 0
