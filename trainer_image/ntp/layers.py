"""Tensor-parallel building blocks: TP-region autograd ops, vocab-parallel embedding and loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ntp.model import at_least_fp32


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums partial outputs over the TP group; backward passes the gradient through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


def vocab_lookup(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Local row of every global token id, -1 where another rank holds it."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.long)
    lookup[rows] = torch.arange(len(rows))
    return lookup


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (any subset of the vocabulary) are spread over the TP group."""

    def __init__(
        self, weight: torch.Tensor, rows: torch.Tensor, vocab_size: int, group: ProcessGroup
    ) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.register_buffer("lookup", vocab_lookup(rows, vocab_size), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = self.lookup[tokens]
        missing = (local < 0).unsqueeze(-1)
        out = F.embedding(local.clamp(min=0), self.weight).masked_fill(missing, 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over logits whose vocabulary columns are spread over the group."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        lookup: torch.Tensor,
        group: ProcessGroup,
    ) -> torch.Tensor:
        # logits: (tokens, local_vocab) fp32; targets: (tokens,) global ids
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = lookup[targets]
        mine = local_target >= 0
        rows = torch.arange(len(targets), device=logits.device)
        target_logit = shifted[rows, local_target.clamp(min=0)] * mine
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(target_logit, group=group)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(len(local_target), device=softmax.device)
        grad_logits[rows, local_target.clamp(min=0)] -= mine.to(softmax.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, lookup: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """Mean next-token loss; equals the dense cross entropy of the gathered logits."""
    flat = at_least_fp32(logits.flatten(0, 1))
    if dist.get_world_size(group) == 1:
        return F.cross_entropy(flat, targets.flatten())
    return _VocabParallelCrossEntropy.apply(flat, targets.flatten(), lookup, group).mean()
