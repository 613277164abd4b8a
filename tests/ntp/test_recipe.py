"""The training recipe: learning-rate schedules against torch's own schedulers, and which
parameters weight decay applies to."""

from __future__ import annotations

import pytest
import torch

from ntp.model import FLAVORS, Transformer
from ntp.recipe import Schedule, parameter_groups

pytestmark = pytest.mark.parity

STEPS, WARMUP, LR, FLOOR = 40, 5, 1e-3, 0.1


def torch_rates(schedulers: list, milestones: list[int]) -> list[float]:
    """The rate torch's chained schedulers give each of STEPS optimizer steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    chain = torch.optim.lr_scheduler.SequentialLR(
        opt, [make(opt) for make in schedulers], milestones=milestones)
    rates = []
    for _ in range(STEPS):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        chain.step()
    return rates


def test_warmup_then_cosine_is_torchs():
    ours = Schedule("cosine", warmup_steps=WARMUP, min_ratio=FLOOR)
    expected = torch_rates([
        lambda o: torch.optim.lr_scheduler.LinearLR(o, 1 / WARMUP, 1.0, WARMUP - 1),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, STEPS - WARMUP, LR * FLOOR),
    ], [WARMUP])
    assert [LR * ours.factor(s, STEPS) for s in range(STEPS)] == pytest.approx(expected,
                                                                                rel=1e-9)


def test_warmup_then_constant_is_torchs():
    ours = Schedule("constant", warmup_steps=WARMUP)
    expected = torch_rates([
        lambda o: torch.optim.lr_scheduler.LinearLR(o, 1 / WARMUP, 1.0, WARMUP - 1),
        lambda o: torch.optim.lr_scheduler.ConstantLR(o, 1.0, 0),
    ], [WARMUP])
    assert [LR * ours.factor(s, STEPS) for s in range(STEPS)] == pytest.approx(expected,
                                                                                rel=1e-9)


def test_warmup_stable_decay_holds_then_falls_linearly_to_the_floor():
    decay = 10
    wsd = Schedule("wsd", warmup_steps=WARMUP, decay_steps=decay, min_ratio=FLOOR)
    rates = [wsd.factor(s, STEPS) for s in range(STEPS)]
    assert rates[:WARMUP] == pytest.approx([(s + 1) / WARMUP for s in range(WARMUP)])
    assert rates[WARMUP:STEPS - decay] == [1.0] * (STEPS - decay - WARMUP)
    falling = rates[STEPS - decay:]
    steps = [a - b for a, b in zip([1.0, *falling], falling, strict=False)]
    assert steps == pytest.approx([(1 - FLOOR) / decay] * decay)
    assert falling[-1] == pytest.approx(FLOOR)


def test_bad_schedules_are_refused():
    for bad in (dict(kind="linear"), dict(warmup_steps=-1), dict(min_ratio=1.5)):
        with pytest.raises(ValueError):
            Schedule(**bad)


def test_weight_decay_leaves_norms_and_embeddings_alone_unless_asked():
    model = Transformer(FLAVORS["debug"])
    named = list(model.named_parameters())
    decayed, kept = parameter_groups(named, 0.1, decay_all=False)
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert "tok_embeddings.weight" in kept["names"]
    assert all("norm" in n for n in kept["names"] if n != "tok_embeddings.weight")
    assert "output.weight" in decayed["names"]
    assert all(p.dim() == 2 for p in decayed["params"])
    assert sorted(decayed["names"] + kept["names"]) == sorted(n for n, _ in named)
    [everything] = parameter_groups(named, 0.1, decay_all=True)
    assert everything["names"] == [n for n, _ in named]
