"""Canon CUDA fast paths (dao = causal_conv1d_fn, fla = fla Triton causal_conv1d) against the reference,
and the Llama-Canon model on the GPU: pinned Canon kernels and flash attention (forward,
gradients, KV-cache decode) against the same weights on the reference path, ``ops=fused`` placement, bf16 cached
decode against one full forward, and a 2-GPU FSDP2 bf16 ``train.py`` smoke. Run with ``pytest -m gpu``; every test
skips without CUDA or without the library.

No test passes on a silent fallback: op-level tests name their backend explicitly (an unavailable or refused one
raises); model-level tests pin the kernels, place the model with ``CanonLM.place("cuda", dtype)`` (which raises when
a request cannot be met) and read the resolved names back from the model and its modules.

Oracle of the op tests: a plain loop over kernel taps in float64 on the CPU (independent of every backend), fed the
same rounded inputs the fast path sees.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canonlm.arch import CanonLM, build_model_config
from canonlm.arch.canon import Canon
from canonlm.arch.mixers import Attention
from canonlm.ops import canon as canon_ops
from canonlm.ops.attention import attention
from canonlm.ops.canon import available_backends, causal_conv1d, causal_conv1d_step
from canonlm.ops.canon.naive import canon_loop as loop_oracle

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 for PyTorch's matmuls / convs (the reference paths). fla's Triton conv does no tl.dot, Dao's
    kernel is CUDA C: neither uses TF32, so the fp32 tolerances stay tight."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _skip_unless(backend: str) -> None:
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    reason = available_backends(torch.device("cuda"), torch.float32)[backend]
    if reason is not None:
        pytest.skip(f"{backend} unavailable: {reason}")


def _grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in leaves]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y, [None if t is None else t.grad for t in leaves]


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


@pytest.mark.parametrize("backend", ["dao", "fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_fast_path_matches_oracle(backend, dtype, K):
    _skip_unless(backend)
    g = torch.Generator().manual_seed(K)
    B, T, C = 2, 70, 64
    for residual, activation, bias, init in itertools.product([True, False], repeat=4):
        x = torch.randn(B, T, C, generator=g).to(dtype)
        w = (torch.rand(C, K, generator=g) - 0.5).to(dtype)
        b = torch.randn(C, generator=g).to(dtype) if bias else None
        h = torch.randn(B, C, K - 1, generator=g).to(dtype) if init else None
        dy = torch.randn(B, T, C, generator=g).to(dtype)
        ref_y, ref_g = _grads(
            lambda xx, ww, bb, hh: loop_oracle(xx, ww, bb, residual, activation, hh),
            [t.double() if t is not None else None for t in (x, w, b, h)],
            dy.double(),
        )
        y, gr = _grads(
            lambda xx, ww, bb, hh: causal_conv1d(
                xx, ww, bb, residual=residual, activation=activation, backend=backend, initial_state=hh
            ),
            [t.cuda() if t is not None else None for t in (x, w, b, h)],
            dy.cuda(),
        )
        assert y.dtype == dtype and y.device.type == "cuda"
        msg = f"{backend} {dtype} K={K} res={residual} act={activation} bias={bias} init={init}"
        torch.testing.assert_close(y.double().cpu(), ref_y, **TOL[dtype], msg=lambda m: f"{msg} y: {m}")
        for name, a, r in zip(("dx", "dw", "db", "dinit"), gr, ref_g):
            if r is None:
                continue
            scale = max(1.0, r.abs().max().item())  # dw/db are sums over B*T terms
            torch.testing.assert_close(
                a.double().cpu() / scale, r / scale, **TOL[dtype], msg=lambda m, n=name: f"{msg} {n}: {m}"
            )


@pytest.mark.parametrize("backend", ["dao", "fla"])
def test_fast_path_causality(backend):
    _skip_unless(backend)
    x = torch.randn(2, 20, 32, device="cuda")
    w = torch.rand(32, 4, device="cuda") - 0.5
    x2 = x.clone()
    x2[:, 9] += 1.0
    y, y2 = causal_conv1d(x, w, backend=backend), causal_conv1d(x2, w, backend=backend)
    assert torch.equal(y[:, :9], y2[:, :9])


@pytest.mark.parametrize("backend", ["dao", "fla"])
@pytest.mark.parametrize("activation", [False, True])
def test_fast_step_matches_torch_step(backend, activation):
    """One decode step with the library's update kernel equals the torch formula; the caller's state is kept."""
    _skip_unless(backend)
    x_t = torch.randn(3, 32, device="cuda")
    state = torch.randn(3, 32, 4, device="cuda")
    w = torch.rand(32, 4, device="cuda") - 0.5
    b = torch.randn(32, device="cuda")
    keep = state.clone()
    y, s = causal_conv1d_step(x_t, state, w, b, activation=activation, backend=backend)
    y_ref, s_ref = causal_conv1d_step(x_t, state, w, b, activation=activation, backend="torch")
    assert torch.equal(state, keep)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)


def test_auto_on_cuda_picks_a_fast_path_or_torch_and_handles_odd_shapes():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    av = available_backends(torch.device("cuda"), torch.float32)
    fast = [n for n in ("dao", "fla") if av[n] is None]
    if not fast:
        pytest.skip(f"no Canon CUDA kernel: {av}")
    # a shape every kernel takes: auto must select the first fast one (dao before fla), not torch
    assert canon_ops.resolve_backend("auto", "cuda", torch.float32) == fast[0]
    assert canon_ops._select("auto", "cuda", torch.float32, 64, 4) == fast[0]
    # C = 60 is not a multiple of 8 and K = 5 is outside causal_conv1d's widths: auto must fall back, not fail
    for C, K in ((60, 4), (64, 5)):
        assert canon_ops._select("auto", "cuda", torch.float32, C, K) in ("fla", "torch")
        x = torch.randn(2, 17, C, device="cuda")
        w = torch.rand(C, K, device="cuda") - 0.5
        y = causal_conv1d(x, w, backend="auto")
        torch.testing.assert_close(
            y.double().cpu(), loop_oracle(x.double().cpu(), w.double().cpu()), rtol=1e-4, atol=1e-4
        )


def test_dao_rejects_unsupported_shapes_explicitly():
    _skip_unless("dao")
    with pytest.raises(ValueError, match="K in"):
        causal_conv1d(torch.randn(1, 8, 64, device="cuda"), torch.randn(64, 5, device="cuda"), backend="dao")
    with pytest.raises(ValueError, match="C % 8"):
        causal_conv1d(torch.randn(1, 8, 60, device="cuda"), torch.randn(60, 4, device="cuda"), backend="dao")


# ------------------------------------------------------------------------------------------------ flash attention op
def _skip_unless_flash():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash_attn")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash-attn needs an Ampere or newer GPU")


@pytest.mark.parametrize("Hkv", [4, 2])
def test_flash_attention_grads_and_kv_cache_call(Hkv):
    """flash_attn_func (bf16) against the fp32 reference: output and q/k/v gradients (GQA too); and a KV-cache call
    (T new queries over S > T keys, bottom-right aligned) against the last T rows of one full call."""
    _skip_unless_flash()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, D = 2, 96, 4, 64
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, S, Hkv, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, S, Hkv, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    outs = []
    for backend in ("flash", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        y = attention(*leaves, causal=True, backend=backend)
        y.backward(dy)
        outs.append((y.float(), [t.grad.float() for t in leaves]))
    (yf, gf), (yr, gr) = outs
    torch.testing.assert_close(yf, yr, rtol=2e-2, atol=2e-2)
    for a, r in zip(gf, gr):
        assert ((a - r).norm() / r.norm()).item() < 2e-2
    T = 5  # decode: the last T queries over all S cached keys
    with torch.no_grad():
        y_cache = attention(q[:, -T:], k, v, causal=True, backend="flash")
        y_full = attention(q, k, v, causal=True, backend="flash")[:, -T:]
        y_ref = attention(q[:, -T:], k, v, causal=True, backend="reference")
    torch.testing.assert_close(y_cache.float(), y_full.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y_cache.float(), y_ref.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------ Llama-Canon model
def _fast_canon(dtype) -> str:
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    av = available_backends(torch.device("cuda"), dtype)
    for name in ("dao", "fla"):
        if av[name] is None:
            return name
    pytest.skip(f"no Canon CUDA kernel: {av}")


def _llama(canon, **req):
    return build_model_config({"size": "2L256D"}, canon={"set": canon}, vocab_size=64, max_seq_len=512, **req)


def _llama_pair(canon, kernels, dtype):
    """(fast, ref): Llama-Canon with ``kernels`` pinned, placed on CUDA for ``dtype``, and the same weights with
    ``ops=reference``; the resolved names are checked on the model and on every Canon / attention module."""
    fast = CanonLM(_llama(canon, kernels=kernels)).cuda()
    ref = CanonLM(_llama(canon, ops="reference")).cuda()
    ref.load_state_dict(fast.state_dict())
    got = fast.place("cuda", dtype)
    for op, name in kernels.items():
        assert got[op] == name, got
    canon_names = {m.backend for m in fast.modules() if isinstance(m, Canon)}
    assert canon_names == ({kernels.get("canon", "auto")} if canon else set())
    assert {m.backend for m in fast.modules() if isinstance(m, Attention)} == {got["attention"]}
    assert ref.place("cuda", dtype) == {"canon": "reference", "attention": "reference"}
    return fast, ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _fwd_bwd(m, ids, bf16):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = m(ids)
    logits.float().logsumexp(-1).mean().backward()
    return logits.float(), torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])


@pytest.mark.parametrize("canon", ["ABCD", "AC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["dao", "fla"])
def test_pinned_canon_model_matches_reference(canon, dtype, which):
    """Llama-Canon with ``kernels.canon=dao|fla``: logits and every gradient equal the reference model's."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    reason = available_backends(torch.device("cuda"), dtype)[which]
    if reason is not None:
        pytest.skip(f"{which} unavailable: {reason}")
    torch.manual_seed(0)
    fast, ref = _llama_pair(canon, {"canon": which}, dtype)
    ids = torch.randint(0, 64, (2, 200), device="cuda")
    bf16 = dtype == torch.bfloat16
    (lf, gf), (lr, gr) = _fwd_bwd(fast, ids, bf16), _fwd_bwd(ref, ids, bf16)
    tol = 5e-2 if bf16 else 1e-4
    torch.testing.assert_close(lf, lr, rtol=tol, atol=tol)
    assert _rel(gf, gr) < (5e-2 if bf16 else 1e-4)


@pytest.mark.parametrize("canon", ["ABCD", ""])
def test_flash_model_matches_reference_with_grads_and_cache(canon):
    """``kernels.attention=flash`` (+ the Canon kernel pinned), placed for bf16: forward + backward against the
    reference model under the same autocast; then bf16 cached decode (prefill + one-token steps: flash with S > T)
    against one full forward."""
    _skip_unless_flash()
    torch.manual_seed(0)
    kernels = {"attention": "flash", "canon": _fast_canon(torch.bfloat16)}
    fast, ref = _llama_pair(canon, kernels, torch.bfloat16)
    ids = torch.randint(0, 64, (2, 200), device="cuda")
    (lf, gf), (lr, gr) = _fwd_bwd(fast, ids, True), _fwd_bwd(ref, ids, True)
    torch.testing.assert_close(lf, lr, rtol=5e-2, atol=5e-2)
    assert _rel(gf, gr) < 5e-2
    fast.eval()
    ids = ids[:, :60]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full = fast(ids)
        cache = fast.new_cache()
        parts = [fast(ids[:, :23], cache), fast(ids[:, 23:30], cache)]  # prefill, then a 7-token chunk
        parts += [fast(ids[:, t : t + 1], cache) for t in range(30, 60)]
    step = torch.cat(parts, 1)
    assert step.dtype == full.dtype == torch.bfloat16
    assert _rel(step, full) < 2e-2
    assert (step.argmax(-1) == full.argmax(-1)).float().mean() > 0.95


def test_flash_refused_in_fp32_at_placement():
    """flash takes fp16/bf16 only: placing a flash model for fp32 is the ConfigError, before any forward."""
    _skip_unless_flash()
    from canonlm.arch import ConfigError

    model = CanonLM(_llama("ABCD", kernels={"attention": "flash"})).cuda()
    with pytest.raises(ConfigError) as e:
        model.place("cuda", torch.float32)
    assert e.value.key == "model.kernels.attention"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_place_the_canon_cuda_kernel(dtype):
    """``ops=fused`` built on the CPU (native Canon kernel there) and placed on CUDA: every Canon module switches to
    the CUDA kernel, and the model matches the reference model."""
    expected = _fast_canon(dtype)
    torch.manual_seed(0)
    fast = CanonLM(_llama("ABCD", ops="fused"))
    ref = CanonLM(_llama("ABCD", ops="reference"))
    ref.load_state_dict(fast.state_dict())
    fast, ref = fast.cuda(), ref.cuda()
    got = fast.place("cuda", dtype)
    assert got == {"canon": expected, "attention": "sdpa"}
    assert {m.backend for m in fast.modules() if isinstance(m, Canon)} == {expected}
    ref.place("cuda", dtype)
    ids = torch.randint(0, 64, (2, 100), device="cuda")
    bf16 = dtype == torch.bfloat16
    (lf, gf), (lr, gr) = _fwd_bwd(fast, ids, bf16), _fwd_bwd(ref, ids, bf16)
    tol = 5e-2 if bf16 else 1e-4
    torch.testing.assert_close(lf, lr, rtol=tol, atol=tol)
    assert _rel(gf, gr) < (5e-2 if bf16 else 1e-4)


def test_fsdp2_bf16_training_smoke_with_flash(tmp_path):
    """``train.py strategy=fsdp2 trainer=gpu`` on 2 GPUs, precision 32-true with the FSDP2 bf16 param_dtype: the
    model is placed for bf16, so ``kernels.attention=flash`` (fp16/bf16 only) is accepted and runs. A few steps,
    finite losses, perf metrics."""
    _skip_unless_flash()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs >= 2 GPUs")
    n = 2
    args = [
        "task=depo1_cpu",
        "model.size=2L128D",
        "canon=ABCD",
        "task.N=8",
        "task.K=4",
        "task.vocab_V=6",
        "task.context=128",
        f"data.batch_size={4 * n}",
        "data.val_windows=8",
        "data.test_windows=8",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=1",
        "strategy=fsdp2",
        "strategy.param_dtype=bf16",
        "trainer=gpu",
        f"trainer.devices={n}",
        "trainer.precision=32-true",
        "kernels.attention=flash",
        f"kernels.canon={_fast_canon(torch.bfloat16)}",
        "logger=none",
        "run_name=fsdp",
        f"paths.log_dir={tmp_path}/logs",
    ]
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    run = tmp_path / "logs" / "train" / "runs" / "fsdp"
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert any("perf/mfu" in r or "perf/tokens_per_s" in r for r in rows)
