"""A node's GPU health as every reader sees it: per GPU healthy, failed or unknown, with its
recent XIDs. The node's health agent (tessera_agents.health) publishes it in the node's GPUHealth
object; the operator reads it and each job decides which XIDs end a GPU for it (`is_fatal`)."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from enum import StrEnum

# The NVIDIA device plugin's rule: every XID is fatal except these application errors.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# A node's health agent writes its GPUHealth at least this often, changed or not; readers count
# an object older than three refreshes as unknown: one lost write is tolerated, a dead agent not.
REFRESH_S = 120.0
STALE_REFRESHES = 3

class State(StrEnum):
    HEALTHY = "healthy"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's verdict; `xid` is the fatal XID behind a failure, when one is known; `xids`
    every recent XID (sorted), fatal for the job or not: the facts a node publishes."""

    index: int
    state: State
    reason: str = ""
    xid: int | None = None
    xids: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeHealth:
    """Every GPU of the node, by index, and what was skipped on the way (one line each);
    `error` says why no usable page was read, when none was (every GPU is then unknown)."""

    gpus: tuple[GpuHealth, ...]
    problems: tuple[str, ...] = ()
    error: str | None = None

    def indices(self, state: State) -> frozenset[int]:
        return frozenset(g.index for g in self.gpus if g.state is state)


def is_fatal(xid: int, fatal_xids: Set[int] | None = None) -> bool:
    """Whether `xid` ends a GPU for the job: by its `fatalXIDs`, else the device plugin's rule."""
    if fatal_xids is None:
        return xid not in APPLICATION_XIDS
    return xid in fatal_xids
