"""CUDA fast paths for the Mamba2 SSD scan: the mamba-ssm Triton kernels (``mamba_ssm.ops.triton``).

mamba-ssm is optional at run time and imported here lazily (inside functions, only for CUDA tensors), never when
canonlm is imported. Its Triton modules are reached by :func:`import_triton_module`: ``mamba_ssm/__init__.py``
imports the compiled Mamba-1 scan ``selective_scan_cuda`` unguarded (mamba-ssm 2.3.1,
``ops/selective_scan_interface.py`` line 20), so a mamba-ssm built without its CUDA extension
(``MAMBA_SKIP_CUDA_BUILD=TRUE``, as ``scripts/wheelhouse.sh`` builds it on a node without nvcc) fails ``import
mamba_ssm`` although the SSD kernels canonlm calls are pure Triton; the loader then imports them with the package's
``__init__`` skipped and says so (:func:`package_problem`). Shapes follow :func:`canonlm.ops.ssd.ssd_scan`: x (B, T, H, P), dt (B, T, H),
A (H,), B/C (B, T, G, N), D (H,) or (H, P), dt_bias (H,), state (B, H, P, N).

* prefill / training: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size,
  D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
  dt_limit=(0, inf), return_final_states=False, ...)`` -> out (B, T, H, P) [, final_states (B, H, P, N)];
  differentiable (its own autograd.Function). Time step: ``clamp(softplus(dt + dt_bias), *dt_limit)`` (the clamp is
  always applied, also with the default (0, inf)) -- the same Δ as the reference.
* decode (one token, no autograd): ``mamba_ssm.ops.triton.selective_state_update.selective_state_update(state
  (B, H, P, N), x (B, H, P), dt (B, H, P), A (H, P, N), B (B, G, N), C (B, G, N), D (H, P), z=None, dt_bias (H, P),
  dt_softplus)`` updates ``state`` in place and returns (B, H, P). The per-head scalars are passed as stride-0
  expansions (A over (P, N), dt/dt_bias/D over P), which the kernel detects ("tie_hdim") and reads once per head.
  The kernel has no ``dt_limit`` and, in some releases, a softplus without the overflow threshold, so Δ is computed
  here in float32 (softplus, clamp) and passed as ``dt`` with a zero ``dt_bias`` and ``dt_softplus=False``.
* fused mixer: ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight (C, W), conv1d_bias, dt_bias, A, D,
  chunk_size, initial_states=None, seq_idx=None, dt_limit, return_final_states=False, activation, rmsnorm_weight,
  rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate)``. It runs the causal-conv1d C++ op
  on the xBC slice of zxbcdt, and which entry point it calls depends on the mamba-ssm release
  (``mamba_ssm/ops/triton/ssd_combined.py``, module-level ``try: ... except ImportError`` that leaves ``None``):

  - mamba-ssm 2.2.0 - 2.2.4: ``import causal_conv1d_cuda``; ``causal_conv1d_cuda.causal_conv1d_fwd(x, weight, bias,
    seq_idx, None, None, silu)`` (7 arguments) and ``causal_conv1d_bwd(...)`` (10). causal-conv1d <= 1.5.0.post8
    has exactly these; from 1.5.1 the C++ ops take a preallocated ``out`` (fwd: 8 arguments, bwd: 12,
    ``csrc/causal_conv1d.cpp``), so this pair fails with a pybind TypeError in the first forward.
  - mamba-ssm >= 2.2.5: ``from causal_conv1d.cpp_functions import causal_conv1d_fwd_function,
    causal_conv1d_bwd_function, causal_conv1d_update_function`` (7 / 10 arguments). ``cpp_functions`` exists from
    causal-conv1d 1.5.1; with 1.5.0.x the import fails, the names stay ``None`` and the first forward fails with
    "'NoneType' object is not callable".

  :func:`split_function` therefore checks the names the installed ssd_combined really calls, and their arity, before
  the fused path is chosen (:func:`causal_conv1d_compat_reason`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.ops._dispatch import probe

PACKAGE = "mamba_ssm"
#: Why ``import mamba_ssm`` failed in this process (its ``__init__``), or None: set by :func:`import_triton_module`.
_package_error: list[Optional[str]] = [None]


def package_problem() -> Optional[str]:
    """Why ``import mamba_ssm`` (the package's ``__init__``) failed in this process when :func:`import_triton_module`
    had to skip it (e.g. ``"ModuleNotFoundError: No module named 'selective_scan_cuda'"``: installed without its CUDA
    extension), or None (it imported, or was not tried yet)."""
    return _package_error[0]


def import_triton_module(name: str):
    """Import ``name``, a module of mamba-ssm's pure-Triton ops (``mamba_ssm.ops.triton.<module>``).

    The package is imported first, the normal way. When its own ``__init__`` raises -- mamba-ssm 2.x's imports the
    compiled Mamba-1 extension ``selective_scan_cuda`` and the Mamba / Mamba2 modules, which fail on an install built
    without CUDA (``MAMBA_SKIP_CUDA_BUILD``) or against another torch -- the package is registered in ``sys.modules``
    without running its ``__init__`` (a module made from its import spec: the package path, nothing executed; the
    half-imported submodules of the failed attempt are dropped first), and ``name`` is imported below it; the Triton
    modules import only ``mamba_ssm.ops.triton.*`` and ``mamba_ssm.utils.*``. The reason is kept
    (:func:`package_problem`) and reported with the backend choice. Afterwards ``import mamba_ssm`` in this process
    gives that bare package (its top-level names -- ``Mamba2``, ``selective_scan_fn`` -- were not importable anyway).

    Raises:
        ImportError: mamba-ssm is not installed; or (what the module raises) ``name`` itself fails to import, with
        the package ``__init__``'s failure named when it was skipped.
    """
    if PACKAGE not in sys.modules:
        try:
            importlib.import_module(PACKAGE)
        except Exception as e:  # ImportError, OSError (undefined symbol): what the __init__ raises
            spec = importlib.util.find_spec(PACKAGE)
            if spec is None or not spec.submodule_search_locations:
                raise
            for key in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
                del sys.modules[key]  # half-imported leftovers of the failed __init__
            sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)
            _package_error[0] = f"{type(e).__name__}: {e}"
    try:
        return importlib.import_module(name)
    except Exception as e:  # re-raised unless the package's own import failed first
        if _package_error[0] is None:
            raise
        raise ImportError(
            f"{name} does not import even without the {PACKAGE} package __init__ "
            f"({type(e).__name__}: {e}); the package __init__ failed with {_package_error[0]}"
        ) from e


def _load_chunk():
    mod = import_triton_module("mamba_ssm.ops.triton.ssd_combined")
    return mod.mamba_chunk_scan_combined


def _load_state_update():
    mod = import_triton_module("mamba_ssm.ops.triton.selective_state_update")
    return mod.selective_state_update


def positional_arities(fn) -> Optional[set]:
    """The numbers of positional arguments ``fn`` accepts, or None when they cannot be read.

    Python functions: from :func:`inspect.signature` (``{n}`` up to the optional ones; ``*args`` gives None = any).
    pybind11 functions (the causal-conv1d C++ ops; ``inspect.signature`` raises on them): from the signature line
    pybind11 writes into ``__doc__``, ``name(arg0: torch.Tensor, arg1: ..., argN: bool) -> ...`` (one line per
    overload)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        lo = hi = 0
        for p in sig.parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                return None
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                hi += 1
                if p.default is p.empty:
                    lo += 1
        return set(range(lo, hi + 1))
    name = getattr(fn, "__name__", None)
    doc = getattr(fn, "__doc__", None) or ""
    out = set()
    for line in doc.splitlines():
        line = line.strip()
        if line[:1].isdigit() and ". " in line:  # pybind11 overloads: "1. name(...) -> ..."
            line = line.split(". ", 1)[1]
        if not name or not line.startswith(name + "("):
            continue
        depth, args, cur = 0, 0, ""
        for ch in line[len(name) + 1 :]:
            if ch == ")" and depth == 0:
                break
            if ch in "[(":
                depth += 1
            elif ch in "])":
                depth -= 1
            if ch == "," and depth == 0:
                args, cur = args + 1, ""
            else:
                cur += ch
        out.add(args + (1 if cur.strip() else 0))
    return out or None


# What mamba_split_conv1d_scan_combined passes to the causal-conv1d ops (forward, backward), by mamba-ssm release.
_CONV_CALL_ARGS = (7, 10)


def _installed_causal_conv1d() -> str:
    """``causal_conv1d <version>`` or why it does not import (for messages)."""
    try:
        mod = importlib.import_module("causal_conv1d")
    except Exception as e:  # noqa: BLE001 -- ImportError or an ABI mismatch (OSError): reported in the backend line
        return f"causal_conv1d not importable ({type(e).__name__}: {e})"
    return f"causal_conv1d {getattr(mod, '__version__', '(unknown version)')}"


def causal_conv1d_compat_reason(mod) -> Optional[str]:
    """None when the causal-conv1d entry points that ``mod`` (an imported ``mamba_ssm.ops.triton.ssd_combined``)
    calls from ``mamba_split_conv1d_scan_combined`` exist and take the arguments it passes; else why not.

    Reads the module globals ssd_combined binds at import: ``causal_conv1d_fwd_function`` /
    ``causal_conv1d_bwd_function`` (mamba-ssm >= 2.2.5, from ``causal_conv1d.cpp_functions``, causal-conv1d >= 1.5.1)
    or ``causal_conv1d_cuda`` (mamba-ssm 2.2.0 - 2.2.4, whose ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` must take
    7 / 10 arguments, i.e. causal-conv1d <= 1.5.0.post8)."""
    g = vars(mod)
    want_f, want_b = _CONV_CALL_ARGS
    if "causal_conv1d_fwd_function" in g:  # mamba-ssm >= 2.2.5
        fwd, bwd = g.get("causal_conv1d_fwd_function"), g.get("causal_conv1d_bwd_function")
        if fwd is None or bwd is None:
            try:
                importlib.import_module("causal_conv1d.cpp_functions")
                why = "it did not import when mamba_ssm was imported"
            except Exception as e:  # noqa: BLE001 -- ImportError or an ABI mismatch (OSError): reported in the backend line
                why = f"{type(e).__name__}: {e}"
            return (
                f"mamba_ssm's fused Mamba2 path calls causal_conv1d.cpp_functions (mamba-ssm >= 2.2.5), which is "
                f"unavailable ({why}; installed: {_installed_causal_conv1d()}; cpp_functions exists from "
                f"causal-conv1d 1.5.1)"
            )
        for fn, want, what in (
            (fwd, want_f, "causal_conv1d_fwd_function"),
            (bwd, want_b, "causal_conv1d_bwd_function"),
        ):
            ar = positional_arities(fn)
            if ar is not None and want not in ar:
                return (
                    f"mamba_ssm calls causal_conv1d.cpp_functions.{what} with {want} arguments; the installed "
                    f"one takes {sorted(ar)} ({_installed_causal_conv1d()})"
                )
        return None
    if "causal_conv1d_cuda" in g:  # mamba-ssm 2.2.0 - 2.2.4
        ext = g.get("causal_conv1d_cuda")
        if ext is None:
            return (
                f"mamba_ssm's fused Mamba2 path calls the causal_conv1d_cuda extension, which did not import "
                f"({_installed_causal_conv1d()})"
            )
        for name, want in (("causal_conv1d_fwd", want_f), ("causal_conv1d_bwd", want_b)):
            fn = getattr(ext, name, None)
            if fn is None:
                return f"causal_conv1d_cuda has no {name} ({_installed_causal_conv1d()})"
            ar = positional_arities(fn)
            if ar is not None and want not in ar:
                return (
                    f"mamba_ssm (<= 2.2.4) calls causal_conv1d_cuda.{name} with {want} arguments, the installed "
                    f"C++ op takes {sorted(ar)} (causal-conv1d >= 1.5.1 added an `out` argument; "
                    f"{_installed_causal_conv1d()}); install mamba-ssm >= 2.2.5 (or causal-conv1d < 1.5.1)"
                )
        return None
    return (
        "mamba_ssm.ops.triton.ssd_combined binds neither causal_conv1d_fwd_function nor causal_conv1d_cuda "
        "(an unknown mamba-ssm layout)"
    )


def has_stride_fix(mod) -> bool:
    """True when ``mod`` (ssd_combined) copies xBC when its row stride is not a multiple of 8 before the
    channel-last conv: ``rearrange_and_update_stride`` (mamba-ssm 2.2.5 - 2.2.6) or ``ensure_stride`` (>= 2.3.0).
    Older releases pass the strided xBC view of zxbcdt as is."""
    return callable(getattr(mod, "ensure_stride", None)) or callable(getattr(mod, "rearrange_and_update_stride", None))


def _load_split():
    mod = import_triton_module("mamba_ssm.ops.triton.ssd_combined")
    fn = mod.mamba_split_conv1d_scan_combined
    reason = causal_conv1d_compat_reason(mod)
    if reason is not None:
        raise ImportError(reason)
    return SimpleNamespace(fn=fn, stride_fix=has_stride_fix(mod))


def chunk_scan_function():
    """(mamba_chunk_scan_combined or None, import error message or None)."""
    return probe("ssd.chunk", _load_chunk)


def state_update_function():
    """(selective_state_update or None, import error message or None)."""
    return probe("ssd.state_update", _load_state_update)


def split_info():
    """(namespace(fn=mamba_split_conv1d_scan_combined, stride_fix=bool) or None, reason or None).

    None with the reason when ssd_combined does not import or the causal-conv1d entry points it calls are missing or
    take other arguments (:func:`causal_conv1d_compat_reason`). Probed once per process."""
    return probe("ssd.split", _load_split)


def split_function():
    """(mamba_split_conv1d_scan_combined or None, reason or None); see :func:`split_info`."""
    info, err = split_info()
    return (None, err) if info is None else (info.fn, None)


def _need(fn_err, what: str):
    fn, err = fn_err
    if fn is None:
        raise RuntimeError(f"canonlm ssd: {what} is unavailable ({err})")
    return fn


def chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    dt_bias: Optional[Tensor],
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_state: Optional[Tensor],
    output_final_state: bool,
    seq_idx: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """SSD scan with ``mamba_chunk_scan_combined`` (differentiable). B and C are cast to x.dtype, A/D/dt_bias and the
    initial state to float32; ``seq_idx`` (B, T) int32 (document masking) is passed when given. Returns
    (y (B, T, H, P) in x.dtype, final state (B, H, P, N) float32 or None)."""
    fn = _need(chunk_scan_function(), "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined")
    out = fn(
        x.contiguous(),
        dt.contiguous(),
        A.float(),
        B.to(x.dtype).contiguous(),
        C.to(x.dtype).contiguous(),
        int(chunk_size),
        D=None if D is None else D.float(),
        dt_bias=None if dt_bias is None else dt_bias.float(),
        initial_states=None if initial_state is None else initial_state.float().contiguous(),
        seq_idx=seq_idx,
        dt_softplus=bool(dt_softplus),
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        return_final_states=bool(output_final_state),
    )
    if output_final_state:
        y, final = out
        return y.to(x.dtype), final.float()
    y = out[0] if isinstance(out, (tuple, list)) else out
    return y.to(x.dtype), None


def state_update(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    dt_bias: Optional[Tensor],
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_state: Optional[Tensor],
    output_final_state: bool,
) -> tuple[Tensor, Optional[Tensor]]:
    """One decode step (T == 1, no autograd) with ``selective_state_update`` on a float32 copy of the state.

    Args as :func:`chunk_scan` with T == 1. Returns (y (B, 1, H, P) in x.dtype, new state (B, H, P, N) float32 or
    None); ``initial_state`` is not modified.
    """
    fn = _need(state_update_function(), "mamba_ssm.ops.triton.selective_state_update.selective_state_update")
    Bsz, _, H, P = x.shape
    N = B.shape[-1]
    d = dt[:, 0].float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    d = d.clamp(float(dt_limit[0]), float(dt_limit[1]))  # (B, H) = Δ
    if initial_state is None:
        state = torch.zeros(Bsz, H, P, N, device=x.device, dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32).contiguous().clone()
    A_e = A.float()[:, None, None].expand(H, P, N)  # tie_hdim: stride 0 over (P, N)
    dt_e = d[:, :, None].expand(Bsz, H, P)  # stride 0 over P
    bias_e = torch.zeros(H, device=x.device, dtype=torch.float32)[:, None].expand(H, P)
    D_e = None if D is None else D.float().reshape(H, -1).expand(H, P)
    xt = x[:, 0].contiguous()
    y = fn(
        state,
        xt,
        dt_e,
        A_e,
        B[:, 0].to(x.dtype).contiguous(),
        C[:, 0].to(x.dtype).contiguous(),
        D=D_e,
        z=None,
        dt_bias=bias_e,
        dt_softplus=False,
    )
    return y.to(x.dtype).unsqueeze(1), (state if output_final_state else None)


def split_conv1d_scan(
    zxbcdt: Tensor,
    conv_weight: Tensor,
    conv_bias: Optional[Tensor],
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    *,
    chunk_size: int,
    activation: Optional[str],
    rmsnorm_weight: Optional[Tensor],
    rmsnorm_eps: float,
    outproj_weight: Optional[Tensor],
    headdim: int,
    ngroups: int,
    norm_before_gate: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    """Fused Mamba2 mixer core with ``mamba_split_conv1d_scan_combined`` (conv + SSD + gated RMSNorm + out-proj)."""
    fn = _need(split_function(), "mamba_ssm mamba_split_conv1d_scan_combined (needs mamba_ssm and causal_conv1d)")
    return fn(
        zxbcdt,
        conv_weight,
        conv_bias,
        dt_bias,
        A,
        D,
        int(chunk_size),
        initial_states=None,
        seq_idx=None,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        return_final_states=False,
        activation=activation,
        rmsnorm_weight=rmsnorm_weight,
        rmsnorm_eps=float(rmsnorm_eps),
        outproj_weight=outproj_weight,
        outproj_bias=None,
        headdim=int(headdim),
        ngroups=int(ngroups),
        norm_before_gate=bool(norm_before_gate),
    )
