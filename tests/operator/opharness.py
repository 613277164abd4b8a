"""What the operator tests share: the shipped manifests, and a handle on the running operator."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client

from tessera_dev import paths, probes, processes, simnodes
from tessera_dev.controlplane import launcher, manifests
from tessera_operator.reconcile import RESYNC_INTERVAL_S

ROOT = paths.repo_root()
SYSTEM_NS, OPERATOR_SA = "tessera-system", "tessera-operator"
MANIFESTS = (
    "manifests/system/namespace.yaml",
    "manifests/power-controller/rbac.yaml",
    "manifests/power-controller/admission.yaml",
    "manifests/operator/rbac.yaml",
    "manifests/operator/admission.yaml",
)  # not the Deployment: on the session's cluster its pod would run a second, cluster-wide operator
# A guard against a hung test, not a bound on how fast the operator reacts. It stays below the
# resync timer's first run, so whatever a test sees happen was driven by a watch event.
HANG_GUARD_S = 120.0
assert HANG_GUARD_S < RESYNC_INTERVAL_S

GRACE_S = yaml.safe_load((ROOT / "manifests/operator/deployment.yaml").read_text())[
    "spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

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
    operator_kubeconfig: Path | None = None  # the operator's own identity and rights

    def wait(self, probe: Callable[[], T], done: Callable[[T], bool], what: str,
             timeout: float = HANG_GUARD_S) -> T:
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

    def create_nodes(self, pool: str, count: int, labels: Mapping[str, str] | None = None
                     ) -> list[str]:
        """GPU nodes in `pool`, where a job of that name is placed (names sort in creation
        order), labelled with `labels` from their creation on."""
        tag = uuid.uuid4().hex[:6]
        return simnodes.register(self.admin, [f"gpu-{tag}-{i}" for i in range(count)], pool,
                                 labels=labels)

    def start_rendezvous(self, job: str) -> None:
        """Play the kubelet for the job's rendezvous pod, the one pod whose running these
        tests need (its address goes into the generation document): these nodes have no
        kubelet, so it is given one."""
        core = client.CoreV1Api(self.admin)
        name = f"{job}-rendezvous"
        self.wait(lambda: [p.metadata.name for p in core.list_namespaced_pod(
            self.namespace, field_selector=f"metadata.name={name}").items], bool,
            f"pod {name}")
        core.patch_namespaced_pod_status(name, self.namespace, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})


@contextmanager
def operator_on(plane: launcher.ControlPlane, work: Path) -> Iterator[RunningOperator]:
    """`python -m tessera_operator.run` on `plane`, watching a fresh namespace, as
    tessera-operator (the shipped RBAC applied); it must stop cleanly on SIGTERM."""
    with plane.api_client() as admin:
        apply_manifests(admin, MANIFESTS)
        namespace = f"op-{uuid.uuid4().hex[:8]}"
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
        token = plane.service_account_token(SYSTEM_NS, OPERATOR_SA)
        kubeconfig = work / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(plane.token_kubeconfig(
            token, f"system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}")))
        log = work / "operator.log"
        proc = processes.spawn(
            [sys.executable, "-m", "tessera_operator.run", "--kubeconfig", str(kubeconfig),
             "--namespace", namespace], log, die_with_parent=True)
        running = RunningOperator(proc, log, namespace, admin, plane.kubeconfig, kubeconfig)
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
