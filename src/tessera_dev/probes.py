"""Waiting on local servers: one deadline-bounded poll loop and one HTTP readiness probe."""

from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(
    probe: Callable[[], T], done: Callable[[T], bool] = bool, *, timeout: float,
    error: Callable[[T], Exception], interval: float = 0.1,
) -> T:
    """Call `probe` until `done` holds for its result, and return that result.

    After `timeout` seconds raise `error(last result)`, so the message can say what was still
    missing. A probe that raises ends the wait at once (a server that exited, say).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if done(result):
            return result
        if time.monotonic() >= deadline:
            raise error(result)
        time.sleep(interval)


def wait_for(what: str, probe: Callable[[], T], done: Callable[[T], bool] = bool, *,
             timeout: float, interval: float = 0.5) -> T:
    """`poll_until` for a test or a demo step: the error names `what` was awaited and the last
    result seen."""
    return poll_until(probe, done, timeout=timeout, interval=interval, error=lambda last: (
        TimeoutError(f"{what} not reached in {timeout:.0f} s; last: {last!r}")))


def responds(url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    """Whether GET url answers 200 within `timeout` seconds (refused, hung or failed: False)."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as response:
            return response.status == 200
    except OSError:  # URLError, HTTPError, refused connections and timeouts are all OSErrors
        return False
