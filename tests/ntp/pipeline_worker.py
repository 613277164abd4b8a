"""One rank of a pipeline test job (tests/ntp/test_pipeline.py): one 1F1B step, its loss and
its synchronized gradients back to the test. Imports only what a rank needs, so that ranks
fork fast from a preloaded server."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ntp.model import ModelArgs
from ntp.pipeline_schedule import forward_backward
from ntp.pipeline_stage import build_stage
from tessera_core.stages import PipelineLayout

SEED = 5


def run_rank(rank: int, world: int, port: int, doc: dict, args: dict, rows: torch.Tensor,
            micro_batch: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        pipe = PipelineLayout.from_dict(doc)
        stage = build_stage(pipe, ModelArgs(**args), torch.device("cpu"), SEED,
                            timeout=timedelta(seconds=120), bucket_elements=2000)
        rep = pipe.stages[stage.stage].replicas[stage.groups.replica]
        local = rows[rep.batch_offset : rep.batch_offset + rep.local_batch]
        loss = forward_backward(stage, local, micro_batch)
        stage.sync.finish()
        grads = {n: p.grad for n, p in stage.model.named_parameters()}
        # Serialized whole: a tensor through the queue would be shared memory this process
        # takes with it when it exits.
        buffer = io.BytesIO()
        torch.save((rank, float(loss), grads), buffer)
        results.put(buffer.getvalue())
    finally:
        dist.destroy_process_group()
