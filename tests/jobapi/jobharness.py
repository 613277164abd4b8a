"""What the job API's live tests share: a user's handles on a cluster with Tessera installed
(kubectl, the API, the shared storage) and a small job to train on 2 simulated nodes x 2 GPUs."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_LABEL, JOB_PLURAL, POWER_TARGET_PLURAL, VERSION
from tessera_dev import demo_data, paths, probes
from tessera_dev.controlplane import cluster, launcher

NODES, GPUS = 2, 2
ROOT = paths.repo_root()
EXAMPLE = ROOT / "manifests/examples/ntpjob-local.yaml"
# Guards against a hang, not bounds on how fast anything reacts.
HANG_S = 300.0
T = TypeVar("T")


@dataclass
class JobFlow:
    """A user's handles on the cluster: kubectl, the API, the shared storage."""

    plane: launcher.ControlPlane
    cluster: cluster.Cluster
    api: client.ApiClient
    namespace: str

    def kubectl(self, *argv: str, check: bool = True, timeout: float = HANG_S
                ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["kubectl", "-n", self.namespace, *argv], capture_output=True,
                              text=True, timeout=timeout,
                              env=os.environ | {"KUBECONFIG": str(self.plane.kubeconfig)})
        assert not check or done.returncode == 0, (argv, done.stdout, done.stderr)
        return done

    def wait(self, what: str, probe: Callable[[], T], done: Callable[[T], bool] = bool,
             timeout: float = HANG_S) -> T:
        return probes.poll_until(probe, done, timeout=timeout, interval=0.5, error=lambda last: (
            AssertionError(f"{what} not reached in {timeout:.0f} s; last: {last!r}")))

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, JOB_PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        client.CustomObjectsApi(self.api).patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, JOB_PLURAL, name, {"spec": spec})

    def pods(self, name: str) -> list[dict[str, Any]]:
        listed = client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=f"{JOB_LABEL}={name}")
        return [self.api.sanitize_for_serialization(p) for p in listed.items]

    def targets(self, name: str) -> list[str]:
        listed = client.CustomObjectsApi(self.api).list_cluster_custom_object(
            GROUP, VERSION, POWER_TARGET_PLURAL, label_selector=f"{JOB_LABEL}={name}")
        return [t["metadata"]["name"] for t in listed["items"]]

    def logs(self, pod: str) -> list[str]:
        return self.kubectl("logs", pod).stdout.splitlines()


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def records(lines: list[str]) -> list[dict[str, Any]]:
    """The ranks' JSON lines in a trainer pod's log."""
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def small_job(name: str, claim: str, steps: int, interval: int, data: str | None = None
              ) -> dict[str, Any]:
    """The example job shrunk to this cluster (TP2 x DP2, a node each), checkpointing every
    `interval` steps onto the shared claim.

    Without `data` it trains on synthetic sequences (no spec.data, and the example's dataset
    claim not mounted): the job API's tests are about the API, and the references they compare
    losses with train without a dataset. With `data`, a claim holding a dataset prepared where
    the example reads it (`tessera_dev.demo_data.data_claim`), it trains on that, mounted as the
    example mounts its own."""
    job = yaml.safe_load(EXAMPLE.read_text())
    if data is None:
        job = demo_data.without_dataset(job)
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec |= {"tensorParallelSize": GPUS, "gpusPerNode": GPUS, "totalGPUs": NODES * GPUS,
             "steps": steps, "checkpointPolicy": {"path": "/checkpoints/run",
                                                  "intervalSteps": interval}}
    spec["failurePolicy"]["minTensorParallelSize"] = 1
    spec["powerPolicy"]["rackBudgetWatts"] = GPUS * spec["powerPolicy"]["baseCapWatts"] + 200
    pod = spec["template"]["spec"]
    trainer = pod["containers"][0]
    if data is not None:
        (volume,) = pod["volumes"]
        volume["persistentVolumeClaim"]["claimName"] = data
    pod["terminationGracePeriodSeconds"] = 5
    pod.setdefault("volumes", []).append(
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    trainer.setdefault("volumeMounts", []).append(
        {"name": "checkpoints", "mountPath": "/checkpoints"})
    return job


def shared(flow: JobFlow, name: str) -> tuple[str, Path]:
    """A ReadWriteMany claim on the cluster's shared storage, and its files on this machine."""
    claim = flow.cluster.shared_volume(flow.api, name, flow.namespace, size="1Gi")
    return claim, flow.cluster.shared_path(name, flow.namespace)
