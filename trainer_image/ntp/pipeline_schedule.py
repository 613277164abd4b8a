"""One training step's forwards and backwards of a pipeline stage under 1F1B, with the hidden
states and their gradients passed between stages of any two TP degrees (point to point)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ntp.data import split_inputs
from ntp.pipeline_stage import StageRank
from tessera_core.stages import FORWARD, one_f_one_b


def _tag(micro_batch: int, backward: bool) -> int:
    return 2 * micro_batch + int(backward)


def forward_backward(stage: StageRank, rows: torch.Tensor, micro_batch: int | None
                     ) -> torch.Tensor:
    """The stage's part of one step over its replica's local batch `rows` (tokens with their
    next-token targets), in micro-batches of `micro_batch` sequences ordered by 1F1B.

    Each micro-batch's mean loss is weighted by its share of the rows, as in
    `ntp.train.Trainer.forward_backward`, so the gradients add up to the local batch's; the
    sync hooks start in the last micro-batch's backward, which is every stage's last step of
    1F1B. Returns the local batch's loss on the last stage (0 elsewhere); the sync is left to
    `stage.sync.finish()`.
    """
    # 1. Micro-batches: the same slices on every stage of the replica.
    inputs, targets = split_inputs(rows)
    size = micro_batch or len(rows)
    starts = list(range(0, len(rows), size))
    parts = [slice(s, s + size) for s in starts]
    n_stages, count = len(stage.pipe.layers), len(parts)
    hidden = stage.pipe.shape.hidden
    device = rows.device
    # 2. Forwards and backwards in this stage's 1F1B order. Sends never block (a stage sends
    #    while its neighbour sends back); a receive waits for its peer.
    sends: list[tuple[dist.Work, torch.Tensor]] = []  # with the tensor, alive until delivered
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
    loss = torch.zeros((), device=device)
    for kind, i in one_f_one_b(stage.stage, n_stages, count):
        part = parts[i]
        if kind == FORWARD:
            if stage.first:
                x = inputs[part]
            else:
                x = torch.empty(len(inputs[part]), inputs.shape[1], hidden, device=device)
                dist.recv(x, src=stage.previous_peer(), tag=_tag(i, False))
                x.requires_grad_(True)
            out = stage.forward(x)
            if stage.last:
                share = len(inputs[part]) / len(rows)
                out = stage.loss_fn(out, targets[part]) * share
                loss += out.detach()
            else:
                payload = out.detach().contiguous()
                sends += [(dist.isend(payload, dst=peer, tag=_tag(i, False)), payload)
                          for peer in stage.next_peers()]
            kept[i] = (x, out)
            continue
        x, out = kept.pop(i)
        with contextlib.nullcontext() if i == count - 1 else stage.sync.no_sync():
            if stage.last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=stage.gradient_peer(), tag=_tag(i, True))
                out.backward(grad)
        if not stage.first:
            assert x.grad is not None
            sends += [(dist.isend(x.grad, dst=peer, tag=_tag(i, True)), x.grad)
                      for peer in stage.gradient_receivers()]
    # 3. Every send delivered before the step's buffers are reused.
    for work, _ in sends:
        work.wait()
    return loss
