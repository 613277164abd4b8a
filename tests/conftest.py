"""Shared fixtures: one real control plane per session, fresh namespaces, Prometheus servers."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest
from kubernetes import client

from tessera_operator.controlplane import crds, launcher
from tessera_operator.controlplane.prometheus import Prometheus


@pytest.fixture(scope="session")
def control_plane() -> Iterator[launcher.ControlPlane]:
    """etcd + kube-apiserver on loopback, stopped after the session (or killed with pytest).

    No controller-manager runs: deleted namespaces never finish terminating, so tests do not
    delete theirs; the whole store is thrown away at the end of the session.
    """
    # building takes far longer than pytest-timeout allows a test: fail at once and say why
    bins = launcher.prebuilt()
    if bins is None:
        pytest.fail("kube-apiserver and etcd are not built: run `make setup` (or "
                    "`tessera build-controlplane`) first, or set TESSERA_BIN_DIR", pytrace=False)
    with launcher.ControlPlane.start(bin_dir=bins) as plane:
        yield plane


@pytest.fixture(scope="session")
def tessera_crds(control_plane: launcher.ControlPlane) -> list[str]:
    """Every CRD in crds/ applied server-side and Established; returns their names."""
    with control_plane.api_client() as api:
        return crds.apply(api, crds.load())


@pytest.fixture
def admin_api(control_plane: launcher.ControlPlane) -> Iterator[client.ApiClient]:
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def namespace(admin_api: client.ApiClient) -> str:
    """A namespace of its own for each test."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    client.CoreV1Api(admin_api).create_namespace({"metadata": {"name": name}})
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
