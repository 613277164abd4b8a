"""Tessera installed into a namespace other than tessera-system, by a kustomize overlay: its
admission policies name the operator's and the agents' service accounts after the namespace they
run in, so the operator creates a job's pods and the job trains."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from installharness import (
    HANG_S,
    ROOT,
    create_job,
    job_status,
    local_cluster,
    new_namespace,
    run,
    tiny_job,
    wait_installed,
)
from kubernetes import client

from tessera_dev import probes
from tessera_dev.controlplane import launcher

pytestmark = pytest.mark.ship

OTHER = "tessera-elsewhere"


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[launcher.ControlPlane]:
    """A cluster of its own with manifests/local applied through an overlay into OTHER."""
    overlay = tmp_path_factory.mktemp("overlay")
    # kustomize takes a base by relative path only
    base = os.path.relpath(ROOT / "manifests/local", overlay)
    (overlay / "kustomization.yaml").write_text(
        f"namespace: {OTHER}\nresources:\n  - {base}\n")
    with local_cluster() as (plane, _):
        run(["kubectl", "apply", "--server-side", "-k", str(overlay)], plane.kubeconfig)
        yield plane


def test_the_overlay_installs_nothing_into_tessera_system(plane):
    with plane.api_client() as api:
        namespaces = {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items}
        assert OTHER in namespaces and "tessera-system" not in namespaces
        wait_installed(api, OTHER)


def test_a_job_trains_with_tessera_in_another_namespace(plane):
    with plane.api_client() as api:
        wait_installed(api, OTHER)
        namespace = f"j-{uuid.uuid4().hex[:8]}"
        new_namespace(api, namespace)
        create_job(api, namespace, tiny_job("tiny"))
        # the operator's pods, layout and progress writes all pass the policies: steps follow
        probes.poll_until(lambda: job_status(api, namespace, "tiny"),
                          lambda status: (status.get("step") or 0) >= 2, timeout=HANG_S,
                          interval=1.0, error=lambda last: AssertionError(
                              f"the job trained no steps with Tessera in {OTHER}: {last}"))
