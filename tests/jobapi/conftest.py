"""The job API's live tests: a local cluster of their own (2 simulated nodes x 2 GPUs) with
Tessera installed from the shipped manifests, as a user installs it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from jobharness import GPUS, HANG_S, NODES, JobFlow
from kubernetes import client

from tessera_dev import install, probes
from tessera_dev.controlplane import cluster, launcher


@pytest.fixture(scope="module")
def installed() -> Iterator[tuple[launcher.ControlPlane, cluster.Cluster]]:
    """A cluster of its own with Tessera installed from manifests/local."""
    with launcher.ControlPlane.start(bin_dir=launcher.prebuilt()) as plane:
        running = cluster.Cluster.start(plane, cluster.node_specs(NODES, GPUS))
        try:
            install.apply(plane.kubeconfig)
            with plane.api_client() as api:
                install.wait(api, NODES, timeout=HANG_S)
            yield plane, running
        finally:
            running.stop()


@pytest.fixture
def flow(installed: tuple[launcher.ControlPlane, cluster.Cluster]) -> Iterator[JobFlow]:
    """A namespace of its own on the installed cluster, ready for pods."""
    plane, running = installed
    with plane.api_client() as api:
        name = f"j-{uuid.uuid4().hex[:8]}"
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": name}})
        probes.poll_until(lambda: core.list_namespaced_service_account(
            name, field_selector="metadata.name=default").items, timeout=60,
            error=lambda _: TimeoutError(f"no default service account in {name}"))
        yield JobFlow(plane, running, api, name)
        # The next test gets the nodes' GPUs free: every pod of this one gone.
        core.delete_namespace(name)
        probes.poll_until(lambda: core.list_namespaced_pod(name).items, lambda pods: not pods,
                          timeout=HANG_S, error=lambda last: TimeoutError(
                              f"pods of {name} left: {[p.metadata.name for p in last]}"))


