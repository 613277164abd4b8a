"""Calls with a deadline: a hung device call (a GPU lost mid-call) must not eat the grace period.

Each call runs in its own daemon thread; one that has not answered by the deadline is abandoned
(its thread cannot be killed, but neither does it keep the process from exiting).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")


def call_all(calls: Mapping[K, Callable[[], T]], timeout_s: float) -> dict[K, T | Exception]:
    """Run every call at once; each key maps to its result, its exception, or a TimeoutError."""
    results: dict[K, T | Exception] = {}

    def run(key: K, fn: Callable[[], T]) -> None:
        try:
            results[key] = fn()
        except Exception as err:  # handed to the caller, who knows what each failure means
            results[key] = err

    threads = [
        threading.Thread(target=run, args=(key, fn), name=f"bounded {key}", daemon=True)
        for key, fn in calls.items()
    ]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = TimeoutError(f"no answer within {timeout_s:g} s")
    return {key: results.get(key, late) for key in calls}
