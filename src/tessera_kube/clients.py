"""An API client as kubectl chooses its credentials, for every process that talks to the API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

# Where a pod finds its own namespace (the service account's projected volume).
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class CredentialsError(RuntimeError):
    """No usable credentials: the message says which were tried and how to give others."""


def in_pod() -> bool:
    """Whether the process runs in a pod (the kubelet sets the API server's address)."""
    return "KUBERNETES_SERVICE_HOST" in os.environ


def api_client(kubeconfig: str | Path | None = None, context: str | None = None, *,
               retries: int | None = None) -> ApiClient:
    """A client of the API server, with client-go's choice of credentials: the kubeconfig file
    and context given; else $KUBECONFIG; else, in a pod, its service account; else
    ~/.kube/config. `retries`: how often the client itself retries a failed connection (0 for a
    process whose loop is the retry; None: the client's default)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    explicit = kubeconfig is not None or context is not None
    try:
        if not explicit and "KUBECONFIG" not in os.environ and in_pod():
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(
                config_file=None if kubeconfig is None else str(kubeconfig), context=context,
                client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        where = "" if context is None else f" (context {context!r})"
        raise CredentialsError(
            f"no Kubernetes credentials: {exc}{where}; pass --kubeconfig or --context, or set "
            "$KUBECONFIG") from None
    if retries is not None:
        configuration.retries = retries
    return client.ApiClient(configuration)


def pod_namespace() -> str | None:
    """The namespace of the pod the process runs in (None outside one)."""
    try:
        return POD_NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None
