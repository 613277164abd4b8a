"""Whether the power agents have settled a set of nodes: each node's agent says so on its metrics
page (`tessera_power_agent_settled`: no target, every GPU that answers at the base cap inside the
node's last share), read from the agent pod's address or, where that cannot be reached (outside
the cluster), through the API server's pod proxy.

`unsettled` does the reads; `parse_page` and `node_left` are pure.
"""

from __future__ import annotations

import http.client
import re
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera_cli import kube
from tessera_contracts.powertarget import LIMIT_METRIC, SETTLED_METRIC, TARGET_METRIC

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

AGENT_SELECTOR = "app.kubernetes.io/name=tessera-power-agent"
AGENT_CONTAINER, METRICS_PORT = "agent", "metrics"
READ_TIMEOUT_S = 3.0
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_page(text: str) -> list[Sample]:
    """The samples of a Prometheus text page; lines that are not samples are skipped."""
    samples = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found is None or line.startswith("#"):
            continue
        try:
            value = float(found[3])
        except ValueError:
            continue
        samples.append(Sample(found[1], dict(_LABEL.findall(found[2] or "")), value))
    return samples


def node_left(samples: Iterable[Sample], node: str) -> str | None:
    """None when the page says `node` is settled; else what is left, in a few words."""
    samples = [s for s in samples if s.labels.get("node") == node]
    if any(s.name == SETTLED_METRIC and s.value == 1 for s in samples):
        return None
    limits = {s.labels.get("gpu"): s.value for s in samples if s.name == LIMIT_METRIC}
    targets = {s.labels.get("gpu"): s.value for s in samples if s.name == TARGET_METRIC}
    gpus = []
    for gpu in sorted(targets.keys() | limits.keys(), key=lambda g: int(g or -1)):
        limit, target = limits.get(gpu), targets.get(gpu)
        if limit is None:
            gpus.append(f"GPU {gpu} not answering")
        elif target is not None and limit != target:
            gpus.append(f"GPU {gpu} at {limit:g} W, settling to {target:g} W")
    return ", ".join(gpus) or "not settled yet (its agent still acts on a target)"


def unsettled(api: ApiClient, namespace: str, nodes: Iterable[str]) -> dict[str, str]:
    """Node -> what is left there, for each of `nodes` whose power agent (in `namespace`) does
    not report it settled or cannot be read."""
    nodes = sorted(set(nodes))
    if not nodes:
        return {}
    pods = kube.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector="
                                    f"{AGENT_SELECTOR}").get("items") or []
    agents = {p["spec"].get("nodeName"): p for p in pods
              if not p["metadata"].get("deletionTimestamp")}
    with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
        found = dict(zip(nodes, pool.map(lambda n: _left(api, agents.get(n), n), nodes),
                         strict=True))
    return {node: left for node, left in found.items() if left is not None}


def _left(api: ApiClient, pod: Mapping[str, Any] | None, node: str) -> str | None:
    if pod is None:
        return "no power agent pod on the node"
    try:
        return node_left(parse_page(_page(api, pod)), node)
    except kube.KubeError as exc:
        return f"power agent {pod['metadata']['name']} unreachable: {exc}"


def _page(api: ApiClient, pod: Mapping[str, Any]) -> str:
    """The agent's metrics page: from its address, else through the API server's pod proxy (the
    API server refuses to proxy to a loopback address, which a local cluster's pods have)."""
    meta, address = pod["metadata"], (pod.get("status") or {}).get("podIP")
    port = next((p.get("containerPort") for c in pod["spec"].get("containers") or []
                 if c.get("name") == AGENT_CONTAINER for p in c.get("ports") or []
                 if p.get("name") == METRICS_PORT), None)
    if port is None:
        raise kube.KubeError(f"no container port {METRICS_PORT!r} on its {AGENT_CONTAINER!r}")
    direct = "no address yet"
    if address:
        host = f"[{address}]" if ":" in address else address
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics",
                                        timeout=READ_TIMEOUT_S) as page:
                return page.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            direct = str(getattr(exc, "reason", None) or exc)
    try:
        return kube.get_text(api, f"/api/v1/namespaces/{meta['namespace']}/pods/"
                                  f"{meta['name']}:{port}/proxy/metrics")
    except kube.KubeError as exc:
        raise kube.KubeError(f"at its address: {direct}; through the API server: {exc}") from exc
