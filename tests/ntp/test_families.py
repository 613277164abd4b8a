"""The model families (Llama 3.1 RoPE scaling, Qwen2.5 QKV biases, Qwen3 QK norms and head size,
tied heads, Mistral) against transformers, which defines them: each family's config.json becomes
spec.model, the trainer's model computes transformers' logits, loss and gradients within float32
rounding, and a Hugging Face directory goes in and out tensor for tensor.

The reference is transformers' own code run in float64 (`hf_families.float64_transformers`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import family_ranks
import pytest
import torch
from hf_families import (
    FAMILIES,
    batch,
    float32_bound,
    float64_transformers,
    in_project_order,
    reference_run,
    rel_err,
    save,
)
from safetensors import safe_open
from test_hf import refused

from ntp import checkpoint, hf, hf_cli, hf_read, hf_write
from ntp.initialize import materialize
from ntp.model import ModelArgs, Transformer, cross_entropy_loss
from ntp.parallelize import apply_ntp
from ntp.sharding import spec_of, unit_size
from tessera_contracts.model_shape import ModelShape, PlanError, RopeScaling
from tessera_core.plan import JobLayout, RankShard, plan_job

pytestmark = pytest.mark.models

ROWS = 3

# What each family's config.json is in spec.model: the CRD's words for what it adds.
SPECS = {
    "llama3.1": {"hidden": 64, "heads": 4, "kvHeads": 2, "ffn": 88, "vocab": 71, "layers": 2,
                 "seqLen": 20,
                 "ropeScaling": {"type": "llama3", "factor": 8.0, "lowFreqFactor": 1.0,
                                 "highFreqFactor": 4.0, "originalMaxPositionEmbeddings": 1024}},
    "qwen2.5": {"hidden": 56, "heads": 7, "kvHeads": 1, "ffn": 96, "vocab": 83, "layers": 2,
                "seqLen": 18, "qkvBias": True, "tiedEmbeddings": True},
    "qwen3": {"hidden": 48, "heads": 8, "kvHeads": 2, "ffn": 72, "vocab": 89, "layers": 2,
              "seqLen": 16, "headDim": 10, "qkNorm": True, "tiedEmbeddings": True},
    "mistral": {"hidden": 60, "heads": 10, "kvHeads": 5, "ffn": 100, "vocab": 79, "layers": 2,
                "seqLen": 22, "headDim": 8, "slidingWindow": 22},
}


def every_unit(shape: ModelShape) -> RankShard:
    return RankShard.build(shape, range(shape.n_heads), range(shape.ffn), range(shape.vocab))


def loaded(directory, args: ModelArgs) -> Transformer:
    """The trainer's dense model read from a Hugging Face directory as a rank reads its units."""
    model = Transformer(args)
    checkpoint.load_state(directory, model, None, args.shape(), every_unit(args.shape()))
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_config_is_its_spec_model(name, tmp_path):
    directory = save(FAMILIES[name].build(seed=1), tmp_path / name)
    args = checkpoint.read_args(directory)
    assert args.shape().to_spec() == SPECS[name]
    assert ModelShape.from_spec(SPECS[name]) == args.shape()
    assert checkpoint.latest(directory) == directory  # a job may start from it


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_model_computes_what_transformers_computes(name, tmp_path, monkeypatch, capsys):
    family = FAMILIES[name]
    source = family.build(seed=3)
    directory = save(source, tmp_path / name)
    args = checkpoint.read_args(directory)
    inputs, targets = batch(args.vocab_size, args.max_seq_len, ROWS, seed=5)
    with float64_transformers(monkeypatch):
        want, want_grads = reference_run(source.double(), inputs, targets)
    want_grads = in_project_order(args, want_grads)

    model = loaded(directory, args)
    logits = model(inputs)
    loss = cross_entropy_loss(logits, targets)
    loss.backward()
    errors = {"logits": rel_err(logits.detach(), want["logits"]),
              "loss": rel_err(loss.detach(), want["loss"])}
    assert want_grads.keys() == dict(model.named_parameters()).keys()
    errors |= {n: rel_err(p.grad, want_grads[n]) for n, p in model.named_parameters()}
    bound = float32_bound(args, ROWS)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= bound, (worst, errors[worst], bound)
    with capsys.disabled():
        print(f"\n[{name}] float32 vs transformers in float64: logits {errors['logits']:.1e}, "
              f"loss {errors['loss']:.1e}, worst gradient "
              f"{max(v for k, v in errors.items() if '.' in k):.1e} (bound {bound:.1e})")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_then_export_gives_back_every_tensor(name, tmp_path):
    family = FAMILIES[name]
    source = family.build(seed=8)
    directory = save(source, tmp_path / "source")
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    job = tmp_path / "job"
    assert hf_cli.import_main([str(directory), str(job)]) == 0
    stored = _tensors(directory)
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = tmp_path / f"export-{dtype}"
        # 2 KiB files: one to a few tensors each, with an index
        assert hf_cli.export_main([str(job), str(out), "--dtype", dtype,
                                   "--max-shard-bytes", "2048"]) == 0
        assert (out / hf.INDEX).is_file() and len(list(out.glob("*.safetensors"))) > 1
        exported = _tensors(out)
        tied = {"lm_head.weight"} if source.config.tie_word_embeddings else set()
        assert exported.keys() == stored.keys() - tied
        for key, t in exported.items():
            assert t.dtype == torch_dtype and torch.equal(t, stored[key].to(torch_dtype)), key
        for carried in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (out / carried).read_bytes() == (directory / carried).read_bytes()
        config = hf.read_config(out)
        assert config["model_type"] == hf.read_config(directory)["model_type"]
        loaded_back = family.model.from_pretrained(out, attn_implementation="eager",
                                                   dtype=torch.float32)
        rounded = copy.deepcopy(source)  # its weights as the export holds them
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(torch_dtype))
        inputs, _ = batch(config["vocab_size"], 6, ROWS, seed=9)
        with torch.no_grad():
            got = loaded_back(input_ids=inputs).logits
            assert torch.equal(got, rounded(input_ids=inputs).logits), dtype


def _tensors(directory) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    return found


@pytest.mark.parametrize("name", ["qwen3", "llama3.1"])
def test_a_bfloat16_directory_widens_exactly(name, tmp_path):
    source = FAMILIES[name].build(seed=12).to(torch.bfloat16)
    directory = save(source, tmp_path / name, torch.bfloat16)
    args = checkpoint.read_args(directory)
    model = loaded(directory, args)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        key, back = hf.to_hf(n, p.detach(), args)
        assert torch.equal(back, source.get_parameter(key).float()), n


def test_what_no_family_computes_is_refused_naming_the_field(tmp_path):
    config = FAMILIES["llama3.1"].config(**FAMILIES["llama3.1"].shape).to_dict()
    rope = config["rope_parameters"]
    cases = [
        ({"rope_parameters": rope | {"rope_type": "yarn"}}, "rope_type"),
        ({"rope_parameters": rope | {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gemma"}, "model_type"),
    ]
    for change, field in cases:
        assert field in refused(lambda c=change: hf.args_from_config(config | c)), field
    qwen3 = FAMILIES["qwen3"].config(**FAMILIES["qwen3"].shape).to_dict()
    assert "attention_bias" in refused(
        lambda: hf.args_from_config(qwen3 | {"attention_bias": True}))
    assert "use_sliding_window" in refused(
        lambda: hf.args_from_config(qwen3 | {"use_sliding_window": True}))
    # Mistral's window: refused only where it would change the result
    mistral = FAMILIES["mistral"].config(**FAMILIES["mistral"].shape).to_dict()
    assert hf.args_from_config(mistral | {"sliding_window": 22}).sliding_window == 22
    assert "sliding_window" in refused(
        lambda: hf.args_from_config(mistral | {"sliding_window": 21}, seq_len=22))
    assert hf.args_from_config(mistral | {"sliding_window": 21}).max_seq_len == 21  # default
    assert hf.args_from_config(mistral | {"sliding_window": None}).sliding_window is None
    # a missing key means the class's default: Qwen3's head_dim is 128, Mistral's window 4096
    del qwen3["head_dim"]
    assert hf.args_from_config(qwen3).head_dim == 128
    del mistral["sliding_window"]
    assert hf.args_from_config(mistral | {"max_position_embeddings": 8192}).max_seq_len == 4096
    # the same limits in spec.model itself
    shape = ModelShape.from_spec(SPECS["mistral"])
    with pytest.raises(PlanError, match="slidingWindow"):
        replace(shape, seq_len=23)
    dynamic = RopeScaling("dynamic", 2.0, original_max_position_embeddings=20)
    with pytest.raises(PlanError, match="originalMaxPositionEmbeddings"):
        replace(shape, sliding_window=None, rope_scaling=dynamic, seq_len=21)
    # QKV biases with QK norms: the trainer computes it, but no family holds it
    args = ModelArgs.of_shape(replace(ModelShape.from_spec(SPECS["qwen3"]), qkv_bias=True))
    assert "no Hugging Face family" in refused(lambda: hf.config_from_args(args))
    # and its export is refused before any file is written
    weights = dict(Transformer(args).named_parameters())
    out = tmp_path / "out"
    assert "no Hugging Face family" in refused(
        lambda: hf_write.write_directory(out, args, lambda name, _dtype: weights[name]))
    assert not out.exists()


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_linear_and_dynamic_scaling_are_transformers_at_training_time(
    kind, tmp_path, monkeypatch
):
    family = FAMILIES["llama3.1"]
    rope = {"rope_type": kind, "rope_theta": 20000.0, "factor": 4.0}
    source = family.build(seed=4, rope_parameters=rope)
    directory = save(source, tmp_path / kind)
    args = checkpoint.read_args(directory)
    assert args.rope_scaling is not None and args.rope_scaling.type == kind
    inputs, targets = batch(args.vocab_size, args.max_seq_len, ROWS, seed=2)
    with float64_transformers(monkeypatch):
        want, _ = reference_run(source.double(), inputs, targets)
    with torch.no_grad():
        logits = loaded(directory, args)(inputs)
    assert rel_err(logits, want["logits"]) <= float32_bound(args, ROWS)
    # and back out as transformers reads it
    config = hf.config_from_args(args)
    assert config["rope_parameters"] == rope | {"factor": 4.0}
    assert config["max_position_embeddings"] == 20


def test_weights_of_another_family_are_refused_naming_the_field(tmp_path):
    directory = save(FAMILIES["qwen3"].build(seed=2), tmp_path / "qwen3")
    args = checkpoint.read_args(directory)
    job = tmp_path / "job"
    assert hf_cli.import_main([str(directory), str(job)]) == 0
    imported = checkpoint.latest(job)
    info = json.loads((imported / checkpoint.INFO).read_text())
    assert info["model"]["qk_norm"] and info["model"]["head_dim"] == 10  # carried
    for start in (directory, imported):
        checkpoint.load_state(start, Transformer(args), None, args.shape(),
                              every_unit(args.shape()))
        for other, field in ((replace(args, tied_embeddings=False), "tiedEmbeddings"),
                             (replace(args, rope_scaling=RopeScaling("linear", 2.0)),
                              "ropeScaling")):
            with pytest.raises(checkpoint.CheckpointError) as refusal:
                checkpoint.load_state(start, Transformer(other), None, other.shape(),
                                      every_unit(other.shape()))
            message = str(refusal.value)
            assert "\n" not in message
            # a missing tensor is found first in a checkpoint (its names), else the field
            assert field in message or "output.weight" in message, message


def test_the_units_a_rank_reads_are_its_slices(tmp_path):
    # every parameter kind, row- and column-split, biases and heads reordered: a rank's read
    # of its units is exactly its slices of the dense read
    directory = save(FAMILIES["qwen2.5"].build(seed=6), tmp_path / "q")
    args = checkpoint.read_args(directory)
    dense = dict(loaded(directory, args).named_parameters())
    files = hf_read.open_directory(directory, args)
    for shard in plan_job(args.shape(), [3], global_batch=3).replicas[0].shards:
        with torch.device("meta"):
            model = Transformer(args)
        apply_ntp(model, shard, group=None)
        materialize(model, "cpu")
        hf_read.load_units(directory, files, model, args.shape(), shard)
        assert model.output.weight is model.tok_embeddings.weight
        for n, p in model.named_parameters():
            spec = spec_of(n)
            if spec is None:
                assert torch.equal(p, dense[n]), n
                continue
            size = unit_size(args.shape(), spec.kind)
            index = torch.tensor([u * size + i for u in shard.units(spec.kind)
                                  for i in range(size)])
            assert torch.equal(p, dense[n].index_select(spec.dim, index)), n


# name -> TP degree of each replica. Every family's head count is one no TP degree of 3
# divides: the TP3 replica splits query heads unevenly, some of its ranks across KV groups.
LAYOUTS = {
    "uniform tp2+tp2": [2, 2],
    "tp3 with uneven GQA splits + reduced tp2": [3, 2],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_computes_what_transformers_computes(layout, tmp_path, monkeypatch,
                                                          capsys):
    """Every rank's logits (its vocabulary columns of its replica's rows), every replica's loss,
    and every rank's synchronized gradients after one step (each unit, KV copies, QK norms, the
    tied head) against transformers on the whole batch."""
    degrees = LAYOUTS[layout]
    global_batch = 2 * len(degrees) + 1
    jobs, references = [], {}
    for k, (name, family) in enumerate(FAMILIES.items()):
        source = family.build(seed=20 + k)
        directory = save(source, tmp_path / name)
        args = checkpoint.read_args(directory)
        inputs, targets = batch(args.vocab_size, args.max_seq_len, global_batch, seed=30 + k)
        tokens = tmp_path / f"{name}-tokens.pt"
        torch.save(torch.cat([inputs, targets[:, -1:]], dim=1), tokens)
        with float64_transformers(monkeypatch):
            want, grads = reference_run(source.double(), inputs, targets)
        references[name] = (args, want, in_project_order(args, grads), targets)
        jobs.append(family_ranks.Job(name, directory, SPECS[name], tokens))
    out = tmp_path / "ranks"
    out.mkdir()
    family_ranks.run(degrees, jobs, out)

    for name, (args, want, want_grads, targets) in references.items():
        # What a layout adds to the longest path: the sum over a replica's ranks of the KV
        # copies' gradients and the weighted sum over replicas.
        bound = float32_bound(args, global_batch, extra_operations=max(degrees) + len(degrees))
        worst = {"logits": 0.0, "loss": 0.0, "gradients": 0.0}
        for rank in range(sum(degrees)):
            dump = torch.load(out / f"{name}-rank{rank}.pt")
            layout_ = JobLayout.from_dict(dump["layout"])
            replica = layout_.replicas[dump["replica"]]
            shard = replica.shards[dump["rank"]]
            rows = slice(replica.batch_offset, replica.batch_offset + replica.local_batch)
            vocab = torch.tensor(shard.vocab_rows)
            mine = want["logits"][rows].index_select(2, vocab)
            worst["logits"] = max(worst["logits"],
                                  rel_err(dump["logits"], mine, scale=want["logits"]))
            replica_loss = torch.nn.functional.cross_entropy(
                want["logits"][rows].flatten(0, 1), targets[rows].flatten())
            worst["loss"] = max(worst["loss"], rel_err(dump["loss"], replica_loss))
            assert dump["grads"].keys() == want_grads.keys()
            for n, g in dump["grads"].items():
                spec = spec_of(n)
                dense = want_grads[n]
                if spec is not None:
                    size = unit_size(args.shape(), spec.kind)
                    index = torch.tensor([u * size + i for u in shard.units(spec.kind)
                                          for i in range(size)])
                    dense_slice = dense.index_select(spec.dim, index)
                else:
                    dense_slice = dense
                worst["gradients"] = max(worst["gradients"],
                                         rel_err(g, dense_slice, scale=dense))
        assert max(worst.values()) <= bound, (name, worst, bound)
        with capsys.disabled():
            print(f"\n[{name}, {layout}] float32 NTP vs transformers in float64: logits "
                  f"{worst['logits']:.1e}, loss {worst['loss']:.1e}, gradients "
                  f"{worst['gradients']:.1e} (bound {bound:.1e})")
