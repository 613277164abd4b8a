"""The dense model against a from-scratch reference of the same equations."""

from __future__ import annotations

import math

import torch

from ntp.model import FLAVORS, build_model


def reference_forward(model, tokens):
    """Textbook Llama forward with explicit per-head loops (no SDPA, no index tricks)."""
    args = model.args
    hd = args.dim // args.n_heads
    group = args.n_heads // args.n_kv_heads
    seq = tokens.shape[1]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.norm_eps) * w

    def rope(x):  # x: (bs, seq, hd)
        pos = torch.arange(seq, dtype=torch.float32)[:, None]
        freqs = args.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        cos, sin = torch.cos(pos * freqs), torch.sin(pos * freqs)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = model.tok_embeddings.weight[tokens]
    for layer in model.layers:
        att = layer.attention
        x = rms(h, layer.attention_norm.weight)
        heads = []
        for i in range(args.n_heads):
            g = i // group
            q = rope(x @ att.wq.weight[i * hd : (i + 1) * hd].T)
            k = rope(x @ att.wk.weight[g * hd : (g + 1) * hd].T)
            v = x @ att.wv.weight[g * hd : (g + 1) * hd].T
            scores = q @ k.transpose(1, 2) / math.sqrt(hd) + mask
            heads.append(torch.softmax(scores, -1) @ v)
        h = h + torch.cat(heads, -1) @ att.wo.weight.T
        x = rms(h, layer.ffn_norm.weight)
        ff = layer.feed_forward
        gate = x @ ff.w1.weight.T
        h = h + (gate * torch.sigmoid(gate) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    return rms(h, model.norm.weight) @ model.output.weight.T


def test_dense_model_matches_reference_equations():
    model = build_model(FLAVORS["debug"], seed=3)
    tokens = torch.randint(0, model.args.vocab_size, (2, model.args.max_seq_len))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference_forward(model, tokens))


def test_seeded_init_is_reproducible_and_seed_dependent():
    a, b, c = (build_model(FLAVORS["debug"], seed=s) for s in (1, 1, 2))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
