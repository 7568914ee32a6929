"""GDN op (gated delta rule; Yang et al. 2025): the chunked WY/UT reference against an independent
step-by-step float64 loop of the recurrence, against fla's naive references, and (``-m gpu``) fla's Triton kernels
against the reference.

Oracle (``canonlm.ops.gdn.naive.gdn_loop``, independent of the chunked reference), per batch row and head, ``[K, V]``
state convention::

    q, k <- x / sqrt(sum(x**2) + 1e-6)          (use_qk_l2norm only)
    a_t = exp(g_t);  w_t = beta_t (v_t - a_t S_{t-1}^T k_t);  S_t = a_t S_{t-1} + k_t w_t^T;  o_t = S_t^T (scale q_t)
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from _kernel_calls import count_calls, fp32_tol, no_torch_tf32

from canonlm.errors import ConfigError
from canonlm.ops._fla_naive import load_fla_naive
from canonlm.ops.gdn import (
    BACKENDS,
    CONFIG_KEY,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    resolve_backend,
)
from canonlm.ops.gdn.naive import gdn_loop as oracle

CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------------------
# oracle and helpers
# ----------------------------------------------------------------------------------------------------------------


def make(B=2, T=37, H=2, K=8, V=6, dtype=torch.float64, seed=0, strong_decay=False, init=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    if strong_decay:
        g = -F.softplus(torch.randn(B, T, H, generator=gen)) * 5
    else:
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen) if init else None
    return [None if t is None else t.to(dtype) for t in (q, k, v, g, beta, h0)]


def run_with_grads(fn, inputs, do, dS):
    """Call fn(q, k, v, g, beta, h0) -> (o, S) on fresh leaves; backprop <o, do> + <S, dS>; return o, S, grads."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    o, S = fn(*leaves)
    loss = (o.double() * do).sum() + (0 if S is None else (S.double() * dS).sum())
    loss.backward()
    return o, S, [None if t is None else t.grad for t in leaves]


NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def assert_close(a, b, atol, rtol=0.0, msg=""):
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a.double() - b.double()).abs().max().item()
    tol = atol + rtol * b.double().abs().max().item()
    assert err <= tol, f"{msg}: max abs diff {err:.3e} > {tol:.3e}"


# ----------------------------------------------------------------------------------------------------------------
# reference vs oracle (float64, forward and gradients)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_reference_matches_oracle_fp64(chunk_size, T, use_qk_l2norm):
    init = (T + chunk_size) % 2 == 1 or T == 130  # both with and without an initial state across the grid
    inputs = make(T=T, seed=T * 7 + chunk_size, init=init)
    if not use_qk_l2norm:  # unnormalised keys (|k|^2 beta > 2) make the delta rule itself blow up
        inputs[1] = F.normalize(inputs[1], dim=-1) * 0.9
    do = torch.randn(2, T, 2, 6, dtype=torch.float64)
    dS = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    scale = 0.3 if not use_qk_l2norm else None

    o_ref, S_ref, g_ref = run_with_grads(
        lambda q, k, v, g, b, h: oracle(q, k, v, g, b, scale, h, use_qk_l2norm), inputs, do, dS
    )
    o, S, gr = run_with_grads(
        lambda q, k, v, g, b, h: chunk_gated_delta_rule_reference(
            q,
            k,
            v,
            g,
            b,
            scale=scale,
            initial_state=h,
            output_final_state=True,
            use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size,
        ),
        inputs,
        do,
        dS,
    )
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    msg = f"C={chunk_size} T={T} l2={use_qk_l2norm} init={init}"
    assert_close(o, o_ref, 1e-9, msg=msg + " o")
    assert_close(S, S_ref, 1e-9, msg=msg + " final_state")
    for name, a, b in zip(NAMES, gr, g_ref):
        if b is None:
            assert a is None
            continue
        assert_close(a, b, 1e-9, 1e-10, msg=f"{msg} d{name}")


def test_no_final_state_and_grads_without_it():
    q, k, v, g, beta, _ = make(T=50, init=False, seed=3)
    o, S = chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=16)
    assert S is None
    o_ref, _ = oracle(q, k, v, g, beta)
    assert_close(o, o_ref, 1e-10)
    do = torch.randn_like(o)
    _, _, gr = run_with_grads(
        lambda *a: chunk_gated_delta_rule_reference(*a[:5], chunk_size=16),
        make(T=50, init=False, seed=3)[:5] + [None],
        do,
        None,
    )
    _, _, g_ref = run_with_grads(
        lambda *a: (oracle(*a[:5])[0], None), make(T=50, init=False, seed=3)[:5] + [None], do, None
    )
    for name, a, b in zip(NAMES[:5], gr, g_ref):
        assert_close(a, b, 1e-9, 1e-10, msg=f"d{name}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_strongly_negative_decay_stays_finite(chunk_size):
    inputs = make(T=130, seed=11, strong_decay=True)
    inputs[3][0, 5:70, 0] = -60.0  # exp(-60 * 64) underflows to 0 in any float: must not make inf/nan
    do = torch.randn(2, 130, 2, 6, dtype=torch.float64)
    dS = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    o_ref, S_ref, g_ref = run_with_grads(lambda q, k, v, g, b, h: oracle(q, k, v, g, b, None, h), inputs, do, dS)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        o, S, gr = run_with_grads(
            lambda q, k, v, g, b, h: chunk_gated_delta_rule_reference(
                q, k, v, g, b, initial_state=h, output_final_state=True, chunk_size=chunk_size
            ),
            [t.to(dtype) for t in inputs],
            do,
            dS,
        )
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        assert all(torch.isfinite(t).all() for t in gr)
        assert_close(o, o_ref, tol, msg=f"{dtype} o")
        assert_close(S, S_ref, tol, msg=f"{dtype} S")
        for name, a, b in zip(NAMES, gr, g_ref):
            assert_close(a, b, tol, tol, msg=f"{dtype} d{name}")


# ----------------------------------------------------------------------------------------------------------------
# continuation, dtypes, dispatch on CPU
# ----------------------------------------------------------------------------------------------------------------


def test_continuation_two_calls_equal_one():
    q, k, v, g, beta, h0 = make(T=87, seed=5)
    o_full, S_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o1, S1 = chunk_gated_delta_rule(
        q[:, :37],
        k[:, :37],
        v[:, :37],
        g[:, :37],
        beta[:, :37],
        initial_state=h0,
        output_final_state=True,
        chunk_size=16,
    )
    o2, S2 = chunk_gated_delta_rule(
        q[:, 37:],
        k[:, 37:],
        v[:, 37:],
        g[:, 37:],
        beta[:, 37:],
        initial_state=S1,
        output_final_state=True,
        chunk_size=16,
    )
    assert_close(torch.cat([o1, o2], 1), o_full, 1e-11)
    assert_close(S2, S_full, 1e-11)


def test_repeated_single_steps_equal_full_call():
    q, k, v, g, beta, h0 = make(T=20, seed=6, dtype=torch.float32)
    o_full, S_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    S, outs = h0, []
    for t in range(20):
        o_t, S = chunk_gated_delta_rule(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            initial_state=S,
            output_final_state=True,
        )
        assert o_t.shape == (2, 1, 2, 6) and S.dtype == torch.float32
        outs.append(o_t)
    assert_close(torch.cat(outs, 1), o_full, 1e-5)
    assert_close(S, S_full, 1e-5)


def test_fp32_close_to_fp64_and_state_dtypes():
    inputs64 = make(B=2, T=150, H=2, K=32, V=16, seed=8)
    o64, S64 = chunk_gated_delta_rule_reference(*inputs64[:5], initial_state=inputs64[5], output_final_state=True)
    inputs32 = [t.float() for t in inputs64]
    o32, S32 = chunk_gated_delta_rule_reference(*inputs32[:5], initial_state=inputs32[5], output_final_state=True)
    assert o32.dtype == torch.float32 and S32.dtype == torch.float32 and S64.dtype == torch.float64
    assert_close(o32, o64, 1e-5, 1e-5)
    assert_close(S32, S64, 1e-5, 1e-5)


def test_bf16_inputs_and_autocast():
    inputs = make(B=2, T=70, H=2, K=16, V=16, seed=9, dtype=torch.float32)
    o32, S32 = chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    bf = [t.bfloat16() for t in inputs[:5]]
    o_bf, S_bf = chunk_gated_delta_rule(*bf, initial_state=inputs[5], output_final_state=True)
    assert o_bf.dtype == torch.bfloat16 and S_bf.dtype == torch.float32
    assert_close(o_bf, o32, 5e-2, 2e-2)
    # autocast must not leak into the reference: fp32 inputs stay fp32 and (nearly) exact
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_ac, S_ac = chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert o_ac.dtype == torch.float32
    assert_close(o_ac, o32, 1e-6)
    assert_close(S_ac, S32, 1e-6)


def test_chunk_size_independent_fp32():
    inputs = make(B=1, T=100, H=3, K=16, V=8, seed=10, dtype=torch.float32)
    outs = [
        chunk_gated_delta_rule_reference(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=c)
        for c in (1, 7, 32, 64, 128)
    ]
    for o, S in outs[1:]:
        assert_close(o, outs[0][0], 1e-5)
        assert_close(S, outs[0][1], 1e-5)


def test_resolve_backend_cpu():
    assert BACKENDS == ("auto", "reference", "fla") and CONFIG_KEY == "model.kernels.gdn"
    assert resolve_backend("auto", "cpu", torch.float32) == "reference"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "reference"
    assert resolve_backend("reference", "cpu", torch.float64) == "reference"
    for name in ("auto", "reference", "fla"):
        assert resolve_backend(name, "meta", torch.bfloat16) == name
    with pytest.raises(ConfigError, match="model.kernels.gdn") as ei:
        resolve_backend("fla", "cpu", torch.bfloat16)
    assert "CUDA" in str(ei.value) and ei.value.value == "fla"
    with pytest.raises(ConfigError, match="model.kernels.gdn"):
        resolve_backend("triton", "cpu", torch.float32)
    q, k, v, g, beta, _ = make(T=5, dtype=torch.float32)
    with pytest.raises(ConfigError, match="model.kernels.gdn"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend="fla")


def test_bad_arguments():
    q, k, v, g, beta, h0 = make(T=5, dtype=torch.float32)
    for cs in (0, -4, 2.5, True, None):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=cs)
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=cs)
    bad = [
        (q[..., :4], k, v, g, beta, None),  # K mismatch
        (q, k, v[:, :3], g, beta, None),  # T mismatch
        (q, k, v, g[..., None], beta, None),  # g rank
        (q, k, v, g, beta[:, :, :1], None),  # beta heads
        (q, k, v, g, beta, h0[..., :2]),  # state V
        (q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], None),  # T == 0
        (q[0], k[0], v[0], g[0], beta[0], None),  # no batch dim
    ]
    for args in bad:
        with pytest.raises(ValueError, match="allowed"):
            chunk_gated_delta_rule(*args[:5], initial_state=args[5])


def test_import_is_lazy():
    """Importing the op and resolving on CPU must not import fla."""
    code = (
        "import sys, torch; from canonlm.ops.gdn import resolve_backend, chunk_gated_delta_rule; "
        "resolve_backend('auto', 'cpu', torch.float32); "
        "bad = [m for m in sys.modules if m == 'fla' or m.startswith('fla.') or m == 'triton']; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# second oracle: fla's naive references (loaded by file path; no triton needed)
# ----------------------------------------------------------------------------------------------------------------


def _naive():
    m = load_fla_naive("gated_delta_rule")
    if m is None or not hasattr(m, "naive_recurrent_gated_delta_rule"):
        pytest.skip("fla-core gated_delta_rule/naive.py not available")
    return m


@pytest.mark.parametrize("T", [37, 130])
def test_matches_fla_naive_references(T):
    """fla's naive references do not L2-normalise q/k: compare with use_qk_l2norm=False on pre-normalised keys
    (unnormalised keys make the delta rule unstable)."""
    m = _naive()
    q, k, v, g, beta, h0 = make(B=2, T=T, H=2, K=16, V=8, seed=T, dtype=torch.float32)
    k = F.normalize(k, dim=-1)
    o, S = chunk_gated_delta_rule_reference(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=False, chunk_size=32
    )
    o_r, S_r = m.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0.clone(), output_final_state=True)
    assert_close(o, o_r, 1e-4, 1e-5, msg="vs naive_recurrent o")
    assert_close(S, S_r, 1e-4, 1e-5, msg="vs naive_recurrent S")
    o_c, S_c = m.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=32, initial_state=h0.clone(), output_final_state=True
    )
    assert_close(o, o_c, 1e-4, 1e-5, msg="vs naive_chunk o")
    assert_close(S, S_c, 1e-4, 1e-5, msg="vs naive_chunk S")
    # with the in-kernel normalisation: same as normalising q and k beforehand
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o_l2, _ = chunk_gated_delta_rule_reference(q * 3.0, k * 0.5, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o_rn, _ = m.naive_recurrent_gated_delta_rule(qn, kn, v, beta, g, initial_state=h0.clone())
    assert_close(o_l2, o_rn, 1e-4, 1e-5, msg="l2norm vs pre-normalised naive_recurrent")


def test_grads_match_fla_naive_recurrent():
    m = _naive()
    inputs = make(B=1, T=45, H=2, K=8, V=8, seed=4, dtype=torch.float32)
    inputs[1] = F.normalize(inputs[1], dim=-1)
    do = torch.randn(1, 45, 2, 8, dtype=torch.float64)
    dS = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    _, _, g_ref = run_with_grads(
        lambda q, k, v, g, b, h: m.naive_recurrent_gated_delta_rule(
            q, k, v, b, g, initial_state=h * 1.0, output_final_state=True
        ),
        inputs,
        do,
        dS,
    )
    _, _, gr = run_with_grads(
        lambda q, k, v, g, b, h: chunk_gated_delta_rule_reference(
            q, k, v, g, b, initial_state=h, output_final_state=True, use_qk_l2norm=False, chunk_size=16
        ),
        inputs,
        do,
        dS,
    )
    for name, a, b in zip(NAMES, gr, g_ref):
        assert_close(a, b, 1e-4, 1e-4, msg=f"d{name}")


# ----------------------------------------------------------------------------------------------------------------
# GPU: fla kernels vs the reference
# ----------------------------------------------------------------------------------------------------------------


def _skip_unless_fla(dtype=torch.bfloat16):
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    from canonlm.ops.gdn import _fla

    fns, err = _fla.functions()
    if fns is None:
        pytest.skip(f"fla unavailable: {err}")
    reason = _fla.dtype_reason(dtype)
    if reason is not None:
        pytest.skip(reason)


# fp32: fla 0.6 has no TF32 switch for chunk_gated_delta_rule; Triton rounds fp32 dots to TF32 unless pytest runs
# with TRITON_F32_DEFAULT=ieee (tests/_kernel_calls.py)
GPU_TOL = {torch.float32: fp32_tol(), torch.bfloat16: 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,init", [(64, False), (100, True), (300, True)])
def test_fla_chunk_matches_reference(monkeypatch, dtype, T, init):
    _skip_unless_fla(dtype)
    from canonlm.ops.gdn import _fla

    no_torch_tf32(monkeypatch)
    assert resolve_backend("auto", "cuda", dtype) == "fla"
    calls = count_calls(monkeypatch, _fla, "forward")
    B, H, K, V = 2, 4, 64, 64
    inputs = make(B=B, T=T, H=H, K=K, V=V, seed=T, dtype=torch.float32, init=init)
    inputs = [None if t is None else t.cuda() for t in inputs]
    q, k, v, g, beta, h0 = inputs
    q, k, v = (t.to(dtype) for t in (q, k, v))  # g and beta stay fp32, as canonlm's GDN mixer passes them
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.float64)
    dS = torch.randn(B, H, K, V, device="cuda", dtype=torch.float64)
    args = [q, k, v, g, beta, h0]
    o_ref, S_ref, g_ref = run_with_grads(
        lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True, backend="reference"),
        [None if t is None else t.float() for t in args],
        do,
        dS,
    )
    o, S, gr = run_with_grads(
        lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True, backend="auto"),
        args,
        do,
        dS,
    )
    assert len(calls) == 1  # fla ran, not the reference
    assert o.dtype == dtype and S.dtype == torch.float32
    tol = GPU_TOL[dtype]
    assert_close(o, o_ref, tol, tol, msg=f"fla {dtype} o")
    assert_close(S, S_ref, tol, tol, msg=f"fla {dtype} S")
    for name, a, b in zip(NAMES, gr, g_ref):
        if b is None:
            continue
        assert_close(a, b, 2 * tol, 2 * tol, msg=f"fla {dtype} d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_decode_path_matches_reference(monkeypatch, dtype):
    """T <= 64 without autograd goes to fused_recurrent_gated_delta_rule; T=1 steps continue the state."""
    _skip_unless_fla(dtype)
    from canonlm.ops.gdn import _fla

    calls = count_calls(monkeypatch, _fla, "forward")
    B, H, K, V, T = 2, 4, 64, 64, 24
    inputs = [t.cuda() for t in make(B=B, T=T, H=H, K=K, V=V, seed=1, dtype=torch.float32)]
    q, k, v, g, beta, h0 = inputs
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))  # beta in the kernel dtype here (fla's own layer)
    with torch.no_grad():
        o_ref, S_ref = chunk_gated_delta_rule(
            q.float(),
            k.float(),
            v.float(),
            g,
            beta.float(),
            initial_state=h0,
            output_final_state=True,
            backend="reference",
        )
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="fla")
        tol = GPU_TOL[dtype]
        assert o.dtype == dtype and S.dtype == torch.float32
        assert_close(o, o_ref, tol, tol, msg="fused_recurrent o")
        assert_close(S, S_ref, tol, tol, msg="fused_recurrent S")
        St, outs = h0, []
        for t in range(T):
            o_t, St = chunk_gated_delta_rule(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                g[:, t : t + 1],
                beta[:, t : t + 1],
                initial_state=St,
                output_final_state=True,
                backend="fla",
            )
            outs.append(o_t)
        assert len(calls) == 1 + T  # every call went to fla
        assert_close(torch.cat(outs, 1), o_ref, tol, tol, msg="T=1 steps o")
        assert_close(St, S_ref, tol, tol, msg="T=1 steps S")


@pytest.mark.gpu
def test_auto_on_cuda_float64_falls_back_with_warning():
    _skip_unless_fla()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert resolve_backend("auto", "cuda", torch.float64) == "reference"
    with pytest.raises(ConfigError, match="model.kernels.gdn"):
        resolve_backend("fla", "cuda", torch.float64)
