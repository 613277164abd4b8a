"""Pipeline stages with nonuniform TP per stage, in real gloo processes: one 1F1B step's loss
and every rank's synchronized gradients against the independent dense reference."""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing as mp
import queue
from collections.abc import Sequence
from pathlib import Path

import llama_reference as ref
import pipeline_worker
import pytest
import torch
import torch.distributed as dist
from test_parity import LR, adamw, dense_steps, excess, grad_bounds, unit_slices

from ntp.data import split_inputs, synthetic_batch
from ntp.initialize import dense_model
from ntp.launch import launch_local
from ntp.model import FLAVORS, ModelArgs
from tessera_core.stages import Layers, PipelineLayout, plan_pipeline

pytestmark = pytest.mark.pipeline

SEED = pipeline_worker.SEED
# test_parity's unit arithmetic assumes the debug flavor's heads; only the depth differs here.
DEBUG = FLAVORS["debug"]


def _run(pipe: PipelineLayout, args: ModelArgs, rows: torch.Tensor, micro_batch: int
         ) -> dict[int, tuple[float, dict[str, torch.Tensor]]]:
    """Every world rank's (loss, gradients) after one step, each rank its own process."""
    ctx = mp.get_context("forkserver")
    # Ranks fork with torch and the trainer's pipeline already imported.
    ctx.set_forkserver_preload(["pipeline_worker"])
    store = dist.TCPStore("127.0.0.1", 0, pipe.world_size + 1, is_master=True,
                          wait_for_workers=False)
    results = ctx.Queue()
    job = (pipe.world_size, store.port, pipe.to_dict(), dataclasses.asdict(args), rows,
           micro_batch, results)
    procs = [ctx.Process(target=pipeline_worker.run_rank, args=(g, *job))
             for g in range(pipe.world_size)]
    for p in procs:
        p.start()
    out = {}
    while len(out) < len(procs):
        # Waits for a rank's result or a rank's death (no clock decides the outcome).
        try:
            rank, loss, grads = torch.load(io.BytesIO(results.get(timeout=1.0)))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
            continue
        out[rank] = (loss, grads)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return out


def _dense(args: ModelArgs, rows: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference's loss and gradients in float64 from the seeded initial weights."""
    cfg = ref.Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ref.Config)})
    leaves = {n: p.detach().double().requires_grad_()
              for n, p in dense_model(args, SEED).named_parameters()}
    inputs, targets = split_inputs(rows)
    loss = ref.cross_entropy(ref.forward(leaves, cfg, inputs), targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in leaves.items()}


def _check(layers: Sequence[Layers], degrees: Sequence[Sequence[int]], global_batch: int,
           micro_batch: int) -> None:
    args = dataclasses.replace(DEBUG, n_layers=layers[-1][1])
    pipe = plan_pipeline(args.shape(), layers, degrees, global_batch)
    rows = synthetic_batch(args.vocab_size, args.max_seq_len, global_batch, 0, SEED)
    got = _run(pipe, args, rows, micro_batch)
    want_loss, want = _dense(args, rows)
    bounds = grad_bounds(want)
    last = len(layers) - 1
    # The global loss: each replica's last stage holds its local batch's mean.
    total = 0.0
    for rep in pipe.stages[last].replicas:
        loss = got[pipe.world_rank(last, rep.index, 0)][0]
        total += loss * pipe.stages[last].sample_weight(rep.index)
    assert total == pytest.approx(want_loss, rel=1e-6)
    # Every rank's gradients, unit by unit, against its slices of the dense ones; each stage
    # holds exactly its own layers' parameters (the embedding first, the head last).
    worst = 0.0
    for k, layout in enumerate(pipe.stages):
        start, stop = layers[k]
        names = {n for n in want if n.startswith("layers.")
                 and start <= int(n.split(".")[1]) < stop}
        names |= {"tok_embeddings.weight"} if k == 0 else set()
        names |= {"norm.weight", "output.weight"} if k == last else set()
        for rep in layout.replicas:
            for j, shard in enumerate(rep.shards):
                grads = got[pipe.world_rank(k, rep.index, j)][1]
                assert grads.keys() == names
                for name, local in grads.items():
                    for g, w, b in unit_slices(name, shard, local, want[name], bounds[name]):
                        worst = max(worst, excess(g, w, b))
    assert worst <= 1.0, worst


def test_pp2_with_a_degraded_stage_in_one_replica_matches_the_dense_model() -> None:
    # PP2 x DP2: replica 0 at TP 2 in both stages, replica 1 lost a GPU in stage 1 (TP 2, 1);
    # 3 micro-batches each, so 1F1B overlaps forwards and backwards across the stages.
    _check(((0, 2), (2, 4)), [(2, 2), (2, 1)], global_batch=9, micro_batch=2)


def test_pp3_with_uneven_stages_matches_the_dense_model() -> None:
    # PP3 over 5 layers as 1, 3, 1 at TP 2, 1, 3: every transfer between unequal degrees.
    _check(((0, 1), (1, 4), (4, 5)), [(2, 1, 3)], global_batch=4, micro_batch=1)


def test_the_trainer_trains_a_pipeline_job_as_the_dense_model_trains(tmp_path: Path) -> None:
    # `python -m ntp.train` on a pipeline layout, PP2 x DP2 with a degraded stage, for several
    # steps: 1F1B in micro-batches, the clip by the whole model's norm, each stage's AdamW step.
    args = ModelArgs.of_shape(dataclasses.replace(DEBUG, n_layers=4).shape())
    pipe = plan_pipeline(args.shape(), ((0, 2), (2, 4)), [(2, 2), (2, 1)], global_batch=9)
    steps, clip = 4, 0.5
    launch_local(pipe, ["--steps", str(steps), "--lr", str(LR), "--micro-batch-size", "2",
                        "--max-grad-norm", str(clip), "--out", str(tmp_path)],
                 # a guard against a hang only: the ranks' own collectives end a stuck step
                 timeout_s=900)
    records = [json.loads((tmp_path / f"rank{g}.json").read_text())
               for g in range(pipe.world_size)]
    model = dense_model(args, seed=0)  # the trainer's default seed, its weights' and batches'
    want = dense_steps(model, adamw(model), 0, steps, pipe.stages[0].global_batch, clip,
                       [rep.local_batch for rep in pipe.stages[0].replicas])
    # Every rank reports the job's loss, and it is the dense model's step after step (the bound
    # test_parity's loss curves keep: float32 sums in another order, through AdamW).
    for record in records:
        assert len(record["losses"]) == steps
        assert max(abs(a - b) for a, b in zip(record["losses"], want["losses"],
                                              strict=True)) <= 1e-4
    assert want["losses"][-1] < want["losses"][0]  # it trains
