"""Two local clusters on one host, side by side, each training a job of its own.

Each cluster (2 simulated nodes x 2 GPUs) has Tessera installed from the shipped manifests, as a
user installs it; the same small job (same name and namespace: the same store keys on the same
rendezvous port) is applied to both at once, with a different seed each. Every pod binds its
own pod address (127.B.K.x, B the cluster's block), so neither cluster's operator health check
or rendezvous takes the other's port and no trainer reaches the other cluster's store: both
jobs succeed, every step trained once, the ranks of each cluster agreeing on their losses and
not with the other cluster's. The wall time of the setup and of the jobs is printed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_contracts.api import JOB_LABEL, ROLE_LABEL
from tessera_dev import demo_data, install, paths, probes
from tessera_dev.controlplane import cluster, launcher
from tessera_operator.workload import RENDEZVOUS, RENDEZVOUS_PORT, TRAINER, rendezvous_name

pytestmark = pytest.mark.hardening

NODES, GPUS = 2, 2
STEPS = 20
JOB = "side-by-side"
SEEDS = (1, 2)  # one per cluster: their losses differ from the first step
ROOT = paths.repo_root()
EXAMPLE = ROOT / "manifests/examples/ntpjob-local.yaml"
# Guards against a hang, not bounds on how fast anything reacts.
HANG_S = 300.0


wait = functools.partial(probes.wait_for, timeout=HANG_S)


@dataclass
class Side:
    """One of the two clusters, as its user sees it: kubectl and the API."""

    plane: launcher.ControlPlane
    api: client.ApiClient
    seed: int

    def kubectl(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(["kubectl", *argv], capture_output=True, text=True, timeout=120,
                              env=os.environ | {"KUBECONFIG": str(self.plane.kubeconfig)})
        assert not check or done.returncode == 0, (self.seed, argv, done.stdout, done.stderr)
        return done.stdout

    def status(self) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "ntpjob", JOB, "-o", "json")).get("status") or {}

    def losses(self) -> dict[int, list[float]]:
        """Every loss the job's ranks logged, by step, from all its trainer pods."""
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            "default", label_selector=f"{JOB_LABEL}={JOB},{ROLE_LABEL}={TRAINER}").items
        assert len(pods) == NODES, [p.metadata.name for p in pods]
        out: dict[int, list[float]] = {}
        for pod in pods:
            for line in self.kubectl("logs", pod.metadata.name).splitlines():
                record = json.loads(line) if line.startswith("{") else {}
                if "loss" in record:
                    out.setdefault(record["step"], []).append(record["loss"])
        return out


def _job(seed: int) -> dict[str, Any]:
    """The example job shrunk to this cluster: TP2 x DP2, a node each, a few steps, on
    synthetic sequences."""
    job = demo_data.without_dataset(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    spec |= {"tensorParallelSize": GPUS, "gpusPerNode": GPUS, "totalGPUs": NODES * GPUS,
             "steps": STEPS, "args": [*spec.get("args", []), f"--seed={seed}"]}
    spec["failurePolicy"]["minTensorParallelSize"] = 1
    spec["powerPolicy"]["rackBudgetWatts"] = GPUS * spec["powerPolicy"]["baseCapWatts"] + 200
    return job


@pytest.fixture(scope="module")
def sides() -> Iterator[list[Side]]:
    """Two clusters of their own on this host, Tessera installed on each. Started one after
    the other: the second one's block is the first whose node ports are free then."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        sides = []
        for seed in SEEDS:
            plane = stack.enter_context(launcher.ControlPlane.start(bin_dir=launcher.prebuilt()))
            stack.callback(cluster.Cluster.start(plane, cluster.node_specs(NODES, GPUS)).stop)
            side = Side(plane, stack.enter_context(plane.api_client()), seed)
            install.apply(plane.kubeconfig)
            sides.append(side)
        for side in sides:
            install.wait(side.api, NODES)
        print(f"\ntwo clusters up and Tessera installed: {time.monotonic() - started:.1f} s")
        yield sides


def test_two_local_clusters_train_side_by_side(sides: list[Side], tmp_path: Path) -> None:
    started = time.monotonic()
    for side in sides:
        manifest = tmp_path / f"job-{side.seed}.yaml"
        manifest.write_text(yaml.safe_dump(_job(side.seed)))
        side.kubectl("apply", "-f", str(manifest))
    # Each rendezvous listens on its own pod IP, the same port in both clusters.
    stores = []
    for side in sides:
        (pod,) = wait(f"cluster {side.seed}: the rendezvous pod's IP", lambda s=side: (
            client.CoreV1Api(s.api).list_namespaced_pod("default", field_selector=(
                f"metadata.name={rendezvous_name(JOB)}")).items),
            lambda pods: pods and pods[0].status.pod_ip)
        store = f"{pod.status.pod_ip}:{RENDEZVOUS_PORT}"
        wait(f"cluster {side.seed}: its store listening on {store}", lambda s=side: s.kubectl(
            "logs", rendezvous_name(JOB), "-c", RENDEZVOUS, check=False),
            lambda log, at=store: f"TCPStore listening on {at}" in log)
        stores.append(store)
    assert stores[0] != stores[1], stores

    done = [wait(f"cluster {side.seed}: {JOB} finished", side.status,
                 lambda s: s.get("phase") in ("Succeeded", "Failed")) for side in sides]
    trained_s = time.monotonic() - started
    assert [d["phase"] for d in done] == ["Succeeded", "Succeeded"], done
    assert [d["step"] for d in done] == [STEPS, STEPS], done

    first_losses = []
    for side in sides:
        losses = side.losses()
        assert sorted(losses) == list(range(1, STEPS + 1)), (side.seed, sorted(losses))
        # Every rank of the cluster that logs a step logs the same loss: one job's ranks.
        for step, values in losses.items():
            assert max(values) - min(values) <= 1e-6, (side.seed, step, values)
        first_losses.append(losses[1][0])
    # Each cluster trained its own seed's model, not the other cluster's.
    assert abs(first_losses[0] - first_losses[1]) > 1e-3, first_losses
    print(f"both jobs applied -> both Succeeded ({STEPS} steps each): {trained_s:.1f} s")
