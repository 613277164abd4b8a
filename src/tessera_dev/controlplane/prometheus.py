"""A Prometheus server on loopback with a generated scrape config and alert rules, and a small
query helper.

Scrape configs come in two kinds: static targets (a test's own endpoint), and the cluster's, which
select what a real cluster's Kubernetes service discovery would: every node's dcgm-exporter pod
(the GPU Operator's DaemonSet), and each pod annotated `prometheus.io/scrape: "true"` at every
container port named `metrics` or ending in `-metrics` and at its `prometheus.io/port`. Debian's
Prometheus has no Kubernetes discovery built in, so locally the same relabelling runs over
targets from an HTTP discovery endpoint that lists nodes and pods from the API server with the
meta labels Kubernetes discovery would attach (see `discovery`).

Alert rules come from a prometheus-operator PrometheusRule (`rule_groups`): its `spec` is a rule
file, so the local server evaluates the very rules a cluster's prometheus-operator would load.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tessera_dev import probes, processes

# Scrapes and rule evaluations every second: a fault shows in the local cluster's alerts within
# a few seconds (a cluster's 15-30 s would make the demo wait).
SCRAPE_INTERVAL = "1s"
DISCOVERY_REFRESH = "2s"
# The GPU Operator's dcgm-exporter pods: their namespace, their `app` label and port name.
DCGM_NAMESPACE, DCGM_EXPORTER, DCGM_PORT_NAME = "gpu-operator", "nvidia-dcgm-exporter", "metrics"


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Alert:
    """An alert as /api/v1/alerts gives it: its labels (`alertname` among them) and state
    (`pending` while its `for` runs, then `firing`)."""

    labels: dict[str, str]
    state: str

    @property
    def name(self) -> str:
        return self.labels["alertname"]


def rule_groups(prometheus_rule: Path) -> dict[str, Any]:
    """The rule file in a PrometheusRule manifest (its `spec`: `{"groups": [...]}`)."""
    doc = yaml.safe_load(prometheus_rule.read_text())
    if (doc.get("apiVersion"), doc.get("kind")) != ("monitoring.coreos.com/v1", "PrometheusRule"):
        raise ValueError(f"{prometheus_rule} is not a monitoring.coreos.com/v1 PrometheusRule")
    return doc["spec"]


def static_scrape_configs(jobs: Mapping[str, Sequence[str]]) -> list[dict]:
    """Scrape each job's host:port targets at /metrics."""
    return [{"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()]


def _pod_relabelling() -> list[dict]:
    """The `kubernetes-pods` rules: keep pods that ask to be scraped, at each container port
    named `metrics` or `*-metrics` (as a PodMonitor with an endpoint per port) and at the port
    their `prometheus.io/port` names, on the path `prometheus.io/path` names, labelled with their
    namespace and pod. Not with their node: Tessera's exporters label their samples with their
    node themselves, and a target label of the same name would rename theirs to `exported_node`
    (as the prometheus-operator's PodMonitors do, which add namespace and pod too, and node only
    when told). A pod's targets that end at the same address are one target."""
    meta = "__meta_kubernetes_pod_"
    return [
        {"source_labels": [f"{meta}annotation_prometheus_io_scrape"], "action": "keep",
         "regex": "true"},
        {"source_labels": [f"{meta}annotation_prometheus_io_port"], "action": "replace",
         "target_label": "__tmp_port", "regex": r"(\d+)"},
        {"source_labels": [f"{meta}container_port_name", f"{meta}container_port_number"],
         "action": "replace", "regex": r"(?:.+-)?metrics;(\d+)", "target_label": "__tmp_port"},
        {"source_labels": ["__tmp_port"], "action": "keep", "regex": r"\d+"},
        {"source_labels": [f"{meta}annotation_prometheus_io_path"], "action": "replace",
         "target_label": "__metrics_path__", "regex": "(.+)"},
        {"source_labels": ["__address__", "__tmp_port"], "action": "replace",
         "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2",
         "target_label": "__address__"},
        {"action": "labelmap", "regex": f"{meta}label_(.+)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": [f"{meta}name"], "target_label": "pod"},
    ]


def _dcgm_relabelling() -> list[dict]:
    """The dcgm-exporter pods at their `metrics` port, labelled with the node they run on (the
    name Tessera's queries group GPUs by; the exporter's own `hostname` label says the same), as
    a ServiceMonitor on the GPU Operator's Service with a `node` relabelling would."""
    meta = "__meta_kubernetes_pod_"
    return [
        {"source_labels": ["__meta_kubernetes_namespace", f"{meta}label_app",
                           f"{meta}container_port_name"],
         "action": "keep", "regex": f"{DCGM_NAMESPACE};{DCGM_EXPORTER};{DCGM_PORT_NAME}"},
        {"source_labels": [f"{meta}node_name"], "target_label": "node"},
    ]


def kubernetes_scrape_configs(discovery_url: str | None = None) -> list[dict]:
    """The cluster's scrape jobs. With `discovery_url`, targets come from the local HTTP
    discovery endpoint; without, from Prometheus' own Kubernetes discovery (a real cluster)."""
    def sd(role: str) -> dict:
        if discovery_url is None:
            return {"kubernetes_sd_configs": [{"role": role}]}
        return {"http_sd_configs": [{"url": f"{discovery_url}/targets/{role}",
                                     "refresh_interval": DISCOVERY_REFRESH}]}
    return [
        # honor_labels: on a GPU cluster the exporter labels a GPU's samples with the namespace
        # and pod of the workload using it; those are kept as the exporter wrote them
        {"job_name": "dcgm-exporter", **sd("pod"), "honor_labels": True,
         "relabel_configs": _dcgm_relabelling()},
        {"job_name": "kubernetes-pods", **sd("pod"), "relabel_configs": _pod_relabelling()},
    ]


def config(scrape_configs: list[dict], interval: str = SCRAPE_INTERVAL,
           rule_files: Sequence[Path] = ()) -> dict:
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": scrape_configs}


@dataclass
class Prometheus:
    """A running Prometheus; a context manager that stops it (and removes its data) on exit."""

    url: str
    data_dir: Path
    owns_data_dir: bool
    _proc: subprocess.Popen | None = field(repr=False, default=None)

    @classmethod
    def start(
        cls, jobs: Mapping[str, Sequence[str]] | None = None, data_dir: Path | None = None,
        binary: str | None = None, timeout: float = 60.0, *,
        scrape_configs: list[dict] | None = None, rules: Mapping[str, Any] | None = None,
        detached: bool = False,
    ) -> Prometheus:
        """Scrape static `jobs` and/or the given scrape configs, and evaluate `rules` (a rule
        file's content, e.g. `rule_groups(...)`). Unless detached, the server dies with the
        process that started it, even on SIGKILL. A rule file Prometheus refuses fails the
        start with its message."""
        exe = binary or shutil.which("prometheus")
        if exe is None:
            raise FileNotFoundError("prometheus is not installed (Debian package `prometheus`)")
        root, owns = processes.work_dir(data_dir, "tessera-prom-")
        config_path = root / "prometheus.yml"
        rule_files: list[Path] = []
        if rules is not None:
            rule_file = root / "rules.yaml"
            rule_file.write_text(yaml.safe_dump(dict(rules)))
            rule_files.append(rule_file)
        config_path.write_text(yaml.safe_dump(config(
            static_scrape_configs(jobs or {}) + list(scrape_configs or []),
            rule_files=rule_files)))

        def launch(ports: list[int]) -> Prometheus:
            log = root / "prometheus.log"
            proc = processes.spawn([
                exe, f"--config.file={config_path}", f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports[0]}",
            ], log, die_with_parent=not detached)
            server = cls(f"http://127.0.0.1:{ports[0]}", root, owns, proc)
            try:
                processes.wait_until(server.is_ready, what="prometheus", proc=proc,
                                     log_path=log, timeout=timeout)
            except BaseException:
                processes.stop_group(proc)
                raise
            return server

        try:
            return processes.with_free_ports(1, launch)
        except BaseException:
            if owns:
                shutil.rmtree(root, ignore_errors=True)
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_ready(self) -> bool:
        return probes.responds(f"{self.url}/-/ready")

    def _api(self, path: str, what: str) -> Any:
        """The `data` of an API answer; ValueError with Prometheus' message if it failed."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body["status"] != "success":
            raise ValueError(f"{what} failed: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[Sample]:
        """Evaluate an instant query; raises ValueError with Prometheus' message if it fails."""
        data = self._api("query?" + urllib.parse.urlencode({"query": promql}),
                         f"query {promql!r}")
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        return [Sample(item["metric"], float(item["value"][1])) for item in data["result"]]

    def rules(self) -> list[dict[str, Any]]:
        """The rule groups loaded, as /api/v1/rules gives them (name, file, rules with health)."""
        return self._api("rules", "listing the rules")["groups"]

    def alerts(self) -> list[Alert]:
        """The alerts pending or firing now."""
        return [Alert(a["labels"], a["state"]) for a in self._api("alerts", "listing alerts")
                ["alerts"]]

    def wait_for(
        self, promql: str, until: Callable[[list[Sample]], bool] = bool, timeout: float = 30.0,
    ) -> list[Sample]:
        """Query repeatedly until the result satisfies `until` (by default: is non-empty)."""
        return probes.poll_until(
            lambda: self.query(promql), until, timeout=timeout, interval=0.2,
            error=lambda samples: TimeoutError(
                f"{promql!r} still gives {samples} after {timeout:.0f} s"))

    def stop(self) -> None:
        if self._proc is not None:
            processes.stop_group(self._proc)
            self._proc = None
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
