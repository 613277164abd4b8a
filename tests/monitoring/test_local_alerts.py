"""The local cluster's Prometheus evaluates Tessera's shipped alert rules: the groups of
manifests/monitoring/alerts.yaml are loaded and healthy, and a GPU failed as hardware fails
(`tessera-dev fail-gpu`) fires TesseraGPULost until it is restored. Pods scraped through their
annotations keep their exporter's own `node` label."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from kubernetes import client

from tessera_dev import probes
from tessera_dev.controlplane import cluster
from tessera_dev.controlplane.prometheus import Alert, Prometheus, rule_groups

pytestmark = [pytest.mark.monitoring, pytest.mark.cluster]

TESSERA = (sys.executable, "-m", "tessera_dev.cli")
# The trainer's own exporter with the labels the node agent gives it, at the port its pod's
# annotations name.
EXPORTER = """
import os, time
from tessera_core.goodput import Ledger
from ntp.nodeagent.metrics import serve
serve(Ledger(time.monotonic), os.environ["POD_IP"], 9300,
      {"ntpjob": "probe", "node": os.environ["NODE_NAME"]})
time.sleep(3600)
"""


def gpu_lost(prometheus: Prometheus, node: str, gpu: int) -> list[Alert]:
    return [a for a in prometheus.alerts() if a.name == "TesseraGPULost"
            and (a.labels["hostname"], a.labels["gpu"]) == (node, str(gpu))]


def tessera(*args: str, data_dir: str) -> None:
    done = subprocess.run([*TESSERA, *args, "--data-dir", data_dir], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_shipped_rules_are_evaluated_and_a_failed_gpu_fires_gpu_lost(local_cluster):
    prometheus, data_dir = local_cluster.prometheus, str(local_cluster.plane.data_dir)
    shipped = {group["name"]: [rule.get("alert") or rule["record"] for rule in group["rules"]]
               for group in rule_groups(cluster.ALERT_RULES)["groups"]}
    # every rule evaluated at least once, without error
    loaded = probes.poll_until(
        prometheus.rules, lambda groups: groups and all(
            rule["health"] == "ok" for group in groups for rule in group["rules"]),
        timeout=30, interval=0.2,
        error=lambda groups: AssertionError(f"rules not all healthy: {groups}"))
    assert {group["name"]: [rule["name"] for rule in group["rules"]]
            for group in loaded} == shipped
    node, gpu = "gpu-node-1", 7
    assert gpu_lost(prometheus, node, gpu) == []
    tessera("fail-gpu", node, str(gpu), "--xid", "79", data_dir=data_dir)
    failed_at = time.monotonic()
    try:
        # no `for`: firing at the first evaluation that sees the exporter's XID
        alerts = probes.poll_until(
            lambda: gpu_lost(prometheus, node, gpu), timeout=30, interval=0.2,
            error=lambda _: AssertionError(f"no TesseraGPULost for {node} GPU {gpu}"))
        print(f"TesseraGPULost after {time.monotonic() - failed_at:.1f} s")
        assert [(a.state, a.labels["severity"]) for a in alerts] == [("firing", "critical")]
    finally:
        tessera("restore-gpu", node, str(gpu), data_dir=data_dir)
    # reset: the last-XID gauge reads 0, though the exporter's window still counts the 79
    probes.poll_until(lambda: gpu_lost(prometheus, node, gpu), lambda found: not found,
                      timeout=30, interval=0.2,
                      error=lambda found: AssertionError(f"still alerting: {found}"))


def test_a_scraped_pod_keeps_its_exporters_node_label(local_cluster, admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    node = "gpu-node-0"
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "exporter", "annotations": {
            "prometheus.io/scrape": "true", "prometheus.io/port": "9300"}},
        "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
                 "containers": [{
                     "name": "exporter", "image": "tessera-trainer:0.1.0",
                     "command": ["python", "-c", EXPORTER],
                     "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                                 "fieldPath": "status.podIP"}}},
                             {"name": "NODE_NAME", "valueFrom": {"fieldRef": {
                                 "fieldPath": "spec.nodeName"}}}]}]}})
    try:
        (sample,) = local_cluster.prometheus.wait_for(
            f'tessera_wall_seconds_total{{namespace="{namespace}"}}', timeout=60)
    finally:
        core.delete_namespaced_pod("exporter", namespace, grace_period_seconds=0)
    labels = sample.labels
    assert (labels["node"], labels["ntpjob"], labels["pod"]) == (node, "probe", "exporter")
    assert labels["job"] == "kubernetes-pods" and "exported_node" not in labels
