"""Kubeconfig documents for the local control plane (admin certificate or bearer token users)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from tessera_dev.controlplane import pki

CONTEXT = "tessera-local"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def certificate_user(cert: Path, key: Path) -> dict[str, str]:
    return {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}


def token_user(token: str) -> dict[str, str]:
    return {"token": token}


def render(server: str, ca_cert: Path, user: dict[str, str], user_name: str) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded) with one cluster, user and context."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {
            "server": server, "certificate-authority-data": _b64(ca_cert)}}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user_name}}],
        "current-context": CONTEXT,
        "preferences": {},
    }


def write(path: Path, config: dict[str, Any]) -> Path:
    """Write a kubeconfig readable by its owner only: it may embed the admin's private key."""
    return pki.write_secret(path, yaml.safe_dump(config, sort_keys=False).encode())
