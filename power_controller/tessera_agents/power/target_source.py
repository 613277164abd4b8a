"""The agent's side of the power channel: its node's `GPUPowerTarget`, read through a watch, and
the status it writes back (the operator writes the spec: tessera_operator.power_targets)."""

from __future__ import annotations

import copy
import threading
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_contracts.api import GROUP, VERSION
from tessera_contracts.api import POWER_TARGET_PLURAL as PLURAL
from tessera_kube.listwatch import ListWatch

# How long one watch request of an agent lasts before it is renewed (from where it left off):
# one request per node per WATCH_TIMEOUT_S, instead of one per node per agent step.
WATCH_TIMEOUT_S = 120


class SourceError(Exception):
    """The target could not be fetched (API server unreachable, forbidden, malformed reply)."""


def _api(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


class KubeTargetSource:
    """The agent's view of its node's target: kept current by a watch on that one object (one
    long-lived request per node instead of a GET every step), and where its status is written.

    `fetch` answers from the watch; until the first list has answered, and while the watch is
    broken and re-listing fails, it raises SourceError, so the agent treats it as an outage (the
    last target it read stays in force) and never mistakes "not known" for "deleted".
    """

    def __init__(self, api_client: client.ApiClient, node: str, timeout_s: float,
                 watch_s: int = WATCH_TIMEOUT_S) -> None:
        self._client, self._node, self._timeout = api_client, node, timeout_s
        self._lock = threading.Lock()
        self._obj: dict[str, Any] | None = None
        self._error: Exception | None = SourceError("the target has not been read yet")
        retry = min(1.0, timeout_s)
        self._watch = ListWatch(
            _api(api_client).list_cluster_custom_object, GROUP, VERSION, PLURAL,
            field_selector=f"metadata.name={node}", on_list=self._listed,
            on_event=self._changed, on_error=self._failed, watch_s=watch_s,
            timeout_s=timeout_s, retry_s=(retry, retry), name="target watch")
        self._started = False

    def fetch(self) -> dict[str, Any] | None:
        if not self._started:
            self._watch.relist()  # the first answer comes from this call, not a thread's later one
            self._watch.start()
            self._started = True
        with self._lock:
            if self._error is not None:
                raise self._error
            return copy.deepcopy(self._obj)

    def close(self) -> None:
        self._watch.stop()

    def _listed(self, items: list[dict[str, Any]]) -> None:
        with self._lock:
            self._obj = items[0] if items else None
            self._error = None

    def _changed(self, kind: str, obj: dict[str, Any]) -> None:
        with self._lock:
            if kind in ("ADDED", "MODIFIED"):
                self._obj = obj
            elif kind == "DELETED":
                self._obj = None

    def _failed(self, err: Exception) -> None:
        with self._lock:
            self._error = _source_error(err)

    def report(self, status: dict[str, Any], uid: str | None) -> None:
        """Make `status` (less its None values) the status of the object with `uid`, the one the
        agent acted on. The name alone could be a target deleted and created again since, with
        another spec: a status saying the budget of its generation is in effect would let the
        operator raise the rest of the rack on a cut never made. So the write is a JSON patch
        that first tests the uid (the API server ignores a uid in a merge patch of the status)
        and fails on any other object; the next step writes to the one seen then."""
        patch = [{"op": "test", "path": "/metadata/uid", "value": uid},
                 {"op": "add", "path": "/status",
                  "value": {k: v for k, v in status.items() if v is not None}}]
        try:
            _api(self._client).patch_cluster_custom_object_status(
                GROUP, VERSION, PLURAL, self._node, patch,
                _content_type="application/json-patch+json", _request_timeout=self._timeout)
        except Exception as err:
            raise _source_error(err) from err


def _source_error(err: Exception) -> SourceError:
    if isinstance(err, SourceError):
        return err
    if isinstance(err, ApiException):
        return SourceError(f"API server answered {err.status}: {err.reason}")
    return SourceError(f"API server unreachable: {err}")  # refused, reset, timed out, TLS
