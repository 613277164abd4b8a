"""`tessera health-agent`: the node health agent's command line (`agent.py` holds the agent), its
settings checked, its exporter found as asked, its metrics and readiness served (`metrics.py`)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading
from typing import Any, NoReturn

from tessera_agents.bounded import exit_abandoning_calls
from tessera_agents.health import discovery
from tessera_agents.health.agent import (
    DiscoveredExporter,
    Exporter,
    FixedExporter,
    HealthAgent,
    KubePublisher,
    Lister,
)
from tessera_agents.health.metrics import serve as serve_metrics
from tessera_agents.kube import api_client, is_node_name
from tessera_contracts.gpuhealth import MAX_GPUS, REFRESH_S

log = logging.getLogger("tessera.health-agent")


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # IANA_SVC_NAME, not all digits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera health-agent",
        description="Node health agent: publishes this node's GPU health, read from its own "
                    "dcgm-exporter, as the node's GPUHealth object.")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="node name (env NODE_NAME)")
    p.add_argument("--exporter-namespace", default=discovery.DEFAULT_NAMESPACE,
                   help="namespace of the exporter's Service (default: %(default)s)")
    p.add_argument("--exporter-service", default=discovery.DEFAULT_SERVICE,
                   help="the exporter's Service, whose EndpointSlices name this node's exporter "
                        "pod (default: %(default)s)")
    p.add_argument("--exporter-port", default=discovery.DEFAULT_PORT,
                   help="the Service's port, by name or number (default: %(default)s)")
    p.add_argument("--exporter-discovery", choices=("endpointslices", "pods"),
                   default="endpointslices",
                   help="find the exporter in the Service's EndpointSlices (default), or in "
                        "the exporter pods on this node (--exporter-selector; for clusters "
                        "whose pod addresses EndpointSlices cannot hold, such as the local "
                        "one's on loopback)")
    p.add_argument("--exporter-selector", default=f"app={discovery.DEFAULT_SERVICE}",
                   help="label selector of the exporter pods, with --exporter-discovery=pods "
                        "(default: %(default)s)")
    p.add_argument("--exporter-url",
                   help="read this URL instead of finding the exporter: one on the host's "
                        "network, e.g. http://$(HOST_IP):9400/metrics")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between reads")
    p.add_argument("--refresh", type=float, default=REFRESH_S,
                   help="seconds after which an unchanged object is written again")
    p.add_argument("--gpus", type=int, default=0,
                   help="the node's GPU count (0: every GPU seen on the exporter's pages)")
    p.add_argument("--fetch-timeout", type=float, default=5.0,
                   help="seconds for reading one page, in all")
    p.add_argument("--api-timeout", type=float, default=3.0, help="seconds per API server call")
    p.add_argument("--metrics-addr", default=os.environ.get("POD_IP") or "127.0.0.1",
                   help="address of /metrics and /readyz (default: env POD_IP, else loopback)")
    p.add_argument("--metrics-port", type=int, default=9403,
                   help="port of /metrics and /readyz, 0 for none (default: %(default)s)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--log-level", default="INFO")
    return p


def _bad_setting(args: argparse.Namespace) -> str | None:
    if not args.node:
        return "--node (or NODE_NAME) is required"
    if not is_node_name(args.node):
        return f"--node {args.node!r} is not a Kubernetes node name"
    if args.exporter_url is not None and not args.exporter_url.startswith(("http://",
                                                                           "https://")):
        return f"--exporter-url must be an http(s) URL, got {args.exporter_url!r}"
    for flag in ("exporter_namespace", "exporter_service"):
        value = getattr(args, flag)
        if not _DNS_LABEL.fullmatch(value):
            return f"--{flag.replace('_', '-')} {value!r} is not a Kubernetes object name"
    port = args.exporter_port
    if not (port.isdigit() and 0 < int(port) < 65536
            or _PORT_NAME.fullmatch(port) and not port.isdigit()):
        return f"--exporter-port {port!r} is neither a port number nor a port name"
    for flag in ("interval", "refresh", "fetch_timeout", "api_timeout"):
        value = getattr(args, flag)
        if not (value > 0 and math.isfinite(value)):
            return f"--{flag.replace('_', '-')} must be a positive number of seconds, got {value}"
    if not 0 <= args.gpus <= MAX_GPUS:
        return f"--gpus must be 0 to {MAX_GPUS}, got {args.gpus}"
    if not 0 <= args.metrics_port < 65536:
        return f"--metrics-port must be a TCP port or 0, got {args.metrics_port}"
    return None


def _exporter(args: argparse.Namespace, api: Any) -> Exporter:
    if args.exporter_url is not None:
        return FixedExporter(args.exporter_url, args.fetch_timeout)
    from kubernetes import client

    if args.exporter_discovery == "pods":
        pods = Lister(api, client.CoreV1Api(api).list_namespaced_pod, args.api_timeout,
                      namespace=args.exporter_namespace, label_selector=args.exporter_selector,
                      field_selector=f"spec.nodeName={args.node}")
        return DiscoveredExporter(lambda: discovery.exporter_url_from_pods(
            pods(), node=args.node, port=args.exporter_port, selector=args.exporter_selector),
            args.fetch_timeout)
    slices = Lister(api, client.DiscoveryV1Api(api).list_namespaced_endpoint_slice,
                    args.api_timeout, namespace=args.exporter_namespace,
                    label_selector=f"{discovery.SERVICE_NAME_LABEL}={args.exporter_service}")
    return DiscoveredExporter(lambda: discovery.exporter_url(
        slices(), node=args.node, port=args.exporter_port, service=args.exporter_service),
        args.fetch_timeout)


def serve(argv: list[str]) -> NoReturn:
    """The DaemonSet container's command (`tessera_agents.bounded.exit_abandoning_calls`)."""
    exit_abandoning_calls(main, argv)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    bad = _bad_setting(args)
    if bad:
        log.error("%s", bad)
        return 2
    try:
        api = api_client(args.kubeconfig)
    except Exception as err:  # no kubeconfig, no in-cluster environment, a malformed file
        log.error("cannot configure the API client: %s", err)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = HealthAgent(args.node, _exporter(args, api), KubePublisher(api, args.api_timeout),
                        gpus=args.gpus, refresh_s=args.refresh)
    server = None
    if args.metrics_port:
        try:
            server = serve_metrics(agent, args.metrics_addr, args.metrics_port)
        except OSError as err:
            log.error("cannot serve metrics on %s:%d: %s", args.metrics_addr,
                      args.metrics_port, err)
            return 1
    where = args.exporter_url or (
        f"the {args.exporter_discovery} of Service {args.exporter_namespace}/"
        f"{args.exporter_service} port {args.exporter_port}")
    log.info("health agent on node %s reading %s every %g s", args.node, where, args.interval)
    while not stop.is_set():
        try:
            agent.step()
        except Exception:  # a bug in one read must not end the node's health reports
            log.exception("health step failed")
        stop.wait(args.interval)
    if server is not None:
        server.shutdown()
    api.close()
    return 0


if __name__ == "__main__":
    serve(sys.argv[1:])
