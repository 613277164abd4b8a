"""The operator as an administrator runs it: two replicas from manifests/local on a cluster of
its own, one leading on the Lease. Its /metrics page as Prometheus scrapes it (and as promtool
checks it), and the leader killed in the middle of a relayout: the standby takes the Lease and
the job converges to the new layout with one generation for the change."""

from __future__ import annotations

import functools
import json
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from installharness import (
    GPUS,
    HANG_S,
    NODES,
    create_job,
    installed_cluster,
    new_namespace,
    tiny_job,
)
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from tessera_cli import main as tessera_cli
from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev import install, probes
from tessera_dev.controlplane import launcher
from tessera_operator import leader

pytestmark = pytest.mark.ship

JOB = "ha"
OPERATOR_LABEL = "app.kubernetes.io/name=tessera-operator"


wait = functools.partial(probes.wait_for, timeout=HANG_S)


@dataclass
class Installed:
    plane: launcher.ControlPlane
    api: client.ApiClient
    namespace: str

    def status(self) -> dict[str, Any]:
        job = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, JOB_PLURAL, JOB)
        return job.get("status") or {}

    def generation(self) -> dict[str, Any]:
        cm = client.CoreV1Api(self.api).read_namespaced_config_map(f"{JOB}-layout",
                                                                   self.namespace)
        return json.loads(cm.data["generation.json"])

    def leader(self) -> str | None:
        """The Lease's holder; None while there is none (a leader that stops deletes it)."""
        try:
            lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
                leader.LEASE_NAME, install.SYSTEM_NS)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return lease.spec.holder_identity

    def operators(self) -> dict[str, str]:
        """Operator pod -> its address, for the running ones not being deleted."""
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            install.SYSTEM_NS, label_selector=OPERATOR_LABEL).items
        return {p.metadata.name: p.status.pod_ip for p in pods
                if p.status.pod_ip and not p.metadata.deletion_timestamp}


def page(ip: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{ip}:9404{path}", timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    """A cluster of its own, Tessera installed from manifests/local, a small job training."""
    with installed_cluster() as (plane, api):
        namespace = f"ha-{uuid.uuid4().hex[:8]}"
        new_namespace(api, namespace)
        create_job(api, namespace, tiny_job(JOB))
        ha = Installed(plane, api, namespace)
        wait("the job training on generation 1", ha.status, lambda s: (
            s.get("phase") == "Running" and s.get("layoutGeneration") == 1
            and s.get("step", 0) >= 1))
        yield ha


def test_the_leaders_metrics_page_shows_its_reconciles_jobs_and_leadership(
        installed: Installed) -> None:
    holder = wait("a leader", installed.leader)
    operators = wait("two operator replicas", installed.operators, lambda o: len(o) == 2)
    pages = {name: page(ip) for name, ip in operators.items()}
    leaders = [name for name, text in pages.items()
               if value(text, "tessera_operator_leader") == 1]
    assert leaders == [holder], {n: value(t, "tessera_operator_leader") for n, t in pages.items()}
    mine = pages[holder]
    assert value(mine, "tessera_operator_reconciles_total", kind="NTPTrainingJob",
                 result="success") > 0
    assert value(mine, "tessera_operator_reconcile_duration_seconds_count",
                 kind="NTPTrainingJob") > 0
    assert value(mine, "tessera_operator_jobs", phase="Running") == 1
    assert value(mine, "tessera_operator_layout_generations_total") >= 1
    for name, text in pages.items():
        checked = subprocess.run(["promtool", "check", "metrics"], input=text,
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, (name, checked.stdout, checked.stderr)
        assert page(operators[name], "/readyz") == "ok\n"  # the standby is Ready too


def test_the_leader_killed_mid_relayout_the_standby_converges_with_one_generation(
        installed: Installed) -> None:
    before = installed.generation()
    assert before["generation"] == 1
    old = wait("a leader", installed.leader)
    wait("a standby", installed.operators, lambda o: len(o) == 2 and old in o)
    node, gpu = "gpu-node-0", 1
    # The cordon, then the leader killed at once (grace 0): its reconcile of the cordon is in
    # flight, or just done.
    assert tessera_cli.main(["cordon-gpu", node, str(gpu),
                             "--kubeconfig", str(installed.plane.kubeconfig)]) == 0
    killed = time.monotonic()
    client.CoreV1Api(installed.api).delete_namespaced_pod(
        old, install.SYSTEM_NS, grace_period_seconds=0)
    new = wait("another replica holding the Lease", installed.leader,
               lambda h: h is not None and h != old)
    took_over = time.monotonic() - killed
    status = wait("the job on the new layout", installed.status, lambda s: (
        s.get("layoutGeneration") == 2 and s.get("tpLayout") in ("1,2", "2,1")))
    # The new leader reconciled the job (its first reconciles: every job when it starts) and
    # wrote no generation the old one had already published, nor a second one.
    ip = wait("the new leader's address", installed.operators, lambda o: new in o)[new]
    text = wait("the new leader's reconcile of the job", lambda: page(ip), lambda t: value(
        t, "tessera_operator_reconciles_total", kind="NTPTrainingJob", result="success") > 0)
    assert value(text, "tessera_operator_leader") == 1
    assert value(text, "tessera_operator_layout_generations_total") <= 1
    published = installed.generation()
    assert published["generation"] == 2, published
    gpus = {g for replica in published["replicas"] for g in replica["gpus"]}
    assert f"{node}/{gpu}" not in gpus and len(gpus) == NODES * GPUS - 1, gpus
    assert installed.status()["layoutGeneration"] == 2
    # The Deployment replaces the killed pod: two replicas again, one leading.
    install.wait(installed.api, NODES)
    assert installed.leader() == new
    print(f"\nLease taken over {took_over:.1f} s after the kill; the job {status['tpLayout']} "
          f"on generation 2; the new leader wrote "
          f"{value(text, 'tessera_operator_layout_generations_total'):.0f} of its generations")
