"""The agent's record, on the host, of the GPUs whose limits it changed, the last limit set, each
one's index on the node, and the node's last known budget share.

Written before each change reaches a GPU (write-ahead), so that whatever kills the agent, the
next agent on the node finds every GPU it must deal with: settle it inside the recorded share
(restore to the device's default, read from the device at that time, where no share was ever
given), or hold at the last limit set, which met the budget. Keyed by UUID: GPU indices may be
renumbered across reboots, UUIDs are not. The share is recorded before the agent acts on a
target, so a successor never knows less budget than its predecessor acted on.

A GPU that fell off the bus no longer answers for its UUID, only its index still names it: so
each GPU's index is recorded with the host's boot id, and a successor started in the same boot
counts a GPU it cannot identify at the limit last recorded for that index (`lost_limit`), not at
the device maximum. After a reboot the indices may name other GPUs, and every GPU has its driver
default again: they are not used.

The file lives on a hostPath that outlives the agent, so its content is validated on load: entries
that do not parse are dropped with a warning, and a file that cannot be understood at all is
reported as `unreadable` so the agent treats every GPU as changed rather than silently forget one.
"""

from __future__ import annotations

import fcntl
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tessera_kube.files import write_json_atomic

FORMAT = 2
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
log = logging.getLogger("tessera.power-agent")


def boot_id() -> str | None:
    """This boot of the host (the kernel's random boot id, the host's in any container); None
    where the kernel does not say."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


class StateLocked(RuntimeError):
    """Another agent holds the node's record: two agents would undo each other's changes."""


@dataclass
class ManagedGpus:
    """uuid -> last limit set in milliwatts (None: not known), uuid -> its index on the node in
    this boot, and the `spec` of the node's settled target (`PowerTarget.settled`: its budget
    share and base cap; None: never given one), persisted at `path` on change."""

    path: Path
    gpus: dict[str, int | None] = field(default_factory=dict)
    unreadable: bool = False  # the file existed but made no sense: every GPU counts as changed
    share: dict[str, Any] | None = None
    indices: dict[str, int] = field(default_factory=dict)
    boot: str | None = field(default_factory=boot_id)
    _lock: IO[str] | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path) -> ManagedGpus:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path)
        except OSError as err:
            log.error("%s cannot be read (%s): every GPU counts as changed", path, err)
            return cls(path, unreadable=True)
        try:
            data = json.loads(text)
            gpus = _parse(data, path)
        except (ValueError, TypeError) as err:
            log.error("%s is not a state file this agent understands (%s): every GPU counts as "
                      "changed", path, err)
            return cls(path, unreadable=True)
        share = data.get("share")
        if share is not None and not isinstance(share, dict):
            log.warning("%s: ignoring the recorded share %r: not an object", path, share)
            share = None
        return cls(path, gpus, share=share, indices=_indices(data, gpus, path))

    @classmethod
    def open(cls, path: Path) -> ManagedGpus:
        """Lock the record for this process's lifetime, then load it; StateLocked if taken."""
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 -- held until exit
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StateLocked(
                f"{path} is locked by another power agent on this node; refusing to start"
            ) from None
        state = cls.load(path)
        state._lock = lock
        return state

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def _save(self, gpus: dict[str, int | None], share: dict[str, Any] | None,
              indices: dict[str, int]) -> None:
        kept = {} if self.boot is None else {"boot": self.boot, "indices": indices}
        write_json_atomic(self.path, {"format": FORMAT, "gpus": gpus} | kept
                          | ({} if share is None else {"share": share}))
        # only once it is on disk: memory never claims more than the file
        self.gpus, self.share, self.indices = gpus, share, indices

    def record(self, uuid: str, limit_mw: int | None, index: int | None = None) -> None:
        indices = self.indices if index is None else self.indices | {uuid: index}
        if self.gpus.get(uuid, -1) != limit_mw or indices != self.indices:
            self._save(self.gpus | {uuid: limit_mw}, self.share, indices)

    def record_share(self, share: dict[str, Any]) -> None:
        if share != self.share:
            self._save(self.gpus, share, self.indices)

    def discard(self, uuid: str) -> None:
        if uuid in self.gpus:
            self._save({u: v for u, v in self.gpus.items() if u != uuid}, self.share,
                       {u: i for u, i in self.indices.items() if u != uuid})

    def lost_limit(self, index: int) -> int | None:
        """The last limit recorded, in this boot, for the GPU at `index`: what a GPU that no
        longer answers for its UUID holds, as far as this node knows; None when none is."""
        return next((self.gpus.get(u) for u, i in self.indices.items() if i == index), None)

    def forget_unreadable(self) -> None:
        """Every GPU was restored after an unreadable file: start a fresh, valid record."""
        self._save({}, None, {})
        self.unreadable = False


def _parse(data: Any, path: Path) -> dict[str, int | None]:
    """The GPUs a state file lists; TypeError/ValueError if it has no recognisable list."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    # Format 1 recorded {uuid: default mW}; the defaults are re-read from the devices now.
    entries = data.get("gpus") if data.get("format") == FORMAT else data.get("defaults")
    if data.get("format") not in (1, FORMAT) or not isinstance(entries, dict):
        raise ValueError(f"unknown format {data.get('format')!r}")
    gpus: dict[str, int | None] = {}
    for uuid, last in entries.items():
        if not uuid.startswith(("GPU-", "MIG-")):
            log.warning("%s: ignoring entry %r: not a GPU UUID", path, uuid)
            continue
        ok = data["format"] == FORMAT and isinstance(last, int) and not isinstance(last, bool)
        if last is not None and not ok and data["format"] == FORMAT:
            log.warning("%s: GPU %s: last limit %r is not a number of mW", path, uuid, last)
        gpus[uuid] = last if ok and last > 0 else None
    return gpus



def _indices(data: dict[str, Any], gpus: dict[str, int | None], path: Path) -> dict[str, int]:
    """The recorded GPUs' indices, when recorded in this boot (none from an earlier boot, whose
    indices may name other GPUs, nor from a host that gives no boot id)."""
    indices, boot = data.get("indices"), data.get("boot")
    if indices is None:
        return {}
    if boot is None or boot != boot_id():
        log.info("%s: GPU indices recorded in another boot; not used", path)
        return {}
    if not isinstance(indices, dict):
        log.warning("%s: ignoring the recorded indices %r: not an object", path, indices)
        return {}
    kept = {}
    for uuid, index in indices.items():
        if uuid in gpus and type(index) is int and index >= 0:
            kept[uuid] = index
        else:
            log.warning("%s: ignoring the index %r of %r", path, index, uuid)
    return kept
