"""The loss on the held-out split: every replica evaluates its share of the split (in proportion
to its share of the training batch, as `tessera_core.plan.split_batch` cuts it), forward only in
micro-batches, and the shares' weighted losses are summed over the job, so every layout
evaluates the same sequences to the same mean loss.

The split is the dataset's held-out windows (`ntp.dataset`, never trained on), or without a
dataset synthetic sequences of a seed no training step uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ntp.build import GenerationRank
from ntp.data import split_inputs, synthetic_batch
from ntp.dataset import TokenDataset
from tessera_core.plan import split_batch

# The synthetic split's "step": training steps count from 0.
HELD_OUT_STEP = -1


def held_out_rows(
    cur: GenerationRank, data: TokenDataset | None, samples: int, seed: int
) -> torch.Tensor:
    """This replica's share of the held-out split's `samples` sequences."""
    shares = split_batch(samples, [r.local_batch for r in cur.layout.replicas])
    replica = cur.groups.replica
    offset = sum(shares[:replica])
    if data is not None:
        return data.held_out_samples(offset, shares[replica])
    tokens = synthetic_batch(cur.args.vocab_size, cur.args.max_seq_len, samples, HELD_OUT_STEP,
                             seed)
    return tokens[offset : offset + shares[replica]]


def evaluate(
    cur: GenerationRank,
    rows: torch.Tensor,
    samples: int,
    micro_batch: int | None,
    device: torch.device,
    bf16: bool,
) -> float:
    """The mean next-token loss over the whole split (a collective over the job's world)."""
    inputs, targets = split_inputs(rows.to(device))
    size = micro_batch or len(rows)
    local = torch.zeros((), device=device)
    with torch.no_grad():
        for start in range(0, len(rows), size):
            part = slice(start, start + size)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = cur.model(inputs[part])
            local += cur.loss_fn(logits, targets[part]) * (len(inputs[part]) / samples)
    # Every rank of a replica computed its replica's share: its rank 0 adds it in.
    total = local if cur.groups.rank == 0 else torch.zeros_like(local)
    dist.all_reduce(total, group=cur.groups.world)
    return float(total)
