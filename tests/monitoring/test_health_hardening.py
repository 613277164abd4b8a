"""A hostile or broken exporter cannot stall the health agent, and a GPU off the bus reads as
failed to everyone: a server that trickles its headers is abandoned within the fetch bound and
the next good page is published; XID 79 is `Failed` in GPUHealth whatever the jobs' fatalXIDs,
which still decide every other XID."""

from __future__ import annotations

import socketserver
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_agents.health.agent import FetchError, KubePublisher, as_facts, fetch_page
from tessera_agents.health.dcgm import classify
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.api import GPU_HEALTH_PLURAL, GROUP, VERSION
from tessera_contracts.gpuhealth import PublishedHealth, read, render
from tessera_dev import probes
from tessera_dev.simnode import dcgm
from tessera_operator import health

pytestmark = pytest.mark.hardening

GPUS = 8
FETCH_BOUND_S = 1.0
TRICKLE_EVERY_S = 0.5


class Exporter:
    """An exporter on loopback that, while `trickling`, sends the status line and then one
    header byte every TRICKLE_EVERY_S for as long as the client stays; otherwise the simulated
    GPUs' page. `trickled` counts the header bytes sent to clients that went away."""

    def __init__(self, gpus: SimBackend, hostname: str) -> None:
        self.gpus, self.hostname = gpus, hostname
        self.trickling = True
        self.trickled: list[int] = []
        self.closing = threading.Event()
        exporter = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                if exporter.trickling:
                    exporter.trickle(self.wfile)
                    return
                body = dcgm.render(exporter.gpus.snapshot(), hostname=exporter.hostname,
                                   generation="4.9").encode()
                self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

        socketserver.ThreadingTCPServer.daemon_threads = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trickle(self, out: Any) -> None:
        sent = 0
        try:
            out.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self.closing.wait(TRICKLE_EVERY_S):
                out.write(b"a")
                out.flush()
                sent += 1
        except OSError:  # the client went away: the end of this response
            self.trickled.append(sent)

    def stop(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def node() -> str:
    return f"hardened-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gpus(node: str) -> SimBackend:
    return SimBackend(count=GPUS, node=node)


@pytest.fixture
def exporter(gpus: SimBackend, node: str) -> Iterator[Exporter]:
    running = Exporter(gpus, node)
    yield running
    running.stop()


def test_a_header_trickling_exporter_is_abandoned_within_the_fetch_bound(
        exporter: Exporter) -> None:
    started = time.monotonic()
    with pytest.raises(FetchError, match=f"no page within {FETCH_BOUND_S:g} s"):
        fetch_page(exporter.url, FETCH_BOUND_S)
    # the margin is the bound itself: the deadline, not the server, ended the read
    assert time.monotonic() - started < 2 * FETCH_BOUND_S
    probes.poll_until(lambda: exporter.trickled, timeout=10 * TRICKLE_EVERY_S,
                      error=lambda _: AssertionError("the server never saw the client go"))
    exporter.trickling = False
    assert "DCGM_FI_DEV_XID_ERROR" in fetch_page(exporter.url, FETCH_BOUND_S)


@pytest.fixture
def objects(tessera_crds, admin_api: client.ApiClient,
            node: str) -> Iterator[client.CustomObjectsApi]:
    """The GPUHealth API; the node's object is deleted after the test."""
    api = client.CustomObjectsApi(admin_api)
    yield api
    with suppress(ApiException):  # not created: the test ended before
        api.delete_cluster_custom_object(GROUP, VERSION, GPU_HEALTH_PLURAL, node)


def _read(objects: client.CustomObjectsApi, node: str) -> dict[str, Any]:
    found = objects.list_cluster_custom_object(GROUP, VERSION, GPU_HEALTH_PLURAL,
                                               field_selector=f"metadata.name={node}")["items"]
    return found[0] if found else {}


def _states(obj: dict[str, Any]) -> dict[int, tuple[str, tuple[int, ...]]]:
    return {g["index"]: (g["state"], tuple(g["xids"]))
            for g in obj.get("status", {}).get("gpus", [])}


def test_the_agent_goes_on_past_a_trickling_exporter_and_publishes_a_gpu_off_the_bus_failed(
        control_plane, objects: client.CustomObjectsApi, exporter: Exporter, gpus: SimBackend,
        node: str) -> None:
    """The agent process reads a trickling exporter, abandons each read at its bound and logs
    it; once the exporter answers, GPU 3's XID 79 reaches the node's GPUHealth as Failed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera_agents.health.main", "--node", node,
         "--kubeconfig", str(control_plane.kubeconfig), "--exporter-url", exporter.url,
         "--interval", "0.2", "--fetch-timeout", f"{FETCH_BOUND_S:g}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        probes.poll_until(lambda: len(exporter.trickled) >= 2, timeout=30,
                          error=lambda _: AssertionError("the agent did not abandon its reads"))
        assert _read(objects, node).get("status", {}).get("exporter", {}).get("error", "") \
            .startswith("exporter unreachable")
        gpus.fail(3, xid=79)
        exporter.trickling = False
        published = probes.poll_until(
            lambda: _read(objects, node), lambda obj: _states(obj).get(3, ("",))[0] == "Failed",
            timeout=30, error=lambda obj: AssertionError(f"GPU 3 not published failed: {obj}"))
        assert _states(published)[3] == ("Failed", (79,))
        assert published["status"]["failedGPUs"] == "3"
        assert "fell off the bus" in published["status"]["gpus"][3]["reason"]
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, out
        assert f"no page within {FETCH_BOUND_S:g} s" in out
        assert "answers again" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_gpu_off_the_bus_is_failed_for_every_job_and_the_job_decides_other_xids(
        admin_api: client.ApiClient, objects: client.CustomObjectsApi, gpus: SimBackend,
        node: str) -> None:
    gpus.fail(3, xid=79)
    gpus.fail(5, xid=48)  # double-bit ECC: fatal only for the jobs that list it
    page = dcgm.render(gpus.snapshot(), hostname=node, generation="4.9")
    now = time.time()
    observed = as_facts(classify(page, gpus=GPUS, fatal_xids=(), hostname=node, now=now))
    KubePublisher(admin_api, timeout_s=10)(
        render(PublishedHealth(node, "http://x/metrics", now, observed)))
    obj = _read(objects, node)
    assert _states(obj)[3] == ("Failed", (79,)) and _states(obj)[5] == ("Healthy", (48,))
    assert obj["status"]["failedGPUs"] == "3" and obj["status"]["xidGPUs"] == "3,5"

    def failures(fatal_xids: list[int] | None) -> dict[tuple[str, int], str]:
        return health.from_gpu_health([read(obj)], GPUS, fatal_xids, now=now,
                                      nodes=[node]).reasons

    tolerant = failures([])
    assert tolerant.keys() == {(node, 3)}
    assert health.from_gpu_health([read(obj)], GPUS, [], now=now, nodes=[node]).failed == \
        tolerant.keys()
    assert "reports it Failed: XID 79: the GPU fell off the bus" in tolerant[(node, 3)]
    strict = failures([48])
    assert strict.keys() == {(node, 3), (node, 5)}
    assert strict[(node, 5)] == "recent XID 48, fatal by the job's fatalXIDs"
    assert failures(None)[(node, 5)] == "recent XID 48, fatal by the device plugin's rule"
    # an agent from before publishes 79 as Healthy: every job still counts the GPU failed
    obj["status"]["gpus"][3].update(state="Healthy")
    assert failures([])[(node, 3)] == \
        "recent XID 79 (the GPU fell off the bus), fatal for every job"

