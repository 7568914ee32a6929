"""Canon op (canonlm.ops.canon) on CPU against independent oracles (paper eq. 4.1; Dao-AILab ``causal_conv1d``).

Oracle: a plain Python loop over time steps and kernel taps in float64 (autograd through the loop gives the
gradient oracle); it shares no code with the backends under test.
"""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

from canonlm.arch.config import ConfigError
from canonlm.ops import canon as C
from canonlm.ops.canon import (
    BACKENDS,
    available_backends,
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_state,
    causal_conv1d_step,
    resolve_backend,
)
from canonlm.ops.canon import _native
from canonlm.ops.canon.naive import canon_loop as loop_oracle

NATIVE = _native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: {_native.unavailable_reason()}")
CPU_BACKENDS = ["reference", "torch"] + (["cpu"] if NATIVE else [])


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread keeps these tests fast and steady on a shared 2-core box (the native
    kernel's multi-threaded split is tested explicitly in test_native_work_split)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _inputs(B, T, Ch, K, seed=0, bias=True, init=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, Ch, generator=g, dtype=torch.float64)
    w = torch.rand(Ch, K, generator=g, dtype=torch.float64) - 0.5
    b = torch.randn(Ch, generator=g, dtype=torch.float64) if bias else None
    h = torch.randn(B, Ch, K - 1, generator=g, dtype=torch.float64) if init else None
    dy = torch.randn(B, T, Ch, generator=g, dtype=torch.float64)
    return x, w, b, h, dy


def _run(fn, dy, tensors):
    """Forward with fresh leaves, backward with dy; returns output and grads (zeros for empty/unused leaves)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    grads = [None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves]
    return y, grads


def _oracle(x, w, b, h, dy, residual, activation):
    return _run(lambda *a: loop_oracle(*a[:3], residual, activation, a[3]), dy, (x, w, b, h))


def _check(backend, dtype, x, w, b, h, dy, residual, activation, tol, wdtype=None):
    """Compare one backend with the oracle. x in ``dtype``; weight, bias, initial_state in ``wdtype`` (default
    ``dtype``); the oracle sees the same rounded inputs in float64."""
    wdtype = wdtype or dtype
    dts = (dtype, wdtype, wdtype, wdtype)
    cast = [t.to(d) if t is not None else None for t, d in zip((x, w, b, h), dts)]
    dy = dy.to(dtype).double()  # the backend sees dy rounded to x's dtype
    ref_y, ref_g = _oracle(*(t.double() if t is not None else None for t in cast), dy, residual, activation)
    y, g = _run(
        lambda xx, ww, bb, hh: causal_conv1d(
            xx, ww, bb, residual=residual, activation=activation, backend=backend, initial_state=hh
        ),
        dy,
        cast,
    )
    assert y.dtype == dtype and y.shape == x.shape
    ctx = (
        f"{backend} {dtype} K={w.shape[1]} T={x.shape[1]} res={residual} act={activation} bias={b is not None} "
        f"init={h is not None}"
    )
    torch.testing.assert_close(y.double(), ref_y, **tol["y"], msg=lambda m: f"{ctx} y: {m}")
    for name, a, r in zip(("dx", "dw", "db", "dinit"), g, ref_g):
        if r is None:
            assert a is None
            continue
        assert a.dtype == (dtype if name == "dx" else wdtype)
        torch.testing.assert_close(a.double(), r, **tol[name], msg=lambda m, n=name: f"{ctx} {n}: {m}")


TOL64 = {k: dict(rtol=1e-10, atol=1e-10) for k in ("y", "dx", "dw", "db", "dinit")}
TOL32 = {k: dict(rtol=1e-5, atol=1e-5) for k in ("y", "dx", "dw", "db", "dinit")}
TOL32["dw"] = TOL32["db"] = dict(rtol=1e-5, atol=1e-4)  # sums over B*T terms
# bf16 x: outputs / dx are rounded to bf16 (rel. 2^-8). With fp32 weights (autocast style) dw, db, dinit
# accumulate in fp32 from exact bf16 inputs and stay fp32 (TOLBF_W32); with bf16 weights they are rounded too.
TOLBF = {k: dict(rtol=1e-2, atol=2e-2) for k in ("y", "dx", "dw", "db", "dinit")}
TOLBF_W32 = dict(TOLBF, dw=dict(rtol=1e-4, atol=1e-3), db=dict(rtol=1e-4, atol=1e-3), dinit=dict(rtol=1e-4, atol=1e-4))

FLAGS = list(itertools.product([True, False], repeat=4))  # residual, activation, bias, init


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_backends_match_loop_oracle(K, T):
    """Every CPU backend, all flag combinations, fwd and grads (x, weight, bias, initial_state); T < K included."""
    for residual, activation, bias, init in FLAGS:
        x, w, b, h, dy = _inputs(2, T, 24, K, seed=K * 100 + T, bias=bias, init=init)
        _check("reference", torch.float64, x, w, b, h, dy, residual, activation, TOL64)
        _check("torch", torch.float64, x, w, b, h, dy, residual, activation, TOL64)
        _check("torch", torch.float32, x, w, b, h, dy, residual, activation, TOL32)
        if NATIVE:
            _check("cpu", torch.float32, x, w, b, h, dy, residual, activation, TOL32)
            _check("cpu", torch.bfloat16, x, w, b, h, dy, residual, activation, TOLBF)
            _check("cpu", torch.bfloat16, x, w, b, h, dy, residual, activation, TOLBF_W32, torch.float32)
        _check("torch", torch.bfloat16, x, w, b, h, dy, residual, activation, TOLBF)
        _check("torch", torch.bfloat16, x, w, b, h, dy, residual, activation, TOLBF_W32, torch.float32)


@needs_native
@pytest.mark.parametrize("impl,ctile,subblock", [(0, 0, 32), (0, 16, 7), (1, 0, 32), (1, 16, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_work_split(monkeypatch, impl, ctile, subblock, threads):
    """Long sequences (several time blocks per batch row, B=1; sub-blocks not dividing T), channel tiles, a partial
    16-channel vector (C=40), both kernels (register-window impl 0, row impl 1) and thread counts all agree with
    the oracle: exercises the look-ahead and history hand-over between blocks inside the C kernel."""
    monkeypatch.setattr(_native, "CHANNEL_TILE", ctile)
    monkeypatch.setattr(_native, "IMPL", impl)
    old_sb, old = _native.SUBBLOCK, torch.get_num_threads()
    _native.set_subblock(subblock)
    torch.set_num_threads(threads)
    try:
        for dtype, tol in ((torch.float32, TOL32), (torch.bfloat16, TOLBF_W32)):
            x, w, b, h, dy = _inputs(1, 300, 40, 4, seed=7)
            _check("cpu", dtype, x, w, b, h, dy, True, True, tol, torch.float32)
            _check("cpu", dtype, x, w, None, None, dy, True, False, tol, torch.float32)
            x, w, b, h, dy = _inputs(2, 70, 24, 3, seed=8)
            _check("cpu", dtype, x, w, b, h, dy, False, False, tol, torch.float32)
    finally:
        torch.set_num_threads(old)
        _native.set_subblock(old_sb)


@needs_native
@pytest.mark.parametrize("K", [4, 5, 10])
def test_native_long_kernels(K):
    """K = 4 (largest register-window specialisation) and K = 5, 10 (row kernel) against the oracle, with C=40
    (two full 16-channel vectors + an 8-channel tail on the row kernel)."""
    for residual, activation in ((True, False), (False, True)):
        x, w, b, h, dy = _inputs(2, 23, 40, K, seed=K)
        _check("cpu", torch.float32, x, w, b, h, dy, residual, activation, TOL32)


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["auto"])
def test_causality(backend):
    """Perturbing token t changes no output before t, and changes outputs t .. t+K-1."""
    x, w, b, _, _ = _inputs(2, 20, 16, 4, seed=3)
    x, w, b = x.float(), w.float(), b.float()
    t = 9
    x2 = x.clone()
    x2[:, t] += 1.0
    y = causal_conv1d(x, w, b, backend=backend)
    y2 = causal_conv1d(x2, w, b, backend=backend)
    assert torch.equal(y[:, :t], y2[:, :t])
    assert (y[:, t : t + 4] - y2[:, t : t + 4]).abs().amax(dim=(0, 2)).min() > 0
    torch.testing.assert_close(y[:, t + 4 :], y2[:, t + 4 :], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_kernel_returns_input(backend, dtype):
    """weight[:, K-1] multiplies the current token: kernel [0, 0, 0, 1] without residual is the identity."""
    x = torch.randn(3, 10, 16).to(dtype)
    w = torch.zeros(16, 4)
    w[:, -1] = 1.0
    assert torch.equal(causal_conv1d(x, w, residual=False, backend=backend), x)
    # and with residual, zero weights return x exactly
    assert torch.equal(causal_conv1d(x, torch.zeros(16, 4), residual=True, backend=backend), x)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_weight_index_order(backend):
    """Tap 0 multiplies the token K-1 steps back: kernel [1, 0, 0, 0] shifts the sequence right by 3."""
    x = torch.randn(2, 9, 8)
    w = torch.zeros(8, 4)
    w[:, 0] = 1.0
    y = causal_conv1d(x, w, residual=False, backend=backend)
    assert torch.equal(y[:, 3:], x[:, :-3]) and torch.equal(y[:, :3], torch.zeros_like(y[:, :3]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("activation", [False, True])
def test_step_decode_equals_full_forward(backend, activation):
    """Prefill a prefix, then decode token by token with causal_conv1d_step: equals one full forward."""
    x, w, b, _, _ = _inputs(2, 13, 16, 4, seed=11)
    x, w, b = x.float(), w.float(), b.float()
    full = causal_conv1d(x, w, b, activation=activation, backend=backend)
    P = 5
    y_pre = causal_conv1d(x[:, :P], w, b, activation=activation, backend=backend)
    state = causal_conv1d_state(x[:, :P], 4)
    outs = [y_pre]
    for t in range(P, 13):
        before = state.clone()
        y_t, state = causal_conv1d_step(x[:, t], state, w, b, activation=activation)
        assert torch.equal(before[:, :, 1:], state[:, :, :-1]) and torch.equal(state[:, :, -1], x[:, t])
        outs.append(y_t.unsqueeze(1))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_state_from_short_prefill_is_zero_padded():
    x = torch.randn(2, 2, 8)
    s = causal_conv1d_state(x, 4)
    assert s.shape == (2, 8, 4)
    assert torch.equal(s[:, :, :2], torch.zeros(2, 8, 2)) and torch.equal(s[:, :, 2:], x.transpose(1, 2))
    h = torch.randn(2, 8, 3)
    s2 = causal_conv1d_state(x, 4, initial_state=h)
    assert torch.equal(s2, torch.cat([h[:, :, 1:], x.transpose(1, 2)], -1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("K", [2, 4])
def test_chunked_prefill_with_initial_state(backend, K):
    """forward(x[:, :P]) then forward(x[:, P:], initial_state=last K-1 inputs) equals forward(x), for chunks
    shorter and longer than K; gradients flow into the history (compared with the one-shot forward)."""
    x, w, b, _, dy = _inputs(2, 17, 16, K, seed=5)
    x, w, b, dy = x.float(), w.float(), b.float(), dy.float()
    xa = x.clone().requires_grad_()
    full = causal_conv1d(xa, w, b, activation=True, backend=backend)
    full.backward(dy)
    for P in (1, 6):
        xb = x.clone().requires_grad_()
        y1 = causal_conv1d(xb[:, :P], w, b, activation=True, backend=backend)
        h = causal_conv1d_state(xb[:, :P], K)[:, :, 1:]
        y2 = causal_conv1d(xb[:, P:], w, b, activation=True, backend=backend, initial_state=h)
        y = torch.cat([y1, y2], 1)
        torch.testing.assert_close(y, full, rtol=1e-5, atol=1e-5)
        y.backward(dy)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_gradcheck_float64(backend):
    x, w, b, h, _ = _inputs(2, 6, 5, 3, seed=2)
    args = tuple(t.requires_grad_() for t in (x, w, b, h))
    for residual, activation in itertools.product([True, False], repeat=2):
        assert torch.autograd.gradcheck(
            lambda xx, ww, bb, hh: causal_conv1d(
                xx, ww, bb, residual=residual, activation=activation, backend=backend, initial_state=hh
            ),
            args,
        )


@needs_native
def test_native_custom_op_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of canonlm::canon_conv_fwd."""
    x, w, b, h, _ = _inputs(2, 7, 8, 4, seed=4)
    for res, act in itertools.product([True, False], repeat=2):
        args = (
            x.float().requires_grad_(),
            w.float().requires_grad_(),
            b.float().requires_grad_(),
            h.float().requires_grad_(),
            res,
            act,
        )
        torch.library.opcheck(torch.ops.canonlm.canon_conv_fwd.default, args)
        torch.library.opcheck(torch.ops.canonlm.canon_conv_fwd.default, (args[0], args[1], None, None, res, act))


@needs_native
def test_native_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces through the backend choice and the custom op (no graph break)."""

    def f(x, w):
        return (causal_conv1d(x, w, backend="auto") * 2).sum()

    x, w, _, _, _ = _inputs(2, 9, 8, 4, seed=6)
    x, w = x.float(), w.float()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.compile(f, fullgraph=True, backend="aot_eager")(xa, wa).backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    loop_oracle(xb.double(), wb.double()).mul(2).sum().backward()
    torch.testing.assert_close(xa.grad.double(), xb.grad.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wa.grad.double(), wb.grad.double(), rtol=1e-5, atol=1e-4)


@needs_native
def test_native_torch_compile_inductor():
    """Inductor compiles the surrounding graph and calls the custom op (~6 s on 2 cores)."""

    def f(x, w):
        return torch.nn.functional.gelu(causal_conv1d(x, w, backend="cpu")).sum()

    x, w, _, _, _ = _inputs(2, 9, 8, 4, seed=6)
    xa, wa = x.float().requires_grad_(), w.float().requires_grad_()
    torch.compile(f, fullgraph=True)(xa, wa).backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.gelu(loop_oracle(xb, wb)).sum().backward()
    torch.testing.assert_close(xa.grad.double(), xb.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_input_and_mixed_dtypes(backend):
    """x as a strided view (e.g. a slice of a fused projection) and bf16 x with fp32 weight (autocast style)."""
    big = torch.randn(2, 11, 40)
    x = big[:, :, 8:32]  # non-contiguous (B, T, 24)
    w = torch.rand(24, 4) - 0.5
    torch.testing.assert_close(
        causal_conv1d(x, w, backend=backend).double(), loop_oracle(x.double(), w.double()), rtol=1e-5, atol=1e-5
    )
    xb = x.to(torch.bfloat16)
    y = causal_conv1d(xb, w, backend=backend)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), loop_oracle(xb.double(), w.double()), rtol=1e-2, atol=2e-2)


def test_resolve_backend_names_and_errors():
    cpu = torch.device("cpu")
    for name in ("dao", "fla"):
        for dev in ("cpu", "cuda"):
            if dev == "cuda" and torch.cuda.is_available():
                continue
            with pytest.raises(ConfigError) as e:
                resolve_backend(name, torch.device(dev), torch.float32)
            assert e.value.key == "model.kernels.canon" and e.value.value == name
            assert "reference" in e.value.allowed and "torch" in e.value.allowed
    with pytest.raises(ConfigError, match="one of auto, reference, torch, cpu, fla, dao"):
        resolve_backend("triton", cpu, torch.float32)
    assert resolve_backend("reference", cpu, torch.float64) == "reference"
    assert resolve_backend("torch", cpu, torch.float16) == "torch"
    assert resolve_backend("auto", cpu, torch.float64) == "torch"
    assert resolve_backend("auto", cpu, torch.float32) == ("cpu" if NATIVE else "torch")
    with pytest.raises(ConfigError, match="float32 and bfloat16"):
        resolve_backend("cpu", cpu, torch.float64)
    with pytest.raises(ConfigError):  # raised before any work
        causal_conv1d(torch.randn(1, 4, 8), torch.randn(8, 4), backend="dao")
    assert set(available_backends(cpu)) == set(BACKENDS) - {"auto"}
    assert available_backends(cpu)["torch"] is None


def test_auto_falls_back_to_torch_without_compiler(monkeypatch):
    """No C compiler: 'auto' warns once and uses 'torch'; an explicit 'cpu' raises ConfigError."""
    monkeypatch.setattr(_native, "_tried", True)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_error", "RuntimeError: no C compiler found")
    monkeypatch.setattr(C, "_warned_native", False)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"  # warned once only
    with pytest.raises(ConfigError, match="no C compiler"):
        resolve_backend("cpu", torch.device("cpu"), torch.float32)


def test_bad_inputs_raise_value_error():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="weight.shape"):
        causal_conv1d(x, torch.randn(8, 1, 4))
    with pytest.raises(ValueError, match="weight.shape"):
        causal_conv1d(x, torch.randn(6, 4))
    with pytest.raises(ValueError, match="bias.shape"):
        causal_conv1d(x, torch.randn(8, 4), torch.randn(7))
    with pytest.raises(ValueError, match="initial_state.shape"):
        causal_conv1d(x, torch.randn(8, 4), initial_state=torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match=r"\(B, T, C\)"):
        causal_conv1d(torch.randn(5, 8), torch.randn(8, 4))
    with pytest.raises(ValueError, match="dtype"):
        causal_conv1d(torch.ones(2, 5, 8, dtype=torch.long), torch.randn(8, 4))
    with pytest.raises(ValueError, match="state"):
        causal_conv1d_step(torch.randn(2, 8), torch.randn(2, 8, 3), torch.randn(8, 4))


@needs_native
def test_native_build_cache(tmp_path, monkeypatch):
    """The kernel builds into $CANONLM_CACHE under a content-keyed name and is reused, not rebuilt."""
    monkeypatch.setenv("CANONLM_CACHE", str(tmp_path))
    p1 = _native._build()
    assert p1.parent == tmp_path and p1.name.startswith("canon_cpu_") and p1.suffix == ".so"
    mtime = os.stat(p1).st_mtime_ns
    assert _native._build() == p1 and os.stat(p1).st_mtime_ns == mtime
    assert [f.name for f in tmp_path.iterdir()] == [p1.name]  # no temp files left behind


def test_reference_is_the_documented_conv1d_formula():
    """causal_conv1d_reference == F.conv1d(F.pad(x, (K-1, 0)), w.unsqueeze(1), b, groups=C)."""
    x, w, b, _, _ = _inputs(2, 9, 6, 4, seed=9)
    direct = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), b, groups=6
    ).transpose(1, 2)
    assert torch.equal(causal_conv1d_reference(x, w, b, residual=False), direct)


# ---------------------------------------------------------------------------------------------------------------
# CUDA adapters on CPU: the dao/fla wrappers are checked against stand-ins that follow the libraries' documented
# contracts (causal_conv1d_interface.py; fla/modules/causal_conv1d/ops.py), so layout/state/residual plumbing is
# tested here; the real kernels are tested in test_canon_gpu.py.
# ---------------------------------------------------------------------------------------------------------------


def _fake_dao_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    assert x.dim() == 3 and x.stride(1) == 1, "dao: channel-last (B, C, T) view expected"
    assert bias is None or bias.dtype == weight.dtype
    if initial_states is not None:
        assert initial_states.stride(1) == 1 and initial_states.dtype == x.dtype
        assert initial_states.shape == (x.shape[0], x.shape[1], weight.shape[1] - 1)
    y = loop_oracle(x.transpose(1, 2), weight, bias, False, activation == "silu", initial_states)
    return y.transpose(1, 2)


def _fake_dao_update(x, conv_state, weight, bias=None, activation=None):
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x.unsqueeze(-1)], -1))
    z = (conv_state * weight).sum(-1) + (bias if bias is not None else 0)
    return z * torch.sigmoid(z) if activation == "silu" else z


def _fake_fla_fn(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, **kw
):
    hist = None
    if initial_state is not None:
        assert initial_state.shape == (x.shape[0], x.shape[2], weight.shape[1]), "fla: state is (N, D, W)"
        hist = initial_state[:, :, 1:]  # column 0 is unused by fla
    y = loop_oracle(x, weight, bias, False, activation in ("silu", "swish"), hist)
    return (y + residual if residual is not None else y), None


def _fake_fla_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    y = _fake_dao_update(x, cache, weight, bias, activation)
    return (y + residual if residual is not None else y), cache


@pytest.mark.parametrize("backend", ["dao", "fla"])
def test_cuda_adapters_against_documented_contracts(monkeypatch, backend):
    from canonlm.ops import _dispatch
    from canonlm.ops.canon import _cuda

    monkeypatch.setitem(_dispatch._probes, "canon.dao", ((_fake_dao_fn, _fake_dao_update), None))
    monkeypatch.setitem(_dispatch._probes, "canon.fla", ((_fake_fla_fn, _fake_fla_update), None))
    fwd = _cuda.dao_forward if backend == "dao" else _cuda.fla_forward
    step = _cuda.dao_step if backend == "dao" else _cuda.fla_step
    for residual, activation, bias, init in FLAGS:
        x, w, b, h, dy = (
            t.float() if t is not None else None for t in _inputs(2, 9, 16, 4, seed=21, bias=bias, init=init)
        )
        ref_y, ref_g = _oracle(x, w, b, h, dy, residual, activation)
        y, g = _run(lambda xx, ww, bb, hh: fwd(xx, ww, bb, residual, activation, hh), dy, (x, w, b, h))
        torch.testing.assert_close(y, ref_y)
        for a, r in zip(g, ref_g):
            if r is not None:
                torch.testing.assert_close(a, r)
        state = torch.randn(2, 16, 4)
        keep = state.clone()
        y1, s1 = step(x[:, 0], state, w, b, residual, activation)
        y2, s2 = causal_conv1d_step(x[:, 0], state, w, b, residual=residual, activation=activation, backend="torch")
        assert torch.equal(state, keep)
        torch.testing.assert_close(s1, s2)
        torch.testing.assert_close(y1, y2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "slice_of_wider", "misaligned_slice"])
def test_gpu_dao_on_strided_views_vs_reference(monkeypatch, dtype, layout):
    """Dao causal_conv1d_fn on views of a wider tensor (the stride logic of _cuda.dao_forward on the real kernel):
    forward, gradients and a decode step against the reference. The wrapper is counted (the library is not mocked);
    fp32 needs no TF32 allowance (causal-conv1d is plain CUDA, fp32 FMA)."""
    from _kernel_calls import count_calls

    from canonlm.ops.canon import _cuda

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if _cuda.dao_functions()[0] is None:
        pytest.skip(f"causal_conv1d unavailable: {_cuda.dao_functions()[1]}")
    assert C.resolve_backend("dao", "cuda", dtype) == "dao"
    calls = count_calls(monkeypatch, _cuda, "dao_forward")
    B, T, Ch, K = 2, 37, 64, 4
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(B, T, 3 * Ch, generator=g)
    start = {"contiguous": None, "slice_of_wider": Ch, "misaligned_slice": Ch + 2}[layout]
    x = (torch.randn(B, T, Ch, generator=g) if start is None else wide[..., start : start + Ch]).to(dtype)
    w, b = torch.randn(Ch, K, generator=g) * 0.3, torch.randn(Ch, generator=g) * 0.1
    h = torch.randn(B, Ch, K - 1, generator=g).to(dtype)
    dy = torch.randn(B, T, Ch, generator=g).to(dtype)

    def fwd_bwd(backend, dev):
        xx = x.to(dev).requires_grad_(True) if start is None else wide.to(dtype).to(dev).requires_grad_(True)
        xin = xx if start is None else xx[..., start : start + Ch]
        ww, bb, hh = (t.to(dev).requires_grad_(True) for t in (w, b, h))
        y = causal_conv1d(xin, ww, bb, residual=True, activation=True, backend=backend, initial_state=hh)
        grads = torch.autograd.grad(y, (xx, ww, bb, hh), dy.to(dev))
        return y, grads

    y, grads = fwd_bwd("dao", "cuda")
    assert len(calls) == 1 and y.dtype == dtype
    yr, grads_r = fwd_bwd("reference", "cpu")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y.float().cpu(), yr.float(), **tol)
    for a, r in zip(grads, grads_r):
        torch.testing.assert_close(a.float().cpu(), r.float(), **tol)
    state = causal_conv1d_state(x.cuda(), K, h.cuda())
    with torch.no_grad():
        y1, _ = causal_conv1d_step(
            x[:, 0].cuda(), state, w.cuda(), b.cuda(), residual=True, activation=True, backend="dao"
        )
        y2, _ = causal_conv1d_step(x[:, 0], state.cpu(), w, b, residual=True, activation=True, backend="torch")
    torch.testing.assert_close(y1.float().cpu(), y2.float(), **tol)
