"""Initialization without the dense model: a rank materializes only its units, with values that
do not depend on the layout, and never holds more than its shard and one dense layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from ntp.initialize import adopt, dense_model, init_parameters, materialize
from ntp.model import ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import plan_job

# A shape no other test uses, with uneven splits (10 heads over 3 ranks, 2 KV heads).
ARGS = ModelArgs(dim=40, n_layers=2, n_heads=10, n_kv_heads=2, ffn_dim=37, vocab_size=53,
                 max_seq_len=8)


def shard_model(args: ModelArgs, shard) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    apply_ntp(model, shard, group=None)
    materialize(model, "cpu")
    init_parameters(model, args, shard, seed=7)
    return model


@pytest.mark.parametrize("degrees", [(3,), (2, 1), (4, 3)])
def test_every_layout_starts_from_the_dense_weights(degrees):
    dense = dict(dense_model(ARGS, seed=7).named_parameters())
    shape = ARGS.shape()
    head = shape.head_dim
    layout = plan_job(shape, list(degrees), global_batch=8)
    for replica in layout.replicas:
        for shard in replica.shards:
            for name, p in shard_model(ARGS, shard).named_parameters():
                # The slice by index arithmetic: rows (dim 0) or columns (dim 1) of each unit.
                if name.endswith(("wq.weight", "wo.weight")):
                    ids, size = shard.q_heads, head
                elif name.endswith(("wk.weight", "wv.weight")):
                    ids, size = shard.kv_heads, head
                elif name.endswith(("w1.weight", "w2.weight", "w3.weight")):
                    ids, size = shard.mlp_cols, 1
                elif name.endswith(("tok_embeddings.weight", "output.weight")):
                    ids, size = shard.vocab_rows, 1
                else:
                    assert torch.equal(p, dense[name]), name
                    continue
                dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
                index = torch.tensor([u * size + i for u in ids for i in range(size)])
                assert torch.equal(p, dense[name].index_select(dim, index)), name


@pytest.mark.parametrize("build", ["materialize", "adopt"])
def test_a_tied_head_stays_the_embedding(build):
    """Allocated, or made of a relayout's moved weights: the LM head is the embedding's tensor,
    so the model computes with the weights it was given and both uses add to one gradient."""
    args = replace(ARGS, tied_embeddings=True)
    shard = plan_job(args.shape(), [3], global_batch=8).replicas[0].shards[1]
    with torch.device("meta"):
        model = Transformer(args)
    apply_ntp(model, shard, group=None)
    weights = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    if build == "materialize":
        materialize(model, "cpu")
    else:
        adopt(model, weights, "cpu")
        assert model.tok_embeddings.weight.data_ptr() == weights["tok_embeddings.weight"].data_ptr()
    assert model.output.weight is model.tok_embeddings.weight
    assert not any(p.is_meta for p in model.parameters())


# Peak resident memory of building one rank's shard (TP8, rank 3) of a 190 M-parameter model
# (760 MB dense in fp32), measured in a fresh process: its peak resident size (reset after the
# imports) above its resident size then.
MEASURE = """
import json, sys, torch
from ntp.initialize import dense_model, init_parameters, materialize
from ntp.model import ModelArgs, Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import plan_job
args = ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=4096,
                 vocab_size=32768, max_seq_len=64)
shard = plan_job(args.shape(), [8], global_batch=8).replicas[0].shards[3]
def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
def peak(): return status("VmHWM")
with torch.device("meta"):  # loads what meta construction needs once (code, not the model)
    Transformer(ModelArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=4, vocab_size=4))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from the current size
before = status("VmRSS")
if sys.argv[1] == "meta":
    with torch.device("meta"):
        model = Transformer(args)
    apply_ntp(model, shard, group=None)
    materialize(model, "cpu")
    init_parameters(model, args, shard, seed=0)
else:  # the dense model first, then cut to the shard: what every rank did before
    model = dense_model(args, seed=0)
    with torch.no_grad():
        dense = {n: p.detach() for n, p in model.named_parameters()}
        with torch.device("meta"):
            cut = Transformer(args)
        apply_ntp(cut, shard, group=None)
        materialize(cut, "cpu")
    model = cut
peak_after = peak()
with torch.device("meta"):
    layer = sum(p.numel() * 4 for p in Transformer(args).layers[0].parameters())
shard_bytes = sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({"peak": peak_after - before, "shard": shard_bytes, "layer": layer}))
"""


def measure(mode: str) -> dict:
    # A fixed mmap threshold: glibc's adaptive one would keep freed temporaries on the heap, so
    # the resident size would count memory no longer allocated.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", MEASURE, mode], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout)


def test_a_rank_holds_its_shard_and_at_most_one_dense_layer_more(capsys):
    meta, dense = measure("meta"), measure("dense")
    # The shard itself, plus the largest transient: one local parameter's values before they
    # are copied in (smaller than one dense layer). Nothing else grows with the model.
    assert meta["peak"] <= meta["shard"] + meta["layer"], meta
    with capsys.disabled():
        mib = 2**20
        print(f"\npeak per rank (TP8, 190 M params): meta init {meta['peak'] / mib:.0f} MiB "
              f"(shard {meta['shard'] / mib:.0f} MiB, one dense layer {meta['layer'] / mib:.0f}"
              f" MiB); dense then cut {dense['peak'] / mib:.0f} MiB; ratio "
              f"{meta['peak'] / dense['peak']:.3f}")
