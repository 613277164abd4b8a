"""Measured pauses: a recovery bench's `tessera.recovery/v1` file, decoded, validated, and scaled
from the bench's small job to the simulated one (README "Measured pauses" states the model and
why).

Pure: the command reads the file and hands its text here; nothing here does I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from tessera_sim.config import MAX_DAYS, SimConfig
from tessera_sim.policies import POLICY_NAMES, Policy

FORMAT = "tessera.recovery/v2"
FAILURE_KINDS: tuple[str, ...] = ("gpu-lost", "gpu-cordoned", "node-lost")
# A GPU back to the job: off the bus and returned, or its cordon lifted.
REPAIR_KINDS: tuple[str, ...] = ("gpu-returned", "gpu-uncordoned")
# The one policy that restarts the job; every other one relays its groups out live.
RESTART_POLICY = "ckpt-restart"
# What a switch from one layout to the next did, by the bytes a GPU receives for it, fewest
# first: a replica left the job (nothing moves); a replica went on on its own TP group at another
# degree or membership (a reshard: the hit group's survivors take the lost GPU's units, a
# returning GPU its own); a replica formed on GPUs that held nothing of it (a spare, a group
# back); the job restarted from its checkpoint.
CHANGES: tuple[str, ...] = ("drop", "reshard", "join", "restart")
# Where a GPU receives the bytes of each change from, as the ScalingModel bandwidth it moves
# at. A restart reads its shard from checkpoint storage. A joining GPU copies a whole shard from
# a data-parallel peer, on another node. A reshard's units come from DP peers too:
# `tessera_core.plan.reshard_moves` takes a unit from a survivor holding it, and no survivor of
# the hit group holds the lost GPU's units (TP shards are disjoint), nor, at scale, most of a
# returning GPU's (a process that held nothing takes each unit from the least-loaded holder, of
# any replica); the survivors' rebalancing among themselves runs alongside over the scale-up
# domain, at several times the bandwidth, and is not charged.
LINKS: dict[str, str] = {"reshard": "scale_out_gbps", "join": "scale_out_gbps",
                         "restart": "storage_gbps"}
# Bytes per GB of the bandwidths: decimal, as link and storage speeds are quoted.
GB = 1e9
# A scaled pause must fit the simulator's clock, as --reconfigure-seconds must.
MAX_PAUSE_S = 86_400 * MAX_DAYS

_JOB_INTS = ("gpus", "nodes", "gpus_per_node", "tp", "pp", "dp", "parameters")
_FAULT_KEYS = {"kind", "detection_s", "pause_s", "steps_redone", "checkpoint_load_s", "layouts",
               "switches", "reduced_s"}
_SWITCH_KEYS = {"changes", "pause_s"}
# A fault's pause is the sum of its switches' to this many seconds: the bench writes each to
# 0.1 ms, so a larger difference is no rounding.
PAUSE_SUM_S = 1e-6
# A pauses file nests seven levels deep (policies, a policy, its faults, a fault, its switches,
# a switch, its changes); far deeper is no pauses file, and Python's JSON reader would run out
# of stack on it.
MAX_DEPTH = 16
# A value shown in an error is cut to this many characters: the error stays one readable line.
SHOWN = 40


class PausesError(ValueError):
    """A pauses document that breaks the format; `path` is the JSON path of the problem."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


@dataclass(frozen=True)
class LongInteger:
    """An integer literal with more digits than Python converts (4,300 by default): kept as
    such, so that the validation refuses it at its JSON path."""

    digits: int

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def decode(text: str) -> Any:
    """The JSON document in `text`: json.JSONDecodeError when it is not JSON, PausesError (at the
    JSON path where it happens) when it nests deeper than MAX_DEPTH."""
    _check_depth(text)
    return json.loads(text, parse_int=_integer_literal)


def _integer_literal(digits: str) -> int | LongInteger:
    try:
        return int(digits)
    except ValueError:  # past the interpreter's limit on the digits it converts
        return LongInteger(len(digits.lstrip("-")))


def _check_depth(text: str) -> None:
    """PausesError naming the JSON path of the first array or object opened MAX_DEPTH levels
    deep; text that is not JSON passes (the decoder says what is wrong with it)."""
    stack: list[list[Any]] = []  # per open container: [kind, key or index, expecting a key]
    start, i = -1, 0
    while i < len(text):
        char = text[i]
        if start >= 0:  # in a string
            if char == "\\":
                i += 1
            elif char == '"':
                if stack and stack[-1][0] == "{" and stack[-1][2]:
                    stack[-1][1] = text[start + 1:i]  # a key, as written
                start = -1
        elif char == '"':
            start = i
        elif char in "{[":
            if len(stack) >= MAX_DEPTH:
                raise PausesError(_path(stack), f"nested deeper than {MAX_DEPTH} levels")
            stack.append([char, None if char == "{" else 0, char == "{"])
        elif char in "}]":
            if stack:
                stack.pop()
        elif char == ":" and stack:
            stack[-1][2] = False
        elif char == "," and stack:
            if stack[-1][0] == "[":
                stack[-1][1] += 1
            else:
                stack[-1][2] = True
        i += 1


def _path(stack: list[list[Any]]) -> str:
    path = ""
    for kind, at, _ in stack:
        path += f"[{at}]" if kind == "[" else f".{at}" if path else str(at)
    return path


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


@dataclass(frozen=True)
class BenchJob:
    """The job the bench measured on."""

    gpus: int
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    parameters: int
    step_seconds: float
    checkpoint_interval_steps: int
    checkpoint_interval_seconds: float


@dataclass(frozen=True)
class MeasuredSwitch:
    """One change of layout a fault caused: what it did (CHANGES, none when the new layout runs
    on the same GPUs) and its pause, from the last step on the layout before to the first on
    the one after."""

    changes: tuple[str, ...]
    pause_s: float


@dataclass(frozen=True)
class MeasuredFault:
    """One fault the bench injected, every switch of layout it caused and the pauses."""

    kind: str
    # None when the policy does not detect the fault itself (a cordon is announced to it).
    detection_s: float | None
    # Every switch's pause, summed; with no switch, the gap around the fault (a step's time).
    pause_s: float
    steps_redone: int
    # The TP degree of every replica the job trained on: before the fault, then after each
    # switch (a restart's new attempt included).
    layouts: tuple[tuple[int, ...], ...]
    switches: tuple[MeasuredSwitch, ...]
    # Seconds the job trained on fewer GPUs than its whole layout, until the next fault.
    reduced_s: float
    checkpoint_load_s: float = 0.0

    @property
    def rest_s(self) -> float:
        """The pause less detection and checkpoint load: pod replacement, process start,
        planning, rendezvous and communicator set-up (README "Measured pauses")."""
        return self.pause_s - (self.detection_s or 0.0) - self.checkpoint_load_s


@dataclass(frozen=True)
class MeasuredPauses:
    job: BenchJob
    # Policy name -> its faults, in the file's order.
    policies: dict[str, tuple[MeasuredFault, ...]]


@dataclass(frozen=True)
class ScalingModel:
    """The knobs of the scaling model (README "Measured pauses"): assumptions about the simulated
    cluster, to change for one's own hardware."""

    # GPUs per node of the simulated cluster (an HGX node), for its node count.
    gpus_per_node: int = 8
    # What the checkpoint holds per parameter: the fp32 weight and AdamW's two fp32 moments.
    bytes_per_parameter: float = 12.0
    # Per GPU, GB/s: a parallel file system's share of its read bandwidth.
    storage_gbps: float = 2.0
    # Per GPU, GB/s: one 400 Gb/s NIC per GPU, as in an HGX H100/H200 node.
    scale_out_gbps: float = 50.0

    def __post_init__(self) -> None:
        # A zero knob would divide by zero deep in the scaling; name it here instead.
        for knob in fields(self):
            value = getattr(self, knob.name)
            if not value > 0:
                raise ValueError(f"ScalingModel.{knob.name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class Factors:
    """How the parts of a measured pause grow from the bench's job to the simulated one."""

    # Everything but detection, checkpoint load and transfer: log2(2 x sim nodes) over the bench's.
    restart: float
    bench_nodes: int
    sim_nodes: int
    # The simulated job's state per GPU: parameters / (tp x pp) x bytes per parameter.
    shard_bytes: float
    # Change (CHANGES) -> {"failure": s, "repair": s}: the bytes a recovering GPU receives on the
    # simulated job for a switch that made it, over its link; the bench's job is too small to
    # show them.
    transfer_s: dict[str, dict[str, float]]
    # The assumptions the transfers were computed with, for the record.
    model: ScalingModel


@dataclass(frozen=True)
class ScaledFault:
    fault: MeasuredFault
    scaled_s: float


@dataclass(frozen=True)
class PolicyPauses:
    """One policy's pauses for the simulated job; None keeps the assumed one."""

    failure_stall_s: float | None
    repair_stall_s: float | None
    # Charged on top of a restart's scaled pause: half the simulated checkpoint interval.
    lost_work_s: float
    faults: tuple[ScaledFault, ...]


@dataclass(frozen=True)
class ScaledPauses:
    """A pauses file scaled to one simulated job."""

    job: BenchJob
    factors: Factors
    policies: dict[str, PolicyPauses]


def parse(doc: Any) -> MeasuredPauses:
    """Validate a decoded pauses document; PausesError names the first bad JSON path."""
    if not isinstance(doc, dict):
        raise PausesError("", "must be a JSON object")
    if doc.get("format") != FORMAT:
        raise PausesError("format", f"must be {FORMAT!r}, got {_shown(doc.get('format'))}")
    job = _parse_job(_object(doc, "job"))
    policies = _object(doc, "policies")
    if not policies:
        raise PausesError("policies", "is empty: a pauses file measures at least one policy")
    parsed = {}
    for name, entry in policies.items():
        path = f"policies.{name}"
        if name not in POLICY_NAMES:
            raise PausesError(
                path, f"unknown policy; the simulator's are {', '.join(POLICY_NAMES)}"
            )
        if not isinstance(entry, dict):
            raise PausesError(path, "must be an object with a 'faults' list")
        _no_other_keys(entry, {"faults"}, path)
        faults = entry.get("faults")
        if not isinstance(faults, list) or not faults:
            raise PausesError(f"{path}.faults", "must be a non-empty list of faults")
        parsed[name] = tuple(_parse_fault(f, f"{path}.faults[{i}]", job)
                             for i, f in enumerate(faults))
    return MeasuredPauses(job, parsed)


def parameters(cfg: SimConfig) -> int:
    """Parameter elements of the simulated model (every unit of every layer, and the vocab)."""
    shape = cfg.model.shape
    kinds = {"q_heads": shape.n_layers, "kv_heads": shape.n_layers, "mlp_cols": shape.n_layers,
             "vocab_rows": 1}  # fmt: skip
    return sum(shape.unit_count(k) * shape.unit_elements(k) * n for k, n in kinds.items())


def factors(job: BenchJob, cfg: SimConfig, model: ScalingModel = ScalingModel()) -> Factors:
    """The scale factors from the bench's job to `cfg`'s."""
    sim_nodes = math.ceil(cfg.gpus / model.gpus_per_node)
    shard = parameters(cfg) / (cfg.tp * cfg.pp) * model.bytes_per_parameter
    return Factors(
        restart=math.log2(2 * sim_nodes) / math.log2(2 * job.nodes),
        bench_nodes=job.nodes,
        sim_nodes=sim_nodes,
        shard_bytes=shard,
        transfer_s={change: _transfers(change, shard, cfg.tp, model) for change in CHANGES},
        model=model,
    )


def scale_fault(fault: MeasuredFault, f: Factors) -> float:
    """The fault's pause on the simulated job: detection and checkpoint load held, the rest by the
    restart factor, plus each switch's transfer of the simulated job's bytes: that of the change
    that moves the most (a switch's changes move at once, to different GPUs)."""
    which = "repair" if fault.kind in REPAIR_KINDS else "failure"
    moved = sum(max((f.transfer_s[c][which] for c in s.changes), default=0.0)
                for s in fault.switches)
    return (fault.detection_s or 0.0) + fault.checkpoint_load_s + fault.rest_s * f.restart + moved


def scale(
    measured: MeasuredPauses, cfg: SimConfig, model: ScalingModel = ScalingModel()
) -> ScaledPauses:
    """Per policy in the file: its pauses on `cfg`'s job. A failure stall is the mean over the
    failure kinds present of each kind's mean (a repair stall likewise over the repair kinds); a
    restart also loses half the checkpoint interval.
    PausesError when a scaled pause exceeds the simulator's clock."""
    f = factors(measured.job, cfg, model)
    lost_work = cfg.policy.lost_work_s
    scaled = {}
    for name, faults in measured.policies.items():
        rows = tuple(ScaledFault(fault, scale_fault(fault, f)) for fault in faults)
        by_kind: dict[str, list[float]] = {}
        for row in rows:
            by_kind.setdefault(row.fault.kind, []).append(row.scaled_s)
        means = {kind: sum(v) / len(v) for kind, v in by_kind.items()}
        failures = [means[k] for k in FAILURE_KINDS if k in means]
        repairs = [means[k] for k in REPAIR_KINDS if k in means]
        lost = lost_work if name == RESTART_POLICY else 0.0
        result = PolicyPauses(
            failure_stall_s=sum(failures) / len(failures) + lost if failures else None,
            repair_stall_s=sum(repairs) / len(repairs) if repairs else None,
            lost_work_s=lost,
            faults=rows,
        )
        for which, value in (
            ("failure", result.failure_stall_s),
            ("repair", result.repair_stall_s),
        ):
            if value is not None and value > MAX_PAUSE_S:
                raise PausesError(
                    f"policies.{name}",
                    f"the {which} pause scales to {value:.3g} s on this job, "
                    f"beyond the simulator's {MAX_PAUSE_S:.3g} s",
                )
        scaled[name] = result
    return ScaledPauses(measured.job, f, scaled)


def apply(policies: Sequence[Policy], scaled: ScaledPauses) -> tuple[Policy, ...]:
    """The policies charged the scaled pauses where the file has them, the assumed ones else."""
    out = []
    for p in policies:
        s = scaled.policies.get(p.name)
        stalls = ("failure_stall_s", "repair_stall_s")
        charged = {k: getattr(s, k) for k in stalls if s and getattr(s, k) is not None}
        out.append(replace(p, **charged))
    return tuple(out)


def _transfers(change: str, shard: float, tp: int, model: ScalingModel) -> dict[str, float]:
    """Seconds for a recovering GPU to receive its bytes for `change`, on failure and repair: a
    whole shard, except a reshard survivor's share of a lost GPU's, shard / (tp - 1); none for
    a drop."""
    if change not in LINKS:
        return {"failure": 0.0, "repair": 0.0}
    whole = shard / (getattr(model, LINKS[change]) * GB)
    # With TP1 there is no survivor to share the lost units among: the whole shard moves.
    survivors = max(tp - 1, 1) if change == "reshard" else 1
    return {"failure": whole / survivors, "repair": whole}


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise PausesError(key, "must be an object" if key in doc else "is missing")
    return value


def _no_other_keys(entry: dict[str, Any], allowed: set[str], path: str) -> None:
    for key in entry:
        if key not in allowed:
            raise PausesError(
                f"{path}.{key}", f"unknown key; expected {', '.join(sorted(allowed))}"
            )


def _present(entry: dict[str, Any], key: str, path: str) -> Any:
    if key not in entry:
        raise PausesError(f"{path}.{key}", "is missing")
    return entry[key]


def _number(entry: dict[str, Any], key: str, path: str, *, positive: bool = False) -> float:
    value = _present(entry, key, path)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise PausesError(f"{path}.{key}", f"must be a number {bound}, got {_shown(value)}")
    return float(value)


def _integer(entry: dict[str, Any], key: str, path: str, *, minimum: int) -> int:
    value = _present(entry, key, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PausesError(f"{path}.{key}",
                          f"must be an integer >= {minimum}, got {_shown(value)}")
    return value


def _parse_job(job: dict[str, Any]) -> BenchJob:
    ints = {key: _integer(job, key, "job", minimum=1) for key in _JOB_INTS}
    parsed = BenchJob(
        **ints,
        step_seconds=_number(job, "step_seconds", "job", positive=True),
        checkpoint_interval_steps=_integer(job, "checkpoint_interval_steps", "job", minimum=0),
        checkpoint_interval_seconds=_number(job, "checkpoint_interval_seconds", "job"),
    )
    if parsed.tp * parsed.pp * parsed.dp != parsed.gpus:
        raise PausesError(
            "job.gpus",
            f"tp x pp x dp = {parsed.tp} x {parsed.pp} x {parsed.dp} = "
            f"{parsed.tp * parsed.pp * parsed.dp}, but gpus = {parsed.gpus}",
        )
    if parsed.nodes * parsed.gpus_per_node < parsed.gpus:
        raise PausesError(
            "job.nodes",
            f"{parsed.nodes} nodes of {parsed.gpus_per_node} GPUs cannot hold {parsed.gpus} GPUs",
        )
    return parsed


def _parse_fault(entry: Any, path: str, job: BenchJob) -> MeasuredFault:
    if not isinstance(entry, dict):
        raise PausesError(path, "must be an object")
    _no_other_keys(entry, _FAULT_KEYS, path)
    kinds = (*FAILURE_KINDS, *REPAIR_KINDS)
    if entry.get("kind") not in kinds:
        raise PausesError(f"{path}.kind", f"must be one of {', '.join(kinds)}, got "
                          f"{_shown(entry.get('kind'))}")  # fmt: skip
    if "detection_s" not in entry:
        raise PausesError(f"{path}.detection_s", "is missing (null when not detected in-job)")
    detection = None if entry["detection_s"] is None else _number(entry, "detection_s", path)
    layouts = _list(entry, "layouts", path)
    if not layouts:
        raise PausesError(f"{path}.layouts", "must list the layout before the fault")
    switches = _list(entry, "switches", path)
    if len(switches) != len(layouts) - 1:
        raise PausesError(f"{path}.switches", f"must be one per layout after the first: "
                          f"{len(layouts) - 1}, got {len(switches)}")  # fmt: skip
    fault = MeasuredFault(
        kind=entry["kind"],
        detection_s=detection,
        pause_s=_number(entry, "pause_s", path),
        steps_redone=_integer(entry, "steps_redone", path, minimum=0),
        layouts=tuple(_parse_layout(x, f"{path}.layouts[{i}]", job)
                      for i, x in enumerate(layouts)),
        switches=tuple(_parse_switch(x, f"{path}.switches[{i}]")
                       for i, x in enumerate(switches)),
        reduced_s=_number(entry, "reduced_s", path),
        checkpoint_load_s=_number(entry, "checkpoint_load_s", path)
        if "checkpoint_load_s" in entry
        else 0.0,
    )
    if fault.switches:
        total = sum(s.pause_s for s in fault.switches)
        if abs(total - fault.pause_s) > PAUSE_SUM_S:
            raise PausesError(f"{path}.pause_s", f"must be the sum of its switches' pauses, "
                              f"{total:g}, got {fault.pause_s:g}")  # fmt: skip
    if fault.rest_s < 0:
        raise PausesError(
            f"{path}.pause_s",
            f"must be at least detection_s + checkpoint_load_s = "
            f"{fault.pause_s - fault.rest_s:g}, got {fault.pause_s:g}",
        )
    return fault


def _list(entry: dict[str, Any], key: str, path: str) -> list[Any]:
    value = _present(entry, key, path)
    if not isinstance(value, list):
        raise PausesError(f"{path}.{key}", f"must be a list, got {_shown(value)}")
    return value


def _parse_layout(value: Any, path: str, job: BenchJob) -> tuple[int, ...]:
    """A layout: the TP degree of each of at most job.dp replicas, each within 1..job.tp."""
    if not isinstance(value, list) or not 1 <= len(value) <= job.dp:
        raise PausesError(path, f"must list the TP degree of 1 to {job.dp} (job.dp) replicas, "
                          f"got {_shown(value)}")  # fmt: skip
    for i, tp in enumerate(value):
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= job.tp:
            raise PausesError(f"{path}[{i}]", f"must be an integer in 1..{job.tp} (job.tp), "
                              f"got {_shown(tp)}")  # fmt: skip
    return tuple(value)


def _parse_switch(entry: Any, path: str) -> MeasuredSwitch:
    if not isinstance(entry, dict):
        raise PausesError(path, "must be an object")
    _no_other_keys(entry, _SWITCH_KEYS, path)
    changes = _list(entry, "changes", path)
    for i, change in enumerate(changes):
        if change not in CHANGES or change in changes[:i]:
            raise PausesError(f"{path}.changes[{i}]", f"must be one of {', '.join(CHANGES)}, "
                              f"each once, got {_shown(change)}")  # fmt: skip
    return MeasuredSwitch(tuple(changes), _number(entry, "pause_s", path))
