"""Canon op: residual causal depthwise 1-D convolution (paper eq. 4.1; Dao-AILab ``causal_conv1d``).

Public API (the model calls only these names)::

    causal_conv1d(x, weight, bias=None, *, residual=True, activation=False, backend="auto", initial_state=None,
                  docs=None)
    causal_conv1d_reference(x, weight, bias=None, *, residual=True, activation=False, initial_state=None)
    causal_conv1d_step(x_t, state, weight, bias=None, *, residual=True, activation=False, backend="auto")
    causal_conv1d_state(x, kernel_size, initial_state=None)
    fold_residual(weight)                      # weight + e_{K-1}: the residual as part of the current-token tap
    resolve_backend(name, device, dtype, channels=None, kernel=None) -> str
    available_backends(device, dtype, channels=None, kernel=None) -> dict[str, str | None]
    BACKENDS

Math, per channel c (x channel-last (B, T, C); weight (C, K); weight[:, K-1] multiplies the current token,
weight[:, 0] the token K-1 steps back)::

    y_t = [x_t +] act(b + sum_{i=0}^{K-1} weight[:, i] * x_{t-K+1+i}),   act = SiLU or identity
    history x_{<0} = 0, or initial_state (B, C, K-1) = the previous K-1 raw inputs (column K-2 = time -1).

Backends (``kernels.canon`` in the Hydra config; ``model.kernels.canon`` in errors):

* ``reference`` -- ``F.conv1d`` on a left-padded (B, C, T) view (the oracle, as ``causal_conv1d_ref``).
* ``torch``     -- shift-and-add on (B, T, C); low-precision inputs accumulate in fp32; the compile-friendly path
  (inductor fuses it with its neighbours; ``CanonLM.place(..., compiled=True)`` picks it for ``auto`` on CUDA).
* ``cpu``       -- native C kernel (``csrc/canon_cpu.c``, compiled on first use, OpenMP, fp32 and bf16 with fp32
  accumulation), exposed as the custom ops ``canonlm::canon_conv_fwd`` / ``canonlm::canon_conv_bwd``.
* ``fla``       -- fla's Triton ``causal_conv1d`` (CUDA), the residual folded into the weight.
* ``dao``       -- Dao-AILab ``causal_conv1d_fn`` on the channel-last view (CUDA; K in {2,3,4}, C % 8 == 0), the
  residual folded into the weight.
* ``auto``      -- dao, else fla on CUDA when importable; on CPU the native kernel when it builds (fp32/bf16),
  else ``torch`` (one warning if the compiler is missing).

The choice is made per Canon shape (C channels, K taps) by :func:`resolve_backend`: ``auto`` skips a kernel that
cannot take the shape, an explicitly requested one is refused with a ConfigError. ``CanonLM.place`` resolves every
Canon layer with it, and the forward / decode dispatch (:func:`causal_conv1d`, :func:`causal_conv1d_step`) applies
the same function to the tensors it gets.

All backends are differentiable w.r.t. x, weight, bias and initial_state, and return x.dtype.

Document masking (``docs``, a :class:`canonlm.ops.varlen.Documents`: several documents packed in one window): the
conv restarts at every document start, i.e. tap ``i`` (lag ``K-1-i``) reads ``x_{t-K+1+i}`` only when that token is
in t's document (``pos_t >= K-1-i``), else zero -- what running each document alone gives. Each backend keeps its
kernel and its memory:

* ``dao`` -- ``causal_conv1d_fn(x, w, b, seq_idx=docs.seq_idx)``: Dao's channel-last kernel reads a tap only when its
  token has the output token's ``seq_idx`` (causal-conv1d ``causal_conv1d_channellast_fwd_kernel`` / ``_bwd``);
* ``fla`` -- fla's ``causal_conv1d(x as (1, B·T, C), cu_seqlens=docs.cu_seqlens)``, its ``IS_VARLEN`` kernels;
* ``torch`` / ``cpu`` / ``reference`` -- the shift-and-add path, each tap's term added only where its (B, T, 1)
  mask ``pos >= lag`` holds (autograd keeps the boolean masks and the one padded input it keeps without masking, not
  a masked copy per tap).

Both kernels take the folded weight (the residual is the current-token tap, which is always in t's own document).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.errors import ConfigError
from canonlm.ops import varlen
from canonlm.ops._dispatch import assume_constant, cuda_reason, memo_table

from . import _cuda, _native
from ._fold import fold_residual

__all__ = [
    "BACKENDS",
    "available_backends",
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_state",
    "causal_conv1d_step",
    "causal_conv1d_torch",
    "fold_residual",
    "resolve_backend",
]

BACKENDS = ("auto", "reference", "torch", "cpu", "fla", "dao")
CONFIG_KEY = "model.kernels.canon"
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_warned_native = False


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------


def _validate(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor]) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(
            f"causal_conv1d: x must be a (B, T, C) tensor; got "
            f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
        )
    if not x.is_floating_point():
        raise ValueError(f"causal_conv1d: x.dtype={x.dtype}; allowed: a floating-point dtype")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(
            f"causal_conv1d: weight.shape={tuple(weight.shape)}; allowed: (C, K) with C={C} "
            f"(x's channels) and K >= 1 (an nn.Conv1d weight (C, 1, K) must be squeezed to (C, K))"
        )
    K = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv1d: bias.shape={tuple(bias.shape)}; allowed: ({C},) or None")
    if initial_state is not None and tuple(initial_state.shape) != (B, C, K - 1):
        raise ValueError(
            f"causal_conv1d: initial_state.shape={tuple(initial_state.shape)}; allowed: "
            f"(B, C, K-1) = {(B, C, K - 1)} (the previous K-1 raw inputs) or None"
        )
    for name, t in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"causal_conv1d: {name}.device={t.device}; allowed: x's device {x.device}")


# ----------------------------------------------------------------------------------------------------------------
# pure-PyTorch paths
# ----------------------------------------------------------------------------------------------------------------


def causal_conv1d_reference(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    residual: bool = True,
    activation: bool = False,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """Oracle (as Dao-AILab ``causal_conv1d_ref``): ``F.conv1d(F.pad(x, (K-1, 0)), w.unsqueeze(1), b, groups=C)``.

    Args: x (B, T, C); weight (C, K); bias (C,) or None; initial_state (B, C, K-1) or None (prepended instead of the
    zero padding). Computes in ``promote_types(x.dtype, weight.dtype)`` and returns (B, T, C) in x.dtype.
    Raises ValueError on bad shapes.
    """
    _validate(x, weight, bias, initial_state)
    C, K = weight.shape
    cd = torch.promote_types(x.dtype, weight.dtype)
    xt = x.to(cd).transpose(1, 2)
    if initial_state is not None:
        xp = torch.cat([initial_state.to(cd), xt], dim=-1)
    else:
        xp = F.pad(xt, (K - 1, 0))
    y = F.conv1d(xp, weight.to(cd).unsqueeze(1), None if bias is None else bias.to(cd), groups=C).transpose(1, 2)
    if activation:
        y = F.silu(y)
    if residual:
        y = x.to(cd) + y
    return y.to(x.dtype)


def causal_conv1d_torch(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    residual: bool = True,
    activation: bool = False,
    initial_state: Optional[Tensor] = None,
    doc_pos: Optional[Tensor] = None,
) -> Tensor:
    """Shift-and-add form: ``y = [x +] act(b + sum_i w[:, i] * x_pad[:, i:i+T])``.

    Works on (B, T, C) directly (no transpose). float16/bfloat16 inputs accumulate in float32 (plain bf16
    accumulation errs by ~6e-2). A residual without an activation is folded into the weight
    (:func:`fold_residual`). Shapes as in :func:`causal_conv1d_reference`; returns x.dtype.

    This is the compile-friendly path: plain element-wise ops that ``torch.compile`` (inductor) fuses with the
    neighbouring RMSNorm, RoPE or SiLU-gate into one kernel, forward and backward (fla's Triton kernel is a graph
    break under compile: its dispatch is wrapped in ``torch.compiler.disable``). ``CanonLM.place(...,
    compiled=True)`` therefore resolves an ``auto`` Canon request on CUDA to this backend.

    ``doc_pos`` (B, T) integer, each token's position in its document (:attr:`canonlm.ops.varlen.Documents.pos`), or
    None: with it, the term of the tap at lag ``l`` is added only where the (B, T, 1) mask ``doc_pos >= l`` holds
    (``torch.where`` between the sums with and without it; document masking, module docstring), so autograd keeps
    only the boolean masks besides what the unmasked path keeps, and a document that fills its row gives the unmasked
    path's values bit for bit; ``initial_state`` must then be None.
    """
    _validate(x, weight, bias, initial_state)
    if doc_pos is not None and (initial_state is not None or tuple(doc_pos.shape) != tuple(x.shape[:2])):
        raise ValueError(
            f"causal_conv1d: doc_pos.shape={tuple(doc_pos.shape)} with initial_state "
            f"{'given' if initial_state is not None else 'None'}; allowed: doc_pos (B, T) = "
            f"{tuple(x.shape[:2])} and no initial_state"
        )
    B, T, C = x.shape
    K = weight.shape[1]
    cd = torch.promote_types(x.dtype, weight.dtype)
    if cd in _LOW_PRECISION:
        cd = torch.float32
    xc = x.to(cd)
    w = weight.to(cd)
    if residual and not activation:
        w, residual = fold_residual(w), False
    if initial_state is not None:
        xp = torch.cat([initial_state.to(cd).transpose(1, 2), xc], dim=1)
    elif K > 1:
        xp = F.pad(xc, (0, 0, K - 1, 0))
    else:
        xp = xc
    acc = xc * w[:, K - 1]
    for i in range(K - 1):
        tap = xp[:, i : i + T]
        if doc_pos is None:
            acc = torch.addcmul(acc, tap, w[:, i])
        else:  # lag K-1-i reaches the previous document where doc_pos < K-1-i: that term is left out there
            acc = torch.where((doc_pos >= K - 1 - i).unsqueeze(-1), torch.addcmul(acc, tap, w[:, i]), acc)
    if bias is not None:
        acc = acc + bias.to(cd)
    if activation:
        acc = F.silu(acc)
    if residual:
        acc = acc + xc
    return acc.to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------------------------


def _unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype, C: Optional[int] = None, K: Optional[int] = None
) -> Optional[str]:
    """None if backend ``name`` can run on (device, dtype) for C channels and kernel size K (None: not checked), else
    why not."""
    if name in ("reference", "torch", "auto"):
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"needs CPU tensors (tensors are on {device.type})"
        if dtype not in _native.SUPPORTED_DTYPES:
            return f"supports float32 and bfloat16 (got {dtype})"
        if not _native.available():
            return f"native kernel does not build: {_native.unavailable_reason()}"
        if K is not None and K > _native.KMAX:
            return f"supports kernel size K <= {_native.KMAX} (got K={K})"
        return None
    reason = cuda_reason(device)
    if reason is not None:
        return reason
    if name == "dao":
        fns, err = _cuda.dao_functions()
        return _cuda.dao_supports_shape(C, K, dtype) if fns is not None else f"causal_conv1d is not importable ({err})"
    if name == "fla":
        fns, err = _cuda.fla_functions()
        return None if fns is not None else f"fla causal_conv1d is not importable ({err})"
    raise AssertionError(name)


def available_backends(
    device, dtype: torch.dtype = torch.float32, channels: Optional[int] = None, kernel: Optional[int] = None
) -> dict:
    """Map every concrete backend name to None (runs here) or the reason it cannot run on (device, dtype) for a Canon
    layer of ``channels`` C and ``kernel`` K taps (None: any shape; see :func:`resolve_backend`).

    Probes lazily: ``cpu`` compiles the native kernel on first use; ``dao``/``fla`` are imported only for a
    CUDA device with CUDA available.
    """
    device = torch.device(device)
    return {n: _unavailable_reason(n, device, dtype, channels, kernel) for n in BACKENDS if n != "auto"}


def resolve_backend(
    name: str, device, dtype: torch.dtype, channels: Optional[int] = None, kernel: Optional[int] = None
) -> str:
    """Concrete Canon backend for a layer of ``channels`` C and ``kernel`` K taps on ``device`` with ``dtype`` -- the
    one rule behind ``CanonLM.place`` (per Canon layer) and the forward / decode dispatch (per call).

    ``"auto"``: ``dao`` or ``fla`` on CUDA when importable and able to take the shape (dao first), else ``torch``; on
    CPU the native kernel (``cpu``) when it builds, dtype is float32/bfloat16 and K <= 64, else ``torch`` (a one-time
    warning if the compiler is missing). Any other name is returned as is when it can run here.

    Shape limits (a None size is not checked): ``dao`` needs K in {2, 3, 4} and C % 8 == 0 on float32 / float16 /
    bfloat16 (``causal_conv1d_fwd``: ``TORCH_CHECK(width >= 2 && width <= 4)``, ``TORCH_CHECK(dim % 8 == 0)`` on the
    channel-last layout, ``csrc/causal_conv1d.cpp``); ``cpu`` needs K <= 64 (``CANON_KMAX``); fla's Triton
    ``causal_conv1d`` (fla-core 0.6) and the torch paths take any shape.

    Raises:
        ConfigError("model.kernels.canon", name, allowed): unknown name, or an explicitly requested backend that
        cannot run here (library missing, no CUDA, no C compiler, unsupported dtype or shape) -- raised before any
        work; ``allowed`` lists the backends available here for this shape and why the requested one is not.
    """
    global _warned_native
    if name not in BACKENDS:
        raise ConfigError(CONFIG_KEY, name, "one of " + ", ".join(BACKENDS))
    device = torch.device(device)
    C, K = channels, kernel
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_available():
            for cand in ("dao", "fla"):
                if _unavailable_reason(cand, device, dtype, C, K) is None:
                    return cand
            return "torch"
        if device.type == "cpu" and dtype in _native.SUPPORTED_DTYPES:
            if _native.available():
                return "cpu" if K is None or K <= _native.KMAX else "torch"
            if not _warned_native:
                _warned_native = True
                warnings.warn(
                    f"canonlm: native CPU Canon kernel unavailable ({_native.unavailable_reason()}); "
                    f"using the slower 'torch' backend",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return "torch"
    reason = _unavailable_reason(name, device, dtype, C, K)
    if reason is not None:
        here = [n for n, r in available_backends(device, dtype, C, K).items() if r is None]
        shape = "".join(f", {k}={v}" for k, v in (("C", C), ("K", K)) if v is not None)
        raise ConfigError(
            CONFIG_KEY,
            name,
            f"backends available here ({device.type}, {dtype}{shape}): auto, {', '.join(here)} ['{name}' {reason}]",
        )
    return name


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------


@assume_constant
def _select(backend: str, device: str, dtype: torch.dtype, C: int, K: int) -> str:
    """``resolve_backend(backend, device, dtype, C, K)`` for the tensors of one call, memoised per argument tuple
    (successful choices only) and constant under torch.compile (no tracing into the import probes / kernel build)."""
    key = (backend, device, dtype, C, K)
    hit = _select_cache.get(key)
    if hit is None:
        hit = _select_cache[key] = resolve_backend(backend, torch.device(device), dtype, C, K)
    return hit


_select_cache: dict = memo_table()


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    residual: bool = True,
    activation: bool = False,
    backend: str = "auto",
    initial_state: Optional[Tensor] = None,
    docs: Optional[varlen.Documents] = None,
) -> Tensor:
    """Canon layer op: ``y_t = [x_t +] act(b + sum_i weight[:, i] * x_{t-K+1+i})`` (paper eq. 4.1).

    Args:
        x: (B, T, C) channel-last, floating dtype (any strides; made contiguous where a kernel needs it).
        weight: (C, K); ``weight[:, K-1]`` multiplies the current token, ``weight[:, 0]`` the token K-1 back.
        bias: (C,) or None.
        residual: add x to the output (paper default True).
        activation: SiLU after the convolution (paper default False).
        backend: one of :data:`BACKENDS`, resolved for this call's device, dtype, C and K by
            :func:`resolve_backend`: with ``"auto"``, shapes a fast path does not support (Dao: K not in {2,3,4} or
            C % 8 != 0; native: K > 64) fall back to the next backend; an explicit name that cannot take them raises.
        initial_state: (B, C, K-1) = the K-1 raw inputs before x (chunked prefill), or None for zeros.
        docs: the documents packed in x's rows (:func:`canonlm.ops.varlen.documents` of the (B, T) document ids), or
            None: document masking (module docstring) on the backend resolved for this call: ``dao`` with
            ``docs.seq_idx``, ``fla`` with ``docs.cu_seqlens`` (computed here, one device-host sync, when the
            ``Documents`` were built without it), the others on :func:`causal_conv1d_torch` with ``docs.pos``;
            no ``initial_state`` with it.

    Returns:
        (B, T, C) in x.dtype (accumulation in float32 for low-precision inputs on every backend but
        ``reference``, which computes in ``promote_types(x.dtype, weight.dtype)``).

    Raises:
        ValueError: bad shapes/devices/dtypes; ``docs`` whose ``pos`` is not (B, T), or with ``initial_state``.
        ConfigError: unknown or unavailable backend, or a shape the explicitly requested backend cannot take (see
            :func:`resolve_backend`).
    """
    _validate(x, weight, bias, initial_state)
    be = _select(backend, str(x.device), x.dtype, int(weight.shape[0]), int(weight.shape[1]))
    if docs is not None:
        if initial_state is not None or tuple(docs.pos.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"causal_conv1d: docs.pos.shape={tuple(docs.pos.shape)} with initial_state "
                f"{'given' if initial_state is not None else 'None'}; allowed: docs for (B, T) = "
                f"{tuple(x.shape[:2])} and no initial_state"
            )
        if be == "dao":
            return _cuda.dao_forward(x, weight, bias, residual, activation, None, seq_idx=docs.seq_idx)
        if be == "fla":
            cu, cu_cpu = docs.cu_seqlens, docs.cu_seqlens_cpu
            if cu is None:
                cu, cu_cpu = varlen.cu_seqlens_from_pos(docs.pos)
            return _cuda.fla_forward(x, weight, bias, residual, activation, None, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        return causal_conv1d_torch(x, weight, bias, residual=residual, activation=activation, doc_pos=docs.pos)
    if be == "cpu":
        return _native.canon_conv(x, weight, bias, initial_state, bool(residual), bool(activation))
    if be == "torch":
        return causal_conv1d_torch(
            x, weight, bias, residual=residual, activation=activation, initial_state=initial_state
        )
    if be == "reference":
        return causal_conv1d_reference(
            x, weight, bias, residual=residual, activation=activation, initial_state=initial_state
        )
    if be == "dao":
        return _cuda.dao_forward(x, weight, bias, residual, activation, initial_state)
    if be == "fla":
        return _cuda.fla_forward(x, weight, bias, residual, activation, initial_state)
    raise AssertionError(be)


# ----------------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------------


def causal_conv1d_state(x: Tensor, kernel_size: int, initial_state: Optional[Tensor] = None) -> Tensor:
    """Decode state after a prefill (``causal_conv1d_update``'s): the last K raw inputs, (B, C, K), zero-left-padded.

    Args: x (B, T, C) the prefill inputs (before the residual add); kernel_size K >= 1; initial_state (B, C, K-1)
    history before x, or None. Returns (B, C, K) in x.dtype; column K-1 is the newest input. Feed ``state[:, :, 1:]``
    as ``initial_state`` to continue with another multi-token :func:`causal_conv1d` call.
    Raises ValueError on bad shapes.
    """
    if x.dim() != 3 or int(kernel_size) < 1:
        raise ValueError(
            f"causal_conv1d_state: x.shape={tuple(x.shape)}, kernel_size={kernel_size}; "
            f"allowed: x (B, T, C) and kernel_size >= 1"
        )
    K = int(kernel_size)
    B, T, C = x.shape
    hist = x.transpose(1, 2)
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, C, K - 1):
            raise ValueError(
                f"causal_conv1d_state: initial_state.shape={tuple(initial_state.shape)}; allowed: {(B, C, K - 1)}"
            )
        hist = torch.cat([initial_state.to(x.dtype), hist], dim=-1)
    n = hist.shape[-1]
    return hist[..., n - K :].contiguous() if n >= K else F.pad(hist, (K - n, 0)).contiguous()


@assume_constant
def _select_step(backend: str, device: str, dtype: torch.dtype, C: int, K: int) -> str:
    """Decode backend of a layer: the kernel family :func:`_select` picks for its multi-token calls (the same rule,
    :func:`resolve_backend` for C and K), i.e. ``dao`` -> ``causal_conv1d_update``, ``fla`` -> fla's
    ``causal_conv1d_update`` when this fla exports it, anything else -> the torch formula (constant under compile)."""
    be = _select(backend, device, dtype, C, K)
    if be == "fla":
        fns, _ = _cuda.fla_functions()
        return "fla" if fns is not None and fns[1] is not None else "torch"
    return "dao" if be == "dao" else "torch"


def causal_conv1d_step(
    x_t: Tensor,
    state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    residual: bool = True,
    activation: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Decode one token (as Dao-AILab ``causal_conv1d_update``).

    Args:
        x_t: (B, C) new input; state: (B, C, K) the last K raw inputs (column K-1 newest); weight (C, K);
        bias (C,) or None.
        backend: ``auto`` (dao, else fla on CUDA when importable and able to take C and K, else torch math),
            ``dao``, ``fla``, or ``torch``/``reference``/``cpu`` (all three: the plain torch formula); resolved by
            :func:`resolve_backend` for C and K like the layer's multi-token calls.

    Returns:
        (y_t (B, C) in x_t.dtype, new_state (B, C, K) in state.dtype) with new_state = roll-left(state) and x_t as
        its last column, ``y_t = [x_t +] act(b + sum_j new_state[:, :, j] * weight[:, j])``. ``state`` is not
        modified.

    Raises:
        ValueError: bad shapes. ConfigError: unknown or unavailable backend, or a shape it cannot take.
    """
    if (
        x_t.dim() != 2
        or state.dim() != 3
        or state.shape[:2] != x_t.shape
        or weight.dim() != 2
        or weight.shape[0] != x_t.shape[1]
        or state.shape[2] != weight.shape[1]
    ):
        raise ValueError(
            f"causal_conv1d_step: x_t {tuple(x_t.shape)}, state {tuple(state.shape)}, weight "
            f"{tuple(weight.shape)}; allowed: x_t (B, C), state (B, C, K), weight (C, K)"
        )
    if bias is not None and tuple(bias.shape) != (x_t.shape[1],):
        raise ValueError(f"causal_conv1d_step: bias.shape={tuple(bias.shape)}; allowed: ({x_t.shape[1]},) or None")
    be = _select_step(backend, str(x_t.device), x_t.dtype, int(weight.shape[0]), int(weight.shape[1]))
    if be == "dao":
        return _cuda.dao_step(x_t, state, weight, bias, residual, activation)
    if be == "fla":
        return _cuda.fla_step(x_t, state, weight, bias, residual, activation)
    new_state = torch.cat([state[:, :, 1:], x_t.unsqueeze(-1).to(state.dtype)], dim=-1)
    cd = torch.promote_types(x_t.dtype, weight.dtype)
    if cd in _LOW_PRECISION:
        cd = torch.float32
    z = (new_state.to(cd) * weight.to(cd)).sum(-1)
    if bias is not None:
        z = z + bias.to(cd)
    if activation:
        z = F.silu(z)
    if residual:
        z = z + x_t.to(cd)
    return z.to(x_t.dtype), new_state
