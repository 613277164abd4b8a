"""Hugging Face Llama checkpoints in and out of the trainer: tensor names, the row order of wq and
wk, config.json, and the `tessera import-hf` / `tessera export-hf` commands.

RoPE. The project rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's Llama
reference code; transformers' Llama rotates the halves (x[i], x[i + d/2]) (`rotate_half`). The
same model is then the same weights with the rows of wq and wk reordered within each head, as
transformers' convert_llama_weights_to_hf.py does (its `permute`): the Hugging Face row
j * d/2 + i of a head is the project's row 2i + j. Import applies the inverse, export the
permutation. It never moves a row to another head, so a rank that holds some heads holds the same
heads' rows in either order.

Tied embeddings. The project's LM head (`output.weight`) is a parameter of its own. A checkpoint
with `tie_word_embeddings` imports with the head a copy of the embedding (the two train apart from
then on); exports are untied.

Precision. Tensors come in as float32 (bfloat16 and float16 widen exactly) and go out as float32,
the checkpoint's precision. Reading streams one tensor at a time from the safetensors files;
writing holds one shard at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ntp import checkpoint
from ntp.model import ModelArgs, parameter_shapes

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOATS = {"BF16", "F16", "F32", "F64"}  # safetensors' dtype names that widen to float32

# project name within a layer -> transformers' (under model.layers.{i}.)
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Buffers older transformers saved with the weights; derived from the config, so not read.
DERIVED = ".rotary_emb.inv_freq"


# -- names and the RoPE row order ---------------------------------------------------------------


def hf_name(name: str) -> str:
    """transformers' name of a project parameter."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{LAYER_NAMES[rest]}"


def _rotated_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads' rows `name` holds when RoPE rotates its output, else None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from the interleaved-pairs order to transformers' halves order."""
    return w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `pairs_to_halves`."""
    return w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """A project tensor (weight or gradient) as transformers names and orders it."""
    heads = _rotated_heads(name, args)
    return hf_name(name), t if heads is None else pairs_to_halves(t, heads)


def from_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The tensor transformers holds for project parameter `name`, in the project's order."""
    heads = _rotated_heads(name, args)
    return t if heads is None else halves_to_pairs(t, heads)


# -- config.json ------------------------------------------------------------------------------


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: {field} is {value!r}; {why}")


def _rope(config: Mapping[str, Any]) -> tuple[str, float]:
    """(rope type, theta): transformers 5 writes them under `rope_parameters`, older versions
    `rope_theta` and `rope_scaling` at the top."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    return kind, float(theta)


def args_from_config(config: Mapping[str, Any], seq_len: int | None = None) -> ModelArgs:
    """The project's model of a Llama config.json; a ValueError of one line names what the
    project's Llama does not compute (it would load and train another model)."""
    if config.get("model_type") != "llama":
        raise _refuse("model_type", config.get("model_type"), "only 'llama' is imported")
    kind, theta = _rope(config)
    if kind != "default":
        raise _refuse("rope_parameters.rope_type", kind,
                      "only the default RoPE (no scaling) is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise _refuse(flag, config[flag], "the project's linear layers have no bias")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", config["hidden_act"], "the project's MLP is SwiGLU (silu)")
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        n_positions = int(config["max_position_embeddings"])
        sizes = {name: int(config[name])
                 for name in ("num_hidden_layers", "intermediate_size", "vocab_size")}
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]}") from None
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise _refuse("head_dim", head_dim,
                      f"the project's heads are hidden_size // num_attention_heads "
                      f"({dim} // {n_heads})")
    if seq_len is not None and not 0 < seq_len <= n_positions:
        raise ValueError(
            f"sequence length {seq_len} is outside 1..{n_positions} (max_position_embeddings)"
        )
    args = ModelArgs(
        dim=dim,
        n_layers=sizes["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        ffn_dim=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        max_seq_len=n_positions if seq_len is None else seq_len,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        init_std=float(config.get("initializer_range", 0.02)),
    )
    args.shape()  # the head arithmetic the planner needs (PlanError, a ValueError)
    return args


def config_from_args(args: ModelArgs) -> dict[str, Any]:
    """config.json of the project's model, as transformers 5 writes it (untied, float32)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim // args.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "initializer_range": args.init_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / CONFIG).read_text())


# -- reading ----------------------------------------------------------------------------------


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Each stored tensor's safetensors file."""
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / SINGLE).is_file():
        with safe_open(directory / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), directory / SINGLE)
    raise ValueError(f"{directory} has neither {SINGLE} nor {INDEX} (only safetensors are read)")


def _check(
    directory: Path, files: Mapping[str, Path], wanted: Mapping[str, tuple[int, ...]],
    optional: set[str],
) -> None:
    """Every wanted tensor there, floating point and of its shape; nothing else (headers only)."""
    missing = sorted(wanted.keys() - files.keys())
    unexpected = sorted(files.keys() - wanted.keys() - optional)
    if missing or unexpected:
        raise ValueError(f"{directory} does not hold this config's Llama: missing {missing}, "
                         f"unexpected {unexpected}")
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt"))
                   for p in set(files[n] for n in wanted)}
        for name, shape in wanted.items():
            stored = handles[files[name]].get_slice(name)
            if tuple(stored.get_shape()) != shape or stored.get_dtype() not in FLOATS:
                raise ValueError(
                    f"{directory}: {name} is {stored.get_dtype()} {tuple(stored.get_shape())}, "
                    f"config.json says a float tensor of shape {shape}"
                )


def read_llama(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a Hugging Face Llama directory (config.json and safetensors, one file or
    sharded) under the project's names and RoPE order, float32, one tensor at a time.

    The directory is checked before anything is read: a ValueError names what is missing or
    unexpected."""
    config = read_config(directory)
    args = args_from_config(config)
    tied = bool(config.get("tie_word_embeddings", False))
    files = _tensor_files(directory)
    params = parameter_shapes(args)
    # project name -> the stored tensor it comes from (a tied head: the embedding)
    source = {name: hf_name(name) for name in params}
    if tied:
        source["output.weight"] = hf_name("tok_embeddings.weight")
    shapes = {hf_name(name): shape for name, shape in params.items()
              if not (tied and name == "output.weight")}
    optional = {name for name in files if name.endswith(DERIVED)}
    if tied:
        optional.add(hf_name("output.weight"))  # transformers ignores it when tied
    _check(directory, files, shapes, optional)
    return _stream(files, source, args)


def _stream(
    files: Mapping[str, Path], source: Mapping[str, str], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, stored in source.items():
            path = files[stored]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            t = handles[path].get_tensor(stored).to(torch.float32)
            if stored != hf_name(name):  # a tied head: a copy of the embedding, not its storage
                t = t.clone()
            yield name, from_hf(name, t, args).contiguous()


# -- writing ----------------------------------------------------------------------------------


def _shard_bytes(shard: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in shard.values())


def write_llama(
    directory: Path,
    args: ModelArgs,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """A Hugging Face Llama directory of the project's weights: safetensors shards of at most
    `max_shard_bytes` (a larger tensor alone), their index when more than one, then config.json.

    config.json is written last and atomically: a directory without it is an unfinished export
    that transformers does not load. The directory must be new or empty."""
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: export into a new or empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    shapes = parameter_shapes(args)
    # 1. Shards under provisional names, each written once full.
    written: list[tuple[Path, list[str], int]] = []
    shard: dict[str, torch.Tensor] = {}
    seen: set[str] = set()

    def flush() -> None:
        path = directory / f"shard-{len(written) + 1:05d}.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard), _shard_bytes(shard)))
        shard.clear()

    for name, t in tensors:
        if name in seen or shapes.get(name) != tuple(t.shape):
            raise ValueError(f"{name} {tuple(t.shape)} comes twice or is not a parameter of "
                             "this model")
        seen.add(name)
        key, value = to_hf(name, t.detach().to("cpu", torch.float32), args)
        value = value.contiguous()
        if shard and _shard_bytes(shard) + value.numel() * value.element_size() > max_shard_bytes:
            flush()
        shard[key] = value
    if missing := sorted(shapes.keys() - seen):
        raise ValueError(f"the weights lack {missing}: nothing exported")
    flush()
    # 2. Final names, and the index that lists them when there are several.
    if len(written) == 1:
        os.replace(written[0][0], directory / SINGLE)
    else:
        weight_map = {}
        for k, (path, names, _) in enumerate(written, 1):
            file = f"model-{k:05d}-of-{len(written):05d}.safetensors"
            os.replace(path, directory / file)
            weight_map |= dict.fromkeys(names, file)
        total = sum(size for _, _, size in written)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    # 3. config.json: from here on the directory is a complete model.
    partial = directory / f"{CONFIG}.partial"
    partial.write_text(json.dumps(config_from_args(args), indent=2) + "\n")
    os.replace(partial, directory / CONFIG)


# -- the commands ------------------------------------------------------------------------------


def _fail(command: str, exc: BaseException) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"tessera {command}: {message}", file=sys.stderr)
    return 2


ERRORS = (OSError, ValueError, SafetensorError)


def import_main(argv: list[str] | None = None) -> int:
    """`tessera import-hf HF_DIR CHECKPOINT_DIR [--seq-len N]`: a job's initial checkpoint."""
    parser = argparse.ArgumentParser(
        prog="tessera import-hf",
        description="Write a Hugging Face Llama directory as the first checkpoint (step 0) of a "
        "job's checkpoint directory: the project's names, RoPE order and float32.",
    )
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    parser.add_argument("checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR")
    parser.add_argument("--seq-len", type=int,
                        help="the job's sequence length (default: max_position_embeddings)")
    opts = parser.parse_args(argv)
    try:
        args = args_from_config(read_config(opts.hf_dir), opts.seq_len)
        existing = checkpoint.latest(opts.checkpoint_dir)
        if existing is not None:
            raise ValueError(f"{opts.checkpoint_dir} already holds checkpoint {existing}: "
                             "import into a new job's checkpoint directory")
        path = checkpoint.write_dense(opts.checkpoint_dir, read_llama(opts.hf_dir), args, step=0)
    except ERRORS as exc:
        return _fail("import-hf", exc)
    print(f"tessera import-hf: wrote {path} (spec.model: {json.dumps(args.shape().to_spec())})")
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """`tessera export-hf CHECKPOINT OUT_DIR`: a checkpoint's weights as a Hugging Face Llama."""
    parser = argparse.ArgumentParser(
        prog="tessera export-hf",
        description="Write a checkpoint's weights as a Hugging Face Llama directory "
        "(config.json, safetensors). CHECKPOINT: one checkpoint, or a job's checkpoint "
        "directory (its newest complete checkpoint).",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    opts = parser.parse_args(argv)
    try:
        ckpt = checkpoint.latest(opts.checkpoint)
        if ckpt is None:
            raise ValueError(f"{opts.checkpoint} holds no complete checkpoint")
        write_llama(opts.out_dir, checkpoint.read_args(ckpt), checkpoint.iter_dense(ckpt, "model"))
    except ERRORS as exc:
        return _fail("export-hf", exc)
    print(f"tessera export-hf: wrote {opts.out_dir} from {ckpt}")
    return 0
