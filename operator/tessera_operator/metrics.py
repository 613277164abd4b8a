"""The operator's Prometheus metrics and its HTTP endpoint: `/metrics`, `/readyz`, `/healthz`.

The handlers and the reconcile record through the small hooks here; the values live in this
module's own registry, so a test process that imports the operator exports nothing of it.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from urllib3.exceptions import HTTPError

REGISTRY = CollectorRegistry()

RECONCILES = Counter(
    "tessera_operator_reconciles_total",
    "Reconciles finished, by the kind reconciled and result (success; api_error: the API "
    "failed it, retried in 5 s; error: a fault of the operator's, retried at the resync).",
    ["kind", "result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram(
    "tessera_operator_reconcile_duration_seconds",
    "Time one reconcile took, whatever its result, by the kind reconciled.",
    ["kind"], registry=REGISTRY,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
API_ERRORS = Counter(
    "tessera_operator_api_errors_total",
    "API requests that failed and that the operator survived (retried later), by HTTP status "
    "code (`unreachable`: no answer).", ["code"], registry=REGISTRY)
JOBS = Gauge(
    "tessera_operator_jobs",
    "The operator's NTPTrainingJobs by status phase (no phase yet: Pending), as its watch "
    "cache holds them; 0 on a replica that does not lead.", ["phase"], registry=REGISTRY)
LAYOUT_GENERATIONS = Counter(
    "tessera_operator_layout_generations_total",
    "Layout generations the operator published (each a new <job>-layout document).",
    registry=REGISTRY)
LEADER = Gauge(
    "tessera_operator_leader",
    "1 while this replica holds the leader Lease (or runs without leader election) and "
    "reconciles, else 0.", registry=REGISTRY)


@contextmanager
def reconciling(kind: str) -> Iterator[None]:
    """Count and time the reconcile in the block by how it ended; its exception goes on."""
    started = time.perf_counter()
    result = "error"
    try:
        yield
        result = "success"
    except (ApiException, HTTPError) as exc:
        result = "api_error"
        api_error(exc)
        raise
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)
        RECONCILES.labels(kind, result).inc()


def api_error(exc: Exception) -> None:
    """An API request failed and the operator goes on (a later event or timer tries again)."""
    status = exc.status if isinstance(exc, ApiException) else None
    API_ERRORS.labels(str(status) if status else "unreachable").inc()


def count_jobs(by_phase: Mapping[str, Collection[Any]]) -> None:
    """Rebuild the jobs-by-phase gauge from the operator's index of jobs by phase (a phase
    no job has any more reads 0, not its last count)."""
    for phase in {labels[0] for labels in _label_sets(JOBS)} | set(by_phase):
        JOBS.labels(phase).set(len(by_phase.get(phase, ())))


def _label_sets(gauge: Gauge) -> list[tuple[str, ...]]:
    return [tuple(s.labels.values()) for m in gauge.collect() for s in m.samples]


def serve(host: str, port: int, ready: Callable[[], bool], live: Callable[[], bool]
          ) -> Callable[[], None]:
    """Serve `/metrics`, `/readyz` (`ready()`) and `/healthz` (`live()`) on host:port in a
    daemon thread; returns what stops it."""
    metrics_app = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        probes = {"/readyz": ready, "/healthz": live}
        if path in probes:
            ok = probes[path]()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not ready\n"]
        if path == "/metrics":
            return metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    Thread(target=server.serve_forever, name="metrics", daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
    return stop


def responds(url: str, timeout: float = 4.0) -> bool:
    """Whether GET url answers 200 in time (kopf's own liveness endpoint, relayed)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


class _Quiet(WSGIRequestHandler):
    """No log line per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
