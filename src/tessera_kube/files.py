"""Files written whole or not at all: a reader, or a restart after a crash, sees the old content
or the new, never a part; and an advisory lock for read-modify-write across processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes | str, mode: int | None = None, *,
                 durable: bool = False) -> None:
    """Replace `path` by `data` through a hidden temporary file beside it. `mode`: the file's
    permissions (default: the temporary file's, 0600). `durable`: the content and the rename
    reach the disk before this returns (for state a restart acts on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:  # the rename itself must be recorded before anyone acts on it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON, durably (state a restarted process reads back)."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True), durable=True)


def read_json(path: Path) -> Any | None:
    """The file's content, or None when it does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` + '.lock' (read-modify-write across processes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
