"""Install CustomResourceDefinitions by server-side apply and wait until they are served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tessera_contracts import api
from tessera_dev import probes

FIELD_MANAGER = "tessera"


def load(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every CRD in the *.yaml files of directory (default: those tessera_contracts ships)."""
    if directory is None:
        return api.crd_documents()
    # the folder also holds its kustomization: only the CRDs themselves are installed here
    docs = [doc for path in sorted(directory.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text())
            if doc and doc.get("kind") == "CustomResourceDefinition"]
    if not docs:
        raise FileNotFoundError(f"no CustomResourceDefinitions in {directory}")
    return docs


def established(crd: client.V1CustomResourceDefinition) -> bool:
    conditions = (crd.status and crd.status.conditions) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


def apply(api: client.ApiClient, docs: list[dict[str, Any]], timeout: float = 30.0) -> list[str]:
    """Server-side apply each CRD, then wait until every one is Established; returns names."""
    ext = client.ApiextensionsV1Api(api)
    names = []
    for doc in docs:
        name = doc["metadata"]["name"]
        ext.patch_custom_resource_definition(
            name, doc, field_manager=FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml")
        names.append(name)
    probes.poll_until(
        lambda: sorted(n for n in names
                       if not established(ext.read_custom_resource_definition(n))),
        lambda pending: not pending, timeout=timeout,
        error=lambda pending: TimeoutError(
            f"CRDs not Established after {timeout:.0f} s: {pending}"))
    return names
