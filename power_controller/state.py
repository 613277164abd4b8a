"""The agent's record, on the host, of the GPUs whose limits it changed and what to restore.

Written before each change reaches a GPU (write-ahead), so that whatever kills the agent, the
next agent on the node finds every GPU it must put back to its default limit. Keyed by UUID:
GPU indices may be renumbered across reboots, UUIDs are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from power_controller.files import read_json, write_json_atomic

FORMAT = 1


@dataclass
class ManagedGpus:
    """uuid -> default limit in milliwatts, persisted at `path` on every change."""

    path: Path
    defaults: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ManagedGpus:
        data = read_json(path)
        if data is None:
            return cls(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown state format; move it aside to start afresh")
        return cls(path, {str(k): int(v) for k, v in data["defaults"].items()})

    def _save(self) -> None:
        write_json_atomic(self.path, {"format": FORMAT, "defaults": self.defaults})

    def add(self, uuid: str, default_mw: int) -> None:
        if self.defaults.get(uuid) != default_mw:
            self.defaults[uuid] = default_mw
            self._save()

    def discard(self, uuid: str) -> None:
        if self.defaults.pop(uuid, None) is not None:
            self._save()
