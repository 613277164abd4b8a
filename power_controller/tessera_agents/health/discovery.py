"""Which dcgm-exporter serves this node: EndpointSlices of the exporter's Service -> its URL.

The NVIDIA GPU Operator runs dcgm-exporter as a DaemonSet without host networking: each node's
exporter is a pod with an address of its own, behind the Service `nvidia-dcgm-exporter` in
namespace `gpu-operator`. The Service's EndpointSlices (label `kubernetes.io/service-name`) name
every exporter pod's address with the node it runs on, so the node agent finds its own exporter
with a read of those slices: no pod specs, no node list. Pure: the agent lists the slices
(`agent.SliceLister`) and hands their dicts, as the API server serves them, to `exporter_url`.

Where the Service's slices cannot name the pods (the local cluster's pod addresses are on
loopback, which the API server refuses in an EndpointSlice), the agent reads the exporter pods
on its node instead (`--exporter-discovery pods`): `exporter_url_from_pods` picks the same
endpoint from them, a ready pod's address and its container port by name or number.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The GPU Operator's names (and those of the standalone dcgm-exporter Helm chart's defaults but
# the namespace): its DaemonSet's pods, their Service and the port the exporter listens on.
DEFAULT_NAMESPACE = "gpu-operator"
DEFAULT_SERVICE = "nvidia-dcgm-exporter"
DEFAULT_PORT = "9400"


class NotFound(LookupError):
    """No endpoint of the Service serves this node (yet): the reason, in one line."""


def _port(ports: Iterable[Mapping[str, Any]], wanted: str) -> int | None:
    """The slice's port named `wanted`, or numbered `wanted` when it is a number."""
    for port in ports:
        if (port.get("protocol") or "TCP") != "TCP":
            continue
        number = port.get("port")
        if wanted.isdigit() and number == int(wanted):
            return number
        if port.get("name") == wanted and isinstance(number, int):
            return number
    return None


def _ready(endpoint: Mapping[str, Any]) -> bool:
    # an absent `ready` is to be read as ready (discovery.k8s.io/v1 EndpointConditions)
    return (endpoint.get("conditions") or {}).get("ready") is not False


def _host(address: str) -> str:
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address


def exporter_url(slices: Iterable[Mapping[str, Any]], *, node: str, port: str,
                 service: str = DEFAULT_SERVICE) -> str:
    """`http://ADDRESS:PORT/metrics` of the ready endpoint on `node` among the Service's
    EndpointSlices; NotFound says why there is none. Of several (a replaced exporter pod still
    terminating beside its successor), the ready one whose pod sorts last by name and address
    is taken, so that repeated reads agree."""
    found: list[tuple[bool, str, str, int]] = []
    seen_node = False
    for piece in slices:
        if (piece.get("addressType") or "") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no pod
        number = _port(piece.get("ports") or [], port)
        for endpoint in piece.get("endpoints") or []:
            if endpoint.get("nodeName") != node:
                continue
            seen_node = True
            addresses = [a for a in endpoint.get("addresses") or [] if _is_ip(a)]
            if number is None or not addresses:
                continue
            pod = (endpoint.get("targetRef") or {}).get("name") or ""
            found.append((_ready(endpoint), pod, addresses[0], number))
    if not found:
        if seen_node:
            raise NotFound(f"the endpoint of Service {service} on node {node} has no TCP port "
                           f"{port!r}")
        raise NotFound(f"no endpoint of Service {service} on node {node} (is its exporter pod "
                       "running and ready?)")
    ready, _, address, number = max(found)
    if not ready:
        raise NotFound(f"the endpoint of Service {service} on node {node} is not ready")
    return f"http://{_host(address)}:{number}/metrics"


def _is_ip(text: object) -> bool:
    try:
        ipaddress.ip_address(str(text))
    except ValueError:
        return False
    return True


def exporter_url_from_pods(pods: Iterable[Mapping[str, Any]], *, node: str, port: str,
                           selector: str) -> str:
    """`http://ADDRESS:PORT/metrics` of the ready exporter pod on `node` among `pods` (those the
    `selector` matched), the port a container port named or numbered `port`; NotFound says why
    there is none."""
    found: list[tuple[bool, str, str, int]] = []
    for pod in pods:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        address = status.get("podIP") or ""
        if spec.get("nodeName") != node or not _is_ip(address):
            continue
        number = _port(((p | {"port": p.get("containerPort")})
                        for c in spec.get("containers") or [] for p in c.get("ports") or []),
                       port)
        if number is None:
            raise NotFound(f"exporter pod {pod['metadata']['name']} on node {node} has no TCP "
                           f"port {port!r}")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        found.append((ready, pod["metadata"]["name"], address, number))
    if not found:
        raise NotFound(f"no exporter pod ({selector}) on node {node} with an address")
    ready, name, address, number = max(found)
    if not ready:
        raise NotFound(f"exporter pod {name} on node {node} is not ready")
    return f"http://{_host(address)}:{number}/metrics"
