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

Every line is PASS, FAIL or SKIP with its detail and seconds. What ran is observed, not inferred from the backend
names: :func:`kernel_calls` counts the calls of every backend's entry point (:data:`ENTRY_POINTS`) while a check
runs. A kernel, model or training line passes only if the fast kernels were the ones called (``auto`` must choose
them whenever their library imports; Mamba2 must take its fused ``mamba_split_conv1d_scan_combined`` path wherever
:func:`canonlm.ops.ssd.fused_split_reason` allows it) and every output and gradient is within the tolerance the line
states. Errors are ``max |fast - ref| / max |ref|`` per tensor (relative to the tensor's largest entry). fp32
tolerances of the Triton kernels follow the fp32 precision of ``tl.dot`` in this process (:func:`fp32_tol`), which the
report states.

:func:`run_kernel_checks` runs only the kernel lines, on any device (default CUDA), and returns structured results.

Usage::

    python -m canonlm.selfcheck [--out FILE] [--force] [--quick] [--steps N] [--size 12L768D] [--batch N]

Exit codes: 0 no FAIL, 1 at least one FAIL, 2 refused (``--out`` exists without ``--force``, bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
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
from typing import Any, Callable, Iterable, Optional

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NO_CUDA = "no CUDA"
NO_CUDA_MESSAGE = "no CUDA device: GPU kernels and GPU training cannot be checked here"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (train.py, conf/) for an editable install

#: Distributions whose versions the report lists (first installed name wins for each row).
LIBRARIES = (("lightning", ("lightning",)), ("triton", ("triton", "pytorch-triton")),
             ("fla-core", ("fla-core", "flash-linear-attention")), ("flash-attn", ("flash-attn",)),
             ("causal-conv1d", ("causal-conv1d",)), ("mamba-ssm", ("mamba-ssm",)))

#: Tolerance on ``max |fast - ref| / max |ref|`` against a float64 reference of the same rounded inputs, bf16.
BF16_TOL = 6e-2
#: fp32 tolerances: IEEE fp32 arithmetic (the CUDA C kernels, SDPA, fla's conv; Triton ``tl.dot`` under
#: ``TRITON_F32_DEFAULT=ieee``), and ``tl.dot`` rounding fp32 operands to TF32 (10-bit mantissa, ~1e-3 relative per
#: product, accumulated over a chunk).
FP32_TOL_IEEE, FP32_TOL_TF32 = 2e-4, 5e-3
#: Fast backends whose fp32 matmuls are Triton ``tl.dot`` calls (fla's chunked GLA / GDN, mamba-ssm's SSD kernels).
TL_DOT_BACKENDS = frozenset({("gla", "fla"), ("gdn", "fla"), ("ssd", "mamba_ssm"), ("ssd", "split")})

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

_CANON, _SSD = "canonlm.ops.canon", "canonlm.ops.ssd"
#: ``(op, backend) -> ((module, function), ...)``: the functions through which each backend of each sequence op runs,
#: as the ops call them (module attributes looked up at call time). Fast backends: canonlm's thin wrappers around
#: the library calls (``canonlm/ops/*/_cuda.py``, ``_fla.py``, ``_mamba.py``) or the library function itself (SDPA,
#: flash-attn). Canon's plain-torch decode step is inline code of ``causal_conv1d_step``: see :data:`INLINE_PATHS`.
ENTRY_POINTS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("canon", "dao"): ((f"{_CANON}._cuda", "dao_forward"), (f"{_CANON}._cuda", "dao_step")),
    ("canon", "fla"): ((f"{_CANON}._cuda", "fla_forward"), (f"{_CANON}._cuda", "fla_step")),
    ("canon", "cpu"): ((f"{_CANON}._native", "canon_conv"),),
    ("canon", "torch"): ((_CANON, "causal_conv1d_torch"),),
    ("canon", "reference"): ((_CANON, "causal_conv1d_reference"),),
    ("attention", "sdpa"): (("torch.nn.functional", "scaled_dot_product_attention"),),
    ("attention", "flash"): (("flash_attn", "flash_attn_func"),),
    ("attention", "reference"): (("canonlm.ops.attention", "attention_reference"),),
    ("gla", "fla"): (("canonlm.ops.gla._fla", "fla_forward"),),
    ("gla", "reference"): (("canonlm.ops.gla", "chunk_gla_reference"),),
    ("gdn", "fla"): (("canonlm.ops.gdn._fla", "forward"),),
    ("gdn", "reference"): (("canonlm.ops.gdn", "chunk_gated_delta_rule_reference"),),
    ("ssd", "mamba_ssm"): ((f"{_SSD}._mamba", "chunk_scan"), (f"{_SSD}._mamba", "state_update")),
    ("ssd", "split"): ((f"{_SSD}._mamba", "split_conv1d_scan"),),
    ("ssd", "reference"): ((_SSD, "ssd_scan_reference"), (_SSD, "split_conv1d_scan_reference")),
}
#: ``(op, backend, module, function)``: a dispatch function with an inline path; a call of it during which no entry
#: point of ``op`` was called counts as ``backend`` (Canon's decode step in plain torch).
INLINE_PATHS = (("canon", "torch", _CANON, "causal_conv1d_step"),)


# ----------------------------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Verdict:
    """What a check returns besides ``(status, detail)``: ``op`` / ``backend`` under test, ``ran`` = the calls
    :func:`kernel_calls` observed (``{op: {backend: calls}}``), ``errors`` = ``{tensor: max |fast - ref| /
    max |ref|}`` and the tolerance ``tol`` they were judged against."""

    status: str
    detail: str
    op: Optional[str] = None
    backend: Optional[str] = None
    ran: dict = dataclasses.field(default_factory=dict)
    errors: dict = dataclasses.field(default_factory=dict)
    tol: Optional[float] = None


@dataclasses.dataclass
class Result:
    """One report line: ``status`` is PASS / FAIL / SKIP; ``seconds`` the wall time of the check; the other fields
    as in :class:`Verdict` (empty when the check ended before judging, e.g. SKIP)."""

    name: str
    status: str
    detail: str
    seconds: float
    op: Optional[str] = None
    backend: Optional[str] = None
    ran: dict = dataclasses.field(default_factory=dict)
    errors: dict = dataclasses.field(default_factory=dict)
    tol: Optional[float] = None


class Skip(Exception):
    """Raised inside a check: the line is SKIP with this message as its reason."""


class Fail(Exception):
    """Raised inside a check: the line is FAIL with this message."""


def run_check(name: str, fn: Callable[[], Any]) -> Result:
    """Run one check ``fn() -> (status, detail) | Verdict``; :class:`Skip` / :class:`Fail` / any other exception
    become SKIP / FAIL lines (the exception type and message, shortened). Never raises (KeyboardInterrupt aside)."""
    t0 = time.perf_counter()
    try:
        out = fn()
        v = out if isinstance(out, Verdict) else Verdict(*out)
    except Skip as e:
        v = Verdict(SKIP, str(e))
    except Fail as e:
        v = Verdict(FAIL, str(e))
    except Exception as e:  # noqa: BLE001 -- a crashing check is a FAIL line, the others still run
        v = Verdict(FAIL, f"{type(e).__name__}: {_short(str(e), 300)}")
    if v.status not in (PASS, FAIL, SKIP):
        v = Verdict(FAIL, f"check returned status {v.status!r} ({v.detail})")
    return Result(name, v.status, v.detail, time.perf_counter() - t0, v.op, v.backend, v.ran, v.errors, v.tol)


def _short(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------------------------
# tolerances: fp32 precision of Triton's tl.dot
# ----------------------------------------------------------------------------------------------------------------

def triton_fp32_precision() -> str:
    """The precision Triton's ``tl.dot`` gives fp32 operands in this process: ``TRITON_F32_DEFAULT`` lower-cased
    (``ieee``, ``tf32``, ``tf32x3``, ...), or ``tf32`` when it is unset -- Triton's default on GPUs with TF32 tensor
    cores (``triton/language/core.py`` ``dot``: ``input_precision = knobs.language.fp32_default or "tf32"``).
    fla-core 0.6 sets ``TRITON_F32_DEFAULT=ieee`` itself on pre-Ampere NVIDIA GPUs when imported
    (``fla/utils/hardware.py``); mamba-ssm has no switch. Read at call time; a kernel compiled earlier keeps the
    precision it was compiled with, so set the variable before the process starts."""
    return os.environ.get("TRITON_F32_DEFAULT", "").strip().lower() or "tf32"


def fp32_tol(tight: float = FP32_TOL_IEEE, tf32: float = FP32_TOL_TF32) -> float:
    """Tolerance of an fp32 comparison involving Triton ``tl.dot`` kernels (fla, mamba-ssm): ``tight`` when
    :func:`triton_fp32_precision` is ``ieee``, else ``tf32`` (TF32 or another reduced-precision mode). The one rule
    for the self-check and the GPU tests (tests/_kernel_calls.py)."""
    return tight if triton_fp32_precision() == "ieee" else tf32


def kernel_tol(op: str, fast: str, dt: str) -> float:
    """Tolerance of a kernel line: :data:`BF16_TOL` for bf16; for fp32 :func:`fp32_tol` when ``(op, fast)`` runs
    ``tl.dot`` (:data:`TL_DOT_BACKENDS`), else :data:`FP32_TOL_IEEE`."""
    if dt == "bf16":
        return BF16_TOL
    return fp32_tol() if (op, fast) in TL_DOT_BACKENDS else FP32_TOL_IEEE


def precision_note() -> str:
    """The report's statement of the fp32 precision in force and the fp32 tolerance it gives the Triton lines."""
    mode = triton_fp32_precision()
    src = "TRITON_F32_DEFAULT=" + os.environ["TRITON_F32_DEFAULT"] if os.environ.get("TRITON_F32_DEFAULT") else \
        "TRITON_F32_DEFAULT unset: Triton's default on TF32 GPUs"
    return (f"{mode} ({src}); fp32 tolerance of the fla / mamba-ssm lines {fp32_tol():.0e} "
            f"({FP32_TOL_IEEE:.0e} with TRITON_F32_DEFAULT=ieee, {FP32_TOL_TF32:.0e} otherwise)")


# ----------------------------------------------------------------------------------------------------------------
# what ran: counted calls of the backends' entry points
# ----------------------------------------------------------------------------------------------------------------

def _resolve_entry(module: str, attr: str, op: str, backend: str):
    """``(module object, function)`` of one entry point; None when ``module`` is a library that does not import
    (its backend cannot have run). Raises RuntimeError when a canonlm module or the function is missing."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 -- ImportError, or an ABI mismatch raising OSError
        if module.startswith("canonlm."):
            raise
        return None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise RuntimeError(f"selfcheck: {module}.{attr} (the entry point of {op} backend {backend!r}) does not "
                           f"exist; without it the self-check cannot tell whether that backend ran (renamed? "
                           f"update canonlm.selfcheck.ENTRY_POINTS)")
    return mod, fn


@contextlib.contextmanager
def kernel_calls(ops: Iterable[str]):
    """Count which backends of the sequence ops ``ops`` (``canon``, ``attention``, ``gla``, ``gdn``, ``ssd``) run
    inside the ``with`` block.

    Every function of :data:`ENTRY_POINTS` of those ops is replaced by a pass-through that counts its calls (the
    original runs unchanged; nothing is mocked), plus the dispatch functions of :data:`INLINE_PATHS`. Calls made
    while another counted call is running (a backend's own internals) are not counted, so each count is one choice
    of a dispatch point. Restored on exit.

    Yields:
        ``{op: {backend: calls}}``, filled while the block runs (only backends that were called appear).
    Raises:
        RuntimeError: an entry point of a canonlm module does not exist (a renamed wrapper would otherwise make
        every fast path look as if it never ran, or -- worse -- a fallback invisible); raised on entry, before the
        block runs.
    """
    ops = set(ops)
    counts: dict[str, dict[str, int]] = {}
    depth = [0]
    patched: list[tuple[Any, str, Any]] = []

    def add(op: str, backend: str) -> None:
        counts.setdefault(op, {})[backend] = counts.get(op, {}).get(backend, 0) + 1

    def counted(fn, op: str, backend: str, inline: bool):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0]:  # inside another counted call: that backend's own internals
                return fn(*args, **kwargs)
            if inline:  # a dispatch function: its inline path ran when no entry point of the op did
                before = sum(counts.get(op, {}).values())
                out = fn(*args, **kwargs)
                if sum(counts.get(op, {}).values()) == before:
                    add(op, backend)
                return out
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                add(op, backend)
        return wrapper

    entries = [(op, be, m, a, False) for (op, be), points in ENTRY_POINTS.items() for m, a in points]
    entries += [(op, be, m, a, True) for op, be, m, a in INLINE_PATHS]
    try:
        for op, be, module, attr, inline in entries:
            if op not in ops:
                continue
            found = _resolve_entry(module, attr, op, be)
            if found is None:
                continue
            mod, fn = found
            patched.append((mod, attr, fn))
            setattr(mod, attr, counted(fn, op, be, inline))
        yield counts
    finally:
        for mod, attr, fn in reversed(patched):
            setattr(mod, attr, fn)


def _fmt_ran(ran: dict) -> str:
    """``canon=dao:12 gla=fla:2`` (``{op: {backend: calls}}`` of :func:`kernel_calls`), or ``nothing``."""
    parts = [f"{op}=" + ",".join(f"{b}:{n}" for b, n in sorted(bs.items())) for op, bs in sorted(ran.items()) if bs]
    return " ".join(parts) or "nothing"


def judge_ran(want: dict, ran: dict, required: Iterable[str] = ()) -> Optional[str]:
    """None when every op of ``want`` ran only its wanted fast backend(s), and every op of ``required`` ran at least
    once; else what went wrong (for a FAIL line).

    ``want`` maps an op to one backend or a tuple of acceptable ones (Canon: ``("dao", "fla")``, since the model
    resolves each Canon layer by its shape); ``ran`` is :func:`kernel_calls`'s ``{op: {backend: calls}}``. An op of
    ``want`` that is not ``required`` may not have been called at all (e.g. Canon in a model whose only conv is fused
    into Mamba2's split kernel)."""
    bad = []
    for op, fast in want.items():
        allowed = (fast,) if isinstance(fast, str) else tuple(fast)
        got = {b: n for b, n in ran.get(op, {}).items() if n}
        other = sorted(b for b in got if b not in allowed)
        if other:
            bad.append(f"{op} ran {'/'.join(other)} (want {'/'.join(allowed)}: fallback)")
        elif op in required and not got:
            bad.append(f"{op}: {'/'.join(allowed)} did not run")
    return "; ".join(bad) or None


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


def judge_kernel(op: str, fast: str, resolved: Optional[str], ran: dict, errors: dict[str, float],
                 tol: float, note: str = "") -> Verdict:
    """Verdict of a fast-path-vs-reference comparison.

    Args:
        op: the sequence op (``"gla"``...); fast: the backend under test (e.g. ``"fla"``).
        resolved: the backend the op's resolution selected (None: unknown).
        ran: ``{op: {backend: calls}}`` observed by :func:`kernel_calls` around the fast path's calls.
        errors: ``{tensor name: max |fast - ref| / max |ref|}`` of every output and gradient compared.
        tol: the largest error that passes. note: appended to the detail (e.g. the fp32 precision in force).
    Returns:
        A :class:`Verdict`: FAIL when the selected backend is not ``fast``, when ``fast`` was not called or another
        backend of ``op`` was (a fallback to the reference is never a pass, whatever the errors), when nothing was
        compared, or when an error is above ``tol`` or not finite (:func:`judge_errors`).
    """
    facts = dict(op=op, backend=fast, ran=ran, errors=errors, tol=tol)
    if resolved != fast:
        return Verdict(FAIL, f"backend {resolved!r} was selected, not {fast!r} (fallback: the fast path did not run)",
                       **facts)
    bad = judge_ran({op: fast}, ran, required=(op,))
    if bad:
        return Verdict(FAIL, f"{bad} (ran {_fmt_ran(ran)})", **facts)
    status, detail = judge_errors(errors, tol)
    return Verdict(status, f"ran {_fmt_ran(ran)}; {detail}{note}", **facts)


def _tol_note(op: str, fast: str, dt: str) -> str:
    """``; fp32 tl.dot: <precision>`` for an fp32 line of a ``tl.dot`` backend (its tolerance depends on it)."""
    return f"; fp32 tl.dot: {triton_fp32_precision()}" if dt == "fp32" and (op, fast) in TL_DOT_BACKENDS else ""


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
# kernel checks (fast path vs reference; CUDA by default)
# ----------------------------------------------------------------------------------------------------------------

def _need_cuda(device: str) -> None:
    """Skip (``no CUDA``) a check meant for a CUDA ``device`` when CUDA is not available."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise Skip(NO_CUDA)


def _kernel_prelude(op: str, fast: str, dtype, device: str) -> str:
    """Skip/fail early when the fast path cannot run on ``device``; return the backend ``auto`` picks (or the explicit
    one when ``fast`` is not ``auto``'s first choice: canon ``fla`` beside ``dao``, attention ``flash``)."""
    _need_cuda(device)
    bad = _fast_unavailable(op, fast, device, dtype)
    if bad is not None:
        if bad[0] == FAIL:
            raise Fail(bad[1])
        raise Skip(bad[1])
    auto = _resolve(op, "auto", device, dtype)
    secondary = (op == "canon" and fast == "fla" and auto == "dao") or (op == "attention" and fast == "flash")
    return _resolve(op, fast, device, dtype) if secondary else auto


def _canon_case(dtype, dev, seed=0, B=2, T=200, C=64, K=4):
    import torch

    g = _gen(seed)
    x = torch.randn(B, T, C, generator=g)
    w = torch.rand(C, K, generator=g) - 0.5
    b = torch.randn(C, generator=g) * 0.1
    h0 = torch.randn(B, C, K - 1, generator=g)
    return [t.to(dtype).to(dev) for t in (x, w, b, h0)]


#: The two Canon-op uses checked: the Canon layer (residual, no activation) and a mixer's short conv (SiLU).
_CANON_KINDS = {"canon.": (True, False), "shortconv.": (False, True)}


def check_canon_kernel(fast: str, dt: str, mode: str, device: str = "cuda") -> Verdict:
    """Canon ``dao`` / ``fla`` vs ``causal_conv1d_reference``: the Canon layer (residual) and the short conv (SiLU,
    no residual), with bias and an initial state; ``mode`` ``fwd+bwd`` or ``decode`` (``causal_conv1d_step`` for
    40 tokens from a zero state vs the full reference, and the final state)."""
    import torch

    from canonlm.ops.canon import causal_conv1d, causal_conv1d_reference, causal_conv1d_state, causal_conv1d_step

    dtype = _dtype(dt)
    resolved = _kernel_prelude("canon", fast, dtype, device)
    x, w, b, h0 = _canon_case(dtype, device)
    errors: dict[str, float] = {}

    def conv(fn, residual, act):
        return lambda x, w, b, h: (fn(x, w, b, residual=residual, activation=act, initial_state=h),)

    if mode == "fwd+bwd":
        fast_fn = functools.partial(causal_conv1d, backend=fast)
        with kernel_calls(["canon"]) as ran:
            got = {tag: _fwd_bwd(conv(fast_fn, *ra), [x, w, b, h0]) for tag, ra in _CANON_KINDS.items()}
        for tag, ra in _CANON_KINDS.items():
            ref = _fwd_bwd(conv(causal_conv1d_reference, *ra), [t.double() for t in (x, w, b, h0)])
            _compare(["y"], ["x", "w", "b", "init"], got[tag], ref, errors, tag)
    else:
        x = x[:, :40]

        def steps(residual, act):
            state, ys = torch.zeros(x.shape[0], x.shape[2], w.shape[1], device=device, dtype=dtype), []
            for t in range(x.shape[1]):
                y, state = causal_conv1d_step(x[:, t], state, w, b, residual=residual, activation=act, backend=fast)
                ys.append(y)
            return torch.stack(ys, 1), state

        with torch.no_grad():
            with kernel_calls(["canon"]) as ran:
                got = {tag: steps(*ra) for tag, ra in _CANON_KINDS.items()}
            for tag, (residual, act) in _CANON_KINDS.items():
                ref = causal_conv1d_reference(x.double(), w.double(), b.double(), residual=residual, activation=act)
                errors[tag + "y_steps"] = rel_err(got[tag][0], ref)
                errors[tag + "state"] = rel_err(got[tag][1], causal_conv1d_state(x, w.shape[1]))
    return judge_kernel("canon", fast, resolved, ran, errors, kernel_tol("canon", fast, dt))


def check_attention_kernel(fast: str, dt: str, mode: str, device: str = "cuda") -> Verdict:
    """Attention ``sdpa`` / ``flash`` vs ``attention_reference`` (GQA 8 query / 2 kv heads, head dim 64, causal):
    ``fwd+bwd`` at T = 256, or ``decode`` (1 and 5 new queries against a 256-key cache, bottom-right causal)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    dtype = _dtype(dt)
    if fast == "flash" and dtype not in (torch.float16, torch.bfloat16):
        raise Skip("flash-attn has no fp32 kernel")
    if fast == "flash":
        resolved = _kernel_prelude("attention", "flash", dtype, device)
    else:
        _need_cuda(device)
        resolved = _resolve("attention", "auto", device, dtype)
    g = _gen(3)
    B, S, H, Hkv, D = 2, 256, 8, 2, 64
    q = torch.randn(B, S, H, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype).to(device)
    errors: dict[str, float] = {}
    if mode == "fwd+bwd":
        with kernel_calls(["attention"]) as ran:
            got = _fwd_bwd(lambda q, k, v: (attention(q, k, v, backend=fast),), [q, k, v])
        ref = _fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
        _compare(["o"], ["q", "k", "v"], got, ref, errors)
    else:
        with torch.no_grad():
            with kernel_calls(["attention"]) as ran:
                outs = {T: attention(q[:, -T:].contiguous(), k, v, backend=fast) for T in (1, 5)}
            for T, o in outs.items():
                errors[f"o_T{T}"] = rel_err(o, attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel("attention", fast, resolved, ran, errors, kernel_tol("attention", fast, dt))


def _gla_case(dtype, dev, seed=0, B=2, T=300, H=4, K=64, V=64):
    import torch
    import torch.nn.functional as F

    g = _gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g)) / 16
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev), gate.to(dev), h0.to(dev)]


def _gdn_case(dtype, dev, seed=0, B=2, T=300, H=4, K=64, V=64):
    import torch
    import torch.nn.functional as F

    g = _gen(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g)
    return [q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev), gate.to(dev), beta.to(dev), h0.to(dev)]


def _ssd_case(dtype, dev, seed=0, B=2, T=300, H=4, P=64, G=1, N=64):
    import torch

    g = _gen(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = torch.randn(B, T, H, generator=g)
    A = -torch.exp(torch.rand(H, generator=g) * 2.0)
    Bm, Cm = torch.randn(B, T, G, N, generator=g), torch.randn(B, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    h0 = torch.randn(B, H, P, N, generator=g)
    return [x.to(dtype).to(dev), dt.to(dev), A.to(dev), Bm.to(dtype).to(dev), Cm.to(dtype).to(dev),
            D.to(dev), dt_bias.to(dev), h0.to(dev)]


#: Decode segments of the GLA / GDN lines: a 20-token prefill, ten 1-token steps, then a 100-token chunk.
_DECODE_SEGMENTS = [(0, 20)] + [(t, t + 1) for t in range(20, 30)] + [(30, 130)]


def _segments(fn, seqs: list, state, segments) -> tuple:
    """``fn(*[s[:, a:b] for s in seqs], state) -> (out, state)`` over ``segments`` (no_grad), the state carried;
    returns (outputs concatenated over time, final state)."""
    import torch

    outs = []
    with torch.no_grad():
        for a, b in segments:
            o, state = fn(*[s[:, a:b] for s in seqs], state)
            outs.append(o)
    return torch.cat(outs, 1), state


def check_gla_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """GLA ``fla`` vs ``chunk_gla_reference`` (B=2, T=300, H=4, K=V=64, initial and final state): ``fwd+bwd``
    (``chunk_gla``), or ``decode`` under no_grad (a 20-token prefill and ten 1-token steps on
    ``fused_recurrent_gla``, then a 100-token chunk, the state carried) vs one reference call."""
    import torch

    from canonlm.ops.gla import chunk_gla, chunk_gla_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("gla", "fla", dtype, device)
    q, k, v, g, h0 = _gla_case(dtype, device)
    errors: dict[str, float] = {}
    ref_fn = lambda q, k, v, g, h: chunk_gla_reference(q, k, v, g, initial_state=h, output_final_state=True)  # noqa
    fast_fn = lambda q, k, v, g, h: chunk_gla(q, k, v, g, initial_state=h, output_final_state=True,  # noqa
                                              backend="fla")
    if mode == "fwd+bwd":
        with kernel_calls(["gla"]) as ran:
            got = _fwd_bwd(fast_fn, [q, k, v, g, h0])
        ref = _fwd_bwd(ref_fn, [t.double() for t in (q, k, v, g, h0)])
        _compare(["o", "S"], ["q", "k", "v", "g", "h0"], got, ref, errors)
    else:
        with kernel_calls(["gla"]) as ran:
            o, S = _segments(fast_fn, [q, k, v, g], h0, _DECODE_SEGMENTS)
        with torch.no_grad():
            eo, eS = ref_fn(*[t[:, :130].double() for t in (q, k, v, g)], h0.double())
        errors["o"], errors["S"] = rel_err(o, eo), rel_err(S, eS)
    return judge_kernel("gla", "fla", resolved, ran, errors, kernel_tol("gla", "fla", dt), _tol_note("gla", "fla", dt))


def check_gdn_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """GDN ``fla`` vs ``chunk_gated_delta_rule_reference`` (q/k L2-normalised in the kernel, B=2, T=300, H=4,
    K=V=64, g and beta fp32 as the mixer passes them): ``fwd+bwd``, or ``decode`` (no_grad: a 20-token prefill and
    ten 1-token steps on ``fused_recurrent_gated_delta_rule``, then a 100-token chunk) vs one reference call."""
    import torch

    from canonlm.ops.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("gdn", "fla", dtype, device)
    q, k, v, g, beta, h0 = _gdn_case(dtype, device)
    errors: dict[str, float] = {}

    def ref_fn(q, k, v, g, beta, h):
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state=h, output_final_state=True)

    def fast_fn(q, k, v, g, beta, h):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h, output_final_state=True, backend="fla")

    if mode == "fwd+bwd":
        with kernel_calls(["gdn"]) as ran:
            got = _fwd_bwd(fast_fn, [q, k, v, g, beta, h0])
        ref = _fwd_bwd(ref_fn, [t.double() for t in (q, k, v, g, beta, h0)])
        _compare(["o", "S"], ["q", "k", "v", "g", "beta", "h0"], got, ref, errors)
    else:
        with kernel_calls(["gdn"]) as ran:
            o, S = _segments(fast_fn, [q, k, v, g, beta], h0, _DECODE_SEGMENTS)
        with torch.no_grad():
            eo, eS = ref_fn(*[t[:, :130].double() for t in (q, k, v, g, beta)], h0.double())
        errors["o"], errors["S"] = rel_err(o, eo), rel_err(S, eS)
    return judge_kernel("gdn", "fla", resolved, ran, errors, kernel_tol("gdn", "fla", dt), _tol_note("gdn", "fla", dt))


def check_ssd_kernel(dt: str, mode: str, device: str = "cuda") -> Verdict:
    """SSD ``mamba_ssm`` vs ``ssd_scan_reference`` (B=2, T=300, H=4, P=64, G=1, N=64, chunk 64, D, dt_bias,
    initial state): ``fwd+bwd`` (``mamba_chunk_scan_combined``), or ``decode`` (no_grad: a 20-token prefill, then
    ten 1-token steps on ``selective_state_update``) vs one reference call."""
    import torch

    from canonlm.ops.ssd import ssd_scan, ssd_scan_reference

    dtype = _dtype(dt)
    resolved = _kernel_prelude("ssd", "mamba_ssm", dtype, device)
    x, dtv, A, Bm, Cm, D, db, h0 = _ssd_case(dtype, device)
    errors: dict[str, float] = {}
    kw = dict(chunk_size=64, output_final_state=True)

    def fast_fn(x, d, B, C, h, A=A, D=D, db=db):
        return ssd_scan(x, d, A, B, C, D=D, dt_bias=db, initial_state=h, backend="mamba_ssm", **kw)

    def ref_fn(x, d, B, C, h, A=A, D=D, db=db):
        return ssd_scan_reference(x, d, A, B, C, D=D, dt_bias=db, initial_state=h, **kw)

    if mode == "fwd+bwd":
        with kernel_calls(["ssd"]) as ran:
            got = _fwd_bwd(fast_fn, [x, dtv, Bm, Cm, h0, A, D, db])
        ref = _fwd_bwd(ref_fn, [t.double() for t in (x, dtv, Bm, Cm, h0, A, D, db)])
        _compare(["y", "S"], ["x", "dt", "B", "C", "h0", "A", "D", "dt_bias"], got, ref, errors)
    else:
        T = 30
        with kernel_calls(["ssd"]) as ran:
            y, S = _segments(fast_fn, [x, dtv, Bm, Cm], h0, [(0, 20)] + [(t, t + 1) for t in range(20, T)])
        with torch.no_grad():
            ey, eS = ref_fn(*[t[:, :T].double() for t in (x, dtv, Bm, Cm)], h0.double(), A.double(), D.double(),
                            db.double())
        errors["y"], errors["S"] = rel_err(y, ey), rel_err(S, eS)
    return judge_kernel("ssd", "mamba_ssm", resolved, ran, errors, kernel_tol("ssd", "mamba_ssm", dt),
                        _tol_note("ssd", "mamba_ssm", dt))


def check_ssd_split_kernel(dt: str, device: str = "cuda") -> Verdict:
    """Mamba2's fused ``mamba_split_conv1d_scan_combined`` (conv + SSD + gated RMSNorm + out-proj) vs
    ``split_conv1d_scan_reference``, forward and backward (B=2, T=130, H=8, P=8, G=1, N=32, width 4, SiLU; every
    width a multiple of 8, as causal-conv1d's channel-last kernel needs). SKIP with the reason when
    ``canonlm.ops.ssd.fused_split_reason`` says the installed mamba-ssm / causal-conv1d pair cannot run it (the
    mixer then runs the conv and the scan separately, which the other SSD lines check)."""
    import torch

    from canonlm.ops import ssd

    dtype = _dtype(dt)
    _kernel_prelude("ssd", "split", dtype, device)
    Bsz, T, H, P, G, N, W, out = 2, 130, 8, 8, 1, 32, 4, 48
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    why = ssd.fused_split_reason(device, dtype, W, d_inner=d_inner, conv_dim=conv_dim, nheads=H)
    if why is not None:
        raise Skip(f"fused split cannot run with this mamba-ssm / causal-conv1d: {_short(why, 200)}")
    fused = ssd.use_fused_split("auto", device, dtype, W, d_inner, conv_dim, H)
    resolved = "split" if fused else "separate conv + scan"
    g = _gen(42)
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
    with kernel_calls(["ssd"]) as ran:
        got = _fwd_bwd(run(ssd.split_conv1d_scan_combined), [t.to(device) for t in leaves])
    ref = _fwd_bwd(run(ssd.split_conv1d_scan_reference), [t.double().to(device) for t in leaves])
    errors: dict[str, float] = {}
    _compare(["out"], ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D", "norm_w", "out_w"], got, ref, errors)
    return judge_kernel("ssd", "split", resolved, ran, errors, kernel_tol("ssd", "split", dt),
                        _tol_note("ssd", "split", dt))


def kernel_checks(device: str = "cuda", dtypes: Iterable[str] = ("fp32", "bf16")
                  ) -> list[tuple[str, str, str, Callable[[], Verdict]]]:
    """Every kernel line as ``(name, op, fast backend, fn)`` for ``device`` (names are known without running)."""
    out: list = []
    for dt in dtypes:
        for fast in ("dao", "fla"):
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel canon/{fast} {dt} {mode}", "canon", fast,
                            functools.partial(check_canon_kernel, fast, dt, mode, device)))
        for fast in ("sdpa", "flash"):
            if fast == "flash" and dt == "fp32":
                continue
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel attention/{fast} {dt} {mode}", "attention", fast,
                            functools.partial(check_attention_kernel, fast, dt, mode, device)))
        for op, fast, fn in (("gla", "fla", check_gla_kernel), ("gdn", "fla", check_gdn_kernel),
                             ("ssd", "mamba_ssm", check_ssd_kernel)):
            for mode in ("fwd+bwd", "decode"):
                out.append((f"kernel {op}/{fast} {dt} {mode}", op, fast, functools.partial(fn, dt, mode, device)))
        out.append((f"kernel ssd/mamba_ssm fused split {dt} fwd+bwd", "ssd", "split",
                    functools.partial(check_ssd_split_kernel, dt, device)))
    return out


def run_kernel_checks(device: str = "cuda", dtypes: Iterable[str] = ("fp32", "bf16"),
                      ops: Optional[Iterable[str]] = None) -> list[Result]:
    """Run the kernel lines (fast kernel vs float64 reference) on ``device``, nothing else.

    Args:
        device: where the tensors live (``"cuda"``; another device runs the lines whose fast backends resolve there,
            the others SKIP with the reason).
        dtypes: ``"fp32"`` and/or ``"bf16"``.
        ops: only these ops (``canon``, ``attention``, ``gla``, ``gdn``, ``ssd``); None: all.
    Returns:
        One :class:`Result` per line, in the report's order: ``status`` PASS / FAIL / SKIP, ``detail``, ``seconds``,
        ``op`` / ``backend`` under test, ``ran`` (``{op: {backend: calls}}`` observed by :func:`kernel_calls`),
        ``errors`` (``{tensor: max |fast - ref| / max |ref|}``) and ``tol``. Never raises for a failing check.
    """
    keep = None if ops is None else set(ops)
    results = []
    for name, op, fast, fn in kernel_checks(device, dtypes):
        if keep is None or op in keep:
            r = run_check(name, fn)
            results.append(dataclasses.replace(r, op=op, backend=fast))
    return results


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
    """``CanonLM.place(device, dtype)``: the concrete ``{op: backend}`` the model was placed with (for the report)."""
    import torch

    return dict(model.place(torch.device(device), dtype))


def _expected_fast(arch: str, dtype, device: str = "cuda") -> dict:
    """``{op: fast backend(s)}`` a model of ``arch`` on ``device`` must run; raises Skip / Fail when a library is
    missing or broken (the mixer op). Canon: the installed Canon kernels among ``dao`` / ``fla`` (the model resolves
    each Canon layer by its shape, Dao's kernel first), left out when neither is installed (plain torch is then
    right). Mamba2's fused path is added per model by :func:`_with_split`."""
    op = MIXER_OP[arch]
    want = {}
    if op == "attention":
        want[op] = "sdpa"
    else:
        fast = "mamba_ssm" if op == "ssd" else "fla"
        bad = _fast_unavailable(op, fast, device, dtype)
        if bad is not None:
            if bad[0] == FAIL:
                raise Fail(bad[1])
            raise Skip(f"{op}: {bad[1]}")
        want[op] = fast
    canon = []
    for c in ("dao", "fla"):
        bad = _fast_unavailable("canon", c, device, dtype)
        if bad is None:
            canon.append(c)
        elif bad[0] == FAIL:
            raise Fail(f"canon {c}: {bad[1]}")
    if canon:
        want["canon"] = tuple(canon)
    return want


def _fused_split_reason(model, device, dtype) -> Optional[str]:
    """:func:`canonlm.ops.ssd.fused_split_reason` for the Mamba2 mixer of ``model`` (a CanonLM) on (device, compute
    dtype), with the shape arguments the mixer passes to ``use_fused_split``: None when the fused
    ``mamba_split_conv1d_scan_combined`` path can run there. ``"not a Mamba2 model"`` for the other architectures."""
    from canonlm.arch.mixers.mamba2 import Mamba2Mixer
    from canonlm.ops import ssd

    mixer = model.blocks[0].attn
    if not isinstance(mixer, Mamba2Mixer):
        return "not a Mamba2 model"
    return ssd.fused_split_reason(device, dtype, mixer.conv_kernel, d_inner=mixer.d_inner, conv_dim=mixer.conv_dim,
                                  nheads=mixer.n_heads)


def _with_split(want: dict, split_reason: Optional[str]) -> dict:
    """``want`` with SSD's ``mamba_ssm`` replaced by the fused ``split`` when ``split_reason`` is None (the fused path
    can run for the model's shape and dtype, so a forward without a decode cache must take it)."""
    if want.get("ssd") == "mamba_ssm" and split_reason is None:
        return {**want, "ssd": "split"}
    return want


def _required_ops(arch: str, canon: str) -> tuple[str, ...]:
    """Ops a forward of a model of ``arch`` with Canon set ``canon`` must call: its mixer op, and Canon when the set
    has a Canon layer (A/B/C/D). A mixer's own conv (``b``) may be fused into Mamba2's split kernel."""
    return (MIXER_OP[arch],) + (("canon",) if any(c in canon for c in "ABCD") else ())


def _judge_model(phases: dict, required, errors: dict, tol: float, placed: dict) -> Verdict:
    """Verdict of a model line: ``phases`` = ``{label: (want, ran)}`` (FAIL when a phase ran anything but its
    wanted fast backends, :func:`judge_ran`), then the errors against ``tol``."""
    runs = "; ".join(f"{label} ran {_fmt_ran(ran)}" for label, (_, ran) in phases.items())
    bad = [f"{label}: {b}" for label, (w, ran) in phases.items() if (b := judge_ran(w, ran, required))]
    facts = dict(ran={label: ran for label, (_, ran) in phases.items()}, errors=errors, tol=tol)
    if bad:
        return Verdict(FAIL, f"{'; '.join(bad)}: the fast path did not run ({runs}; placed {_fmt_backends(placed)})",
                       **facts)
    status, detail = judge_errors(errors, tol)
    return Verdict(status, f"{runs}; {detail}", **facts)


def _fmt_backends(b: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(b.items()))


def check_model_fast_vs_reference(arch: str, device: str = "cuda", size: str = "2L256D") -> Verdict:
    """A ``size`` (2L256D) model of ``arch`` (Canon-ABCD / AbCD) on its fast paths vs the same weights with
    ``ops=reference``, under bf16 autocast: logits (max rel err) and all parameter gradients (relative L2 norm) of a
    logsumexp loss, T = 300. The fast model's forward and backward must call only the fast kernels
    (:func:`kernel_calls`; Mamba2: the fused split kernel wherever it can run)."""
    import torch

    _need_cuda(device)
    dtype = torch.bfloat16
    want = _expected_fast(arch, dtype, device)
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    fast = _build(arch, canon, size).to(device)
    ref = _build(arch, canon, size, ops="reference").to(device)
    ref.load_state_dict(fast.state_dict())
    placed = _place(fast, device, dtype)
    _place(ref, device, dtype)
    want = _with_split(want, _fused_split_reason(fast, device, dtype))
    ids = torch.randint(0, 64, (2, 300), generator=_gen(1)).to(device)

    def fwd_bwd(m):
        with torch.autocast(torch.device(device).type, dtype=dtype):
            logits = m(ids)
        logits.float().logsumexp(-1).mean().backward()
        return logits.float(), torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])

    with kernel_calls(["canon", MIXER_OP[arch]]) as ran:
        lf, gf = fwd_bwd(fast)
    lr, gr = fwd_bwd(ref)
    gerr = ((gf - gr).norm() / gr.norm().clamp_min(1e-30)).item()
    return _judge_model({"fwd+bwd": (want, ran)}, _required_ops(arch, canon),
                        {"logits": rel_err(lf, lr), "grads(L2)": gerr}, BF16_TOL, placed)


def check_model_decode(arch: str, device: str = "cuda", size: str = "2L256D", fast: bool = True) -> Verdict:
    """Cached decoding (17-token prefill, then 23 one-token steps) against one full forward, fp32, no autocast,
    for ``arch`` with Canon-ABCD / AbCD on ``device``.

    ``fast``: the fast kernels must be the ones called (:func:`_expected_fast`; the full forward of Mamba2 must take
    the fused split kernel where it can run, the cached one runs the scan and state-update kernels); tolerance
    :func:`fp32_tol` (1e-3 / 1e-2 under TF32) for the ``tl.dot`` mixers, 1e-3 for llama. Without ``fast`` (the CPU
    line) the calls are only reported and the tolerance is 1e-4."""
    import torch

    dtype = torch.float32
    want: dict = {}
    if fast:
        _need_cuda(device)
        want = _expected_fast(arch, dtype, device)
    canon = CANON_SETS[arch][1]
    torch.manual_seed(0)
    m = _build(arch, canon, size).to(device)
    placed = _place(m, device, dtype)
    m.eval()
    ids = torch.randint(0, 64, (3, 40), generator=_gen(2)).to(device)
    ops = ["canon", MIXER_OP[arch]]
    with torch.no_grad():
        with kernel_calls(ops) as ran_full:
            full = m(ids)
        cache = m.new_cache()
        with kernel_calls(ops) as ran_cached:
            parts = [m(ids[:, :17], cache)] + [m(ids[:, t:t + 1], cache) for t in range(17, 40)]
    tl_dot = (MIXER_OP[arch], want.get(MIXER_OP[arch])) in TL_DOT_BACKENDS
    tol = (fp32_tol(1e-3, 1e-2) if tl_dot else 1e-3) if want else 1e-4
    phases = {"full": (_with_split(want, _fused_split_reason(m, device, dtype)), ran_full),
              "cached": (want, ran_cached)}
    v = _judge_model(phases, _required_ops(arch, canon) if want else (),
                     {"logits": rel_err(torch.cat(parts, 1), full)}, tol, placed)
    if tl_dot:
        v.detail += f"; fp32 tl.dot: {triton_fp32_precision()}"
    return v


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


def check_cpu_canon_native(dt: str) -> Verdict:
    """The native CPU Canon kernel (``auto`` on CPU must pick ``cpu``, and it must be the one called) vs
    ``causal_conv1d_reference`` in float64, forward and backward, Canon layer and short conv (B=2, T=64, C=48, K=4,
    bias, initial state)."""
    from canonlm.ops.canon import available_backends, causal_conv1d, causal_conv1d_reference

    dtype = _dtype(dt)
    why = available_backends("cpu", dtype)["cpu"]
    if why is not None:
        raise Skip(f"native kernel unavailable: {why}")
    resolved = _resolve("canon", "auto", "cpu", dtype)
    x, w, b, h0 = _canon_case(dtype, "cpu", B=2, T=64, C=48, K=4)
    errors: dict[str, float] = {}

    def conv(fn, residual, act):
        return lambda x, w, b, h: (fn(x, w, b, residual=residual, activation=act, initial_state=h),)

    with kernel_calls(["canon"]) as ran:
        got = {tag: _fwd_bwd(conv(functools.partial(causal_conv1d, backend="cpu"), *ra), [x, w, b, h0])
               for tag, ra in _CANON_KINDS.items()}
    for tag, ra in _CANON_KINDS.items():
        ref = _fwd_bwd(conv(causal_conv1d_reference, *ra), [t.double() for t in (x, w, b, h0)])
        _compare(["y"], ["x", "w", "b", "init"], got[tag], ref, errors, tag)
    return judge_kernel("canon", "cpu", resolved, ran, errors, 1e-5 if dt == "fp32" else 2e-2)


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
    return judge_errors(errors, 1e-12)


def check_cpu_attention() -> Verdict:
    """SDPA (``auto`` on CPU, and the function called) vs ``attention_reference`` (float64), fp32, GQA 4 / 2 heads,
    T = 64, forward and backward, plus decode (1 and 5 queries against the 64-key cache)."""
    import torch

    from canonlm.ops.attention import attention, attention_reference

    resolved = _resolve("attention", "auto", "cpu", torch.float32)
    g = _gen(5)
    q = torch.randn(2, 64, 4, 32, generator=g)
    k, v = torch.randn(2, 64, 2, 32, generator=g), torch.randn(2, 64, 2, 32, generator=g)
    errors: dict[str, float] = {}
    with kernel_calls(["attention"]) as ran:
        got = _fwd_bwd(lambda q, k, v: (attention(q, k, v, backend="sdpa"),), [q, k, v])
        with torch.no_grad():
            steps = {T: attention(q[:, -T:], k, v, backend="sdpa") for T in (1, 5)}
    ref = _fwd_bwd(lambda q, k, v: (attention_reference(q, k, v),), [q.double(), k.double(), v.double()])
    _compare(["o"], ["q", "k", "v"], got, ref, errors)
    with torch.no_grad():
        for T, o in steps.items():
            errors[f"o_decode_T{T}"] = rel_err(o, attention_reference(q[:, -T:].double(), k.double(), v.double()))
    return judge_kernel("attention", "sdpa", resolved, ran, errors, 1e-4)


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
    return judge_errors(errors, 1e-10)


# ----------------------------------------------------------------------------------------------------------------
# training runs (train.py in a subprocess)
# ----------------------------------------------------------------------------------------------------------------

def train_probe(out: str):
    """Lightning callback for the self-check's training runs (instantiated by Hydra from
    ``+callbacks.selfcheck._target_=canonlm.selfcheck.train_probe``). From the start of training it counts the calls
    of every sequence op's backends (:func:`kernel_calls`; a missing entry point fails the run); at its end, rank 0
    writes ``out`` (JSON) with the steps done, world size, the backends the model was placed with, ``ran``
    (``{op: {backend: calls}}``), for Mamba2 ``fused_split_reason`` (None: the fused split kernel can run for this
    model, :func:`_fused_split_reason`), and the peak memory in GiB (CUDA: ``max_memory_allocated``; CPU: peak RSS)."""
    import lightning.pytorch as L

    class _Probe(L.Callback):
        def __init__(self):
            self._calls = contextlib.ExitStack()
            self._ran: dict = {}

        def on_train_start(self, trainer, pl_module):  # noqa: D401
            self._ran = self._calls.enter_context(kernel_calls(set(MIXER_OP.values()) | {"canon"}))

        def teardown(self, trainer, pl_module, stage):  # noqa: D401
            self._calls.close()

        def on_train_end(self, trainer, pl_module):  # noqa: D401
            self._calls.close()
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
                    "placed": None if placed is None else [str(placed[0]), str(placed[1])], "ran": self._ran}
            if model.cfg.arch == "mamba2" and placed is not None:
                info["fused_split_reason"] = _fused_split_reason(model, *placed)
            from canonlm.utils.io import atomic_write_text

            atomic_write_text(out, json.dumps(info))

    return _Probe()


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
            world_size, backends the model was placed with, ``ran`` = ``{op: {backend: calls}}`` observed during
            training, ``fused_split_reason`` for Mamba2, peak memory). want: ``{op: fast backend}`` that must have
            run (None: no requirement, e.g. on the CPU); Mamba2's ``mamba_ssm`` becomes the fused ``split`` when
            ``fused_split_reason`` is None.
    Returns:
        ``(PASS | FAIL, detail)``: FAIL when fewer steps ran than asked, a loss is missing or not finite, the world
        size differs, or (with ``want``) the calls were not recorded, an op ran anything but its wanted fast backend
        (a reference fallback, or Mamba2's unfused path where the fused one can run), or a required op
        (:func:`_required_ops`) did not run. The detail gives tokens/s (median of the ``perf/tokens_per_s`` rows
        after the first), peak memory (GiB; the larger of the ``perf/peak_mem_gb`` rows and the probe), MFU (median
        ``perf/mfu``), the first and last loss, the placed backends and the calls.
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
    ran = info.get("ran")
    parts = [f"tokens/s {tok_s:,.0f}" if tok_s else "tokens/s n/a (no perf/tokens_per_s rows)",
             f"peak mem {max(mem):.2f} GiB" if mem else "peak mem n/a",
             f"MFU {100 * _median(mfu[1:] or mfu):.1f}%" if mfu else
             ("MFU n/a (GPU not in the peak-FLOPs table)" if spec.device == "cuda" else "MFU n/a (CPU)"),
             f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", f"ops {_fmt_backends(backends)}" if backends else "ops ?",
             f"ran {_fmt_ran(ran)}" if ran is not None else "ran ? (not recorded)"]
    detail = "; ".join(parts)
    if want:
        if ran is None:
            return FAIL, f"the probe recorded no kernel calls; {detail}"
        split = info.get("fused_split_reason", "not recorded")
        bad = judge_ran(_with_split(want, split), ran, _required_ops(spec.arch, spec.canon))
        if bad:
            return FAIL, f"{bad}; {detail}"
    return PASS, detail


# ----------------------------------------------------------------------------------------------------------------
# the check lists
# ----------------------------------------------------------------------------------------------------------------

def gpu_checks(args, workdir: Path) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    """Every GPU check as ``(name, fn)`` (names are known without CUDA, so they can be listed as SKIP)."""
    dts = ["bf16"] if args.quick else ["fp32", "bf16"]
    out: list = [(name, fn) for name, _, _, fn in kernel_checks("cuda", dts)]
    for arch in PRESETS:
        if not args.quick:
            out.append((f"model {arch} fast vs reference (cuda, bf16)",
                        functools.partial(check_model_fast_vs_reference, arch)))
        out.append((f"model {arch} decode == full forward (cuda, fp32)", functools.partial(check_model_decode, arch)))
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
    _need_cuda("cuda")
    return run_training(spec, workdir)


def _fsdp2(arch: str, canon: str, label: str, args, workdir: Path) -> tuple[str, str]:
    import torch

    _need_cuda("cuda")
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
                    functools.partial(check_model_decode, arch, "cpu", "2L64D", fast=False)))
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
              "inputs (dX = gradient of a random projection w.r.t. X). \"ran op=backend:n\" counts the calls of each "
              "backend's entry point during the check; a kernel, model or training line passes only if the fast "
              "kernels were the ones called.", ""]
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
              "fp32 precision of Triton tl.dot": precision_note(),
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
