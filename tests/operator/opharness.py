"""What the operator tests share: the shipped manifests, and a handle on the running operator."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from tessera_operator import paths, simnodes
from tessera_operator.controlplane import manifests, probes, processes

ROOT = paths.repo_root()
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
    manifests.apply(admin, [ROOT / path for path in paths])


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
        return simnodes.register(self.admin, [f"gpu-{tag}-{i}" for i in range(count)], job,
                                 self.namespace)
