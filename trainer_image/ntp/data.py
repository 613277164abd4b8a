"""Deterministic synthetic token batches, identical for every layout and the dense reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ntp.dataset import TokenDataset
    from tessera_core.plan import ReplicaLayout


def synthetic_batch(vocab: int, seq_len: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """(batch, seq_len + 1) tokens of learnable arithmetic sequences (random start and stride)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def replica_rows(data: TokenDataset | None, replica: ReplicaLayout, first_sample: int,
                 global_batch: int, step: int, vocab: int, seq_len: int, seed: int
                 ) -> torch.Tensor:
    """A replica's rows of a step's global batch: the dataset's, that batch starting at global
    sample `first_sample`; without a dataset, the step's synthetic sequences."""
    if data is not None:
        return data.samples(first_sample + replica.batch_offset, replica.local_batch)
    tokens = synthetic_batch(vocab, seq_len, global_batch, step, seed)
    return tokens[replica.batch_offset : replica.batch_offset + replica.local_batch]


def split_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets."""
    return tokens[:, :-1], tokens[:, 1:]
