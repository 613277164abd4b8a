"""Activation checkpointing leaves the loss and every gradient exactly as they are, and keeps
fewer activations (counted by autograd's own saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch

from ntp.activation_checkpointing import apply_activation_checkpointing
from ntp.data import split_inputs, synthetic_batch
from ntp.initialize import dense_model
from ntp.model import ModelArgs, cross_entropy_loss

pytestmark = pytest.mark.parity

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=128,
                 max_seq_len=32)


def run(mode: str) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, gradients and the bytes autograd saves for backward over one step."""
    model = dense_model(ARGS, seed=3)
    apply_activation_checkpointing(model, mode, every=2)
    inputs, targets = split_inputs(synthetic_batch(ARGS.vocab_size, ARGS.max_seq_len, 4, 0, 0))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_loss(model(inputs), targets)
    loss.backward()
    kept = sum(n for ptr, n in saved.items() if ptr not in params)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, kept


def test_recomputed_layers_give_the_same_loss_and_gradients_with_fewer_activations():
    loss, grads, kept = run("none")
    previous = kept
    for mode in ("selective", "full"):
        other_loss, other_grads, other_kept = run(mode)
        assert other_loss == loss
        for name, grad in grads.items():
            assert torch.equal(other_grads[name], grad), (mode, name)
        assert other_kept < previous, mode
        previous = other_kept


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of"):
        apply_activation_checkpointing(dense_model(ARGS), "some")
