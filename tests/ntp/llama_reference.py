"""A Llama-style decoder written from its equations, independent of `ntp.model`, for checking it.

Everything is spelled out on plain tensors: RMSNorm (Zhang & Sennrich 2019), rotary position
embedding on consecutive pairs (Su et al. 2021, as in the Llama reference code), grouped-query
attention with a causal mask (Ainslie et al. 2023), the SwiGLU MLP (Shazeer 2020), an untied LM
head and the mean next-token cross entropy. Parameters are a flat dict under the Llama checkpoint
names (`layers.{i}.attention.wq.weight`, ...; a linear map's weight is (out, in), applied as
x @ W.T), so a state dict of `ntp.model` loads into it by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Config:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape."""
        hd = self.head_dim
        per_layer = {
            "attention_norm.weight": (self.dim,),
            "attention.wq.weight": (self.n_heads * hd, self.dim),
            "attention.wk.weight": (self.n_kv_heads * hd, self.dim),
            "attention.wv.weight": (self.n_kv_heads * hd, self.dim),
            "attention.wo.weight": (self.dim, self.n_heads * hd),
            "ffn_norm.weight": (self.dim,),
            "feed_forward.w1.weight": (self.ffn_dim, self.dim),
            "feed_forward.w3.weight": (self.ffn_dim, self.dim),
            "feed_forward.w2.weight": (self.dim, self.ffn_dim),
        }
        shapes = {"tok_embeddings.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            shapes |= {f"layers.{i}.{name}": shape for name, shape in per_layer.items()}
        return shapes | {"norm.weight": (self.dim,), "output.weight": (self.vocab_size, self.dim)}


def random_params(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter random in float64, norm gains included (uniform in [0.5, 1.5], not 1).

    Matrices are scaled by 1/sqrt(fan_in) so that activations, attention scores and logits stay of
    order one: softmax is not saturated and no stage is badly conditioned.
    """
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in cfg.shapes().items():
        if name.endswith("norm.weight"):
            params[name] = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)
        else:
            scale = 1.0 if name == "tok_embeddings.weight" else shape[1] ** -0.5
            params[name] = scale * torch.randn(shape, generator=gen, dtype=torch.float64)
    return params


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x_i^2) + eps) * g, over the last dimension."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gain


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) at position m by the angle m * theta^(-2i/d).

    x: (batch, seq, heads, d).
    """
    seq, d = x.shape[1], x.shape[-1]
    position = torch.arange(seq, dtype=torch.float64).view(seq, 1)
    frequency = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = (position * frequency).view(1, seq, 1, d // 2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).reshape(x.shape)


def attention(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Causal grouped-query attention: query head h reads KV head h // (n_heads / n_kv_heads)."""
    batch, seq, _ = x.shape
    hd = cfg.head_dim
    q = rotary((x @ p["wq"].T).view(batch, seq, cfg.n_heads, hd), cfg.rope_theta)
    k = rotary((x @ p["wk"].T).view(batch, seq, cfg.n_kv_heads, hd), cfg.rope_theta)
    v = (x @ p["wv"].T).view(batch, seq, cfg.n_kv_heads, hd)
    kv_of_head = [h * cfg.n_kv_heads // cfg.n_heads for h in range(cfg.n_heads)]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)  # key after query
    heads = []
    for h, g in enumerate(kv_of_head):
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, g]) / math.sqrt(hd)
        scores = scores.masked_fill(future, -math.inf)
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        heads.append(torch.einsum("bij,bjd->bid", weights, v[:, :, g]))
    return torch.cat(heads, dim=-1) @ p["wo"].T


def swiglu(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """W2 (silu(W1 x) * W3 x), silu(z) = z * sigmoid(z)."""
    gate = x @ p["w1"].T
    return (gate / (1 + torch.exp(-gate)) * (x @ p["w3"].T)) @ p["w2"].T


def forward(params: dict[str, torch.Tensor], cfg: Config, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (batch, seq, vocab) of token ids (batch, seq), pre-norm residual blocks."""
    h = params["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layers):
        layer = {
            name.rsplit(".", 2)[-2]: value
            for name, value in params.items()
            if name.startswith(f"layers.{i}.")
        }
        h = h + attention(rms_norm(h, layer["attention_norm"], cfg.norm_eps), layer, cfg)
        h = h + swiglu(rms_norm(h, layer["ffn_norm"], cfg.norm_eps), layer)
    return rms_norm(h, params["norm.weight"], cfg.norm_eps) @ params["output.weight"].T


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over positions of log(sum_j exp(z_j)) - z_target."""
    top = logits.amax(dim=-1, keepdim=True)
    log_total = top.squeeze(-1) + torch.log(torch.exp(logits - top).sum(dim=-1))
    return (log_total - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()
