"""Server-side apply of the project's YAML manifests (RBAC, admission policies, deployments)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.dynamic import DynamicClient

FIELD_MANAGER = "tessera"


def apply(api: client.ApiClient, paths: Iterable[Path]) -> list[str]:
    """Apply every document of every file, as `kubectl apply --server-side` would; returns
    `kind/name` of each object in order."""
    return apply_documents(api, [doc for path in paths
                                 for doc in yaml.safe_load_all(Path(path).read_text()) if doc])


def apply_documents(api: client.ApiClient, docs: Iterable[dict[str, Any]]) -> list[str]:
    """Server-side apply each object, in order; returns `kind/name` of each."""
    dynamic = DynamicClient(api)
    applied = []
    for doc in docs:
        kind = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        kind.server_side_apply(
            body=doc, name=doc["metadata"]["name"],
            namespace=doc["metadata"].get("namespace"), field_manager=FIELD_MANAGER,
            force_conflicts=True)
        applied.append(f"{doc['kind']}/{doc['metadata']['name']}")
    return applied
