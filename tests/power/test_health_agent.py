"""The node health agent: a node's dcgm-exporter page (both generations, stale, garbage) to the
node's GPUHealth object, written only when something changed; flaps damped; and on the real API
server, an agent writes its own node's object only."""

from __future__ import annotations

import http.server
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_control_plane import AGENT, NS, OPERATOR, _node, _node_token, _token_client

from tessera_agents.health import agent as health_agent
from tessera_agents.health import main as health_main
from tessera_agents.health.agent import FixedExporter, HealthAgent, KubePublisher, fetch_page
from tessera_agents.health.dcgm import MAX_PAGE_BYTES, STALE_AFTER_S, classify
from tessera_agents.health.discovery import SERVICE_NAME_LABEL
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.api import GPU_HEALTH_PLURAL, GROUP, VERSION
from tessera_contracts.gpuhealth import NodeHealth, PublishedHealth
from tessera_contracts.gpuhealth import render as render_health
from tessera_dev import probes, processes
from tessera_dev.simnode.dcgm import GENERATIONS, render

pytestmark = pytest.mark.power

ROOT = Path(__file__).resolve().parents[2]
HOST = "gpu-node-0"
GPUS = 8
T0 = 1_700_000_000.0


class Clock:
    """Wall and monotonic time moved together by the test."""

    def __init__(self) -> None:
        self.now = T0

    def wall(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - T0


class Exporter:
    """A dcgm-exporter on loopback serving whatever `body` holds (the simulated GPUs' page by
    default); `stop()` makes it unreachable."""

    def __init__(self, gpus: SimBackend, generation: str = "4.9") -> None:
        self.gpus, self.generation, self.hostname = gpus, generation, HOST
        self.body: bytes | None = None
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                body = exporter.body if exporter.body is not None else render(
                    exporter.gpus.snapshot(), hostname=exporter.hostname,
                    generation=exporter.generation).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gpus(clock: Clock) -> SimBackend:
    return SimBackend(count=GPUS, node=HOST, clock=clock.wall)


@pytest.fixture
def exporter(gpus: SimBackend) -> Iterator[Exporter]:
    e = Exporter(gpus)
    yield e
    e.stop()


Written = list[tuple[float, dict[str, Any]]]


def _agent(exporter: Exporter, clock: Clock, **kw: Any) -> tuple[HealthAgent, Written]:
    written: Written = []
    agent = HealthAgent(HOST, FixedExporter(exporter.url, 5.0),
                        lambda body: written.append((clock.now, body)), wall=clock.wall,
                        monotonic=clock.monotonic, **kw)
    return agent, written


def _gpus(body: dict[str, Any]) -> dict[int, tuple[str, tuple[int, ...]]]:
    return {g["index"]: (g["state"], tuple(g["xids"])) for g in body["status"]["gpus"]}


HEALTHY = {i: ("Healthy", ()) for i in range(GPUS)}


@pytest.mark.parametrize("generation", GENERATIONS)
def test_both_exporter_generations_publish_the_xid_of_a_failed_gpu(
        gpus: SimBackend, clock: Clock, generation: str) -> None:
    exporter = Exporter(gpus, generation)
    try:
        agent, written = _agent(exporter, clock)
        agent.step()
        gpus.fail(3, xid=79)
        clock.now += 10
        agent.step()
        gpus.fail(5, xid=13)  # an application error: published, each job decides
        clock.now += 10
        agent.step()
    finally:
        exporter.stop()
    assert [_gpus(body) for _, body in written] == [
        HEALTHY, HEALTHY | {3: ("Failed", (79,))},
        HEALTHY | {3: ("Failed", (79,)), 5: ("Healthy", (13,))}]
    status = written[-1][1]["status"]
    assert (status["xidGPUs"], status["failedGPUs"], status["unknownGPUs"]) == ("3,5", "3", "")
    assert status["observedAt"] == "2023-11-14T22:13:40.000Z"  # T0 + 20 s
    assert status["exporter"] == {"url": exporter.url}
    assert written[-1][1]["metadata"] == {"name": HOST}


def test_a_health_watch_failing_on_something_else_than_an_xid_is_failed(
        gpus: SimBackend, exporter: Exporter, clock: Clock) -> None:
    page = render(gpus.snapshot(), hostname=HOST, generation="4.9").splitlines()
    (mem,) = [i for i, line in enumerate(page)
              if 'gpu="6",' in line and 'health_watch="MEM"' in line]
    page[mem] = page[mem].replace('"DCGM_FR_OK"} 0', '"DCGM_FR_VOLATILE_DBE_DETECTED"} 20')
    exporter.body = "\n".join(page).encode()
    agent, written = _agent(exporter, clock)
    agent.step()
    (_, body), = written
    assert {i for i, (state, _) in _gpus(body).items() if state == "Failed"} == {6}
    assert "DCGM_FR_VOLATILE_DBE_DETECTED" in body["status"]["gpus"][6]["reason"]


def test_an_unchanged_node_is_written_once_per_refresh(
        exporter: Exporter, clock: Clock) -> None:
    agent, written = _agent(exporter, clock, refresh_s=120)
    for _ in range(30):  # 300 s of reads every 10 s
        agent.step()
        clock.now += 10
    assert [t - T0 for t, _ in written] == [0, 120, 240]
    assert all(_gpus(body) == HEALTHY for _, body in written)


def test_a_failed_write_is_tried_again_at_the_next_read(
        exporter: Exporter, clock: Clock) -> None:
    bodies: list[dict[str, Any]] = []
    calls = []

    def flaky(body: dict[str, Any]) -> None:
        calls.append(body)
        if len(calls) == 1:
            raise ConnectionRefusedError("API server down")
        bodies.append(body)

    agent = HealthAgent(HOST, FixedExporter(exporter.url, 5.0), flaky,
                        wall=clock.wall, monotonic=clock.monotonic)
    agent.step()
    clock.now += 10
    agent.step()
    agent.step()
    assert len(calls) == 2 and len(bodies) == 1


def test_a_stale_or_unreachable_exporter_makes_every_gpu_unknown(
        gpus: SimBackend, exporter: Exporter, clock: Clock) -> None:
    agent, written = _agent(exporter, clock)
    agent.step()
    exporter.stop()
    # one missed collection is tolerated: the last page stands until it is STALE_AFTER_S old
    clock.now += STALE_AFTER_S
    assert {g.state.value for g in agent.step().gpus} == {"healthy"}
    assert len(written) == 1
    clock.now += 10
    agent.step()
    assert len(written) == 2
    status = written[-1][1]["status"]
    assert _gpus(written[-1][1]) == {i: ("Unknown", ()) for i in range(GPUS)}
    assert status["unknownGPUs"] == "0,1,2,3,4,5,6,7"
    assert "70 s old" in status["exporter"]["error"]
    assert "Connection refused" in status["exporter"]["error"]
    clock.now += 10
    agent.step()  # still down: nothing new to write
    assert len(written) == 2


def test_an_exporter_that_never_answered_publishes_no_gpu_it_cannot_know(clock: Clock) -> None:
    written: Written = []
    agent = HealthAgent(HOST, FixedExporter("http://127.0.0.1:9/metrics", 1.0),
                        lambda body: written.append((clock.now, body)), wall=clock.wall,
                        monotonic=clock.monotonic)
    agent.step()
    (_, body), = written
    assert body["status"]["gpus"] == []
    assert "exporter unreachable" in body["status"]["exporter"]["error"]
    # told the count, it says which GPUs it cannot see
    told = HealthAgent(HOST, agent.exporter, lambda body: written.append((0, body)), gpus=4)
    told.step()
    assert _gpus(written[-1][1]) == {i: ("Unknown", ()) for i in range(4)}


GARBAGE = [
    pytest.param(b"\x00\xff\xfe" * 1000, id="binary"),
    pytest.param(b'DCGM_FI_DEV_XID_ERROR{gpu="0"} seventy-nine\n', id="malformed-value"),
    pytest.param(b'DCGM_FI_DEV_XID_ERROR{gpu="0",gpu="1"} 79\n', id="label-twice"),
    pytest.param(b'DCGM_FI_DEV_XID_ERROR{gpu="0\n', id="unterminated"),
    pytest.param(b"# " + b"x" * (MAX_PAGE_BYTES + 10), id="over-4MiB"),
    pytest.param(b"<html>502 Bad Gateway</html>", id="not-exposition"),
]


@pytest.mark.parametrize("body", GARBAGE)
def test_a_garbage_page_makes_the_gpus_unknown_and_the_agent_carries_on(
        gpus: SimBackend, exporter: Exporter, clock: Clock, body: bytes,
        caplog: pytest.LogCaptureFixture) -> None:
    agent, written = _agent(exporter, clock)
    agent.step()
    exporter.body = body
    clock.now += 10
    agent.step()
    states = {state for state, _ in _gpus(written[-1][1]).values()}
    assert states == {"Unknown"} and len(written) == 2
    assert written[-1][1]["status"]["exporter"]["error"]
    exporter.body = None  # a good page again
    clock.now += 10
    agent.step()
    assert _gpus(written[-1][1]) == HEALTHY and len(written) == 3


def test_bad_samples_are_skipped_and_each_problem_logged_once(
        gpus: SimBackend, exporter: Exporter, clock: Clock,
        caplog: pytest.LogCaptureFixture) -> None:
    page = render(gpus.snapshot(), hostname=HOST, generation="4.8")
    exporter.body = (page + 'DCGM_FI_DEV_XID_ERRORS{gpu="0",hostname="gpu-node-9"} 79\n'
                     + "".join(f'DCGM_FI_DEV_XID_ERRORS{{gpu="{40 + i}",hostname="x{i}"}} 79\n'
                               for i in range(24))).encode()
    agent, written = _agent(exporter, clock)
    with caplog.at_level(logging.WARNING, logger="tessera.health-agent"):
        for _ in range(3):
            agent.step()
            clock.now += 10
    assert _gpus(written[-1][1]) == HEALTHY and len(written) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sum("gpu-node-9" in line for line in lines) == 1
    assert sum("more problems not logged" in line for line in lines) == 1
    assert len(lines) == health_agent.MAX_LOGGED_PROBLEMS + 1


def test_a_gpu_flapping_three_times_in_a_minute_is_written_out_once_and_back_once(
        gpus: SimBackend, exporter: Exporter, clock: Clock) -> None:
    """Read every 5 s; GPU 3 fails (XID 79) at 0, 20 and 40 s and recovers 5 s after each:
    six changes undamped; published, two: its XID from 0 s until it has been clean for the
    hold-down of its third failure, 60 s x 2^2 = 240 s from 45 s."""
    agent, written = _agent(exporter, clock)
    for tick in range(0, 400, 5):
        clock.now = T0 + tick
        if tick in (0, 20, 40):
            gpus.fail(3, xid=79)
        elif tick in (5, 25, 45):
            gpus.restore(3)
        agent.step()
    changes, last = [], None
    for t, body in written:
        gpu3 = _gpus(body)[3]
        if gpu3 != last:
            changes.append((t - T0, gpu3))
            last = gpu3
        assert {i: g for i, g in _gpus(body).items() if i != 3} == {
            i: ("Healthy", ()) for i in range(GPUS) if i != 3}
    assert changes == [(0, ("Failed", (79,))), (285, ("Healthy", ()))]
    # the other writes are refreshes, not changes
    assert [t - T0 for t, _ in written] == [0, 120, 240, 285]
    held = written[1][1]["status"]["gpus"][3]["reason"]
    assert held.startswith("held down after XID 79") and "3 failures" in held


def test_the_shipped_daemonset_runs_the_health_agent_as_configured() -> None:
    docs = yaml.safe_load((ROOT / "manifests/power-controller/daemonset.yaml").read_text())
    pod = docs["spec"]["template"]["spec"]
    (health,) = [c for c in pod["containers"] if c["name"] == "health"]
    assert health["image"] == pod["containers"][0]["image"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in health["env"] if "valueFrom" in e}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    args = health_main._parser().parse_args(
        [a.replace("$(POD_IP)", "10.0.0.7") for a in health["args"]] + ["--node", "n"])
    assert health_main._bad_setting(args) is None
    # the GPU Operator's exporter, found through its Service's EndpointSlices
    assert args.exporter_url is None and args.exporter_discovery == "endpointslices"
    assert (args.exporter_namespace, args.exporter_service, args.exporter_port) == (
        "gpu-operator", "nvidia-dcgm-exporter", "9400")
    assert args.interval == 2 and (args.metrics_addr, args.metrics_port) == ("10.0.0.7", 9403)
    assert health["ports"] == [{"name": "health-metrics", "containerPort": 9403,
                                "protocol": "TCP"}]
    assert health["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health-metrics"}
    assert health["command"] == ["tessera", "health-agent"]


# --- on the real API server -----------------------------------------------------------------


def _read(admin: client.ApiClient, node: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi(admin).get_cluster_custom_object(
            GROUP, VERSION, GPU_HEALTH_PLURAL, node)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def test_an_agent_may_write_only_its_own_nodes_gpu_health(
        control_plane, admin_api: client.ApiClient, power_api, gpus: SimBackend,
        clock: Clock, namespace: str) -> None:
    mine, other = _node(), _node()
    agent_api = _token_client(control_plane, _node_token(admin_api, mine))
    try:
        publish = KubePublisher(agent_api, timeout_s=10)
        healthy = _body(mine, _health(gpus, mine), clock.now)
        publish(healthy)  # created
        gpus.fail(2, xid=79)
        publish(_body(mine, _health(gpus, mine), clock.now))
        assert _read(admin_api, mine)["status"]["xidGPUs"] == "2"  # updated
        forged = _body(other, _health(gpus, other), clock.now)

        def refused() -> bool:
            try:
                publish(forged)
            except ApiException as err:
                assert err.status == 403, err
                return "only its own node's GPUHealth" in err.body
            _delete(admin_api, other)
            return False

        probes.poll_until(refused, timeout=15, error=lambda _: AssertionError(
            "the admission policy never refused another node's GPUHealth"))
        attempts: list[tuple[Callable[[], object], str]] = [
            # the agents' shared account without a node in its token
            (lambda: KubePublisher(power_api(NS, AGENT), 10)(healthy), "only its own node's"),
            (lambda: KubePublisher(power_api(NS, OPERATOR), 10)(forged), ""),  # no RBAC
            (lambda: KubePublisher(power_api(namespace, "trainer"), 10)(forged), ""),
            (lambda: client.CustomObjectsApi(agent_api).delete_cluster_custom_object(
                GROUP, VERSION, GPU_HEALTH_PLURAL, mine), ""),
        ]
        for attempt, why in attempts:
            with pytest.raises(ApiException) as denied:
                attempt()
            assert denied.value.status == 403 and why in denied.value.body
        assert _read(admin_api, other) is None
        assert _read(admin_api, mine)["status"]["xidGPUs"] == "2"
    finally:
        agent_api.close()
        for node in (mine, other):
            _delete(admin_api, node)


def _delete(admin: client.ApiClient, node: str) -> None:
    try:
        client.CustomObjectsApi(admin).delete_cluster_custom_object(
            GROUP, VERSION, GPU_HEALTH_PLURAL, node)
    except ApiException as err:
        if err.status != 404:
            raise


def _body(node: str, health: NodeHealth, at: float) -> dict[str, Any]:
    return render_health(PublishedHealth(node, "http://x/metrics", at, health))


def _health(gpus: SimBackend, node: str) -> NodeHealth:
    return health_agent.as_facts(classify(render(gpus.snapshot(), hostname=node,
                                                 generation="4.9"), gpus=GPUS, fatal_xids=()))


def test_the_agent_process_publishes_its_nodes_gpu_health(
        control_plane, admin_api: client.ApiClient, power_api, gpus: SimBackend,
        exporter: Exporter, tmp_path: Path) -> None:
    """`python -m tessera_agents.health.main` under a token bound to its node, as the
    DaemonSet runs it, from its exporter to the API server; SIGTERM ends it cleanly."""
    node = exporter.hostname = _node()
    kubeconfig = tmp_path / "agent.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(control_plane.token_kubeconfig(
        _node_token(admin_api, node), f"system:serviceaccount:{NS}:{AGENT}")))
    port = processes.free_ports(1)[0]
    own = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera_agents.health.main", "--kubeconfig", str(kubeconfig),
         "--exporter-url", exporter.url, "--interval", "0.2", "--metrics-addr", "127.0.0.1",
         "--metrics-port", str(port)],
        env={**os.environ, "NODE_NAME": node, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        probes.poll_until(lambda: (_read(admin_api, node) or {}).get("status"), timeout=20,
                          error=lambda _: AssertionError("no GPUHealth published"))
        # ready once published
        probes.poll_until(lambda: probes.responds(f"{own}/readyz"), timeout=20,
                          error=lambda _: AssertionError("/readyz never answered 200"))
        gpus.fail(4, xid=79)
        probes.poll_until(
            lambda: (_read(admin_api, node) or {})["status"]["xidGPUs"] == "4", timeout=20,
            error=lambda _: AssertionError("XID 79 of GPU 4 not published"))
        # the page shows what was published once the write returned, a moment after the API
        failed = f'tessera_health_gpus{{node="{node}",state="failed"}} 1.0'
        page = probes.poll_until(lambda: fetch_page(f"{own}/metrics", 5.0),
                                 lambda p: failed in p, timeout=20, error=AssertionError)
        assert f'tessera_health_exporter_up{{node="{node}"}} 1.0' in page, page
        assert f'tessera_health_gpus{{node="{node}",state="healthy"}} {GPUS - 1}.0' in page
        assert f'tessera_health_read_errors_total{{node="{node}",reason="timeout"}} 0.0' in page
        promtool = subprocess.run(["promtool", "check", "metrics"], input=page, text=True,
                                  capture_output=True, timeout=30)
        assert promtool.returncode == 0, promtool.stdout + promtool.stderr
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, out
        assert "failed [4], XIDs [4], unknown []" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _delete(admin_api, node)


@pytest.mark.parametrize(("gpu", "status"), [
    ({"index": 64, "state": "Healthy"}, {}),
    ({"index": 0, "state": "Broken"}, {}),
    ({"index": 0, "state": "Failed", "xids": list(range(65))}, {}),
    ({"index": 0, "state": "Failed", "reason": "x" * 1025}, {}),
    ({"index": 0, "state": "Healthy"}, {"observedAt": "yesterday"}),
])
def test_api_server_rejects_out_of_schema_gpu_health(
        admin_api: client.ApiClient, power_api, clock: Clock, gpu: dict, status: dict) -> None:
    node = _node()
    body = _body(node, health_agent.as_facts(classify("", gpus=1)), clock.now)
    body["status"].update(status, gpus=[gpu])
    with pytest.raises(ApiException) as refused:
        KubePublisher(admin_api, 10)(body)
    assert refused.value.status == 422
    assert _read(admin_api, node) is None


def test_the_agent_finds_its_exporter_in_the_services_endpointslices(
        admin_api: client.ApiClient, power_api) -> None:
    """With the shipped role, on the real API server: the endpoint of its own node, at the port
    named or numbered as told; none on its node is one clear reason."""
    namespace = f"dcgm-{os.getpid()}"
    core = client.CoreV1Api(admin_api)
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        endpoint = {"addressType": "IPv4", "ports": [{"name": "gpu-metrics", "port": 9400,
                                                      "protocol": "TCP"}]}
        client.DiscoveryV1Api(admin_api).create_namespaced_endpoint_slice(namespace, {
            "metadata": {"name": "exporter-a", "labels": {SERVICE_NAME_LABEL: "exporter"}},
            **endpoint, "endpoints": [
                {"addresses": ["10.8.0.5"], "nodeName": "node-a",
                 "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "e-a"}},
                {"addresses": ["10.8.1.5"], "nodeName": "node-b",
                 "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "e-b"}}]})
        agent_api = power_api(NS, AGENT)
        for port in ("9400", "gpu-metrics"):
            args = health_main._parser().parse_args([
                "--node", "node-b", "--exporter-namespace", namespace,
                "--exporter-service", "exporter", "--exporter-port", port, "--fetch-timeout", "1"])
            exporter = health_main._exporter(args, agent_api)
            with pytest.raises(health_agent.FetchError):  # nobody listens at 10.8.1.5
                exporter.fetch()
            assert exporter.url == "http://10.8.1.5:9400/metrics"
        args.node = "node-c"
        with pytest.raises(health_agent.FetchError, match="no endpoint .* on node node-c") as err:
            health_main._exporter(args, agent_api).fetch()
        assert err.value.reason == "discovery"
    finally:
        core.delete_namespace(namespace)
