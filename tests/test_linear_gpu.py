"""Model-level GPU checks of the linear zoo (models.md §9): each architecture with its fast paths (fla chunk kernels,
mamba_ssm's fused conv + SSD + gated norm + out-proj, Dao / fla causal conv) against the same weights on the
pure-PyTorch references, in fp32 and under bf16 autocast, forward and gradients; and cached decoding on the GPU
against one full forward. Run with ``pytest -m gpu``; every test skips without CUDA or without the kernel library.
The per-op kernel-vs-reference tests live in tests/test_op_{gla,gdn,ssd}.py."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch

from canonlm.arch import CanonLM, build_model_config

pytestmark = pytest.mark.gpu

LIBS = {"gla": "fla", "gdn": "fla", "mamba2": "mamba_ssm"}
PRESETS = {
    "gla": dict(arch="gla"),
    "gdn": dict(arch="gdn", expand_k=0.75, expand_v=1.5, ffn_ratio=2.0),
    "mamba2": dict(arch="mamba2", ffn_ratio=2.0, init="mamba2_default", norm_eps=1e-5),
}


def _need(arch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec(LIBS[arch]) is None:
        pytest.skip(f"needs {LIBS[arch]}")


def _pair(arch, canon):
    kw = dict(PRESETS[arch], size="2L256D")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = CanonLM(build_model_config(kw, canon={"set": canon}, vocab_size=64, max_seq_len=512)).cuda()
        ref_cfg = build_model_config(kw, canon={"set": canon}, vocab_size=64, max_seq_len=512, ops="reference")
        ref = CanonLM(ref_cfg).cuda()
    ref.load_state_dict(copy.deepcopy(fast.state_dict()))
    return fast, ref


@pytest.mark.parametrize("arch", list(PRESETS))
@pytest.mark.parametrize("canon", ["b", "AbCD", ""])
@pytest.mark.parametrize("bf16", [False, True])
def test_fast_model_matches_reference_model(arch, canon, bf16):
    _need(arch)
    torch.manual_seed(0)
    fast, ref = _pair(arch, canon)
    fast.check_backends("cuda", torch.bfloat16 if bf16 else torch.float32)
    ids = torch.randint(0, 64, (2, 300), device="cuda")
    outs, grads = [], []
    for m in (fast, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = m(ids)
        logits.float().logsumexp(-1).mean().backward()
        outs.append(logits.float())
        grads.append(torch.cat([p.grad.flatten().float() for p in m.parameters()]))
    tol = 5e-2 if bf16 else 2e-3
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < (5e-2 if bf16 else 5e-3)


@pytest.mark.parametrize("arch", list(PRESETS))
def test_gpu_decode_equals_full_forward(arch):
    _need(arch)
    torch.manual_seed(0)
    fast, _ = _pair(arch, "AbCD")
    fast.eval()
    ids = torch.randint(0, 64, (3, 40), device="cuda")
    with torch.no_grad():
        full = fast(ids)
        cache = fast.new_cache()
        parts = [fast(ids[:, :17], cache)] + [fast(ids[:, t:t + 1], cache) for t in range(17, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=2e-3, atol=2e-3)
