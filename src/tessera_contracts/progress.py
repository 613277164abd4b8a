"""The trainer pods' progress reports and what the operator makes of them.

Each node's agent writes one `NodeReport` as JSON into the job's ConfigMap `<job>-progress`,
key `<node>.json` (`report_key`); the operator reads them all (`parse_reports`) and sets the
job's status from `summarize`. Pure: no I/O, no Kubernetes; a report that does not parse is a
`ReportError` (a ValueError), never anything else.

A report describes its node since its agent started: the generation its ranks run, the job's
last step they completed, the node's goodput ledger (docs/goodput.md), what its ranks train on
(`Device`; absent in reports of agents that do not say), the job's nodes whose agents it found
silent (`silentNodes`: their heartbeat on the job's store stopped, `ntp.nodeagent.heartbeat`;
absent when none, and in reports of agents that do not watch), the GPUs of its node whose rank
died (`rankDeaths`: GPU index -> `RankDeath`; a GPU leaves it once a rank starts on it again;
absent when none) and a state:

| state | the node's agent |
| --- | --- |
| `Starting` | has not seen its ranks complete a step yet |
| `Training` | sees its ranks complete steps (checkpoints and the time between steps included) |
| `Reconfiguring` | a generation failed or is being switched to, or it has no rank to run |
| `Finished` | the job has finished and its ranks have exited |
| `Failed` | cannot go on; `message` says why |
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tessera_contracts import vocabulary
from tessera_contracts.unreadable import Unreadable
from tessera_contracts.vocabulary import BADPUT_CATEGORIES, LOST_PROGRESS

RESTART = vocabulary.Phase.RESTART.value  # the badput of a job's pods replaced
# Every node writes its report into one ConfigMap, and every write sends the whole object
# (all nodes' reports, ~400 B each) to etcd and to each watcher: at 2,000 nodes that object is
# ~800 kB, so a write per node per 1 s step would be 1.6 GB/s, and even one per node every
# 10 s 160 MB/s. So a node writes when its state or generation changes and otherwise every
# REPORT_EVERY_S, stretched so that the job's nodes together write at most JOB_WRITES_PER_S
# times a second (16 MB/s there): `report_period`.
REPORT_EVERY_S = 10.0
JOB_WRITES_PER_S = 20.0
# A report's seconds are rounded to the millisecond (`ntp.nodeagent.progress`), each figure
# by up to half of one: what productive plus badput may exceed wall by, per figure.
FIGURE_ROUNDING_S = 0.001


def report_period(nodes: int) -> float:
    """The longest a node's report goes unwritten while its state and generation hold, in a job
    of `nodes` nodes: how far a report's step may lag its ranks."""
    return max(REPORT_EVERY_S, nodes / JOB_WRITES_PER_S)


class State(StrEnum):
    STARTING = "Starting"
    TRAINING = "Training"
    RECONFIGURING = "Reconfiguring"
    FINISHED = "Finished"
    FAILED = "Failed"


class Phase(StrEnum):
    """The job's phase as the operator shows it."""

    PENDING = "Pending"
    RUNNING = "Running"
    RECONFIGURING = "Reconfiguring"
    RESTARTING = "Restarting"  # a failed attempt's pods stopping, the next one's not made yet
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ReportError(ValueError):
    """A progress report that is not a valid `NodeReport`; the message names the field."""


DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Device:
    """What a node's ranks train on, as its agent finds it before starting them: `kind` cpu
    or cuda, and the CUDA devices the agent sees on the node (None: not said)."""

    kind: str
    cuda_devices: int | None = None


def progress_configmap(job: str) -> str:
    """The ConfigMap that holds the progress reports of `job`'s nodes."""
    return f"{job}-progress"


def report_key(node: str) -> str:
    """The key of `node`'s report in the progress ConfigMap."""
    return f"{node}.json"


# A dead rank's last error line, as a report carries it: enough for the exception's type and
# message, while the reports of thousands of nodes still share one ConfigMap.
ERROR_MAX = 300


@dataclass(frozen=True)
class RankDeath:
    """How the rank on one GPU of the node died: when (`at`, Unix seconds, the node's clock),
    the job's last step it completed (None: none since it started), its last error line
    (its stderr's, else how it exited), and whether it died `again`: the GPU's previous rank
    died too, and this one came back and got no step past the step that one died at, so the
    fault is the job's (a data path, a tokenizer, an exception at a step), not the GPU's. In
    JSON, a death with only its time is that number (as agents that say no more write it)."""

    at: float
    step: int | None = None
    error: str = ""
    again: bool = False

    def to_json(self) -> float | dict[str, Any]:
        if self.step is None and not self.error and not self.again:
            return self.at
        return {"at": self.at, **({"step": self.step} if self.step is not None else {}),
                **({"error": self.error} if self.error else {}),
                **({"again": True} if self.again else {})}

    @classmethod
    def from_json(cls, value: Any) -> RankDeath:
        """From what `_check` validated."""
        if isinstance(value, Mapping):
            return cls(float(value["at"]), value.get("step"), value.get("error", ""),
                       bool(value.get("again", False)))
        return cls(float(value))


@dataclass(frozen=True)
class NodeReport:
    """One node's progress (module docstring). Seconds are floats; `badput_seconds` has a
    value for some of `goodput.BADPUT_CATEGORIES` (a missing category is 0)."""

    node: str
    generation: int  # that its ranks run; 0 before its agent has entered one
    step: int  # the job's last step its ranks completed
    steps: int  # the job's steps in all
    state: State
    message: str = ""
    step_seconds: float | None = None  # mean of the recent steps; None before any
    # The node's ranks' mean compute time per step (forward, backward, optimizer; not the
    # waits in the gradient sync) over the recent steps of the generation they run; None
    # before any. The operator's closed boost loop compares replicas by it.
    compute_seconds: float | None = None
    samples: int = 0  # of the job's global batches that its ranks completed
    tokens: int = 0
    goodput: float = 0.0
    productive_seconds: float = 0.0
    wall_seconds: float = 0.0
    badput_seconds: Mapping[str, float] = field(default_factory=dict)
    # When the report was made (Unix seconds, the node's clock); None: not said. How far its
    # step may lag the ranks when it is read (`progress_age`).
    reported_at: float | None = None
    device: Device | None = None  # what its ranks train on; None: not said
    # Nodes of the job whose agents its agent found silent, and still does: lost to the job.
    silent_nodes: tuple[str, ...] = ()
    # GPU index -> how the rank on it died, for the GPUs of this node with no rank started
    # since: the operator takes each out of the layout at once. A number given is a death at
    # that time (Unix seconds) and no more.
    rank_deaths: Mapping[int, RankDeath] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_deaths", {
            i: d if isinstance(d, RankDeath) else RankDeath(d)
            for i, d in sorted(self.rank_deaths.items())})
        _check(self.to_dict())  # one validation, whoever builds the report
        object.__setattr__(self, "state", State(self.state))
        object.__setattr__(self, "silent_nodes", tuple(sorted(set(self.silent_nodes))))
        # a category with no time is the same report with or without it
        object.__setattr__(self, "badput_seconds",
                           {c: float(s) for c, s in self.badput_seconds.items() if s})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; an empty message is left out (at thousands of nodes the ConfigMap's
        1 MiB holds all reports only if each is small), as are zero badput categories."""
        out: dict[str, Any] = {
            "node": self.node,
            "generation": self.generation,
            "step": self.step,
            "steps": self.steps,
            "state": str(self.state),
        }
        if self.message:
            out["message"] = self.message
        if self.step_seconds is not None:
            out["stepSeconds"] = self.step_seconds
        if self.compute_seconds is not None:
            out["computeSeconds"] = self.compute_seconds
        out |= {
            "samples": self.samples,
            "tokens": self.tokens,
            "goodput": self.goodput,
            "productiveSeconds": self.productive_seconds,
            "wallSeconds": self.wall_seconds,
            "badputSeconds": dict(self.badput_seconds),
        }
        if self.reported_at is not None:
            out["reportedAt"] = self.reported_at
        if self.device is not None:
            out["device"] = self.device.kind
            if self.device.cuda_devices is not None:
                out["cudaDevices"] = self.device.cuda_devices
        if self.silent_nodes:
            out["silentNodes"] = list(self.silent_nodes)
        if self.rank_deaths:
            out["rankDeaths"] = {str(i): d.to_json() for i, d in self.rank_deaths.items()}
        return out

    @classmethod
    def from_dict(cls, document: object) -> NodeReport:
        """A report from its JSON form; ReportError when anything is missing or wrong."""
        d = _check(document)
        return cls(
            node=d["node"],
            generation=d["generation"],
            step=d["step"],
            steps=d["steps"],
            state=State(d["state"]),
            message=d.get("message", ""),
            step_seconds=d.get("stepSeconds"),
            compute_seconds=d.get("computeSeconds"),
            samples=d.get("samples", 0),
            tokens=d.get("tokens", 0),
            goodput=d.get("goodput", 0.0),
            productive_seconds=d.get("productiveSeconds", 0.0),
            wall_seconds=d.get("wallSeconds", 0.0),
            badput_seconds=dict(d.get("badputSeconds", {})),
            reported_at=d.get("reportedAt"),
            device=None if d.get("device") is None
            else Device(d["device"], d.get("cudaDevices")),
            silent_nodes=tuple(d.get("silentNodes", ())),
            rank_deaths={int(i): RankDeath.from_json(death)
                         for i, death in d.get("rankDeaths", {}).items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodeReport:
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ReportError(f"not JSON: {exc}") from None
        return cls.from_dict(document)


_REQUIRED = ("node", "generation", "step", "steps", "state")


def _check(document: object) -> Mapping[str, Any]:
    """`document` if it is a valid report's JSON form, else ReportError."""
    if not isinstance(document, Mapping):
        raise ReportError(f"a report is a JSON object, got {type(document).__name__}")
    missing = [k for k in _REQUIRED if k not in document]
    if missing:
        raise ReportError(f"missing {', '.join(missing)}")
    d = document
    if not isinstance(d["node"], str) or not d["node"]:
        raise ReportError(f"node: a non-empty string, got {d['node']!r}")
    for key in ("generation", "step", "samples", "tokens"):
        _count(d, key)
    if d.get("device") is not None and d["device"] not in DEVICE_KINDS:
        raise ReportError(f"device: one of {', '.join(DEVICE_KINDS)}, got {d['device']!r}")
    if d.get("cudaDevices") is not None:
        _count(d, "cudaDevices")
    if _count(d, "steps") < 1:
        raise ReportError(f"steps: at least 1, got {d['steps']}")
    if d["step"] > d["steps"]:
        raise ReportError(f"step: {d['step']} is past the job's {d['steps']} steps")
    if d["state"] not in [s.value for s in State]:  # by equality: any JSON value may come
        raise ReportError(f"state: one of {', '.join(State)}, got {d['state']!r}")
    if not isinstance(d.get("message", ""), str):
        raise ReportError(f"message: a string, got {d['message']!r}")
    deaths = d.get("rankDeaths", {})
    if not isinstance(deaths, Mapping) or not all(
            isinstance(i, str) and i.isascii() and i.isdigit() for i in deaths):
        raise ReportError(f"rankDeaths: an object of GPU indices, got {deaths!r}")
    for index, death in deaths.items():
        name = f"rankDeaths.{index}"
        if not isinstance(death, Mapping):
            _seconds(deaths, index, name)
            continue
        if "at" not in death:
            raise ReportError(f"{name}: an object with at, got {death!r}")
        _seconds(death, "at", f"{name}.at")
        if death.get("step") is not None:
            _count(death, "step", f"{name}.step")
        error = death.get("error", "")
        if not isinstance(error, str) or len(error) > ERROR_MAX:
            raise ReportError(f"{name}.error: a string of at most {ERROR_MAX} characters")
        if not isinstance(death.get("again", False), bool):
            raise ReportError(f"{name}.again: true or false, got {death['again']!r}")
    silent = d.get("silentNodes", [])
    if not isinstance(silent, list) or not all(isinstance(n, str) and n for n in silent):
        raise ReportError(f"silentNodes: a list of node names, got {silent!r}")
    for key in ("stepSeconds", "computeSeconds", "reportedAt"):
        if d.get(key) is not None:
            _seconds(d, key)
    if not 0.0 <= _seconds(d, "goodput") <= 1.0:
        raise ReportError(f"goodput: between 0 and 1, got {d['goodput']}")
    productive = _seconds(d, "productiveSeconds")
    wall = _seconds(d, "wallSeconds")
    badput = d.get("badputSeconds", {})
    if not isinstance(badput, Mapping):
        raise ReportError(f"badputSeconds: an object, got {badput!r}")
    for category in badput:
        if category not in BADPUT_CATEGORIES:
            raise ReportError(f"badputSeconds: {category!r} is not one of "
                              f"{', '.join(BADPUT_CATEGORIES)}")
    spent = productive + sum(_seconds(badput, c, f"badputSeconds.{c}") for c in badput)
    # A node's time is its wall time: productive plus badput is wall to a rounding of each
    # figure. More would make the job's goodput exceed 1 (and the status refused) for as long
    # as the report stays, and an ended attempt's account carry it for good.
    if spent > wall + FIGURE_ROUNDING_S * (1 + len(badput)):
        raise ReportError(f"productiveSeconds + badputSeconds: {spent:g} s, more than the "
                          f"node's wallSeconds {wall:g}")
    return d


def _count(d: Mapping[str, Any], key: str, name: str | None = None) -> int:
    value = d.get(key, 0)
    # bool is an int in Python, never a count in a report
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ReportError(f"{name or key}: a non-negative integer, got {value!r}")
    return value


def _seconds(d: Mapping[str, Any], key: str, name: str | None = None) -> float:
    value = d.get(key, 0.0)
    try:
        # an int past a double's range is an OverflowError here, and no number of seconds
        number = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:
        number = math.inf
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise ReportError(f"{name or key}: a non-negative number, got {value!r}")
    return number


def parse_reports(data: Mapping[str, str] | None) -> dict[str, NodeReport | Unreadable]:
    """Every node's report in the progress ConfigMap's data (key `report_key(node)`), or why it
    is not a valid one (an agent of another version, a hand edit)."""
    reports: dict[str, NodeReport | Unreadable] = {}
    for key, text in (data or {}).items():
        if not key.endswith(".json"):
            continue
        node = key.removesuffix(".json")
        try:
            reports[node] = NodeReport.from_json(text)
        except ReportError as exc:
            reports[node] = Unreadable(node, str(exc))
    return reports


def usable(reports: Mapping[str, NodeReport | Unreadable], nodes: Iterable[str]
           ) -> dict[str, NodeReport | None]:
    """Each of `nodes`' report among `reports` (`parse_reports`); None where a node has none or
    an unreadable one."""
    return {node: found if isinstance(found := reports.get(node), NodeReport) else None
            for node in nodes}


def read_reports(data: Mapping[str, str] | None, nodes: Sequence[str]
                 ) -> dict[str, NodeReport | None]:
    """Each node's report from the progress ConfigMap's data; None where a node has none or
    its report is not valid."""
    return usable(parse_reports(data), nodes)


@dataclass(frozen=True)
class Account:
    """A goodput ledger summed over nodes (docs/goodput.md): what the job's earlier attempts
    spent, carried in its status across the restarts and suspensions that replace its pods."""

    wall_seconds: float = 0.0
    productive_seconds: float = 0.0
    badput_seconds: Mapping[str, float] = field(default_factory=dict)

    def plus(self, other: Account) -> Account:
        badput = dict(self.badput_seconds)
        for category, seconds in other.badput_seconds.items():
            badput[category] = badput.get(category, 0.0) + seconds
        return Account(self.wall_seconds + other.wall_seconds,
                       self.productive_seconds + other.productive_seconds, badput)

    @classmethod
    def of_attempt(cls, reports: Mapping[str, NodeReport | None], resumes_at: int) -> Account:
        """What an attempt that stops now spent, from its nodes' reports; the next attempt
        resumes at step `resumes_at` (its last checkpoint), so each node's productive time on
        the steps after it moves to lost progress (at the node's recent step time)."""
        total = cls()
        for r in reports.values():
            if r is None:
                continue
            redone = max(0, r.step - resumes_at)
            lost = min(r.productive_seconds,
                       r.productive_seconds if r.step_seconds is None
                       else redone * r.step_seconds)
            badput = dict(r.badput_seconds)
            if lost:
                badput[LOST_PROGRESS] = badput.get(LOST_PROGRESS, 0.0) + lost
            total = total.plus(cls(r.wall_seconds, r.productive_seconds - lost, badput))
        return total

    @classmethod
    def restart_gap(cls, seconds: float, nodes: int) -> Account:
        """`seconds` with no pod of the job running, on each of its `nodes`: restart badput."""
        gap = max(0.0, seconds) * nodes
        return cls(gap, 0.0, {RESTART: gap} if gap else {})

    def to_status(self) -> dict[str, Any]:
        return {"wallSeconds": round(self.wall_seconds, 3),
                "productiveSeconds": round(self.productive_seconds, 3),
                "badputSeconds": {c: round(s, 3) for c, s in sorted(self.badput_seconds.items())
                                  if s}}

    @classmethod
    def from_status(cls, value: object) -> Account:
        """The account `to_status` wrote, its productive time at most its wall time; what does
        not read as one (a hand edit) is none."""
        if not isinstance(value, Mapping):
            return cls()
        try:
            badput = {c: _seconds(value.get("badputSeconds") or {}, c)
                      for c in (value.get("badputSeconds") or {}) if c in BADPUT_CATEGORIES}
            wall = _seconds(value, "wallSeconds")
            # productive time past the wall time would hold the job's goodput above 1, which
            # the schema refuses, for good
            return cls(wall, min(_seconds(value, "productiveSeconds"), wall), badput)
        except (ReportError, AttributeError):
            return cls()


@dataclass(frozen=True)
class JobProgress:
    """What the operator puts in the job's status."""

    phase: Phase
    step: int  # the job's last completed step
    steps: int | None  # the job's steps in all, as the reports say; None without reports
    goodput: float | None  # None before any wall time is reported
    message: str
    # What the ranks of the published generation's nodes train on, for the nodes that say.
    devices: Mapping[str, Device] = field(default_factory=dict)


# How many node names a message lists before it says "and N more".
_NAMED = 3


def name_nodes(nodes: Sequence[str], why: Mapping[str, str]) -> str:
    """A few of `nodes`, each with why it is named, and how many more there are."""
    named = [f"{n} ({why[n]})" for n in nodes[:_NAMED]]
    more = len(nodes) - _NAMED
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")


def summarize(reports: Mapping[str, NodeReport | None], published_generation: int,
              nodes: Sequence[str], earlier: Account = Account()) -> JobProgress:
    """The job's progress from its nodes' reports.

    `nodes`: the nodes of the published generation; phase and step are theirs. The phase is
    the first that holds of: Failed (one of them reports Failed), Succeeded (every one reports
    Finished), Pending (none has a report past Starting: the job has not trained yet),
    Reconfiguring (one has no report, is starting, reports Reconfiguring, or runs a generation
    before `published_generation`), Running. The step is the lowest among those that have
    trained (a node still starting has done no step yet). Goodput is the job's: productive over
    wall seconds summed over every report given, those of nodes that left the job included
    (their time was the job's too), and the job's `earlier` attempts; weighting by wall time
    makes it the mean of the nodes' goodput over the node-seconds they were part of the job.
    """
    mine = {n: reports.get(n) for n in nodes}
    present = [r for r in mine.values() if r is not None]
    devices = {n: r.device for n, r in mine.items() if r is not None and r.device is not None}
    everyone = [r for r in reports.values() if r is not None]
    wall = earlier.wall_seconds + sum(r.wall_seconds for r in everyone)
    productive = earlier.productive_seconds + sum(r.productive_seconds for r in everyone)
    goodput = productive / wall if wall > 0 else None
    steps = max((r.steps for r in everyone), default=None)
    trained = [r for r in present if r.state is not State.STARTING] or present
    step = min((r.step for r in trained), default=0)
    of_steps = f"step {step}" + (f"/{steps}" if steps is not None else "")

    failed = [r for r in present if r.state is State.FAILED]
    if failed:
        first = failed[0]
        more = f" ({len(failed) - 1} more node(s) failed)" if len(failed) > 1 else ""
        return JobProgress(Phase.FAILED, step, steps, goodput,
                           f"{first.node} failed: {first.message or 'no reason given'}{more}",
                           devices)
    if nodes and len(present) == len(nodes) and all(r.state is State.FINISHED for r in present):
        return JobProgress(Phase.SUCCEEDED, step, steps, goodput,
                           f"all {len(nodes)} nodes finished at {of_steps}", devices)
    if all(r.state is State.STARTING for r in present):
        return JobProgress(Phase.PENDING, step, steps, goodput,
                           f"{len(present)}/{len(nodes)} nodes started, none has trained yet",
                           devices)
    why: dict[str, str] = {}
    for node, r in mine.items():
        if r is None:
            why[node] = "no report"
        elif r.generation < published_generation:
            why[node] = f"generation {r.generation}"
        elif r.state in (State.STARTING, State.RECONFIGURING):
            why[node] = r.state.lower()
    if why:
        waiting = [n for n in nodes if n in why]
        return JobProgress(Phase.RECONFIGURING, step, steps, goodput,
                           f"{of_steps}, generation {published_generation}: waiting for "
                           f"{name_nodes(waiting, why)}", devices)
    return JobProgress(Phase.RUNNING, step, steps, goodput,
                       f"{of_steps}, generation {published_generation}, {len(nodes)} nodes",
                       devices)
