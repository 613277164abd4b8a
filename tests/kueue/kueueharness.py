"""What the tests marked kueue share: the size of their cluster, namespaces Kueue manages or not,
the example queues (manifests/kueue) sized for a test, and reading Kueue's objects."""

from __future__ import annotations

import uuid
from typing import Any

import yaml
from kubernetes import client

from tessera_dev import paths, probes
from tessera_dev.controlplane import kueue

NODES, GPUS = 2, 2
QUEUES = paths.repo_root() / "manifests" / "kueue" / "example-queues.yaml"
KUEUE_API = ("kueue.x-k8s.io", "v1beta2")
PLURALS = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues",
           "LocalQueue": "localqueues", "WorkloadPriorityClass": "workloadpriorityclasses"}


def make_namespace(api: client.ApiClient, managed: bool) -> str:
    """A namespace for jobs, ready for pods; `managed`: labelled for Kueue to manage."""
    name = f"q-{uuid.uuid4().hex[:8]}"
    labels = {kueue.MANAGED_LABEL: "true"} if managed else {}
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name, "labels": labels}})
    probes.poll_until(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, timeout=60,
        error=lambda _: TimeoutError(f"no default service account in {name}"))
    return name


def queues(api: client.ApiClient, namespace: str, gpus: int) -> str:
    """The example queues (manifests/kueue) for `namespace`, a ClusterQueue of its own holding
    `gpus` GPUs; returns the LocalQueue's name, which is the ClusterQueue's too."""
    name = f"gpus-{namespace}"
    custom = client.CustomObjectsApi(api)
    for doc in yaml.safe_load_all(QUEUES.read_text()):
        kind = doc["kind"]
        plural = PLURALS[kind]
        doc["metadata"]["name"] = {"ClusterQueue": name, "LocalQueue": name}.get(
            kind, doc["metadata"]["name"])
        if kind == "ClusterQueue":
            doc["spec"]["namespaceSelector"] = {
                "matchLabels": {"kubernetes.io/metadata.name": namespace}}
            for resource in doc["spec"]["resourceGroups"][0]["flavors"][0]["resources"]:
                if resource["name"] == kueue.GPU_RESOURCE:
                    resource["nominalQuota"] = gpus
        if kind == "LocalQueue":
            doc["metadata"]["namespace"] = namespace
            doc["spec"]["clusterQueue"] = name
            custom.create_namespaced_custom_object(*KUEUE_API, namespace, plural, doc)
        else:
            _apply_cluster_object(custom, plural, doc)
    return name


def _apply_cluster_object(custom: client.CustomObjectsApi, plural: str,
                          doc: dict[str, Any]) -> None:
    custom.patch_cluster_custom_object(
        *KUEUE_API, plural, doc["metadata"]["name"], doc, field_manager="tests", force=True,
        _content_type="application/apply-patch+yaml")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
