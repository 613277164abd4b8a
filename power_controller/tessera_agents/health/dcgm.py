"""GPU health from a node's own dcgm-exporter page: healthy, failed (with XID and reason) or
unknown per GPU, with flap damping.

Pure: the node agent fetches the page and calls `assess`, then `FlapDamper.update`, and
publishes the result for its own node only (docs/health.md says why the node reads it). The page
is parsed here, not by prometheus_client, so that hostile pages are bounded and every refusal has
a reason; both field-name generations are read (4.8 `DCGM_FI_DEV_XID_ERRORS`, 4.9
`DCGM_FI_DEV_XID_ERROR`: the last XID, not a count).

Verdict for one GPU, from its samples on one page:

1. No health series at all (no last-XID gauge, no XID count or total, no health status): unknown.
2. A DCGM health watch at FAIL for a reason other than an XID: failed.
3. A recent XID after which the device is gone (79, off the bus: `DEVICE_GONE_XIDS`), whatever
   the job's list, or one that is fatal for the job: failed. Recent means the last-XID gauge,
   and the XIDs in the exporter's count window (or, without that family, its totals since
   start), unless the last-XID gauge reads 0: the GPU was reset since, so counts from before
   are history. A later XID can overwrite 79 in the gauge; the counts still show it.
4. A health watch at FAIL for an XID with no fatal XID recent: healthy (the job's `fatalXIDs`
   decide which XIDs end a GPU), noted; with no XID to judge it by: failed.
5. Otherwise healthy (a WARN is noted).

A page older than `max_age`, an unreachable endpoint, a page over `MAX_PAGE_BYTES`, a malformed
line in a family read here or a page with no usable sample at all makes every GPU unknown, never
healthy or failed (`NodeHealth.error` says why); a bad sample (an index out of range, an
implausible value, another host's sample) is skipped with the reason.

Every verdict also lists the GPU's recent XIDs, fatal or not (`GpuHealth.xids`): the node agent
classifies with no XID of a job's list fatal (a device that is gone is still failed) and
publishes them for each job to judge (`tessera_agents.health.agent`).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Set
from dataclasses import dataclass, field, replace

from tessera_contracts.gpuhealth import (
    DEVICE_GONE_XIDS,
    MAX_GPUS,
    MAX_XID,
    GpuHealth,
    NodeHealth,
    State,
    is_fatal,
)

LAST_XID_FAMILIES = ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR")  # 4.8, 4.9
XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
XID_TOTAL = "DCGM_EXP_XID_ERRORS_TOTAL"
HEALTH_STATUS = "DCGM_EXP_GPU_HEALTH_STATUS"
FAMILIES = frozenset({*LAST_XID_FAMILIES, XID_COUNT, XID_TOTAL, HEALTH_STATUS})
HEALTH_PASS, HEALTH_WARN, HEALTH_FAIL = 0, 10, 20
XID_HEALTH_CODE = "DCGM_FR_XID_ERROR"
# dcgm-exporter collects every 30 s by default: two collections may pass before a page is stale.
STALE_AFTER_S = 60.0
# The simulated 8-GPU page is 38 kB; a real one with every default field and pod labels a few
# times that: 4 MiB leaves room, and bounds what a hostile page costs to read.
MAX_PAGE_BYTES = 4 << 20
MAX_COUNT = 2**53  # counts beyond exact doubles are sentinels or garbage
MAX_REASON = 200  # characters of a label value quoted in a reason


def unknown(gpus: int, reason: str, problems: tuple[str, ...] = ()) -> NodeHealth:
    return NodeHealth(tuple(GpuHealth(i, State.UNKNOWN, reason) for i in range(gpus)), problems,
                      reason)


# --- the exposition text -------------------------------------------------------------------

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_VALUE = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|Inf|inf)|NaN")
_TIMESTAMP = re.compile(r"-?\d{1,19}")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_SPECIAL = re.compile(r'["\\]')


class Malformed(ValueError):
    """A line of a family this module reads does not parse."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None


def _quote(text: str) -> str:
    return repr(text if len(text) <= MAX_REASON else text[:MAX_REASON] + "...")


def parse_line(line: str) -> Sample:
    """One sample line: `name{label="value",...} value [timestamp]`; Malformed says why."""
    match = _NAME.match(line)
    if match is None:
        raise Malformed("no metric name")
    i, n = match.end(), len(line)
    labels: dict[str, str] = {}
    if i < n and line[i] == "{":
        i += 1
        while True:
            while i < n and line[i] in " \t":
                i += 1
            if i < n and line[i] == "}":
                i += 1
                break
            label = _LABEL.match(line, i)
            if label is None:
                raise Malformed(f"bad label name at column {i + 1}")
            i = label.end()
            while i < n and line[i] in " \t":
                i += 1
            if line[i:i + 2] != '="':
                raise Malformed(f"label {label.group()} has no quoted value")
            i += 2
            chars: list[str] = []
            while True:
                # the nearest quote or backslash: one pass over the value, however many escapes
                special = _SPECIAL.search(line, i)
                if special is None:
                    raise Malformed(f"label {label.group()}: unterminated value")
                k = special.start()
                chars.append(line[i:k])
                if line[k] == '"':
                    i = k + 1
                    break
                escaped = _ESCAPES.get(line[k + 1:k + 2])
                if escaped is None:
                    raise Malformed(f"label {label.group()}: bad escape at column {k + 1}")
                chars.append(escaped)
                i = k + 2
            if label.group() in labels:
                raise Malformed(f"label {label.group()} given twice")
            labels[label.group()] = "".join(chars)
            while i < n and line[i] in " \t":
                i += 1
            if i < n and line[i] == ",":
                i += 1
            elif not (i < n and line[i] == "}"):
                raise Malformed(f"expected ',' or '}}' at column {i + 1}")
    rest = line[i:].split()
    if len(rest) not in (1, 2) or (i < n and line[i] not in " \t"):
        raise Malformed("expected a value and an optional timestamp after the labels")
    if not _VALUE.fullmatch(rest[0]):
        raise Malformed(f"bad value {_quote(rest[0])}")
    if len(rest) == 2 and not _TIMESTAMP.fullmatch(rest[1]):
        raise Malformed(f"bad timestamp {_quote(rest[1])}")
    return Sample(match.group(), labels, float(rest[0]),
                  int(rest[1]) if len(rest) == 2 else None)


def _family(line: str) -> str:
    match = _NAME.match(line)
    return match.group() if match else ""


def read_page(text: str, families: frozenset[str] = FAMILIES) -> list[Sample]:
    """The samples of `families` on a page; Malformed (with the line number) for a line of one
    of them that does not parse. Lines of other families are not parsed at all."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#") or _family(line) not in families:
            continue
        try:
            samples.append(parse_line(line))
        except Malformed as exc:
            raise Malformed(f"line {number}: {exc}") from None
    return samples


# --- one page -> verdicts ------------------------------------------------------------------

@dataclass
class _Evidence:
    last_xid: int | None = None
    window: dict[int, float] | None = None  # xid -> count in the exporter's window
    totals: dict[int, float] | None = None
    health: list[tuple[str, str, int]] = field(default_factory=list)  # watch, code, value


def _whole(value: float, bound: int) -> int | None:
    """`value` as a whole number in [0, bound], None for anything else (NaN, sentinels)."""
    if not math.isfinite(value) or value < 0 or value > bound or value != int(value):
        return None
    return int(value)


def _xid_label(sample: Sample) -> int | None:
    text = sample.labels.get("xid")
    if text is None or not text.isdigit() or len(text) > 10:
        return None
    xid = int(text)
    return xid if 0 < xid <= MAX_XID else None


def _gather(samples: list[Sample], gpus: int, hostname: str | None,
            max_age_ms: float, now_ms: float | None) -> tuple[dict[int, _Evidence], list[str]]:
    evidence: dict[int, _Evidence] = {}
    problems: list[str] = []
    for s in samples:
        where = f"{s.name}{{gpu={_quote(s.labels.get('gpu', ''))}}}"
        index_text = s.labels.get("gpu", "")
        if not index_text.isdigit() or len(index_text) > 3 or int(index_text) >= gpus:
            problems.append(f"{where}: no GPU {_quote(index_text)} on this node of {gpus}; "
                            "sample skipped")
            continue
        host = s.labels.get("hostname", s.labels.get("Hostname"))
        if hostname is not None and host is not None and host != hostname:
            problems.append(f"{where}: sample of host {_quote(host)}, not {hostname!r}; skipped")
            continue
        if (s.timestamp_ms is not None and now_ms is not None
                and now_ms - s.timestamp_ms > max_age_ms):
            problems.append(f"{where}: sample {(now_ms - s.timestamp_ms) / 1000:.0f} s old; "
                            "skipped")
            continue
        ev = evidence.setdefault(int(index_text), _Evidence())
        if s.name in LAST_XID_FAMILIES:
            xid = _whole(s.value, MAX_XID)
            if xid is None:
                problems.append(f"{where}: last XID {s.value!r} is not an XID; skipped")
            elif ev.last_xid is not None and ev.last_xid != xid:
                problems.append(f"{where}: last XID given as both {ev.last_xid} and {xid}; "
                                "the larger kept")
                ev.last_xid = max(ev.last_xid, xid)
            else:
                ev.last_xid = xid
        elif s.name in (XID_COUNT, XID_TOTAL):
            count = _whole(s.value, MAX_COUNT)
            if count is None:
                problems.append(f"{where}: XID count {s.value!r} is not a count; skipped")
                continue
            xid = _xid_label(s) if "xid" in s.labels else None
            if "xid" in s.labels and xid is None:
                problems.append(f"{where}: xid label {_quote(s.labels['xid'])} is not an XID; "
                                "skipped")
                continue
            if s.name == XID_COUNT:
                counts = ev.window = ev.window if ev.window is not None else {}
            else:
                counts = ev.totals = ev.totals if ev.totals is not None else {}
            if xid is not None and count:
                counts[xid] = counts.get(xid, 0) + count
        else:
            status = _whole(s.value, HEALTH_FAIL)
            if status not in (HEALTH_PASS, HEALTH_WARN, HEALTH_FAIL):
                problems.append(f"{where}: health status {s.value!r} is not 0, 10 or 20; "
                                "skipped")
                continue
            ev.health.append((s.labels.get("health_watch", "?"),
                              s.labels.get("health_error_code", "?"), status))
    return evidence, problems


def _verdict(index: int, ev: _Evidence | None, fatal_xids: Set[int] | None) -> GpuHealth:
    if ev is None or (ev.last_xid is None and ev.window is None and ev.totals is None
                      and not ev.health):
        return GpuHealth(index, State.UNKNOWN, "no health series for this GPU on the page")
    recent: set[int] = set()
    if ev.last_xid != 0:
        counts = ev.window if ev.window is not None else ev.totals or {}
        recent = {xid for xid, n in counts.items() if n > 0}
        if ev.last_xid is not None:
            recent.add(ev.last_xid)
    xids = tuple(sorted(recent))
    failing = [(w, c) for w, c, v in ev.health if v == HEALTH_FAIL]
    for watch, code in failing:
        if code != XID_HEALTH_CODE:
            return GpuHealth(index, State.FAILED,
                             f"DCGM health watch {_quote(watch)} fails with {_quote(code)}",
                             ev.last_xid if ev.last_xid and is_fatal(ev.last_xid, fatal_xids)
                             else None, xids)
    fatal = {xid for xid in recent if is_fatal(xid, fatal_xids)}
    gone = fatal & DEVICE_GONE_XIDS.keys()
    if gone:
        xid = max(gone)
        return GpuHealth(index, State.FAILED, f"XID {xid}: {DEVICE_GONE_XIDS[xid]}", xid, xids)
    if fatal:
        xid = ev.last_xid if ev.last_xid in fatal else max(fatal)
        return GpuHealth(index, State.FAILED, f"XID {xid}, fatal for this job", xid, xids)
    if failing:
        if not recent:
            return GpuHealth(index, State.FAILED,
                             f"DCGM health watch {_quote(failing[0][0])} fails with an XID "
                             "error, and no XID is reported to judge it by")
        return GpuHealth(index, State.HEALTHY,
                         f"XID {', '.join(map(str, xids))} not fatal for this job "
                         "(DCGM health fails on it)", xids=xids)
    warning = [w for w, _, v in ev.health if v == HEALTH_WARN]
    if warning:
        return GpuHealth(index, State.HEALTHY, f"DCGM health warns on {', '.join(warning)}",
                         xids=xids)
    return GpuHealth(index, State.HEALTHY, xids=xids)


def classify(text: str, *, gpus: int, fatal_xids: Iterable[int] | None = None,
             hostname: str | None = None, now: float | None = None,
             max_age: float = STALE_AFTER_S) -> NodeHealth:
    """Every GPU's verdict from one page of a node with `gpus` GPUs. `fatal_xids` is the job's
    list (None: the device plugin's rule); samples of another `hostname`, or with a timestamp
    older than `max_age` before `now` (Unix seconds; None: not checked), are skipped."""
    if not 0 < gpus <= MAX_GPUS:
        raise ValueError(f"a node has 1 to {MAX_GPUS} GPUs, got {gpus}")
    if len(text) > MAX_PAGE_BYTES:
        return unknown(gpus, f"page of {len(text)} characters exceeds {MAX_PAGE_BYTES}")
    try:
        samples = read_page(text)
    except Malformed as exc:
        return unknown(gpus, f"malformed exporter page: {exc}")
    evidence, problems = _gather(samples, gpus, hostname, max_age * 1000,
                                 None if now is None else now * 1000)
    if not evidence:  # not an exporter page, or none of it about this node's GPUs
        return unknown(gpus, "no usable GPU health series on the page", tuple(problems))
    fatal = None if fatal_xids is None else frozenset(fatal_xids)
    return NodeHealth(tuple(_verdict(i, evidence.get(i), fatal) for i in range(gpus)),
                      tuple(problems))


def assess(page: str | None, *, fetched_at: float | None, now: float, gpus: int,
           fatal_xids: Iterable[int] | None = None, hostname: str | None = None,
           error: str | None = None, max_age: float = STALE_AFTER_S) -> NodeHealth:
    """The node's GPUs from its latest fetched page: unknown while the endpoint is unreachable
    (`error`) or the page fetched at `fetched_at` is older than `max_age` at `now`."""
    if page is None or fetched_at is None:
        return unknown(gpus, f"exporter unreachable: {error or 'no page fetched yet'}")
    age = now - fetched_at
    if age > max_age:
        why = f" (latest error: {error})" if error else ""
        return unknown(gpus, f"exporter page is {age:.0f} s old, over {max_age:.0f} s{why}")
    return classify(page, gpus=gpus, fatal_xids=fatal_xids, hostname=hostname, now=now,
                    max_age=max_age)


# --- flap damping --------------------------------------------------------------------------

HOLD_DOWN_S = 60.0
MAX_HOLD_DOWN_S = 960.0
FLAP_MEMORY_S = 600.0


@dataclass
class _Held:
    failed: GpuHealth | None = None  # the failure that holds the GPU out, while it does
    healthy_since: float | None = None
    onsets: deque[float] = field(default_factory=deque)


class FlapDamper:
    """A failed GPU is reported failed at once, and healthy again only after it has been seen
    healthy without a break for its hold-down: `hold_down` seconds, doubled for each further
    failure within `memory` seconds, at most `max_hold_down` (docs/health.md derives them).
    Unknown is not health: it restarts the count, and a held GPU stays failed through it.

    With `hold_xids`, a recent XID counts as a failure whatever the verdict: the node agent
    publishes XIDs for each job to judge by its own fatal list, so it damps them as failures. A
    held GPU is reported as the observation that holds it (its state and XIDs), with the reason
    saying it is held."""

    def __init__(self, hold_down: float = HOLD_DOWN_S, max_hold_down: float = MAX_HOLD_DOWN_S,
                 memory: float = FLAP_MEMORY_S, *, hold_xids: bool = False) -> None:
        if not 0 < hold_down <= max_hold_down:
            raise ValueError(f"need 0 < hold_down <= max_hold_down, got {hold_down}, "
                             f"{max_hold_down}")
        self.hold_down, self.max_hold_down, self.memory = hold_down, max_hold_down, memory
        self.hold_xids = hold_xids
        self._gpus: dict[int, _Held] = {}

    def hold(self, failures: int) -> float:
        """The hold-down after `failures` (>= 1) failures within the memory window."""
        return min(self.hold_down * 2.0 ** (max(failures, 1) - 1), self.max_hold_down)

    def update(self, now: float, observed: NodeHealth) -> NodeHealth:
        return replace(observed, gpus=tuple(self._one(now, g) for g in observed.gpus))

    def _one(self, now: float, seen: GpuHealth) -> GpuHealth:
        held = self._gpus.setdefault(seen.index, _Held())
        while held.onsets and now - held.onsets[0] > self.memory:
            held.onsets.popleft()
        if seen.state is State.FAILED or (self.hold_xids and seen.xids):
            if held.failed is None or held.healthy_since is not None or not held.onsets:
                held.onsets.append(now)
            held.failed, held.healthy_since = seen, None
            return seen
        if held.failed is None:
            return seen
        if seen.state is State.UNKNOWN:
            held.healthy_since = None
            return replace(held.failed,
                           reason=f"held down after {held.failed.reason}; now {seen.reason}")
        if held.healthy_since is None:
            held.healthy_since = now
        need = self.hold(len(held.onsets))
        if now - held.healthy_since >= need:
            held.failed, held.healthy_since = None, None
            return seen
        return replace(held.failed,
                       reason=f"held down after {held.failed.reason}: healthy for "
                              f"{now - held.healthy_since:.0f} s of {need:.0f} s "
                              f"({len(held.onsets)} failures in {self.memory:.0f} s)")
