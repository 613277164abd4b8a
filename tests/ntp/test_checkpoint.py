"""Loading a dense checkpoint checks every tensor's shape against the model before writing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ntp.checkpoint import MOMENTS, load_checkpoint
from ntp.model import FLAVORS, build_model
from tessera_core.plan import plan_replica

ARGS = FLAVORS["debug"]
SHAPE = ARGS.shape()
WHOLE = plan_replica(SHAPE, 1)[0]  # TP 1: the dense model is its own shard


def checkpoint_of(args) -> dict:
    model = build_model(args, seed=1)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {m: {n: torch.rand_like(t) for n, t in named.items()} for m in MOMENTS}
    return {"model": named, "optimizer": moments | {"step": 3.0}}


@pytest.mark.parametrize(
    ("change", "culprit"),
    [({"vocab_size": 80}, "tok_embeddings.weight"), ({"ffn_dim": 56}, "w1.weight")],
)
def test_a_checkpoint_of_another_shape_is_refused_and_nothing_is_written(change, culprit):
    model = build_model(ARGS, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bigger = checkpoint_of(dataclasses.replace(ARGS, **change))
    with pytest.raises(ValueError, match=rf"{culprit}.* has shape .* this model needs"):
        load_checkpoint(model, None, bigger, SHAPE, WHOLE)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_moment_of_another_shape_is_refused():
    model = build_model(ARGS, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    state = checkpoint_of(ARGS)
    state["optimizer"]["exp_avg_sq"]["output.weight"] = torch.zeros(80, ARGS.dim)
    with pytest.raises(ValueError, match="exp_avg_sq 'output.weight' has shape"):
        load_checkpoint(model, opt, state, SHAPE, WHOLE)


def test_a_matching_checkpoint_loads_weights_and_moments():
    model = build_model(ARGS, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    state = checkpoint_of(ARGS)
    load_checkpoint(model, opt, state, SHAPE, WHOLE)
    for n, p in model.named_parameters():
        assert torch.equal(p, state["model"][n])
        assert torch.equal(opt.state[p]["exp_avg"], state["optimizer"]["exp_avg"][n])
