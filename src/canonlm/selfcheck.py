"""``python -m canonlm.selfcheck``: what works on this machine, checked in minutes, written to a markdown report.

On a CUDA machine it runs

* every available fast kernel against its pure-PyTorch reference (computed in float64 from the same rounded inputs):
  Canon (``dao``, ``fla``), attention (``sdpa``, ``flash``), GLA and GDN (``fla``), SSD (``mamba_ssm``, including
  the fused conv + scan + norm + out-proj ``split`` kernel) -- in fp32 and bf16, forward and backward (the gradient
  of a random projection of the outputs), and the decode paths (one-token steps after a prefill);
* per architecture, a small model on its fast paths against the same weights on the references (bf16 autocast,
  logits and gradients) and cached decoding against one full forward;
* 30 training steps (``train.py`` in a subprocess) of every architecture at 12L768D with and without Canon
  (llama: ``none`` / ``ABCD``; gla, gdn, mamba2: ``b`` / ``AbCD``), reporting tokens/s, peak memory and MFU;
* an FSDP2 run across all visible GPUs (SKIP with one GPU).

Without CUDA it says so, lists every GPU check as SKIP, and runs what the CPU can check: the native Canon kernel
and SDPA against the references, the chunked GLA / GDN / SSD references against step-by-step recurrences (float64),
cached decoding against a full forward for every architecture, and a 5-step tiny training per architecture.

Every line is PASS, FAIL or SKIP with its detail and seconds; a kernel line passes only if the fast backend was
really the one that ran (``auto`` must choose it whenever its library imports) and every output and gradient is
within the tolerance the line states. Errors are ``max |fast - ref| / max |ref|`` per tensor (relative to the
tensor's largest entry).

Usage::

    python -m canonlm.selfcheck [--out FILE] [--force] [--quick] [--steps N] [--size 12L768D] [--batch N]

Exit codes: 0 no FAIL, 1 at least one FAIL, 2 refused (``--out`` exists without ``--force``, bad arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NO_CUDA = "no CUDA"
NO_CUDA_MESSAGE = "no CUDA device: GPU kernels and GPU training cannot be checked here"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (train.py, conf/) for an editable install

#: Distributions whose versions the report lists (first installed name wins for each row).
LIBRARIES = (("lightning", ("lightning",)), ("triton", ("triton", "pytorch-triton")),
             ("fla-core", ("fla-core", "flash-linear-attention")), ("flash-attn", ("flash-attn",)),
             ("causal-conv1d", ("causal-conv1d",)), ("mamba-ssm", ("mamba-ssm",)))

#: Tolerances on ``max |fast - ref| / max |ref|`` against a float64 reference of the same rounded inputs.
TOL = {"fp32": 2e-3, "bf16": 6e-2}

#: Model presets of the small model-level checks (the ``conf/arch`` values that differ from the defaults).
PRESETS = {
    "llama": dict(arch="llama"),
    "gla": dict(arch="gla"),
    "gdn": dict(arch="gdn", expand_k=0.75, expand_v=1.5, ffn_ratio=2.0),
    "mamba2": dict(arch="mamba2", ffn_ratio=2.0, init="mamba2_default", norm_eps=1e-5),
}
CANON_SETS = {"llama": ("none", "ABCD"), "gla": ("b", "AbCD"), "gdn": ("b", "AbCD"), "mamba2": ("b", "AbCD")}
MIXER_OP = {"llama": "attention", "gla": "gla", "gdn": "gdn", "mamba2": "ssd"}

_FLA = ("fla-core", "flash-linear-attention")
#: Fast backend -> (required distributions, each a tuple of alternative names; modules its import needs).
FAST_LIBS = {
    ("canon", "dao"): ((("causal-conv1d",),), ("causal_conv1d",)),
    ("canon", "fla"): ((_FLA,), ("fla.modules",)),
    ("attention", "flash"): ((("flash-attn",),), ("flash_attn",)),
    ("gla", "fla"): ((_FLA,), ("fla.ops.gla",)),
    ("gdn", "fla"): ((_FLA,), ("fla.ops.gated_delta_rule",)),
    ("ssd", "mamba_ssm"): ((("mamba-ssm",),), ("mamba_ssm.ops.triton.ssd_combined",)),
    ("ssd", "split"): ((("mamba-ssm",), ("causal-conv1d",)), ("mamba_ssm.ops.triton.ssd_combined", "causal_conv1d")),
}


# ----------------------------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    """One report line: ``status`` is PASS / FAIL / SKIP; ``seconds`` the wall time of the check."""

    name: str
    status: str
    detail: str
    seconds: float


class Skip(Exception):
    """Raised inside a check: the line is SKIP with this message as its reason."""


class Fail(Exception):
    """Raised inside a check: the line is FAIL with this message."""


def run_check(name: str, fn: Callable[[], tuple[str, str]]) -> Result:
    """Run one check ``fn() -> (status, detail)``; :class:`Skip` / :class:`Fail` / any other exception become SKIP /
    FAIL lines (the exception type and message, shortened). Never raises (KeyboardInterrupt aside)."""
    t0 = time.perf_counter()
    try:
        status, detail = fn()
    except Skip as e:
        status, detail = SKIP, str(e)
    except Fail as e:
        status, detail = FAIL, str(e)
    except Exception as e:  # noqa: BLE001 -- a crashing check is a FAIL line, the others still run
        status, detail = FAIL, f"{type(e).__name__}: {_short(str(e), 300)}"
    if status not in (PASS, FAIL, SKIP):
        status, detail = FAIL, f"check returned status {status!r} ({detail})"
    return Result(name, status, detail, time.perf_counter() - t0)


def _short(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def judge_errors(errors: dict[str, float], tol: float) -> tuple[str, str]:
    """``(PASS | FAIL, detail)`` for ``errors`` = ``{tensor name: max |fast - ref| / max |ref|}``: FAIL when nothing
    was compared or an error is above ``tol`` or not finite. The detail names the worst tensor and the tolerance."""
    if not errors:
        return FAIL, "nothing was compared"
    bad = {k: v for k, v in errors.items() if not (v <= tol)}  # NaN is bad
    worst = max(errors, key=lambda k: (not math.isfinite(errors[k]), errors[k]))
    if bad:
        return FAIL, (f"max rel err {errors[worst]:.2e} ({worst}) > tol {tol:.0e}; over tol: "
                      + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()))
    return PASS, f"max rel err {errors[worst]:.2e} ({worst}) <= tol {tol:.0e} ({len(errors)} tensors)"


def judge_kernel(fast: str, resolved: Optional[str], errors: dict[str, float], tol: float) -> tuple[str, str]:
    """Verdict of a fast-path-vs-reference comparison.

    Args:
        fast: the backend under test (e.g. ``"fla"``).
        resolved: the backend the op / model actually selected (None: unknown).
        errors: ``{tensor name: max |fast - ref| / max |ref|}`` of every output and gradient compared.
        tol: the largest error that passes.
    Returns:
        ``(PASS | FAIL, detail)``: FAIL when the selected backend is not ``fast`` (a fallback to the reference is
        never a pass, whatever the errors), when nothing was compared, or when an error is above ``tol`` or not
        finite (:func:`judge_errors`).
    """
    if resolved != fast:
        return FAIL, f"backend {resolved!r} was selected, not {fast!r} (fallback: the fast path did not run)"
    status, detail = judge_errors(errors, tol)
    return status, f"{fast}: {detail}"


# ----------------------------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------------------------

def dist_version(names) -> Optional[str]:
    """Version of the first installed distribution among ``names`` (``"fla-core"``...), or None."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> list[tuple[str, str]]:
    """``[(component, version or "not installed")]``: Python, torch, CUDA, GPUs, canonlm and the optional kernels."""
    import torch

    rows = [("python", platform.python_version()), ("platform", platform.platform()), ("torch", torch.__version__),
            ("CUDA (torch build)", str(torch.version.cuda) if torch.version.cuda else "none (CPU build)")]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"))
        cudnn = torch.backends.cudnn.version()
        rows.append(("cuDNN", str(cudnn) if cudnn else "none"))
    else:
        rows.append(("GPU", "none visible (torch.cuda.is_available() is False)"))
    rows.append(("canonlm", f"{dist_version(['canonlm']) or 'not installed'} (git {_git_rev()})"))
    for label, names in LIBRARIES:
        rows.append((label, dist_version(names) or "not installed"))
    return rows


def _git_rev() -> str:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return "unknown"
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        rev = p.stdout.strip() or "unknown"
        d = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
        return rev + ("+modified" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fast_unavailable(op: str, fast: str, device, dtype) -> Optional[tuple[str, str]]:
    """None when backend ``fast`` of ``op`` can run on (device, dtype); else ``(SKIP | FAIL, reason)``: SKIP when its
    library is not installed or refuses this dtype, FAIL when it is installed but its import fails (a broken
    build, e.g. compiled against another torch)."""
    dists, modules = FAST_LIBS[(op, fast)]
    missing = [alts[0] for alts in dists if dist_version(alts) is None]
    if missing:
        return SKIP, f"{', '.join(missing)} not installed"
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 -- ImportError, OSError (undefined symbol), Triton driver errors
            return FAIL, f"installed but `import {module}` fails: {type(e).__name__}: {_short(str(e), 200)}"
    from canonlm.arch.config import ConfigError

    try:
        _resolve(op, "mamba_ssm" if fast == "split" else fast, device, dtype)
    except ConfigError as e:
        return SKIP, f"{fast} refuses {device}/{_dt_name(dtype)}: {_short(e.allowed, 200)}"
    return None


def _resolve(op: str, name: str, device, dtype) -> str:
    """``canonlm.ops.<op>.resolve_backend(name, device, dtype)``."""
    mod = importlib.import_module(f"canonlm.ops.{op}")
    return mod.resolve_backend(name, device, dtype)


def _dt_name(dtype) -> str:
    import torch

    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64", torch.float16: "fp16"}.get(
        dtype, str(dtype))


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[name]


# ----------------------------------------------------------------------------------------------------------------
# numerics helpers
# ----------------------------------------------------------------------------------------------------------------

def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` in float64 (inf when shapes differ or ``a`` is missing; NaN propagates)."""
    if a is None or b is None:
        return math.inf if (a is None) != (b is None) else 0.0
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if a.shape != b.shape:
        return math.inf
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-30)


def _fwd_bwd(fn, inputs: list, cot_seed: int = 1234):
    """``fn(*leaves) -> tuple of outputs (None allowed)`` on fresh leaves; backprop ``sum_i <out_i, r_i>`` for fixed
    random ``r_i`` (float64, seeded; the same for both paths of a comparison). Returns (outputs, input grads)."""
    import torch

    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(cot_seed)
    loss = 0.0
    for o in outs:
        if o is None:
            continue
        r = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)
        loss = loss + (o.double() * r).sum()
    req = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(loss, req, allow_unused=True))
    gr = [None if (t is None or not t.requires_grad) else next(grads) for t in leaves]
    return [None if o is None else o.detach() for o in outs], gr


def _compare(names_out, names_in, fast, ref, errors: dict, prefix: str = "") -> None:
    """Fill ``errors`` from ``fast`` / ``ref`` = (outputs, grads) of :func:`_fwd_bwd` (None pairs are skipped)."""
    for n, a, b in zip(names_out, fast[0], ref[0]):
        if b is not None or a is not None:
            errors[prefix + n] = rel_err(a, b)
    for n, a, b in zip(names_in, fast[1], ref[1]):
        if b is not None or a is not None:
            errors[prefix + "d" + n] = rel_err(a, b)


def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# GPU kernel checks (fast path vs reference)
# ----------------------------------------------------------------------------------------------------------------

#: Device of the GPU checks. Only the test suite changes it (to "cpu", with the fast paths stubbed by references,
#: to exercise this harness on a machine without a GPU).
_DEV = "cuda"


def _need_cuda():
    import torch

    if _DEV == "cuda" and not torch.cuda.is_available():
        raise Skip(NO_CUDA)


def _kernel_prelude(op: str, fast: str, dtype) -> str:
    """Skip/fail early when the fast path cannot run; return the backend ``auto`` picks (or the explicit one when
    ``fast`` is not ``auto``'s first choice: canon ``fla`` beside ``dao``, attention ``flash``)."""
    _need_cuda()
    bad = _fast_unavailable(op, fast, _DEV, dtype)
    if bad is not None:
        if bad[0] == FAIL:
            raise Fail(bad[1])
        raise Skip(bad[1])
    auto = _resolve(op, "auto", _DEV, dtype)
    secondary = (op == "canon" and fast == "fla" and auto == "dao") or (op == "attention" and fast == "flash")
    return _resolve(op, fast, _DEV, dtype) if secondary else auto


def _canon_case(dtype, dev, seed=0, B=2, T=200, C=64, K=4):
    import torch

    g = _gen(seed)
    x = torch.randn(B, T, C, generator=g)
    w = torch.rand(C, K, generator=g) - 0.5
    b = torch.randn(C, generator=g) * 0.1
    h0 = torch.randn(B, C, K - 1, generator=g)
    return [t.to(dtype).to(dev) for t in (x, w, b, h0)]


def check_canon_kernel(fast: str, dt: str, mode: str) -> tuple[str, str]:
    """Canon ``dao`` / ``fla`` vs ``causal_conv1d_reference``: the Canon layer (residual) and the short conv (SiLU,
    no residual), with bias and an initial state; ``mode`` ``fwd+bwd`` or ``decode`` (``causal_conv1d_step`` for
    40 tokens from a zero state vs the full reference, and the final state)."""
    import torch

    from canonlm.ops.canon import causal_conv1d, causal_conv1d_reference, causal_conv1d_state, causal_conv1d_step

    dtype = _dtype(dt)
    resolved = _kernel_prelude("canon", fast, dtype)
    errors: dict[str, float] = {}
    for residual, act in ((True, False), (False, True)):
        tag = "canon." if residual else "shortconv."
        x, w, b, h0 = _canon_case(dtype, _DEV)
        if mode == "fwd+bwd":
            got = _fwd_bwd(lambda x, w, b, h: (causal_conv1d(x, w, b, residual=residual, activation=act,
                                                               backend=fast, initial_state=h),), [x, w, b, h0])
            ref = _fwd_bwd(lambda x, w, b, h: (causal_conv1d_reference(x, w, b, residual=residual, activation=act,
                                                                         initial_state=h),),
                           [t.double() for t in (x, w, b, h0)])
            _compare(["y"], ["x", "w", "b", "init"], got, ref, errors, tag)
        else:
            x = x[:, :40]
            state = torch.zeros(x.shape[0], x.shape[2], w.shape[1], device=_DEV, dtype=dtype)
            ys = []
            with torch.no_grad():
                for t in range(x.shape[1]):
                    y, state = causal_conv1d_step(x[:, t], state, w, b, residual=residual, activation=act,
                                                  backend=fast)
                    ys.append(y)
                ref = causal_conv1d_reference(x.double(), w.double(), b.double(), residual=residual, activation=act)
            errors[tag + "y_steps"] = rel_err(torch.stack(ys, 1), ref)
            errors[tag + "state"] = rel_err(state, causal_conv1d_state(x, w.shape[1]))
    return judge_kernel(fast, resolved, errors, TOL[dt])


def check_attention_kernel(fast: str, dt: str, mode: str) -> tuple[str, str]:
    """Attention ``sdpa`` / ``flash`` vs ``attention_reference`` (GQA 8 query / 2 kv heads, head dim 64, causal):
    ``fwd+bwd`` at T = 256, or ``decode`` (1 and 5 new queries against a 256-key cache, bottom-right causal)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    dtype = _dtype(dt)
    if fast == "flash" and dtype not in (torch.float16, torch.bfloat16):
        raise Skip("flash-attn has no fp32 kernel")
    if fast == "flash":
        resolved = _kernel_prelude("attention", "flash", dtype)
    else:
        _need_cuda()
        resolved = _resolve("attention", "auto", _DEV, dtype)
    g = _gen(3)
    B, S, H, Hkv, D = 2, 256, 8, 2, 64
    q = torch.randn(B, S, H, D, generator=g).to(dtype).to(_DEV)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(_DEV)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(_DEV)
    errors: dict[str, float] = {}
    if mode == "fwd+bwd":
        got = _fwd_bwd(lambda q, k, v: (attention(q, k, v, backend=fast),), [q, k, v])
        ref = _fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
        _compare(["o"], ["q", "k", "v"], got, ref, errors)
    else:
        with torch.no_grad():
            for T in (1, 5):
                o = attention(q[:, -T:].contiguous(), k, v, backend=fast)
                errors[f"o_T{T}"] = rel_err(o, attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel(fast, resolved, errors, TOL[dt])


def _gla_case(dtype, seed=0, B=2, T=300, H=4, K=64, V=64):
    import torch
    import torch.nn.functional as F

    g = _gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g)) / 16
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(_DEV), k.to(dtype).to(_DEV), v.to(dtype).to(_DEV), gate.to(_DEV), h0.to(_DEV)]


def _gdn_case(dtype, seed=0, B=2, T=300, H=4, K=64, V=64):
    import torch
    import torch.nn.functional as F

    g = _gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(_DEV), k.to(dtype).to(_DEV), v.to(dtype).to(_DEV), gate.to(_DEV), beta.to(_DEV),
            h0.to(_DEV)]


def _ssd_case(dtype, seed=0, B=2, T=300, H=4, P=64, G=1, N=64):
    import torch

    g = _gen(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = torch.randn(B, T, H, generator=g)
    A = -torch.exp(torch.rand(H, generator=g) * 2.0)
    Bm, Cm = torch.randn(B, T, G, N, generator=g), torch.randn(B, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    h0 = torch.randn(B, H, P, N, generator=g)
    return [x.to(dtype).to(_DEV), dt.to(_DEV), A.to(_DEV), Bm.to(dtype).to(_DEV), Cm.to(dtype).to(_DEV),
            D.to(_DEV), dt_bias.to(_DEV), h0.to(_DEV)]


_DECODE_SEGMENTS = [(0, 20)] + [(t, t + 1) for t in range(20, 30)] + [(30, 130)]


def check_gla_kernel(dt: str, mode: str) -> tuple[str, str]:
    """GLA ``fla`` vs ``chunk_gla_reference`` (B=2, T=300, H=4, K=V=64, initial and final state): ``fwd+bwd``
    (``chunk_gla``), or ``decode`` under no_grad (a 20-token prefill and ten 1-token steps on
    ``fused_recurrent_gla``, then a 100-token chunk, the state carried) vs one reference call."""
    import torch

    from canonlm.ops.gla import chunk_gla, chunk_gla_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("gla", "fla", dtype)
    q, k, v, g, h0 = _gla_case(dtype)
    errors: dict[str, float] = {}
    ref_fn = lambda q, k, v, g, h: chunk_gla_reference(q, k, v, g, initial_state=h, output_final_state=True)  # noqa
    if mode == "fwd+bwd":
        got = _fwd_bwd(lambda q, k, v, g, h: chunk_gla(q, k, v, g, initial_state=h, output_final_state=True,
                                                        backend="fla"), [q, k, v, g, h0])
        ref = _fwd_bwd(ref_fn, [t.double() for t in (q, k, v, g, h0)])
        _compare(["o", "S"], ["q", "k", "v", "g", "h0"], got, ref, errors)
    else:
        with torch.no_grad():
            eo, eS = ref_fn(*[t[:, :130].double() for t in (q, k, v, g)], h0.double())
            state, outs = h0, []
            for a, b in _DECODE_SEGMENTS:
                o, state = chunk_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=state,
                                     output_final_state=True, backend="fla")
                outs.append(o)
        errors["o"], errors["S"] = rel_err(torch.cat(outs, 1), eo), rel_err(state, eS)
    return judge_kernel("fla", resolved, errors, TOL[dt])


def check_gdn_kernel(dt: str, mode: str) -> tuple[str, str]:
    """GDN ``fla`` vs ``chunk_gated_delta_rule_reference`` (q/k L2-normalised in the kernel, B=2, T=300, H=4,
    K=V=64, g and beta fp32 as the mixer passes them): ``fwd+bwd``, or ``decode`` (no_grad: a 20-token prefill and
    ten 1-token steps on ``fused_recurrent_gated_delta_rule``, then a 100-token chunk) vs one reference call."""
    import torch

    from canonlm.ops.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("gdn", "fla", dtype)
    q, k, v, g, beta, h0 = _gdn_case(dtype)
    errors: dict[str, float] = {}

    def ref_fn(q, k, v, g, beta, h):
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state=h, output_final_state=True)

    if mode == "fwd+bwd":
        got = _fwd_bwd(lambda q, k, v, g, b, h: chunk_gated_delta_rule(q, k, v, g, b, initial_state=h,
                                                                      output_final_state=True, backend="fla"),
                       [q, k, v, g, beta, h0])
        ref = _fwd_bwd(ref_fn, [t.double() for t in (q, k, v, g, beta, h0)])
        _compare(["o", "S"], ["q", "k", "v", "g", "beta", "h0"], got, ref, errors)
    else:
        with torch.no_grad():
            eo, eS = ref_fn(*[t[:, :130].double() for t in (q, k, v, g, beta)], h0.double())
            state, outs = h0, []
            for a, b in _DECODE_SEGMENTS:
                o, state = chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                  initial_state=state, output_final_state=True, backend="fla")
                outs.append(o)
        errors["o"], errors["S"] = rel_err(torch.cat(outs, 1), eo), rel_err(state, eS)
    return judge_kernel("fla", resolved, errors, TOL[dt])


def check_ssd_kernel(dt: str, mode: str) -> tuple[str, str]:
    """SSD ``mamba_ssm`` vs ``ssd_scan_reference`` (B=2, T=300, H=4, P=64, G=1, N=64, chunk 64, D, dt_bias,
    initial state): ``fwd+bwd`` (``mamba_chunk_scan_combined``), or ``decode`` (no_grad: a 20-token prefill, then
    ten 1-token steps on ``selective_state_update``) vs one reference call."""
    import torch

    from canonlm.ops.ssd import ssd_scan, ssd_scan_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("ssd", "mamba_ssm", dtype)
    x, dtv, A, Bm, Cm, D, db, h0 = _ssd_case(dtype)
    errors: dict[str, float] = {}
    kw = dict(chunk_size=64, output_final_state=True)
    if mode == "fwd+bwd":
        got = _fwd_bwd(lambda x, d, A, B, C, D, db, h: ssd_scan(x, d, A, B, C, D=D, dt_bias=db, initial_state=h,
                                                                backend="mamba_ssm", **kw),
                       [x, dtv, A, Bm, Cm, D, db, h0])
        ref = _fwd_bwd(lambda x, d, A, B, C, D, db, h: ssd_scan_reference(x, d, A, B, C, D=D, dt_bias=db,
                                                                          initial_state=h, **kw),
                       [t.double() for t in (x, dtv, A, Bm, Cm, D, db, h0)])
        _compare(["y", "S"], ["x", "dt", "A", "B", "C", "D", "dt_bias", "h0"], got, ref, errors)
    else:
        T = 30
        with torch.no_grad():
            ey, eS = ssd_scan_reference(*[t[:, :T].double() for t in (x, dtv)], A.double(),
                                        *[t[:, :T].double() for t in (Bm, Cm)], D=D.double(), dt_bias=db.double(),
                                        initial_state=h0.double(), **kw)
            state, ys = h0, []
            for a, b in [(0, 20)] + [(t, t + 1) for t in range(20, T)]:
                y, state = ssd_scan(x[:, a:b], dtv[:, a:b], A, Bm[:, a:b], Cm[:, a:b], D=D, dt_bias=db,
                                    initial_state=state, backend="mamba_ssm", **kw)
                ys.append(y)
        errors["y"], errors["S"] = rel_err(torch.cat(ys, 1), ey), rel_err(state, eS)
    return judge_kernel("mamba_ssm", resolved, errors, TOL[dt])


def check_ssd_split_kernel(dt: str) -> tuple[str, str]:
    """Mamba2's fused ``mamba_split_conv1d_scan_combined`` (conv + SSD + gated RMSNorm + out-proj) vs
    ``split_conv1d_scan_reference``, forward and backward (B=2, T=130, H=8, P=8, G=1, N=32, width 4, SiLU; every
    width a multiple of 8, as causal-conv1d's channel-last kernel needs). SKIP with the reason when
    ``canonlm.ops.ssd.fused_split_reason`` says the installed mamba-ssm / causal-conv1d pair cannot run it (the
    mixer then runs the conv and the scan separately, which the other SSD lines check)."""
    import torch

    from canonlm.ops import ssd

    dtype = _dtype(dt)
    _kernel_prelude("ssd", "split", dtype)
    Bsz, T, H, P, G, N, W, out = 2, 130, 8, 8, 1, 32, 4, 48
    shape = dict(d_inner=H * P, conv_dim=H * P + 2 * G * N, nheads=H)
    why_fn = getattr(ssd, "fused_split_reason", None)
    why = why_fn(_DEV, dtype, W, **shape) if callable(why_fn) and _DEV == "cuda" else None
    if why is not None:
        raise Skip(f"fused split cannot run with this mamba-ssm / causal-conv1d: {_short(why, 200)}")
    try:
        fused = ssd.use_fused_split("auto", _DEV, dtype, W, shape["d_inner"], shape["conv_dim"], shape["nheads"])
    except TypeError:  # an older signature without the shape arguments
        fused = ssd.use_fused_split("auto", _DEV, dtype, W)
    resolved = "split" if fused else "separate conv + scan"
    g = _gen(42)
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    zx = torch.randn(Bsz, T, 2 * d_inner + 2 * G * N + H, generator=g)
    conv_w, conv_b = torch.rand(conv_dim, W, generator=g) - 0.5, torch.randn(conv_dim, generator=g) * 0.1
    dt_bias, A = torch.randn(H, generator=g) * 0.5, -torch.exp(torch.rand(H, generator=g) * 2.0)
    D, norm_w = torch.randn(H, generator=g), 1.0 + 0.1 * torch.randn(d_inner, generator=g)
    out_w = torch.randn(out, d_inner, generator=g) / math.sqrt(d_inner)
    leaves = [zx.to(dtype), conv_w, conv_b, dt_bias, A, D, norm_w, out_w.to(dtype)]
    kw = dict(chunk_size=64, activation="silu", rmsnorm_eps=1e-5, headdim=P, ngroups=G)

    def run(fn):
        return lambda zx, cw, cb, db, A, D, nw, ow: (fn(zx, cw, cb, db, A, D, rmsnorm_weight=nw, outproj_weight=ow,
                                                        **kw),)
    got = _fwd_bwd(run(ssd.split_conv1d_scan_combined), [t.to(_DEV) for t in leaves])
    ref = _fwd_bwd(run(ssd.split_conv1d_scan_reference), [t.double().to(_DEV) for t in leaves])
    errors: dict[str, float] = {}
    _compare(["out"], ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D", "norm_w", "out_w"], got, ref, errors)
    return judge_kernel("split", resolved, errors, TOL[dt])


# ----------------------------------------------------------------------------------------------------------------
# model-level checks
# ----------------------------------------------------------------------------------------------------------------

def _build(arch: str, canon: str, size: str, ops: str = "auto", vocab: int = 64, max_len: int = 512):
    import warnings

    from canonlm.arch import CanonLM, build_model_config

    kw = dict(PRESETS[arch], size=size)
    if ops != "auto":
        kw["ops"] = ops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CanonLM(build_model_config(kw, canon={"set": "" if canon == "none" else canon}, vocab_size=vocab,
                                          max_seq_len=max_len))


def _place(model, device, dtype) -> dict:
    """Resolve the model's backends where it runs: ``CanonLM.place`` (or the older ``check_backends``), else
    :func:`canonlm.arch.resolve_backends` for the report only. Returns the concrete ``{op: backend}``."""
    for name in ("place", "check_backends"):
        fn = getattr(model, name, None)
        if callable(fn):
            return dict(fn(device, dtype))
    from canonlm.arch import resolve_backends

    return dict(resolve_backends(model.cfg, device, dtype))


def _expected_fast(arch: str, dtype) -> dict:
    """``{op: fast backend}`` a CUDA model of ``arch`` must select; raises Skip / Fail when a library is missing or
    broken (the mixer op), and leaves Canon out when neither Canon library is installed (plain torch is then right)."""
    op = MIXER_OP[arch]
    want = {}
    if op == "attention":
        want[op] = "sdpa"
    else:
        fast = "mamba_ssm" if op == "ssd" else "fla"
        bad = _fast_unavailable(op, fast, _DEV, dtype)
        if bad is not None:
            if bad[0] == FAIL:
                raise Fail(bad[1])
            raise Skip(f"{op}: {bad[1]}")
        want[op] = fast
    for c in ("dao", "fla"):
        bad = _fast_unavailable("canon", c, _DEV, dtype)
        if bad is None:
            want["canon"] = c
            break
        if bad[0] == FAIL:
            raise Fail(f"canon {c}: {bad[1]}")
    return want


def _judge_backends(want: dict, got: dict) -> Optional[str]:
    wrong = {op: got.get(op) for op, be in want.items() if got.get(op) != be}
    if wrong:
        return "selected " + ", ".join(f"{op}={b!r} (want {want[op]!r})" for op, b in wrong.items())
    return None


def _fmt_backends(b: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(b.items()))


def check_model_fast_vs_reference(arch: str) -> tuple[str, str]:
    """A 2L256D model of ``arch`` (Canon-ABCD / AbCD) on its fast paths vs the same weights with ``ops=reference``,
    under bf16 autocast on CUDA: logits (max rel err) and all parameter gradients (relative L2 norm) of a
    logsumexp loss, T = 300."""
    import torch

    _need_cuda()
    want = _expected_fast(arch, torch.bfloat16)
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    fast = _build(arch, canon, "2L256D").to(_DEV)
    ref = _build(arch, canon, "2L256D", ops="reference").to(_DEV)
    ref.load_state_dict(fast.state_dict())
    got = _place(fast, torch.device(_DEV), torch.bfloat16)
    _place(ref, torch.device(_DEV), torch.bfloat16)
    bad = _judge_backends(want, got)
    if bad:
        return FAIL, f"{bad}: the fast path did not run ({_fmt_backends(got)})"
    ids = torch.randint(0, 64, (2, 300), generator=_gen(1)).to(_DEV)
    outs, grads = [], []
    for m in (fast, ref):
        with torch.autocast(torch.device(_DEV).type, dtype=torch.bfloat16):
            logits = m(ids)
        logits.float().logsumexp(-1).mean().backward()
        outs.append(logits.float())
        grads.append(torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None]))
    gerr = ((grads[0] - grads[1]).norm() / grads[1].norm().clamp_min(1e-30)).item()
    status, detail = judge_errors({"logits": rel_err(outs[0], outs[1]), "grads(L2)": gerr}, TOL["bf16"])
    return status, f"{_fmt_backends(got)}; {detail}"


def check_model_decode(arch: str, device: str, size: str = "2L256D") -> tuple[str, str]:
    """Cached decoding (17-token prefill, then 23 one-token steps) against one full forward, fp32, no autocast,
    for ``arch`` with Canon-ABCD / AbCD on ``device`` (on CUDA the fast paths must be selected)."""
    import torch

    want = {}
    if device == "cuda":
        _need_cuda()
        want = _expected_fast(arch, torch.float32)
        device = _DEV
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    m = _build(arch, canon, size).to(device)
    got = _place(m, torch.device(device), torch.float32)
    bad = _judge_backends(want, got)
    if bad:
        return FAIL, f"{bad}: the fast path did not run ({_fmt_backends(got)})"
    m.eval()
    ids = torch.randint(0, 64, (3, 40), generator=_gen(2)).to(device)
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache()
        parts = [m(ids[:, :17], cache)] + [m(ids[:, t:t + 1], cache) for t in range(17, 40)]
    tol = 1e-3 if want else 1e-4
    status, detail = judge_errors({"logits": rel_err(torch.cat(parts, 1), full)}, tol)
    return status, f"{_fmt_backends(got)}; {detail}"


# ----------------------------------------------------------------------------------------------------------------
# CPU checks: what runs here, against independent loops
# ----------------------------------------------------------------------------------------------------------------

def _gla_loop(q, k, v, g, h0):
    """GLA step by step: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (q_t / sqrt(K))``."""
    import torch

    B, T, H, K = q.shape
    S, outs = h0, []
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append((S * (q[:, t] * K ** -0.5).unsqueeze(-1)).sum(-2))
    return torch.stack(outs, 1), S


def _gdn_loop(q, k, v, g, beta, h0):
    """Gated delta rule step by step, q/k L2-normalised (``x / sqrt(|x|^2 + 1e-6)``), state (B, H, K, V)."""
    import torch

    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    K = q.shape[-1]
    S, outs = h0, []
    for t in range(q.shape[1]):
        a = g[:, t].exp()
        kt, vt = k[:, t], v[:, t]
        w = beta[:, t, :, None] * (vt - a[..., None] * torch.einsum("bhk,bhkv->bhv", kt, S))
        S = a[..., None, None] * S + kt[..., :, None] * w[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return torch.stack(outs, 1), S


def _ssd_loop(x, dt, A, B, C, D, dt_bias, h0):
    """SSD step by step: ``H_t = exp(Δ_t A) H_{t-1} + Δ_t x_t B_t^T``, ``y_t = H_t C_t + D x_t``,
    ``Δ = softplus(dt + dt_bias)``; group g = h // (H / G)."""
    import torch

    H = x.shape[2]
    rep = H // B.shape[2]
    delta = torch.nn.functional.softplus(dt + dt_bias)
    h, ys = h0, []
    for t in range(x.shape[1]):
        Bt, Ct = B[:, t].repeat_interleave(rep, 1), C[:, t].repeat_interleave(rep, 1)
        d = delta[:, t]
        h = torch.exp(d * A)[:, :, None, None] * h + (d[:, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append((h * Ct[:, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1), h


def check_cpu_canon_native(dt: str) -> tuple[str, str]:
    """The native CPU Canon kernel (``auto`` on CPU must pick ``cpu``) vs ``causal_conv1d_reference`` in float64,
    forward and backward, Canon layer and short conv (B=2, T=64, C=48, K=4, bias, initial state)."""
    from canonlm.ops.canon import available_backends, causal_conv1d, causal_conv1d_reference

    dtype = _dtype(dt)
    why = available_backends("cpu", dtype)["cpu"]
    if why is not None:
        raise Skip(f"native kernel unavailable: {why}")
    resolved = _resolve("canon", "auto", "cpu", dtype)
    errors: dict[str, float] = {}
    for residual, act in ((True, False), (False, True)):
        x, w, b, h0 = _canon_case(dtype, "cpu", B=2, T=64, C=48, K=4)
        got = _fwd_bwd(lambda x, w, b, h: (causal_conv1d(x, w, b, residual=residual, activation=act, backend="cpu",
                                                         initial_state=h),), [x, w, b, h0])
        ref = _fwd_bwd(lambda x, w, b, h: (causal_conv1d_reference(x, w, b, residual=residual, activation=act,
                                                                     initial_state=h),),
                       [t.double() for t in (x, w, b, h0)])
        _compare(["y"], ["x", "w", "b", "init"], got, ref, errors, "canon." if residual else "shortconv.")
    return judge_kernel("cpu", resolved, errors, 1e-5 if dt == "fp32" else 2e-2)


def check_cpu_canon_reference_loop() -> tuple[str, str]:
    """``causal_conv1d_reference`` and the one-token ``causal_conv1d_step`` vs a plain loop over taps (float64)."""
    import torch

    from canonlm.ops.canon import causal_conv1d_reference, causal_conv1d_step

    x, w, b, h0 = _canon_case(torch.float64, "cpu", B=2, T=30, C=16, K=4)
    errors: dict[str, float] = {}
    got = _fwd_bwd(lambda x, w, b, h: (causal_conv1d_reference(x, w, b, activation=True, initial_state=h),),
                   [x, w, b, h0])
    from canonlm.ops.canon.naive import canon_loop

    ref = _fwd_bwd(lambda x, w, b, h: (canon_loop(x, w, b, True, True, h),), [x, w, b, h0])
    _compare(["y"], ["x", "w", "b", "init"], got, ref, errors)
    state = torch.cat([torch.zeros(2, 16, 1, dtype=torch.float64), h0], -1)
    ys = []
    for t in range(x.shape[1]):
        y, state = causal_conv1d_step(x[:, t], state, w, b, activation=True, backend="torch")
        ys.append(y)
    errors["y_steps"] = rel_err(torch.stack(ys, 1), ref[0][0])
    return judge_kernel("reference", "reference", errors, 1e-12)


def check_cpu_attention() -> tuple[str, str]:
    """SDPA (``auto`` on CPU) vs ``attention_reference`` (float64), fp32, GQA 4 / 2 heads, T = 64, forward and
    backward, plus decode (1 and 5 queries against the 64-key cache)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    resolved = _resolve("attention", "auto", "cpu", torch.float32)
    g = _gen(5)
    q = torch.randn(2, 64, 4, 32, generator=g)
    k, v = torch.randn(2, 64, 2, 32, generator=g), torch.randn(2, 64, 2, 32, generator=g)
    errors: dict[str, float] = {}
    got = _fwd_bwd(lambda q, k, v: (attention(q, k, v, backend="sdpa"),), [q, k, v])
    ref = _fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
    _compare(["o"], ["q", "k", "v"], got, ref, errors)
    with torch.no_grad():
        for T in (1, 5):
            errors[f"o_decode_T{T}"] = rel_err(attention(q[:, -T:], k, v, backend="sdpa"),
                                               attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel("sdpa", resolved, errors, 1e-4)


def check_cpu_linear_reference(op: str) -> tuple[str, str]:
    """The chunked reference of ``op`` (gla / gdn / ssd; chunk 16, T = 37, initial state) vs its step-by-step
    recurrence in float64: outputs, final state and every input gradient."""
    import torch
    import torch.nn.functional as F

    g = _gen({"gla": 11, "gdn": 12, "ssd": 13}[op])
    B, T, H = 2, 37, 2
    d = torch.float64
    errors: dict[str, float] = {}
    if op == "gla":
        from canonlm.ops.gla import chunk_gla_reference

        K, V = 8, 6
        ins = [torch.randn(B, T, H, K, generator=g, dtype=d), torch.randn(B, T, H, K, generator=g, dtype=d),
               torch.randn(B, T, H, V, generator=g, dtype=d),
               F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=d)) / 4,
               torch.randn(B, H, K, V, generator=g, dtype=d)]
        got = _fwd_bwd(lambda q, k, v, gg, h: chunk_gla_reference(q, k, v, gg, initial_state=h,
                                                                   output_final_state=True, chunk_size=16), ins)
        ref = _fwd_bwd(_gla_loop, ins)
        names = ["q", "k", "v", "g", "h0"]
    elif op == "gdn":
        from canonlm.ops.gdn import chunk_gated_delta_rule_reference

        K, V = 8, 6
        ins = [torch.randn(B, T, H, K, generator=g, dtype=d), torch.randn(B, T, H, K, generator=g, dtype=d),
               torch.randn(B, T, H, V, generator=g, dtype=d),
               F.logsigmoid(torch.randn(B, T, H, generator=g, dtype=d) + 2.0),
               torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=d)),
               torch.randn(B, H, K, V, generator=g, dtype=d)]
        got = _fwd_bwd(lambda q, k, v, gg, b, h: chunk_gated_delta_rule_reference(
            q, k, v, gg, b, initial_state=h, output_final_state=True, chunk_size=16), ins)
        ref = _fwd_bwd(_gdn_loop, ins)
        names = ["q", "k", "v", "g", "beta", "h0"]
    else:
        from canonlm.ops.ssd import ssd_scan_reference

        P, G, N = 3, 1, 5
        ins = [torch.randn(B, T, H, P, generator=g, dtype=d), torch.randn(B, T, H, generator=g, dtype=d),
               -torch.exp(torch.rand(H, generator=g, dtype=d) * 2), torch.randn(B, T, G, N, generator=g, dtype=d),
               torch.randn(B, T, G, N, generator=g, dtype=d), torch.randn(H, generator=g, dtype=d),
               torch.randn(H, generator=g, dtype=d) * 0.5, torch.randn(B, H, P, N, generator=g, dtype=d)]
        got = _fwd_bwd(lambda x, dt, A, Bm, Cm, D, db, h: ssd_scan_reference(
            x, dt, A, Bm, Cm, D=D, dt_bias=db, initial_state=h, output_final_state=True, chunk_size=16), ins)
        ref = _fwd_bwd(_ssd_loop, ins)
        names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "h0"]
    _compare(["o", "S"], names, got, ref, errors)
    return judge_kernel("reference", "reference", errors, 1e-10)


# ----------------------------------------------------------------------------------------------------------------
# training runs (train.py in a subprocess)
# ----------------------------------------------------------------------------------------------------------------

def train_probe(out: str):
    """Lightning callback for the self-check's training runs (instantiated by Hydra from
    ``+callbacks.selfcheck._target_=canonlm.selfcheck.train_probe``): at the end of training, rank 0 writes
    ``out`` (JSON) with the steps done, world size, the backends the model was placed with, the selections the
    ops memoised during the run, and the peak memory in GiB (CUDA: ``max_memory_allocated``; CPU: peak RSS)."""
    import lightning.pytorch as L

    class _Probe(L.Callback):
        def on_train_end(self, trainer, pl_module):  # noqa: D401
            if not trainer.is_global_zero:
                return
            import torch

            model = pl_module.model
            dev = pl_module.device
            if dev.type == "cuda":
                peak = torch.cuda.max_memory_allocated(dev) / 2**30
            else:
                import resource

                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                peak = rss / 2**30 if sys.platform == "darwin" else rss / 2**20
            placed = getattr(model, "placement", None)
            info = {"steps": int(trainer.global_step), "world_size": int(trainer.world_size), "device": str(dev),
                    "precision": str(trainer.precision), "peak_mem_gib": peak,
                    "backends": dict(getattr(model, "backends", {}) or {}),
                    "placed": None if placed is None else [str(placed[0]), str(placed[1])],
                    "selected": observed_selections(dev.type)}
            from canonlm.utils.io import atomic_write_text

            atomic_write_text(out, json.dumps(info))

    return _Probe()


def observed_selections(device_type: str) -> dict[str, list[str]]:
    """Backends the Canon / GLA / GDN / SSD ops actually selected in this process for ``device_type`` (read from the
    ops' memo tables; an op whose table is not readable is left out)."""
    out: dict[str, set] = {}
    try:
        from canonlm.ops import canon, gdn, gla, ssd
    except Exception:  # noqa: BLE001
        return {}
    tables = [("canon", getattr(canon, "_select_cache", None))]
    tables += [(n, getattr(getattr(m, "_select", None), "cache", None)) for n, m in (("gla", gla), ("gdn", gdn),
                                                                                      ("ssd", ssd))]
    for name, table in tables:
        if not isinstance(table, dict):
            continue
        for key, be in list(table.items()):
            if isinstance(key, tuple) and len(key) > 1 and str(key[1]).split(":")[0] == device_type:
                out.setdefault(name, set()).add(str(be))
    return {k: sorted(v) for k, v in out.items()}


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


@dataclasses.dataclass
class TrainSpec:
    """One training line: what to run and what it must show."""

    label: str
    arch: str
    canon: str
    overrides: list
    steps: int
    world: int
    device: str                      # "cuda" | "cpu"
    timeout: float


def run_training(spec: TrainSpec, workdir: Path) -> tuple[str, str]:
    """Run ``train.py`` for ``spec`` in a subprocess (``logger=none``, ``callbacks=none`` plus :func:`train_probe`,
    no validation or test) and judge it with :func:`judge_training`; on CUDA every op must run its fast path when
    its library is installed (:func:`_expected_fast`). Raises Skip without a checkout's ``train.py``, Fail when the
    run exits non-zero or times out (the last output lines and the run directory in the message)."""
    train_py = ROOT / "train.py"
    if not train_py.is_file() or not (ROOT / "conf").is_dir():
        raise Skip(f"no train.py / conf/ at {ROOT} (run from a source checkout: pip install -e .)")
    name = spec.label.replace(" ", "_").replace("=", "-").replace("/", "-")
    probe = workdir / f"{name}.probe.json"
    cmd = [sys.executable, str(train_py), f"arch={spec.arch}", f"canon={spec.canon}", *spec.overrides,
           f"trainer.max_steps={spec.steps}", "trainer.limit_val_batches=0", "test=false", "logger=none",
           "callbacks=none", "+callbacks.selfcheck._target_=canonlm.selfcheck.train_probe",
           f"+callbacks.selfcheck.out={probe}", f"paths.log_dir={workdir}", f"run_name={name}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.timeout, cwd=str(workdir), env=env)
    except subprocess.TimeoutExpired:
        raise Fail(f"train.py did not finish within {spec.timeout:.0f} s") from None
    run_dir = workdir / "train" / "runs" / name
    if p.returncode != 0:
        tail = [ln for ln in (p.stderr + "\n" + p.stdout).splitlines() if ln.strip()][-3:]
        raise Fail(f"train.py exit {p.returncode}: {_short(' / '.join(tail), 400)} (run dir {run_dir})")
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    info = json.loads(probe.read_text()) if probe.is_file() else {}
    want, why = None, None
    if spec.device == "cuda":
        import torch

        try:
            want = _expected_fast(spec.arch, torch.bfloat16)
        except Skip as e:
            want, why = {}, str(e)
    status, detail = judge_training(spec, rows, info, want)
    if why is not None:
        detail += f" (no fast {MIXER_OP[spec.arch]} kernel: {why})"
    if status == FAIL:
        detail += f" (run dir {run_dir})"
    return status, detail


def judge_training(spec: TrainSpec, rows: list[dict], info: dict, want: Optional[dict]) -> tuple[str, str]:
    """Verdict of a finished training run.

    Args:
        spec: what was run. rows: the run's ``metrics.jsonl`` rows. info: what :func:`train_probe` wrote (steps,
            world_size, backends the model was placed with, ``selected`` = the backends the ops memoised, peak
            memory). want: ``{op: fast backend}`` that must have run (None: no requirement, e.g. on the CPU).
    Returns:
        ``(PASS | FAIL, detail)``: FAIL when fewer steps ran than asked, a loss is missing or not finite, the world
        size differs, or an op ran anything but its wanted fast backend (a reference fallback). The detail gives
        tokens/s (median of the ``perf/tokens_per_s`` rows after the first), peak memory (GiB; the larger of the
        ``perf/peak_mem_gb`` rows and the probe), MFU (median ``perf/mfu``), the first and last loss and the ops.
    """
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    if info.get("steps") != spec.steps:
        return FAIL, f"{info.get('steps')} optimizer steps done, {spec.steps} asked"
    if not losses or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        return FAIL, f"non-finite or missing train/loss in metrics.jsonl: {losses[:5]}"
    if spec.world and info.get("world_size") != spec.world:
        return FAIL, f"world size {info.get('world_size')}, expected {spec.world}"
    tps = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]
    mfu = [r["perf/mfu"] for r in rows if "perf/mfu" in r]
    mem = [r["perf/peak_mem_gb"] for r in rows if "perf/peak_mem_gb" in r]
    mem += [info["peak_mem_gib"]] if isinstance(info.get("peak_mem_gib"), (int, float)) else []
    tok_s = _median(tps[1:] or tps)
    backends = info.get("backends") or {}
    selected = info.get("selected") or {}
    parts = [f"tokens/s {tok_s:,.0f}" if tok_s else "tokens/s n/a (no perf/tokens_per_s rows)",
             f"peak mem {max(mem):.2f} GiB" if mem else "peak mem n/a",
             f"MFU {100 * _median(mfu[1:] or mfu):.1f}%" if mfu else
             ("MFU n/a (GPU not in the peak-FLOPs table)" if spec.device == "cuda" else "MFU n/a (CPU)"),
             f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", f"ops {_fmt_backends(backends)}" if backends else "ops ?"]
    if selected:
        parts.append("ran " + " ".join(f"{k}={'/'.join(v)}" for k, v in sorted(selected.items())))
    detail = "; ".join(parts)
    bad = {}
    for op, fast in (want or {}).items():
        ran = [backends.get(op)] if op == "attention" else (selected.get(op) or [backends.get(op)])
        if set(ran) != {fast}:
            bad[op] = ran
    if bad:
        return FAIL, ("fallback: " + ", ".join(f"{k} ran {'/'.join(map(str, v))}, want {want[k]}"
                                               for k, v in bad.items()) + f"; {detail}")
    return PASS, detail


# ----------------------------------------------------------------------------------------------------------------
# the check lists
# ----------------------------------------------------------------------------------------------------------------

def gpu_checks(args, workdir: Path) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    """Every GPU check as ``(name, fn)`` (names are known without CUDA, so they can be listed as SKIP)."""
    dts = ["bf16"] if args.quick else ["fp32", "bf16"]
    out: list = []
    for dt in dts:
        for fast in ("dao", "fla"):
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel canon/{fast} {dt} {mode}",
                            lambda f=fast, d=dt, m=mode: check_canon_kernel(f, d, m)))
        for fast in ("sdpa", "flash"):
            if fast == "flash" and dt == "fp32":
                continue
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel attention/{fast} {dt} {mode}",
                            lambda f=fast, d=dt, m=mode: check_attention_kernel(f, d, m)))
        for label, fn in (("gla/fla", check_gla_kernel), ("gdn/fla", check_gdn_kernel),
                          ("ssd/mamba_ssm", check_ssd_kernel)):
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel {label} {dt} {mode}", lambda f=fn, d=dt, m=mode: f(d, m)))
        out.append((f"kernel ssd/mamba_ssm fused split {dt} fwd+bwd", lambda d=dt: check_ssd_split_kernel(d)))
    for arch in PRESETS:
        if not args.quick:
            out.append((f"model {arch} fast vs reference (cuda, bf16)",
                        lambda a=arch: check_model_fast_vs_reference(a)))
        out.append((f"model {arch} decode == full forward (cuda, fp32)",
                    lambda a=arch: check_model_decode(a, "cuda")))
    bs = args.batch
    common = [f"model.size={args.size}", "task=depo1", "trainer=gpu", "trainer.devices=1",
              "trainer.log_every_n_steps=5", f"data.batch_size={bs}"]
    for arch, sets in CANON_SETS.items():
        for canon in (sets[1:] if args.quick else sets):
            label = f"train {arch} canon={canon} {args.size} {args.steps} steps (1 GPU, bf16-mixed)"
            spec = TrainSpec(label, arch, canon, common, args.steps, 1, "cuda", 1200)
            out.append((label, lambda s=spec: _gpu_train(s, workdir)))
    for arch in (("llama",) if args.quick else ("llama", "gla")):
        canon = CANON_SETS[arch][1]
        label = f"fsdp2 {arch} canon={canon} {args.size} {args.steps} steps (all GPUs)"
        out.append((label, lambda a=arch, c=canon, lb=label: _fsdp2(a, c, lb, args, workdir)))
    return out


def _gpu_train(spec: TrainSpec, workdir: Path) -> tuple[str, str]:
    _need_cuda()
    return run_training(spec, workdir)


def _fsdp2(arch: str, canon: str, label: str, args, workdir: Path) -> tuple[str, str]:
    import torch

    _need_cuda()
    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"needs >= 2 GPUs ({n} visible)")
    over = [f"model.size={args.size}", "task=depo1", "trainer=gpu", f"trainer.devices={n}",
            "trainer.precision=32-true", "strategy=fsdp2", "trainer.log_every_n_steps=5",
            f"data.batch_size={args.batch * n}"]
    return run_training(TrainSpec(label, arch, canon, over, args.steps, n, "cuda", 1800), workdir)


def cpu_checks(args, workdir: Path) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    """The checks that run on the CPU (always run; on a CUDA machine they are the CPU half of the report)."""
    out: list = [("cpu canon/cpu native kernel fp32 fwd+bwd", lambda: check_cpu_canon_native("fp32"))]
    if not args.quick:
        out.append(("cpu canon/cpu native kernel bf16 fwd+bwd", lambda: check_cpu_canon_native("bf16")))
    out += [("cpu canon reference + decode step vs loop (fp64)", check_cpu_canon_reference_loop),
            ("cpu attention sdpa fp32 fwd+bwd + decode", check_cpu_attention)]
    for op in ("gla", "gdn", "ssd"):
        out.append((f"cpu {op} chunked reference vs recurrence (fp64) fwd+bwd",
                    lambda o=op: check_cpu_linear_reference(o)))
    for arch in PRESETS:
        out.append((f"cpu model {arch} decode == full forward (fp32)",
                    lambda a=arch: check_model_decode(a, "cpu", "2L64D")))
    tiny = ["model.size=2L64D", "task=depo1_cpu", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128",
            "data.batch_size=4", "trainer=cpu", "trainer.log_every_n_steps=1"]
    for arch, sets in CANON_SETS.items():
        if args.quick and arch != "llama":
            continue
        canon = sets[1]
        label = f"cpu train {arch} canon={canon} 2L64D 5 steps"
        spec = TrainSpec(label, arch, canon, tiny, 5, 1, "cpu", 300)
        out.append((label, lambda s=spec: run_training(s, workdir)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------

def _cell(s: str) -> str:
    return " ".join(str(s).split()).replace("|", "\\|")


def render(results: list[Result], vers: list[tuple[str, str]], header: dict) -> str:
    """The markdown report: header, versions table, checks table (status, check, detail, seconds), summary."""
    n = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines = ["# canonlm self-check", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [f"- result: **{'FAIL' if n[FAIL] else 'PASS'}** ({n[PASS]} PASS, {n[FAIL]} FAIL, {n[SKIP]} SKIP)", ""]
    lines += ["## Versions", "", "| component | version |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in vers]
    lines += ["", "## Checks", "", "| status | check | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {r.status} | {_cell(r.name)} | {_cell(r.detail)} | {r.seconds:.1f} |" for r in results]
    lines += ["", "Errors are max |fast - ref| / max |ref| per tensor against a float64 reference of the same rounded "
              "inputs (dX = gradient of a random projection w.r.t. X). A kernel line passes only if the fast backend "
              "really ran.", ""]
    return "\n".join(lines)


def write_report(path: Path, text: str, force: bool) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then rename). Without ``force`` an
    existing file is never replaced: the new file is hard-linked into place, which fails if the name exists.
    Raises FileExistsError (exists, no ``force``) or OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # file systems without hard links: check, then rename
                if path.exists():
                    raise FileExistsError(str(path)) from None
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point; returns the exit code (0 no FAIL, 1 a FAIL, 2 refused)."""
    ap = argparse.ArgumentParser(prog="python -m canonlm.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="report path (default: selfcheck-<date>.md in the current directory)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out")
    ap.add_argument("--quick", action="store_true",
                    help="fewer checks: bf16 kernels only, decode model checks, Canon runs only, FSDP2 llama only")
    ap.add_argument("--steps", type=int, default=30, help="training steps per GPU run (default 30)")
    ap.add_argument("--size", default="12L768D", help="model size of the GPU training runs (default 12L768D)")
    ap.add_argument("--batch", type=int, default=8, help="windows of 2048 tokens per GPU per step (default 8)")
    ap.add_argument("--keep", action="store_true", help="keep the training run directories (default: removed "
                    "unless a training line failed)")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.batch < 1:
        print("selfcheck: error: --steps must be >= 2 and --batch >= 1", file=sys.stderr)
        return 2
    started = datetime.datetime.now()
    out = Path(args.out) if args.out else Path.cwd() / f"selfcheck-{started:%Y-%m-%d}.md"
    if out.exists() and not args.force:
        print(f"selfcheck: error: {out} exists; pass --force to overwrite it or --out to choose another file",
              file=sys.stderr)
        return 2

    import torch

    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    if not cuda:
        print(NO_CUDA_MESSAGE, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="canonlm-selfcheck-"))
    results: list[Result] = []
    t0 = time.perf_counter()

    def emit(r: Result) -> None:
        results.append(r)
        print(f"[{r.status}] {r.name} ({r.seconds:.1f} s): {r.detail}", file=sys.stderr, flush=True)

    try:
        for name, fn in gpu_checks(args, workdir):
            emit(run_check(name, fn) if cuda else Result(name, SKIP, NO_CUDA, 0.0))
        for name, fn in cpu_checks(args, workdir):
            emit(run_check(name, fn))
    finally:
        failed_train = any(r.status == FAIL and ("train" in r.name or "fsdp2" in r.name) for r in results)
        if args.keep or failed_train:
            print(f"selfcheck: training run directories kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    header = {"date": started.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node() or "unknown",
              "command": "python -m canonlm.selfcheck " + " ".join(sys.argv[1:] if argv is None else argv),
              "mode": (f"CUDA, {n_gpu} GPU(s) visible" if cuda else NO_CUDA_MESSAGE + "; CPU subset only")
              + (", --quick" if args.quick else ""),
              "wall time": f"{time.perf_counter() - t0:.0f} s"}
    text = render(results, versions(), header)
    print(text, flush=True)
    try:
        write_report(out, text, args.force)
    except FileExistsError:
        print(f"selfcheck: error: {out} appeared while the checks ran; not overwritten (use --force)",
              file=sys.stderr)
        return 2
    print(f"selfcheck: report written to {out}", file=sys.stderr)
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
