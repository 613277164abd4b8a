"""Shared fixtures: one real control plane per session (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager), the local cluster's simulated GPU nodes and Prometheus on it, fresh
namespaces, Prometheus servers for static targets."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest
from kubernetes import client

from tessera_dev import probes
from tessera_dev.controlplane import build, cluster, crds, launcher
from tessera_dev.controlplane.prometheus import Prometheus

# Kueue's build, started at collection when the session runs the kueue tests and Kueue is not
# cached: the session's other tests leave the cores idle for much of their waits, so building
# at the lowest priority meanwhile costs them little and spares the kueue tests many minutes.
_kueue_build: subprocess.Popen[bytes] | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The kueue tests last (their build has the whole session to finish), Kueue built in the
    background."""
    global _kueue_build
    queued = [item for item in items if item.get_closest_marker("kueue")]
    if not queued:
        return
    items[:] = [item for item in items if not item.get_closest_marker("kueue")] + queued
    if os.environ.get("TESSERA_KUEUE_BIN") or (build.find_kueue() and build.find_kueue_manifests()):
        return
    build.cache_root().mkdir(parents=True, exist_ok=True)
    with open(build.cache_root() / "kueue-build.log", "wb") as log:
        # the build lock makes the kueue tests' own ensure_kueue wait for this one to finish
        _kueue_build = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "tessera_dev.controlplane.build",
             "--kueue"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session that ends before its kueue tests stops the build it started."""
    if _kueue_build is not None and _kueue_build.poll() is None:
        os.killpg(_kueue_build.pid, signal.SIGTERM)
        _kueue_build.wait()


# The session's local cluster: as `tessera-dev up` makes it by default.
CLUSTER_NODES = cluster.DEFAULT_NODES
CLUSTER_GPUS = cluster.DEFAULT_GPUS


@pytest.fixture(scope="session")
def control_plane() -> Iterator[launcher.ControlPlane]:
    """The control plane on loopback, stopped after the session (or killed with pytest); the
    whole store is thrown away at the end of the session."""
    # building takes far longer than pytest-timeout allows a test: fail at once and say why
    bins = launcher.prebuilt()
    if bins is None:
        pytest.fail("the control plane is not built: run `make setup` (or "
                    "`tessera-dev build-controlplane`) first, or set TESSERA_BIN_DIR",
                    pytrace=False)
    with launcher.ControlPlane.start(bin_dir=bins) as plane:
        yield plane


@pytest.fixture(scope="session")
def tessera_crds(control_plane: launcher.ControlPlane) -> list[str]:
    """Every CRD tessera_contracts ships applied server-side and Established; returns their
    names."""
    with control_plane.api_client() as api:
        return crds.apply(api, crds.load())


@pytest.fixture(scope="session")
def local_cluster(control_plane: launcher.ControlPlane,
                  tessera_crds: list[str]) -> Iterator[cluster.Cluster]:
    """Simulated GPU nodes (Ready, running pods), discovery and Prometheus on the session's
    control plane: what `tessera-dev up` starts."""
    if shutil.which("prometheus") is None:
        pytest.fail("the prometheus binary is not on PATH: run `make setup`", pytrace=False)
    running = cluster.Cluster.start(control_plane,
                                    cluster.node_specs(CLUSTER_NODES, CLUSTER_GPUS))
    yield running
    running.stop()


@pytest.fixture
def admin_api(control_plane: launcher.ControlPlane) -> Iterator[client.ApiClient]:
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def namespace(admin_api: client.ApiClient) -> str:
    """A namespace of its own for each test, ready for pods: its `default` service account,
    which the controller-manager creates, exists (pods are refused until it does)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(admin_api)
    core.create_namespace({"metadata": {"name": name}})
    probes.poll_until(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, timeout=30,
        error=lambda _: TimeoutError(f"no default service account in {name} after 30 s"))
    return name


@pytest.fixture
def prometheus() -> Iterator[Callable[[Mapping[str, Sequence[str]]], Prometheus]]:
    """Factory: `prometheus({"job": ["127.0.0.1:PORT"]})` starts a server scraping every second."""
    # a failure, not a skip: `make setup` installs it, and a skip would hide a broken CI
    if shutil.which("prometheus") is None:
        pytest.fail("the prometheus binary is not on PATH: run `make setup` (it installs the "
                    "Debian package `prometheus`)", pytrace=False)
    servers: list[Prometheus] = []

    def start(jobs: Mapping[str, Sequence[str]]) -> Prometheus:
        servers.append(Prometheus.start(jobs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
