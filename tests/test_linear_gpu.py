"""Model-level GPU checks of the linear zoo: each architecture with its fast paths (fla chunk kernels,
mamba_ssm's fused conv + SSD + gated norm + out-proj, Dao / fla causal conv) against the same weights on the
pure-PyTorch references, in fp32 and under bf16 autocast, forward and gradients; cached decoding on the GPU against
one full forward, in fp32 and bf16; and a 2-GPU FSDP2 bf16 training smoke through ``train.py``. Run with
``pytest -m gpu``; every test skips without CUDA or without the kernel library.

No test can pass on a silent fallback: the fast model pins its kernels (``kernels.<op>=fla|mamba_ssm``,
``kernels.canon=dao|fla``) or asks for ``ops=fused``, is placed with ``CanonLM.place("cuda", dtype)`` -- which raises
when a request cannot be met -- and the test reads the resolved names back from the model and from every mixer and
Canon module. The per-op kernel-vs-reference tests live in tests/test_op_{gla,gdn,ssd}.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from canonlm.arch import CanonLM, build_model_config
from canonlm.arch.canon import Canon
from canonlm.ops import canon as canon_ops

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
LIBS = {"gla": "fla", "gdn": "fla", "mamba2": "mamba_ssm"}
OP = {"gla": "gla", "gdn": "gdn", "mamba2": "ssd"}
FAST = {"gla": "fla", "gdn": "fla", "mamba2": "mamba_ssm"}
PRESETS = {
    "gla": dict(arch="gla"),
    "gdn": dict(arch="gdn", expand_k=0.75, expand_v=1.5, ffn_ratio=2.0),
    "mamba2": dict(arch="mamba2", ffn_ratio=2.0, init="mamba2_default", norm_eps=1e-5),
}
# fp32 tolerances: the reference path runs with TF32 off (fixture below), but fla's and mamba_ssm's Triton kernels
# use TF32 in tl.dot by default (10-bit mantissa, ~1e-3 relative per product), hence 1e-2 rather than 1e-3.
TOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}
GRAD_TOL = {torch.float32: 2e-2, torch.bfloat16: 6e-2}


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 for PyTorch's own matmuls / convs (the reference path) during these tests."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _need(arch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec(LIBS[arch]) is None:
        pytest.skip(f"needs {LIBS[arch]}")


def _fast_canon(dtype=torch.float32) -> str:
    """The Canon CUDA kernel to pin: dao when it is importable, else fla; skip when neither is."""
    av = canon_ops.available_backends(torch.device("cuda"), dtype)
    for name in ("dao", "fla"):
        if av[name] is None:
            return name
    pytest.skip(f"no Canon CUDA kernel: {av}")


def _requests(arch, mode, dtype):
    """``pinned``: every op pinned to its fast kernel; ``fused``: ``ops=fused`` (each op's fast kernel required)."""
    if mode == "pinned":
        return {"kernels": {OP[arch]: FAST[arch], "canon": _fast_canon(dtype)}}
    return {"ops": "fused"}


def _pair(arch, canon, dtype=torch.float32, mode="pinned"):
    """(fast, ref): the same weights, the fast model placed on CUDA for ``dtype`` with fast kernels required, the
    reference model with ``ops=reference``; both checked to hold what they claim."""
    kw = dict(PRESETS[arch], size="2L256D")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = CanonLM(
            build_model_config(kw, canon={"set": canon}, vocab_size=64, max_seq_len=512, **_requests(arch, mode, dtype))
        ).cuda()
        ref = CanonLM(
            build_model_config(kw, canon={"set": canon}, vocab_size=64, max_seq_len=512, ops="reference")
        ).cuda()
    ref.load_state_dict(fast.state_dict())
    got = fast.place("cuda", dtype)
    assert got[OP[arch]] == FAST[arch] and got["canon"] in ("dao", "fla"), got
    assert all(b.attn.backend == FAST[arch] for b in fast.blocks)
    assert {m.backend for m in fast.modules() if isinstance(m, Canon)} <= {got["canon"]}
    assert ref.place("cuda", dtype) == {"canon": "reference", OP[arch]: "reference"}
    assert all(b.attn.backend == "reference" for b in ref.blocks)
    return fast, ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("arch", list(PRESETS))
@pytest.mark.parametrize("canon", ["b", "AbCD", ""])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["pinned", "fused"])
def test_fast_model_matches_reference_model(arch, canon, dtype, mode):
    """Forward logits and every parameter gradient of the fast model equal the reference model's."""
    _need(arch)
    torch.manual_seed(0)
    fast, ref = _pair(arch, canon, dtype, mode)
    bf16 = dtype == torch.bfloat16
    ids = torch.randint(0, 64, (2, 300), device="cuda")
    outs, grads = [], []
    for m in (fast, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = m(ids)
        logits.float().logsumexp(-1).mean().backward()
        outs.append(logits.float())
        grads.append(torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None]))
    torch.testing.assert_close(outs[0], outs[1], rtol=TOL[dtype], atol=TOL[dtype])
    assert grads[0].numel() == grads[1].numel()
    assert _rel(grads[0], grads[1]) < GRAD_TOL[dtype]


@pytest.mark.parametrize("arch", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_equals_full_forward(arch, dtype):
    """Prefill 17 tokens, then one-token steps through the DecodeCache (the fused-recurrent / state-update kernels),
    against one full forward of the same fast model -- in fp32 and under bf16 autocast."""
    _need(arch)
    torch.manual_seed(0)
    fast, _ = _pair(arch, "AbCD", dtype)
    fast.eval()
    bf16 = dtype == torch.bfloat16
    ids = torch.randint(0, 64, (3, 40), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        full = fast(ids)
        cache = fast.new_cache()
        parts = [fast(ids[:, :17], cache)] + [fast(ids[:, t : t + 1], cache) for t in range(17, 40)]
    step = torch.cat(parts, 1)
    assert step.dtype == full.dtype == (torch.bfloat16 if bf16 else torch.float32)
    if bf16:  # different kernels (chunked vs recurrent), each rounding to bf16: compare relative norms
        assert _rel(step, full) < 2e-2
        assert (step.argmax(-1) == full.argmax(-1)).float().mean() > 0.95
    else:
        torch.testing.assert_close(step, full, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("arch", ["gla", "mamba2"])
def test_fsdp2_bf16_training_smoke(arch, tmp_path):
    """``train.py strategy=fsdp2 trainer=gpu`` on 2 GPUs with the FSDP2 bf16 param_dtype (precision 32-true): the
    linear op and Canon pinned to their CUDA kernels, which is only allowed because the model is placed for bf16.
    A few steps, finite losses, a checkpoint."""
    _need(arch)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs >= 2 GPUs")
    n = min(torch.cuda.device_count(), 2)
    args = [
        f"arch={arch}",
        "task=depo1_cpu",
        "model.size=2L128D",
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
        f"kernels.{OP[arch]}={FAST[arch]}",
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
    res = json.loads((run / "results.json").read_text())
    assert res["steps"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert any("perf/peak_mem_gb" in r for r in rows)
