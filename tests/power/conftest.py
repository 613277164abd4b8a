"""What the power tests on a real kube-apiserver share: the shipped power-controller manifests
and clients acting as service accounts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tessera_dev.controlplane import manifests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def power_api(control_plane, tessera_crds) -> Iterator[Callable[[str, str], client.ApiClient]]:
    """Every CRD and the shipped power-controller manifests, applied as shipped; yields a
    factory of clients acting as a service account."""
    with control_plane.api_client() as admin:
        manifests.apply(admin, [ROOT / "manifests/system/namespace.yaml"] + [
            ROOT / "manifests/power-controller" / name
            for name in ("rbac.yaml", "admission.yaml", "daemonset.yaml")])
    clients: list[client.ApiClient] = []

    def as_account(namespace: str, name: str) -> client.ApiClient:
        clients.append(control_plane.service_account_client(namespace, name))
        return clients[-1]

    yield as_account
    for c in clients:
        c.close()
