"""Attention op and RoPE against explicit formulas (SDPA, flash-attn; RoPE: Su et al. 2021)."""

from __future__ import annotations

import math

import pytest
import torch

from canonlm.arch import (
    ConfigError,
    LlamaCanon,
    apply_rope,
    build_model_config,
    interleaved_to_half_permutation,
    rope_angles,
)
from canonlm.ops.attention import attention, flash_available, resolve_backend
from canonlm.ops.attention.naive import attention_loop


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_loop(backend, H, Hkv, causal):
    torch.manual_seed(H * 10 + Hkv)
    B, T, D = 2, 7, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    out = attention(q, k, v, causal=causal, backend=backend)
    assert out.shape == (B, T, H, D) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), attention_loop(q, k, v, causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_attention_custom_scale_and_strided_views(backend):
    torch.manual_seed(1)
    B, T, H, Hkv, D = 2, 6, 4, 2, 8
    qkv = torch.randn(B, T, H + 2 * Hkv, D)  # views of one fused projection, as the model passes them
    q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
    out = attention(q, k, v, scale=0.3, backend=backend)
    torch.testing.assert_close(out.double(), attention_loop(q, k, v, True, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_attention_bf16(backend):
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 16, 4, 16), torch.randn(1, 16, 2, 16), torch.randn(1, 16, 2, 16)
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), attention_loop(q, k, v), rtol=0.05, atol=0.05)


def test_attention_bad_input():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="H % H_kv"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="backend"):
        attention(q, q, q, backend="xformers")
    with pytest.raises(ValueError, match="flash"):
        attention(q, q, q, backend="flash")


def test_resolve_backend():
    assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
    assert resolve_backend("fused", "cpu", torch.bfloat16) == "sdpa"
    assert resolve_backend("reference", "cpu", torch.float32) == "reference"
    with pytest.raises(ConfigError) as e:
        resolve_backend("flash", "cpu", torch.bfloat16)
    assert e.value.key == "model.kernels.attention" and e.value.value == "flash"
    with pytest.raises(ConfigError, match="model.kernels.attention"):
        resolve_backend("xformers", "cpu", torch.float32)


# ---------------------------------------------------------------------------------------------- RoPE


def rope_loop(x, rope_dim, base, pairing):
    """Rotate pair i of every head at position p by p * base^(-2i/r) with explicit 2x2 rotations (float64)."""
    B, T, H, D = x.shape
    y = x.double().clone()
    half = rope_dim // 2
    for p in range(T):
        for i in range(half):
            ang = p * base ** (-2 * i / rope_dim)
            a, b = (i, i + half) if pairing == "half" else (2 * i, 2 * i + 1)
            xa, xb = x[:, p, :, a].double(), x[:, p, :, b].double()
            y[:, p, :, a] = xa * math.cos(ang) - xb * math.sin(ang)
            y[:, p, :, b] = xb * math.cos(ang) + xa * math.sin(ang)
    return y


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("rope_dim", [16, 4])
def test_rope_matches_rotation_formula(pairing, rope_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16)
    cos, sin = rope_angles(rope_dim, 9, 500.0)
    y = apply_rope(x, cos, sin, pairing)
    torch.testing.assert_close(y.double(), rope_loop(x, rope_dim, 500.0, pairing), rtol=1e-5, atol=1e-5)
    if rope_dim < 16:  # partial RoPE: the other channels pass through bit-exactly
        assert torch.equal(y[..., rope_dim:], x[..., rope_dim:])


def test_rope_angles_values():
    cos, sin = rope_angles(8, 5, 10000.0)
    assert cos.shape == (5, 4) and cos.dtype == torch.float32
    for p in range(5):
        for i in range(4):
            assert abs(cos[p, i].item() - math.cos(p * 10000.0 ** (-2 * i / 8))) < 1e-6
            assert abs(sin[p, i].item() - math.sin(p * 10000.0 ** (-2 * i / 8))) < 1e-6


def test_rope_preserves_relative_scores():
    """q·k after RoPE depends only on the position difference."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rope_angles(16, 20, 10000.0)

    def score(pq, pk):
        return (
            apply_rope(q, cos[pq : pq + 1], sin[pq : pq + 1]) * apply_rope(k, cos[pk : pk + 1], sin[pk : pk + 1])
        ).sum()

    torch.testing.assert_close(score(7, 3), score(15, 11), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_dim", [16, 8])
def test_pairing_conversion_preserves_scores(rope_dim):
    """Permuting Wq/Wk rows per head (interleaved 2i -> i, 2i+1 -> i + r/2) turns interleaved RoPE
    into half RoPE with identical q·k for every pair of positions."""
    torch.manual_seed(0)
    H, Dh, d, T = 2, 16, 24, 10
    x = torch.randn(1, T, d)
    wq, wk = torch.randn(H * Dh, d), torch.randn(H * Dh, d)
    perm = interleaved_to_half_permutation(Dh, rope_dim)
    assert sorted(perm.tolist()) == list(range(Dh))
    cos, sin = rope_angles(rope_dim, T, 10000.0)

    def scores(wq, wk, pairing):
        q = apply_rope((x @ wq.T).view(1, T, H, Dh), cos, sin, pairing)
        k = apply_rope((x @ wk.T).view(1, T, H, Dh), cos, sin, pairing)
        return torch.einsum("bihd,bjhd->bhij", q, k)

    def permute(w):
        return w.view(H, Dh, d)[:, perm].reshape(H * Dh, d)

    torch.testing.assert_close(
        scores(wq, wk, "interleaved"), scores(permute(wq), permute(wk), "half"), rtol=1e-4, atol=1e-4
    )
    assert not torch.allclose(scores(wq, wk, "interleaved"), scores(wq, wk, "half"), atol=1e-2)


@pytest.mark.parametrize("qk_norm", ["none", "whole"])
def test_pairing_conversion_whole_model(qk_norm):
    torch.manual_seed(0)
    kw = dict(vocab_size=32, max_seq_len=16)
    model = {"size": "2L64D", "qk_norm": qk_norm, "n_kv_heads": 1}
    a = LlamaCanon(
        build_model_config(
            model, canon={"set": "AB"}, pos={"type": "partial_rope", "fraction": 0.5, "pairing": "interleaved"}, **kw
        )
    )
    b = LlamaCanon(
        build_model_config(
            model, canon={"set": "AB"}, pos={"type": "partial_rope", "fraction": 0.5, "pairing": "half"}, **kw
        )
    )
    H, Hkv, Dh = 2, 1, 32
    perm = interleaved_to_half_permutation(Dh, 16)
    # row permutation of the fused [q ; k ; v] output: within every q and k head; v untouched
    rows = torch.cat([h * Dh + perm for h in range(H + Hkv)] + [torch.arange((H + Hkv) * Dh, (H + 2 * Hkv) * Dh)])
    sd = a.state_dict()
    for name in list(sd):
        if name.endswith("attn.wqkv.weight"):
            sd[name] = sd[name][rows]
        elif name.endswith("attn.canon_b.weight"):
            sd[name] = sd[name][rows]
        elif name.endswith("attn.q_norm.weight"):
            sd[name] = sd[name][torch.cat([h * Dh + perm for h in range(H)])]
        elif name.endswith("attn.k_norm.weight"):
            sd[name] = sd[name][torch.cat([h * Dh + perm for h in range(Hkv)])]
    b.load_state_dict(sd)
    ids = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not flash_available(), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2)])
def test_flash_matches_sdpa(H, Hkv):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(2, 256, H, 64, device=dev, dtype=dt)
    k, v = torch.randn(2, 256, Hkv, 64, device=dev, dtype=dt), torch.randn(2, 256, Hkv, 64, device=dev, dtype=dt)
    assert resolve_backend("flash", dev, dt) == "flash"
    ref = attention(q.float(), k.float(), v.float(), backend="reference")
    out = attention(q, k, v, backend="flash")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, attention(q, k, v, backend="sdpa"), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not flash_available(), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 100, 256])
def test_flash_fwd_bwd_decode_vs_reference(monkeypatch, dt, D):
    """flash really runs (its flash_attn_func is wrapped and counted, not mocked): forward and gradients against the
    fp32 reference, and a cached decode (S > T, bottom-right causal). D=100 is padded to 104 by flash_attn_func;
    fp32 is not a flash dtype (resolve_backend refuses it; tested on CPU)."""
    import flash_attn

    from _kernel_calls import count_calls

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash-attn needs an Ampere or newer GPU")
    assert resolve_backend("flash", "cuda", dt, head_dim=D) == "flash"
    calls = count_calls(monkeypatch, flash_attn, "flash_attn_func")
    torch.manual_seed(1)
    q = torch.randn(2, 96, 8, D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(2, 96, 2, D, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(2, 96, 2, D, device="cuda", dtype=dt, requires_grad=True)
    out = attention(q, k, v, backend="flash")
    assert len(calls) == 1 and out.dtype == dt
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = attention(*leaves, backend="reference")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dt))
    grads_ref = torch.autograd.grad(ref, leaves, g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
    with torch.no_grad():  # decode: the last 3 queries against the full KV cache
        step = attention(q[:, -3:], k, v, backend="flash")
        assert len(calls) == 2
        torch.testing.assert_close(step.float(), ref[:, -3:].detach(), rtol=2e-2, atol=2e-2)
