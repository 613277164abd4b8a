"""GPU power -> speed model calibrated to the NTP paper, shared by the simulated GPUs and simulator.

The paper reports perf/W dropping 2.8% at 1.1x power and 6.5% at 1.2x, i.e. about +6.9% and
+12.2% speed. We model the perf/W loss as a(r-1) + b(r-1)^2 through those two points, so
speed(r) = r * (1 - a(r-1) - b(r-1)^2) for a power ratio r against the baseline cap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PerfModel:
    """Relative speed as a function of power ratio against the baseline (uncapped-equivalent)
    cap."""

    a: float = 0.235
    b: float = 0.45

    def speedup(self, power_ratio: float) -> float:
        if power_ratio <= 0:
            raise ValueError(f"power ratio must be positive, got {power_ratio}")
        x = power_ratio - 1.0
        return power_ratio * (1.0 - self.a * x - self.b * x * x)

    def max_ratio(self) -> float:
        """The power ratio past which more power makes the GPU no faster (d speed / d r = 0)."""
        # d/dr [r(1 - a x - b x^2)] with x = r - 1 -> 1 - a x - b x^2 - r(a + 2 b x) = 0
        lo, hi = 1.0, 3.0
        for _ in range(80):
            mid = (lo + hi) / 2
            x = mid - 1.0
            slope = 1 - self.a * x - self.b * x * x - mid * (self.a + 2 * self.b * x)
            lo, hi = (mid, hi) if slope > 0 else (lo, mid)
        return lo

    def ratio_for_speedup(self, speedup: float) -> float:
        """Smallest power ratio that reaches `speedup`; raises if the model cannot reach it."""
        top = self.max_ratio()
        if speedup > self.speedup(top):
            peak = self.speedup(top)
            raise ValueError(f"speedup {speedup:.4f} is beyond the model's peak {peak:.4f}")
        lo, hi = 1e-6, top
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.speedup(mid) < speedup else (lo, mid)
        return hi

    def ratio_for_slowdown(self, slowdown: float, cap: float) -> float:
        """The power ratio at which a group whose step takes `slowdown` x longer at the baseline
        cap keeps pace with a healthy one; `cap` (or the model's peak, if lower) if it cannot.

        The one boost rule shared by the operator's power planning and the simulator's policies.
        """
        if slowdown <= 0 or cap <= 0:
            raise ValueError(f"slowdown and cap must be positive, got {slowdown}, {cap}")
        top = min(cap, self.max_ratio())
        if slowdown <= 1.0:
            return 1.0
        if slowdown >= self.speedup(top):
            return top
        return self.ratio_for_speedup(slowdown)


PAPER = PerfModel()
