"""GPU health from observed objects: the set of (node, GPU index) the planner must not use.

Pure: it reads objects as the API returns them (plain dicts) and never raises on what a person
typed into an annotation or a node published; a value it cannot use is ignored and reported with
the reason. Every source (the administrative cordon on Nodes, DCGM through each node's GPUHealth,
the nodes lost, the ranks the job's node agents saw die) produces a `Health`, and `merge`
combines them, so the planner sees one shape whatever the signal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera_contracts import gpuhealth
from tessera_contracts.api import CORDON_ANNOTATION
from tessera_contracts.cordon import parse_indices
from tessera_contracts.gpuhealth import (
    REFRESH_S,
    STALE_REFRESHES,
    PublishedHealth,
    State,
    is_fatal,
)
from tessera_contracts.progress import NodeReport, report_period
from tessera_contracts.unreadable import Unreadable

GpuId = tuple[str, int]


GPU_HEALTH_STALE_AFTER_S = STALE_REFRESHES * REFRESH_S
# How long a GPU whose rank died stays out of the layout when DCGM says nothing newer of it. It
# covers DCGM's own delay on a real cluster (dcgm-exporter collects every 30 s by default, the
# health agent reads it every few seconds): a GPU that failed is named by DCGM before it ends,
# and one that did not comes back at most once a minute, should its new rank die again.
RANK_DEATH_HOLD_S = 60.0


@dataclass(frozen=True)
class Health:
    """Failed GPUs, GPUs whose health no source could tell (neither failed nor healthy), and
    why some input was ignored or is unknown (one human-readable line each)."""

    failed: frozenset[GpuId] = frozenset()
    problems: tuple[str, ...] = ()
    unknown: frozenset[GpuId] = frozenset()
    # why a failed GPU is failed, where its source says more than that it is (DCGM's verdict)
    reasons: Mapping[GpuId, str] = field(default_factory=dict)
    # when (Unix seconds) this health changes with no event to tell: a hold that ends
    recheck_at: float | None = None

    def merge(self, other: Health) -> Health:
        times = [t for t in (self.recheck_at, other.recheck_at) if t is not None]
        return Health(self.failed | other.failed, self.problems + other.problems,
                      self.unknown | other.unknown, {**self.reasons, **other.reasons},
                      min(times, default=None))


def from_cordons(nodes: Iterable[Mapping[str, Any]], gpus_per_node: int) -> Health:
    """GPUs an administrator cordoned through the node annotation."""
    failed: set[GpuId] = set()
    problems: list[str] = []
    for node in nodes:
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        value = annotations.get(CORDON_ANNOTATION)
        if value is None:
            continue
        indices, bad = parse_indices(str(value), gpus_per_node)
        failed.update((name, i) for i in indices)
        problems.extend(f"node {name}: {CORDON_ANNOTATION}: {why}, ignored" for why in bad)
    return Health(frozenset(failed), tuple(problems))


# The node lifecycle controller's reason once a node's kubelet stops posting its status (a node
# that never posted any gets NodeStatusNeverUpdated instead: nothing ran there to lose).
NODE_LOST_REASON = "NodeStatusUnknown"


def node_lost(node: Mapping[str, Any]) -> bool:
    """The node stopped reporting: its Ready condition is Unknown because its kubelet went
    silent (the node died whole, or its network did)."""
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "Unknown" and \
                condition.get("reason") == NODE_LOST_REASON
    return False


def from_lost_nodes(nodes: Iterable[Mapping[str, Any]], gpus_per_node: int, *,
                    placed: Iterable[str] = (), leaving: Iterable[str] = (),
                    silent: Iterable[str] = ()) -> Health:
    """Every GPU of a lost node is failed: whatever ran there is out of reach, and the
    survivors elsewhere can go on only without it. A node is lost when it stopped reporting,
    when it is one of the job's `placed` nodes but gone from the API (`nodes` lacks it), when
    the job's trainer pod on it is `leaving` (being deleted), or when it is one of the job's
    nodes and the job's own node agents report it `silent` (its agent's heartbeat stopped:
    `ntp.nodeagent.heartbeat`; in seconds, long before its kubelet's silence shows; the
    reports judged by `heard_silent`). A silent node is lost for as long as its agents report
    it: once it beats again, it is not.

    When every node of the job stopped reporting at once, that is taken for the control
    plane's view failing (as the node lifecycle controller takes a fully disrupted zone), not
    for every node dying: none is lost, and the problems say so. Agents that report a node
    silent are alive: their word stands."""
    nodes = list(nodes)
    present = {node["metadata"]["name"] for node in nodes}
    stopped = sorted(node["metadata"]["name"] for node in nodes if node_lost(node))
    problems: list[str] = []
    if stopped and len(stopped) == len(nodes):
        problems.append(f"every node of the job ({len(stopped)}) stopped reporting at once: "
                        "taken for the control plane's view, not as lost")
        stopped = []
    why = {name: "its kubelet stopped reporting (Ready Unknown)" for name in stopped}
    why |= {name: "its trainer pod is being deleted" for name in sorted(set(leaving))
            if name not in why}
    why |= {name: "it is gone from the API" for name in sorted(set(placed) - present)}
    why |= {name: "the job's node agents lost its heartbeat"
            for name in sorted(set(silent) & (present | set(placed))) if name not in why}
    failed = {(name, i) for name in why for i in range(gpus_per_node)}
    problems += [f"node {name}: {reason}: its GPUs are lost" for name, reason in why.items()]
    return Health(frozenset(failed), tuple(problems))


# A node the job's agents report silent is lost on the word of this many of them (each node has
# two watchers in a job of three nodes or more, `ntp.nodeagent.heartbeat.WATCHED`), or of one
# once its own report is this late past its agent's report period (writes, their latency and
# the nodes' clocks): one pod's report alone never takes another node's GPUs.
SILENT_WITNESSES = 2
REPORT_LATE_S = 3.0


@dataclass(frozen=True)
class Silence:
    """The nodes the job's agents report silent on evidence that does not rest on one pod's
    word (`heard_silent`), why the others are not taken yet, and when one of those would be."""

    nodes: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()
    recheck_at: float | None = None


def heard_silent(reports: Mapping[str, NodeReport | None], now: float | None) -> Silence:
    """The job's nodes its node agents report silent (`NodeReport.silent_nodes`) that count as
    lost: those `SILENT_WITNESSES` other nodes' reports name, and those one names whose own
    report has gone unwritten for its report period (`progress.report_period`) plus
    `REPORT_LATE_S` by `now` (Unix seconds; None: by witnesses only). A node that lives on
    writes its report at least that often, and at once when a generation it runs ends, as a
    real accuser's does; a frozen one writes nothing. `reports`: the job's nodes' (None where
    a node has none)."""
    accusers: dict[str, set[str]] = {}
    for node, report in reports.items():
        for accused in () if report is None else report.silent_nodes:
            if accused != node:
                accusers.setdefault(accused, set()).add(node)
    period = report_period(len(reports))
    silent: set[str] = set()
    problems: list[str] = []
    rechecks: list[float] = []
    for accused, by in sorted(accusers.items()):
        own = reports.get(accused)
        last = None if own is None else own.reported_at
        late_at = None if last is None else last + period + REPORT_LATE_S
        if len(by) >= SILENT_WITNESSES or (now is not None and late_at is not None
                                           and now >= late_at):
            silent.add(accused)
            continue
        then = "" if late_at is None else \
            f", or once its own report is {period + REPORT_LATE_S:.0f} s old"
        problems.append(f"node {accused}: reported silent by {', '.join(sorted(by))} alone: "
                        f"lost when another node's agent agrees{then}")
        if late_at is not None and now is not None:
            rechecks.append(late_at)
    return Silence(frozenset(silent), tuple(problems), min(rechecks, default=None))


def from_rank_deaths(reports: Mapping[str, NodeReport | None], gpus_per_node: int, *,
                     now: float, told_at: Mapping[str, float] | None,
                     hold_s: float = RANK_DEATH_HOLD_S, settled: bool = False) -> Health:
    """The GPUs whose rank died, as their node's agent reports (`NodeReport.rank_deaths`):
    failed at once, so the survivors go on without it in seconds, whatever DCGM says yet.

    A death counts until DCGM's verdict on its node is newer (`told_at`: when each node's
    GPUHealth was observed; None: DCGM is not a health source), which then decides alone: a GPU
    that fell off the bus stays out, one a software fault killed the rank of comes back (through
    a planned join). Without a newer verdict it counts for `hold_s` after the death. A death
    time further than `hold_s` ahead of `now` is not believed (a clock that far off would hold
    the GPU out for good).

    `settled`: a death counts only once that wait is over instead, and from then on: a job that
    restarts on a loss (CKPT-RESTART) places its next attempt by what DCGM says of the GPU
    then, not on a GPU that failed before DCGM could name it (the attempt after would die on
    it too)."""
    failed: dict[GpuId, str] = {}
    problems: list[str] = []
    ends: list[float] = []
    for node, report in sorted(reports.items()):
        if report is None:
            continue
        for index, death in sorted(report.rank_deaths.items()):
            at = death.at
            if index >= gpus_per_node:
                continue  # not a GPU of the job's
            if at - now > hold_s:
                problems.append(f"node {node}: GPU {index}'s rank died {at - now:.0f} s in the "
                                "future by its agent's clock, ignored")
                continue
            waiting = now - at < hold_s and (told_at is None
                                              or told_at.get(node, -math.inf) < at)
            if waiting:
                ends.append(at + hold_s)
            if waiting != settled:
                failed[(node, index)] = "its rank died (its node agent saw it exit" + (
                    f": {death.error})" if death.error else ")")
    if failed and not settled:
        problems.append(f"GPUs {', '.join(f'{n}/{i}' for n, i in sorted(failed))} out of the "
                        f"layout: their rank died; back once DCGM calls them healthy after it, "
                        f"or {hold_s:.0f} s after it without a newer verdict")
    return Health(frozenset(failed), tuple(problems), reasons=failed,
                  recheck_at=min(ends, default=None))


def observed_at(published: Iterable[PublishedHealth | Unreadable]) -> dict[str, float]:
    """When each node's GPUHealth was observed (Unix seconds), for those that parsed."""
    return {report.node: report.observed_at for report in published
            if isinstance(report, PublishedHealth)}


def _ranges(indices: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(indices)))


def from_gpu_health(published: Iterable[PublishedHealth | Unreadable], gpus_per_node: int,
                    fatal_xids: Iterable[int] | None, *, now: float,
                    nodes: Iterable[str] | None = None,
                    max_age: float = GPU_HEALTH_STALE_AFTER_S) -> Health:
    """GPUs that DCGM shows failed for the job, from the nodes' GPUHealth objects as read
    (`gpuhealth.read`).

    A GPU is failed when its node reports it Failed (a DCGM health watch failing on something
    other than an XID, or an XID after which the device is gone: 79, off the bus) or lists a
    recent XID that `gpuhealth.is_fatal` makes fatal for the job: one in `fatal_xids`, the job's
    `failurePolicy.fatalXIDs` (None: the NVIDIA device plugin's rule, every XID but the
    application errors), or one after which the device is gone, whatever the list. It is
    unknown, neither failed nor healthy, when the node reports it Unknown, does not list it,
    published last more than `max_age` seconds before `now` (Unix seconds) or published nothing
    at all (`nodes`: the job's nodes, when given; one without an object is unknown, and objects
    of other nodes are not read). Each node with unknown GPUs gets one line in the problems,
    saying which and why; an object that did not parse (`Unreadable`) makes its node's GPUs
    unknown, and what parsing skipped is in the problems too. The reasons say why each
    failed GPU is failed, for the job's status.
    """
    failed, unknown, problems = _judge(published, gpus_per_node, fatal_xids, now=now,
                                       nodes=nodes, max_age=max_age)
    return Health(frozenset(failed), problems, unknown, failed)


def _why_failed(gpu: gpuhealth.GpuHealth, fatal: frozenset[int] | None) -> str | None:
    """Why the job counts `gpu` failed, None when it does not."""
    if gpu.state is State.FAILED:
        return f"its node reports it Failed: {_shown_reason(gpu.reason or 'no reason given')}"
    ending = [x for x in gpu.xids if is_fatal(x, fatal)]
    if not ending:
        return None
    gone = [f"XID {x} ({gpuhealth.DEVICE_GONE_XIDS[x]}), fatal for every job"
            for x in ending if x in gpuhealth.DEVICE_GONE_XIDS]
    if gone:
        return f"recent {', '.join(gone)}"
    rule = "the device plugin's rule" if fatal is None else "the job's fatalXIDs"
    return f"recent XID {_ranges(ending)}, fatal by {rule}"


def _judge(reports: Iterable[PublishedHealth | Unreadable], gpus_per_node: int,
           fatal_xids: Iterable[int] | None, *,
           now: float, nodes: Iterable[str] | None, max_age: float,
           ) -> tuple[dict[GpuId, str], frozenset[GpuId], tuple[str, ...]]:
    """Failed GPUs with why, unknown GPUs, problems: `from_gpu_health` says how."""
    fatal = None if fatal_xids is None else frozenset(fatal_xids)
    failed: dict[GpuId, str] = {}
    unknown: set[GpuId] = set()
    problems: list[str] = []
    every = range(gpus_per_node)
    published: set[str] = set()
    wanted = None if nodes is None else frozenset(nodes)

    def not_known(node: str, indices: Iterable[int], why: str) -> None:
        indices = sorted(indices)
        if indices:
            unknown.update((node, i) for i in indices)
            problems.append(f"node {node}: GPU health unknown for GPUs {_ranges(indices)}: {why}")

    for report in reports:
        if isinstance(report, Unreadable):
            if report.node is None:
                problems.append("a GPUHealth object without a name, ignored")
            elif wanted is None or report.node in wanted:
                published.add(report.node)
                not_known(report.node, every, f"its GPUHealth is malformed ({report.why})")
            continue
        name, observed = report.node, report.observed_at
        if wanted is not None and name not in wanted:
            continue
        published.add(name)
        if now - observed > max_age:
            not_known(name, every, f"its GPUHealth was published {now - observed:.0f} s ago, "
                                   f"over {max_age:.0f} s (is its health agent running?)")
            continue
        if observed - now > max_age:  # a clock this far ahead would never go stale
            not_known(name, every, f"its GPUHealth claims to be from {observed - now:.0f} s "
                                   "in the future")
            continue
        problems.extend(f"node {name}: GPUHealth: {why}, ignored"
                        for why in report.health.problems)
        # a GPU beyond the job's count per node is not the job's
        listed = {g.index: g for g in report.health.gpus}
        reasons: dict[str, list[int]] = {}
        for i in every:
            gpu = listed.get(i)
            why_failed = None if gpu is None else _why_failed(gpu, fatal)
            if why_failed is not None:
                failed[(name, i)] = why_failed
            elif gpu is None or gpu.state is State.UNKNOWN:
                why = "not listed" if gpu is None else \
                    gpu.reason or f"state {gpuhealth.STATE_NAMES[gpu.state]}"
                reasons.setdefault(_shown_reason(why), []).append(i)
        for why, indices in reasons.items():
            not_known(name, indices, why)
    for node in sorted((wanted or frozenset()) - published):
        not_known(node, every, "the node published no GPUHealth")
    return failed, frozenset(unknown), tuple(problems)


def hold_unknown(health: Health, in_force: Iterable[GpuId] | None,
                 reporting: Iterable[str]) -> Health:
    """`health` with every unknown GPU kept where the generation in force has it: one out of the
    layout (it failed, or was drained, when its health was last known) stays out until a source
    tells again; one in it stays in (unknown is never failed).

    Only GPUs of `reporting` nodes (those that published a GPUHealth, stale or not) are held: a
    node that never published says nothing, and its cordons alone decide. With no generation in
    force (`in_force` None) there is nothing to hold."""
    if in_force is None:
        return health
    nodes, kept = frozenset(reporting), frozenset(in_force)
    held = sorted(g for g in health.unknown - health.failed - kept if g[0] in nodes)
    if not held:
        return health
    by_node: dict[str, list[int]] = {}
    for node, index in held:
        by_node.setdefault(node, []).append(index)
    notes = tuple(f"node {node}: GPUs {_ranges(indices)} stay out of the layout while their "
                  "health is unknown" for node, indices in sorted(by_node.items()))
    return Health(health.failed | frozenset(held), health.problems + notes, health.unknown,
                  health.reasons)


def _shown_reason(reason: str) -> str:
    return reason if len(reason) <= 200 else reason[:200] + "..."
