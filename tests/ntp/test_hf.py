"""Hugging Face Llama in and out (`ntp.hf`), against transformers' LlamaForCausalLM: the imported
model computes what transformers computes, exports load back in transformers, commands round-trip.

Tiny random Llamas are built and saved locally (nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_families import float64_transformers as reference_in_float64
from hf_families import reference_run
from rounding import FLOAT32_ROUNDING, FLOAT64_ROUNDING, rounding_bound
from safetensors.torch import load_file, save_file
from test_model import rel_err
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from ntp import checkpoint, hf, hf_cli, hf_read, hf_write
from ntp.model import ModelArgs, Transformer, cross_entropy_loss, parameter_shapes

pytestmark = pytest.mark.hf
hf_logging.disable_progress_bar()

BATCH = 3

# Shapes no other test uses: grouped-query and multi-head attention, with different depth,
# vocabulary, FFN, RoPE theta and norm eps; head_dim 6 and 8.
SHAPES = {
    "GQA 6q/2kv": dict(
        hidden_size=36, num_attention_heads=6, num_key_value_heads=2, intermediate_size=46,
        vocab_size=53, num_hidden_layers=2, max_position_embeddings=9, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 2500.0},
    ),
    "MHA 4 heads": dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=70,
        vocab_size=47, num_hidden_layers=3, max_position_embeddings=12, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 31000.0},
    ),
}


def random_llama(shape: dict, seed: int, **extra) -> LlamaForCausalLM:
    """A LlamaForCausalLM with every weight random and float32, norm gains included (uniform in
    [0.5, 1.5]); matrices N(0, 1/fan_in), the embedding N(0, 1), as llama_reference.random_params,
    so that activations, scores and logits stay of order one (no stage badly conditioned)."""
    model = LlamaForCausalLM(LlamaConfig(**shape, **extra, attn_implementation="eager"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                scale = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' Llama computed in float64 throughout (`hf_families.float64_transformers`:
    the three stages it rounds to float32 whatever the dtype run in float64, the rest its
    own code)."""
    with reference_in_float64(monkeypatch):
        yield


def batch(vocab: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def project_run(args: ModelArgs, weights: dict, dtype, inputs, targets):
    """The same for the project's model holding `weights` in `dtype`; gradients mapped to
    transformers' names and row order."""
    model = Transformer(args)  # float32; .double() keeps the complex RoPE table complex
    model = model.double() if dtype == torch.float64 else model
    model.load_state_dict({n: w.to(dtype) for n, w in weights.items()})  # strict
    logits = model(inputs)
    loss = cross_entropy_loss(logits, targets)
    loss.backward()
    grads = dict(hf.to_hf(n, p.grad, args) for n, p in model.named_parameters())
    return {"logits": logits.detach(), "loss": loss.detach()}, grads


def worst_errors(got, got_grads, want, want_grads) -> dict[str, float]:
    """Each compared tensor's largest difference relative to its largest reference magnitude."""
    assert got_grads.keys() == want_grads.keys()
    errors = {k: rel_err(got[k], want[k]) for k in ("logits", "loss")}
    return errors | {n: rel_err(g, want_grads[n]) for n, g in got_grads.items()}


def float32_bound(args: ModelArgs) -> float:
    """One float32 evaluation against a float64 one: `rounding_bound` counts the operations on
    the longest dependency path N and allows 2 x u64 per operation (two float64 evaluations);
    here each operation rounds at most at u32 on one side and u64 on the other."""
    operations = rounding_bound(args, BATCH) / (2 * FLOAT64_ROUNDING)
    return (FLOAT32_ROUNDING + FLOAT64_ROUNDING) * operations


def save(model: LlamaForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight of a Hugging Face directory under the project's names and order."""
    args = hf.args_from_config(hf.read_config(directory))
    files = hf_read.open_directory(directory, args)
    return {n: hf_read.read_dense(directory, files, args, n) for n in parameter_shapes(args)}


def write(directory: Path, args: ModelArgs, weights, **options) -> None:
    tensors = dict(weights)
    hf_write.write_directory(directory, args, lambda name, _dtype: tensors[name], **options)


@pytest.mark.parametrize("name", list(SHAPES))
def test_imported_model_computes_what_transformers_computes(
    name, tmp_path, float64_transformers, capsys
):
    source = save(random_llama(SHAPES[name], seed=3), tmp_path / "hf")
    args = hf.args_from_config(hf.read_config(source))
    weights = read_weights(source)
    assert all(w.dtype == torch.float32 for w in weights.values())
    reference = LlamaForCausalLM.from_pretrained(source, attn_implementation="eager",
                                                 dtype=torch.float64)
    inputs, targets = batch(args.vocab_size, args.max_seq_len, seed=5)
    want, want_grads = reference_run(reference, inputs, targets)
    assert want["logits"].dtype == torch.float64

    # Float64: the two implement the same equations, so they agree to float64 rounding
    # (`rounding_bound`, the derivation in test_model.py; the transformers path has the same
    # stages). A RoPE row order other than the one transformers pairs with rotate_half is
    # another model: without the permutation, or with it the wrong way round, the logits
    # differ by 0.4-0.6 of their largest magnitude.
    got, got_grads = project_run(args, weights, torch.float64, inputs, targets)
    errors64 = worst_errors(got, got_grads, want, want_grads)
    bound64 = rounding_bound(args, BATCH)
    worst64 = max(errors64, key=errors64.__getitem__)
    assert errors64[worst64] <= bound64, (worst64, errors64[worst64], bound64)

    # Float32, as the trainer runs: within float32 rounding of the float64 reference.
    got, got_grads = project_run(args, weights, torch.float32, inputs, targets)
    errors32 = worst_errors(got, got_grads, want, want_grads)
    bound32 = float32_bound(args)
    worst32 = max(errors32, key=errors32.__getitem__)
    assert errors32[worst32] <= bound32, (worst32, errors32[worst32], bound32)
    with capsys.disabled():
        print(f"\n[{name}] float64: logits {errors64['logits']:.1e}, loss {errors64['loss']:.1e}, "
              f"worst {errors64[worst64]:.1e} (bound {bound64:.1e}); float32: logits "
              f"{errors32['logits']:.1e}, loss {errors32['loss']:.1e}, worst "
              f"{errors32[worst32]:.1e} (bound {bound32:.1e})")


def test_export_loads_in_transformers_and_reads_back_identically(tmp_path):
    source_model = random_llama(SHAPES["GQA 6q/2kv"], seed=8)
    source = save(source_model, tmp_path / "hf")
    args = hf.args_from_config(hf.read_config(source))
    model = Transformer(args)
    model.load_state_dict(read_weights(source))
    inputs, _ = batch(args.vocab_size, args.max_seq_len, seed=9)
    with torch.no_grad():
        want = source_model(input_ids=inputs).logits
    stored = load_file(source / hf.SINGLE)

    # the largest tensor (the embedding, 53 x 36 float32) is 7,632 bytes: 8 KiB shards hold
    # one to a few tensors each
    for out, shard_bytes in ((tmp_path / "one", 5 * 2**30), (tmp_path / "sharded", 8 * 2**10)):
        write(out, args, model.named_parameters(), max_shard_bytes=shard_bytes)
        shards = sorted(out.glob("*.safetensors"))
        sharded = shard_bytes < 2**20
        assert (len(shards) > 1) == sharded == (out / hf.INDEX).is_file()
        assert all(p.stat().st_size <= shard_bytes + 2**10 for p in shards)  # + header
        # Moving rows and renaming is exact: the very tensors transformers saved, so the same
        # logits bit for bit.
        exported = {}
        for p in shards:
            exported |= load_file(p)
        assert exported.keys() == stored.keys()
        assert all(torch.equal(exported[k], stored[k]) for k in stored)
        loaded = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=inputs).logits, want)
        back = read_weights(out)
        assert back.keys() == dict(model.named_parameters()).keys()
        assert all(torch.equal(back[n], p) for n, p in model.named_parameters())
        assert hf.read_config(out) == hf.config_from_args(args)


def test_bfloat16_weights_widen_exactly(tmp_path):
    source_model = random_llama(SHAPES["MHA 4 heads"], seed=12).to(torch.bfloat16)
    source = save(source_model, tmp_path / "hf")
    args = hf.args_from_config(hf.read_config(source))
    weights = read_weights(source)
    assert all(w.dtype == torch.float32 for w in weights.values())
    for name, w in weights.items():
        hf_key, back = hf.to_hf(name, w, args)
        assert torch.equal(back, source_model.get_parameter(hf_key).float()), name


def test_config_round_trips_through_transformers():
    args = hf.args_from_config(LlamaConfig(**SHAPES["MHA 4 heads"]).to_dict())
    assert args == ModelArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=70,
                             vocab_size=47, max_seq_len=12, norm_eps=1e-6, rope_theta=31000.0)
    config = LlamaConfig(**hf.config_from_args(args))
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 31000.0}
    assert not config.tie_word_embeddings
    assert hf.args_from_config(config.to_dict()) == args
    assert hf.args_from_config(config.to_dict(), seq_len=5).max_seq_len == 5
    # a config of transformers 4: theta at the top, no rope_parameters
    old = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    old |= {"rope_theta": 777.0, "rope_scaling": None}
    assert hf.args_from_config(old).rope_theta == 777.0


def test_tied_embeddings_import_as_one_tensor(tmp_path, float64_transformers):
    source_model = random_llama(SHAPES["MHA 4 heads"], seed=4, tie_word_embeddings=True)
    source = save(source_model, tmp_path / "hf")
    weights = read_weights(source)
    assert "output.weight" not in weights  # the head is the embedding
    args = hf.args_from_config(hf.read_config(source))
    assert args.tied_embeddings
    inputs, targets = batch(args.vocab_size, args.max_seq_len, seed=6)
    want, want_grads = reference_run(source_model.double(), inputs, targets)
    got, got_grads = project_run(args, weights, torch.float64, inputs, targets)
    bound = rounding_bound(args, BATCH)
    # the tied weight's gradient is the sum of its two uses, in the one tensor
    assert want_grads.keys() == got_grads.keys()
    for key, want_value in {**want, **want_grads}.items():
        assert rel_err({**got, **got_grads}[key], want_value) <= bound, key


def refused(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_what_the_project_does_not_compute_is_refused(tmp_path):
    # the families' refusals: tests/ntp/test_families.py
    config = LlamaConfig(**SHAPES["GQA 6q/2kv"]).to_dict()
    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}
    assert "rope_type" in refused(lambda: hf.args_from_config(config | {"rope_parameters": yarn}))
    old_scaling = {"rope_scaling": {"type": "longrope", "factor": 2.0}, "rope_parameters": None}
    assert "'longrope'" in refused(lambda: hf.args_from_config(config | old_scaling))
    for field, value in (("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"),
                         ("model_type", "gemma")):
        assert field in refused(lambda: hf.args_from_config(config | {field: value}))  # noqa: B023
    assert "max_position_embeddings" in refused(lambda: hf.args_from_config(config, seq_len=10))

    source = save(random_llama(SHAPES["GQA 6q/2kv"], seed=1), tmp_path / "hf")
    tensors = load_file(source / hf.SINGLE)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(tensors, source / hf.SINGLE, metadata={"format": "pt"})
    message = refused(lambda: read_weights(source))
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "model.layers.2.mlp.up_proj.weight" in message


def test_an_unfinished_export_has_no_config(tmp_path):
    args = hf.args_from_config(LlamaConfig(**SHAPES["GQA 6q/2kv"]).to_dict())
    model = Transformer(args)
    tensors = dict(model.named_parameters())

    def read(name: str, _dtype: torch.dtype) -> torch.Tensor:  # fails on the final norm
        if name == "norm.weight":
            raise ValueError("norm.weight: unreadable")
        return tensors[name]

    out = tmp_path / "out"
    assert "norm.weight" in refused(
        lambda: hf_write.write_directory(out, args, read, max_shard_bytes=2**14))
    assert any(out.iterdir()) and not (out / hf.CONFIG).exists()
    with pytest.raises(OSError):
        LlamaForCausalLM.from_pretrained(out)
    assert "not empty" in refused(lambda: write(out, args, model.named_parameters()))


def test_import_then_export_commands_give_the_source_tensors(tmp_path, capsys):
    source = save(random_llama(SHAPES["MHA 4 heads"], seed=2), tmp_path / "hf")
    job = tmp_path / "job-checkpoints"
    assert hf_cli.import_main([str(source), str(job), "--seq-len", "10"]) == 0
    first = checkpoint.latest(job)
    assert first is not None and first.name == "step-00000000"
    assert checkpoint.read_args(first).max_seq_len == 10
    stored = load_file(source / hf.SINGLE)
    out = tmp_path / "export"
    # the job's directory (its newest checkpoint), or one checkpoint
    for given, into in ((job, out), (first, tmp_path / "export-1")):
        assert hf_cli.export_main([str(given), str(into)]) == 0
        exported = load_file(into / hf.SINGLE)
        assert exported.keys() == stored.keys()
        assert all(torch.equal(exported[k], stored[k]) for k in stored)
        assert json.loads((into / hf.CONFIG).read_text())["max_position_embeddings"] == 10
    capsys.readouterr()

    for argv, main in (([str(source), str(job)], hf_cli.import_main),  # holds a checkpoint already
                       ([str(source), str(tmp_path / "j2"), "--seq-len", "13"], hf_cli.import_main),
                       ([str(tmp_path / "nothing"), str(tmp_path / "o2")], hf_cli.export_main),
                       ([str(first), str(out)], hf_cli.export_main)):  # not empty
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tessera "), err
