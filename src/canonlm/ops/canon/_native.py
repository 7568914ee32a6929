"""Native CPU kernel for the Canon op: build on first use, load with ctypes, expose as ``torch.library`` custom ops.

The C source (``csrc/canon_cpu.c``) is compiled with the system C compiler (``$CC`` or ``cc``; flags
``-O3 -march=native -fopenmp -shared -fPIC``, falling back to fewer flags if those fail) into a per-user cache
directory: ``$CANONLM_CACHE``, else ``$XDG_CACHE_HOME/canonlm``, else ``~/.cache/canonlm``. The file name carries a
hash of the source, the flags, the compiler's version line and the CPU's identity (a ``-march=native`` build from
one machine is never loaded on another one sharing the cache). The build writes a temp file and renames it into
place, so concurrent processes are safe. No torch C++ headers are used, so a build takes well under a second.

OpenMP: torch's CPU wheels load ``libgomp.so.1``; the kernel links the same soname, so it shares torch's thread
pool. Each call passes ``torch.get_num_threads()`` threads.

Custom ops (so ``torch.compile(fullgraph=True)`` traces through without a graph break; spec models.md §1.6, P5):

* ``canonlm::canon_conv_fwd(x, weight, bias, initial_state, residual, activation) -> y``
* ``canonlm::canon_conv_bwd(dy, x, weight, bias, initial_state, residual, activation, need_dinit)
  -> (dx, dweight, dbias, dinitial_state)``

Kernels (``IMPL``): 0 = register-window kernel for K <= 4 on full 16-channel vectors (time walked per vector in
L2-sized sub-blocks of ``SUBBLOCK`` rows, next sub-block prefetched), remaining channels and K > 4 on the row kernel;
1 = row (ring-buffer) kernel only. Measured with bench/canon_op.py (``--rows`` compares both).

Set ``CANONLM_DISABLE_NATIVE=1`` to pretend no compiler is available (the ``cpu`` backend is then unavailable).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

_SRC = Path(__file__).with_name("csrc") / "canon_cpu.c"
_ABI = 4
KMAX = 64  # largest kernel size the C kernel accepts (CANON_KMAX)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Channel tile of a work unit (floats); 0 = whole rows (measured best: tiles break the row-sequential streams).
CHANNEL_TILE = int(os.environ.get("CANONLM_CANON_CTILE", "0"))
# 0: register-window kernel for K <= 4 (full 16-channel vectors), row kernel otherwise; 1: always the row (ring-buffer) kernel (tests, bench).
IMPL = 0
# Time rows per sub-block of the register-window kernel (working set of a sub-block stays in L2).
SUBBLOCK = int(os.environ.get("CANONLM_CANON_SUBBLOCK", "32"))


def set_subblock(rows: int) -> None:
    """Set the register-window kernel's time sub-block (rows); for benchmarks."""
    global SUBBLOCK
    SUBBLOCK = int(rows)
    if available():
        _lib.canon_set_subblock(SUBBLOCK)

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_tried = False


def cache_dir() -> Path:
    """Directory holding compiled kernels: ``$CANONLM_CACHE``, ``$XDG_CACHE_HOME/canonlm`` or ``~/.cache/canonlm``."""
    if os.environ.get("CANONLM_CACHE"):
        return Path(os.environ["CANONLM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "canonlm"
    return Path.home() / ".cache" / "canonlm"


def _cpu_identity() -> str:
    """Model name + feature flags of this CPU (so ``-march=native`` builds are keyed per CPU type)."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    ident.append(line.strip())
    except OSError:
        pass
    return "\n".join(ident)


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-shared", "-fPIC"],  # no OpenMP (e.g. Apple clang): single-threaded kernel
    ["-O3", "-shared", "-fPIC"],
)


def _build() -> Path:
    """Compile the kernel (or reuse the cached build). Raises RuntimeError with the compiler's message."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    src = _SRC.read_bytes()
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"C compiler {cc} does not run: {e}") from e
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), "".join(ver).encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        target = out_dir / f"canon_cpu_{key}.so"
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=".canon_cpu_", suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, "-o", tmp, str(_SRC)], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, target)  # atomic: concurrent builders all write the same bytes
                return target
            errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-400:]}")
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{cc} {' '.join(flags)}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("could not compile the native Canon kernel: " + " | ".join(errors))


def _load() -> None:
    global _lib, _error, _tried
    with _lock:
        if _tried:
            return
        try:
            if os.environ.get("CANONLM_DISABLE_NATIVE", "") not in ("", "0"):
                raise RuntimeError("disabled by CANONLM_DISABLE_NATIVE")
            lib = ctypes.CDLL(str(_build()))
            if lib.canon_abi() != _ABI:
                raise RuntimeError(f"stale kernel build (abi {lib.canon_abi()} != {_ABI})")
            P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.canon_fwd.argtypes = [P, P, P, P, P, I64, I64, I64, I64, I, I, I, I, I64, I]
            lib.canon_fwd.restype = I
            lib.canon_bwd.argtypes = [P, P, P, P, P, P, P, P, P, I64, I64, I64, I64, I, I, I, I, I64, I]
            lib.canon_bwd.restype = I
            lib.canon_set_subblock.argtypes = [I64]
            lib.canon_set_subblock.restype = None
            lib.canon_set_subblock(SUBBLOCK)
            _lib = lib
        except Exception as e:  # noqa: BLE001 -- any failure means "not available", reported verbatim
            _error = f"{type(e).__name__}: {e}"
        _tried = True


def available() -> bool:
    """True if the native kernel is compiled and loaded (builds it on the first call, ~0.5-1 s)."""
    _load()
    return _lib is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (compiler message), or None."""
    _load()
    return _error


def has_openmp() -> bool:
    """True if the loaded kernel was built with OpenMP (multi-threaded)."""
    return available() and bool(_lib.canon_has_openmp())


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _prep(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor]):
    """Contiguous channel-last x, float32 (K, C) weight, float32 bias and float32 (B, K-1, C) history."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"native canon kernel: x.dtype={x.dtype}; allowed: float32, bfloat16")
    x = x.contiguous()
    wT = weight.detach().to(torch.float32).t().contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    init = None
    if initial_state is not None and weight.shape[1] > 1:
        init = initial_state.detach().to(torch.float32).transpose(1, 2).contiguous()
    return x, wT, b, init


def _check_rc(rc: int, what: str) -> None:
    if rc == 1:
        raise MemoryError(f"native canon kernel ({what}): out of memory for scratch buffers")
    if rc != 0:
        raise ValueError(f"native canon kernel ({what}): bad sizes (rc={rc}); K must be in [1, {KMAX}]")


def canon_fwd_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                   residual: bool, activation: bool) -> Tensor:
    """Run the C forward. Shapes/dtypes as in :func:`canonlm.ops.canon.causal_conv1d`; returns y (B, T, C), x.dtype."""
    if not available():
        raise RuntimeError(f"native canon kernel unavailable: {_error}")
    B, T, C = x.shape
    K = weight.shape[1]
    x, wT, b, init = _prep(x, weight, bias, initial_state)
    y = torch.empty_like(x)
    rc = _lib.canon_fwd(x.data_ptr(), y.data_ptr(), wT.data_ptr(), _ptr(b), _ptr(init), B, T, C, K,
                        int(x.dtype == torch.bfloat16), int(residual), int(activation),
                        torch.get_num_threads(), CHANNEL_TILE, IMPL)
    _check_rc(rc, "fwd")
    return y


def canon_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                   residual: bool, activation: bool, need_dinit: bool):
    """Run the C backward; returns (dx (B,T,C) x.dtype, dweight (C,K) weight.dtype, dbias (C,) float32,
    dinitial_state (B,C,K-1) initial_state.dtype, or an empty tensor when not requested)."""
    if not available():
        raise RuntimeError(f"native canon kernel unavailable: {_error}")
    B, T, C = x.shape
    K = weight.shape[1]
    x, wT, b, init = _prep(x, weight, bias, initial_state)
    dy = dy.to(x.dtype).contiguous()
    dx = torch.empty_like(x)
    dwT = torch.empty(K, C, dtype=torch.float32)
    db = torch.empty(C, dtype=torch.float32)
    want_init = need_dinit and initial_state is not None
    dinit = torch.empty(B, max(K - 1, 0), C, dtype=torch.float32) if want_init else None
    rc = _lib.canon_bwd(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), wT.data_ptr(), _ptr(b), _ptr(init),
                        dwT.data_ptr(), db.data_ptr(), _ptr(dinit), B, T, C, K,
                        int(x.dtype == torch.bfloat16), int(residual), int(activation),
                        torch.get_num_threads(), CHANNEL_TILE, IMPL)
    _check_rc(rc, "bwd")
    dw = dwT.t().to(weight.dtype).contiguous()
    if want_init:
        dinit_out = dinit.transpose(1, 2).to(initial_state.dtype).contiguous()
    else:
        dinit_out = x.new_empty(0)
    return dx, dw, db, dinit_out


# --------------------------------------------------------------------------------------------------------------
# torch.library custom ops
# --------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("canonlm::canon_conv_fwd", mutates_args=(), device_types="cpu")
def canon_conv_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                   residual: bool, activation: bool) -> Tensor:
    """Canon forward on the native CPU kernel. x (B, T, C) float32/bfloat16, weight (C, K), bias (C,) or None,
    initial_state (B, C, K-1) or None -> y (B, T, C) in x.dtype."""
    return canon_fwd_impl(x, weight, bias, initial_state, residual, activation)


@canon_conv_fwd.register_fake
def _(x, weight, bias, initial_state, residual, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("canonlm::canon_conv_bwd", mutates_args=(), device_types="cpu")
def canon_conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                   residual: bool, activation: bool, need_dinit: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Canon backward on the native CPU kernel -> (dx, dweight, dbias float32 (C,), dinitial_state or empty)."""
    return canon_bwd_impl(dy, x, weight, bias, initial_state, residual, activation, need_dinit)


@canon_conv_bwd.register_fake
def _(dy, x, weight, bias, initial_state, residual, activation, need_dinit):
    B, T, C = x.shape
    K = weight.shape[1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = weight.new_empty(C, K)
    db = x.new_empty(C, dtype=torch.float32)
    if need_dinit and initial_state is not None:
        dinit = initial_state.new_empty(B, C, max(K - 1, 0))
    else:
        dinit = x.new_empty(0)
    return dx, dw, db, dinit


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, residual, activation = inputs
    ctx.save_for_backward(x, weight, bias, initial_state)
    ctx.residual, ctx.activation = residual, activation


def _grads(ctx, dy, bwd):
    """Shared backward of the custom op and of :class:`_CanonFunction`: ``bwd`` is the op or its eager impl."""
    x, weight, bias, initial_state = ctx.saved_tensors
    need_dinit = initial_state is not None and ctx.needs_input_grad[3]
    dx, dw, db, dinit = bwd(dy, x, weight, bias, initial_state, ctx.residual, ctx.activation, need_dinit)
    return (dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            db.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None,
            dinit if need_dinit else None,
            None, None)


def _backward(ctx, dy):
    return _grads(ctx, dy, canon_conv_bwd)


canon_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


class _CanonFunction(torch.autograd.Function):
    """Eager-mode twin of the custom op (same kernels, less dispatch overhead: ~3x lower per-call cost).
    Under torch.compile :func:`canon_conv` uses the custom op instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, residual, activation):
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.residual, ctx.activation = residual, activation
        return canon_fwd_impl(x, weight, bias, initial_state, residual, activation)

    @staticmethod
    def backward(ctx, dy):
        return _grads(ctx, dy, canon_bwd_impl)


def canon_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
               residual: bool, activation: bool) -> Tensor:
    """Native Canon forward with autograd: the custom op under torch.compile, an autograd.Function in eager mode.
    Shapes as in :func:`canon_conv_fwd`."""
    if torch.compiler.is_compiling():
        return canon_conv_fwd(x, weight, bias, initial_state, residual, activation)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad)
                                         or (initial_state is not None and initial_state.requires_grad))):
        return canon_fwd_impl(x, weight, bias, initial_state, residual, activation)
    return _CanonFunction.apply(x, weight, bias, initial_state, residual, activation)
