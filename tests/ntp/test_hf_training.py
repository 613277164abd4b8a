"""A Hugging Face model, a Llama imported or a Qwen3 directory read by the ranks themselves,
trained under NTP through a GPU loss, exported, and checked by transformers: it computes the loss
Tessera computes on the next batch.

The layout runs as real trainer processes (gloo, CPU); the launcher plays the node agent and the
test publishes the next generation ahead, as the operator would (see test_reconfiguration.py).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_families import FAMILIES
from hf_families import save as save_family
from rounding import FLOAT32_ROUNDING, FLOAT64_ROUNDING, rounding_bound
from test_hf import random_llama, save
from transformers import LlamaForCausalLM

from ntp import hf, hf_cli
from ntp.checkpoint import latest, read_args
from ntp.data import split_inputs, synthetic_batch
from ntp.launch import launch_local
from tessera_contracts.generation import Generation, Gpu, Rendezvous, next_generation
from tessera_core.plan import plan_job

pytestmark = pytest.mark.hf

GLOBAL_BATCH = 8
STEPS = 20
# Used by no other test: 6 query heads on 3 KV heads, FFN 60, vocabulary 67.
SHAPE = dict(
    hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=60,
    vocab_size=67, num_hidden_layers=2, max_position_embeddings=32, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
NODE0 = tuple(Gpu("gpu-node-0", i) for i in range(2))
NODE1 = tuple(Gpu("gpu-node-1", i) for i in range(2))


# Used by no other test: Qwen3 with 6 query heads of 12 on 2 KV heads (40 / 6 is no head
# size), QK norms and a tied head, stored in bfloat16 with its tokenizer.
QWEN3 = dict(
    hidden_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
    intermediate_size=56, vocab_size=73, num_hidden_layers=2, max_position_embeddings=16,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)


def llama2_imported(tmp_path):
    """A random Llama as transformers saves it, imported as the job's initial checkpoint."""
    source = save(random_llama(SHAPE, seed=5), tmp_path / "source")
    assert hf_cli.import_main([str(source), str(tmp_path / "init"), "--seq-len", "16"]) == 0
    return tmp_path / "init", LlamaForCausalLM


def qwen3_directory(tmp_path):
    """A random Qwen3 in bfloat16 with a tokenizer: the job starts from the directory itself,
    each rank reading its units of it."""
    model = FAMILIES["qwen3"].model
    source = save_family(replace(FAMILIES["qwen3"], shape=QWEN3).build(seed=5),
                         tmp_path / "source", torch.bfloat16)
    (source / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    return source, model


# The Qwen3 job trains in micro-batches of 3 (4 rows a replica: 3 + 1) with every other layer
# recomputed, which wrap the layers its QK norms and tied head live in.
MICRO_AND_RECOMPUTED = ["--micro-batch-size", "3", "--activation-checkpointing", "selective"]


@pytest.mark.parametrize("start,extra", [
    pytest.param(llama2_imported, [], id="llama2 imported"),
    pytest.param(qwen3_directory, MICRO_AND_RECOMPUTED, id="qwen3 bf16 directory",
                 marks=pytest.mark.models),
])
def test_trained_under_ntp_through_a_gpu_loss_then_exported(start, extra, tmp_path, capsys):
    # 1. What the job starts from: a checkpoint or a Hugging Face directory.
    init, model_class = start(tmp_path)
    args = read_args(latest(init))
    # 2. TP2 + TP2; the process on gpu-node-1/1 (rank 3) dies at step 8 and its replica goes on
    #    at TP1 (generation 2, published ahead).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = Generation(1, args.shape(), GLOBAL_BATCH, "NTP", (NODE0, NODE1),
                       Rendezvous("127.0.0.1", store.port))
    run = tmp_path / "run"
    run.mkdir()
    nxt = next_generation(first, (NODE0, NODE1[:1]))
    (run / "gen2.json").write_text(json.dumps(nxt.to_dict()))
    ckpt = tmp_path / "ckpt"
    report = launch_local(
        first,
        ["--steps", str(STEPS), "--out", str(run), "--layout-dir", str(run),
         "--init", str(init), "--save", str(ckpt), "--save-every", "10", *extra],
        timeout_s=200, store=store, faults={3: 8}, may_fail={3},
        env={"TESSERA_RENDEZVOUS_TIMEOUT_S": "60"},
    )
    assert [d[0] for d in report.deaths] == [3]
    metrics = json.loads((run / "rank0.json").read_text())
    assert len(metrics["losses"]) == STEPS
    assert [e["tp_degrees"] for e in metrics["events"] if e["event"] == "reconfigured"] == [[2, 1]]
    # 3. Exported, and loaded by transformers; the tokenizer the job started with is there.
    assert hf_cli.export_main([str(ckpt), str(tmp_path / "export")]) == 0
    for carried in hf.carried_files(init if hf.is_directory(init) else init / "huggingface"):
        assert (tmp_path / "export" / carried.name).read_bytes() == carried.read_bytes()
    model = model_class.from_pretrained(tmp_path / "export", attn_implementation="eager")
    inputs, targets = split_inputs(
        synthetic_batch(args.vocab_size, args.max_seq_len, GLOBAL_BATCH, STEPS, seed=0)
    )
    with torch.no_grad():
        theirs = float(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()))
    # 4. Tessera's loss on that batch: the job's next step, from its checkpoint, on one GPU.
    nxt_dir = tmp_path / "next"
    launch_local(plan_job(args.shape(), [1], GLOBAL_BATCH),
                 ["--until-step", str(STEPS + 1), "--save", str(ckpt), "--resume",
                  "--out", str(nxt_dir), *extra], timeout_s=120)
    [ours] = json.loads((nxt_dir / "rank0.json").read_text())["losses"]
    # Two float32 evaluations of the same loss: each within (u32 + u64) x the operations on
    # the longest dependency path (`rounding_bound`'s count, test_model.py) of the exact value.
    operations = rounding_bound(args, GLOBAL_BATCH) / (2 * FLOAT64_ROUNDING)
    bound = 2 * (FLOAT32_ROUNDING + FLOAT64_ROUNDING) * operations
    assert abs(ours - theirs) <= bound * abs(theirs), (ours, theirs, bound)
    with capsys.disabled():
        print(f"\nloss on batch {STEPS}: Tessera {ours:.7f}, transformers {theirs:.7f}, "
              f"relative difference {abs(ours - theirs) / theirs:.1e} (bound {bound:.1e})")
    # It trained: the loss on the training batches fell.
    assert metrics["losses"][-1] < metrics["losses"][0]


def test_an_import_of_another_shape_is_refused_by_the_trainer(tmp_path):
    source = save(random_llama(SHAPE, seed=5), tmp_path / "source")
    assert hf_cli.import_main([str(source), str(tmp_path / "init"), "--seq-len", "16"]) == 0
    other = plan_job(read_args(latest(tmp_path / "init")).shape().__class__(
        hidden=48, n_heads=6, n_kv_heads=3, ffn=64, vocab=67, n_layers=2, seq_len=16), [1], 8)
    with pytest.raises(Exception, match="shape"):
        launch_local(other, ["--steps", "1", "--init", str(tmp_path / "init")], timeout_s=120)
