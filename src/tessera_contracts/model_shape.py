"""The dimensions of a Llama-style decoder (`spec.model` of the CRD), and the units NTP shards
it by: query heads, KV heads, MLP columns and vocabulary rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# spec.model's field names (the CRD's, and the generation document's) -> ModelShape's
SPEC_FIELDS = {
    "hidden": "hidden",
    "heads": "n_heads",
    "kvHeads": "n_kv_heads",
    "ffn": "ffn",
    "vocab": "vocab",
    "layers": "n_layers",
    "seqLen": "seq_len",
}


class PlanError(ValueError):
    """A model shape, TP degree or layout that cannot be planned."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder that the plan needs."""

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
        if self.hidden % self.n_heads:
            raise PlanError(
                f"hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @classmethod
    def from_spec(cls, model: Mapping[str, Any]) -> ModelShape:
        """From `spec.model` (KeyError names a missing field, PlanError a bad value)."""
        return cls(**{attr: model[key] for key, attr in SPEC_FIELDS.items()})

    def to_spec(self) -> dict[str, int]:
        return {key: getattr(self, attr) for key, attr in SPEC_FIELDS.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

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
        return {
            "q_heads": 2 * self.head_dim * self.hidden,  # wq rows + wo columns
            "kv_heads": 2 * self.head_dim * self.hidden,  # wk rows + wv rows
            "mlp_cols": 3 * self.hidden,  # gate row + up row + down column
            "vocab_rows": 2 * self.hidden,  # embedding row + untied LM-head row
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
