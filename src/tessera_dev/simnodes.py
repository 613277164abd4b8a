"""GPU nodes without a kubelet: Node objects for the operator's tests and benchmark.

A job is placed on nodes by GPU capacity and scale-up domain; these nodes advertise
`nvidia.com/gpu` and carry a pool label that a job's `nodeSelector` names, so that jobs of
different tests never land on each other's nodes. Their pods are bound by the scheduler and
never run (`tessera-dev up` starts nodes that run them). Nothing here is used against a real
cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_operator.workload import GPU_RESOURCE

GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
POOL_LABEL = "pool.tessera.dev/name"


def register(api: client.ApiClient, names: Iterable[str], pool: str, gpus: int = 8,
             domain_label: str | None = None, domain: str | None = None,
             labels: Mapping[str, str] | None = None) -> list[str]:
    """Create (or relabel) one node per name in `pool`, each with `gpus` GPUs and `labels`
    beside the pool's; returns the names."""
    core = client.CoreV1Api(api)
    labels = {**(labels or {}), POOL_LABEL: pool, GPU_PRESENT_LABEL: "true"}
    if domain_label and domain:
        labels[domain_label] = domain
    names = list(names)
    status = {"status": {"capacity": {GPU_RESOURCE: str(gpus)},
                         "allocatable": {GPU_RESOURCE: str(gpus)}}}
    for name in names:
        body = {"metadata": {"name": name, "labels": labels}}
        try:
            core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            core.patch_node(name, body)
        core.patch_node_status(name, status)
    return names


def pool_selector(pool: str) -> dict[str, str]:
    """The `nodeSelector` of a job placed in `pool`."""
    return {POOL_LABEL: pool}


def place_in_pool(spec: dict[str, Any], pool: str) -> dict[str, Any]:
    """`spec` (a job's, changed in place) with its pod template's nodeSelector naming `pool`."""
    template = spec.setdefault("template", {}).setdefault("spec", {})
    template["nodeSelector"] = pool_selector(pool)
    return spec
