"""What one TP group that lost GPUs does under a failure policy: its TP degree, slowdown and
power boost. The operator plans jobs with it and the simulator replays failures with it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_core.perf_model import PAPER, PerfModel
from tessera_core.plan import rank_layer_flops


# Each entry is one float keyed by a shape and a degree (about 1 kB with the key), so the cache
# stays under a megabyte however many distinct shapes the cluster runs.
@lru_cache(maxsize=512)
def _busiest_rank_flops(shape: ModelShape, tp: int) -> float:
    return max(rank_layer_flops(shape, tp))


def planned_slowdown(shape: ModelShape, healthy_tp: int, tp: int) -> float:
    """Step time of a replica at `tp` against one at `healthy_tp`, same batch and power: the
    busiest rank's per-layer FLOPs under tessera_core.plan's layouts (uneven heads, GQA copies)."""
    return _busiest_rank_flops(shape, tp) / _busiest_rank_flops(shape, healthy_tp)


@dataclass(frozen=True)
class GroupDecision:
    """What a TP group with some survivors does."""

    tp: int  # the TP degree it runs at; 0: not used
    slowdown: float  # step time at base power against a healthy group (inf when unused)
    power_ratio: float  # power of its survivors against the base cap
    speed: float  # relative speed after the boost (1.0 = healthy; 0 when unused)


UNUSED = GroupDecision(0, float("inf"), 1.0, 0.0)


def decide_group(
    shape: ModelShape,
    healthy_tp: int,
    survivors: int,
    *,
    min_tp: int,
    reshapes: bool = True,
    cap_ratio: float = 1.0,
    perf: PerfModel = PAPER,
) -> GroupDecision:
    """The decision for one group: uniform policies use only whole groups; NTP runs at the
    survivors' degree down to `min_tp`, boosted by the shared rule up to `cap_ratio` x base."""
    if survivors >= healthy_tp:
        return GroupDecision(healthy_tp, 1.0, 1.0, 1.0)
    if not reshapes or survivors < max(1, min_tp):
        return UNUSED
    try:
        slowdown = planned_slowdown(shape, healthy_tp, survivors)
    except PlanError:
        return UNUSED
    ratio = perf.ratio_for_slowdown(slowdown, cap_ratio)
    return GroupDecision(survivors, slowdown, ratio, min(1.0, perf.speedup(ratio) / slowdown))
