"""manifests/monitoring: the alert rules pass promtool's checks and their unit tests, every PromQL
expression (rules and dashboard) is accepted by a real Prometheus, every dashboard query returns
data from this project's own exporters, the panels count a job once however many nodes report it
and read dcgm-exporter's host label under either name, the PodMonitors select what the manifests
run, and the bundle carries the selector label kube-prometheus-stack loads by default."""

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

from ntp.nodeagent.metrics import StepTimes, serve
from tessera_agents.health import metrics as health_metrics
from tessera_agents.health.agent import FixedExporter, HealthAgent
from tessera_agents.power.metrics import AgentCollector, GpuStatus, NodeStatus
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger
from tessera_dev.controlplane.prometheus import Prometheus
from tessera_dev.controlplane.prometheus import rule_groups as prometheus_rule_groups
from tessera_dev.simnode.dcgm import render
from tessera_dev.simnode.server import exporter_endpoint
from tessera_operator import metrics as operator_metrics
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


def _with_variables(expr: str, rate_interval: str) -> str:
    """`expr` with Grafana's variables set as its "All" sets them (match anything)."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$namespace", ".*")
            .replace("$ntpjob", ".*").replace("$node", ".*"))


def dashboard_exprs() -> list[str]:
    """Every panel query and every variable's metric selector, variables set to "All"."""
    board = dashboard()
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *\w+\)", variable["query"]["query"])
            assert match, variable
            exprs.append(match.group(1))
    return [_with_variables(e, RATE_INTERVAL) for e in exprs]


def panel_exprs(title: str, rate_interval: str) -> dict[str, str]:
    """The queries of the panel titled `title` by legend, variables set to "All"."""
    (panel,) = (p for p in dashboard()["panels"] if p["title"] == title)
    return {t["legendFormat"]: _with_variables(t["expr"], rate_interval)
            for t in panel["targets"]}


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
    assert tested == alerts == {"TesseraGPULost", "TesseraDCGMExporterUnreachable",
                                "TesseraReplicaDegraded", "TesseraGoodputLow",
                                "TesseraBoostStuck", "TesseraPowerLimitOffTarget",
                                "TesseraPowerAgentHolding", "TesseraOperatorDown"}


def _sections(markdown: str) -> dict[str, str]:
    """A Markdown file's `## ` sections: the anchor GitHub gives each heading -> its text."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)[1:]
    return {re.sub(r"[^\w\- ]", "", title).strip().lower().replace(" ", "-"): body
            for title, body in zip(parts[::2], parts[1::2], strict=True)}


def test_every_alert_links_its_runbook_which_says_what_to_check_and_do() -> None:
    runbooks = _sections((ROOT / "docs" / "runbooks.md").read_text())
    alerts = [rule for group in rule_groups()["groups"] for rule in group["rules"]
              if "alert" in rule]
    assert alerts
    for rule in alerts:
        url = rule["annotations"].get("runbook_url")
        assert url == f"docs/runbooks.md#{rule['alert'].lower()}", (rule["alert"], url)
        path, _, anchor = url.partition("#")
        assert (ROOT / path).is_file()
        body = runbooks[anchor]
        for part in ("**What it means.**", "**What to check.**", "**What to do.**"):
            assert part in body, (rule["alert"], part)
    assert set(runbooks) == {rule["alert"].lower() for rule in alerts}


def test_the_dashboard_loads_with_the_panels_asked_for() -> None:
    board = dashboard()
    titles = [panel["title"] for panel in board["panels"]]
    assert len({panel["id"] for panel in board["panels"]}) == len(titles)
    for wanted in ("Goodput", "Badput by category", "Tensor-parallel degree per replica",
                   "Step time (median and p99)", "Throughput",
                   "Reconfigurations and lost steps (1 h)", "GPU power limit and target",
                   "DCGM power draw", "DCGM last XID and failing health watches",
                   "Health agents reading dcgm-exporter", "Operator reconciles",
                   "Operator reconcile time (p99)", "Operator leader",
                   "Loss: training and held-out"):
        assert wanted in titles
    for panel in board["panels"]:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"


@pytest.fixture
def exporters() -> Iterator[dict[str, list[str]]]:
    """One of each page the dashboard reads, each on a free loopback port: a node agent's
    trainer metrics (two steps timed), a power agent, two nodes' DCGM pages (gpu-node-0 as 4.9
    prints it, label `hostname`: GPU 2 fell off the bus, GPU 3 hit the application error XID 13;
    gpu-node-1 as 4.8.2 prints it, label `Hostname`: GPU 1 fell off the bus), the health agent
    that read gpu-node-0's page, and the operator's after one reconcile, as leader."""
    clock = [100.0]
    ledger = Ledger(lambda: clock[0])
    ledger.set_layout({0: 7, 1: 8})
    clock[0] += 5
    ledger.enter(Phase.TRAINING)
    steps = StepTimes()
    for step in (1, 2):
        clock[0] += 1
        ledger.step_done(step, samples=8, tokens=8 * 256)
        steps.observe(1.0)
    trainer = serve(ledger, "127.0.0.1", 0, {"ntpjob": "llama-small", "node": "gpu-node-0"},
                    loss=lambda: 2.5, step_times=steps, eval_loss=lambda: 2.75)

    status = NodeStatus(
        node="gpu-node-0", rack="rack-0", budget_mw=4_800_000, rack_budget_mw=9_600_000,
        holding=False, reason="following target",
        gpus=tuple(GpuStatus(i, f"GPU-{i}", 550_000, 650_000, 650_000, True, 650_000, 1980)
                   for i in range(2)))
    agent_registry = CollectorRegistry(auto_describe=False)
    agent_registry.register(AgentCollector(lambda: status))
    agent, _thread = start_http_server(0, "127.0.0.1", agent_registry)

    node0 = SimBackend(count=4, node="gpu-node-0")
    node0.fail(2, xid=79)
    node0.fail(3, xid=13)
    node1 = SimBackend(count=2, node="gpu-node-1")
    node1.fail(1, xid=79)
    dcgm = [exporter_endpoint("127.0.0.1", 0, lambda: render(
                node0.snapshot(), hostname="gpu-node-0", generation="4.9")),
            exporter_endpoint("127.0.0.1", 0, lambda: render(
                node1.snapshot(), hostname="gpu-node-1", generation="4.8"
            ).replace('hostname="', 'Hostname="'))]
    health_agent = HealthAgent("gpu-node-0", FixedExporter(
        f"http://127.0.0.1:{dcgm[0].server_address[1]}/metrics", 5.0), lambda _: None)
    health_agent.step()
    health = health_metrics.serve(health_agent, "127.0.0.1", 0)

    with operator_metrics.reconciling("NTPTrainingJob"):
        operator_metrics.LEADER.set(1)
    operator, _thread = start_http_server(0, "127.0.0.1", operator_metrics.REGISTRY)
    yield {"trainer": [f"127.0.0.1:{trainer.server_port}"],
           "power-agent": [f"127.0.0.1:{agent.server_port}"],
           "dcgm-exporter": [f"127.0.0.1:{d.server_address[1]}" for d in dcgm],
           "health-agent": [f"127.0.0.1:{health.server_address[1]}"],
           "operator": [f"127.0.0.1:{operator.server_port}"]}
    operator_metrics.LEADER.set(0)
    for server in (trainer, agent, *dcgm, health, operator):
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
    xids = prom.wait_for('{__name__=~"DCGM_FI_DEV_XID_ERRORS?"} > 0',
                         lambda found: len(found) == 3)
    assert sorted((s.labels.get("hostname") or s.labels["Hostname"], s.labels["gpu"], s.value)
                  for s in xids) == [("gpu-node-0", "2", 79.0), ("gpu-node-0", "3", 13.0),
                                     ("gpu-node-1", "1", 79.0)]
    # the GPU-lost rule over the simulator's real pages: the fallen GPUs, named by host under
    # either label, not the XID 13 one
    (gpu_lost,) = (rule["expr"] for group in rule_groups()["groups"] for rule in group["rules"]
                   if rule.get("alert") == "TesseraGPULost")
    assert sorted((s.labels["hostname"], s.labels["gpu"]) for s in prom.query(gpu_lost)) == [
        ("gpu-node-0", "2"), ("gpu-node-1", "1")]
    draw = panel_exprs("DCGM power draw", RATE_INTERVAL)["{{hostname}} GPU {{gpu}}"]
    # GPU 1 of gpu-node-1 fell off the bus: its power draw is blank, so not on the page
    assert sorted((s.labels["hostname"], s.labels["gpu"]) for s in prom.query(draw)) == [
        ("gpu-node-0", "0"), ("gpu-node-0", "1"), ("gpu-node-1", "0")]


# Two nodes' trainers of one job report the same job-wide counts (each sees every step) and each
# every replica's degree; the step-time histogram holds each node's timing of every step. Per
# minute: 6,000 tokens and 60 samples (100 and 1 per second), one reconfiguration and two lost
# steps in the hour; steps of 0.2 s on node-0 and 0.6 s on node-1, in the buckets (0.15, 0.25]
# and (0.4, 0.6] of the exported bounds, from which Prometheus interpolates: the median (rank 60
# of 120) is the top of the first, 0.25, the p99 (rank 118.8) 0.4 + 0.2 x 58.8 / 60. DCGM power
# draw from a 4.9 exporter (`hostname`) on node-0 and a 4.8.2 one (`Hostname`) on node-1, where
# GPU 1 falls off the bus at 30m.
PANEL_SERIES = [
    *({"series": f'tessera_tokens_total{{namespace="ml",ntpjob="llama",node="{n}"}}',
       "values": "0+6000x60"} for n in ("node-0", "node-1")),
    *({"series": f'tessera_samples_total{{namespace="ml",ntpjob="llama",node="{n}"}}',
       "values": "0+60x60"} for n in ("node-0", "node-1")),
    *({"series": f'tessera_reconfigurations_total{{namespace="ml",ntpjob="llama",node="{n}"}}',
       "values": "0x30 1x30"} for n in ("node-0", "node-1")),
    *({"series": f'tessera_steps_lost_total{{namespace="ml",ntpjob="llama",node="{n}"}}',
       "values": "0x30 2x30"} for n in ("node-0", "node-1")),
    *({"series": f'tessera_replica_tp_degree{{namespace="ml",ntpjob="llama",node="{n}",'
                 f'replica="{r}"}}', "values": f"{8 - r}x60"}
      for n in ("node-0", "node-1") for r in (0, 1)),
    *({"series": f'tessera_loss{{namespace="ml",ntpjob="llama",node="{n}"}}',
       "values": "6.5-0.0625x60"} for n in ("node-0", "node-1")),
    *({"series": f'tessera_step_seconds_bucket{{namespace="ml",ntpjob="llama",node="{n}",'
                 f'le="{le}"}}', "values": f"0+{60 if le >= fast else 0}x60"}
      for n, fast in (("node-0", 0.25), ("node-1", 0.6))
      for le in (0.15, 0.25, 0.4, 0.6, 1.0)),
    *({"series": f'tessera_step_seconds_bucket{{namespace="ml",ntpjob="llama",node="{n}",'
                 'le="+Inf"}', "values": "0+60x60"} for n in ("node-0", "node-1")),
    {"series": 'DCGM_FI_DEV_BOARD_POWER_WATTS{hostname="node-0",gpu="0",UUID="GPU-0"}',
     "values": "650x60"},
    {"series": 'DCGM_FI_DEV_POWER_USAGE{Hostname="node-1",gpu="0",UUID="GPU-1"}',
     "values": "640x60"},
    {"series": 'DCGM_FI_DEV_XID_ERROR{hostname="node-0",gpu="0",UUID="GPU-0"}',
     "values": "0x60"},
    {"series": 'DCGM_FI_DEV_XID_ERRORS{Hostname="node-1",gpu="1",UUID="GPU-2"}',
     "values": "0x30 79x30"},
    {"series": 'DCGM_EXP_GPU_HEALTH_STATUS{Hostname="node-1",gpu="1",UUID="GPU-2",'
               'health_watch="PCIE",health_error_code="DCGM_FR_XID_ERROR"}',
     "values": "0x30 20x30"},
]
JOB = {"namespace": "ml", "ntpjob": "llama"}


def _at_one_hour(expr: str, samples: list[tuple[dict[str, str], float]]) -> dict:
    return {"expr": expr, "eval_time": "60m",
            "exp_samples": [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in
                                                      sorted(labels.items())) + "}",
                             "value": value} for labels, value in samples]}


def test_panels_count_a_job_once_and_read_either_dcgm_host_label(tmp_path: Path) -> None:
    """The panels over job-wide counts give one node's figure however many nodes report it,
    and the DCGM panels name the host under `hostname` whichever label the exporter used."""
    rate = "5m"
    throughput = panel_exprs("Throughput", rate)
    changes = panel_exprs("Reconfigurations and lost steps (1 h)", rate)
    steps = panel_exprs("Step time (median and p99)", rate)
    tp = panel_exprs("Tensor-parallel degree per replica", rate)
    loss = panel_exprs("Loss: training and held-out", rate)["{{ntpjob}} training"]
    draw = panel_exprs("DCGM power draw", rate)["{{hostname}} GPU {{gpu}}"]
    xid, health = panel_exprs("DCGM last XID and failing health watches", rate).values()
    fallen = {"Hostname": "node-1", "hostname": "node-1", "gpu": "1", "UUID": "GPU-2"}
    tests = [
        _at_one_hour(throughput["{{ntpjob}} tokens/s"], [(JOB, 100)]),
        _at_one_hour(throughput["{{ntpjob}} samples/s"], [(JOB, 1)]),
        _at_one_hour(changes["{{ntpjob}} reconfigurations"], [(JOB, 1)]),
        _at_one_hour(changes["{{ntpjob}} steps lost"], [(JOB, 2)]),
        _at_one_hour(steps["{{ntpjob}} median"], [(JOB, 0.25)]),
        _at_one_hour(steps["{{ntpjob}} p99"], [(JOB, 0.596)]),
        _at_one_hour(tp["{{ntpjob}} replica {{replica}}"],
                     [(JOB | {"replica": "0"}, 8), (JOB | {"replica": "1"}, 7)]),
        _at_one_hour(loss, [(JOB, 2.75)]),  # 6.5 - 0.0625 x 60, the job's once
        _at_one_hour(draw, [
            ({"__name__": "DCGM_FI_DEV_BOARD_POWER_WATTS", "hostname": "node-0", "gpu": "0",
              "UUID": "GPU-0"}, 650),
            ({"__name__": "DCGM_FI_DEV_POWER_USAGE", "Hostname": "node-1",
              "hostname": "node-1", "gpu": "0", "UUID": "GPU-1"}, 640)]),
        _at_one_hour(xid, [({"__name__": "DCGM_FI_DEV_XID_ERRORS", **fallen}, 79)]),
        _at_one_hour(health, [({"__name__": "DCGM_EXP_GPU_HEALTH_STATUS", **fallen,
                                "health_watch": "PCIE",
                                "health_error_code": "DCGM_FR_XID_ERROR"}, 20)]),
    ]
    (tmp_path / "panels.test.yaml").write_text(yaml.safe_dump({
        "rule_files": [], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": PANEL_SERIES, "promql_expr_test": tests}]}))
    assert "SUCCESS" in promtool("test", "rules", "panels.test.yaml", cwd=tmp_path)


def _podmonitors() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(
        (MONITORING / "podmonitors.yaml").read_text())}


def _scraped_ports(monitor: dict, pod: dict) -> list[int | None] | None:
    """The ports a PodMonitor scrapes on `pod`, one per endpoint (None: no container port of
    that name), as the prometheus-operator matches them: every matchLabels pair, each endpoint's
    port by name; None if it does not select the pod."""
    selector = monitor["spec"]["selector"]["matchLabels"]
    if not selector.items() <= (pod["metadata"].get("labels") or {}).items():
        return None
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
             for p in c.get("ports", [])}
    return [ports.get(e["port"]) for e in monitor["spec"]["podMetricsEndpoints"]]


def test_the_agent_podmonitor_scrapes_the_power_and_health_agents() -> None:
    daemonset = yaml.safe_load((ROOT / "manifests/power-controller/daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]
    power, health = _scraped_ports(_podmonitors()["tessera-power-agents"], pod)
    assert power == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert health == 9403


def test_the_operator_podmonitor_scrapes_its_metrics_port() -> None:
    deployment = yaml.safe_load((ROOT / "manifests/operator/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]
    (port,) = _scraped_ports(_podmonitors()["tessera-operator"], pod)
    assert port == int(pod["metadata"]["annotations"]["prometheus.io/port"])


def test_the_trainer_podmonitor_selects_the_operators_trainer_pods_only() -> None:
    """On a prometheus-operator cluster the goodput comes from the pods the operator makes:
    the monitor selects its trainer pods at the port their annotations name (what the local
    cluster scrapes), and not its rendezvous pod, which serves no metrics."""
    job = yaml.safe_load((ROOT / "manifests/examples/ntpjob-local.yaml").read_text())
    job["metadata"] |= {"namespace": "default", "uid": "u-1"}
    spec = NTPTrainingJobSpec.from_spec(job["spec"])
    trainer = workload.trainer_pod(job, spec, 0, "gpu-node-0")
    monitor = _podmonitors()["tessera-trainers"]
    annotated = int(trainer["metadata"]["annotations"]["prometheus.io/port"])
    assert _scraped_ports(monitor, trainer) == [annotated]
    assert _scraped_ports(monitor, workload.rendezvous_pod(job, spec)) is None


def test_kustomize_builds_the_monitoring_bundle_for_kube_prometheus_stack() -> None:
    """The monitors and rules carry the label kube-prometheus-stack's default selectors match
    (`release: <its release name>`, kube-prometheus-stack by default)."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not on PATH (README: prerequisites)", pytrace=False)
    done = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in objects)
    assert kinds == [("ConfigMap", "tessera-dashboard"), ("PodMonitor", "tessera-operator"),
                     ("PodMonitor", "tessera-power-agents"), ("PodMonitor", "tessera-trainers"),
                     ("PrometheusRule", "tessera")]
    for d in objects:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            assert d["metadata"]["labels"]["release"] == "kube-prometheus-stack", d
    board = next(d for d in objects if d["kind"] == "ConfigMap")
    assert json.loads(board["data"]["dashboard.json"]) == dashboard()
