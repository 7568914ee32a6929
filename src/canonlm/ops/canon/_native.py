"""Native CPU kernel for the Canon op: build on first use, load with ctypes, expose as ``torch.library`` custom ops.

The C source (``csrc/canon_cpu.c``) is compiled with the system C compiler (``$CC`` or ``cc``; flags
``-O3 -march=native -fopenmp -shared -fPIC``, falling back to fewer flags if those fail) into a per-user cache
directory: ``$CANONLM_CACHE``, else ``$XDG_CACHE_HOME/canonlm``, else ``~/.cache/canonlm`` (created with mode
0o700). The file name carries a hash of the source, the flags, the compiler's version line and the CPU's identity (a
``-march=native`` build from one machine is never loaded on another one sharing the cache). The build writes a temp
file, loads and checks it, then renames it into place, so concurrent processes are safe and a build that does not
load is never published. No torch C++ headers are used, so a build takes well under a second.

Trust rule (loading a shared library runs its code; :mod:`canonlm.utils.trust`, shared with the kernel cache of
:mod:`canonlm.utils.kernel_cache`): a cached ``.so`` is loaded only if

* its directory is a real directory (not a symlink) owned by this user (``os.geteuid()``) that nobody else can
  write (no group/other write bits), and
* the file is a regular file (not a symlink) owned by this user with no group/other write bits.

A configured directory that fails the rule is not used: the kernel is built in ``~/.cache/canonlm`` if that passes,
else in a fresh private ``tempfile.mkdtemp`` directory (removed at exit), and a warning names the directory and the
reason (once per process). A cached file that fails the rule in a safe directory is deleted and rebuilt, never
loaded. Parent directories are not checked.

A cached file that does not load is deleted and rebuilt once: truncated (checked against its ELF headers before
``dlopen``, which can die with SIGBUS on a cut file), corrupt (``OSError`` from the loader), missing symbols or a
stale ABI. Only if the fresh build fails too is the ``cpu`` backend unavailable, with the compiler's or loader's
message (:func:`unavailable_reason`).

OpenMP: torch's CPU wheels load ``libgomp.so.1``; the kernel links the same soname, so it shares torch's thread
pool. Each call passes ``torch.get_num_threads()`` threads.

Custom ops (so ``torch.compile(fullgraph=True)`` traces through without a graph break; ``torch.library.custom_op``):

* ``canonlm::canon_conv_fwd(x, weight, bias, initial_state, residual, activation) -> y``
* ``canonlm::canon_conv_bwd(dy, x, weight, bias, initial_state, residual, activation, need_dinit)
  -> (dx, dweight, dbias, dinitial_state)``

Kernels (``IMPL``): 0 = register-window kernel for K <= 4 on full 16-channel vectors (time walked per vector in
L2-sized sub-blocks of ``SUBBLOCK`` rows, next sub-block prefetched), remaining channels and K > 4 on the row kernel;
1 = row (ring-buffer) kernel only. Measured with bench/canon_op.py (``--rows`` compares both).

Set ``CANONLM_DISABLE_NATIVE=1`` to pretend no compiler is available (the ``cpu`` backend is then unavailable).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from canonlm.utils.trust import stat_problem, unsafe_dir_reason, unsafe_file_reason, usable_dir, user_cache_root

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
_path: Optional[Path] = None  # the cached file the loaded kernel came from
_error: Optional[str] = None
_tried = False
_warned_dirs: set[str] = set()
_private_dir: Optional[Path] = None  # mkdtemp fallback, one per process


def cache_dir() -> Path:
    """Configured directory for compiled kernels: ``$CANONLM_CACHE``, ``$XDG_CACHE_HOME/canonlm`` or
    ``~/.cache/canonlm`` (:func:`canonlm.utils.trust.user_cache_root`). The kernel is built there only if it passes the
    trust rule (see :func:`safe_cache_dir`)."""
    return user_cache_root()


# The trust rule (one rule for every canonlm cache that holds code: canonlm.utils.trust).
_stat_problem = stat_problem
_unsafe_dir_reason = unsafe_dir_reason
_safe_to_load = unsafe_file_reason
_usable_dir = usable_dir


def _warn_once(d: Path, why: str, instead: Path) -> None:
    if str(d) in _warned_dirs:
        return
    _warned_dirs.add(str(d))
    warnings.warn(
        f"canonlm: not using the native kernel cache {d}: it {why}, so a library there could have been "
        f"planted by someone else (use a directory you own that only you can write, e.g. chmod 700, or "
        f"point CANONLM_CACHE at one). Building the native Canon kernel in {instead} instead.",
        RuntimeWarning,
        stacklevel=2,
    )


def _mkdtemp_private() -> Path:
    global _private_dir
    if _private_dir is None or _unsafe_dir_reason(_private_dir) is not None:
        _private_dir = Path(tempfile.mkdtemp(prefix="canonlm-native-"))  # mode 0o700, owned by us
        atexit.register(shutil.rmtree, str(_private_dir), ignore_errors=True)
    return _private_dir


def safe_cache_dir() -> Path:
    """The directory the kernel is built in and loaded from: :func:`cache_dir` if it passes the trust rule, else
    ``~/.cache/canonlm`` if that does, else a private temp directory (warns once, naming the refused directory)."""
    configured = cache_dir()
    why = _usable_dir(configured)
    if why is None:
        return configured
    default = Path.home() / ".cache" / "canonlm"
    fallback = None
    if default != configured and _usable_dir(default) is None:
        fallback = default
    if fallback is None:
        fallback = _mkdtemp_private()
    _warn_once(configured, why, fallback)
    return fallback


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


def _toolchain() -> tuple[str, str]:
    """(compiler path, its version line). Raises RuntimeError if there is no working compiler."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"C compiler {cc} does not run: {e}") from e
    return cc, "".join(ver)


def _target_path(out_dir: Path, flags: list[str], ver: Optional[str] = None) -> Path:
    """Where the build with ``flags`` is cached in ``out_dir`` (``ver``: the compiler's version line, else asked)."""
    if ver is None:
        ver = _toolchain()[1]
    key = hashlib.sha256(
        b"\0".join([_SRC.read_bytes(), " ".join(flags).encode(), ver.encode(), _cpu_identity().encode()])
    ).hexdigest()[:20]
    return Path(out_dir) / f"canon_cpu_{key}.so"


def _dlclose(lib: ctypes.CDLL) -> None:
    try:
        import _ctypes

        close = getattr(_ctypes, "dlclose", None) or _ctypes.FreeLibrary
        close(lib._handle)
    except Exception:  # noqa: BLE001 -- best effort: a stale copy left mapped is harmless
        pass


def _elf_problem(path) -> Optional[str]:
    """Why ``path`` is not a whole ELF shared library (None: it looks whole). dlopen of a truncated ELF file can kill
    the process with SIGBUS instead of raising, so the headers, the loadable segments and the section header table
    must lie inside the file. Not checked on macOS (Mach-O)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        return None if platform.system() == "Darwin" else "is not an ELF file"
    if len(data) < 52 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return "has a truncated or invalid ELF header"
    end = "<" if data[5] == 1 else ">"
    wide = data[4] == 2
    ehdr = end + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH")
    if len(data) < 16 + struct.calcsize(ehdr):
        return "has a truncated ELF header"
    _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = struct.unpack_from(ehdr, data, 16)
    phdr = end + ("IIQQQQQQ" if wide else "IIIIIIII")
    if phnum == 0 or phentsize < struct.calcsize(phdr) or phoff + phnum * phentsize > len(data):
        return "is truncated (program headers)"
    for i in range(phnum):
        f = struct.unpack_from(phdr, data, phoff + i * phentsize)
        p_type, p_offset, p_filesz = (f[0], f[2], f[5]) if wide else (f[0], f[1], f[4])
        if p_type in (1, 2) and p_offset + p_filesz > len(data):  # PT_LOAD, PT_DYNAMIC
            return f"is truncated ({len(data)} bytes; a segment ends at {p_offset + p_filesz})"
    if shnum and shoff + shnum * shentsize > len(data):
        return f"is truncated ({len(data)} bytes; section headers end at {shoff + shnum * shentsize})"
    return None


def _open(path) -> ctypes.CDLL:
    """Check and load one build (whole ELF file, ABI version, symbols). Raises OSError / AttributeError /
    RuntimeError."""
    why = _elf_problem(path)
    if why is not None:
        raise OSError(f"{path} {why}")
    lib = ctypes.CDLL(str(path))
    try:
        abi = lib.canon_abi()
        if abi != _ABI:
            raise RuntimeError(f"stale kernel build (abi {abi} != {_ABI})")
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.canon_fwd.argtypes = [P, P, P, P, P, I64, I64, I64, I64, I, I, I, I, I64, I]
        lib.canon_fwd.restype = I
        lib.canon_bwd.argtypes = [P, P, P, P, P, P, P, P, P, I64, I64, I64, I64, I, I, I, I, I64, I]
        lib.canon_bwd.restype = I
        lib.canon_set_subblock.argtypes = [I64]
        lib.canon_set_subblock.restype = None
        lib.canon_has_openmp.restype = I
    except Exception:
        _dlclose(lib)
        raise
    return lib


def _discard(path: Path, st: Optional[os.stat_result]) -> None:
    """Delete a cached file we refuse or cannot load (only if it is still the file we looked at; best effort:
    the fresh build replaces it anyway)."""
    try:
        now = os.lstat(path)
        if st is None or (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _build_and_load(out_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """Load the cached build in ``out_dir`` or compile, load and publish a fresh one; returns (library, cached path).

    ``out_dir`` must pass the trust rule. For each flag set (best first): a cached file that passes the rule and
    loads is used; one that fails the rule or does not load is deleted and rebuilt once. A fresh build is compiled
    to a temp file, loaded from it (a unique name, so a stale copy still mapped in this process is never reused)
    and then renamed into place. Raises RuntimeError with the compiler's / loader's messages."""
    out_dir = Path(out_dir)
    why = _unsafe_dir_reason(out_dir)
    if why is not None:
        raise RuntimeError(f"refusing kernel cache directory {out_dir}: it {why}")
    cc, ver = _toolchain()
    errors = []
    for flags in _FLAG_SETS:
        target = _target_path(out_dir, flags, ver)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None:
            why = _safe_to_load(target)
            if why is None:
                try:
                    return _open(target), target
                except Exception as e:  # noqa: BLE001 -- truncated / corrupt / stale: rebuild below
                    why = f"does not load ({type(e).__name__}: {e})"
            errors.append(f"cached {target.name} {why}; rebuilding")
            _discard(target, st)
        fd, tmp = tempfile.mkstemp(prefix=".canon_cpu_", suffix=".so", dir=out_dir)  # 0o600, ours
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, "-o", tmp, str(_SRC)], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-400:]}")
                continue
            os.chmod(tmp, 0o755)  # the linker may have recreated it under a permissive umask
            why = _safe_to_load(Path(tmp))
            if why is not None:
                errors.append(f"{cc} {' '.join(flags)}: fresh build {why}")
                continue
            try:
                lib = _open(tmp)
            except Exception as e:  # noqa: BLE001 -- try the next flag set
                errors.append(f"{cc} {' '.join(flags)}: fresh build does not load ({type(e).__name__}: {e})")
                continue
            try:
                os.replace(tmp, target)  # atomic: concurrent builders all write the same bytes
            except OSError:
                return lib, Path(tmp)  # loaded and valid, just not cached
            return lib, target
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{cc} {' '.join(flags)}: {e}")
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    raise RuntimeError("could not compile the native Canon kernel: " + " | ".join(errors))


def _build() -> Path:
    """Build (or reuse) the kernel in :func:`safe_cache_dir` and return the cached file. Raises RuntimeError."""
    return _build_and_load(safe_cache_dir())[1]


def _load() -> None:
    global _lib, _path, _error, _tried
    with _lock:
        if _tried:
            return
        try:
            if os.environ.get("CANONLM_DISABLE_NATIVE", "") not in ("", "0"):
                raise RuntimeError("disabled by CANONLM_DISABLE_NATIVE")
            lib, path = _build_and_load(safe_cache_dir())
            lib.canon_set_subblock(SUBBLOCK)
            _lib, _path = lib, path
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


def canon_fwd_impl(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], residual: bool, activation: bool
) -> Tensor:
    """Run the C forward. Shapes/dtypes as in :func:`canonlm.ops.canon.causal_conv1d`; returns y (B, T, C), x.dtype."""
    if not available():
        raise RuntimeError(f"native canon kernel unavailable: {_error}")
    B, T, C = x.shape
    K = weight.shape[1]
    x, wT, b, init = _prep(x, weight, bias, initial_state)
    y = torch.empty_like(x)
    rc = _lib.canon_fwd(
        x.data_ptr(),
        y.data_ptr(),
        wT.data_ptr(),
        _ptr(b),
        _ptr(init),
        B,
        T,
        C,
        K,
        int(x.dtype == torch.bfloat16),
        int(residual),
        int(activation),
        torch.get_num_threads(),
        CHANNEL_TILE,
        IMPL,
    )
    _check_rc(rc, "fwd")
    return y


def canon_bwd_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    residual: bool,
    activation: bool,
    need_dinit: bool,
):
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
    rc = _lib.canon_bwd(
        x.data_ptr(),
        dy.data_ptr(),
        dx.data_ptr(),
        wT.data_ptr(),
        _ptr(b),
        _ptr(init),
        dwT.data_ptr(),
        db.data_ptr(),
        _ptr(dinit),
        B,
        T,
        C,
        K,
        int(x.dtype == torch.bfloat16),
        int(residual),
        int(activation),
        torch.get_num_threads(),
        CHANNEL_TILE,
        IMPL,
    )
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
def canon_conv_fwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], residual: bool, activation: bool
) -> Tensor:
    """Canon forward on the native CPU kernel. x (B, T, C) float32/bfloat16, weight (C, K), bias (C,) or None,
    initial_state (B, C, K-1) or None -> y (B, T, C) in x.dtype."""
    return canon_fwd_impl(x, weight, bias, initial_state, residual, activation)


@canon_conv_fwd.register_fake
def _(x, weight, bias, initial_state, residual, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("canonlm::canon_conv_bwd", mutates_args=(), device_types="cpu")
def canon_conv_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    residual: bool,
    activation: bool,
    need_dinit: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw if ctx.needs_input_grad[1] else None,
        db.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None,
        dinit if need_dinit else None,
        None,
        None,
    )


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


def canon_conv(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], residual: bool, activation: bool
) -> Tensor:
    """Native Canon forward with autograd: the custom op under torch.compile, an autograd.Function in eager mode.
    Shapes as in :func:`canon_conv_fwd`."""
    if torch.compiler.is_compiling():
        return canon_conv_fwd(x, weight, bias, initial_state, residual, activation)
    if not (
        torch.is_grad_enabled()
        and (
            x.requires_grad
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
            or (initial_state is not None and initial_state.requires_grad)
        )
    ):
        return canon_fwd_impl(x, weight, bias, initial_state, residual, activation)
    return _CanonFunction.apply(x, weight, bias, initial_state, residual, activation)
