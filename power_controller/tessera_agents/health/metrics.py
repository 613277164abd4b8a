"""The health agent's own metrics and readiness, on the pod's address (`--metrics-port`).

/metrics (Prometheus text, every series labelled with the agent's `node`):

  tessera_health_exporter_up             1 when the last read of the exporter gave a page, else 0
  tessera_health_scrape_age_seconds      seconds since the last read that gave a page (absent
                                         before the first)
  tessera_health_read_errors_total       reads that gave no page, by `reason` (agent.READ_ERRORS)
  tessera_health_parse_errors_total      pages read that could not be used (malformed, too
                                         large, no GPU health series)
  tessera_health_gpus                    the node's GPUs by `state` as last published

/readyz answers 200 once the agent has published its node's GPUHealth at least once (whatever
the GPUs' states: Unknown is a fact to publish too), 503 before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera_agents.health.agent import READ_ERRORS, HealthAgent
from tessera_contracts.gpuhealth import State


class HealthCollector(Collector):
    """The agent's state at each scrape; `wall` is the clock of the scrape age."""

    def __init__(self, agent: HealthAgent, wall: Callable[[], float] = time.time) -> None:
        self.agent, self.wall = agent, wall

    def collect(self) -> Iterator[Metric]:
        agent, node = self.agent, [self.agent.node]
        up = GaugeMetricFamily("tessera_health_exporter_up",
                               "1 when the last read of the node's dcgm-exporter gave a page.",
                               labels=["node"])
        up.add_metric(node, 1.0 if agent.up else 0.0)
        yield up
        age = GaugeMetricFamily("tessera_health_scrape_age_seconds",
                                "Seconds since the last read of the exporter that gave a page.",
                                labels=["node"])
        if agent.read_at is not None:
            age.add_metric(node, max(0.0, self.wall() - agent.read_at))
        yield age
        errors = CounterMetricFamily("tessera_health_read_errors",
                                     "Reads of the exporter that gave no page, by reason.",
                                     labels=["node", "reason"])
        for reason in READ_ERRORS:
            errors.add_metric([*node, reason], agent.read_errors.get(reason, 0))
        yield errors
        parse = CounterMetricFamily("tessera_health_parse_errors",
                                    "Exporter pages read that could not be used.",
                                    labels=["node"])
        parse.add_metric(node, agent.parse_errors)
        yield parse
        gpus = GaugeMetricFamily("tessera_health_gpus",
                                 "The node's GPUs by health state, as last published.",
                                 labels=["node", "state"])
        published = agent.published
        for state in State:
            count = sum(g.state is state for g in published.gpus) if published else 0
            gpus.add_metric([*node, state.value], count)
        yield gpus


def serve(agent: HealthAgent, address: str, port: int) -> ThreadingHTTPServer:
    """/metrics and /readyz on `address`:`port`, in a daemon thread; OSError if it cannot bind."""
    registry = CollectorRegistry()
    registry.register(HealthCollector(agent))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/readyz":
                ready = agent.published is not None
                self._answer(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                             b"ok\n" if ready else b"no GPUHealth published yet\n")
            else:
                self._answer(HTTPStatus.NOT_FOUND, b"not found\n")

        def _answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            """Scraped and probed every few seconds: no line per request."""

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    Thread(target=server.serve_forever, name="health-metrics", daemon=True).start()
    return server
