"""Prometheus HTTP service discovery from the API server: what `kubernetes_sd_configs` would find.

Debian's Prometheus is built without Kubernetes discovery, so this endpoint lists nodes and pods
from the API server on each request (Prometheus asks every refresh interval) and answers with
target groups carrying the same `__meta_kubernetes_*` labels Kubernetes discovery attaches. The
scrape config's relabelling (`prometheus.kubernetes_scrape_configs`) is then the one a real
cluster uses. It reads with an identity that may only list nodes and pods; when the API server
does not answer it says 503, and Prometheus keeps the targets it had.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
NODE, POD = "__meta_kubernetes_node_", "__meta_kubernetes_pod_"
API_TIMEOUT_S = 5.0

log = logging.getLogger("tessera.discovery")


def label_name(name: str) -> str:
    """A Kubernetes label or annotation key as Prometheus writes it into a label name."""
    return _INVALID.sub("_", name)


def _mapped(prefix: str, kind: str, items: Mapping[str, str] | None) -> dict[str, str]:
    labels = {}
    for key, value in (items or {}).items():
        labels[f"{prefix}{kind}_{label_name(key)}"] = value
        labels[f"{prefix}{kind}present_{label_name(key)}"] = "true"
    return labels


def node_targets(nodes: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One group per node, at its first address, as role `node` does."""
    groups = []
    for node in nodes:
        meta, status = node["metadata"], node.get("status") or {}
        addresses = status.get("addresses") or []
        if not addresses:
            continue
        labels = {f"{NODE}name": meta["name"],
                  **_mapped(NODE, "label", meta.get("labels")),
                  **_mapped(NODE, "annotation", meta.get("annotations"))}
        for address in addresses:
            labels.setdefault(f"{NODE}address_{address['type']}", address["address"])
        port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
        host = addresses[0]["address"]
        groups.append({"targets": [f"{host}:{port}" if port else host], "labels": labels})
    return groups


def pod_targets(pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One target per declared container port of every pod with an IP (one portless target for
    a pod that declares none), as role `pod` does."""
    groups = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        ip = status.get("podIP")
        if not ip:
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        base = {
            "__meta_kubernetes_namespace": meta["namespace"],
            f"{POD}name": meta["name"], f"{POD}ip": ip, f"{POD}uid": meta.get("uid", ""),
            f"{POD}node_name": spec.get("nodeName", ""),
            f"{POD}host_ip": status.get("hostIP", ""),
            f"{POD}phase": status.get("phase", ""), f"{POD}ready": str(ready).lower(),
            **_mapped(POD, "label", meta.get("labels")),
            **_mapped(POD, "annotation", meta.get("annotations")),
        }
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if owner:
            base[f"{POD}controller_kind"], base[f"{POD}controller_name"] = (
                owner["kind"], owner["name"])
        targets = []
        for container in spec.get("containers", []):
            for port in container.get("ports") or []:
                targets.append((f"{ip}:{port['containerPort']}", {
                    f"{POD}container_name": container["name"],
                    f"{POD}container_port_name": port.get("name", ""),
                    f"{POD}container_port_number": str(port["containerPort"]),
                    f"{POD}container_port_protocol": port.get("protocol", "TCP")}))
        for address, extra in targets or [(ip, {})]:
            groups.append({"targets": [address], "labels": {**base, **extra}})
    return groups


def _serve(api: Any, listen: str) -> ThreadingHTTPServer:
    from kubernetes import client

    core = client.CoreV1Api(api)
    listers = {
        "/targets/node": lambda: node_targets(api.sanitize_for_serialization(
            core.list_node(_request_timeout=API_TIMEOUT_S).items)),
        "/targets/pod": lambda: pod_targets(api.sanitize_for_serialization(
            core.list_pod_for_all_namespaces(_request_timeout=API_TIMEOUT_S).items)),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
            if self.path == "/healthz":
                return self._answer(200, b"ok", "text/plain")
            lister = listers.get(self.path)
            if lister is None:
                return self._answer(404, b"not found", "text/plain")
            try:
                body = json.dumps(lister()).encode()
            except Exception as exc:  # an API outage: Prometheus keeps its last targets
                log.warning("listing for %s failed: %s", self.path, exc)
                return self._answer(503, str(exc).encode(), "text/plain")
            return self._answer(200, body, "application/json")

        def _answer(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            """Prometheus asks every refresh interval: no line per request."""

    host, _, port = listen.rpartition(":")
    return ThreadingHTTPServer((host, int(port)), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-discovery", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--listen", default="127.0.0.1:9900", help="HOST:PORT to serve on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from kubernetes import config

    with config.new_client_from_config(config_file=str(args.kubeconfig)) as api:
        server = _serve(api, args.listen)
        log.info("serving discovery on %s", args.listen)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
