"""Fixtures for the operator tests: the shipped RBAC applied, and the operator running as a real
process under its own service account's token (so the tests prove the RBAC is enough)."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client
from opharness import MANIFESTS, OPERATOR_SA, SYSTEM_NS, RunningOperator, apply_manifests

from tessera_dev import paths, processes
from tessera_dev.controlplane import launcher

GRACE_S = yaml.safe_load((paths.repo_root() / "manifests/operator/deployment.yaml").read_text())[
    "spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


@pytest.fixture(scope="module")
def running_operator(
    control_plane: launcher.ControlPlane, tessera_crds: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningOperator]:
    """`python -m tessera_operator.run` watching a fresh namespace, as tessera-operator."""
    work = tmp_path_factory.mktemp("operator")
    with control_plane.api_client() as admin:
        apply_manifests(admin, MANIFESTS)
        namespace = f"op-{uuid.uuid4().hex[:8]}"
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
        token = control_plane.service_account_token(SYSTEM_NS, OPERATOR_SA)
        kubeconfig = work / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(control_plane.token_kubeconfig(
            token, f"system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}")))
        log = work / "operator.log"
        proc = processes.spawn(
            [sys.executable, "-m", "tessera_operator.run", "--kubeconfig", str(kubeconfig),
             "--namespace", namespace], log, die_with_parent=True)
        running = RunningOperator(proc, log, namespace, admin, control_plane.kubeconfig,
                                  kubeconfig)
        try:
            yield running
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                # The bound is the behaviour: Kubernetes kills the pod after this grace period.
                code = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                processes.stop_group(proc)
                code = None
        assert code == 0, f"the operator did not stop cleanly on SIGTERM ({code}):\n" + \
            processes.log_tail(log, 40)
