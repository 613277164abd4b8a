"""Fixtures for the operator tests: the shipped RBAC applied, and the operator running as a real
process under its own service account's token (so the tests prove the RBAC is enough)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opharness import RunningOperator, operator_on

from tessera_dev.controlplane import launcher


@pytest.fixture(scope="module")
def running_operator(
    control_plane: launcher.ControlPlane, tessera_crds: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningOperator]:
    """`python -m tessera_operator.run` watching a fresh namespace, as tessera-operator."""
    with operator_on(control_plane, tmp_path_factory.mktemp("operator")) as running:
        yield running
