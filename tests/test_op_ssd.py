"""Mamba2 SSD op (canonlm.ops.ssd; Dao & Gu 2024; ``mamba_ssm``).

Oracles (independent of the code under test):

* ``canonlm.ops.ssd.naive.ssd_loop``: the recurrence ``H_t = exp(Δ_t A_h) H_{t-1} + Δ_t x_t B_tᵀ``,
  ``y_t = H_t C_t + D_h x_t`` stepped one token at a time in float64 (softplus / dt_bias / dt_limit / D / groups
  written out);
* fla's ``naive_recurrent_simple_gla`` under the mapping q = C, k = B, v = Δ·x, g = Δ·A, scale = 1 (skipped when
  fla-core is not installed);
* for the mixer core: ``canonlm.ops.canon.naive.canon_loop`` conv -> SiLU -> ``ssd_loop`` -> gated RMSNorm and
  out-proj written out.

GPU tests (``pytest -m gpu``; skipped without CUDA or mamba_ssm / causal_conv1d) compare the mamba_ssm kernels with
the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _kernel_calls import count_calls, fp32_tol, no_torch_tf32

from canonlm.errors import ConfigError
from canonlm.ops import ssd
from canonlm.ops._fla_naive import load_fla_naive
from canonlm.ops.ssd import (
    CONFIG_KEY,
    _mamba,
    gated_rmsnorm,
    resolve_backend,
    split_conv1d_scan_combined,
    split_conv1d_scan_reference,
    ssd_scan,
    ssd_scan_reference,
)
from canonlm.ops.canon.naive import canon_loop
from canonlm.ops.ssd.naive import ssd_loop

INF = float("inf")
F64 = torch.float64


# ----------------------------------------------------------------------------------------------------------------
# oracles
# ----------------------------------------------------------------------------------------------------------------


def _inputs(Bsz=2, T=37, H=4, P=3, G=2, N=5, seed=0, dtype=F64, big=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bsz, T, H, P, generator=g)
    dt = torch.randn(Bsz, T, H, generator=g) * (5.0 if big else 1.0) + (10.0 if big else 0.0)
    A = -torch.exp(torch.rand(H, generator=g) * 4.0)  # -exp(U(0, 4)): down to -54.6
    B = torch.randn(Bsz, T, G, N, generator=g)
    C = torch.randn(Bsz, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    h0 = torch.randn(Bsz, H, P, N, generator=g)
    return [t.to(dtype) for t in (x, dt, A, B, C, D, dt_bias, h0)]


def _leaves(ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _fwd_bwd(fn, ts, gy, gh):
    """Run fn(*leaves) -> (y, h|None); backprop <y, gy> + <h, gh>; return y, h, grads (None for None inputs)."""
    leaves = _leaves(ts)
    y, h = fn(*leaves)
    loss = (y * gy).sum() + ((h * gh).sum() if h is not None and gh is not None else 0.0)
    req = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, req, allow_unused=True))
    return y.detach(), None if h is None else h.detach(), [None if t is None else next(grads) for t in leaves]


NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")


# ----------------------------------------------------------------------------------------------------------------
# reference vs the loop oracle (float64)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("Q", [1, 16, 64])
def test_reference_matches_loop_oracle_fwd_and_grads(Q, T, G):
    variants = [  # (initial state, final state, dt_limit, D, dt_bias, dt_softplus)
        (True, True, (0.0, INF), True, True, True),
        (False, False, (0.05, 0.8), False, False, True),
    ]
    if T == 37:
        variants.append((True, True, (0.0, 2.0), True, True, False))
    for k, (init, final, lim, useD, useb, sp) in enumerate(variants):
        x, dt, A, B, C, D, db, h0 = _inputs(T=T, G=G, seed=100 * Q + T + G + k)
        if not sp:
            dt = dt.abs() * 0.5
        ts = [x, dt, A, B, C, D if useD else None, db if useb else None, h0 if init else None]
        g = torch.Generator().manual_seed(7)
        gy = torch.randn(x.shape, generator=g, dtype=F64)
        gh = torch.randn(h0.shape, generator=g, dtype=F64) if final else None

        def ref(x, dt, A, B, C, D, db, h0):
            return ssd_scan_reference(
                x,
                dt,
                A,
                B,
                C,
                chunk_size=Q,
                D=D,
                dt_bias=db,
                dt_softplus=sp,
                dt_limit=lim,
                initial_state=h0,
                output_final_state=final,
            )

        def oracle(x, dt, A, B, C, D, db, h0):
            y, h = ssd_loop(x, dt, A, B, C, D, db, sp, lim, h0)
            return y, (h if final else None)

        y, h, gr = _fwd_bwd(ref, ts, gy, gh)
        yo, ho, go = _fwd_bwd(oracle, ts, gy, gh)
        msg = f"Q={Q} T={T} G={G} variant={k}"
        assert y.dtype == F64 and y.shape == x.shape
        torch.testing.assert_close(y, yo, rtol=1e-9, atol=1e-9, msg=msg)
        if final:
            assert h.dtype == F64 and h.shape == h0.shape
            torch.testing.assert_close(h, ho, rtol=1e-9, atol=1e-9, msg=msg)
        else:
            assert h is None
        for name, a, b in zip(NAMES, gr, go):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"{msg} grad {name}")


def test_very_negative_A_and_large_dt_stay_finite():
    x, dt, A, B, C, D, db, h0 = _inputs(T=150, G=1, seed=3, big=True)  # Δ ~ 10..25 (past softplus' threshold)
    ts = [x, dt, A, B, C, D, db, h0]
    gy = torch.randn(x.shape, dtype=F64)
    gh = torch.randn(h0.shape, dtype=F64)
    for Q in (16, 64):
        y, h, gr = _fwd_bwd(
            lambda *a: ssd_scan_reference(
                *a[:5], chunk_size=Q, D=a[5], dt_bias=a[6], initial_state=a[7], output_final_state=True
            ),
            ts,
            gy,
            gh,
        )
        assert torch.isfinite(y).all() and torch.isfinite(h).all()
        assert all(torch.isfinite(g).all() for g in gr)
        yo, ho, go = _fwd_bwd(lambda *a: ssd_loop(*a[:5], a[5], a[6], True, (0.0, INF), a[7]), ts, gy, gh)
        torch.testing.assert_close(y, yo, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(h, ho, rtol=1e-9, atol=1e-9)
        for name, a, b in zip(NAMES, gr, go):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    # float32 too: same inputs, finite and close
    y32, h32 = ssd_scan_reference(
        *[t.float() for t in (x, dt, A, B, C)],
        chunk_size=64,
        D=D.float(),
        dt_bias=db.float(),
        initial_state=h0.float(),
        output_final_state=True,
    )
    assert torch.isfinite(y32).all() and torch.isfinite(h32).all()
    torch.testing.assert_close(y32.double(), yo, rtol=1e-4, atol=1e-4)


def test_gradcheck_small():
    x, dt, A, B, C, D, db, h0 = _inputs(Bsz=1, T=5, H=2, P=2, G=1, N=2, seed=11)

    def f(x, dt, A, B, C, D, db, h0):
        return ssd_scan_reference(
            x, dt, A, B, C, chunk_size=3, D=D, dt_bias=db, initial_state=h0, output_final_state=True
        )

    assert torch.autograd.gradcheck(f, _leaves([x, dt, A, B, C, D, db, h0]))


# ----------------------------------------------------------------------------------------------------------------
# continuation, decode, dtypes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Q", [16, 256])
def test_continuation_equals_one_call(Q):
    x, dt, A, B, C, D, db, h0 = _inputs(T=64, seed=5)
    kw = dict(chunk_size=Q, D=D, dt_bias=db, output_final_state=True)
    y, h = ssd_scan_reference(x, dt, A, B, C, initial_state=h0, **kw)
    t1 = 23
    y1, h1 = ssd_scan_reference(x[:, :t1], dt[:, :t1], A, B[:, :t1], C[:, :t1], initial_state=h0, **kw)
    y2, h2 = ssd_scan_reference(x[:, t1:], dt[:, t1:], A, B[:, t1:], C[:, t1:], initial_state=h1, **kw)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h2, h, rtol=1e-10, atol=1e-10)


def test_repeated_single_steps_equal_full_call():
    x, dt, A, B, C, D, db, h0 = _inputs(T=12, seed=6)
    y, h = ssd_scan(x, dt, A, B, C, chunk_size=256, D=D, dt_bias=db, output_final_state=True)
    state, ys = None, []
    with torch.no_grad():
        for t in range(x.shape[1]):
            sl = slice(t, t + 1)
            yt, state = ssd_scan(
                x[:, sl],
                dt[:, sl],
                A,
                B[:, sl],
                C[:, sl],
                D=D,
                dt_bias=db,
                initial_state=state,
                output_final_state=True,
            )
            assert yt.shape == (x.shape[0], 1, x.shape[2], x.shape[3])
            ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, dim=1), y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, h, rtol=1e-10, atol=1e-10)


def test_float32_close_to_float64():
    ts64 = _inputs(Bsz=2, T=100, H=4, P=8, G=2, N=16, seed=8)
    x, dt, A, B, C, D, db, h0 = [t.float() for t in ts64]
    y, h = ssd_scan_reference(x, dt, A, B, C, chunk_size=32, D=D, dt_bias=db, initial_state=h0, output_final_state=True)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    yo, ho = ssd_loop(*ts64[:5], ts64[5], ts64[6], True, (0.0, INF), ts64[7])
    torch.testing.assert_close(y.double(), yo, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.double(), ho, rtol=1e-4, atol=1e-4)


def test_bfloat16_inputs_give_bfloat16_output_and_fp32_state():
    ts64 = _inputs(Bsz=2, T=50, H=4, P=8, G=1, N=16, seed=9)
    x, dt, A, B, C, D, db, h0 = ts64
    xb, Bb, Cb = (t.to(torch.bfloat16) for t in (x, B, C))
    y, h = ssd_scan(
        xb, dt.float(), A.float(), Bb, Cb, chunk_size=16, D=D.float(), dt_bias=db.float(), output_final_state=True
    )
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    yo, ho = ssd_loop(xb.double(), dt, A, Bb.double(), Cb.double(), D, db)
    torch.testing.assert_close(y.double(), yo, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(h.double(), ho, rtol=1e-4, atol=1e-4)  # state computed in fp32 from bf16 inputs
    # gradients flow to bf16 leaves in bf16
    xl = xb.clone().requires_grad_()
    ssd_scan_reference(xl, dt.float(), A.float(), Bb, Cb, chunk_size=16)[0].float().sum().backward()
    assert xl.grad.dtype == torch.bfloat16 and torch.isfinite(xl.grad.float()).all()


def test_autocast_is_disabled_inside():
    x, dt, A, B, C, D, db, h0 = [t.float() for t in _inputs(T=40, seed=10)]
    y, _ = ssd_scan_reference(x, dt, A, B, C, chunk_size=16, D=D, dt_bias=db)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, _ = ssd_scan_reference(x, dt, A, B, C, chunk_size=16, D=D, dt_bias=db)
    assert ya.dtype == torch.float32
    torch.testing.assert_close(ya, y, rtol=0, atol=0)


def test_padding_does_not_change_final_state():
    x, dt, A, B, C, D, db, h0 = _inputs(T=33, seed=12)
    outs = [
        ssd_scan_reference(x, dt, A, B, C, chunk_size=Q, D=D, dt_bias=db, initial_state=h0, output_final_state=True)
        for Q in (1, 11, 16, 33, 64)
    ]
    for y, h in outs[1:]:
        torch.testing.assert_close(y, outs[0][0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, outs[0][1], rtol=1e-10, atol=1e-10)


def test_D_per_channel_and_meta_device():
    x, dt, A, B, C, D, db, h0 = _inputs(T=20, seed=13)
    D2 = torch.randn(x.shape[2], x.shape[3], dtype=F64)
    y, _ = ssd_scan_reference(x, dt, A, B, C, chunk_size=8, D=D2, dt_bias=db)
    y0, _ = ssd_scan_reference(x, dt, A, B, C, chunk_size=8, dt_bias=db)
    torch.testing.assert_close(y, y0 + D2 * x, rtol=1e-12, atol=1e-12)
    m = [t.to("meta") for t in (x, dt, A, B, C)]
    ym, hm = ssd_scan(*m, chunk_size=8, output_final_state=True)
    assert ym.device.type == "meta" and ym.shape == x.shape and hm.shape == h0.shape


# ----------------------------------------------------------------------------------------------------------------
# second oracle: fla's naive simple GLA (same op under q=C, k=B, v=Δx, g=Δ·A, scale=1)
# ----------------------------------------------------------------------------------------------------------------


def test_matches_fla_naive_simple_gla():
    m = load_fla_naive("simple_gla")
    if m is None or not hasattr(m, "naive_recurrent_simple_gla"):
        pytest.skip("fla-core (simple_gla/naive.py) not installed")
    x, dt, A, B, C, D, db, h0 = [t.float() for t in _inputs(Bsz=2, T=70, H=4, P=8, G=2, N=16, seed=14)]
    y, h = ssd_scan_reference(x, dt, A, B, C, chunk_size=32, D=D, dt_bias=db, initial_state=h0, output_final_state=True)
    delta = F.softplus(dt + db)
    rep = x.shape[2] // B.shape[2]
    o, S = m.naive_recurrent_simple_gla(
        C.repeat_interleave(rep, 2),
        B.repeat_interleave(rep, 2),
        x * delta[..., None],
        delta * A,
        scale=1.0,
        initial_state=h0.transpose(-1, -2).contiguous(),
        output_final_state=True,
    )
    torch.testing.assert_close(y, o + D[:, None] * x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, S.transpose(-1, -2), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Mamba2 mixer core: conv -> scan -> gated RMSNorm -> out-proj
# ----------------------------------------------------------------------------------------------------------------


def _mixer_inputs(Bsz=2, T=29, H=4, P=4, G=2, N=6, W=4, out=10, seed=20, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    zxbcdt = torch.randn(Bsz, T, 2 * d_inner + 2 * G * N + H, generator=g)
    conv_w = torch.rand(conv_dim, W, generator=g) - 0.5
    conv_b = torch.randn(conv_dim, generator=g) * 0.1
    dt_bias = torch.randn(H, generator=g) * 0.5
    A = -torch.exp(torch.rand(H, generator=g) * 2.0)
    D = torch.randn(H, generator=g)
    norm_w = 1.0 + 0.1 * torch.randn(d_inner, generator=g)
    out_w = torch.randn(out, d_inner, generator=g) / math.sqrt(d_inner)
    ts = [t.to(dtype) for t in (zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w)]
    return ts, dict(H=H, P=P, G=G, N=N)


def _gated_norm_loop(y, z, w, eps, G, norm_before_gate=False):
    """RMSNorm over each group of d/G channels, gate y*silu(z) before (default) or after the norm."""
    d = y.shape[-1]
    gs = d // G
    gate = z * torch.sigmoid(z)
    u = y if norm_before_gate else y * gate
    parts = []
    for k in range(G):
        seg = u[..., k * gs : (k + 1) * gs]
        parts.append(seg / torch.sqrt((seg * seg).mean(-1, keepdim=True) + eps))
    out = torch.cat(parts, dim=-1) * w
    return out * gate if norm_before_gate else out


def _mixer_oracle(
    zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w, dims, activation, eps, conv=True, dt_limit=(0.0, INF)
):
    H, P, G, N = dims["H"], dims["P"], dims["G"], dims["N"]
    Bsz, T, _ = zxbcdt.shape
    d_inner = H * P
    z = zxbcdt[..., :d_inner]
    xBC = zxbcdt[..., d_inner : 2 * d_inner + 2 * G * N]
    dt = zxbcdt[..., 2 * d_inner + 2 * G * N :]
    if conv:
        xBC = canon_loop(xBC, conv_w, conv_b, residual=False, activation=activation == "silu")
    x = xBC[..., :d_inner].reshape(Bsz, T, H, P)
    B = xBC[..., d_inner : d_inner + G * N].reshape(Bsz, T, G, N)
    C = xBC[..., d_inner + G * N :].reshape(Bsz, T, G, N)
    y, _ = ssd_loop(x, dt, A, B, C, D, dt_bias, True, dt_limit)
    y = _gated_norm_loop(y.reshape(Bsz, T, d_inner), z, norm_w, eps, G)
    return y @ out_w.T


def test_split_reference_with_random_conv_matches_step_by_step_composition():
    ts, dims = _mixer_inputs()
    kw = dict(chunk_size=16, rmsnorm_eps=1e-5, headdim=dims["P"], ngroups=dims["G"])

    def ref(zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w):
        return split_conv1d_scan_reference(
            zxbcdt, conv_w, conv_b, dt_bias, A, D, activation="silu", rmsnorm_weight=norm_w, outproj_weight=out_w, **kw
        ), None

    def oracle(zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w):
        return _mixer_oracle(zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w, dims, "silu", 1e-5), None

    gy = torch.randn(ts[0].shape[0], ts[0].shape[1], ts[7].shape[0], dtype=F64)
    y, _, gr = _fwd_bwd(ref, ts, gy, None)
    yo, _, go = _fwd_bwd(oracle, ts, gy, None)
    assert y.shape == gy.shape and y.dtype == F64
    torch.testing.assert_close(y, yo, rtol=1e-9, atol=1e-9)
    for name, a, b in zip(("zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D", "norm_w", "out_w"), gr, go):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=name)


def test_noconv1d_identity_kernel_passes_xBC_through():
    """Paper Result 7.1: Mamba2 without its conv = identity kernel [0,0,0,1], no bias, no activation."""
    ts, dims = _mixer_inputs(seed=21)
    zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w = ts
    ident = torch.zeros_like(conv_w)
    ident[:, -1] = 1.0
    kw = dict(
        chunk_size=8,
        rmsnorm_weight=norm_w,
        rmsnorm_eps=1e-6,
        outproj_weight=out_w,
        headdim=dims["P"],
        ngroups=dims["G"],
    )
    y = split_conv1d_scan_reference(zxbcdt, ident, None, dt_bias, A, D, activation=None, **kw)
    # the composition without any conv: plain ssd_scan_reference + gated_rmsnorm + linear
    H, P, G, N = dims["H"], dims["P"], dims["G"], dims["N"]
    Bsz, T, _ = zxbcdt.shape
    z, x, B, C, dt = zxbcdt.split([H * P, H * P, G * N, G * N, H], dim=-1)
    ys, _ = ssd_scan_reference(
        x.reshape(Bsz, T, H, P),
        dt,
        A,
        B.reshape(Bsz, T, G, N),
        C.reshape(Bsz, T, G, N),
        chunk_size=8,
        D=D,
        dt_bias=dt_bias,
    )
    want = F.linear(gated_rmsnorm(ys.reshape(Bsz, T, H * P), z, norm_w, 1e-6, G), out_w)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        y, _mixer_oracle(*ts[:1], ident, None, *ts[3:], dims, None, 1e-6, conv=False), rtol=1e-9, atol=1e-9
    )
    # and it differs from the activated / random conv (the switch matters)
    y_conv = split_conv1d_scan_reference(zxbcdt, conv_w, conv_b, dt_bias, A, D, activation="silu", **kw)
    assert (y_conv - y).abs().max() > 1e-2


def test_gated_rmsnorm_modes():
    g = torch.Generator().manual_seed(22)
    y, z = torch.randn(3, 5, 12, generator=g, dtype=F64), torch.randn(3, 5, 12, generator=g, dtype=F64)
    w = torch.randn(12, generator=g, dtype=F64)
    for G in (1, 3):
        for nbg in (False, True):
            torch.testing.assert_close(gated_rmsnorm(y, z, w, 1e-6, G, nbg), _gated_norm_loop(y, z, w, 1e-6, G, nbg))
    torch.testing.assert_close(gated_rmsnorm(y, z, None, 1e-6), y * F.silu(z))
    out = gated_rmsnorm(y.to(torch.bfloat16), z.to(torch.bfloat16), w.float(), 1e-6)
    assert out.dtype == torch.float32


def test_split_reference_without_norm_and_outproj_and_dtypes():
    ts, dims = _mixer_inputs(seed=23, dtype=torch.float32)
    zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w = ts
    kw = dict(chunk_size=8, rmsnorm_eps=1e-6, headdim=dims["P"], ngroups=dims["G"])
    y = split_conv1d_scan_reference(
        zxbcdt, conv_w, conv_b, dt_bias, A, D, activation="silu", rmsnorm_weight=None, outproj_weight=None, **kw
    )
    assert y.shape == (*zxbcdt.shape[:2], dims["H"] * dims["P"]) and y.dtype == torch.float32
    yb = split_conv1d_scan_reference(
        zxbcdt.to(torch.bfloat16),
        conv_w,
        conv_b,
        dt_bias,
        A,
        D,
        activation="silu",
        rmsnorm_weight=norm_w,
        outproj_weight=out_w,
        **kw,
    )
    y32 = split_conv1d_scan_reference(
        zxbcdt.to(torch.bfloat16).float(),
        conv_w,
        conv_b,
        dt_bias,
        A,
        D,
        activation="silu",
        rmsnorm_weight=norm_w,
        outproj_weight=out_w,
        **kw,
    )
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y32, rtol=1e-2, atol=2e-2)


def test_split_shape_errors():
    ts, dims = _mixer_inputs(seed=24)
    zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w = ts
    kw = dict(
        chunk_size=8,
        rmsnorm_weight=norm_w,
        rmsnorm_eps=1e-6,
        outproj_weight=out_w,
        headdim=dims["P"],
        ngroups=dims["G"],
    )
    with pytest.raises(ValueError, match="zxbcdt"):
        split_conv1d_scan_reference(zxbcdt[..., :-1], conv_w, conv_b, dt_bias, A, D, activation="silu", **kw)
    with pytest.raises(ValueError, match="activation"):
        split_conv1d_scan_reference(zxbcdt, conv_w, conv_b, dt_bias, A, D, activation="relu", **kw)
    with pytest.raises(ValueError, match="conv_weight"):
        split_conv1d_scan_reference(zxbcdt, conv_w[:, None], conv_b, dt_bias, A, D, activation="silu", **kw)
    with pytest.raises(ConfigError, match=CONFIG_KEY):  # fused path off CUDA
        split_conv1d_scan_combined(
            zxbcdt.float(),
            conv_w.float(),
            conv_b.float(),
            dt_bias.float(),
            A.float(),
            D.float(),
            activation="silu",
            **kw,
        )


# ----------------------------------------------------------------------------------------------------------------
# backend resolution and argument errors
# ----------------------------------------------------------------------------------------------------------------


def test_resolve_backend_names_and_errors():
    assert resolve_backend("auto", "cpu", torch.float32) == "reference"
    assert resolve_backend("reference", "cpu", torch.bfloat16) == "reference"
    assert resolve_backend("mamba_ssm", "meta", torch.float32) == "mamba_ssm"
    assert resolve_backend("auto", torch.device("meta"), torch.float32) == "auto"
    with pytest.raises(ConfigError) as e:
        resolve_backend("mamba_ssm", "cpu", torch.float32)
    assert e.value.key == CONFIG_KEY and CONFIG_KEY in str(e.value) and "CUDA" in str(e.value)
    assert "reference" in e.value.allowed
    with pytest.raises(ConfigError, match="model.kernels.ssd"):
        resolve_backend("triton", "cpu", torch.float32)
    x, dt, A, B, C, *_ = _inputs(T=5)
    with pytest.raises(ConfigError, match="model.kernels.ssd"):
        ssd_scan(x, dt, A, B, C, backend="mamba_ssm")
    y1, _ = ssd_scan(x, dt, A, B, C, chunk_size=4, backend="auto")
    y2, _ = ssd_scan(x, dt, A, B, C, chunk_size=4, backend="reference")
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    assert ssd.available_backends("cpu")["reference"] is None
    assert "CUDA" in ssd.available_backends("cpu")["mamba_ssm"]


def test_bad_arguments_raise_value_error():
    x, dt, A, B, C, D, db, h0 = _inputs(T=6)
    for bad in (0, -4, 2.0, True, None):
        with pytest.raises(ValueError, match="chunk_size"):
            ssd_scan(x, dt, A, B, C, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            ssd_scan_reference(x, dt, A, B, C, chunk_size=bad)
    cases = [
        (dict(x=x[0]), "x.shape"),
        (dict(dt=dt[..., :-1]), "dt.shape"),
        (dict(A=A[:-1]), "A.shape"),
        (dict(B=B[..., :-1], C=C[..., :-1], h0=h0[..., :-1]), None),  # consistent smaller N is fine
        (dict(B=torch.randn(2, 6, 3, 5, dtype=F64), C=torch.randn(2, 6, 3, 5, dtype=F64)), "B.shape"),  # H % G
        (dict(C=C[..., :-1]), "C.shape"),
        (dict(D=D[:-1]), "D.shape"),
        (dict(db=db[:-1]), "dt_bias.shape"),
        (dict(h0=h0[:, :-1]), "initial_state.shape"),
        (dict(x=x[:, :0], dt=dt[:, :0], B=B[:, :0], C=C[:, :0]), "x.shape"),
    ]
    for over, match in cases:
        a = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, db=db, h0=h0)
        a.update(over)

        def call():
            return ssd_scan(
                a["x"], a["dt"], a["A"], a["B"], a["C"], chunk_size=4, D=a["D"], dt_bias=a["db"], initial_state=a["h0"]
            )

        if match is None:
            call()
        else:
            with pytest.raises(ValueError, match=match):
                call()
    with pytest.raises(ValueError, match="dt_limit"):
        ssd_scan(x, dt, A, B, C, dt_limit=(1.0, 0.5))


# ----------------------------------------------------------------------------------------------------------------
# the mamba_ssm adapters against the documented kernel contracts (fake kernels, CPU)
# ----------------------------------------------------------------------------------------------------------------


def _fake_chunk_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, INF),
    return_final_states=False,
    return_varlen_states=False,
    state_dtype=None,
):
    """mamba_chunk_scan_combined's documented contract, via the loop oracle."""
    assert x.dim() == 4 and dt.shape == x.shape[:3] and A.shape == (x.shape[2],) and A.dtype == torch.float32
    assert z is None and B.dtype == x.dtype == C.dtype and isinstance(chunk_size, int)
    y, h = ssd_loop(
        x.double(),
        dt.double(),
        A.double(),
        B.double(),
        C.double(),
        None if D is None else D.double(),
        None if dt_bias is None else dt_bias.double(),
        dt_softplus,
        dt_limit,
        None if initial_states is None else initial_states.double(),
    )
    y = y.to(x.dtype)
    return (y, h.float()) if return_final_states else y


def _fake_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """selective_state_update's documented contract (mamba_ssm): in-place state update, returns (B, H, P)."""
    Bsz, H, P, N = state.shape
    G = B.shape[1]
    assert x.shape == (Bsz, H, P) and dt.shape == (Bsz, H, P) and A.shape == (H, P, N) and B.shape == (Bsz, G, N)
    assert (D is None or D.shape == (H, P)) and dt_bias.shape == (H, P) and z is None
    assert A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0  # tie_hdim
    rep = H // G
    d = dt + dt_bias
    d = F.softplus(d) if dt_softplus else d
    Bh, Ch = B.repeat_interleave(rep, 1).float(), C.repeat_interleave(rep, 1).float()
    state.copy_(state * torch.exp(d[..., None] * A) + (d * x.float())[..., None] * Bh[:, :, None, :])
    out = (state * Ch[:, :, None, :]).sum(-1) + (0.0 if D is None else D * x.float())
    return out.to(x.dtype)


def test_mamba_adapters_against_documented_contracts(monkeypatch):
    from canonlm.ops import _dispatch

    monkeypatch.setitem(_dispatch._probes, "ssd.chunk", (_fake_chunk_scan, None))
    monkeypatch.setitem(_dispatch._probes, "ssd.state_update", (_fake_state_update, None))
    x, dt, A, B, C, D, db, h0 = [t.float() for t in _inputs(T=9, seed=30)]
    lim = (0.0, 3.0)
    yo, ho = ssd_loop(*[t.double() for t in (x, dt, A, B, C, D, db)], True, lim, h0.double())
    y, h = _mamba.chunk_scan(x, dt, A, B, C, 64, D, db, True, lim, h0, True)
    torch.testing.assert_close(y.double(), yo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), ho, rtol=1e-5, atol=1e-5)
    h0c = h0.clone()
    s = slice(0, 1)
    y1, h1 = _mamba.state_update(x[:, s], dt[:, s], A, B[:, s], C[:, s], D, db, True, lim, h0, True)
    yo1, ho1 = ssd_loop(*[t.double() for t in (x[:, s], dt[:, s], A, B[:, s], C[:, s], D, db)], True, lim, h0.double())
    assert y1.shape == (2, 1, 4, 3) and h1.dtype == torch.float32
    torch.testing.assert_close(y1.double(), yo1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.double(), ho1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h0, h0c, rtol=0, atol=0)  # caller's state untouched
    y0, h0n = _mamba.state_update(x[:, s], dt[:, s], A, B[:, s], C[:, s], None, None, False, (0.0, INF), None, False)
    assert h0n is None and y0.shape == (2, 1, 4, 3)


# ----------------------------------------------------------------------------------------------------------------
# GPU: mamba_ssm kernels vs the reference (pytest -m gpu)
# ----------------------------------------------------------------------------------------------------------------

CUDA = torch.cuda.is_available()
# fp32: mamba-ssm's Triton dots round fp32 to TF32 unless pytest runs with TRITON_F32_DEFAULT=ieee (_kernel_calls)
GPU_TOL = {torch.float32: dict(rtol=fp32_tol(), atol=fp32_tol()), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def _skip_unless_mamba(split=False):
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    reason = ssd.available_backends("cuda", torch.float32)["mamba_ssm"]
    if reason is not None:
        pytest.skip(f"mamba_ssm unavailable: {reason}")
    if split and _mamba.split_function()[0] is None:
        pytest.skip(f"mamba_split_conv1d_scan_combined unavailable: {_mamba.split_function()[1]}")


def _rel_close(a, b, tol, msg):
    """max |a-b| <= atol + rtol * max |b| (kernels accumulate in a different order; bf16 rounds x/B/C)."""
    a, b = a.double().cpu(), b.double().cpu()
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= tol["atol"] + tol["rtol"] * scale, f"{msg}: max err {err:.3g} (scale {scale:.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,G,init", [(100, 1, False), (300, 2, True), (1, 2, True)])
def test_gpu_chunk_scan_matches_reference(monkeypatch, dtype, T, G, init):
    _skip_unless_mamba()
    no_torch_tf32(monkeypatch)
    assert resolve_backend("auto", "cuda", dtype) == "mamba_ssm"
    calls = count_calls(monkeypatch, _mamba, "chunk_scan")
    x, dt, A, B, C, D, db, h0 = [t.float() for t in _inputs(Bsz=2, T=T, H=4, P=16, G=G, N=32, seed=40)]
    x, B, C = (t.to(dtype) for t in (x, B, C))
    ts = [x, dt, A, B, C, D, db, h0 if init else None]
    gy = torch.randn(x.shape).to(dtype)
    gh = torch.randn(h0.shape)
    kw = dict(chunk_size=64, dt_limit=(0.0, 5.0), output_final_state=True)

    def run(backend, dev):
        return _fwd_bwd(
            lambda x, dt, A, B, C, D, db, h0: ssd_scan(
                x, dt, A, B, C, D=D, dt_bias=db, initial_state=h0, backend=backend, **kw
            ),
            [None if t is None else t.to(dev) for t in ts],
            gy.to(dev),
            gh.to(dev),
        )

    y, h, gr = run("auto", "cuda")
    assert len(calls) == 1  # mamba_chunk_scan_combined ran (T = 1 too: autograd on)
    yr, hr, grr = run("reference", "cpu")
    tol = GPU_TOL[dtype]
    # the prefill final state stays float32 for bf16 inputs (mamba-ssm's _state_passing_fwd allocates it float32)
    assert y.dtype == dtype and h.dtype == torch.float32
    _rel_close(y, yr, tol, "y")
    _rel_close(h, hr, tol, "final state")
    for name, a, b in zip(NAMES, gr, grr):
        if b is not None:
            _rel_close(a, b, tol, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_step_matches_reference(monkeypatch, dtype):
    _skip_unless_mamba()
    if _mamba.state_update_function()[0] is None:
        pytest.skip(f"selective_state_update unavailable: {_mamba.state_update_function()[1]}")
    calls = count_calls(monkeypatch, _mamba, "state_update")
    x, dt, A, B, C, D, db, h0 = [t.float() for t in _inputs(Bsz=3, T=4, H=4, P=16, G=2, N=32, seed=41)]
    x, B, C = (t.to(dtype) for t in (x, B, C))
    state_g, state_r = h0.cuda(), h0
    for t in range(x.shape[1]):
        s = slice(t, t + 1)
        args = (x[:, s], dt[:, s], A, B[:, s], C[:, s])
        with torch.no_grad():
            yg, state_g = ssd_scan(
                *[a.cuda() for a in args],
                D=D.cuda(),
                dt_bias=db.cuda(),
                initial_state=state_g,
                output_final_state=True,
                backend="auto",
                dt_limit=(0.0, 2.0),
            )
        assert len(calls) == t + 1  # selective_state_update ran for this step
        yr, state_r = ssd_scan_reference(
            *args, D=D, dt_bias=db, initial_state=state_r, output_final_state=True, dt_limit=(0.0, 2.0)
        )
        assert yg.dtype == dtype and state_g.dtype == torch.float32
        _rel_close(yg, yr, GPU_TOL[dtype], f"y step {t}")
        _rel_close(state_g, state_r, GPU_TOL[dtype], f"state step {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noconv", [False, True])
def test_gpu_split_conv1d_scan_matches_reference(monkeypatch, dtype, noconv):
    _skip_unless_mamba(split=True)
    no_torch_tf32(monkeypatch)
    ts, dims = _mixer_inputs(Bsz=2, T=130, H=8, P=16, G=1, N=32, out=48, seed=42, dtype=torch.float32)
    # d_inner 128, conv channels 192, in_proj 328: causal-conv1d's channel-last layout holds, the fused path is chosen
    assert ssd.use_fused_split("auto", "cuda", dtype, 4, d_inner=128, conv_dim=192, nheads=8)
    calls = count_calls(monkeypatch, _mamba, "split_conv1d_scan")
    zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w = ts
    if noconv:  # noconv1d: identity kernel, no bias, no activation
        conv_w = torch.zeros_like(conv_w)
        conv_w[:, -1] = 1.0
        conv_b = None
    act = None if noconv else "silu"
    zxbcdt = zxbcdt.to(dtype)
    out_w = out_w.to(dtype)  # the fused out-proj runs in the activations' dtype
    leaves = [zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w]
    kw = dict(chunk_size=64, activation=act, rmsnorm_eps=1e-5, headdim=dims["P"], ngroups=dims["G"])
    gy = torch.randn(*zxbcdt.shape[:2], out_w.shape[0]).to(dtype)

    def run(fn, dev):
        def f(zx, cw, cb, db, A, D, nw, ow):
            return fn(zx, cw, cb, db, A, D, rmsnorm_weight=nw, outproj_weight=ow, **kw), None

        return _fwd_bwd(f, [None if t is None else t.to(dev) for t in leaves], gy.to(dev), None)

    y, _, gr = run(split_conv1d_scan_combined, "cuda")
    assert len(calls) == 1
    yr, _, grr = run(split_conv1d_scan_reference, "cpu")
    tol = GPU_TOL[dtype]
    assert y.dtype == dtype
    _rel_close(y, yr, tol, "out")
    for name, a, b in zip(("zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D", "norm_w", "out_w"), gr, grr):
        if b is not None:
            _rel_close(a, b, tol, f"grad {name}")
