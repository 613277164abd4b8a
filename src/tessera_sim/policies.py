"""Recovery policies: how much of the healthy job's throughput each keeps for a set of failed GPUs.

Every policy reduces to two choices, evaluated on the survivors of each TP group:
- the relative speed of a TP group with s working GPUs (0 = the group cannot be used), and
- how groups form DP replicas: replicas keep their groups while all of them are usable; the
  usable groups of broken replicas (plus spares, for the spares policy) regroup into new
  replicas, in their order (`fixed`) or sorted by speed so partially failed groups share as few
  replicas as possible (`packed`, Tessera's placement), or stay idle (`regroup` off: a broken
  replica is dropped whole). Regrouping ignores pipeline stages unless `stage_aware`: then a new
  replica takes exactly one group of each stage (spare groups may take any stage).
A replica runs at the speed of its slowest group (pipeline stages advance in lockstep); the job's
throughput is the sum of its at most DP best replicas, normalised to DP healthy replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera_core import group_decision
from tessera_core.perf_model import PAPER, PerfModel
from tessera_sim.config import SimConfig

POLICY_NAMES: tuple[str, ...] = (
    "ckpt-restart", "dp-drop", "dp-drop-unpacked", "spares", "ntp", "ntp-pw", "tessera",
)  # fmt: skip


@dataclass(frozen=True)
class Capacity:
    """A policy's throughput for one failure state."""

    # Share of the healthy job's throughput (the replicas actually formed).
    throughput: float
    # Missing throughput in TP-group equivalents if partial replicas could be completed from
    # standby hardware: what a fixed mini-batch needs in spares.
    deficit_groups: float
    # Power above the baseline caps drawn by boosted survivors, as a share of the job's baseline
    # (every usable reduced group counted as boosted: an upper bound when some sit idle).
    extra_power: float
    # The highest draw of one usable TP group against its healthy budget (tp x baseline cap):
    # above 1.0 the rack must deliver more than the group's own share.
    peak_group_power: float


@dataclass(frozen=True)
class Policy:
    """One recovery policy, as data."""

    name: str
    summary: str
    # speed[s]: relative step speed of a TP group with s working GPUs, 0 if unusable.
    speed: np.ndarray
    # power[s]: power ratio (vs the baseline cap) its survivors run at.
    power: np.ndarray
    packed: bool = False
    # Whether the usable groups of broken replicas form new replicas at all.
    regroup: bool = True
    # Whether a regrouped replica must take one group of each pipeline stage.
    stage_aware: bool = False
    uses_spares: bool = False
    # Whether a usable group runs at its survivors' TP degree (NTP) rather than only at full TP.
    reshapes: bool = False
    # Whole-job pause when a failure / a repair changes the layout of a group it uses.
    failure_stall_s: float = 0.0
    repair_stall_s: float = 0.0

    def layout(self, survivors: int) -> int:
        """The TP degree a group with `survivors` working GPUs runs at; 0 if it is not used."""
        if self.speed[survivors] <= 0:
            return 0
        return survivors if self.reshapes else len(self.speed) - 1

    def evaluate(self, survivors: np.ndarray, dp: int, pp: int) -> tuple[Capacity, np.ndarray]:
        """Throughput for per-group survivor counts (job groups first, then spare groups), and
        which groups (over all of them) serve in a formed replica."""
        job = dp * pp
        tp = len(self.speed) - 1
        counted = survivors if self.uses_spares else survivors[:job]
        speed = self.speed[counted]
        usable = speed > 0
        alive = counted[usable]
        boosted = alive * self.power[alive]
        replicas, rest = self._replicas(speed, usable, dp, pp)
        rates = speed[replicas].min(axis=1)
        if len(rates) > dp:
            best = np.argsort(-rates, kind="stable")[:dp]
            replicas, rates = replicas[best], rates[best]
        formed = float(rates.sum())
        incomplete = len(rest) > 0 and len(rates) < dp
        partial = len(rest) / pp * float(speed[rest].min()) if incomplete else 0.0
        completed = min(float(dp), formed + partial)
        in_use = np.zeros(len(survivors), dtype=bool)
        in_use[replicas.ravel()] = True
        capacity = Capacity(
            throughput=formed / dp,
            deficit_groups=(dp - completed) * pp,
            extra_power=float((boosted - alive).sum()) / (job * tp),
            peak_group_power=float(boosted.max()) / tp if len(alive) else 0.0,
        )
        return capacity, in_use

    def _replicas(
        self, speed: np.ndarray, usable: np.ndarray, dp: int, pp: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(replicas as rows of `pp` group indices, usable groups left out of every replica)."""
        job = dp * pp
        if self.packed:
            kept = np.empty((0, pp), dtype=int)
            pool = np.flatnonzero(usable)
        else:
            rows = np.arange(job).reshape(dp, pp)
            intact = usable[rows].all(axis=1)
            kept = rows[intact]
            pool = np.concatenate([rows[~intact].ravel(), np.arange(job, len(speed))])
            pool = pool[usable[pool]]
        if not self.regroup:
            return kept, pool
        if self.packed:
            pool = pool[np.argsort(-speed[pool], kind="stable")]
        if self.stage_aware:
            new, rest = _stage_rows(pool, job, pp)
        else:
            full = len(pool) // pp
            new, rest = pool[: full * pp].reshape(full, pp), pool[full * pp :]
        return np.concatenate([kept, new]), rest


def _stage_rows(pool: np.ndarray, job: int, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """Replicas of one job group per stage from `pool` (in its order of preference); spare groups
    (index >= `job`) fill any stage a replica still lacks. Returns (replicas, groups left)."""
    is_job = pool < job
    mine, spare = pool[is_job], pool[~is_job]
    stage = mine % pp
    count = np.bincount(stage, minlength=pp)
    # The most replicas whose stages, each short of its own groups, spares can complete.
    sizes = np.arange(len(pool) // pp + 1)
    short = np.maximum(sizes[:, None] - count[None, :], 0).sum(axis=1)
    n = int(sizes[short <= len(spare)].max())
    # Rank of each group within its stage, in the pool's order (stable sort by stage).
    order = np.argsort(stage, kind="stable")
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    rank = np.empty(len(mine), dtype=int)
    rank[order] = np.arange(len(mine)) - first[stage[order]]
    rows = np.full((n, pp), -1, dtype=int)
    taken = rank < n
    rows[rank[taken], stage[taken]] = mine[taken]
    holes = rows == -1
    used_spares = int(holes.sum())
    rows[holes] = spare[:used_spares]
    return rows, np.concatenate([mine[~taken], spare[used_spares:]])


def _boosted(
    slowdown: np.ndarray, headroom: float, perf: PerfModel
) -> tuple[np.ndarray, np.ndarray]:
    """Speed and power ratio of groups whose step takes `slowdown` x longer at baseline power,
    boosted by the operator's rule within 1 + `headroom`."""
    power = np.array([perf.ratio_for_slowdown(s, 1.0 + headroom) for s in slowdown])
    speed = np.minimum(1.0, np.array([perf.speedup(r) for r in power]) / slowdown)
    return speed, power


def build_policies(cfg: SimConfig, perf: PerfModel = PAPER) -> tuple[Policy, ...]:
    """The policies compared on the same failure trace, in POLICY_NAMES order."""
    tp, min_tp, p = cfg.tp, cfg.min_tp, cfg.policy
    survivors = np.arange(tp + 1)
    usable = survivors >= min_tp
    uniform = (survivors == tp).astype(float)
    baseline = np.ones(tp + 1)
    ideal = np.array([tp / s if s >= min_tp else np.inf for s in range(tp + 1)])
    pw_speed, pw_power = _boosted(ideal, p.power_headroom, perf)
    # Tessera's groups decide exactly as the operator's planner does.
    tessera = [
        group_decision.decide_group(cfg.model.shape, tp, s, min_tp=min_tp,
                             cap_ratio=1.0 + p.power_headroom, perf=perf)
        for s in range(tp + 1)
    ]
    # A restart reloads every group from the checkpoint, so only the live policies keep stages.
    stages = {"stage_aware": p.stage_aware_regroup}
    live = {"failure_stall_s": p.reconfigure_seconds, "repair_stall_s": p.reconfigure_seconds}
    ntp_live = {**live, "reshapes": True}
    restart = 60 * p.restart_minutes + p.lost_work_s
    return (
        Policy(
            "ckpt-restart",
            "uniform TP; each failure restarts the job from its last checkpoint on intact groups",
            uniform,
            baseline,
            failure_stall_s=restart,
        ),
        Policy(
            "dp-drop",
            "uniform TP; hit replicas are dropped live and their intact groups regroup (packed)",
            uniform,
            baseline,
            **live,
            **stages,
        ),
        Policy(
            "dp-drop-unpacked",
            "uniform TP; a hit replica is dropped live, whole: its intact groups stay idle",
            uniform,
            baseline,
            regroup=False,
            **live,
        ),
        Policy(
            "spares",
            f"uniform TP; {p.spare_domains} hot standby domains replace hit groups",
            uniform,
            baseline,
            uses_spares=True,
            failure_stall_s=p.spare_swap_seconds,
            **stages,
        ),
        Policy(
            "ntp",
            "reduced TP with the local batch shrunk to the ideal N2/N1 share",
            np.where(usable, survivors / tp, 0.0),
            baseline,
            **ntp_live,
            **stages,
        ),
        Policy(
            "ntp-pw",
            "reduced TP, survivors power-boosted within the headroom (ideal N1/N2 work)",
            np.where(usable, pw_speed, 0.0),
            pw_power,
            **ntp_live,
            **stages,
        ),
        Policy(
            "tessera",
            "NTP-PW on the planner's per-rank work; hit groups packed into few replicas",
            np.array([d.speed for d in tessera]),
            np.array([d.power_ratio for d in tessera]),
            packed=True,
            **ntp_live,
            **stages,
        ),
    )
