"""Install CustomResourceDefinitions by server-side apply and wait until they are served."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

FIELD_MANAGER = "tessera"
# crds/ at the repository root (the package is installed editable from the checkout)
CRD_DIR = Path(__file__).resolve().parents[3] / "crds"


def load(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    docs = [doc for path in sorted(directory.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]
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
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending:
        pending = {n for n in pending
                   if not established(ext.read_custom_resource_definition(n))}
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"CRDs not Established after {timeout:.0f} s: {sorted(pending)}")
        if pending:
            time.sleep(0.1)
    return names
