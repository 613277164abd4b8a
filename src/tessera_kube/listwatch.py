"""Following a selection of objects as informers do: list, then watch from the list's
resourceVersion until the server ends the watch, and list again after it expires (410) or fails.

Every request is bounded (the connection and each read by `timeout_s`, a watch by `watch_s` plus
that), and objects are handed over as the API server's JSON (plain dicts, camelCase), whatever
the list function's model: a caller reads the same fields it would read with kubectl.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

ListFn = Callable[..., Any]  # a client's list_* method (namespaced, cluster or custom objects)


class Expired(Exception):
    """The watch's resourceVersion is older than the server keeps (410 Gone): list again."""


def list_objects(list_fn: ListFn, *args: Any, timeout_s: float, **selection: Any
                 ) -> tuple[list[dict[str, Any]], str]:
    """The objects `list_fn(*args, **selection)` lists, and the list's resourceVersion."""
    response = list_fn(*args, **selection, _preload_content=False, _request_timeout=timeout_s)
    listed = json.loads(response.data)
    return list(listed.get("items") or []), listed["metadata"]["resourceVersion"]


def watch_events(list_fn: ListFn, *args: Any, resource_version: str, watch_s: int,
                 timeout_s: float, **selection: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, object) for each change after `resource_version`, bookmarks included (their object
    carries only the new resourceVersion), until the server ends the watch after `watch_s`.
    Expired when the version is too old; the client's ApiException for any other error."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.watch.watch import iter_resp_lines

    response = list_fn(
        *args, **selection, watch=True, resource_version=resource_version,
        allow_watch_bookmarks=True, timeout_seconds=watch_s, _preload_content=False,
        # a connection that dies silently ends the read some time after the server would
        _request_timeout=(timeout_s, watch_s + timeout_s))
    try:
        for line in iter_resp_lines(response):
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Expired(obj.get("message", "resourceVersion too old"))
                raise ApiException(status=obj.get("code"), reason=obj.get("message"))
            yield kind, obj
    finally:
        response.close()
        response.release_conn()


class ListWatch:
    """A selection of objects followed in a thread of its own.

    `on_list(items)` gets every list's whole answer (the first, and each after the watch expired
    or failed: the selection as it is, which replaces anything known before); `on_event(type,
    obj)` each ADDED, MODIFIED or DELETED object in between; `on_error(exc)` each failure of
    either, after which the list is tried again `retry_s[0]` later, doubling up to `retry_s[1]`
    while it keeps failing. A watch the server ends normally resumes from the last version seen.
    """

    def __init__(self, list_fn: ListFn, *args: Any,
                 on_list: Callable[[list[dict[str, Any]]], None],
                 on_event: Callable[[str, dict[str, Any]], None],
                 on_error: Callable[[Exception], None],
                 watch_s: int = 60, timeout_s: float = 10.0,
                 retry_s: tuple[float, float] = (0.5, 5.0), name: str = "list-watch",
                 **selection: Any) -> None:
        self._list_fn, self._args, self._selection = list_fn, args, selection
        self._on_list, self._on_event, self._on_error = on_list, on_event, on_error
        self.watch_s, self.timeout_s, self.retry_s = watch_s, timeout_s, retry_s
        self._version: str | None = None
        self.name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def relist(self) -> bool:
        """List now, in the caller's thread (a first answer it waits for); False on failure,
        which `on_error` was told."""
        try:
            items, self._version = list_objects(self._list_fn, *self._args,
                                                timeout_s=self.timeout_s, **self._selection)
        except Exception as exc:  # an outage, a refusal: said, and the list tried again
            self._version = None
            self._on_error(exc)
            return False
        self._on_list(items)
        return True

    def start(self) -> ListWatch:
        """Follow in a thread of its own."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following: at once between requests, else when the current one answers."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Follow in the caller's thread, until stopped."""
        wait = self.retry_s[0]
        while not self._stop.is_set():
            if self._version is None and not self.relist():
                self._stop.wait(wait)
                wait = min(2 * wait, self.retry_s[1])
                continue
            wait = self.retry_s[0]
            try:
                self._follow()
                log.debug("%s: the watch ended, watching again from resourceVersion %s",
                          self.name, self._version)
            except Expired as exc:
                log.info("%s: watch expired (%s), listing again", self.name, exc)
                self._version = None
            except Exception as exc:  # dropped, refused, timed out: said, then listed again
                self._version = None
                self._on_error(exc)
                self._stop.wait(wait)

    def _follow(self) -> None:
        assert self._version is not None
        for kind, obj in watch_events(self._list_fn, *self._args, resource_version=self._version,
                                      watch_s=self.watch_s, timeout_s=self.timeout_s,
                                      **self._selection):
            self._version = (obj.get("metadata") or {}).get("resourceVersion", self._version)
            if kind != "BOOKMARK":
                self._on_event(kind, obj)
            if self._stop.is_set():
                return
