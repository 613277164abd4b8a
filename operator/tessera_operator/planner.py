"""Tessera's planner: from a job's spec, its nodes and their failed GPUs to the desired layout.

Pure (no kopf, Kubernetes client or torch): the operator, the simulator and the tests run the
same decisions. The steps of `plan`:
1. Group the job's nodes into scale-up domains; cut each domain's GPUs into fixed TP-group slots
   (a TP group never leaves its domain; slots stay put so that one failure moves nobody else).
2. Decide each slot from its survivors (`decide_group`): full TP, a reduced TP at or above the
   minimum (NTP modes), or unused.
3. Pack usable groups into DP replicas, healthiest first, so partially failed groups share as few
   replicas as possible; each stage runs at its own TP degree, the replica at its slowest's.
4. NTP-PW: each reduced replica's boost is the power at which its busiest rank (tessera_core.plan's
   real split of whole heads, not the ideal N1/N2) keeps pace with a healthy one, within the boost
   cap.
   That open-loop figure only seeds the closed loop (`follow_compute`), which steps the ratio
   from the compute time the replica's nodes report against the healthy replicas'.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import groupby
from typing import Any

from tessera_contracts.jobspec import (
    NTPTrainingJobSpec,
    PowerPolicySpec,
    SpecError,
    min_tensor_parallel,
    schema_default,
)
from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_contracts.powertarget import PowerTarget
from tessera_contracts.progress import NodeReport, State
from tessera_contracts.vocabulary import FailurePolicy
from tessera_core.group_decision import GroupDecision, decide_group
from tessera_operator.power_planning import PowerPolicy, next_boost_ratio, plan_rack

DEFAULT_DOMAIN_LABEL: str = schema_default("scaleUpDomainLabel")
TP_LAYOUT_MAX = 4096  # status.tpLayout's maxLength in the CRD

GpuId = tuple[str, int]
ReplicaKey = tuple[int, int, tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class JobSpec:
    """What planning needs of an NTPTrainingJob's spec (`of`: a view of its typed value)."""

    shape: ModelShape
    tp: int
    dp: int
    pp: int = schema_default("pipelineParallelSize")
    gpus_per_node: int = schema_default("gpusPerNode")
    mode: FailurePolicy = FailurePolicy(schema_default("failurePolicy.mode"))
    min_tp: int = 0  # 0: half the healthy TP, as in the simulator
    domain_label: str = DEFAULT_DOMAIN_LABEL
    power: PowerPolicy | None = None

    @property
    def min_tp_or_default(self) -> int:
        return min_tensor_parallel(self.tp, self.min_tp)

    @property
    def restarts_on_loss(self) -> bool:
        return self.mode.restarts_on_loss

    @property
    def fewest_nodes(self) -> int:
        """The whole nodes that hold DP x TP x PP GPUs: the least an attempt runs on."""
        return -(-self.dp * self.tp * self.pp // self.gpus_per_node)

    @classmethod
    def of(cls, spec: NTPTrainingJobSpec) -> JobSpec:
        """What planning needs of a job's typed spec; SpecError names a field the operator
        cannot plan with (a model that does not split into heads, a power policy that does
        not hold, a size below 1, NTP-PW without a power policy)."""
        try:
            shape = spec.model.shape()
        except PlanError as exc:
            raise SpecError("model", str(exc)) from exc
        failure = spec.failure_policy
        job = cls(
            shape=shape, tp=spec.tensor_parallel_size, dp=spec.data_parallel_replicas,
            pp=spec.pipeline_parallel_size, gpus_per_node=spec.gpus_per_node, mode=failure.mode,
            min_tp=failure.min_tensor_parallel_size or 0,
            domain_label=spec.scale_up_domain_label, power=_power_policy(spec.power_policy))
        if min(job.tp, job.dp, job.pp, job.gpus_per_node) < 1:
            raise SpecError("tensorParallelSize", "TP, DP, PP and gpusPerNode must be positive")
        if job.mode is FailurePolicy.NTP_PW and job.power is None:
            raise SpecError("powerPolicy", "is required when failurePolicy.mode is NTP-PW")
        return job


def _power_policy(power: PowerPolicySpec | None) -> PowerPolicy | None:
    if power is None:
        return None
    try:
        return PowerPolicy(base_w=power.base_cap_watts, boost_cap_w=power.boost_cap_watts,
                           rack_budget_w=power.rack_budget_watts,
                           ramp_step_w=power.ramp_step_watts)
    except ValueError as exc:
        raise SpecError("powerPolicy", str(exc)) from exc


# ----------------------------------------------------------------------------------------------
# One TP group
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# The whole job
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Why the plan falls short of the spec; `reason` is a condition reason (CamelCase)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Group:
    """A TP-group slot of a scale-up domain and what it does."""

    domain: str
    slot: int
    gpus: tuple[GpuId, ...]  # its healthy GPUs, in rank order
    failed: tuple[GpuId, ...]
    decision: GroupDecision


@dataclass(frozen=True)
class Replica:
    """One DP replica: PP stages, each a group at its own TP degree (NTP per stage); `tp` is
    its limiting stage's, the one its pipeline runs at and whose survivors are boosted."""

    index: int
    tp: int
    stages: tuple[Group, ...]
    power_ratio: float = 1.0
    # The job step at which the closed loop last set `power_ratio` (0: the open-loop seed).
    ratio_step: int = 0

    def degrees(self) -> tuple[int, ...]:
        """TP degree of each stage: a GPU lost in one stage reduces that stage alone."""
        return tuple(g.decision.tp for g in self.stages)

    @property
    def limiting_stage(self) -> int:
        """The stage that sets the pipeline's pace: its lowest degree (the first of equals)."""
        degrees = self.degrees()
        return degrees.index(min(degrees))

    def limits(self, group: Group) -> bool:
        """Whether `group` is a stage slowed below the healthy pace to the replica's degree."""
        return group.decision.tp == self.tp and group.decision.slowdown > 1.0

    def stage_gpus(self) -> tuple[tuple[GpuId, ...], ...]:
        """The GPUs each stage's ranks run on; a stage's other survivors idle."""
        return tuple(g.gpus[: g.decision.tp] for g in self.stages)

    def idle_gpus(self) -> tuple[GpuId, ...]:
        return tuple(gpu for g in self.stages for gpu in g.gpus[g.decision.tp :])

    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({n for g in self.stages for n, _ in g.gpus + g.failed}))

    def failed_gpus(self) -> tuple[GpuId, ...]:
        return tuple(sorted(gpu for g in self.stages for gpu in g.failed))

    def key(self) -> ReplicaKey:
        """What identifies the replica across plans (as the status lists it): another index,
        degree, node or failed GPU makes it another replica, whose boost starts afresh."""
        return (self.index, self.tp, self.nodes(), tuple(map(gpu_name, self.failed_gpus())))


def gpu_name(gpu: GpuId) -> str:
    return f"{gpu[0]}/{gpu[1]}"


@dataclass(frozen=True)
class JobPlan:
    """The desired layout of a job and the power its domains should run at."""

    spec: JobSpec
    racks: Mapping[str, tuple[str, ...]]  # scale-up domain -> its nodes
    failed: frozenset[GpuId]
    replicas: tuple[Replica, ...]
    problems: tuple[Problem, ...] = field(default=())
    # Survivors of hit groups that no replica uses (too few to run, or dropped): idle, so their
    # power pays for boosts like the failed GPUs'.
    stranded: frozenset[GpuId] = frozenset()
    # Failed GPUs that may no longer take a limit, at the watts their agents still count them
    # (`power_planning.plan_rack`'s `stuck`).
    stuck: Mapping[GpuId, int] = field(default_factory=dict)

    @property
    def tp_layout(self) -> str:
        """TP degree per replica (`format_layout`)."""
        return format_layout([r.tp for r in self.replicas])

    @property
    def degraded(self) -> bool:
        return len(self.replicas) < self.spec.dp or any(r.tp < self.spec.tp for r in self.replicas)

    def rack_ratios(self) -> dict[str, float]:
        """Boost ratio per scale-up domain: the largest of the stages it serves (1.0: none). A
        replica's limiting stages take its ratio; its other stages keep pace unboosted, or at
        their own ratio when reduced less (a pipeline runs at its slowest stage)."""
        ratios = dict.fromkeys(self.racks, 1.0)
        for replica in self.replicas:
            for group in replica.stages:
                own = (replica.power_ratio if replica.limits(group)
                       else min(replica.power_ratio, group.decision.power_ratio))
                ratios[group.domain] = max(ratios[group.domain], own)
        return ratios

    def power_targets(self, held: Mapping[str, str] | None = None) -> dict[str, PowerTarget]:
        """GPUPowerTargets for every node of the job (empty without a power policy); they hold
        until changed or deleted.

        `held`: node -> the rack its current target names. A node of a rack the job still plans
        that is no longer in the layout still holds a share there (`power_planning.plan_sync` keeps
        its target), so it is planned again, parked: its GPUs at the minimum, inside the rack
        budget with the others', and the rack's raises can proceed once it reports that cut.

        SpecError when the power policy cannot be met on the racks observed (the schema cannot
        know the rack sizes).

        Failed GPUs and the idle survivors of a bottlenecked stage go to the minimum so that
        their budget pays for the boost; NTP-PW boosts a domain's other GPUs by its ratio.
        """
        if self.spec.power is None:
            return {}
        parked = self._parked(held or {})
        targets: dict[str, PowerTarget] = {}
        for rack, ratio in self.rack_ratios().items():
            targets |= self._rack_targets(rack, ratio, parked.get(rack, frozenset()))
        return targets

    def _parked(self, held: Mapping[str, str]) -> dict[str, frozenset[str]]:
        """Rack -> the nodes whose target names it but that no rack of the layout holds (a node
        moved to another planned rack is planned there, not parked)."""
        laid_out = {n for nodes in self.racks.values() for n in nodes}
        parked: dict[str, set[str]] = {}
        for node, rack in held.items():
            if rack in self.racks and node not in laid_out:
                parked.setdefault(rack, set()).add(node)
        return {rack: frozenset(nodes) for rack, nodes in parked.items()}

    def _rack_targets(self, rack: str, ratio: float, parked: frozenset[str]
                      ) -> dict[str, PowerTarget]:
        assert self.spec.power is not None
        nodes = dict.fromkeys((*self.racks[rack], *sorted(parked)), self.spec.gpus_per_node)
        unused = {gpu for gpu in self._idle if gpu[0] in nodes}
        policy = self.spec.power
        if policy.rack_budget_w is not None:
            # Watts beyond every GPU at the boost cap can never be drawn; left in, they would
            # inflate each node's share past what a GPUPowerTarget may carry.
            ceiling = len(nodes) * self.spec.gpus_per_node * policy.boost_cap_w
            policy = replace(policy, rack_budget_w=min(policy.rack_budget_w, ceiling))
        boost = ratio if self.spec.mode is FailurePolicy.NTP_PW else 1.0
        try:
            return plan_rack(policy, rack, nodes, unused, boost, parked, self.stuck)
        except ValueError as exc:  # e.g. a rack budget below its GPUs' minimum limits
            raise SpecError("powerPolicy.rackBudgetWatts", str(exc)) from exc

    @cached_property
    def _idle(self) -> frozenset[GpuId]:
        return self.failed | self.stranded | {gpu for r in self.replicas for gpu in r.idle_gpus()}

    def reachable_ratio(self, replica: Replica, held: Mapping[str, str] | None = None) -> float:
        """The highest power ratio the rack budgets let `replica`'s running GPUs reach, at most
        the boost cap's: asking for more would change no watt."""
        assert self.spec.power is not None
        base, cap = self.spec.power.base_w, self.spec.power.boost_cap_w
        parked = self._parked(held or {})
        watts = []
        for group in replica.stages:
            if not replica.limits(group):
                continue
            targets = self._rack_targets(group.domain, cap / base,
                                         parked.get(group.domain, frozenset()))
            watts += [targets[n].watts_for(i) for n, i in group.gpus[: replica.tp]]
        return max(1.0, min(watts, default=base) / base)


def node_domains(nodes: Iterable[Mapping[str, Any]], label: str) -> dict[str, str]:
    """Node name -> scale-up domain (its `label` value; a node without it is its own domain)."""
    out = {}
    for node in nodes:
        meta = node["metadata"]
        out[meta["name"]] = (meta.get("labels") or {}).get(label) or meta["name"]
    return out


def format_layout(degrees: Sequence[int]) -> str:
    """TP degree per replica, "8,7,8"; past the status field's 4096 characters (thousands of
    replicas) runs of equal degrees are written "8x1200,7,8x100", and what still does not fit
    ends in ",... (N replicas)"."""
    full = ",".join(map(str, degrees))
    if len(full) <= TP_LAYOUT_MAX:
        return full
    runs = [(tp, len(list(same))) for tp, same in groupby(degrees)]
    text = ",".join(str(tp) if n == 1 else f"{tp}x{n}" for tp, n in runs)
    if len(text) <= TP_LAYOUT_MAX:
        return text
    # Degrees that alternate do not run-length encode: the field shows what fits.
    tail = f",... ({len(degrees)} replicas)"
    return text[: TP_LAYOUT_MAX - len(tail)].rsplit(",", 1)[0] + tail


def racks_of(domains: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Scale-up domain -> its nodes (from node -> domain), in a canonical order."""
    return {d: tuple(sorted(n for n, dom in domains.items() if dom == d))
            for d in sorted(set(domains.values()))}


def budget_problem(spec: JobSpec, domains: Mapping[str, str]) -> Problem | None:
    """InvalidSpec when a domain's rack budget cannot hold the job's GPUs there at the device
    minimum: no plan could keep it, so the job must not take the GPUs at all."""
    if spec.power is None:
        return None
    for rack, nodes in racks_of(domains).items():
        try:
            spec.power.budget(len(nodes) * spec.gpus_per_node)
        except ValueError as exc:
            return Problem("InvalidSpec", f"powerPolicy.rackBudgetWatts: domain {rack}: {exc}")
    return None


def below_base_cap(spec: JobSpec, racks: Mapping[str, tuple[str, ...]]) -> str | None:
    """Why the job's GPUs run below their base cap with nothing failed: a rack budget smaller
    than its GPUs at the base cap (None when every budget holds them)."""
    policy = spec.power
    if policy is None or policy.rack_budget_w is None:
        return None
    for rack, nodes in racks.items():
        gpus = len(nodes) * spec.gpus_per_node
        if policy.rack_budget_w < gpus * policy.base_w:
            return (f"powerPolicy.rackBudgetWatts {policy.rack_budget_w} W holds domain {rack}'s "
                    f"{gpus} GPUs at {policy.rack_budget_w // gpus} W each, below baseCapWatts "
                    f"{policy.base_w} W: they run capped lower and no replica can be boosted")
    return None


def _slots(spec: JobSpec, racks: Mapping[str, tuple[str, ...]], failed: Set[GpuId],
           problems: list[Problem]) -> list[Group]:
    cap = spec.power.boost_cap_w / spec.power.base_w if spec.power else 1.0
    groups = []
    for rack, nodes in racks.items():
        gpus = [(n, i) for n in nodes for i in range(spec.gpus_per_node)]
        if len(gpus) < spec.tp:
            problems.append(Problem("DomainTooSmall", (
                f"scale-up domain {rack} has {len(gpus)} GPUs, fewer than tensorParallelSize "
                f"{spec.tp}; a TP group must stay inside one domain (label {spec.domain_label})")))
        for slot in range(len(gpus) // spec.tp):
            members = gpus[slot * spec.tp : (slot + 1) * spec.tp]
            alive = tuple(g for g in members if g not in failed)
            decision = decide_group(
                spec.shape, spec.tp, len(alive), min_tp=spec.min_tp_or_default,
                reshapes=spec.mode.reshapes, cap_ratio=cap)
            groups.append(Group(rack, slot, alive, tuple(g for g in members if g in failed),
                                decision))
    return groups


def plan(spec: JobSpec, domains: Mapping[str, str], failed: Set[GpuId]) -> JobPlan:
    """The desired layout for `spec` on nodes `domains` (node -> domain) with `failed` GPUs."""
    problems: list[Problem] = []
    # 1. Scale-up domains and their fixed group slots, in a canonical order.
    racks = racks_of(domains)
    groups = _slots(spec, racks, failed, problems)
    # 2. DROP keeps to the job's own groups; the other modes may use spare groups (CKPT-RESTART
    #    when an attempt starts: its layout never changes while it runs).
    if spec.mode is FailurePolicy.DROP:
        groups = groups[: spec.dp * spec.pp]
    position = {g: i for i, g in enumerate(groups)}
    # 3. Pack: healthiest groups first, so partially failed ones end up in the same replicas.
    usable = sorted((g for g in groups if g.decision.tp), key=lambda g: (-g.decision.tp,
                                                                       position[g]))
    chunks = [usable[i : i + spec.pp] for i in range(0, len(usable) - spec.pp + 1, spec.pp)]
    chunks = chunks[: spec.dp]
    # 4. Number replicas by where their groups sit, so a failure does not renumber the others.
    chunks.sort(key=lambda c: min(position[g] for g in c))
    replicas = []
    for index, chunk in enumerate(chunks):
        slowest = min(chunk, key=lambda g: g.decision.tp)
        stages = tuple(sorted(chunk, key=lambda g: position[g]))
        replicas.append(Replica(index, slowest.decision.tp, stages, slowest.decision.power_ratio))
    if len(replicas) < spec.dp and groups:
        reason = "ReplicasDropped" if any(g.failed for g in groups) else "InsufficientGPUs"
        problems.append(Problem(reason, (
            f"{len(replicas)} of {spec.dp} replicas can run: {len(usable)} usable TP groups "
            f"of {len(groups)} (pipelineParallelSize {spec.pp}, minimum TP "
            f"{spec.min_tp_or_default}, mode {spec.mode})")))
    used = {g for chunk in chunks for g in chunk}
    stranded = frozenset(gpu for g in groups if g.failed and g not in used for gpu in g.gpus)
    return JobPlan(spec, racks, frozenset(failed) & _all_gpus(spec, racks), tuple(replicas),
                   tuple(problems), stranded)


def _all_gpus(spec: JobSpec, racks: Mapping[str, tuple[str, ...]]) -> frozenset[GpuId]:
    return frozenset((n, i) for nodes in racks.values() for n in nodes
                     for i in range(spec.gpus_per_node))


# ----------------------------------------------------------------------------------------------
# The closed boost loop
# ----------------------------------------------------------------------------------------------

# A node's reported compute time is the mean over its ranks' recent steps (at most 20 of the
# generation they run, ntp.nodeagent.progress.RECENT_STEPS): a ratio moves again only once that many
# steps ran since it last moved, so one lag is not answered twice (and the agents have ramped).
SETTLE_STEPS = 20


@dataclass(frozen=True)
class Boost:
    """A reduced replica's boost as the closed loop left it (the job's status keeps it, so the
    loop survives operator restarts)."""

    ratio: float
    step: int  # the job step at which it was set


def follow_compute(
    plan: JobPlan,
    reports: Mapping[str, NodeReport | None],
    boosts: Mapping[ReplicaKey, Boost],
    held: Mapping[str, str] | None = None,
) -> JobPlan:
    """`plan` with each reduced replica's boost ratio stepped by the closed loop (NTP-PW).

    Data-parallel replicas wait for each other in the gradient sync, so their step times are
    equal; what differs is their compute time (forward, backward, optimizer), which each node
    reports (`NodeReport.compute_seconds`). A replica's is its slowest node's. A reduced
    replica's ratio (from `boosts`, else the open-loop seed the plan holds) moves by
    `power_planning.next_boost_ratio` on its compute time against the median of the healthy
    replicas', up to the boost cap and what its racks' budgets let its GPUs reach (`held` as
    for `JobPlan.power_targets`); it holds while any of its nodes or every healthy replica
    lacks a measurement (not training, or an agent that does not report one), and until
    SETTLE_STEPS steps ran at it.
    """
    power = plan.spec.power
    if power is None or plan.spec.mode is not FailurePolicy.NTP_PW:
        return plan
    measured = {n: r for n, r in reports.items()
                if r is not None and r.state is State.TRAINING and r.compute_seconds}

    def compute(replica: Replica) -> float | None:
        nodes = replica.nodes()
        if not nodes or any(n not in measured for n in nodes):
            return None
        return max(measured[n].compute_seconds or 0.0 for n in nodes)

    healthy = [c for r in plan.replicas
               if r.tp == plan.spec.tp and (c := compute(r)) is not None]
    now = max((r.step for r in measured.values()), default=0)
    cap = power.boost_cap_w / power.base_w
    replicas = []
    for replica in plan.replicas:
        if replica.tp >= plan.spec.tp:
            replicas.append(replica)
            continue
        known = boosts.get(replica.key())
        ratio, since = ((max(1.0, min(cap, known.ratio)), known.step) if known is not None
                        else (round(replica.power_ratio, 4), now))
        own = compute(replica)
        if own is not None and healthy and \
                min(measured[n].step for n in replica.nodes()) >= since + SETTLE_STEPS:
            top = min(cap, plan.reachable_ratio(replica, held))
            moved = round(next_boost_ratio(min(ratio, top), own, statistics.median(healthy),
                                           max_ratio=top), 4)
            if moved != ratio:
                ratio, since = moved, now
        replicas.append(replace(replica, power_ratio=ratio, ratio_step=since))
    return replace(plan, replicas=tuple(replicas))
