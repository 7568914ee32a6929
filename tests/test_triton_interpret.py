"""Optional tier: fla's Triton kernels on CPU under Triton's interpreter (spec engineering.md §6.4, models.md §9).

Runs only when both ``triton`` and fla-core import (the ``interp`` extra; triton is not a default dependency), else
skips. One subprocess (the interpreter must be switched on before triton is imported) sets ``TRITON_INTERPRET=1``,
patches triton's ``Autotuner`` to keep only its first config (the autotuner's benchmarking step needs a GPU driver,
engineering.md §6.4), and compares on small CPU tensors:

* ``fla.ops.gla.fused_recurrent_gla`` fwd+bwd (with initial and final state) vs
  ``canonlm.ops.gla.chunk_gla_reference``;
* canonlm's fla wrapper ``canonlm.ops.gla._fla.fla_forward`` on its decode path (no grad, T <= 64 ->
  ``fused_recurrent_gla``), bf16 q/k/v with an fp32 gate as the GLA mixer passes them;
* fla's Triton ``causal_conv1d(x, weight, bias, residual=x)`` (the Canon op) fwd+bwd vs
  ``canonlm.ops.canon.causal_conv1d_reference``.

``chunk_gla`` itself does not run under the interpreter with fla-core 0.6 (``InterpreterError`` in
``chunk_fwd_kernel_h``, engineering.md §6.4); it is covered by the GPU tests in test_op_gla.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAVE = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None
pytestmark = pytest.mark.skipif(not HAVE, reason="needs triton and fla-core (pip install -e '.[interp]')")

SCRIPT = r'''
import json, os, sys, time, traceback
os.environ["TRITON_INTERPRET"] = "1"
import warnings
warnings.filterwarnings("ignore")
import triton
from triton.runtime import autotuner as _autotuner

_prune = _autotuner.Autotuner.prune_configs


def _first_config_only(self, kwargs):
    # one config left -> Autotuner.run takes its no-benchmark branch
    return _prune(self, kwargs)[:1]


_autotuner.Autotuner.prune_configs = _first_config_only

import torch
import torch.nn.functional as F

torch.manual_seed(0)
res = {"triton": triton.__version__}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def grads(fn, leaves, dys):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    sum((o.double() * d).sum() for o, d in zip(outs, dys)).backward()
    return outs, [t.grad for t in leaves]


def part(name, fn):
    t0 = time.time()
    try:
        res[name] = fn()
    except Exception:
        res[name] = {"error": traceback.format_exc(limit=6)}
    res[name + "_seconds"] = round(time.time() - t0, 2)


def gla_fused():
    from fla.ops.gla import fused_recurrent_gla
    from canonlm.ops.gla import chunk_gla_reference
    B, T, H, K, V = 2, 30, 2, 16, 16
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, K)) / 4
    h0 = torch.randn(B, H, K, V)
    dys = [torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)]
    (o, s), gr = grads(lambda *a: fused_recurrent_gla(a[0], a[1], a[2], gk=a[3], initial_state=a[4],
                                                       output_final_state=True), [q, k, v, g, h0], dys)
    (eo, es), egr = grads(lambda *a: chunk_gla_reference(*a[:4], initial_state=a[4], output_final_state=True,
                                                         chunk_size=16), [q, k, v, g, h0], dys)
    out = {"o": rel(o, eo), "state": rel(s, es)}
    out.update({"d" + n: rel(a, b) for n, a, b in zip(["q", "k", "v", "g", "h0"], gr, egr)})
    return out


def gla_wrapper_decode():
    from canonlm.ops.gla import _fla, chunk_gla_reference
    B, T, H, K, V = 1, 20, 2, 16, 32
    q, k = torch.randn(B, T, H, K).bfloat16(), torch.randn(B, T, H, K).bfloat16()
    v = torch.randn(B, T, H, V).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, H, K)) / 8
    h0 = torch.randn(B, H, K, V)
    with torch.no_grad():
        o, s = _fla.fla_forward(q, k, v, g, K ** -0.5, h0, True)
        eo, es = chunk_gla_reference(q.double(), k.double(), v.double(), g.double(), initial_state=h0.double(),
                                     output_final_state=True)
    return {"o": rel(o, eo), "state": rel(s, es), "o_dtype": str(o.dtype), "state_dtype": str(s.dtype)}


def canon_conv():
    from canonlm.ops.canon import _cuda, causal_conv1d_reference
    fn = _cuda._load_fla()[0]
    out = {}
    for bias, act in ((True, False), (False, True)):
        B, T, D, W = 2, 33, 16, 4
        x = torch.randn(B, T, D)
        w = torch.rand(D, W) - 0.5
        b = torch.randn(D) if bias else torch.zeros(D)
        dys = [torch.randn(B, T, D, dtype=torch.float64)]

        def fla_fn(x, w, b):
            y = fn(x, weight=w, bias=b if bias else None, residual=x, activation="silu" if act else None)
            return [y[0] if isinstance(y, (tuple, list)) else y]

        def ref_fn(x, w, b):
            return [causal_conv1d_reference(x, w, b if bias else None, residual=True, activation=act)]

        (y,), gr = grads(fla_fn, [x, w, b], dys)
        (ey,), egr = grads(ref_fn, [x, w, b], dys)
        tag = f"bias={bias},silu={act}"
        out[tag] = {"y": rel(y, ey), "dx": rel(gr[0], egr[0]), "dw": rel(gr[1], egr[1])}
        if bias:
            out[tag]["db"] = rel(gr[2], egr[2])
    return out


part("gla_fused_recurrent", gla_fused)
part("gla_wrapper_decode", gla_wrapper_decode)
part("canon_causal_conv1d", canon_conv)
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _ok(res: dict, name: str) -> dict:
    r = res[name]
    assert "error" not in r, f"{name} (triton {res['triton']}) raised:\n{r['error']}"
    return r


def test_fla_fused_recurrent_gla_vs_reference(interp_results):
    r = _ok(interp_results, "gla_fused_recurrent")
    for key, val in r.items():
        assert val < 1e-5, (key, r)


def test_fla_wrapper_decode_path_vs_reference(interp_results):
    r = _ok(interp_results, "gla_wrapper_decode")
    assert r["o_dtype"] == "torch.bfloat16" and r["state_dtype"] == "torch.float32", r
    assert r["o"] < 2e-2 and r["state"] < 1e-5, r


def test_fla_canon_causal_conv1d_vs_reference(interp_results):
    r = _ok(interp_results, "canon_causal_conv1d")
    for tag, diffs in r.items():
        for key, val in diffs.items():
            assert val < 1e-5, (tag, key, r)
