"""manifests/monitoring: the alert rules pass promtool's checks and their unit tests, every PromQL
expression (rules and dashboard) is accepted by a real Prometheus, every dashboard query returns
data from this project's own exporters, and the PodMonitors select what the manifests run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import yaml
from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from ntp.nodeagent.metrics import serve
from tessera_agents.power.metrics import AgentCollector, GpuStatus, NodeStatus
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger
from tessera_dev.controlplane.prometheus import Prometheus
from tessera_dev.controlplane.prometheus import rule_groups as prometheus_rule_groups
from tessera_dev.simnode.dcgm import render
from tessera_dev.simnode.server import exporter_endpoint
from tessera_operator import workload

pytestmark = pytest.mark.monitoring

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
SCRAPE_INTERVAL_S = 1  # the prometheus fixture's
# Grafana's $__rate_interval is at least four scrape intervals: two samples in every window
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"
PromFactory = Callable[[Mapping[str, Sequence[str]]], Prometheus]


def rule_groups() -> dict:
    return prometheus_rule_groups(MONITORING / "alerts.yaml")


def rule_exprs() -> list[str]:
    return [rule["expr"] for group in rule_groups()["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads((MONITORING / "dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    """Every panel query and every variable's metric selector, with the variables set to match
    anything, as Grafana's "All" does."""
    board = dashboard()
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *\w+\)", variable["query"]["query"])
            assert match, variable
            exprs.append(match.group(1))
    return [e.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", ".*")
            .replace("$ntpjob", ".*").replace("$node", ".*") for e in exprs]


@pytest.fixture
def rule_dir(tmp_path: Path) -> Path:
    """The PrometheusRule's groups as the plain rule file its promtool tests name."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not on PATH: `make setup` installs Debian's prometheus",
                    pytrace=False)
    (tmp_path / "tessera-rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copy(MONITORING / "alerts.test.yaml", tmp_path)
    return tmp_path


def promtool(*args: str, cwd: Path) -> str:
    done = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_the_rules_and_their_unit_tests_pass(rule_dir: Path) -> None:
    out = promtool("check", "rules", "tessera-rules.yaml", cwd=rule_dir)
    assert f"SUCCESS: {len(rule_exprs())} rules found" in out
    out = promtool("test", "rules", "alerts.test.yaml", cwd=rule_dir)
    assert "SUCCESS" in out
    tested = set(re.findall(r"alertname: (\w+)", (rule_dir / "alerts.test.yaml").read_text()))
    alerts = {rule["alert"] for group in rule_groups()["groups"] for rule in group["rules"]
              if "alert" in rule}
    assert tested == alerts == {"TesseraGPULost", "TesseraReplicaDegraded", "TesseraGoodputLow",
                                "TesseraBoostStuck", "TesseraPowerLimitOffTarget",
                                "TesseraPowerAgentHolding"}


def test_the_dashboard_loads_with_the_panels_asked_for() -> None:
    board = dashboard()
    titles = [panel["title"] for panel in board["panels"]]
    assert len({panel["id"] for panel in board["panels"]}) == len(titles)
    for wanted in ("Goodput", "Badput by category", "Tensor-parallel degree per replica",
                   "GPU power limit and target", "DCGM power draw",
                   "DCGM last XID and failing health watches"):
        assert wanted in titles
    for panel in board["panels"]:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"


@pytest.fixture
def exporters() -> Iterator[dict[str, list[str]]]:
    """One of each exporter the dashboard reads: a trainer's ledger, a power agent, a node's
    DCGM page (4.9; GPU 2 fell off the bus, GPU 3 hit the application error XID 13), each on a
    free loopback port."""
    clock = [100.0]
    ledger = Ledger(lambda: clock[0])
    ledger.set_layout({0: 7, 1: 8})
    clock[0] += 5
    ledger.enter(Phase.TRAINING)
    for step in (1, 2):
        clock[0] += 1
        ledger.step_done(step, samples=8, tokens=8 * 256)
    trainer = serve(ledger, "127.0.0.1", 0, {"ntpjob": "llama-small", "replica": "0"})

    status = NodeStatus(
        node="gpu-node-0", rack="rack-0", budget_mw=4_800_000, rack_budget_mw=9_600_000,
        holding=False, reason="following target",
        gpus=tuple(GpuStatus(i, f"GPU-{i}", 550_000, 650_000, 650_000, True, 650_000, 1980)
                   for i in range(2)))
    agent_registry = CollectorRegistry(auto_describe=False)
    agent_registry.register(AgentCollector(lambda: status))
    agent, _thread = start_http_server(0, "127.0.0.1", agent_registry)

    gpus = SimBackend(count=4, node="gpu-node-0")
    gpus.fail(2, xid=79)
    gpus.fail(3, xid=13)
    dcgm = exporter_endpoint("127.0.0.1", 0, lambda: render(
        gpus.snapshot(), hostname="gpu-node-0", generation="4.9"))
    yield {"trainer": [f"127.0.0.1:{trainer.server_port}"],
           "power-agent": [f"127.0.0.1:{agent.server_port}"],
           "dcgm-exporter": [f"127.0.0.1:{dcgm.server_address[1]}"]}
    for server in (trainer, agent, dcgm):
        server.shutdown()
        server.server_close()


def test_every_query_is_accepted_and_the_dashboard_shows_data(
        prometheus: PromFactory, exporters: dict[str, list[str]]) -> None:
    prom = prometheus(exporters)
    for expr in rule_exprs():
        prom.query(expr)  # raises with Prometheus' message if refused
    for expr in dashboard_exprs():
        # a name misspelt against the exporters would stay empty until the timeout
        assert prom.wait_for(expr, timeout=30), expr
    xids = prom.wait_for('{__name__=~"DCGM_FI_DEV_XID_ERRORS?"} > 0')
    assert sorted((s.labels["gpu"], s.value) for s in xids) == [("2", 79.0), ("3", 13.0)]
    # the GPU-lost rule over the simulator's real page: the fallen GPU, not the XID 13 one
    (gpu_lost,) = (rule["expr"] for group in rule_groups()["groups"] for rule in group["rules"]
                   if rule.get("alert") == "TesseraGPULost")
    assert [(s.labels["hostname"], s.labels["gpu"]) for s in prom.query(gpu_lost)] == [
        ("gpu-node-0", "2")]


def _podmonitors() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(
        (MONITORING / "podmonitors.yaml").read_text())}


def _scraped_port(monitor: dict, pod: dict) -> int | None:
    """The port a PodMonitor scrapes on `pod` (None: it does not select the pod), as the
    prometheus-operator matches them: every matchLabels pair, the endpoint's port by name."""
    selector = monitor["spec"]["selector"]["matchLabels"]
    if not selector.items() <= (pod["metadata"].get("labels") or {}).items():
        return None
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
             for p in c.get("ports", [])}
    return ports.get(monitor["spec"]["podMetricsEndpoints"][0]["port"])


def test_the_power_agent_podmonitor_selects_the_daemonsets_pods() -> None:
    daemonset = yaml.safe_load((ROOT / "manifests/power-controller/daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]
    port = _scraped_port(_podmonitors()["tessera-power-agents"], pod)
    assert port is not None and int(pod["metadata"]["annotations"]["prometheus.io/port"]) == port


def test_the_trainer_podmonitor_selects_the_operators_trainer_pods_only() -> None:
    """On a prometheus-operator cluster the goodput comes from the pods the operator makes:
    the monitor selects its trainer pods at the port their annotations name (what the local
    cluster scrapes), and not its rendezvous pod, which serves no metrics."""
    job = yaml.safe_load((ROOT / "manifests/examples/ntpjob-local.yaml").read_text())
    job["metadata"] |= {"namespace": "default", "uid": "u-1"}
    trainer = workload.trainer_pod(job, 0, "gpu-node-0")
    monitor = _podmonitors()["tessera-trainers"]
    annotated = int(trainer["metadata"]["annotations"]["prometheus.io/port"])
    assert _scraped_port(monitor, trainer) == annotated
    assert _scraped_port(monitor, workload.rendezvous_pod(job)) is None


def test_kustomize_builds_the_monitoring_bundle() -> None:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not on PATH (README: prerequisites)", pytrace=False)
    done = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout))
    assert kinds == [("ConfigMap", "tessera-dashboard"), ("PodMonitor", "tessera-power-agents"),
                     ("PodMonitor", "tessera-trainers"), ("PrometheusRule", "tessera")]
    board = next(d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "ConfigMap")
    assert json.loads(board["data"]["dashboard.json"]) == dashboard()
