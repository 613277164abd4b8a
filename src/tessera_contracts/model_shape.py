"""The decoder a job trains (`spec.model` of the CRD): its dimensions, the units NTP shards it by
(query heads, KV heads, MLP columns, vocabulary rows), and what a model family adds to a Llama
(an explicit head size, QKV biases, per-head QK norms, a tied LM head, RoPE scaling, a sliding
window)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# spec.model's dimensions (the CRD's, and the generation document's names) -> ModelShape's
SPEC_FIELDS = {
    "hidden": "hidden",
    "heads": "n_heads",
    "kvHeads": "n_kv_heads",
    "ffn": "ffn",
    "vocab": "vocab",
    "layers": "n_layers",
    "seqLen": "seq_len",
}
# What a family adds: optional in spec.model, absent meaning a Llama's (no bias, no QK norm,
# an untied head, head size hidden / heads, unscaled RoPE, no window).
FAMILY_FIELDS = {
    "headDim": "head_dim",
    "qkvBias": "qkv_bias",
    "qkNorm": "qk_norm",
    "tiedEmbeddings": "tied_embeddings",
    "slidingWindow": "sliding_window",
    "ropeScaling": "rope_scaling",
}
ROPE_SCALING_FIELDS = {
    "type": "type",
    "factor": "factor",
    "lowFreqFactor": "low_freq_factor",
    "highFreqFactor": "high_freq_factor",
    "originalMaxPositionEmbeddings": "original_max_position_embeddings",
}
ROPE_SCALING_TYPES = ("llama3", "linear", "dynamic")


class PlanError(ValueError):
    """A model shape, TP degree or layout that cannot be planned."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers computes it at training time.

    `llama3` (Llama 3.1+): frequencies whose wavelength exceeds original / low_freq_factor are
    divided by `factor`, those below original / high_freq_factor kept, the band between
    interpolated. `linear`: every frequency divided by `factor`. `dynamic` (NTK): transformers
    rescales the base only for sequences longer than `original_max_position_embeddings`
    (its max_position_embeddings), so a job whose sequences are no longer trains with the
    unscaled frequencies; a longer one is refused (the result would depend on the longest
    sequence the model has seen before)."""

    type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise PlanError(f"ropeScaling.type must be one of {', '.join(ROPE_SCALING_TYPES)}, "
                            f"got {self.type!r}")
        if not _is_number(self.factor) or self.factor < 1:
            raise PlanError(f"ropeScaling.factor must be a number >= 1, got {self.factor!r}")
        needed = {"llama3": ("low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"),
                  "dynamic": ("original_max_position_embeddings",), "linear": ()}[self.type]
        for name in needed:
            if getattr(self, name) is None:
                raise PlanError(f"ropeScaling.{_spec_key(ROPE_SCALING_FIELDS, name)} is needed "
                                f"by ropeScaling.type {self.type}")
        if self.original_max_position_embeddings is not None:
            _check_positive("ropeScaling.originalMaxPositionEmbeddings",
                            self.original_max_position_embeddings)
        if self.type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if not (_is_number(low) and _is_number(high) and 0 < low < high):  # type: ignore
                raise PlanError("ropeScaling needs 0 < lowFreqFactor < highFreqFactor, got "
                                f"{low!r} and {high!r}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RopeScaling:
        unknown = sorted(set(spec) - set(ROPE_SCALING_FIELDS))
        if unknown:
            raise PlanError(f"ropeScaling.{unknown[0]} is not a field of ropeScaling")
        return cls(**{attr: spec[key] for key, attr in ROPE_SCALING_FIELDS.items()
                      if key in spec})

    def to_spec(self) -> dict[str, Any]:
        return {key: getattr(self, attr) for key, attr in ROPE_SCALING_FIELDS.items()
                if getattr(self, attr) is not None}


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """What a family adds to a Llama (the defaults: a Llama's), the same fields wherever a model
    is described (`ModelShape`, the trainer's `ntp.model.ModelArgs`). `head_dim` left out is
    hidden // n_heads; given, the attention is n_heads * head_dim wide, whatever hidden is."""

    head_dim: int = None  # type: ignore[assignment]  # set to hidden // n_heads when not given
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None


@dataclass(frozen=True)
class ModelShape(ModelFamily):
    """A decoder's dimensions, the plan's input, and what its family adds (`ModelFamily`;
    without `head_dim`, hidden must be a multiple of n_heads)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    n_layers: int = 1
    seq_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "n_layers", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"ModelShape.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden % self.n_heads:
                raise PlanError(
                    f"hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        _check_positive("headDim", self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        for name in ("qkv_bias", "qk_norm", "tied_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{_spec_key(FAMILY_FIELDS, name)} must be true or false, got "
                                f"{getattr(self, name)!r}")
        if isinstance(self.rope_scaling, Mapping):  # from asdict(): a layout document
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.sliding_window is not None:
            _check_positive("slidingWindow", self.sliding_window)
            if self.seq_len > self.sliding_window:
                raise PlanError(
                    f"seqLen ({self.seq_len}) is longer than slidingWindow "
                    f"({self.sliding_window}): the trainer attends to the whole sequence, so "
                    "a window shorter than it is another model (not implemented)")
        scaling = self.rope_scaling
        if (scaling is not None and scaling.type == "dynamic"
                and self.seq_len > scaling.original_max_position_embeddings):  # type: ignore
            raise PlanError(
                f"seqLen ({self.seq_len}) is longer than ropeScaling."
                f"originalMaxPositionEmbeddings ({scaling.original_max_position_embeddings}): "
                "dynamic RoPE scaling then depends on the longest sequence transformers has "
                "seen, which training cannot reproduce")

    @classmethod
    def from_spec(cls, model: Mapping[str, Any]) -> ModelShape:
        """From `spec.model` (KeyError names a missing dimension, PlanError a bad value)."""
        values = {attr: model[key] for key, attr in SPEC_FIELDS.items()}
        for key, attr in FAMILY_FIELDS.items():
            if key in model:
                values[attr] = model[key]
        if isinstance(values.get("rope_scaling"), Mapping):
            values["rope_scaling"] = RopeScaling.from_spec(values["rope_scaling"])
        return cls(**values)

    def to_spec(self) -> dict[str, Any]:
        """`spec.model`: the dimensions, and what the family sets other than a Llama's."""
        spec: dict[str, Any] = {key: getattr(self, attr) for key, attr in SPEC_FIELDS.items()}
        llama = {f.name: f.default for f in fields(self) if f.name in FAMILY_FIELDS.values()}
        if self.hidden % self.n_heads == 0:
            llama["head_dim"] = self.hidden // self.n_heads
        for key, attr in FAMILY_FIELDS.items():
            value = getattr(self, attr)
            if value != llama[attr]:
                spec[key] = value.to_spec() if isinstance(value, RopeScaling) else value
        return spec

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_of(self, q_head: int) -> int:
        return q_head // self.group_size

    def unit_count(self, kind: str) -> int:
        return {
            "q_heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "mlp_cols": self.ffn,
            "vocab_rows": self.vocab,
        }[kind]

    def unit_elements(self, kind: str) -> int:
        """Parameter elements of one unit: per layer for layer kinds, per model for vocab rows."""
        bias = self.head_dim if self.qkv_bias else 0
        return {
            "q_heads": 2 * self.head_dim * self.hidden + bias,  # wq rows (+ bias) + wo columns
            "kv_heads": 2 * (self.head_dim * self.hidden + bias),  # wk and wv rows (+ biases)
            "mlp_cols": 3 * self.hidden,  # gate row + up row + down column
            # an embedding row, and the LM head's unless it is the same tensor
            "vocab_rows": (1 if self.tied_embeddings else 2) * self.hidden,
        }[kind]

    def unit_flops(self, kind: str) -> float:
        """Forward FLOPs of one unit over one sequence in one layer (causal attention)."""
        per_token = {
            # Q and O projections, then QK^T and AV over on average seq_len/2 keys.
            "q_heads": 4 * self.hidden * self.head_dim + 2 * self.seq_len * self.head_dim,
            "kv_heads": 4 * self.hidden * self.head_dim,  # K and V projections
            "mlp_cols": 6 * self.hidden,  # gate, up and down
            "vocab_rows": 2 * self.hidden,  # LM head (once per model, not per layer)
        }[kind]
        return float(per_token * self.seq_len)


def _spec_key(names: Mapping[str, str], attr: str) -> str:
    return next(key for key, value in names.items() if value == attr)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{field} must be a positive integer, got {value!r}")
