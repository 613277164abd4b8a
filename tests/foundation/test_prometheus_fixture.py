"""The Prometheus fixture scrapes a live exporter and answers PromQL through its HTTP API."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

pytestmark = pytest.mark.foundation


@pytest.fixture
def exporter():
    registry = CollectorRegistry()
    gauge = Gauge("tessera_test_power_watts", "power of a fake GPU", ["gpu"], registry=registry)
    # port 0: the kernel picks a free one while binding, so nothing can take it first
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield gauge, f"127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_prometheus_scrapes_the_exporter(prometheus, exporter):
    gauge, target = exporter
    gauge.labels(gpu="3").set(612.5)
    prom = prometheus({"gpus": [target]})
    samples = prom.wait_for("tessera_test_power_watts")
    assert [(s.labels["gpu"], s.labels["job"], s.value) for s in samples] == [("3", "gpus", 612.5)]
    # a new value shows up on a later scrape: Prometheus reads the live exporter
    gauge.labels(gpu="3").set(700.0)
    prom.wait_for("tessera_test_power_watts", lambda s: s and s[0].value == 700.0)
    assert prom.query('up{job="gpus"}')[0].value == 1.0


def test_bad_promql_reports_prometheus_error(prometheus):
    prom = prometheus({})
    with pytest.raises(ValueError, match="parse error"):
        prom.query("sum(")
