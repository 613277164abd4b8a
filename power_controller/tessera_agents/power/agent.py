"""The node power agent (`tessera power-agent`): collect -> decide -> actuate -> serve metrics.

Each step reads the node's GPUs and its `GPUPowerTarget`, lets the pure policy decide, lowers
limits first, raises only into the headroom that is really there, and reports what is in effect
in the target's status. Every GPU it changes is recorded on the host, with the limit set, before
the change, and so is the node's budget share before the agent acts on a target. A boost never
outlives its target: with the target deleted or invalid, on SIGTERM, and in the agent that
follows a crash, the GPUs settle at the base cap inside the last share (`--on-exit hold` leaves
them to the next agent instead); only a node that was never given a share goes back to the
device defaults. Settling raises a GPU below the base cap (one cordoned at its minimum, one
ramping) to it at once, not by ramp steps: the level is inside the share, and with no target no
job's workload is left to draw it, so an agent that goes away leaves no GPU below it. An agent
that starts and finds GPUs recorded adopts them if the operator's target is valid, settles them
if it is gone, and holds them at their recorded limits while it cannot tell.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

from tessera_agents.bounded import call_all
from tessera_agents.power.devices import GpuId, GpuReading, NotFound, PowerBackend, PowerError
from tessera_agents.power.metrics import GpuStatus, NodeStatus
from tessera_agents.power.state import ManagedGpus
from tessera_contracts.powertarget import (
    InvalidTarget,
    PowerTarget,
    parse_object,
    parse_spec,
    render_status,
    to_object,
)
from tessera_core.power_policy import WATT, Decision, DeviceView, clamp, decide_after_cuts

log = logging.getLogger("tessera.power-agent")


class TargetSource(Protocol):
    """Where the agent reads its node's target object (the API server in production): the object,
    None when there is none (404), or an exception when it cannot be known; and where it reports
    the status of the object with `uid`, the one the agent acted on, and no other (an exception
    when that fails, or when that object is gone)."""

    def fetch(self) -> dict[str, Any] | None: ...

    def report(self, status: dict[str, Any], uid: str | None) -> None: ...


class Fetched(Enum):
    """What one read of the target established."""

    VALID = "valid"
    ABSENT = "absent"  # the operator has no target for this node: it released the node
    INVALID = "invalid"
    UNREACHABLE = "unreachable"


@dataclass
class Agent:
    """One node's control loop state; `step()` runs one collect -> decide -> actuate cycle."""

    node: str
    backend: PowerBackend
    source: TargetSource
    managed: ManagedGpus
    step_mw: int = 50_000
    restore_timeout_s: float = 10.0
    target: PowerTarget | None = None
    generation: int | None = None  # metadata.generation of the object last read
    uid: str | None = None  # metadata.uid of the object last read
    status: NodeStatus = field(init=False)
    # GPUs a previous agent left changed, until the operator's target says what to do with them.
    recovering: bool = field(init=False)
    # Limits last seen per GPU index: a GPU that stops answering is counted at this value.
    _known_mw: dict[int, int] = field(default_factory=dict, init=False)
    _uuids: dict[int, str] = field(default_factory=dict, init=False)  # last seen per index
    _last_warning: dict[str, str] = field(default_factory=dict, init=False)
    _invalid: str | None = field(default=None, init=False)  # why the object read is refused
    # The object (uid) whose status was last written, and what: a target deleted and created
    # again with the same spec gets the same status, and must still get it.
    _reported: tuple[str | None, dict[str, Any]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.status = NodeStatus(node=self.node)
        self.recovering = bool(self.managed.gpus)

    def _warn(self, where: str, message: str) -> None:
        if self._last_warning.get(where) != message:  # log changes, not every repeat
            log.warning("%s: %s", where, message)
            self._last_warning[where] = message

    def _error(self, where: str, err: Exception) -> None:
        kind = type(err).__name__
        self.status.errors[kind] = self.status.errors.get(kind, 0) + 1
        self._warn(where, f"{kind}: {err}")

    def _ok(self, where: str) -> None:
        if self._last_warning.pop(where, None) is not None:
            log.info("%s: recovered", where)

    # 1. collect -----------------------------------------------------------------------------

    def _read_all(self, gpus: list[GpuId]) -> dict[int, GpuReading | None]:
        readings: dict[int, GpuReading | None] = {}
        for gpu in gpus:
            where = f"GPU {gpu.index}"
            try:
                readings[gpu.index] = r = self.backend.read(gpu.index)
                self._known_mw[gpu.index], self._uuids[gpu.index] = r.limit_mw, r.uuid
                self._ok(where)
            except PowerError as err:
                readings[gpu.index] = None
                self._error(where, err)
        return readings

    def _refresh_target(self) -> Fetched:
        try:
            obj = self.source.fetch()
            self._ok("target")
        except Exception as err:  # outage: keep acting on the last valid target
            self._error("target", err)
            return Fetched.UNREACHABLE
        if obj is None:
            self.target, self.generation, self.uid = None, None, None
            return Fetched.ABSENT
        meta = (obj.get("metadata") or {}) if isinstance(obj, dict) else {}
        generation, uid = meta.get("generation"), meta.get("uid")
        valid_generation = isinstance(generation, int) and not isinstance(generation, bool)
        self.generation = generation if valid_generation else None
        self.uid = uid if isinstance(uid, str) else None
        try:
            target = parse_object(obj, self.node)
        except InvalidTarget as err:
            self.target, self._invalid = None, str(err)
            self._error("target", err)
            return Fetched.INVALID
        self._invalid = None
        try:
            # Before acting on it: a successor must never know less budget than was acted on.
            self.managed.record_share(to_object(target.settled())["spec"])
        except OSError as err:  # then no GPU can be recorded either, so none is changed
            self._error("state file", err)
        self.target = target
        return Fetched.VALID

    def settled(self) -> PowerTarget | None:
        """The node's settled target (base cap inside its last recorded share); None when no
        share was ever recorded."""
        if self.managed.share is None:
            return None
        try:
            return parse_spec(self.managed.share, self.node)
        except InvalidTarget as err:
            self._warn("record", f"the recorded share cannot be used: {err}")
            return None

    def _goal(self) -> PowerTarget | None:
        """What this step moves toward: the valid target; without one, the settled level (but
        not while GPUs a previous agent changed wait for the target to say what to do)."""
        if self.target is not None:
            return self.target
        return None if self.recovering else self.settled()

    def _check_indices(self, gpus: list[GpuId]) -> None:
        beyond = sorted(i for i in (self.target.gpu_w if self.target else {}) if i >= len(gpus))
        if beyond:
            self._warn("target indices",
                       f"target names GPU(s) {beyond}, but this node has {len(gpus)} GPU(s)")

    # restart --------------------------------------------------------------------------------

    def _resolve(self, fetched: Fetched) -> bool:
        """Decide what to do with GPUs a previous agent left changed; True once decided."""
        if not self.recovering:
            return True
        if fetched is Fetched.VALID:
            log.info("valid target for node %s: adopting %d GPU(s) a previous agent changed",
                     self.node, len(self.managed.gpus))
        elif fetched in (Fetched.ABSENT, Fetched.INVALID) and self.settled() is not None:
            log.info("no valid target for node %s: settling %d GPU(s) a previous agent changed at"
                     " the base cap inside the node's last share", self.node,
                     len(self.managed.gpus))
        elif fetched is Fetched.ABSENT:
            log.info("no target and no budget ever given to node %s: restoring %d GPU(s) a "
                     "previous agent changed", self.node, len(self.managed.gpus))
            self.restore()
        else:
            return False
        self.recovering = False
        return True

    def recover(self, wait_s: float, sleep: Callable[[float], object] = time.sleep) -> None:
        """At start: read the target for up to `wait_s` to decide between adopting, settling
        and restoring the recorded GPUs, and hold them at their recorded limits if it cannot be
        read (the loop keeps trying). With the record unreadable, any GPU may have been changed
        and the share is lost: every GPU counts as recorded, so a valid target still adopts
        them (never a detour through the defaults on a budgeted node), and only a node with no
        target at all gets its defaults back."""
        if self.managed.unreadable:
            self._record_every_gpu()
        self.recovering = bool(self.managed.gpus)
        deadline = time.monotonic() + wait_s
        while not self._resolve(self._refresh_target()):
            if time.monotonic() >= deadline:
                log.warning("cannot tell whether the operator still wants the limits on %d GPU(s)"
                            " a previous agent changed: holding their last limits, retrying",
                            len(self.managed.gpus))
                self.hold_recorded()
                return
            if sleep(min(1.0, max(0.0, deadline - time.monotonic()))):
                return  # asked to stop (`threading.Event.wait` answers True): shutdown decides

    def _identified_gpus(self, left_out: str) -> list[str] | None:
        """The UUIDs of the GPUs the backend can identify (None when it cannot list them); the
        others are logged as `left_out` ("recorded", "restored")."""
        try:
            gpus = self.backend.gpus()
        except PowerError as err:
            self._error("backend", err)
            return None
        unknown = [g.index for g in gpus if g.uuid is None]
        if unknown:
            log.error("GPU(s) %s cannot be identified and are not %s", unknown, left_out)
        return [g.uuid for g in gpus if g.uuid is not None]

    def _record_anew(self, uuids: list[str]) -> None:
        """Replace an unreadable record by one naming `uuids` as changed."""
        try:
            self.managed.forget_unreadable()
            for uuid in uuids:
                self.managed.record(uuid, None)
        except OSError as err:
            self._error("state file", err)

    def _record_every_gpu(self) -> None:
        uuids = self._identified_gpus("recorded")
        if uuids is not None:
            self._record_anew(uuids)

    def hold_recorded(self) -> None:
        """Put recorded GPUs back at their last recorded limit (which met the budget), in case
        the driver reset them (a driver reload returns every GPU to its default)."""
        try:
            gpus = self.backend.gpus()
        except PowerError as err:
            self._error("backend", err)
            return
        for gpu in gpus:
            last = self.managed.gpus.get(gpu.uuid) if gpu.uuid else None
            if last is None:
                continue
            try:
                r = self.backend.read(gpu.index)
                want = clamp(last, r.min_mw, r.max_mw)
                if r.limit_mw != want:
                    self.backend.set_limit(gpu.index, want)
                    log.info("GPU %d: back at its last limit %d mW", gpu.index, want)
            except PowerError as err:
                self._error(f"GPU {gpu.index}", err)

    # 2. decide ------------------------------------------------------------------------------

    def _views(self, readings: dict[int, GpuReading | None]) -> list[DeviceView]:
        worst = max((r.max_mw for r in readings.values() if r), default=0)
        views = []
        for index, r in readings.items():
            if r is None:
                # Unknown is counted at its last limit (seen by this agent, else recorded for
                # its index by a predecessor), or the node's largest maximum: we cannot show it
                # draws less, and the budget must hold whatever it does.
                recorded = self.managed.lost_limit(index)
                last = self._known_mw.get(index, worst if recorded is None else recorded)
                views.append(DeviceView(index, 0, 0, last, False))
            else:
                views.append(DeviceView(index, r.min_mw, r.max_mw, r.limit_mw))
        return views

    # 3. actuate -----------------------------------------------------------------------------

    def _apply(
        self, changes: dict[int, int], readings: dict[int, GpuReading | None]
    ) -> dict[int, int]:
        """Set limits (recording each GPU first); the limit each GPU holds afterwards, also put
        in `readings`: as read back, or, when the GPU cannot be read, the limit set, or after a
        failed set the higher of the old and the asked one (a failed call may have taken)."""
        held = {}
        for index, milliwatts in changes.items():
            gpu, where = readings[index], f"GPU {index}"
            assert gpu is not None  # the policy only changes GPUs it could read
            try:
                # Write-ahead: a GPU that cannot be recorded is not changed.
                self.managed.record(gpu.uuid, milliwatts, index)
                self.backend.set_limit(index, milliwatts)
                taken = True
            except (PowerError, OSError) as err:
                self._error(where, err)
                taken = False
            try:
                readings[index] = after = self.backend.read(index)  # the driver may round
            except PowerError as err:
                self._error(where, err)
                assumed = milliwatts if taken else max(gpu.limit_mw, milliwatts)
                readings[index] = after = replace(gpu, limit_mw=assumed)
            else:
                if taken:
                    self._ok(where)
            self._known_mw[index] = held[index] = after.limit_mw
            if taken:
                try:
                    self.managed.record(gpu.uuid, after.limit_mw, index)
                except OSError as err:  # the GPU is set; the record keeps the value asked for
                    self._error("state file", err)
        return held

    def step(self) -> NodeStatus:
        try:
            gpus = self.backend.gpus()
        except PowerError as err:
            self._error("backend", err)
            self.status = replace(self.status, holding=True, reason=f"hold: {err}", gpus=())
            return self.status
        fetched = self._refresh_target()
        self._resolve(fetched)
        self._check_indices(gpus)
        readings = self._read_all(gpus)
        views, goal = self._views(readings), self._goal()
        step_mw = self.step_mw if self.target is not None else _at_once(views)
        decision = decide_after_cuts(views, goal, step_mw,
                                     functools.partial(self._apply, readings=readings))
        if decision.infeasible:
            self._warn("budget", decision.reason)
        self._apply(decision.raise_, readings)

        limits = {v.index: self._limit(v, readings) for v in views}
        # Released and at the settled level: what `tessera uninstall` waits for.
        settled = (goal is not None and self.target is None and not decision.holding
                   and all(limits[i] == g for i, g in decision.goals.items()))
        self.status = replace(self._render(gpus, readings, decision, goal), settled=settled)
        self._report(fetched, decision, limits)
        return self.status

    def _report(self, fetched: Fetched, decision: Decision, limits: dict[int, int]) -> None:
        """Write the target's status when what is in effect changed (so the operator can raise
        other nodes of the rack once this one's cut is in force); there is nothing to write to
        without an object, and no way to during an outage."""
        if fetched not in (Fetched.VALID, Fetched.INVALID):
            return
        target = self.target
        in_effect = (target is not None and not decision.holding
                     and sum(limits.values()) <= target.budget_w * WATT)
        if fetched is Fetched.INVALID:
            settling = "settling" if self.settled() is not None else "holding"
            state, message = "Settled", f"target refused ({self._invalid}); {settling}"
        elif decision.holding:
            state, message = "Holding", decision.reason
        elif decision.infeasible:
            state, message = "Infeasible", decision.reason
        elif not in_effect:
            state, message = "OverBudget", "a GPU refused its cut and the others cannot make up"
        elif all(limits[i] == g for i, g in decision.goals.items()):
            state, message = "Applied", "every GPU at its target"
        else:
            state, message = "Ramping", "within budget, raising toward the targets"
        status = render_status(generation=self.generation, in_effect=in_effect, state=state,
                               message=message, limits_mw=limits)
        if (self.uid, status) == self._reported:
            return
        try:
            self.source.report(status, self.uid)
        except Exception as err:  # the loop is the retry: the next step writes it again
            self._error("status", err)
            return
        self._reported = (self.uid, status)
        self._ok("status")

    def _limit(self, view: DeviceView, readings: dict[int, GpuReading | None]) -> int:
        reading = readings[view.index]
        return reading.limit_mw if reading is not None else view.limit_mw

    def _render(
        self,
        gpus: list[GpuId],
        readings: dict[int, GpuReading | None],
        decision: Decision,
        t: PowerTarget | None,
    ) -> NodeStatus:
        goals = decision.goals
        rows = tuple(
            GpuStatus(
                index=g.index,
                uuid=r.uuid if (r := readings[g.index]) else (g.uuid or ""),
                power_mw=r.power_mw if r else None,
                limit_mw=r.limit_mw if r else None,
                target_mw=goals.get(g.index),
                boosted=bool(t and goals and t.boosted(g.index)),
                enforced_mw=r.enforced_mw if r else None,
                sm_clock_mhz=r.sm_clock_mhz if r else None,
                power_capped=r.power_capped if r and r.clock_event_reasons is not None else None,
            )
            for g in gpus
        )
        return replace(
            self.status,
            rack=t.rack if t else self.status.rack,
            budget_mw=t.budget_w * WATT if t else self.status.budget_mw,
            rack_budget_mw=t.rack_budget_w * WATT if t else self.status.rack_budget_mw,
            holding=decision.holding,
            reason=decision.reason,
            gpus=rows,
        )

    # leave ---------------------------------------------------------------------------------

    def leave(self) -> list[str]:
        """On the way out: settle every GPU at the base cap inside the node's last share (all
        GPUs at once, within `restore_timeout_s`: the cuts first, then the raises of GPUs below
        it, admitted against what the GPUs hold after the cuts: nothing stays boosted or below
        the base cap with no agent watching, and the share holds whatever comes next); a node
        never given a share is restored to its defaults instead. GPUs stay recorded for the next
        agent. Returns the GPUs (UUID, or index when unidentified) that could not be brought to
        their level."""
        goal = self.settled()
        if goal is None:
            return self.restore()
        start = time.monotonic()

        def within(calls: dict[Any, Callable[[], Any]], share: float) -> dict[Any, Any]:
            """`calls` at once, until `share` of the time allowed has passed: one hung call
            leaves the later rounds their own part of it."""
            deadline = start + share * self.restore_timeout_s
            return call_all(calls, max(0.0, deadline - time.monotonic()))

        listed = within({"gpus": self.backend.gpus}, 0.2)["gpus"]
        if isinstance(listed, Exception):
            self._error("backend", listed)
            return sorted(self.managed.gpus)
        readings: dict[int, GpuReading | None] = {}
        for index, r in within({g.index: functools.partial(self.backend.read, g.index)
                                for g in listed}, 0.4).items():
            readings[index] = None if isinstance(r, Exception) else r
            if isinstance(r, Exception):
                self._error(f"GPU {index}", r)
            else:
                self._known_mw[index] = r.limit_mw
        # The first round of cuts may take 60% of the time, deeper rounds up to 80%; the raises
        # what is left.
        shares, missed = iter([0.6]), set()

        def cut(cuts: dict[int, int]) -> dict[int, int]:
            held = self._set_within(cuts, readings,
                                    functools.partial(within, share=next(shares, 0.8)))
            missed.update(i for i, mw in held.items() if mw > cuts[i])
            return held

        views = self._views(readings)
        decision = decide_after_cuts(views, goal, _at_once(views), cut)
        raised = self._set_within(decision.raise_, readings, functools.partial(within, share=1.0))
        missed.update(i for i, mw in raised.items() if mw < decision.raise_[i])
        names = {g.index: g.uuid or self._uuids.get(g.index, f"GPU {g.index}") for g in listed}
        return sorted(names[i] for i in missed | {i for i, r in readings.items() if r is None})

    def _set_within(
        self,
        limits: dict[int, int],
        readings: dict[int, GpuReading | None],
        within: Callable[[dict[Any, Callable[[], Any]]], dict[Any, Any]],
    ) -> dict[int, int]:
        """Set `limits` all at once (recorded first), bounded; the limit each GPU then holds, also
        put in `readings` (its old one where the call failed or did not answer in time)."""
        calls, held = {}, {}
        for index, milliwatts in limits.items():
            gpu = readings[index]
            assert gpu is not None  # the policy only changes GPUs it could read
            held[index] = gpu.limit_mw
            try:
                self.managed.record(gpu.uuid, milliwatts, index)
            except OSError as err:  # a GPU that cannot be recorded is not changed
                self._error("state file", err)
                continue
            calls[index] = functools.partial(self.backend.set_limit, index, milliwatts)
        for index, result in within(calls).items():
            if isinstance(result, Exception):
                self._error(f"GPU {index}", result)
            else:
                self._known_mw[index] = held[index] = limits[index]
                readings[index] = replace(readings[index], limit_mw=limits[index])
        return held

    # restore -------------------------------------------------------------------------------

    def restore(self, uuids: list[str] | None = None) -> list[str]:
        """Put GPUs (by default every recorded one) back to the default limit each reports now,
        all at once and within `restore_timeout_s`. Returns the UUIDs that could not be restored;
        they stay recorded for the next attempt."""
        uuids = sorted(self.managed.gpus) if uuids is None else uuids
        calls = {u: functools.partial(self.backend.restore_default, u) for u in uuids}
        left = []
        for uuid, result in call_all(calls, self.restore_timeout_s).items():
            if isinstance(result, NotFound):
                # Replaced or gone for good: nothing to restore now, and a GPU that comes back
                # after a reset or reboot comes back at the driver's default.
                log.warning("GPU %s is not on this node any more; forgetting it", uuid)
            elif isinstance(result, Exception):
                self._error(f"restore {uuid}", result)
                left.append(uuid)
                continue
            else:
                log.info("restored GPU %s to its default %d mW", uuid, result)
            try:
                self.managed.discard(uuid)
            except OSError as err:  # restored; the next agent restores it again, harmlessly
                self._error("state file", err)
        return left

    def restore_all(self) -> None:
        """The record could not be read, so any GPU may have been changed: restore them all."""
        uuids = self._identified_gpus("restored")
        if uuids is not None:
            self._record_anew(self.restore(uuids))


def _at_once(views: list[DeviceView]) -> int:
    """A raise step that takes any of these GPUs from its minimum to its maximum in one go."""
    return max((v.max_mw for v in views), default=0)
