"""What a trainer rank tells its node agent: one JSON line on stdout per step (`StepRecord`), per
event (`RankEvent`) and per evaluation on the held-out split (`EvalRecord`), among the rest of
its output.

Every rank of the job prints them (`ntp.train` writes them with `to_line`); each node's agent
reads its own ranks' lines with `parse_line` into the node's goodput ledger
(`ntp.nodeagent.progress.NodeProgress`). An event line is tagged by its `event` key, an
evaluation's by its `eval_loss`; a step line is the one with a `loss`. A line that is none of
them (a log line, any other JSON) is no record; a record that does not follow the contract is a
`RecordError` naming the field, never anything else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RecordError(ValueError):
    """A rank's line that claims to be a record and is not a valid one; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class EventKind(StrEnum):
    RESTORING = "restoring"  # live resharding cannot work: a checkpoint restore begins
    RESTORED = "restored"  # the checkpoint is loaded: training resumes from the event's step
    SWITCHING = "switching"  # the rank leaves its generation for a planned one after this step
    RECONFIGURED = "reconfigured"  # the rank runs the event's generation
    SAVING_CHECKPOINT = "saving_checkpoint"
    CHECKPOINTED = "checkpointed"


# The events about a checkpoint restore say which checkpoint (null: the seeded weights) and why.
RESTORE_EVENTS = frozenset({EventKind.RESTORING, EventKind.RESTORED})


@dataclass(frozen=True)
class StepRecord:
    """A step the job completed, as one rank saw it (every rank prints every step)."""

    step: int  # the job's steps done, this one included
    rank: int  # the rank's global rank in its generation
    generation: int
    loss: float  # the step's global loss (NaN, not an error, when training diverges)
    step_s: float  # the step's wall time on this rank
    samples: int  # the job's global batch
    tokens: int = 0
    # This rank's own work (forward, backward, optimizer), without the waits for other
    # replicas: what the operator's closed boost loop compares. None: not measured.
    compute_s: float | None = None
    tp_degrees: tuple[int, ...] = ()  # of every replica, in replica order
    # Wall clock when the step ended, Unix seconds: a log read later still times the job.
    time: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_degrees", tuple(self.tp_degrees))
        _check_step(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "rank": self.rank, "loss": self.loss,
                               "step_s": self.step_s}
        if self.compute_s is not None:
            out["compute_s"] = self.compute_s
        out |= {"samples": self.samples, "tokens": self.tokens,
                "tp_degrees": list(self.tp_degrees), "generation": self.generation}
        return out if self.time is None else out | {"time": self.time}

    def to_line(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> StepRecord:
        d = _check_step(record)
        compute, ended = d.get("compute_s"), d.get("time")
        return cls(step=d["step"], rank=d["rank"], generation=d["generation"],
                   loss=float(d["loss"]), step_s=float(d["step_s"]), samples=d["samples"],
                   tokens=d.get("tokens", 0), compute_s=None if compute is None else float(compute),
                   tp_degrees=tuple(d.get("tp_degrees", ())),
                   time=None if ended is None else float(ended))


@dataclass(frozen=True)
class RankEvent:
    """Something a rank went through between steps, at `step` (the job's steps done)."""

    kind: EventKind
    rank: int  # the rank's global rank in its generation
    generation: int
    step: int
    tp_degrees: tuple[int, ...]  # of the layout the event is about
    time: float  # wall clock, Unix seconds
    checkpoint: str | None = None  # restore events: the checkpoint (None: the seeded weights)
    why: str = ""  # restore events: why live resharding could not work

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _kind(self.kind))
        object.__setattr__(self, "tp_degrees", tuple(self.tp_degrees))
        _check_event(self.to_dict())
        if self.kind not in RESTORE_EVENTS and (self.checkpoint is not None or self.why):
            raise RecordError("event", f"a {self.kind} event has no checkpoint or why")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": str(self.kind), "generation": self.generation,
                               "step": self.step, "tp_degrees": list(self.tp_degrees),
                               "time": self.time}
        if self.kind in RESTORE_EVENTS:
            out |= {"checkpoint": self.checkpoint, "why": self.why}
        return out | {"rank": self.rank}

    def to_line(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RankEvent:
        d = _check_event(record)
        kind = _kind(d["event"])
        restore = kind in RESTORE_EVENTS
        return cls(kind=kind, rank=d["rank"], generation=d["generation"], step=d["step"],
                   tp_degrees=tuple(d["tp_degrees"]), time=float(d["time"]),
                   checkpoint=d.get("checkpoint") if restore else None,
                   why=d.get("why", "") if restore else "")


@dataclass(frozen=True)
class EvalRecord:
    """The loss on the held-out split after a step, as one rank saw it (every rank prints it)."""

    step: int  # the job's steps done when it was evaluated
    rank: int
    generation: int
    eval_loss: float  # mean next-token loss over the evaluated samples (NaN once it diverges)
    samples: int  # held-out samples evaluated
    time: float | None = None  # wall clock, Unix seconds

    def __post_init__(self) -> None:
        _check_eval(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "rank": self.rank,
                               "generation": self.generation, "eval_loss": self.eval_loss,
                               "samples": self.samples}
        return out if self.time is None else out | {"time": self.time}

    def to_line(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> EvalRecord:
        d = _check_eval(record)
        ended = d.get("time")
        return cls(step=d["step"], rank=d["rank"], generation=d["generation"],
                   eval_loss=float(d["eval_loss"]), samples=d["samples"],
                   time=None if ended is None else float(ended))


Record = StepRecord | RankEvent | EvalRecord


def parse_record(record: object) -> Record | None:
    """A record from a rank's JSON value; None for a value that is no record."""
    if not isinstance(record, Mapping):
        return None
    if "event" in record:
        return RankEvent.from_dict(record)
    if "eval_loss" in record:
        return EvalRecord.from_dict(record)
    if "loss" in record:
        return StepRecord.from_dict(record)
    return None


def parse_line(line: bytes | str) -> Record | None:
    """A record from one line of a rank's stdout; None for a line that is no record."""
    if not line.startswith(b"{" if isinstance(line, bytes) else "{"):
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # not JSON after all (UnicodeDecodeError included)
        return None
    return parse_record(value)


# -- validation ------------------------------------------------------------------------------


def _kind(value: object) -> EventKind:
    if value not in [k.value for k in EventKind]:  # by equality: any JSON value may come
        raise RecordError("event", f"one of {', '.join(EventKind)}, got {_shown(value)}")
    return EventKind(value)


def _check_step(d: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("step", "rank", "generation", "samples"):
        _count(d, key, required=True)
    _count(d, "tokens")
    _number(d, "loss", seconds=False)
    _number(d, "step_s")
    for key in ("compute_s", "time"):
        if d.get(key) is not None:
            _number(d, key)
    _degrees(d, required=False)
    return d


def _check_eval(d: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("step", "rank", "generation", "samples"):
        _count(d, key, required=True)
    _number(d, "eval_loss", seconds=False)
    if d.get("time") is not None:
        _number(d, "time")
    return d


def _check_event(d: Mapping[str, Any]) -> Mapping[str, Any]:
    _kind(d.get("event"))
    for key in ("rank", "generation", "step"):
        _count(d, key, required=True)
    _degrees(d, required=True)
    _number(d, "time")
    if d.get("checkpoint") is not None and not isinstance(d["checkpoint"], str):
        raise RecordError("checkpoint", f"a path or null, got {_shown(d['checkpoint'])}")
    if not isinstance(d.get("why", ""), str):
        raise RecordError("why", f"a string, got {_shown(d['why'])}")
    return d


def _count(d: Mapping[str, Any], key: str, required: bool = False) -> None:
    if key not in d and not required:
        return
    value = d.get(key)
    # bool is an int in Python, never a count
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RecordError(key, f"a non-negative integer, got {_shown(value)}")


def _number(d: Mapping[str, Any], key: str, seconds: bool = True) -> None:
    """A number (a double); with `seconds`, a finite non-negative one."""
    value = d.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RecordError(key, f"a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past a double's range
        raise RecordError(key, f"a number, got {_shown(value)}") from None
    if seconds and not (math.isfinite(number) and number >= 0):
        raise RecordError(key, f"a non-negative number of seconds, got {_shown(value)}")


def _degrees(d: Mapping[str, Any], required: bool) -> None:
    if "tp_degrees" not in d and not required:
        return
    value = d.get("tp_degrees")
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in value):
        raise RecordError("tp_degrees", f"a list of positive integers, got {_shown(value)}")


def _shown(value: object) -> str:
    """A value as it goes into a message: clipped, whatever it is."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's 4,300 digits; deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
