"""Children that die with their parent: a process started for another must not outlive it."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """A preexec_fn making the child die (SIGKILL) when the thread that forks it ends."""
    parent = os.getpid()
    # libc is loaded here, before the fork: the child only makes one system call
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # the parent may have died between fork and prctl; then no signal would ever come
        if os.getppid() != parent:
            os._exit(1)

    return preexec
