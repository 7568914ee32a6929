"""What makes Canon fast on a GPU (issue 25), checked where a CPU can check it.

* The residual folded into the weight (``canonlm.ops.canon.fold_residual``): ``x_t + conv(x, w)_t = conv(x, w +
  e_{K-1})_t`` without an activation. Oracle: the plain loop ``canonlm.ops.canon.naive.canon_loop`` in float64 with
  the residual added by hand, forward and every gradient, for several kernel sizes, with a bias and an initial state.
* The CUDA wrappers hand fla's ``causal_conv1d`` and Dao's ``causal_conv1d_fn`` the folded weight and no residual
  (stand-ins written from the libraries' signatures record what they get and compute with the loop; the real fla
  kernel runs with the fold under Triton's interpreter in tests/test_triton_interpret.py, whose mutation check has a
  wrong-tap fold among its mutations).
* Canon in the compute dtype: under autocast the pre-norms return the autocast dtype, so Canon-A and Canon-C read
  and write bf16, like Canon-B and Canon-D (oracle: the dtype rule of autocast itself, ``torch.get_autocast_dtype``).
* The compile path: a Llama with Canon-ABCD on the ``torch`` shift-and-add backend, each block compiled by inductor
  with ``fullgraph=True`` (Canon, RMSNorm, RoPE and the SiLU gate in one graph: no graph break), under bf16 autocast,
  against the same weights on ``ops=reference`` in eager mode: logits and every gradient.
"""

from __future__ import annotations

import pytest
import torch

from canonlm.arch import CanonLM, build_model_config
from canonlm.arch.canon import Canon
from canonlm.ops.canon import _cuda, fold_residual
from canonlm.ops.canon.naive import canon_loop


def _case(K: int, seed: int = 0, B: int = 2, T: int = 23, C: int = 12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    h0 = torch.randn(B, C, K - 1, generator=g, dtype=torch.float64)
    return x, w, b, h0


@pytest.mark.parametrize("K", [1, 2, 4, 5])
def test_fold_changes_only_the_current_token_tap_by_one(K):
    _, w, _, _ = _case(K)
    f = fold_residual(w)
    assert f.shape == w.shape and f.dtype == w.dtype
    assert torch.equal(f[:, :-1], w[:, :-1])
    assert torch.equal(f[:, -1], w[:, -1] + 1)
    assert torch.equal(w, _case(K)[1])  # the argument is not modified


@pytest.mark.parametrize("K", [1, 2, 4, 5])
@pytest.mark.parametrize("with_state", [False, True])
def test_folded_weight_computes_the_residual_canon(K, with_state):
    """conv(x, fold(w)) == x + conv(x, w) by the plain loop in float64, and so are the gradients w.r.t. x, w, b and
    the initial state (the fold's own gradient is the identity)."""
    x, w, b, h0 = _case(K, seed=K)
    init = h0 if with_state and K > 1 else None
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    leaves2 = [t.clone().requires_grad_(True) for t in (x, w, b)]
    s1 = s2 = None
    if init is not None:
        s1, s2 = init.clone().requires_grad_(True), init.clone().requires_grad_(True)
    ref = leaves[0] + canon_loop(leaves[0], leaves[1], leaves[2], residual=False, init=s1)
    got = canon_loop(leaves2[0], fold_residual(leaves2[1]), leaves2[2], residual=False, init=s2)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    g_ref = torch.autograd.grad((ref * r).sum(), leaves + ([s1] if s1 is not None else []))
    g_got = torch.autograd.grad((got * r).sum(), leaves2 + ([s2] if s2 is not None else []))
    for a, e in zip(g_got, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------- the CUDA wrappers
seen: list[dict] = []


def _fla_stand_in(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, **kw
):
    """fla-core 0.6.0 ``causal_conv1d(x (B, T, D), weight (D, W), bias, residual, initial_state (N, D, W) with column 0
    unused, output_final_state, activation) -> (y, final_state)``: y = act(conv) + residual, computed by the loop."""
    seen.append(dict(lib="fla", weight=weight.detach().clone(), residual=residual))
    hist = None if initial_state is None else initial_state[:, :, 1:]
    y = canon_loop(x, weight, bias, residual=False, activation=activation in ("silu", "swish"), init=hist)
    return (y + residual if residual is not None else y), None


def _dao_stand_in(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """causal-conv1d ``causal_conv1d_fn(x (B, C, T), weight (C, W), bias, seq_idx, initial_states (B, C, W-1),
    return_final_states, final_states_out, activation)``: act(conv), no residual argument."""
    seen.append(dict(lib="dao", weight=weight.detach().clone(), residual=None))
    y = canon_loop(
        x.transpose(1, 2), weight, bias, residual=False, activation=activation == "silu", init=initial_states
    )
    return y.transpose(1, 2)


@pytest.fixture
def stand_ins(monkeypatch):
    from canonlm.ops import _dispatch

    monkeypatch.setitem(_dispatch._probes, "canon.fla", ((_fla_stand_in, None), None))
    monkeypatch.setitem(_dispatch._probes, "canon.dao", ((_dao_stand_in, None), None))
    seen.clear()


@pytest.mark.parametrize("lib", ["fla", "dao"])
@pytest.mark.parametrize("residual,activation", [(True, False), (True, True), (False, True), (False, False)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_cuda_wrappers_pass_the_folded_weight_and_no_residual(stand_ins, lib, residual, activation, wdtype):
    """The folded weight reaches the kernel in fp32 even when the weight is bf16 (FSDP2's bf16 param_dtype,
    ``bf16-true``): ``w[:, K-1] + 1`` in bf16 would round by up to 2^-8, in fp32 it is exact for a bf16 w."""
    x, w, b, h0 = (t.float() for t in _case(4, seed=3, C=16))
    w = w.to(wdtype)
    fwd = _cuda.fla_forward if lib == "fla" else _cuda.dao_forward
    y = fwd(x, w, b, residual, activation, h0)
    call = seen[-1]
    folded = residual and not activation
    want_w = w.float().clone()
    if folded:
        want_w[:, -1] += 1
    if not folded:
        want_w = want_w.to(wdtype)
    assert call["weight"].dtype == want_w.dtype and torch.equal(call["weight"], want_w)
    if lib == "fla":
        assert (call["residual"] is None) == (folded or not residual)
    # causal-conv1d takes the bias in the weight's dtype: unfolded, a bf16 weight rounds the bias too
    b_used = b.to(wdtype) if lib == "dao" and not folded else b
    expect = canon_loop(
        x.double(), w.double(), b_used.double(), residual=residual, activation=activation, init=h0.double()
    )
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- compute dtype
def _llama(canon: str = "ABCD", **kw):
    cfg = build_model_config(
        {"n_layers": 2, "d_model": 64, "n_heads": 2}, canon={"set": canon}, vocab_size=32, max_seq_len=32, **kw
    )
    torch.manual_seed(0)
    return CanonLM(cfg)


@pytest.mark.parametrize("autocast", [False, True])
def test_every_canon_layer_runs_in_the_compute_dtype(autocast):
    """Under bf16 autocast Canon-A and Canon-C get bf16 inputs from their pre-norms (the residual stream stays fp32)
    and every Canon layer returns bf16; without autocast everything stays fp32."""
    model = _llama(kernels={"canon": "torch"})
    model.place("cpu", torch.bfloat16 if autocast else torch.float32)
    got: dict[str, tuple] = {}

    def record(name):
        def hook(mod, args, out):
            got[name] = (args[0].dtype, out.dtype)

        return hook

    for name, m in model.named_modules():
        if isinstance(m, Canon):
            m.register_forward_hook(record(name))
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids)
    want = torch.get_autocast_dtype("cpu") if autocast else torch.float32
    assert want == (torch.bfloat16 if autocast else torch.float32)
    sites = {n.rsplit(".", 1)[-1] for n in got}
    assert sites == {"canon_a", "canon_b", "canon_c", "canon_d"} and len(got) == 8
    assert all(v == (want, want) for v in got.values()), got
    assert logits.dtype == want


# ------------------------------------------------------------------------------------------- compile path
@pytest.mark.slow
def test_compiled_blocks_with_torch_canon_match_the_reference_in_bf16():
    """Each block compiled with fullgraph=True (a graph break, e.g. an opaque kernel, would raise), Canon on the
    ``torch`` path, bf16 autocast; against ``ops=reference`` eager: logits within bf16 rounding, every gradient by
    relative L2 norm (the tolerances of tests/test_eval_precision.py's bf16 checks)."""
    fast, ref = _llama(kernels={"canon": "torch"}), _llama(ops="reference")
    ref.load_state_dict(fast.state_dict())
    fast.place("cpu", torch.bfloat16, compiled=True)
    assert set(fast.canon_backends.values()) == {"torch"}
    for block in fast.blocks:
        block.compile(fullgraph=True)
    ids = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (fast, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        (logits.float().square().mean()).backward()
        outs.append((logits.float(), {n: p.grad for n, p in model.named_parameters()}))
    (lf, gf), (lr, gr) = outs
    assert (lf - lr).norm() / lr.norm() < 2e-2
    assert gf.keys() == gr.keys()
    for n in gr:
        assert (gf[n] - gr[n]).norm() / gr[n].norm() < 5e-2, n
