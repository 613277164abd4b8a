"""Llama-style decoder in plain PyTorch: RMSNorm, RoPE, GQA attention, SwiGLU MLP, LM head, and
what the families built on it add: an explicit head size, QKV biases (Qwen2), per-head QK norms
(Qwen3), a tied LM head, scaled RoPE (Llama 3.1+).

Parallelism is applied afterwards by `ntp.parallelize`; nothing here knows about ranks. The
attention maps each (local) query head to its KV head through the `kv_index` buffer, so the same
module runs the dense model and any subset of heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from tessera_contracts.model_shape import FAMILY_FIELDS, ModelFamily, ModelShape, RopeScaling


@dataclass(frozen=True)
class ModelArgs(ModelFamily):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    vocab_size: int = 128256
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, Mapping):  # as a checkpoint's tessera.json holds it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @classmethod
    def of_shape(cls, shape: ModelShape) -> ModelArgs:
        """The model of a plan's shape, with the defaults for what a shape does not say."""
        return cls(dim=shape.hidden, n_layers=shape.n_layers, n_heads=shape.n_heads,
                   n_kv_heads=shape.n_kv_heads, ffn_dim=shape.ffn, vocab_size=shape.vocab,
                   max_seq_len=shape.seq_len,
                   **{attr: getattr(shape, attr) for attr in FAMILY_FIELDS.values()})

    def shape(self) -> ModelShape:
        """The plan's view of this model (validates the head arithmetic)."""
        return ModelShape(
            hidden=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn=self.ffn_dim,
            vocab=self.vocab_size,
            n_layers=self.n_layers,
            seq_len=self.max_seq_len,
            **{attr: getattr(self, attr) for attr in FAMILY_FIELDS.values()},
        )


# Tiny flavors for CPU tests and benchmarks.
FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=48, n_layers=2, n_heads=12, n_kv_heads=4, ffn_dim=40, vocab_size=64, max_seq_len=16
    ),
    "bench": ModelArgs(
        dim=256, n_layers=2, n_heads=16, n_kv_heads=4, ffn_dim=768, vocab_size=512, max_seq_len=64
    ),
    "llama3-8b": ModelArgs(),
}


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in its own dtype if wider: half precision is upcast, float64 stays."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Each rotated pair's inverse frequency, float64, scaled as transformers scales it at
    training time (`modeling_rope_utils`)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    # dynamic: transformers keeps the unscaled frequencies up to the original length, which
    # bounds a job's sequences (ModelShape)
    if scaling is None or scaling.type == "dynamic":
        return freqs
    if scaling.type == "linear":
        return freqs / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between smoothed
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    assert original is not None and low is not None and high is not None  # RopeScaling checks
    wavelen = 2 * math.pi / freqs
    slowed = torch.where(wavelen > original / low, freqs / scaling.factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, slowed)


def precompute_rope(
    head_dim: int, seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Complex rotations, (seq_len, head_dim // 2), in double precision (each use rounds them to
    its own precision, so a float64 model gets float64 angles)."""
    # On the CPU even while a model is built on the meta device: the rotations are computed,
    # never initialized or loaded.
    with torch.device("cpu"):
        freqs = rope_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
        return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (bs, seqlen, n_heads, head_dim)
    xc = torch.view_as_complex(at_least_fp32(x).reshape(*x.shape[:-1], -1, 2))
    rot = rope[: x.shape[1]].view(1, x.shape[1], 1, -1).to(xc.dtype)
    return torch.view_as_real(xc * rot).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = at_least_fp32(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, width, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.wo = nn.Linear(width, args.dim, bias=False)
        # One gain per head element, shared by every head (so every rank holds all of it).
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        group = args.n_heads // args.n_kv_heads
        # Local KV head index of each local query head (dense: repeat each KV head `group` times).
        self.register_buffer("kv_index", torch.arange(args.n_heads) // group, persistent=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_local_heads, hd)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_local_kv, hd)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        k = k.index_select(2, self.kv_index)  # (bs, seqlen, n_local_heads, hd)
        v = v.index_select(2, self.kv_index)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (bs, n_local_heads, seqlen, hd)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tied_embeddings:
            # One parameter (named tok_embeddings.weight), its gradient the sum of both uses;
            # a state dict holds it once too.
            self.output.weight = self.tok_embeddings.weight
            self.register_state_dict_post_hook(_without_tied_head)
            self.register_load_state_dict_pre_hook(_with_tied_head)
        self.register_buffer(
            "rope",
            precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling),
            persistent=False,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (bs, seqlen) -> logits (bs, seqlen, vocab)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def _without_tied_head(module: nn.Module, state: dict, prefix: str, _metadata: object) -> None:
    state.pop(f"{prefix}output.weight", None)


def _with_tied_head(module: nn.Module, state: dict, prefix: str, *_: object) -> None:
    if f"{prefix}tok_embeddings.weight" in state:
        state.setdefault(f"{prefix}output.weight", state[f"{prefix}tok_embeddings.weight"])


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all positions."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets.flatten())


@cache
def parameter_shapes(args: ModelArgs) -> Mapping[str, tuple[int, ...]]:
    """Every parameter of the dense model and its shape, in the model's order (nothing
    allocated: built on the meta device); a tied LM head is the embedding, listed once."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
