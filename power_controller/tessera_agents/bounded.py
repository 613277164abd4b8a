"""Calls and connections with a deadline: a hung device call (a GPU lost mid-call) must not eat
the grace period, and a peer that answers slowly must not hold an agent's loop.

Each call runs in its own daemon thread; one that has not answered by the deadline is abandoned
(its thread cannot be killed, but neither does it keep the process from exiting). A connection
is bounded as a whole: a socket's timeout bounds each read, not the exchange, so a peer that
sends one byte before each timeout would hold it forever; `shut_at` shuts it down at the
deadline instead.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import NoReturn, TypeVar

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


def open_connection(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to `host`:`port`, its name resolved and connected within `timeout_s` in
    all (a resolver's own timeouts add up to far longer; an abandoned lookup ends on its own).
    OSError (TimeoutError at the deadline) says why there is none. The socket's timeout is
    what is left of `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    found = call_all({host: lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)},
                     timeout_s)[host]
    if isinstance(found, Exception):
        raise found
    error = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in found:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not connected within {timeout_s:g} s")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        except OSError as err:
            sock.close()
            error = err
        else:
            return sock
    raise error


@contextmanager
def shut_at(sock: socket.socket, timeout_s: float) -> Iterator[threading.Event]:
    """Shut the connection of `sock` down `timeout_s` from now unless the block has ended; the
    event yielded is set when it was. A read blocked on it then sees the end of the stream (or
    an error), whichever thread it is in. The connection is reached through a duplicate of the
    descriptor, so it stays reachable when `sock` is wrapped (TLS detaches the socket it wraps);
    `sock` itself is the caller's to close."""
    handle = sock.dup()
    expired = threading.Event()

    def shut() -> None:
        expired.set()
        with suppress(OSError):  # the peer has closed it already
            handle.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(max(timeout_s, 0.0), shut)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()
        timer.join()
        handle.close()


def exit_abandoning_calls(main: Callable[[list[str]], int], argv: list[str]) -> NoReturn:
    """Run an agent's `main`, then end the process with its code without the interpreter's
    teardown. A call abandoned at its deadline (a watch blocked reading an unreachable API
    server, a device call that never answered) may still be inside the TLS or driver library
    whose exit handlers the teardown runs; the process can then die of SIGABRT after a clean
    shutdown, and its exit code no longer says how the agent ended."""
    code = main(argv)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # closed or gone: nothing left to lose
            stream.flush()
    os._exit(code)
