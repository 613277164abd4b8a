"""Turn a dense Transformer into one rank's nonuniform tensor-parallel shard."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ntp.layers import (
    VocabParallelEmbedding,
    copy_to_tp,
    reduce_from_tp,
    vocab_lookup,
    vocab_parallel_cross_entropy,
)
from ntp.model import Transformer
from ntp.sharding import local_positions, local_shape
from tessera_core.plan import RankShard

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner_name), leaf, nn.Parameter(value))


def apply_ntp(model: Transformer, shard: RankShard, group: ProcessGroup) -> LossFn:
    """Give `model` (built on the meta device) `shard`'s local parameter shapes, and return the
    matching loss function. `ntp.initialize` allocates and fills them afterwards: no rank
    holds the dense weights.
    """
    shape = model.args.shape()
    # 1. Every parameter takes this rank's local shape (replicated ones keep theirs).
    for name, p in list(model.named_parameters()):
        local = local_shape(shape, name, p.shape, shard)
        _set_parameter(model, name, torch.empty(local, dtype=p.dtype, device=p.device))
    # 2. Local query heads read their KV head from this rank's copies.
    kv_index = torch.tensor(
        local_positions(shard.kv_heads, [shape.kv_of(h) for h in shard.q_heads]), dtype=torch.long
    )
    for layer in model.layers:
        layer.attention.kv_index = kv_index.clone()
    # 3. Vocabulary-parallel embedding (the LM head is already its row slice; a tied head is
    #    the embedding's parameter again, so both uses add into one gradient).
    rows = torch.tensor(shard.vocab_rows, dtype=torch.long)
    model.tok_embeddings = VocabParallelEmbedding(
        model.tok_embeddings.weight.data, rows, shape.vocab, group
    )
    if model.args.tied_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # 4. TP regions: replicated input in, partial outputs summed out.
    for layer in model.layers:
        for block in (layer.attention, layer.feed_forward):
            block.register_forward_pre_hook(
                lambda _m, args: (copy_to_tp(args[0], group), *args[1:])
            )
            block.register_forward_hook(lambda _m, _args, out: reduce_from_tp(out, group))
    model.output.register_forward_pre_hook(lambda _m, args: (copy_to_tp(args[0], group),))
    # The loss reads the lookup from the model so it follows the model to its device.
    model.output.register_buffer("vocab_lookup", vocab_lookup(rows, shape.vocab), persistent=False)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, model.output.vocab_lookup, group)

    return loss_fn
