"""Tessera installed into a namespace other than tessera-system, by a kustomize overlay: its
admission policies name the operator's and the agents' service accounts after the namespace they
run in, so the operator creates a job's pods and the job trains."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import yaml
from installharness import (
    HANG_S,
    ROOT,
    create_job,
    installed_cluster,
    job_status,
    new_namespace,
    tiny_job,
)
from kubernetes import client

from tessera_dev import install, probes

pytestmark = pytest.mark.ship

OTHER = "tessera-elsewhere"
# manifests/local's Role and RoleBinding that let the power agents list the exporter pods belong
# in the exporter's namespace, which a `namespace:` overlay moves them out of: put them back.
TO_THE_EXPORTER = {"op": "replace", "path": "/metadata/namespace", "value": "gpu-operator"}
EXPORTER_FINDER = {"resources": ["moved"], "patches": [
    {"target": {"kind": "Role", "name": "tessera-dcgm-exporter-pod-finder"},
     "patch": yaml.safe_dump([TO_THE_EXPORTER])},
    {"target": {"kind": "RoleBinding", "name": "tessera-power-agent-dcgm-exporter-pod-finder"},
     "patch": yaml.safe_dump([TO_THE_EXPORTER, {"op": "replace", "path": "/subjects/0/namespace",
                                                "value": OTHER}])}]}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[client.ApiClient]:
    """A cluster of its own with manifests/local applied through an overlay into OTHER."""
    overlay = tmp_path_factory.mktemp("overlay")
    moved = overlay / "moved"
    moved.mkdir()
    # kustomize takes a base by relative path only
    base = os.path.relpath(ROOT / "manifests/local", moved)
    (moved / "kustomization.yaml").write_text(f"namespace: {OTHER}\nresources:\n  - {base}\n")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(EXPORTER_FINDER))
    with installed_cluster(overlay, OTHER) as (_, api):
        yield api


def test_the_overlay_installs_nothing_into_tessera_system(installed):
    namespaces = {n.metadata.name for n in client.CoreV1Api(installed).list_namespace().items}
    assert OTHER in namespaces and install.SYSTEM_NS not in namespaces


def test_a_job_trains_with_tessera_in_another_namespace(installed):
    api = installed
    namespace = f"j-{uuid.uuid4().hex[:8]}"
    new_namespace(api, namespace)
    create_job(api, namespace, tiny_job("tiny"))
    # the operator's pods, layout and progress writes all pass the policies: steps follow
    probes.poll_until(lambda: job_status(api, namespace, "tiny"),
                      lambda status: (status.get("step") or 0) >= 2, timeout=HANG_S,
                      interval=1.0, error=lambda last: AssertionError(
                          f"the job trained no steps with Tessera in {OTHER}: {last}"))
