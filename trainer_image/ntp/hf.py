"""The Hugging Face format of the families the trainer computes (Llama 2/3.x, Mistral, Qwen2/2.5,
Qwen3): tensor names, the RoPE row order, config.json to and from the model's arguments, and what
a Hugging Face directory holds (docs/huggingface.md).

RoPE. The project rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's Llama
reference code; transformers rotates the halves (x[i], x[i + d/2]) (`rotate_half`). The same
model is then the same weights with the rows that feed RoPE reordered within each head, as
transformers' convert_llama_weights_to_hf.py does (its `permute`): the Hugging Face row
j * d/2 + i of a head is the project's row 2i + j. That is wq and wk, their biases, and the QK
norms' gains (one head's worth, applied before RoPE); never wv or wo. It never moves a row to
another head, so a rank that holds some heads holds the same heads' rows in either order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ntp.model import ModelArgs
from tessera_contracts.model_shape import PlanError, RopeScaling

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOATS = {"BF16", "F16", "F32", "F64"}  # safetensors' dtype names that widen to float32
# model_type -> the transformers class of a causal LM of that family
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The classes' defaults for keys a config.json may leave out where the families differ
# (transformers 5.24, configuration_*.py).
KV_HEADS_DEFAULT = {"llama": None, "mistral": 8, "qwen2": 32, "qwen3": 32}  # None: heads
HEAD_DIM_DEFAULT = {"qwen3": 128}  # others: hidden_size // num_attention_heads
MISTRAL_WINDOW_DEFAULT = 4096

# project name within a layer -> transformers' (under model.layers.{i}.)
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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
# What a Hugging Face directory holds besides the model, carried from the one a job starts from
# to its exports: the tokenizer (in any of its formats) and the generation defaults.
CARRIED = re.compile(
    r"(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|.*\.tiktoken|chat_template\.(jinja|json)|generation_config\.json)"
)
_ROTATED = (
    "attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
    "attention.q_norm.weight", "attention.k_norm.weight",
)


# -- names and the RoPE row order ---------------------------------------------------------------


def hf_name(name: str) -> str:
    """transformers' name of a project parameter."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{LAYER_NAMES[rest]}"


def is_rotated(name: str) -> bool:
    """Whether `name`'s rows (whole heads of head_dim rows) feed RoPE, so are reordered."""
    return name.endswith(_ROTATED)


def pairs_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from the interleaved-pairs order to transformers' halves order."""
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def halves_to_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `pairs_to_halves`."""
    heads = w.shape[0] // head_dim
    return w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def copy_from_hf(out: torch.Tensor, stored: torch.Tensor, name: str, head_dim: int) -> None:
    """Write rows transformers holds (whole heads for a rotated tensor) into `out`, the same
    rows in the project's order, converting the dtype; no copy of the rows besides `out`."""
    if not is_rotated(name):
        out.copy_(stored)
        return
    heads, rest = out.shape[0] // head_dim, out.shape[1:]
    out.view(heads, head_dim // 2, 2, *rest).copy_(
        stored.view(heads, 2, head_dim // 2, *rest).transpose(1, 2))


def to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """A project tensor (weight or gradient) as transformers names and orders it."""
    return hf_name(name), pairs_to_halves(t, args.head_dim) if is_rotated(name) else t


def from_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The tensor transformers holds for project parameter `name`, in the project's order."""
    return halves_to_pairs(t, args.head_dim) if is_rotated(name) else t


# -- config.json ------------------------------------------------------------------------------


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: {field} is {value!r}; {why}")


def _rope(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str, float]:
    """(RoPE parameters, type, theta): transformers 5 writes them under `rope_parameters`, older
    versions `rope_theta` and `rope_scaling` at the top."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    return params, kind, float(theta)


def _rope_scaling(params: Mapping[str, Any], kind: str, n_positions: int) -> RopeScaling | None:
    if kind == "default":
        return None
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse("rope_parameters.partial_rotary_factor", params["partial_rotary_factor"],
                      "the trainer rotates every element of a head")
    try:
        if kind == "llama3":
            return RopeScaling("llama3", float(params["factor"]),
                               float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                               int(params["original_max_position_embeddings"]))
        if kind == "linear":
            return RopeScaling("linear", float(params["factor"]))
        if kind == "dynamic":  # transformers' threshold is max_position_embeddings
            return RopeScaling("dynamic", float(params["factor"]),
                               original_max_position_embeddings=n_positions)
    except KeyError as exc:
        raise ValueError(f"config.json: rope_parameters lacks {exc.args[0]} (rope_type "
                         f"{kind})") from None
    except PlanError as exc:
        raise ValueError(f"config.json: rope_parameters: {exc}") from None
    raise _refuse("rope_parameters.rope_type", kind,
                  "only default, llama3, linear and dynamic RoPE are implemented (the others "
                  "change the frequencies or the attention scale in ways the trainer does not)")


def args_from_config(config: Mapping[str, Any], seq_len: int | None = None) -> ModelArgs:
    """The project's model of a config.json; a ValueError of one line names what the trainer
    does not compute (it would load and train another model)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise _refuse("model_type", family, f"only {', '.join(FAMILIES)} are imported")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", config["hidden_act"], "the trainer's MLP is SwiGLU (silu)")
    if config.get("mlp_bias", False):
        raise _refuse("mlp_bias", config["mlp_bias"], "the trainer's MLP has no bias")
    if family != "qwen2" and config.get("attention_bias", False):
        raise _refuse("attention_bias", config["attention_bias"],
                      "it also biases o_proj, which the trainer's attention does not have")
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window", False):
        raise _refuse("use_sliding_window", True,
                      "per-layer sliding windows (max_window_layers) are not implemented")
    if any(kind != "full_attention" for kind in config.get("layer_types") or ()):
        raise _refuse("layer_types", config["layer_types"],
                      "only full attention on every layer is implemented")
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        n_positions = int(config["max_position_embeddings"])
        sizes = {name: int(config[name])
                 for name in ("num_hidden_layers", "intermediate_size", "vocab_size")}
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]}") from None
    params, kind, theta = _rope(config)
    scaling = _rope_scaling(params, kind, n_positions)
    if seq_len is not None and not 0 < seq_len <= n_positions:
        raise ValueError(
            f"sequence length {seq_len} is outside 1..{n_positions} (max_position_embeddings)"
        )
    window = None
    if family == "mistral":
        window = config.get("sliding_window", MISTRAL_WINDOW_DEFAULT)
    # by default the longest sequence the model trains on unchanged
    seq = min(n_positions, window or n_positions) if seq_len is None else seq_len
    if window is not None and seq > window:
        raise _refuse("sliding_window", window,
                      f"shorter than the sequence length {seq}: the trainer attends to the "
                      "whole sequence (pass --seq-len at most the window)")
    kv_heads = config.get("num_key_value_heads", KV_HEADS_DEFAULT[family]) or n_heads
    head_dim = config.get("head_dim", HEAD_DIM_DEFAULT.get(family)) or dim // n_heads
    args = ModelArgs(
        dim=dim,
        n_layers=sizes["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=int(kv_heads),
        ffn_dim=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        max_seq_len=seq,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        init_std=float(config.get("initializer_range", 0.02)),
        head_dim=int(head_dim),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=None if window is None else int(window),
        rope_scaling=scaling,
    )
    try:
        args.shape()  # the head arithmetic the planner needs
    except PlanError as exc:
        raise ValueError(f"config.json: {exc}") from None
    return args


def family_of(args: ModelArgs) -> str:
    """The model_type whose transformers class computes the project's model: Qwen3 for QK norms,
    Qwen2 for QKV biases, Mistral for a sliding window, else Llama."""
    if args.qk_norm and args.qkv_bias:
        raise ValueError("no Hugging Face family has QKV biases and QK norms (Qwen3's "
                         "attention_bias also biases o_proj): nothing to export to")
    if args.qk_norm:
        return "qwen3"
    if args.qkv_bias:
        return "qwen2"
    return "mistral" if args.sliding_window is not None else "llama"


def _rope_parameters(args: ModelArgs) -> dict[str, Any]:
    scaling = args.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    params = {"rope_type": scaling.type, "rope_theta": args.rope_theta, "factor": scaling.factor}
    if scaling.type == "llama3":
        params |= {"low_freq_factor": scaling.low_freq_factor,
                   "high_freq_factor": scaling.high_freq_factor,
                   "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return params


def config_from_args(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the project's model, as transformers 5 writes it for the family that
    computes it (`family_of`)."""
    family = family_of(args)
    scaling = args.rope_scaling
    # dynamic scaling starts past max_position_embeddings: the original one, not the job's
    positions = (scaling.original_max_position_embeddings
                 if scaling is not None and scaling.type == "dynamic" else args.max_seq_len)
    config: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": positions,
        "rms_norm_eps": args.norm_eps,
        "initializer_range": args.init_std,
        "rope_parameters": _rope_parameters(args),
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tied_embeddings,
        "dtype": dtype,
    }
    if family in ("llama", "qwen3"):
        config["attention_bias"] = False
    if family == "llama":
        config["mlp_bias"] = False
    if family in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if family == "mistral":
        config["sliding_window"] = args.sliding_window
    return config


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / CONFIG).read_text())


# -- a directory ------------------------------------------------------------------------------


def is_directory(path: Path) -> bool:
    """Whether `path` is a Hugging Face model directory (config.json and safetensors)."""
    return (path / CONFIG).is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def tensor_files(directory: Path) -> dict[str, Path]:
    """Each stored tensor's safetensors file."""
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / SINGLE).is_file():
        with safe_open(directory / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), directory / SINGLE)
    raise ValueError(f"{directory} has neither {SINGLE} nor {INDEX} (only safetensors are read)")


def check_directory(
    directory: Path, files: Mapping[str, Path], args: ModelArgs,
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Every tensor the model needs there, floating point and of its shape; nothing else
    (headers only). A ValueError names what is missing, unexpected or of another shape."""
    wanted = {hf_name(name): shape for name, shape in shapes.items()}
    optional = {name for name in files if name.endswith(DERIVED)}
    if args.tied_embeddings:
        optional.add(hf_name("output.weight"))  # transformers ignores it when tied
    missing = sorted(wanted.keys() - files.keys())
    unexpected = sorted(files.keys() - wanted.keys() - optional)
    if missing or unexpected:
        raise ValueError(f"{directory} does not hold this config's model: missing {missing}, "
                         f"unexpected {unexpected}")
    for path in sorted(set(files[n] for n in wanted)):
        with safe_open(path, framework="pt") as f:
            for name in (n for n in wanted if files[n] == path):
                stored = f.get_slice(name)
                if tuple(stored.get_shape()) != wanted[name] or stored.get_dtype() not in FLOATS:
                    raise ValueError(
                        f"{directory}: {name} is {stored.get_dtype()} "
                        f"{tuple(stored.get_shape())}, config.json says a float tensor of shape "
                        f"{wanted[name]}"
                    )


def carried_files(directory: Path) -> list[Path]:
    """The tokenizer files and generation config of a Hugging Face directory."""
    return sorted(p for p in directory.iterdir() if p.is_file() and CARRIED.fullmatch(p.name))
