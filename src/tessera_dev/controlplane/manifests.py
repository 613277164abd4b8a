"""Server-side apply of the project's YAML manifests (RBAC, admission policies, deployments)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml
from kubernetes import client
from kubernetes.dynamic import DynamicClient

FIELD_MANAGER = "tessera"


def apply(api: client.ApiClient, paths: Iterable[Path]) -> list[str]:
    """Apply every document of every file, as `kubectl apply --server-side` would; returns
    `kind/name` of each object in order."""
    dynamic = DynamicClient(api)
    applied = []
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            kind = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            kind.server_side_apply(
                body=doc, name=doc["metadata"]["name"],
                namespace=doc["metadata"].get("namespace"), field_manager=FIELD_MANAGER,
                force_conflicts=True)
            applied.append(f"{doc['kind']}/{doc['metadata']['name']}")
    return applied
