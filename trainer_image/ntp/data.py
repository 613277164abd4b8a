"""Deterministic synthetic token batches, identical for every layout and the dense reference."""

from __future__ import annotations

import torch


def synthetic_batch(vocab: int, seq_len: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """(batch, seq_len + 1) tokens of learnable arithmetic sequences (random start and stride)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def split_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets."""
    return tokens[:, :-1], tokens[:, 1:]
