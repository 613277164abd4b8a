"""The dense model against an independently written reference: forward, loss and every gradient."""

from __future__ import annotations

import dataclasses

import llama_reference as ref
import pytest
import torch
from rounding import rounding_bound

from ntp.initialize import dense_model
from ntp.model import FLAVORS, ModelArgs, Transformer, cross_entropy_loss

SHAPES = {
    "debug flavor": FLAVORS["debug"],
    # outside every other test: 10 query heads on 2 KV heads (groups of 5), head_dim 4, an FFN
    # and a prime vocabulary that no TP degree splits evenly, 3 layers, another eps and theta
    "10q/2kv heads, vocab 61": ModelArgs(
        dim=40,
        n_layers=3,
        n_heads=10,
        n_kv_heads=2,
        ffn_dim=52,
        vocab_size=61,
        max_seq_len=11,
        norm_eps=1e-6,
        rope_theta=10000.0,
    ),
}
BATCH = 3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", list(SHAPES))
def test_model_matches_an_independent_reference_with_every_parameter_random(name, capsys):
    args = SHAPES[name]
    cfg = ref.Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ref.Config)})
    params = ref.random_params(cfg, seed=7)
    model = Transformer(args).double()
    model.load_state_dict(params)  # strict: the names and shapes agree one to one
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, args.vocab_size, (BATCH, args.max_seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    logits = model(inputs)
    loss = cross_entropy_loss(logits, targets)
    loss.backward()
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    want_logits = ref.forward(leaves, cfg, inputs)
    want_loss = ref.cross_entropy(want_logits, targets)
    want_loss.backward()

    bound = rounding_bound(args, BATCH)
    assert logits.dtype == torch.float64
    errors = {"logits": rel_err(logits.detach(), want_logits.detach())}
    errors["loss"] = rel_err(loss.detach(), want_loss.detach())
    for n, p in model.named_parameters():
        errors[n] = rel_err(p.grad, leaves[n].grad)
    assert errors.keys() == {"logits", "loss"} | params.keys()
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= bound, (worst, errors[worst], bound)
    with capsys.disabled():
        print(
            f"\n[{name}] float64: logits {errors['logits']:.1e}, loss {errors['loss']:.1e},"
            f" worst gradient {max(v for k, v in errors.items() if '.' in k):.1e}"
            f" (bound {bound:.1e})"
        )


def test_seeded_init_is_reproducible_and_seed_dependent():
    a, b, c = (dense_model(FLAVORS["debug"], seed=s) for s in (1, 1, 2))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
