"""The demo's live view: what the job and its GPUs are doing, read from the API and Prometheus.

`observe` takes one snapshot (one read of the job, three instant queries); `render` turns it
into the tables the terminal shows, so the same snapshot always draws the same screen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev.controlplane.prometheus import Prometheus, Sample

LIMIT = "tessera_gpu_power_limit_watts"
TARGET = "tessera_gpu_power_target_watts"
# dcgm-exporter 4.8 and 4.9 name the power draw differently
DRAW = '{__name__=~"DCGM_FI_DEV_POWER_USAGE|DCGM_FI_DEV_BOARD_POWER_WATTS"}'
GOODPUT = "tessera_goodput_ratio"
TP_DEGREE = "tessera_replica_tp_degree"


@dataclass(frozen=True)
class Snapshot:
    """The job's status and its nodes' GPUs at one moment (empty where nothing answered)."""

    status: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Mapping[int, float]] = field(default_factory=dict)  # node -> GPU -> W
    targets: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    draws: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    goodput: Mapping[str, float] = field(default_factory=dict)  # node -> the trainer's ratio
    # replica -> the degrees the trainer pods report for it (every node reports every replica)
    trainer_tp: Mapping[int, frozenset[float]] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return str(self.status.get("phase") or "")

    @property
    def step(self) -> int:
        return int(self.status.get("step") or 0)

    @property
    def tp_layout(self) -> str:
        return str(self.status.get("tpLayout") or "")

    def trainers_at(self, *degrees: int) -> bool:
        """Every trainer pod runs replica r at degrees[r]: the ranks, not only the plan, have
        switched."""
        return dict(self.trainer_tp) == {r: frozenset({float(d)}) for r, d in enumerate(degrees)}

    def failed(self) -> set[tuple[str, int]]:
        """(node, GPU) pairs the job's status names failed (cordoned or lost)."""
        out = set()
        for replica in self.status.get("replicas") or []:
            for item in replica.get("failedGPUs") or []:
                node, _, gpu = str(item).rpartition("/")
                if gpu.isdigit():
                    out.add((node, int(gpu)))
        return out

    def boosted(self, node: str, base_watts: float) -> bool:
        """Every GPU of `node` the job still uses runs above the base cap."""
        alive = [w for g, w in self.limits.get(node, {}).items() if (node, g) not in self.failed()]
        return bool(alive) and min(alive) > base_watts

    def at_targets(self, nodes: Iterable[str]) -> bool:
        """Every GPU of `nodes` has reached the limit its power agent targets."""
        return all(self.limits.get(n) and self.limits.get(n) == self.targets.get(n)
                   for n in nodes)


def _by_gpu(samples: list[Sample]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for s in samples:
        if "node" in s.labels and s.labels.get("gpu", "").isdigit():
            out.setdefault(s.labels["node"], {})[int(s.labels["gpu"])] = s.value
    return out


def observe(api: client.ApiClient, prometheus: Prometheus, namespace: str, job: str) -> Snapshot:
    """One snapshot; a source that does not answer yet leaves its part empty."""
    status: Mapping[str, Any] = {}
    with contextlib.suppress(ApiException):
        status = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, JOB_PLURAL, job, _request_timeout=5).get("status") or {}

    def query(promql: str) -> list[Sample]:
        try:
            return prometheus.query(promql)
        except (OSError, ValueError):
            return []

    trainer_tp: dict[int, frozenset[float]] = {}
    for s in query(f'{TP_DEGREE}{{ntpjob="{job}"}}'):
        if s.labels.get("replica", "").isdigit():
            replica = int(s.labels["replica"])
            trainer_tp[replica] = trainer_tp.get(replica, frozenset()) | {s.value}
    return Snapshot(
        status, _by_gpu(query(LIMIT)), _by_gpu(query(TARGET)), _by_gpu(query(DRAW)),
        {s.labels["node"]: s.value for s in query(f'{GOODPUT}{{ntpjob="{job}"}}')
         if "node" in s.labels}, trainer_tp)


def _watts(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(snap: Snapshot, job: str, nodes: list[str], gpus: int, base_watts: float,
           waiting: str) -> Group:
    """The job line, its replicas, and every GPU's power limit and draw per node."""
    head = Table(title=f"NTPTrainingJob {job}", title_justify="left")
    for name in ("phase", "step", "TP layout", "goodput", "generation"):
        head.add_column(name, justify="right" if name != "phase" else "left")
    goodput = snap.status.get("goodput")
    head.add_row(snap.phase or "-", str(snap.status.get("step", "-")), snap.tp_layout or "-",
                 "-" if goodput is None else f"{goodput:.3f}",
                 str(snap.status.get("layoutGeneration", "-")))

    replicas = Table(title="replicas", title_justify="left")
    for name in ("replica", "TP planned", "TP trainers run", "nodes", "failed GPUs",
                 "boosted"):
        replicas.add_column(name)
    for r in snap.status.get("replicas") or []:
        running = snap.trainer_tp.get(int(r.get("index", -1)), frozenset())
        replicas.add_row(str(r.get("index", "")), str(r.get("tensorParallelSize", "")),
                         ",".join(f"{d:.0f}" for d in sorted(running)) or "-",
                         ",".join(r.get("nodes") or []), ",".join(r.get("failedGPUs") or []),
                         "yes" if r.get("powerBoosted") else "")

    power = Table(title="GPU power limit / draw (W, Prometheus)", title_justify="left")
    power.add_column("node")
    for gpu in range(gpus):
        power.add_column(f"GPU {gpu}", justify="right")
    power.add_column("trainer goodput", justify="right")
    failed = snap.failed()
    for node in nodes:
        cells = []
        for gpu in range(gpus):
            limit = snap.limits.get(node, {}).get(gpu)
            text = f"{_watts(limit)} / {_watts(snap.draws.get(node, {}).get(gpu))}"
            style = ("red" if (node, gpu) in failed
                     else "bold green" if limit is not None and limit > base_watts else "")
            cells.append(Text(text, style=style))
        ratio = snap.goodput.get(node)
        power.add_row(node, *cells, "-" if ratio is None else f"{ratio:.3f}")
    return Group(head, replicas, power, Text(waiting, style="cyan"))
