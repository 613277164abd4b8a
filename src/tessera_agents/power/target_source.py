"""The agent's side of the power channel: its node's `GPUPowerTarget`, read through a watch, and
the status it writes back (the operator writes the spec: tessera_operator.power_targets)."""

from __future__ import annotations

import copy
import threading
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tessera_contracts.api import GROUP, VERSION
from tessera_contracts.api import POWER_TARGET_PLURAL as PLURAL

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
        self._client, self._node, self._timeout, self._watch_s = (
            api_client, node, timeout_s, watch_s)
        self._lock = threading.Lock()
        self._obj: dict[str, Any] | None = None
        self._error: Exception | None = SourceError("the target has not been read yet")
        self._resource_version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def fetch(self) -> dict[str, Any] | None:
        if self._thread is None:
            self._relist()  # the first answer comes from this call, not a thread's later one
            self._thread = threading.Thread(target=self._watch, name="target watch",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            if self._error is not None:
                raise self._error
            return copy.deepcopy(self._obj)

    def close(self) -> None:
        self._stop.set()

    def _relist(self) -> None:
        try:
            listed = _api(self._client).list_cluster_custom_object(
                GROUP, VERSION, PLURAL, field_selector=f"metadata.name={self._node}",
                _request_timeout=self._timeout)
            items = listed["items"]
            with self._lock:
                self._obj = items[0] if items else None
                self._resource_version = listed["metadata"]["resourceVersion"]
                self._error = None
        except Exception as err:
            with self._lock:
                self._error = _source_error(err)

    def _watch(self) -> None:
        """Follow the object's changes; on any failure, say so, and re-list until it answers."""
        while not self._stop.is_set():
            if self._error is None:
                try:
                    self._follow()
                    continue  # the server ended the watch after watch_s: resume from there
                except Exception as err:  # gone (410), dropped, refused, timed out
                    with self._lock:
                        self._error = _source_error(err)
            self._stop.wait(min(1.0, self._timeout))
            self._relist()

    def _follow(self) -> None:
        w = watch.Watch()
        stream = w.stream(
            _api(self._client).list_cluster_custom_object, GROUP, VERSION, PLURAL,
            field_selector=f"metadata.name={self._node}",
            resource_version=self._resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_s,
            # a connection that dies silently ends the read some time after the server would
            _request_timeout=(self._timeout, self._watch_s + self._timeout))
        for event in stream:
            obj = event["object"]
            with self._lock:
                self._resource_version = obj["metadata"]["resourceVersion"]
                if event["type"] in ("ADDED", "MODIFIED"):
                    self._obj = obj
                elif event["type"] == "DELETED":
                    self._obj = None
            if self._stop.is_set():
                w.stop()

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
