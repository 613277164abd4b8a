"""What both node agents need of the API server: a client that tries each call once, and the
check that `--node` is a node's name (it also names files and objects)."""

from __future__ import annotations

import re
from typing import Any

from tessera_kube import clients


def api_client(kubeconfig: str | None) -> Any:
    """A client of the API server from `kubeconfig` (None: the pod's service account) that
    makes one bounded attempt per call: an agent's loop is the retry."""
    return clients.api_client(kubeconfig, retries=0)


_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_node_name(name: str) -> bool:
    return len(name) <= 253 and _NODE_NAME.fullmatch(name) is not None
