"""The model families the trainer computes, as transformers defines them: tiny random models built
and saved locally (nothing is downloaded), transformers' own code run in float64 as the
reference, and the rounding bound a float32 evaluation stays within.

Each family has a shape no other test uses, and a head count no TP degree of 3 divides, so a TP3
replica splits its query heads unevenly across KV groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rounding import FLOAT32_ROUNDING, FLOAT64_ROUNDING, rounding_bound
from torch.overrides import TorchFunctionMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.utils import logging as hf_logging

from ntp import hf
from ntp.model import ModelArgs, parameter_shapes

hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class Family:
    config: type
    model: type
    module: Any  # transformers' modeling module (its RMSNorm and rotary embedding classes)
    prefix: str
    shape: dict[str, Any]

    def build(self, seed: int, **extra: Any) -> PreTrainedModel:
        """The family's model with every weight random, float32: matrices N(0, 1/fan_in), the
        embedding N(0, 1), biases N(0, 1/4), norm gains uniform in [0.5, 1.5] (QK norms
        included), so activations, scores and logits stay of order one."""
        model = self.model(self.config(**self.shape | extra, attn_implementation="eager"))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(0.25 * torch.randn(p.shape, generator=gen))
                else:
                    scale = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                    p.copy_(scale * torch.randn(p.shape, generator=gen))
        return model


FAMILIES = {
    # Llama 3.1: llama3 RoPE scaling. head_dim 16 has wavelengths on all three sides of the
    # scaled band (original 1024: kept below 256, interpolated up to 1024, slowed above).
    "llama3.1": Family(LlamaConfig, LlamaForCausalLM, modeling_llama, "Llama", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=88,
        vocab_size=71, num_hidden_layers=2, max_position_embeddings=20, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024},
    )),
    # Qwen2.5: QKV biases, a tied head, 7 query heads on one KV head.
    "qwen2.5": Family(Qwen2Config, Qwen2ForCausalLM, modeling_qwen2, "Qwen2", dict(
        hidden_size=56, num_attention_heads=7, num_key_value_heads=1, intermediate_size=96,
        vocab_size=83, num_hidden_layers=2, max_position_embeddings=18, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )),
    # Qwen3: per-head QK norms, head_dim 10 where hidden / heads is 6, a tied head.
    "qwen3": Family(Qwen3Config, Qwen3ForCausalLM, modeling_qwen3, "Qwen3", dict(
        hidden_size=48, num_attention_heads=8, num_key_value_heads=2, head_dim=10,
        intermediate_size=72, vocab_size=89, num_hidden_layers=2, max_position_embeddings=16,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )),
    # Mistral: a sliding window no shorter than the sequence, head_dim 8 where hidden / heads
    # is 6.
    "mistral": Family(MistralConfig, MistralForCausalLM, modeling_mistral, "Mistral", dict(
        hidden_size=60, num_attention_heads=10, num_key_value_heads=5, head_dim=8,
        intermediate_size=100, vocab_size=79, num_hidden_layers=2, max_position_embeddings=22,
        sliding_window=22, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}


def save(model: PreTrainedModel, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(directory)
    model.float()
    return directory


class _Float64(TorchFunctionMode):
    """transformers' RoPE frequency code run in float64: the float32 it asks for explicitly
    becomes float64, and nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_transformers(monkeypatch) -> Iterator[None]:
    """transformers' models computed in float64 throughout.

    Whatever the model's dtype, transformers 5.24 rounds three stages to float32 in every family
    (models/*/modeling_*.py): RMSNorm (`hidden_states.to(torch.float32)`, the QK norms too), the
    RoPE table (inverse frequencies and angles in float32) and the eager softmax
    (`dtype=torch.float32`). Those would put float32 rounding into the reference, so here the
    same equations run in the input's dtype: the norms' formula, the frequencies from
    transformers' own rope functions (llama3's scaling included) evaluated in float64, the
    softmax widened; everything else (names, q/k layout, rotate_half, biases, QK norms' place,
    GQA repeat, SwiGLU, residuals, the tied head) stays transformers' own code.
    """

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    def rotary(self, x, position_ids):
        init = (self.compute_default_rope_parameters if self.rope_type == "default"
                else ROPE_INIT_FUNCTIONS[self.rope_type])
        with _Float64():
            inv_freq, scaling = init(self.config, device=x.device)
        assert inv_freq.dtype == torch.float64
        angles = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    softmax = F.softmax

    def wide_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim, dtype=None if dtype is None else torch.promote_types(x.dtype, dtype))

    for family in FAMILIES.values():
        monkeypatch.setattr(getattr(family.module, f"{family.prefix}RMSNorm"), "forward",
                            rms_norm)
        monkeypatch.setattr(getattr(family.module, f"{family.prefix}RotaryEmbedding"),
                            "forward", rotary)
    monkeypatch.setattr(modeling_llama.nn.functional, "softmax", wide_softmax)
    yield


def batch(vocab: int, seq: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def reference_run(
    model: PreTrainedModel, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """transformers' logits and mean next-token loss (torch's cross entropy over its logits,
    whose own `labels=` loss rounds them to float32 first), and every weight's gradient by
    transformers' name (a tied head's is the embedding's)."""
    model.zero_grad()
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": loss.detach()}, grads


def in_project_order(args: ModelArgs, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gradients (by its names) under the project's names and row order."""
    names = {hf.hf_name(n): n for n in parameter_shapes(args)}
    return {names[k]: hf.from_hf(names[k], g, args) for k, g in grads.items()}


def float32_bound(args: ModelArgs, rows: int, extra_operations: int = 0) -> float:
    """One float32 evaluation against a float64 one, relative to the compared tensor's largest
    magnitude: `rounding_bound` counts the operations on the longest dependency path N (and
    allows 2 u64 per operation, two float64 evaluations); here each one rounds at most at u32
    on one side and u64 on the other. `extra_operations`: what a layout adds to the path."""
    operations = rounding_bound(args, rows) / (2 * FLOAT64_ROUNDING) + extra_operations
    return (FLOAT32_ROUNDING + FLOAT64_ROUNDING) * operations


def rel_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Largest difference relative to the largest magnitude of `scale` (default `want`)."""
    reference = want if scale is None else scale
    return float((got.double() - want.double()).abs().max() / reference.abs().max())
