"""Simulated GPU nodes: Node objects that serve a job on a control plane without kubelets.

The operator finds a job's nodes by the labels below; the power agents of the demo (simulated
NVML backend) then act for them. Nothing here is used against a real cluster, whose nodes are
labelled by their owners.
"""

from __future__ import annotations

from collections.abc import Iterable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_operator.handlers import JOB_LABEL, JOB_NAMESPACE_LABEL

GPU_PRESENT_LABEL = "nvidia.com/gpu.present"


def register(api: client.ApiClient, names: Iterable[str], job: str, namespace: str,
             domain_label: str | None = None, domain: str | None = None) -> list[str]:
    """Create (or relabel) one node per name serving `namespace/job`; returns the names."""
    core = client.CoreV1Api(api)
    labels = {JOB_LABEL: job, JOB_NAMESPACE_LABEL: namespace, GPU_PRESENT_LABEL: "true"}
    if domain_label and domain:
        labels[domain_label] = domain
    names = list(names)
    for name in names:
        body = {"metadata": {"name": name, "labels": labels}}
        try:
            core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            core.patch_node(name, body)
    return names
