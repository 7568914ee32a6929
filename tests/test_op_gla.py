"""GLA op (canonlm.ops.gla) against independent oracles (Yang et al. 2024; ``fla.ops.gla``).

Oracle 1: ``canonlm.ops.gla.naive.gla_loop``, a plain step-by-step loop over time in float64 of the recurrence
``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale * q_t)``; autograd through the loop gives the
gradient oracle. It shares no code with the chunked reference.
Oracle 2: fla's ``naive_recurrent_gla`` (fla/ops/gla/naive.py, loaded by path; skipped without fla-core): fp32,
fixed scale K**-0.5, returns (o, final_state).

GPU tests (``pytest -m gpu``) compare fla's ``chunk_gla`` / ``fused_recurrent_gla`` paths with the reference; they
skip without CUDA or without an importable ``fla.ops.gla``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _kernel_calls import count_calls, fp32_tol, no_torch_tf32

from canonlm.errors import ConfigError
from canonlm.ops._fla_naive import load_fla_naive
from canonlm.ops.gla import BACKENDS, CONFIG_KEY, chunk_gla, chunk_gla_reference, resolve_backend
from canonlm.ops.gla.naive import gla_loop as loop_gla

F64 = torch.float64


@pytest.fixture(autouse=True)
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------------------------
# oracle and helpers
# ----------------------------------------------------------------------------------------------------------------


def make(B=2, T=37, H=2, K=8, V=6, gate="mild", init=True, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    x = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    g = {
        "mild": F.logsigmoid(x) / 16,
        "strong": F.logsigmoid(x) * 5,
        "huge": F.logsigmoid(x) * 200 - 50,
        "zero": torch.zeros_like(x),
    }[gate]
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=F64) if init else None
    return [t.to(dtype) if t is not None else None for t in (q, k, v, g, h0)]


def run(fn, inputs, do, dS):
    """fn(q, k, v, g, h0) -> (o, S); returns o, S and the grads of (o*do).sum() + (S*dS).sum() w.r.t. the inputs."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    o, S = fn(*leaves)
    loss = (o.to(do.dtype) * do).sum() + (S.to(dS.dtype) * dS).sum()
    loss.backward()
    return o, S, [t.grad if t is not None else None for t in leaves]


def rel(a, b):
    """max |a - b| / max |b| (both upcast to float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def ref(chunk_size=64, scale=None):
    return lambda q, k, v, g, h0: chunk_gla_reference(
        q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )


def oracle(scale=None):
    return lambda q, k, v, g, h0: loop_gla(q, k, v, g, scale=scale, initial_state=h0)


# ----------------------------------------------------------------------------------------------------------------
# reference vs loop oracle (float64)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["mild", "strong"])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("T,chunk_size", list(itertools.product([1, 37, 130], [1, 16, 64])) + [(70, 24), (9, 3)])
def test_reference_matches_loop_oracle(T, chunk_size, init, gate):
    inputs = make(T=T, gate=gate, init=init, seed=T + chunk_size)
    B, _, H, K = inputs[0].shape
    V = inputs[2].shape[-1]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    dS = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    scale = 0.3 if chunk_size == 16 else None
    o, S, grads = run(ref(chunk_size, scale), inputs, do, dS)
    eo, eS, egrads = run(oracle(scale), inputs, do, dS)
    assert o.dtype == F64 and S.dtype == F64 and o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    torch.testing.assert_close(o, eo, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, eS, rtol=1e-10, atol=1e-10)
    for name, gr, eg in zip("q k v g h0".split(), grads, egrads):
        if eg is None:
            assert gr is None
            continue
        assert torch.isfinite(gr).all(), name
        torch.testing.assert_close(gr, eg, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_extreme_gates_stay_finite(dtype):
    """Gates of -50 .. -250 per step (exp underflows) next to zero gates (no decay): no NaN/inf anywhere, forward and
    backward, and the values still match the float64 loop (never exp(b_t) * exp(-b_j))."""
    q, k, v, g, h0 = make(T=100, gate="huge", seed=3)
    g[:, 40:60] = 0.0  # a run without decay inside a chunk
    g[:, 5] = -1e4
    inputs = [t.to(dtype) for t in (q, k, v, g, h0)]
    do = torch.randn(2, 100, 2, 6, dtype=F64)
    dS = torch.randn(2, 2, 8, 6, dtype=F64)
    o, S, grads = run(ref(64), inputs, do, dS)
    eo, eS, egrads = run(oracle(), [t.double() for t in inputs], do, dS)
    for t in (o, S, *grads):
        assert torch.isfinite(t).all()
    tol = 1e-10 if dtype == F64 else 2e-5
    assert rel(o, eo) < tol and rel(S, eS) < tol
    for gr, eg in zip(grads, egrads):
        assert rel(gr, eg) < tol * 10


def test_zero_gate_is_plain_linear_attention():
    q, k, v, g, _ = make(T=20, gate="zero", init=False, seed=5)
    o, S = chunk_gla_reference(q, k, v, g, output_final_state=True, chunk_size=8)
    scores = torch.einsum("bthk,bjhk->bhtj", q * 8**-0.5, k).tril()
    torch.testing.assert_close(o, torch.einsum("bhtj,bjhv->bthv", scores, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, torch.einsum("bthk,bthv->bhkv", k, v), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# continuation, decode steps
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T1,T2,chunk_size", [(37, 50, 16), (64, 64, 64), (1, 90, 64), (100, 3, 32)])
def test_continuation_equals_one_call(T1, T2, chunk_size):
    q, k, v, g, h0 = make(T=T1 + T2, gate="strong", seed=T1)
    o, S = chunk_gla_reference(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o1, S1 = chunk_gla_reference(
        q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )
    o2, S2 = chunk_gla_reference(
        q[:, T1:], k[:, T1:], v[:, T1:], g[:, T1:], initial_state=S1, output_final_state=True, chunk_size=chunk_size
    )
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S2, S, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("init", [False, True])
def test_single_token_steps_equal_one_call(init):
    q, k, v, g, h0 = make(T=40, gate="mild", init=init, seed=11)
    o, S = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    with torch.no_grad():
        for t in range(40):
            sl = slice(t, t + 1)
            ot, state = chunk_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=state, output_final_state=True)
            outs.append(ot)
    torch.testing.assert_close(torch.cat(outs, dim=1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, S, rtol=1e-10, atol=1e-10)


def test_results_do_not_depend_on_chunk_size():
    q, k, v, g, h0 = make(T=150, gate="strong", seed=2)
    outs = [
        chunk_gla_reference(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=c)
        for c in (1, 7, 32, 64, 128, 1000)
    ]
    for o, S in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, outs[0][1], rtol=1e-10, atol=1e-10)


def test_no_final_state_unless_asked():
    q, k, v, g, h0 = make(T=10)
    o, S = chunk_gla_reference(q, k, v, g, initial_state=h0)
    assert S is None and o.shape == (2, 10, 2, 6)
    o2, S2 = chunk_gla(q, k, v, g, backend="reference")
    assert S2 is None


# ----------------------------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------------------------


def test_float32_close_to_float64():
    inputs = make(B=2, T=300, H=2, K=16, V=16, gate="mild", seed=4)
    o64, S64 = chunk_gla_reference(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    i32 = [t.float() for t in inputs]
    o32, S32 = chunk_gla_reference(*i32[:4], initial_state=i32[4], output_final_state=True)
    assert o32.dtype == torch.float32 and S32.dtype == torch.float32
    assert rel(o32, o64) < 1e-5 and rel(S32, S64) < 1e-5


def test_bfloat16_inputs():
    inputs = [t.to(torch.bfloat16) for t in make(T=70, seed=6)]
    o, S = chunk_gla_reference(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    eo, eS = loop_gla(*[t.double() for t in inputs[:4]], initial_state=inputs[4].double())
    assert rel(o, eo) < 1e-2 and rel(S, eS) < 1e-5
    # fp32 gate with bf16 q/k/v (what the GLA mixer passes): computes in fp32, returns v's dtype
    o2, _ = chunk_gla(*inputs[:3], inputs[3].float())
    assert o2.dtype == torch.bfloat16
    q, k, v, g, h0 = make(T=8)
    o3, _ = chunk_gla(q.float(), k.float(), v.to(torch.bfloat16), g.float())
    assert o3.dtype == torch.bfloat16


def test_autocast_is_disabled_inside():
    inputs = [t.float() for t in make(T=50, seed=7)]
    o, S = chunk_gla_reference(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        oa, Sa = chunk_gla_reference(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    assert oa.dtype == torch.float32 and Sa.dtype == torch.float32
    torch.testing.assert_close(oa, o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(Sa, S, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# fla's naive recurrent reference (second oracle)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", [False, True])
def test_matches_fla_naive_recurrent(init):
    naive = load_fla_naive("gla")
    if naive is None:
        pytest.skip("fla-core not installed (fla/ops/gla/naive.py not loadable)")
    inputs = [t.float() if t is not None else None for t in make(B=2, T=100, H=2, K=16, V=8, init=init, seed=8)]
    do = torch.randn(2, 100, 2, 8)
    dS = torch.randn(2, 2, 16, 8)
    # naive_recurrent_gla(q, k, v, gk, initial_state, output_final_state) -> (o, final_state); scale fixed K**-0.5
    eo, eS, egrads = run(
        lambda q, k, v, g, h0: naive.naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True),
        inputs,
        do,
        dS,
    )
    o, S, grads = run(ref(32), inputs, do, dS)
    assert rel(o, eo) < 1e-5 and rel(S, eS) < 1e-5
    for gr, eg in zip(grads, egrads):
        if eg is not None:
            assert rel(gr, eg) < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# backend resolution and argument checks
# ----------------------------------------------------------------------------------------------------------------


def test_resolve_backend_cpu():
    assert BACKENDS == ("auto", "reference", "fla") and CONFIG_KEY == "model.kernels.gla"
    assert resolve_backend("auto", "cpu", torch.float32) == "reference"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "reference"
    assert resolve_backend("reference", "cpu", torch.float64) == "reference"
    with pytest.raises(ConfigError, match="model.kernels.gla") as e:
        resolve_backend("fla", "cpu", torch.float32)
    assert "reference" in str(e.value) and "CUDA" in str(e.value)
    with pytest.raises(ConfigError, match="model.kernels.gla"):
        resolve_backend("triton", "cpu", torch.float32)
    assert isinstance(e.value, ValueError)


def test_resolve_backend_meta():
    assert resolve_backend("auto", "meta", torch.float32) == "auto"
    assert resolve_backend("fla", "meta", torch.bfloat16) == "fla"
    assert resolve_backend("reference", "meta", torch.float32) == "reference"
    with pytest.raises(ConfigError):
        resolve_backend("nope", "meta", torch.float32)


def test_chunk_gla_dispatch_on_cpu():
    q, k, v, g, h0 = make(T=45, seed=9)
    a = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=16)
    b = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=16, backend="reference")
    c = chunk_gla_reference(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=16)
    for x in (a, b):
        torch.testing.assert_close(x[0], c[0], rtol=0, atol=0)
        torch.testing.assert_close(x[1], c[1], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="model.kernels.gla"):
        chunk_gla(q, k, v, g, backend="fla")
    with pytest.raises(ConfigError):
        chunk_gla(q, k, v, g, backend="bogus")


@pytest.mark.parametrize("bad", [0, -1, 2.5, "64", None, True])
def test_chunk_size_must_be_positive_int(bad):
    q, k, v, g, _ = make(T=5)
    for fn in (chunk_gla, chunk_gla_reference):
        with pytest.raises(ValueError, match="chunk_size"):
            fn(q, k, v, g, chunk_size=bad)


def test_shape_errors():
    q, k, v, g, h0 = make(B=2, T=5, H=2, K=8, V=6)
    cases = [
        (q, k, v, g[..., :4], None),  # g not like q
        (q, k[:, :4], v, g, None),  # T mismatch
        (q, k, v[:, :, :1], g, None),  # H mismatch
        (q[:, :0], k[:, :0], v[:, :0], g[:, :0], None),  # T = 0
        (q[0], k[0], v[0], g[0], None),  # 3-D
        (q, k, v, g, h0[..., :3]),  # state V mismatch
        (q, k, v, g, h0.transpose(-1, -2)),  # state (B, H, V, K)
        (q.long(), k, v, g, None),  # integer dtype
    ]
    for q_, k_, v_, g_, h_ in cases:
        with pytest.raises(ValueError, match="chunk_gla"):
            chunk_gla(q_, k_, v_, g_, initial_state=h_)


def test_meta_tensors_give_shapes():
    q, k, g = (torch.empty(2, 100, 4, 16, device="meta") for _ in range(3))
    v = torch.empty(2, 100, 4, 32, device="meta")
    o, S = chunk_gla(q, k, v, g, output_final_state=True)
    assert o.shape == (2, 100, 4, 32) and o.device.type == "meta" and S.shape == (2, 4, 16, 32)


def test_module_import_does_not_import_fla():
    import subprocess
    import sys

    code = (
        "import sys, canonlm.ops.gla as m; "
        "bad = [n for n in sys.modules if n == 'fla' or n.startswith(('fla.', 'triton'))]; "
        "m.resolve_backend('auto', 'cpu', m.torch.float32); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------------------------
# GPU: fla kernels vs the reference
# ----------------------------------------------------------------------------------------------------------------


def _skip_unless_fla():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from canonlm.ops.gla import _fla

    fns, err = _fla.fla_functions()
    if fns is None:
        pytest.skip(f"fla.ops.gla unavailable: {err}")
    return fns


# fp32: fla 0.6 has no TF32 switch for chunk_gla; Triton rounds fp32 dots to TF32 unless pytest runs with
# TRITON_F32_DEFAULT=ieee (tests/_kernel_calls.py)
GPU_TOL = {torch.float32: fp32_tol(), torch.bfloat16: 5e-2}


def _gpu_case(dtype, T, init, seed=0, B=2, H=2, K=64, V=64):
    """Inputs rounded to ``dtype`` (g in fp32 as the GLA mixer passes it, initial state fp32), CPU float64 copies for
    the reference, and the upstream gradients."""
    q, k, v, g, h0 = make(B=B, T=T, H=H, K=K, V=V, gate="mild", init=init, seed=seed)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    g = g.float()
    h0 = h0.float() if h0 is not None else None
    do = torch.randn(B, T, H, V, dtype=F64)
    dS = torch.randn(B, H, K, V, dtype=F64)
    return [q, k, v, g, h0], do, dS


def _cuda(ts):
    return [t.cuda() if t is not None else None for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,init", [(100, True), (256, False), (64, True), (7, True)])
def test_fla_chunk_matches_reference(monkeypatch, dtype, T, init):
    _skip_unless_fla()
    from canonlm.ops.gla import _fla

    no_torch_tf32(monkeypatch)
    assert resolve_backend("auto", "cuda", dtype) == "fla"
    calls = count_calls(monkeypatch, _fla, "fla_forward")
    inputs, do, dS = _gpu_case(dtype, T, init, seed=T)
    eo, eS, egrads = run(ref(64), [t.double() if t is not None else None for t in inputs], do, dS)
    o, S, grads = run(
        lambda q, k, v, g, h0: chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, backend="auto"),
        _cuda(inputs),
        do.cuda(),
        dS.cuda(),
    )
    assert len(calls) == 1  # fla ran, not the reference
    assert o.dtype == dtype and o.device.type == "cuda" and S.dtype == torch.float32
    tol = GPU_TOL[dtype]
    assert rel(o, eo) < tol and rel(S, eS) < tol
    for name, gr, eg in zip("q k v g h0".split(), grads, egrads):
        if eg is not None:
            assert gr is not None and rel(gr, eg) < tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_fused_recurrent_matches_reference(dtype):
    """fla's fused_recurrent_gla (the decode path) called directly, fwd + bwd, with initial/final state."""
    fns = _skip_unless_fla()
    if fns[1] is None:
        pytest.skip("fused_recurrent_gla not exported by this fla version")
    inputs, do, dS = _gpu_case(dtype, 50, True, seed=1)
    eo, eS, egrads = run(ref(16), [t.double() for t in inputs], do, dS)
    o, S, grads = run(
        lambda q, k, v, g, h0: fns[1](q, k, v, gk=g, initial_state=h0, output_final_state=True),
        _cuda(inputs),
        do.cuda(),
        dS.cuda(),
    )
    tol = GPU_TOL[dtype]
    assert rel(o, eo) < tol and rel(S, eS) < tol
    for name, gr, eg in zip("q k v g h0".split(), grads, egrads):
        assert rel(gr, eg) < tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_decode_steps_match_reference(monkeypatch, dtype):
    """chunk_gla(backend='fla') under no_grad: prefill (T=20 -> fused_recurrent), then T=1 steps, then a 100-token
    chunk (chunk_gla), state carried over; equals one reference call."""
    _skip_unless_fla()
    from canonlm.ops.gla import _fla

    calls = count_calls(monkeypatch, _fla, "fla_forward")
    inputs, _, _ = _gpu_case(dtype, 130, True, seed=2)
    eo, eS = chunk_gla_reference(
        *[t.double() for t in inputs[:4]], initial_state=inputs[4].double(), output_final_state=True
    )
    q, k, v, g, state = _cuda(inputs)
    outs = []
    with torch.no_grad():
        for a, b in [(0, 20)] + [(t, t + 1) for t in range(20, 30)] + [(30, 130)]:
            o, state = chunk_gla(
                q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=state, output_final_state=True, backend="fla"
            )
            assert o.dtype == dtype and state.dtype == torch.float32
            outs.append(o)
    assert len(calls) == len(outs)
    tol = GPU_TOL[dtype]
    assert rel(torch.cat(outs, dim=1), eo) < tol and rel(state, eS) < tol


@pytest.mark.gpu
def test_auto_picks_fla_on_cuda():
    _skip_unless_fla()
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "fla"
    assert resolve_backend("auto", "cuda", torch.float64) == "reference"
    with pytest.raises(ConfigError, match="model.kernels.gla"):
        resolve_backend("fla", "cuda", torch.float64)
