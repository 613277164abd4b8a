"""How far AdamW's weights and moments may drift when every step's gradient is off by a known bound.

Two runs see gradients g_t and g'_t with |g'_t - g_t| <= d_t elementwise (rounding: another
summation order, another sharding). torch's AdamW (weight decay l, step t, bias corrections
c1 = 1 - b1^t, c2 = 1 - b2^t) keeps

    m_t = b1 m + (1 - b1) g,   v_t = b2 v + (1 - b2) g^2,
    w_t = (1 - lr l) w - lr u,  u = mh / (s + eps),  mh = m_t / c1,  s = sqrt(v_t / c2).

mh is a weighted mean of g_1..g_t and s a weighted root mean square (weights a_i and b_i summing
to one), so |mh' - mh| <= Em (the same weighted mean of d) and, by the triangle inequality of
the weighted 2-norm, |s' - s| <= Es (the weighted RMS of d). Then, since s' >= max(s - Es, 0),

    |u' - u| <= (Em + |u| Es) / (max(s - Es, 0) + eps),

and in any case |u' - u| <= |u| + C_t, where C_t = sqrt(sum a_i^2 / b_i) bounds |mh| / s
(Cauchy-Schwarz). The first form is tight where the gradient stands well above its error; the
second caps the steps where it does not: there Adam's division by s turns rounding into up to a
whole step (lr), which no relative tolerance on the weights can absorb for every shape. Weight
decay only shrinks a difference, so |w'_T - w_T| <= lr sum_t |u'_t - u_t|, and the moments obey
|m'_T - m_T| <= c1 Em and |v'_T - v_T| <= c2 Es (2 s + Es).

Each run also rounds its own float32 optimizer arithmetic: at most one unit roundoff per operation
on the stored value, about four per step (w: decay and the update, whose own quotient is computed
to a few roundoffs of lr |u|; m: the interpolation; v: scale and add), in both runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

FLOAT32_ROUNDING = 2.0**-24
OPS_PER_STEP = 4  # roundings of each stored quantity per optimizer step, as counted above

# name -> (weight, exp_avg, exp_avg_sq) after one step
State = Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def direction_cap(step: int, beta1: float, beta2: float) -> float:
    """C_t = sqrt(sum_i a_i^2 / b_i): the largest |mh| / s any gradient history can give."""
    c1, c2 = 1 - beta1**step, 1 - beta2**step
    ratio = sum((beta1 * beta1 / beta2) ** k for k in range(step))
    return math.sqrt((1 - beta1) ** 2 / (1 - beta2) * c2 / c1**2 * ratio)


def adamw_state_bounds(
    states: Sequence[State],
    grad_errors: Sequence[Mapping[str, torch.Tensor]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    first_step: int = 1,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Elementwise bounds on the difference of (weight, exp_avg, exp_avg_sq) after the last step.

    Both runs hold equal state before optimizer step `first_step` (1: from scratch);
    `states[i]` is the reference run's state after step first_step + i and `grad_errors[i]` the
    bound d on that step's gradient error (absolute, elementwise).
    """
    beta1, beta2 = betas
    bounds = {}
    for name in states[0]:
        # errors before first_step are zero, so the moments' error averages start at zero
        em = ev = drift = rounded_w = rounded_m = rounded_v = 0.0
        for i, (state, error) in enumerate(zip(states, grad_errors, strict=True)):
            t = first_step + i
            d = error[name].double()
            w, m, v = (x.double() for x in state[name])
            c1, c2 = 1 - beta1**t, 1 - beta2**t
            em = beta1 * em + (1 - beta1) * d
            ev = beta2 * ev + (1 - beta2) * d * d
            mean_err, rms_err = em / c1, torch.sqrt(ev / c2)
            s = torch.sqrt(v / c2)
            u = (m / c1) / (s + eps)
            conditioned = (mean_err + u.abs() * rms_err) / ((s - rms_err).clamp_min(0) + eps)
            capped = u.abs() + direction_cap(t, beta1, beta2)
            drift = drift + lr * torch.minimum(conditioned, capped)
            rounded_w = rounded_w + w.abs() + lr * u.abs()
            rounded_m = rounded_m + m.abs()
            rounded_v = rounded_v + v.abs()
        rounding = 2 * OPS_PER_STEP * FLOAT32_ROUNDING
        bounds[name] = (
            drift + rounding * rounded_w,
            c1 * mean_err + rounding * rounded_m,
            c2 * rms_err * (2 * s + rms_err) + rounding * rounded_v,
        )
    return bounds
