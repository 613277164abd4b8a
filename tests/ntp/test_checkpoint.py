"""Sharded checkpoints: each rank of replica 0 writes its own units (nothing dense), a checkpoint
of one layout loads into others with each rank reading only its units, a save runs in the
background on what was copied when it was called, torn checkpoints are never loaded, the newest
`keep` stay.

Slices of the dense tensors are cut here by plain index arithmetic from the table below, not by
the trainer's sharding code.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ntp.checkpoint import CheckpointSaver, dense_state, latest, load_state, save_state
from ntp.checkpointing import Checkpointing
from ntp.initialize import dense_model, materialize
from ntp.launch import launch_local
from ntp.model import FLAVORS, Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import RankShard, plan_job, plan_replica

pytestmark = pytest.mark.checkpoint

ARGS = FLAVORS["debug"]  # 12 query heads, 4 KV heads, 40 MLP columns, 64 vocabulary rows
SHAPE = ARGS.shape()
HEAD = ARGS.dim // ARGS.n_heads
# parameter name suffix -> (unit kind, split dimension, rows or columns per unit)
SPLIT = {
    "attention.wq.weight": ("q_heads", 0, HEAD),
    "attention.wk.weight": ("kv_heads", 0, HEAD),
    "attention.wv.weight": ("kv_heads", 0, HEAD),
    "attention.wo.weight": ("q_heads", 1, HEAD),
    "feed_forward.w1.weight": ("mlp_cols", 0, 1),
    "feed_forward.w3.weight": ("mlp_cols", 0, 1),
    "feed_forward.w2.weight": ("mlp_cols", 1, 1),
    "tok_embeddings.weight": ("vocab_rows", 0, 1),
    "output.weight": ("vocab_rows", 0, 1),
}


def split_of(name: str) -> tuple[str, int, int] | None:
    return next((v for k, v in SPLIT.items() if name.endswith(k)), None)


def dense_slice(name: str, dense: torch.Tensor, shard: RankShard) -> torch.Tensor:
    split = split_of(name)
    if split is None:
        return dense
    kind, dim, size = split
    index = [u * size + i for u in getattr(shard, kind) for i in range(size)]
    return dense.index_select(dim, torch.tensor(index))


def train(layout, tmp: Path, steps: int, *extra: str) -> None:
    args = ["--flavor", "debug", "--steps", str(steps), "--out", str(tmp), *extra]
    env = {"TESSERA_COLLECTIVE_TIMEOUT_S": "60", "TESSERA_RENDEZVOUS_TIMEOUT_S": "60"}
    launch_local(layout, args, timeout_s=150, env=env)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Three steps on TP4 + TP4, saved every step, the newest two kept."""
    tmp = tmp_path_factory.mktemp("tp4tp4")
    train(plan_job(SHAPE, [4, 4], global_batch=8), tmp, 3,
          "--save", str(tmp / "ckpt"), "--save-every", "1", "--keep", "2")
    return tmp / "ckpt"


def test_replica_0_writes_each_unit_once_and_nothing_dense(saved):
    # The curves' event files (`ntp.curves`) sit beside the checkpoints; two are kept.
    assert sorted(p.name for p in saved.glob("step-*")) == ["step-00000002", "step-00000003"]
    checkpoint = latest(saved)
    assert checkpoint is not None and checkpoint.name == "step-00000003"
    # Four writers (replica 0's ranks); replica 1 holds the same state and writes nothing.
    written = {p.name for p in checkpoint.glob("*.distcp") if p.stat().st_size > 0}
    assert written == {f"__{g}_0.distcp" for g in range(4)}
    stored = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    for key, meta in stored.items():
        name = key.partition("/")[2]
        split = split_of(name)
        if split is None:
            continue
        dim = split[1]
        covered = sum(math.prod(c.sizes) for c in meta.chunks)
        # Every element once, and no chunk is the dense tensor: each is a rank's runs of units.
        assert covered == math.prod(meta.size), key
        assert all(c.sizes[dim] < meta.size[dim] for c in meta.chunks), key


@pytest.mark.parametrize("degrees", [(4, 3), (2,)], ids=["tp4+tp3", "tp2x1"])
def test_a_checkpoint_loads_into_other_layouts(saved, tmp_path, degrees):
    layout = plan_job(SHAPE, list(degrees), global_batch=8)
    train(layout, tmp_path, 0, "--init", str(saved), "--dump")
    dense = dense_state(latest(saved))
    assert dense["optimizer"] is not None and dense["optimizer"]["step"] == 3.0
    for g in range(layout.world_size):
        replica, rank = layout.locate(g)
        shard = layout.replicas[replica].shards[rank]
        state = torch.load(tmp_path / f"state-rank{g}.pt")
        for name, (weight, *moments) in state.items():
            assert torch.equal(weight, dense_slice(name, dense["model"][name], shard)), name
            for m, got in zip(("exp_avg", "exp_avg_sq"), moments, strict=True):
                assert torch.equal(got, dense_slice(name, dense["optimizer"][m][name], shard))


def test_a_rank_reads_only_its_units(saved, monkeypatch):
    read: list = []
    original = FileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend(plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    shard = plan_job(SHAPE, [4, 3], global_batch=8).replicas[1].shards[2]
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_ntp(model, shard, group=None)
    materialize(model, "cpu")
    load_state(latest(saved), model, None, SHAPE, shard)
    held = sum(p.numel() for p in model.parameters())
    weights = [item for item in read if item.dest_index.fqn.startswith("model/")]
    assert sum(math.prod(item.lengths) for item in weights) == held
    dense = dense_state(latest(saved))["model"]
    for name, p in model.named_parameters():
        assert torch.equal(p, dense_slice(name, dense[name], shard)), name


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()


def info(step: int) -> dict:
    return {"step": step, "samples": 8 * step, "model": asdict(ARGS), "tp_degrees": [1]}


def test_an_asynchronous_save_writes_what_was_staged(tmp_path, one_rank, monkeypatch):
    model = dense_model(ARGS, seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    whole = plan_replica(SHAPE, 1)
    held = threading.Event()
    write = FileSystemWriter.write_data

    def gated(self, plan, planner):
        held.wait()
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated)
    saver = CheckpointSaver(tmp_path, keep=3)
    saver.save(save_state(model, None, SHAPE, whole, 0), info(1), one_rank, coordinator=True)
    # save() returned with the write still held: nothing is committed, and training goes on.
    assert latest(tmp_path) is None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    held.set()
    saver.wait()
    got = dense_state(latest(tmp_path))["model"]
    assert all(torch.equal(got[n], t) for n, t in before.items())
    # Blocking: committed when save() returns.
    blocking = CheckpointSaver(tmp_path / "b", keep=3, blocking=True)
    blocking.save(save_state(model, None, SHAPE, whole, 0), info(2), one_rank, coordinator=True)
    assert latest(tmp_path / "b").name == "step-00000002"


def test_a_torn_checkpoint_is_never_loaded(tmp_path, one_rank):
    model = dense_model(ARGS, seed=4)
    whole = plan_replica(SHAPE, 1)
    saver = CheckpointSaver(tmp_path, keep=5, blocking=True)
    for step in (2, 4):
        saver.save(save_state(model, None, SHAPE, whole, 0), info(step), one_rank, True)
    # A save that died half-way (no commit), and a checkpoint directory missing its record.
    (tmp_path / "step-00000006.partial").mkdir()
    (tmp_path / "step-00000006.partial" / "__0_0.distcp").write_bytes(b"torn")
    (tmp_path / "step-00000008").mkdir()
    assert latest(tmp_path).name == "step-00000004"
    assert Checkpointing(save=tmp_path).newest().name == "step-00000004"
    assert json.loads((latest(tmp_path) / "tessera.json").read_text())["samples"] == 32
