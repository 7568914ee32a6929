"""Canon placement A/B/C/D inside a Llama block, against a forward written out from the paper's diagram
(paper §4): x -> RMSNorm -> [A] -> Wqkv -> [B on q|k|v] -> RoPE -> causal softmax attention -> Wo -> +x ->
RMSNorm -> [C] -> W1|W3 -> [D on the concatenation] -> silu(gate) * up -> W2 -> +. Plain loops and explicit
formulas only (no model code), fed the model's own parameters; Canon weights are random so a misplaced or missing
Canon changes the output."""

from __future__ import annotations

import math

import pytest
import torch

from canonlm.arch import LlamaCanon, build_model_config
from canonlm.ops.attention.naive import attention_loop
from canonlm.ops.canon.naive import canon_loop


def rmsnorm(x, g, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rope_pairs(x, theta):
    """x (B, T, H, D): rotate pair (i, i + D/2) of position p by angle p * theta^(-2i/D) (half pairing)."""
    B, T, H, D = x.shape
    out = x.clone()
    for p in range(T):
        for i in range(D // 2):
            a = p * theta ** (-2 * i / D)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[:, p, :, i], x[:, p, :, i + D // 2]
            out[:, p, :, i], out[:, p, :, i + D // 2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


@pytest.mark.parametrize("canon", ["ABCD", "A", "B", "C", "D", "AC", ""])
@pytest.mark.parametrize("pos", ["rope", "nope"])
def test_block_matches_spec_diagram(canon, pos):
    torch.manual_seed(0)
    cfg = build_model_config(
        {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 48},
        {"set": canon},
        {"type": pos},
        vocab_size=11,
        max_seq_len=16,
    )
    model = LlamaCanon(cfg).double()
    with torch.no_grad():  # every gain and Canon weight away from its init, so each one matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    blk = model.blocks[0]
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cos = sin = None
    if pos == "rope":  # exact float64 tables from the formula (the model caches float32 ones)
        ang = torch.outer(
            torch.arange(9, dtype=torch.float64), cfg.pos.theta ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        )
        cos, sin = ang.cos(), ang.sin()
    got = blk(x, cos, sin)

    H, D, F_ = 2, 16, 48
    h = rmsnorm(x, blk.attn_norm.weight, cfg.norm_eps)
    h = canon_loop(h, blk.canon_a.weight) if "A" in canon else h
    qkv = h @ blk.attn.wqkv.weight.T
    qkv = canon_loop(qkv, blk.attn.canon_b.weight) if "B" in canon else qkv
    q, k, v = (t.unflatten(-1, (H, D)) for t in qkv.split(H * D, dim=-1))
    if pos == "rope":
        q, k = rope_pairs(q, cfg.pos.theta), rope_pairs(k, cfg.pos.theta)
    x1 = x + attention_loop(q, k, v).flatten(2) @ blk.attn.wo.weight.T
    h2 = rmsnorm(x1, blk.mlp_norm.weight, cfg.norm_eps)
    h2 = canon_loop(h2, blk.canon_c.weight) if "C" in canon else h2
    u = h2 @ blk.mlp.w13.weight.T
    u = canon_loop(u, blk.mlp.canon_d.weight) if "D" in canon else u
    gate, up = u[..., :F_], u[..., F_:]
    want = x1 + (torch.nn.functional.silu(gate) * up) @ blk.mlp.w2.weight.T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
