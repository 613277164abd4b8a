"""The operator -> agent channel: one cluster-scoped `GPUPowerTarget` per node, named after it.

The operator writes (`publish`, `withdraw`); the agent only reads (`KubeTargetSource`). RBAC in
manifests/power-controller/rbac.yaml lets only the operator's service account write these
objects, and the agent re-validates every object it reads (`targets.parse_object`). Every call
carries a timeout so that neither side can hang on an unreachable API server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from power_controller.targets import (
    GROUP,
    OPTIONAL_FIELDS,
    PLURAL,
    VERSION,
    PowerTarget,
    to_object,
)

DEFAULT_TIMEOUT_S = 5.0


class SourceError(Exception):
    """The target could not be fetched (API server unreachable, forbidden, malformed reply)."""


def _api(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def publish(
    api_client: client.ApiClient, target: PowerTarget, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """Create or update the node's target (operator side); the API's answer is returned."""
    api, body = _api(api_client), to_object(target)
    try:
        return api.create_cluster_custom_object(
            GROUP, VERSION, PLURAL, body, _request_timeout=timeout_s
        )
    except ApiException as err:
        if err.status != 409:
            raise
    # A merge patch replaces `gpus` as a whole, so GPUs dropped from the boost list go back to
    # base; optional fields the new target leaves out are nulled, which deletes them.
    patch = {"metadata": {"labels": body["metadata"]["labels"]},
             "spec": dict.fromkeys(OPTIONAL_FIELDS) | body["spec"]}
    return api.patch_cluster_custom_object(
        GROUP, VERSION, PLURAL, target.node, patch, _request_timeout=timeout_s
    )


def publish_all(
    api_client: client.ApiClient,
    targets: Mapping[str, PowerTarget],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Publish a rack's targets, the nodes whose share shrinks first (see README: rack budgets
    spanning several nodes)."""
    current = {}
    for node in targets:
        obj = fetch(api_client, node, timeout_s)
        current[node] = int(obj["spec"]["budgetWatts"]) if obj else 0
    for target in sorted(targets.values(), key=lambda t: t.budget_w - current[t.node]):
        publish(api_client, target, timeout_s)


def withdraw(api_client: client.ApiClient, node: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Delete the node's target: its agent then holds the limits where they are."""
    try:
        _api(api_client).delete_cluster_custom_object(
            GROUP, VERSION, PLURAL, node, _request_timeout=timeout_s
        )
    except ApiException as err:
        if err.status != 404:
            raise


def fetch(
    api_client: client.ApiClient, node: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any] | None:
    """The node's target object as the API holds it, or None when there is none."""
    try:
        return _api(api_client).get_cluster_custom_object(
            GROUP, VERSION, PLURAL, node, _request_timeout=timeout_s
        )
    except ApiException as err:
        if err.status == 404:
            return None
        raise


class KubeTargetSource:
    """The agent's read-only view of its node's target."""

    def __init__(self, api_client: client.ApiClient, node: str, timeout_s: float) -> None:
        self._client, self._node, self._timeout = api_client, node, timeout_s

    def fetch(self) -> dict[str, Any] | None:
        try:
            return fetch(self._client, self._node, self._timeout)
        except ApiException as err:
            raise SourceError(f"API server answered {err.status}: {err.reason}") from err
        except Exception as err:  # transport: refused, reset, timed out, TLS
            raise SourceError(f"API server unreachable: {err}") from err
