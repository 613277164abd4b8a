"""What the operator tests share: the shipped manifests, and a handle on the running operator."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from kubernetes.dynamic import DynamicClient
from tessera_operator.controlplane import probes, processes

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_NS, OPERATOR_SA = "tessera-system", "tessera-operator"
MANIFESTS = (
    "manifests/power-controller/rbac.yaml",
    "manifests/power-controller/admission.yaml",
    "manifests/operator/rbac.yaml",
    "manifests/operator/deployment.yaml",
)
# Shorter than the operator's renewal timer (20 s): what happens within it was event-driven.
REACTION_S = 15.0

T = TypeVar("T")


def apply_manifests(admin: client.ApiClient, paths: tuple[str, ...]) -> None:
    api = DynamicClient(admin)
    for path in paths:
        for doc in yaml.safe_load_all((ROOT / path).read_text()):
            kind = api.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            kind.server_side_apply(
                body=doc, name=doc["metadata"]["name"],
                namespace=doc["metadata"].get("namespace"), field_manager="tessera-tests",
                force_conflicts=True)


@dataclass
class RunningOperator:
    """The operator process and what the tests need around it."""

    proc: subprocess.Popen
    log: Path
    namespace: str
    admin: client.ApiClient
    admin_kubeconfig: Path

    def wait(self, probe: Callable[[], T], done: Callable[[T], bool], what: str,
             timeout: float = REACTION_S) -> T:
        """Poll until `done(probe())`; on timeout fail with the last value and the log tail."""
        def check() -> T:
            if not processes.is_alive(self.proc):
                pytest.fail(f"the operator exited ({self.proc.returncode}):\n"
                            f"{processes.log_tail(self.log, 60)}")
            return probe()

        return probes.poll_until(check, done, timeout=timeout, interval=0.2, error=lambda last: (
            AssertionError(f"{what} not reached in {timeout:.0f} s; last: {last!r}\n"
                           f"operator log:\n{processes.log_tail(self.log, 60)}")))

    def job(self, name: str) -> dict[str, Any]:
        return client.CustomObjectsApi(self.admin).get_namespaced_custom_object(
            "tessera.dev", "v1alpha1", self.namespace, "ntptrainingjobs", name)

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def create_job(self, body: dict[str, Any]) -> None:
        client.CustomObjectsApi(self.admin).create_namespaced_custom_object(
            "tessera.dev", "v1alpha1", self.namespace, "ntptrainingjobs", body)

    def create_nodes(self, job: str, count: int) -> list[str]:
        """GPU nodes serving `job` (names sort in creation order)."""
        tag = uuid.uuid4().hex[:6]
        names = [f"gpu-{tag}-{i}" for i in range(count)]
        for name in names:
            client.CoreV1Api(self.admin).create_node({"metadata": {
                "name": name,
                "labels": {"tessera.dev/job": job, "tessera.dev/job-namespace": self.namespace,
                           "nvidia.com/gpu.present": "true"}}})
        return names


