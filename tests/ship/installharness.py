"""What the ship tests that install Tessera share: a local cluster of their own (NODES simulated
nodes of GPUS GPUs), kubectl and helm on it, Tessera installed as a user installs it and waited
for with tessera_dev.install, and a tiny job."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev import demo_data, install, paths, probes
from tessera_dev.controlplane import cluster, launcher

ROOT = paths.repo_root()
CHART = ROOT / "charts/tessera"
NODES, GPUS = 2, 2
# Guards against a hang, not bounds on how fast anything reacts.
HANG_S = 300.0


def helm_binary() -> Path:
    found = launcher.helm()
    if found is None:
        pytest.fail("helm is not built: run `make setup` (or `tessera-dev build-controlplane`)",
                    pytrace=False)
    return found


def run(argv: list[str], kubeconfig: Path | None = None, check: bool = True,
        timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    env = os.environ if kubeconfig is None else os.environ | {"KUBECONFIG": str(kubeconfig)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert not check or done.returncode == 0, (argv, done.stdout, done.stderr)
    return done


@contextmanager
def local_cluster() -> Iterator[tuple[launcher.ControlPlane, cluster.Cluster]]:
    """A control plane and NODES simulated nodes of GPUS GPUs, on free ports, stopped after."""
    with launcher.ControlPlane.start(bin_dir=launcher.prebuilt()) as plane:
        running = cluster.Cluster.start(plane, cluster.node_specs(NODES, GPUS))
        try:
            yield plane, running
        finally:
            running.stop()


@contextmanager
def installed_cluster() -> Iterator[tuple[launcher.ControlPlane, client.ApiClient]]:
    """A local cluster with `kubectl apply --server-side -k manifests/local` done and every part
    of Tessera ready."""
    with local_cluster() as (plane, _), plane.api_client() as api:
        install.apply(plane.kubeconfig, install.LOCAL_OVERLAY)
        install.wait(api, NODES, timeout=HANG_S)
        yield plane, api


def tiny_job(name: str) -> dict[str, Any]:
    """The example job shrunk to this cluster (TP2 x DP2, a node each), on synthetic data."""
    job = demo_data.without_dataset(
        yaml.safe_load((ROOT / "manifests/examples/ntpjob-local.yaml").read_text()))
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec |= {"tensorParallelSize": GPUS, "gpusPerNode": GPUS, "totalGPUs": NODES * GPUS}
    spec["failurePolicy"]["minTensorParallelSize"] = 1
    spec["powerPolicy"]["rackBudgetWatts"] = GPUS * spec["powerPolicy"]["baseCapWatts"] + 200
    spec["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    return job


def create_job(api: client.ApiClient, namespace: str, job: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, job)


def job_status(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, name).get("status") or {}


def new_namespace(api: client.ApiClient, name: str) -> None:
    """A namespace for a user's jobs, ready for pods (its default service account made)."""
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    probes.poll_until(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, timeout=60,
        error=lambda _: TimeoutError(f"no default service account in {name}"))
