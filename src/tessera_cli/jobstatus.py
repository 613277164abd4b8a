"""What `kubectl ntp status JOB` prints, from the objects it read (pure: no API, no clock).

A job's status says the layout the operator plans (`status.tpLayout`, `status.replicas`); the
layout ConfigMap holds the generation it published to the ranks, and the progress ConfigMap what
each node's ranks run. Per GPU: the node's cordon annotation, its GPUHealth, and its
GPUPowerTarget's watts and the limit its power agent reports in effect. Every object is read
with the parser its own readers use, and what does not parse is shown as such, never raised. What
the user's roles may not read (`view` in a namespace reaches neither Nodes nor the cluster-scoped
GPUHealths and GPUPowerTargets) shows as `?`, and is named once at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera_contracts import gpuhealth, powertarget
from tessera_contracts.api import CORDON_ANNOTATION
from tessera_contracts.cordon import parse_indices
from tessera_contracts.generation import LAYOUT_KEY, Generation
from tessera_contracts.progress import read_reports

GPU_RESOURCE = "nvidia.com/gpu"
NONE = "-"
UNREADABLE = "?"


@dataclass(frozen=True)
class JobObjects:
    """What the status is made of, as the API returned it (plain dicts); None where an object
    does not exist."""

    job: Mapping[str, Any]
    layout: Mapping[str, Any] | None  # the ConfigMap <job>-layout
    progress: Mapping[str, Any] | None  # the ConfigMap <job>-progress
    nodes: Mapping[str, Mapping[str, Any] | None]  # Node by name
    targets: Mapping[str, Mapping[str, Any] | None]  # GPUPowerTarget by node
    health: Mapping[str, Mapping[str, Any] | None]  # GPUHealth by node
    # the kinds (plural, "Nodes") the user may not read: their objects are None, and not absent
    forbidden: frozenset[str] = frozenset()


def job_nodes(job: Mapping[str, Any]) -> list[str]:
    """The nodes of the job's planned layout, replica by replica."""
    nodes: list[str] = []
    for replica in _replicas(job):
        nodes += [n for n in replica.get("nodes") or () if isinstance(n, str) and n not in nodes]
    return nodes


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned as kubectl aligns them: left, three spaces apart."""
    cells = [list(header)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def render(objects: JobObjects, now: float) -> str:
    """The status text; `now` (Unix seconds) tells a stale GPUHealth from a current one."""
    job = objects.job
    meta, spec, status = (job.get(k) or {} for k in ("metadata", "spec", "status"))
    nodes = job_nodes(job)
    parts = [
        _summary(meta, spec, status),
        _layout(status, objects.layout),
        table(("REPLICA", "TP", "NODES", "FAILED GPUS", "BOOSTED"),
              [(r.get("index", NONE), r.get("tensorParallelSize", NONE),
                ",".join(r.get("nodes") or ()) or NONE, ",".join(r.get("failedGPUs") or ()) or NONE,
                "yes" if r.get("powerBoosted") else "no") for r in _replicas(job)]),
    ]
    if nodes:
        parts.append(_nodes(nodes, objects))
        parts.append(_gpus(nodes, objects, spec, now))
    if objects.forbidden:
        parts.append(f"Not shown, your roles may not read them: "
                     f"{', '.join(sorted(objects.forbidden))} ({UNREADABLE})")
    return "\n\n".join(parts) + "\n"


def _replicas(job: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    replicas = (job.get("status") or {}).get("replicas") or []
    return [r for r in replicas if isinstance(r, Mapping)]


def _summary(meta: Mapping[str, Any], spec: Mapping[str, Any],
             status: Mapping[str, Any]) -> str:
    goodput = status.get("goodput")
    return (f"NTPTrainingJob {meta.get('namespace')}/{meta.get('name')}: "
            f"{status.get('phase') or 'no status yet'}, "
            f"step {status.get('step', 0)} of {spec.get('steps', '?')}, "
            f"goodput {NONE if goodput is None else f'{goodput:.3f}'}, "
            f"mode {(spec.get('failurePolicy') or {}).get('mode', '?')}, "
            f"attempt {status.get('attempt', 0)}, restarts {status.get('restarts', 0)}")


def _layout(status: Mapping[str, Any], layout: Mapping[str, Any] | None) -> str:
    planned = (f"Layout planned: TP {status.get('tpLayout') or NONE} "
               f"(layout generation {status.get('layoutGeneration', 0)})")
    text = (layout or {}).get("data", {}).get(LAYOUT_KEY) if layout else None
    if text is None:
        return f"{planned}; none published to the ranks"
    try:
        published = Generation.from_dict(json.loads(text))
    except ValueError as exc:  # not JSON, or a GenerationError naming the field
        return f"{planned}; the published layout does not parse ({exc})"
    degrees = ",".join(map(str, published.tp_degrees))
    switch = "" if published.at_step is None else f", from step {published.at_step}"
    return (f"{planned}; published to the ranks: generation {published.generation}, "
            f"TP {degrees}{switch}")


def _nodes(nodes: list[str], objects: JobObjects) -> str:
    reports = read_reports((objects.progress or {}).get("data"), nodes)
    absent = _absent(objects, "GPUPowerTargets")
    rows = []
    for name in nodes:
        report = reports[name]
        target = objects.targets.get(name)
        state = (target or {}).get("status") or {}
        try:
            budget = f"{powertarget.parse_object(target, name).budget_w}" if target else absent
        except powertarget.InvalidTarget as exc:
            budget = f"invalid ({exc})"
        rows.append((
            name,
            NONE if report is None else report.generation,
            NONE if report is None else report.state,
            NONE if report is None else report.step,
            NONE if report is None or report.step_seconds is None
            else f"{report.step_seconds:.2f}",
            budget, state.get("limitWatts", absent), state.get("state", absent)))
    return table(("NODE", "RUNS GENERATION", "STATE", "STEP", "STEP S", "BUDGET W", "LIMIT W",
                  "POWER STATE"), rows)


def _absent(objects: JobObjects, kind: str) -> str:
    """What a cell of an object of `kind` shows when there is none: unknown if the user may not
    read that kind, else none."""
    return UNREADABLE if kind in objects.forbidden else NONE


def _gpus(nodes: list[str], objects: JobObjects, spec: Mapping[str, Any], now: float) -> str:
    absent = _absent(objects, "GPUPowerTargets")
    rows = []
    for name in nodes:
        node = objects.nodes.get(name)
        count = _gpu_count(node, spec)
        annotation = ((node or {}).get("metadata") or {}).get("annotations") or {}
        cordoned, _ = parse_indices(annotation.get(CORDON_ANNOTATION, ""), count or 1)
        health, health_note = ({}, UNREADABLE) if "GPUHealths" in objects.forbidden else (
            _health(objects.health.get(name), now))
        target_obj = objects.targets.get(name)
        try:
            target = None if target_obj is None else powertarget.parse_object(target_obj, name)
        except powertarget.InvalidTarget:
            target = None  # said once, in the node's row
        limits = {} if target_obj is None else powertarget.reported_limits(target_obj)
        indices = sorted(set(range(count or 0)) | health.keys() | limits.keys()
                         | (set(target.gpu_w) if target else set()))
        for i in indices:
            cordon = "cordoned" if i in cordoned else _absent(objects, "Nodes")
            rows.append((f"{name}/{i}", cordon, health.get(i, health_note),
                         absent if target is None else target.watts_for(i),
                         limits.get(i, absent)))
    return table(("GPU", "CORDON", "HEALTH", "TARGET W", "LIMIT W"), rows)


def _gpu_count(node: Mapping[str, Any] | None, spec: Mapping[str, Any]) -> int | None:
    capacity = str(((node or {}).get("status") or {}).get("capacity", {}).get(GPU_RESOURCE, ""))
    if capacity.isascii() and capacity.isdigit() and len(capacity) < 4:
        return int(capacity)
    per_node = spec.get("gpusPerNode")
    return per_node if isinstance(per_node, int) else None


def _health(obj: Mapping[str, Any] | None, now: float) -> tuple[dict[int, str], str]:
    """Each GPU's state as its GPUHealth publishes it, and what a GPU it does not list shows."""
    if obj is None:
        return {}, "Unknown (no GPUHealth)"
    try:
        published = gpuhealth.parse(obj)
    except gpuhealth.MalformedHealth as exc:
        return {}, f"Unknown ({exc})"
    if now - published.observed_at > gpuhealth.REFRESH_S * gpuhealth.STALE_REFRESHES:
        return {}, f"Unknown (GPUHealth {now - published.observed_at:.0f} s old)"
    states = {}
    for gpu in published.health.gpus:
        state = gpuhealth.STATE_NAMES[gpu.state]
        detail = ", ".join(filter(None, (
            gpu.reason, gpu.xids and "XID " + ",".join(map(str, gpu.xids)))))
        states[gpu.index] = f"{state} ({detail})" if detail else state
    return states, "Unknown (not listed)"
