"""The CLI's way to the Kubernetes API: a client for a kubeconfig and context, plain JSON requests,
and one line for each way a request fails.

The kubernetes package is imported inside these functions, never when the module is: `--help`
and usage errors answer without it. Requests go through `ApiClient.call_api` with plain dicts,
not the typed APIs (`CoreV1Api`), whose ~250 pydantic models take over a second to import, more
than the requests themselves, and several seconds on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera_kube import clients

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

TIMEOUT_S = 10.0


class KubeError(Exception):
    """A request that cannot be made or was refused; the message is one line for the user."""


class ApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"API server answered {status}: {message}")
        self.status = status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--kubeconfig` and `--context`, as kubectl has them."""
    parser.add_argument("--kubeconfig", type=Path,
                        help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: its current context)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.kubeconfig is not None and not args.kubeconfig.is_file():
        parser.error(f"no kubeconfig at {args.kubeconfig}")


@contextmanager
def connect(kubeconfig: Path | None, context: str | None) -> Iterator[ApiClient]:
    """A client for `context` of `kubeconfig` (None: kubectl's defaults; in a pod without
    $KUBECONFIG, its service account), closed on exit."""
    try:
        api = clients.api_client(kubeconfig, context)
    except clients.CredentialsError as exc:
        raise KubeError(str(exc)) from exc
    with api:
        yield api


def default_namespace(kubeconfig: Path | None, context: str | None) -> str:
    """The namespace `context` (None: the current one) names, as kubectl defaults `-n`."""
    from kubernetes import config

    contexts, current = config.list_kube_config_contexts(
        None if kubeconfig is None else str(kubeconfig))
    chosen = current if context is None else next(
        (c for c in contexts if c.get("name") == context), None)
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def request(api: ApiClient, method: str, path: str, body: Any = None,
            content_type: str | None = None) -> dict[str, Any]:
    """The JSON object the API server answers `method path` with; ApiError for an error status,
    KubeError when it cannot be reached."""
    document = _json(_call(api, method, path, body, content_type, "application/json"))
    if not isinstance(document, dict):
        raise KubeError(f"API server answered {method} {path} with no JSON object")
    return document


def get_text(api: ApiClient, path: str) -> str:
    """The text the API server answers `GET path` with (a pod's page through its proxy);
    ApiError for an error status, KubeError when it cannot be reached."""
    return _call(api, "GET", path, None, None, "text/plain, */*").decode(errors="replace")


def _call(api: ApiClient, method: str, path: str, body: Any, content_type: str | None,
          accept: str) -> bytes:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    headers = {"Accept": accept} | ({} if content_type is None else {"Content-Type": content_type})
    serialized = api.param_serialize(method=method, resource_path=path, header_params=headers,
                                     body=body, auth_settings=["BearerToken"])
    try:
        response = api.call_api(*serialized, _request_timeout=TIMEOUT_S)
        response.read()
    except ApiException as exc:  # what the client makes of TLS and protocol errors
        raise KubeError(f"API server {api.configuration.host} unreachable: {exc.reason}") from exc
    except HTTPError as exc:
        reason = getattr(exc, "reason", None) or exc
        raise KubeError(f"API server {api.configuration.host} unreachable: {reason}") from exc
    if not 200 <= response.status <= 299:
        document = _json(response.data)
        message = document.get("message") if isinstance(document, dict) else None
        raise ApiError(response.status, message or str(response.reason))
    return response.data


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
