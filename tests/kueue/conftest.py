"""The tests marked kueue share one local cluster with Kueue (`tessera-dev up --kueue` as the
tests start it): its own control plane, NODES simulated nodes of GPUS GPUs, Prometheus and
Kueue's controller, stopped after the session; Tessera is installed on it (after Kueue, as its
operator serves Kueue's API only if it is there when it starts) for the tests that run jobs.
Kueue is built from the Go module registry on first use (many minutes on a fresh machine: the
session's first test waits for it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from kueueharness import GPUS, NODES

from tessera_dev import install
from tessera_dev.controlplane import build, cluster, crds, launcher


@pytest.fixture(scope="session")
def kueue_cluster() -> Iterator[cluster.Cluster]:
    bins = launcher.prebuilt()
    if bins is None:
        pytest.fail("the control plane is not built: run `make setup` first", pytrace=False)
    binary = launcher.kueue()
    release = build.ensure_kueue_manifests()
    with launcher.ControlPlane.start(bin_dir=bins) as plane:
        with plane.api_client() as api:
            crds.apply(api, crds.load())
        running = cluster.Cluster.start(plane, cluster.node_specs(NODES, GPUS))
        try:
            running.start_kueue(binary, release)
            yield running
        finally:
            running.stop()


@pytest.fixture
def kueue_api(kueue_cluster: cluster.Cluster) -> Iterator[client.ApiClient]:
    with kueue_cluster.plane.api_client() as api:
        yield api


@pytest.fixture(scope="session")
def tessera_on_kueue(kueue_cluster: cluster.Cluster) -> cluster.Cluster:
    """The shared cluster with Tessera installed from manifests/local."""
    install.apply(kueue_cluster.plane.kubeconfig)
    with kueue_cluster.plane.api_client() as api:
        install.wait(api, NODES)
    return kueue_cluster
