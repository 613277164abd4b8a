"""A node's GPU health as every reader sees it: per GPU healthy, failed or unknown, with its
recent XIDs. The node's health agent (tessera_agents.health) publishes it in the node's GPUHealth
object (`render`); the operator and the demo read that object back (`parse`), and each job
decides which XIDs end a GPU for it (`is_fatal`), except those after which the device is gone
(`DEVICE_GONE_XIDS`): those end it for every job, and the node publishes it Failed.

`parse` trusts nothing the API server hands it (a hand edit, another agent's version, a server
without the CRD's schema): an object no reader can use is a `MalformedHealth` naming the field,
and a GPU entry it cannot use is skipped and described in the value's `health.problems`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from tessera_contracts.api import API_VERSION, GPU_HEALTH_KIND
from tessera_contracts.cordon import shown
from tessera_contracts.powertarget import format_time
from tessera_contracts.unreadable import Unreadable

# The NVIDIA device plugin's rule: every XID is fatal except these application errors.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# XIDs after which the device itself is gone, whatever a job tolerates: nothing runs on it
# until it is reset (DCGM's own health module rates 79 FAIL, isolate). Fatal for every job,
# and a node publishes such a GPU Failed.
DEVICE_GONE_XIDS: Mapping[int, str] = {79: "the GPU fell off the bus"}
# A node's health agent writes its GPUHealth at least this often, changed or not; readers count
# an object older than three refreshes as unknown: one lost write is tolerated, a dead agent not.
REFRESH_S = 120.0
STALE_REFRESHES = 3
# The CRD's bounds: GPU indices 0-63, XIDs 32-bit as in the driver (larger values are sentinels
# or garbage), at most 64 XIDs per GPU, reasons and the exporter's error of 1,024 characters.
MAX_GPUS = 64
MAX_XID = 0x7FFFFFFF
MAX_XIDS = 64
MAX_REASON = 1024

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
    """Whether `xid` ends a GPU for the job: always for a DEVICE_GONE_XIDS one, else by its
    `fatalXIDs`, else by the device plugin's rule."""
    if xid in DEVICE_GONE_XIDS:
        return True
    if fatal_xids is None:
        return xid not in APPLICATION_XIDS
    return xid in fatal_xids


# ----------------------------------------------------------------------------------------------
# The GPUHealth object
# ----------------------------------------------------------------------------------------------

# How the object spells each state.
STATE_NAMES = {State.HEALTHY: "Healthy", State.FAILED: "Failed", State.UNKNOWN: "Unknown"}
_STATES = {name: state for state, name in STATE_NAMES.items()}
# The status' index lists, for people (`kubectl get gpuhealth`): failed GPUs, those with recent
# XIDs, unknown ones.
_SUMMARY = (
    ("failedGPUs", lambda g: g.state is State.FAILED),
    ("xidGPUs", lambda g: bool(g.xids)),
    ("unknownGPUs", lambda g: g.state is State.UNKNOWN),
)


class MalformedHealth(ValueError):
    """A GPUHealth object no reader can use; names the field, and the node when the object has
    a name."""

    def __init__(self, node: str | None, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.node = node
        self.field = field


@dataclass(frozen=True)
class PublishedHealth:
    """A node's GPUHealth object: its GPUs as its health agent saw them at `observed_at` (Unix
    seconds) on the exporter at `exporter_url`. `health.error` is why no usable page was read;
    `health.problems` are, read back, the entries `parse` skipped (the agent does not publish
    its own). A GPU's `xid` is not published: each job judges `xids` by its own list."""

    node: str
    exporter_url: str
    observed_at: float
    health: NodeHealth


def summary(gpus: Iterable[GpuHealth]) -> dict[str, str]:
    """The status' index lists (failedGPUs, xidGPUs, unknownGPUs), comma-separated."""
    gpus = tuple(gpus)
    return {name: ",".join(str(g.index) for g in gpus if keep(g)) for name, keep in _SUMMARY}


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def render(published: PublishedHealth) -> dict[str, Any]:
    """The node's GPUHealth object, for server-side apply by its health agent."""
    health = published.health
    exporter = {"url": published.exporter_url}
    if health.error is not None:
        exporter["error"] = _clip(health.error)
    gpus = [{"index": g.index, "state": STATE_NAMES[g.state], "xids": list(g.xids[:MAX_XIDS]),
             "reason": _clip(g.reason)} for g in health.gpus]
    return {
        "apiVersion": API_VERSION,
        "kind": GPU_HEALTH_KIND,
        "metadata": {"name": published.node},
        "status": {
            # to the millisecond: a reader compares it with a rank's death (operator health)
            "observedAt": format_time(datetime.fromtimestamp(published.observed_at, UTC),
                                      timespec="milliseconds"),
            "exporter": exporter,
            **summary(health.gpus),
            "gpus": gpus,
        },
    }


def parse(obj: object) -> PublishedHealth:
    """A GPUHealth object as the API returns it (plain dicts). MalformedHealth when it has no
    name, no status or no valid `status.observedAt`; anything else it cannot use is skipped
    and described in `health.problems`. The summary lists are not read: `status.gpus` says it
    all."""
    if not isinstance(obj, Mapping):
        raise MalformedHealth(None, "object", f"not an object: {_shown(obj)}")
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        raise MalformedHealth(None, "metadata.name", "missing")
    status = obj.get("status")
    if not isinstance(status, Mapping):
        raise MalformedHealth(name, "status", "missing")
    observed = _timestamp(status.get("observedAt"))
    if observed is None:
        raise MalformedHealth(name, "status.observedAt",
                              f"not an RFC 3339 time: {_shown(status.get('observedAt'))}")
    # No reader acts on the exporter's URL or error (an error has made every GPU unknown,
    # with it as the reason): one that is missing is not a problem, one that is garbage is.
    problems: list[str] = []
    exporter = status.get("exporter", {})
    if not isinstance(exporter, Mapping):
        problems.append("status.exporter: not an object")
        exporter = {}
    url, error = exporter.get("url", ""), exporter.get("error")
    if not isinstance(url, str):
        problems.append("status.exporter.url: not a string")
        url = ""
    if error is not None and not isinstance(error, str):
        problems.append("status.exporter.error: not a string")
        error = None
    health = NodeHealth(_gpus(status.get("gpus"), problems), tuple(problems),
                        None if error is None else _clip(error))
    return PublishedHealth(name, _clip(url), observed, health)


def read(obj: object) -> PublishedHealth | Unreadable:
    """`parse`, with an object no reader can use kept as why (its node, when it has a name)."""
    try:
        return parse(obj)
    except MalformedHealth as exc:
        return Unreadable(exc.node, str(exc))


def _shown(value: object) -> str:
    """A value as it goes into a problem, whatever it is."""
    try:
        text = str(value)
    except (ValueError, RecursionError):  # an int past Python's 4,300 digits; deep nesting
        text = f"<{type(value).__name__}>"
    return shown(text)


def _timestamp(value: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time such as 2026-12-01T08:00:00Z; None if it is
    not one."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.replace(tzinfo=parsed.tzinfo or UTC).timestamp()


def _gpus(listed: object, problems: list[str]) -> tuple[GpuHealth, ...]:
    if not isinstance(listed, list):
        problems.append("status.gpus: not a list")
        return ()
    gpus: dict[int, GpuHealth] = {}
    for entry in listed:
        index = entry.get("index") if isinstance(entry, Mapping) else None
        # bool is an int in Python, never a GPU index
        if not isinstance(entry, Mapping) or isinstance(index, bool) or \
                not isinstance(index, int):
            problems.append(f"an entry without a GPU index ({_shown(entry)})")
        elif not 0 <= index < MAX_GPUS:
            problems.append(f"an entry with GPU index {_shown(index)}, not 0-{MAX_GPUS - 1}")
        elif index in gpus:
            problems.append(f"GPU {index} listed twice")
        else:
            gpus[index] = _gpu(index, entry, problems)
    return tuple(gpus[i] for i in sorted(gpus))


def _gpu(index: int, entry: Mapping[str, Any], problems: list[str]) -> GpuHealth:
    """One entry; a state it cannot read is unknown, with that state as the reason."""
    reason = entry.get("reason", "")
    if not isinstance(reason, str):
        problems.append(f"GPU {index}: reason: not a string")
        reason = ""
    raw = entry.get("state")
    state = _STATES.get(raw) if isinstance(raw, str) else None
    if state is None:
        state, reason = State.UNKNOWN, reason or f"state {_shown(raw)}"
    listed = entry.get("xids", [])
    listed = listed if isinstance(listed, list) else [listed]
    xids = {x for x in listed
            if isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_XID}
    if len(xids) < len(listed):
        problems.append(f"GPU {index}: xids: {len(listed) - len(xids)} not XIDs (integers "
                        f"0-{MAX_XID}) or repeated")
    if len(xids) > MAX_XIDS:
        problems.append(f"GPU {index}: xids: {len(xids) - MAX_XIDS} past the first {MAX_XIDS}")
    return GpuHealth(index, state, _clip(reason), xids=tuple(sorted(xids))[:MAX_XIDS])
