"""How far two correct evaluations of the trainer's model may be apart: unit roundoffs and the
operations on the longest dependency path of a model's forward and backward (shared by the tests
against independent references and against transformers)."""

from __future__ import annotations

from ntp.model import ModelArgs

FLOAT64_ROUNDING = 2.0**-53  # unit roundoff
FLOAT32_ROUNDING = 2.0**-24


def rounding_bound(args: ModelArgs, batch: int) -> float:
    """Relative difference two correct float64 evaluations of the loss, logits or a gradient may
    show: 2 (two implementations) x unit roundoff x the operations on the longest dependency path.

    A reduction of n terms rounds at most n times (each relative to its terms' magnitude), an
    elementwise step a few times. Forward, per layer: two RMSNorms (dim + 3 each), the Q/K/V, O,
    gate/up projections (dim each) and the down projection (ffn), RoPE (2), scores (head_dim + 1),
    softmax (seq + 3), weights x V (seq), SiLU and product (4), two residual adds; then the final
    norm, the LM head (dim) and the loss (log-sum-exp over vocab + 3, mean over batch x seq).
    Backward retraces that path and sums each weight gradient over batch x seq positions. With
    parameters scaled by 1/sqrt(fan_in) every stage is well conditioned, so the bound holds
    relative to the largest magnitude of the compared tensor.

    The families add to a layer's path: a QKV bias (1), a QK norm on each head (head_dim + 3),
    and the O projection sums heads x head_dim products (hidden, unless head_dim is explicit).
    """
    hd = args.head_dim
    seq = args.max_seq_len
    qkv = args.dim + args.qkv_bias + (hd + 3 if args.qk_norm else 0)
    per_layer = (2 * (args.dim + 3) + qkv + args.n_heads * hd + 2 * args.dim + args.ffn_dim + 2
                 + hd + 1 + 2 * seq + 3 + 4 + 2)
    forward = args.n_layers * per_layer + args.dim + 3 + args.dim + args.vocab_size + 3
    return 2 * FLOAT64_ROUNDING * (2 * forward + 2 * batch * seq)
