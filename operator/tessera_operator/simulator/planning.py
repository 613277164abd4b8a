"""The one place the simulator asks the NTP planner how long a reduced TP group takes.

Tessera's policy does not assume the ideal N1/N2 slowdown: it plans the replica at both degrees
with `ntp.plan` and compares the busiest rank's per-layer FLOPs, which includes the uneven split
of whole heads and the KV copies GQA needs. Plans are cached per (shape, degree) because planning
a 480B-class shape takes a noticeable fraction of a second.
"""

from __future__ import annotations

from functools import lru_cache

from ntp import plan


@lru_cache(maxsize=512)
def busiest_rank_flops(shape: plan.ModelShape, tp: int) -> float:
    """Per-layer forward FLOPs of the busiest rank when one replica runs at TP degree `tp`."""
    return max(plan.layer_flops(shape, shard) for shard in plan.plan_replica(shape, tp))


def slowdown(shape: plan.ModelShape, healthy_tp: int, reduced_tp: int) -> float:
    """Step time at `reduced_tp` relative to `healthy_tp`, for the same batch and power."""
    return busiest_rank_flops(shape, reduced_tp) / busiest_rank_flops(shape, healthy_tp)
