"""Mamba2 SSD scan (state-space duality, chunked) and the Mamba2 mixer core (Dao & Gu 2024; ``mamba_ssm``).

Public API (the Mamba2 mixer calls only these names)::

    ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, inf),
             initial_state=None, output_final_state=False, backend="auto") -> (y, final_state | None)
    ssd_scan_reference(...same, without backend...)                      -> (y, final_state | None)
    split_conv1d_scan_combined(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, *, chunk_size, activation,
                               rmsnorm_weight, rmsnorm_eps, outproj_weight, headdim, ngroups,
                               norm_before_gate=False, dt_limit=(0.0, inf)) -> out          (CUDA, fused)
    split_conv1d_scan_reference(...same...)                                                -> out
    gated_rmsnorm(y, z, weight, eps, ngroups, norm_before_gate=False)   (the mixer's gated RMSNorm, plain torch)
    resolve_backend(name, device, dtype) -> str
    available_backends(device, dtype) -> dict[str, str | None]
    use_fused_split(backend, device, dtype, conv_width, d_inner=None, conv_dim=None, nheads=None) -> bool
    check_fused_split(name, device, dtype, conv_kernel, *, d_inner, conv_dim, nheads, key=CONFIG_KEY) -> bool
    fused_split_reason(device, dtype, conv_kernel, *, d_inner=None, conv_dim=None, nheads=None) -> str | None
    split_shape_reason(d_inner, conv_dim, nheads, stride_fix=True) -> str | None
    BACKENDS, CONFIG_KEY

Math, per batch row and head h (group g = h // (H // G) supplies B and C)::

    Δ_t  = clamp(softplus(dt_t + dt_bias_h), *dt_limit)     (no softplus when dt_softplus=False; always clamped)
    a_t  = Δ_t · A_h   (A_h = -exp(A_log_h) < 0)             x̄_t = Δ_t · x_t
    H_t  = exp(a_t) · H_{t-1} + x̄_t B_tᵀ                     (state H_t ∈ R^{P×N}, H_0 = initial_state or 0)
    y_t  = H_t C_t + D_h · x_t

Chunked form (chunk Q; the "SSD" algorithm of Dao & Gu 2024, written here from those formulas): with
``L_ts = exp(Σ_{r=s+1}^{t} a_r)`` (s ≤ t, inside a chunk; computed as a masked cumulative sum of a, never as a ratio
of exponentials) ::

    y_t^diag = Σ_{s≤t in chunk} L_ts (C_t·B_s) x̄_s                           batched over all chunks (matmuls)
    S_c      = Σ_{s∈c} exp(Σ_{r=s+1}^{end(c)} a_r) x̄_s B_sᵀ                  batched over all chunks
    H_c      = exp(Σ_{r∈c} a_r) H_{c-1} + S_c                                 a short loop over chunks
    y_t^off  = exp(Σ_{r=start(c)}^{t} a_r) H_{c-1} C_t                        batched over all chunks

SSD is "simple GLA" (fla ``naive_recurrent_simple_gla``) with q = C, k = B, v = Δ·x, g = a, scale = 1 (fla's state
is the transpose (N, P) of ours); the benchmark and a test use that mapping.

Backends (``model.kernels.ssd`` in the config and in errors):

* ``reference`` -- :func:`ssd_scan_reference` (pure PyTorch, any device, float32 / float64 compute).
* ``mamba_ssm`` -- mamba-ssm's Triton kernels (CUDA; fp32/fp16/bf16): ``mamba_chunk_scan_combined``, and for a
  one-token step without autograd ``selective_state_update`` (see ``_mamba.py``).
* ``auto``      -- ``mamba_ssm`` on CUDA when ``mamba_ssm.ops.triton.ssd_combined`` imports (and dtype is not
  float64), else ``reference``.

The Mamba2 mixer's fused path (``mamba_split_conv1d_scan_combined``: conv + scan + gated norm + out-proj) is chosen on
top of ``mamba_ssm`` by :func:`use_fused_split` only when :func:`fused_split_reason` finds nothing against it: conv
kernel width 2-4, the causal-conv1d entry points the installed mamba-ssm calls present with the arguments it passes
(mamba-ssm 2.2.0-2.2.4 need causal-conv1d <= 1.5.0.post8, mamba-ssm >= 2.2.5 need causal-conv1d >= 1.5.1), and xBC
channels laid out as causal-conv1d's channel-last kernel needs (:func:`split_shape_reason`). Otherwise ``auto`` warns
once and runs the conv and ``mamba_chunk_scan_combined`` separately; a pinned ``mamba_ssm`` is refused by
:func:`check_fused_split` with a ConfigError naming ``model.kernels.ssd``.

State dtypes: the prefill final state of ``mamba_chunk_scan_combined`` is float32 for every input dtype (mamba-ssm
2.2.0-2.3.x ``_state_passing_fwd`` allocates ``final_states`` as float32 and accumulates in float32; chunk states use
``states_in_fp32=True``); the decode state is kept float32 here and ``selective_state_update`` computes in float32 and
stores in the state's dtype. Only the per-chunk states fed back into the output (``out_dtype=C.dtype``) and the
backward's recomputed states (``states_dtype=x.dtype``) are in the activations' dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.errors import ConfigError
from canonlm.ops._dispatch import (
    assume_constant,
    compute_dtype,
    cuda_reason,
    make_selector,
    memo_table,
    no_autocast,
    resolve_fast_or_reference,
    shape_of,
)
from canonlm.ops import varlen
from canonlm.ops.canon._cuda import DAO_WIDTHS

from . import _mamba

__all__ = [
    "BACKENDS",
    "CONFIG_KEY",
    "available_backends",
    "check_fused_split",
    "fused_split_reason",
    "gated_rmsnorm",
    "resolve_backend",
    "split_conv1d_scan_combined",
    "split_conv1d_scan_reference",
    "split_shape_reason",
    "ssd_scan",
    "use_fused_split",
    "ssd_scan_reference",
]

BACKENDS = ("auto", "reference", "mamba_ssm")
CONFIG_KEY = "model.kernels.ssd"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INF = float("inf")


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------


def _check_chunk(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"ssd_scan: chunk_size={chunk_size!r}; allowed: a positive int (e.g. 64 or 256)")
    return int(chunk_size)


def _check_limit(dt_limit) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"ssd_scan: dt_limit={dt_limit!r}; allowed: a pair (lo, hi) of floats with lo <= hi") from None
    if not lo <= hi or math.isnan(lo) or math.isnan(hi):
        raise ValueError(f"ssd_scan: dt_limit={dt_limit!r}; allowed: a pair (lo, hi) of floats with lo <= hi")
    return lo, hi


def _validate(x, dt, A, B, C, D, dt_bias, initial_state) -> tuple[int, int, int, int, int, int]:
    """(Bsz, T, H, P, G, N) after checking every shape/device; ValueError naming the argument otherwise."""
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"ssd_scan: x.shape={shape_of(x)}; allowed: a floating (B, T, H, P) tensor")
    Bsz, T, H, P = x.shape
    if T < 1 or H < 1 or P < 1:
        raise ValueError(f"ssd_scan: x.shape={tuple(x.shape)}; allowed: (B, T, H, P) with T, H, P >= 1")
    if not isinstance(dt, Tensor) or tuple(dt.shape) != (Bsz, T, H):
        raise ValueError(f"ssd_scan: dt.shape={shape_of(dt)}; allowed: (B, T, H) = {(Bsz, T, H)} (raw time step)")
    if not isinstance(A, Tensor) or tuple(A.shape) != (H,):
        raise ValueError(f"ssd_scan: A.shape={shape_of(A)}; allowed: ({H},) (per-head A = -exp(A_log) < 0)")
    if not isinstance(B, Tensor) or B.dim() != 4 or tuple(B.shape[:2]) != (Bsz, T):
        raise ValueError(f"ssd_scan: B.shape={shape_of(B)}; allowed: (B, T, G, N) with (B, T) = {(Bsz, T)}")
    G, N = B.shape[2], B.shape[3]
    if G < 1 or N < 1 or H % G != 0:
        raise ValueError(f"ssd_scan: B.shape={tuple(B.shape)}; allowed: G >= 1 groups dividing H={H}, N >= 1")
    if not isinstance(C, Tensor) or C.shape != B.shape:
        raise ValueError(f"ssd_scan: C.shape={shape_of(C)}; allowed: B's shape {tuple(B.shape)}")
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"ssd_scan: D.shape={shape_of(D)}; allowed: ({H},), ({H}, {P}) or None")
    if dt_bias is not None and tuple(dt_bias.shape) != (H,):
        raise ValueError(f"ssd_scan: dt_bias.shape={shape_of(dt_bias)}; allowed: ({H},) or None")
    if initial_state is not None and tuple(initial_state.shape) != (Bsz, H, P, N):
        raise ValueError(
            f"ssd_scan: initial_state.shape={shape_of(initial_state)}; allowed: (B, H, P, N) = {(Bsz, H, P, N)} or None"
        )
    for name, t in (
        ("dt", dt),
        ("A", A),
        ("B", B),
        ("C", C),
        ("D", D),
        ("dt_bias", dt_bias),
        ("initial_state", initial_state),
    ):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"ssd_scan: {name}.dtype={t.dtype}; allowed: a floating-point dtype")
        if t.device != x.device:
            raise ValueError(f"ssd_scan: {name}.device={t.device}; allowed: x's device {x.device}")
    return Bsz, T, H, P, G, N


# ----------------------------------------------------------------------------------------------------------------
# pure-PyTorch reference (Dao & Gu 2024)
# ----------------------------------------------------------------------------------------------------------------


def _time_step(
    dt: Tensor, dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: tuple[float, float], cd: torch.dtype
) -> Tensor:
    """Δ = clamp(softplus(dt + dt_bias), *dt_limit) in ``cd`` (softplus linear above 20, as in the kernels)."""
    d = dt.to(cd)
    if dt_bias is not None:
        d = d + dt_bias.to(cd)
    if dt_softplus:
        d = F.softplus(d)
    return d.clamp(dt_limit[0], dt_limit[1])


def _ssd_chunked(
    xbar: Tensor, a: Tensor, Bm: Tensor, Cm: Tensor, h0: Optional[Tensor], Q: int
) -> tuple[Tensor, Tensor]:
    """Chunked SSD core. xbar (B, Tp, H, P), a (B, Tp, H), Bm/Cm (B, Tp, G, N), h0 (B, H, P, N) or None, all in one
    dtype, Tp % Q == 0. Returns (y without the D term (B, Tp, H, P), final state (B, H, P, N)).

    Heads are split as (G, R) (group-major, R = H // G) so that group g's B/C serve its R heads: the per-head
    diagonal blocks are batched over (B, G, R, chunks); the state products fold the R heads into the matrix
    dimension (R·P rows against one group's B or C), so B and C are never repeated per head."""
    Bsz, Tp, H, P = xbar.shape
    G, N = Bm.shape[2], Bm.shape[3]
    R, nc = H // G, Tp // Q
    x6 = xbar.reshape(Bsz, nc, Q, G, R, P)
    ah = a.reshape(Bsz, nc, Q, G, R).permute(0, 3, 4, 1, 2)  # (B, G, R, nc, Q)
    bc = Bm.reshape(Bsz, nc, Q, G, N).permute(0, 3, 1, 2, 4)  # (B, G, nc, Q, N)
    cc = Cm.reshape(Bsz, nc, Q, G, N).permute(0, 3, 1, 2, 4)  # (B, G, nc, Q, N)

    # segment sums seg[t, s] = sum_{r=s+1}^{t} a_r (s <= t) as a cumulative sum over rows r of the strictly-lower
    # masked matrix E[r, s] = a_r (r > s). Above the diagonal seg is exactly 0 (an empty sum), so L = exp(seg) is 1
    # there; the causal mask is applied once per group to the scores instead (R times fewer elements), and exp runs
    # in place on finite values only.
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    strict, upper = ones.tril(-1), ~ones.tril(0)
    seg = ah.unsqueeze(-1).expand(*ah.shape, Q).masked_fill(~strict, 0.0).cumsum(-2)
    L = seg.exp_()  # (B, G, R, nc, Q, Q), 1 above diag

    # intra-chunk (diagonal blocks), per head
    scores = (cc @ bc.transpose(-1, -2)).masked_fill_(upper, 0.0)  # (B, G, nc, Q, Q) = C_t . B_s, s <= t
    y_diag = (L * scores.unsqueeze(2)) @ x6.permute(0, 3, 4, 1, 2, 5)  # (B, G, R, nc, Q, P)

    # per-chunk states S_c = sum_s exp(sum_{r=s+1}^{end} a_r) xbar_s B_s^T; the decay to the chunk end is L's last row
    # (all of it on or below the diagonal)
    dec_end = L[..., Q - 1, :].permute(0, 1, 3, 4, 2).unsqueeze(-1)  # (B, G, nc, Q, R, 1)
    xw = x6.permute(0, 3, 1, 2, 4, 5) * dec_end  # (B, G, nc, Q, R, P)
    S = xw.reshape(Bsz, G, nc, Q, R * P).transpose(-1, -2) @ bc  # (B, G, nc, R*P, N)

    # inter-chunk recurrence over the chunk states (nc small steps)
    acs = ah.cumsum(-1)  # sum_{r=start}^{t} a_r, (B, G, R, nc, Q)
    chunk_decay = acs[..., Q - 1].exp().permute(0, 1, 3, 2)[..., None, None]  # (B, G, nc, R, 1, 1)
    h = xbar.new_zeros(Bsz, G, R, P, N) if h0 is None else h0.reshape(Bsz, G, R, P, N)
    prev = []
    # unbind (not S[:, :, c]): its backward stacks the nc gradients instead of scattering each into a zero tensor
    for dec_c, S_c in zip(chunk_decay.unbind(2), S.view(Bsz, G, nc, R, P, N).unbind(2)):
        prev.append(h)
        h = dec_c * h + S_c
    h_prev = torch.stack(prev, dim=2).view(Bsz, G, nc, R * P, N)  # state entering chunk c

    # off-diagonal part: exp(sum_{r=start}^{t} a_r) * H_{c-1} C_t
    y_off = (cc @ h_prev.transpose(-1, -2)).view(Bsz, G, nc, Q, R, P)
    y = y_off * acs.exp().permute(0, 1, 3, 4, 2).unsqueeze(-1) + y_diag.permute(0, 1, 3, 4, 2, 5)
    y = y.permute(0, 2, 3, 1, 4, 5).reshape(Bsz, Tp, H, P)  # (B, G, nc, Q, R, P) -> (B, T, H, P)
    return y, h.reshape(Bsz, H, P, N)


def ssd_scan_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int = 256,
    D: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = (0.0, _INF),
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Pure-PyTorch chunked SSD (Dao & Gu 2024); the CPU path and the oracle of the fused kernels.

    Args: see :func:`ssd_scan` (same shapes and semantics).

    Computes in float32 (float64 when any input is float64) with autocast disabled; differentiable w.r.t. x, dt, A,
    B, C, D, dt_bias and initial_state. The chunk is ``min(chunk_size, T)``; T is zero-padded to a multiple of it
    with Δ = 0 in the padding (set *after* the softplus), so a = 0 and x̄ = 0 there and neither y nor the final state
    change. The result does not depend on ``chunk_size`` beyond rounding.

    Returns:
        (y (B, T, H, P) in x.dtype, final state (B, H, P, N) in the compute dtype or None).

    Raises:
        ValueError: bad shapes / devices / dtypes, ``chunk_size`` not a positive int, bad ``dt_limit``.
    """
    Bsz, T, H, P, G, N = _validate(x, dt, A, B, C, D, dt_bias, initial_state)
    Q = min(_check_chunk(chunk_size), T)
    lim = _check_limit(dt_limit)
    cd = compute_dtype(x, dt, A, B, C, D, dt_bias, initial_state)
    with no_autocast(x.device):
        xc = x.to(cd)
        delta = _time_step(dt, dt_bias, dt_softplus, lim, cd)  # (B, T, H)
        pad = (-T) % Q
        Bm, Cm = B.to(cd), C.to(cd)
        if pad:
            delta = F.pad(delta, (0, 0, 0, pad))  # Δ = 0 -> a = 0, x̄ = 0
            Bm = F.pad(Bm, (0, 0, 0, 0, 0, pad))
            Cm = F.pad(Cm, (0, 0, 0, 0, 0, pad))
            xp = F.pad(xc, (0, 0, 0, 0, 0, pad))
        else:
            xp = xc
        a = delta * A.to(cd)
        xbar = xp * delta.unsqueeze(-1)
        h0 = None if initial_state is None else initial_state.to(cd)
        y, h = _ssd_chunked(xbar, a, Bm, Cm, h0, Q)
        y = y[:, :T]
        if D is not None:
            y = y + xc * D.to(cd).reshape(H, -1)
    return y.to(x.dtype), (h if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------------------------


def _unavailable_reason(name: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None if backend ``name`` can run on (device, dtype), else why not."""
    if name in ("reference", "auto"):
        return None
    if name == "mamba_ssm":
        reason = cuda_reason(device)
        if reason is not None:
            return reason
        if dtype not in _KERNEL_DTYPES:
            return f"supports float32, float16 and bfloat16 (got {dtype})"
        fn, err = _mamba.chunk_scan_function()
        return None if fn is not None else f"mamba_ssm.ops.triton.ssd_combined is not importable ({err})"
    raise AssertionError(name)


def available_backends(device, dtype: torch.dtype = torch.float32) -> dict:
    """Map every concrete backend name to None (runs here) or the reason it cannot run on (device, dtype).
    mamba_ssm is imported only for a CUDA device with CUDA available."""
    device = torch.device(device)
    return {n: _unavailable_reason(n, device, dtype) for n in BACKENDS if n != "auto"}


def resolve_backend(name: str, device, dtype: torch.dtype) -> str:
    """Concrete SSD backend for tensors on ``device`` with ``dtype``.

    ``"auto"``: ``"mamba_ssm"`` on CUDA when ``mamba_ssm.ops.triton.ssd_combined`` imports and dtype is
    fp32/fp16/bf16, else ``"reference"``. ``"reference"`` always runs. Device ``meta`` (shape tracing): ``name`` is
    returned unchanged (``ssd_scan`` then runs the reference, which works on meta tensors).

    Raises:
        ConfigError("model.kernels.ssd", name, allowed): unknown name, or ``"mamba_ssm"`` where it cannot run (not
        CUDA, mamba_ssm not importable, float64); ``allowed`` says what runs here and why the
        requested one is not.
    """
    return resolve_fast_or_reference(
        name,
        device,
        dtype,
        key=CONFIG_KEY,
        fast="mamba_ssm",
        reason=lambda dev, dt: _unavailable_reason("mamba_ssm", dev, dt),
    )


_select = make_selector(resolve_backend)


def split_shape_reason(d_inner: int, conv_dim: int, nheads: int, stride_fix: bool = True) -> Optional[str]:
    """None when causal-conv1d's channel-last kernel takes the xBC slice ``zxbcdt[..., d_inner:d_inner + conv_dim]``
    that ``mamba_split_conv1d_scan_combined`` convolves, else why not.

    The slice reaches ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (``csrc/causal_conv1d.cpp``, causal-conv1d
    1.4 - 1.6) as the (B, conv_dim, T) view with stride(1) == 1, i.e. the channel-last layout, which needs
    ``conv_dim % 8 == 0`` ("causal_conv1d only supports channel dimension divisible by 8") and strides
    (row = ``d_in_proj = 2·d_inner + 2GN + H``, batch = T·d_in_proj) that are multiples of 8; mamba-ssm >= 2.3.0
    asserts ``conv_dim % 8 == 0`` itself (``ensure_stride``). mamba-ssm >= 2.2.5 copies xBC when the row stride is
    not a multiple of 8 (``stride_fix``); older releases pass the view as is. When the view is passed uncopied, its
    first element sits ``d_inner`` elements into each row, and the kernel's 16-byte vector loads need
    ``d_inner % 8 == 0``.

    Args: d_inner = H·P; conv_dim = d_inner + 2·G·N (the conv's channels); nheads = H; stride_fix: see above.
    """
    d_in_proj = d_inner + conv_dim + nheads
    if conv_dim % 8:
        return (
            f"the conv's channels d_inner + 2*G*N = {conv_dim} are not a multiple of 8 (causal_conv1d's "
            f"channel-last kernel)"
        )
    if d_in_proj % 8 == 0 or not stride_fix:
        if d_in_proj % 8:
            return (
                f"in_proj's width 2*d_inner + 2*G*N + H = {d_in_proj} is not a multiple of 8 (the xBC row stride "
                f"causal_conv1d's channel-last kernel needs; this mamba-ssm (< 2.2.5) does not copy)"
            )
        if d_inner % 8:
            return (
                f"d_inner = {d_inner} is not a multiple of 8 (xBC starts d_inner elements into each zxbcdt row; "
                f"causal_conv1d's 16-byte vector loads need it aligned)"
            )
    return None


def fused_split_reason(
    device,
    dtype: torch.dtype,
    conv_kernel: int,
    *,
    d_inner: Optional[int] = None,
    conv_dim: Optional[int] = None,
    nheads: Optional[int] = None,
) -> Optional[str]:
    """None when the fused ``mamba_split_conv1d_scan_combined`` can run the Mamba2 mixer here, else why not.

    Checks, in order: the ``mamba_ssm`` backend runs on (device, dtype) (CUDA, fp32/fp16/bf16, ssd_combined imports);
    the conv kernel width is 2, 3 or 4 (causal-conv1d: "only supports width between 2 and 4"); the causal-conv1d
    entry points the installed ssd_combined calls exist with the arguments it passes
    (:func:`canonlm.ops.ssd._mamba.causal_conv1d_compat_reason`); and, when ``d_inner``, ``conv_dim`` and ``nheads``
    are given, the channel layout (:func:`split_shape_reason`). Imports the libraries only on a CUDA device."""
    device = torch.device(device)
    why = _unavailable_reason("mamba_ssm", device, dtype)
    if why is not None:
        return f"mamba_ssm {why}"
    if conv_kernel not in DAO_WIDTHS:
        return f"conv kernel width {conv_kernel}; causal_conv1d supports {DAO_WIDTHS}"
    info, err = _mamba.split_info()
    if info is None:
        return err
    if d_inner is not None and conv_dim is not None and nheads is not None:
        return split_shape_reason(int(d_inner), int(conv_dim), int(nheads), info.stride_fix)
    return None


_split_cache: dict = memo_table()
_split_warned: set = set()


@assume_constant
def use_fused_split(
    backend: str,
    device: str,
    dtype: torch.dtype,
    conv_width: int,
    d_inner: Optional[int] = None,
    conv_dim: Optional[int] = None,
    nheads: Optional[int] = None,
) -> bool:
    """True when the Mamba2 mixer should call the fused ``mamba_split_conv1d_scan_combined``.

    ``backend`` is the resolved SSD backend (``auto`` / ``mamba_ssm`` / ``reference``); only ``mamba_ssm`` (or an
    ``auto`` that resolves to it) can be fused. When it resolves to ``mamba_ssm`` but :func:`fused_split_reason` says
    the fused path cannot run (conv width, the causal-conv1d entry points the installed mamba-ssm calls, the channel
    layout when ``d_inner``/``conv_dim``/``nheads`` are given), the result is False and a RuntimeWarning (once per
    reason and process) says why; the mixer then runs its conv and ``mamba_chunk_scan_combined`` separately. Memoised per arguments;
    constant under torch.compile. A pinned request that must not fall back is checked by :func:`check_fused_split`
    at model build time."""
    key = (backend, device, dtype, conv_width, d_inner, conv_dim, nheads)
    hit = _split_cache.get(key)
    if hit is not None:
        return hit
    use = False
    if _select(backend, device, dtype) == "mamba_ssm":
        why = fused_split_reason(device, dtype, conv_width, d_inner=d_inner, conv_dim=conv_dim, nheads=nheads)
        use = why is None
        if not use and why not in _split_warned:
            _split_warned.add(why)
            warnings.warn(
                f"canonlm: Mamba2's fused mamba_split_conv1d_scan_combined path cannot run ({why}); "
                f"running the conv and mamba_chunk_scan_combined separately",
                RuntimeWarning,
                stacklevel=2,
            )
    _split_cache[key] = use
    return use


def check_fused_split(
    name: str,
    device,
    dtype: torch.dtype,
    conv_kernel: int,
    *,
    d_inner: int,
    conv_dim: int,
    nheads: int,
    key: str = CONFIG_KEY,
) -> bool:
    """Model-build check of the fused Mamba2 path for the *requested* SSD backend ``name``.

    Returns whether the fused path will run. ``reference`` -> False. ``auto`` / ``fused`` -> as
    :func:`use_fused_split` (False with a warning when it cannot run; the unfused mamba_ssm path is used).
    ``mamba_ssm`` (pinned) -> True, or raises.

    Raises:
        canonlm.errors.ConfigError(key, name, allowed): ``name == "mamba_ssm"`` and the fused path cannot run here
        (``allowed`` carries :func:`fused_split_reason`); unknown names and a mamba_ssm that cannot run at all are
        refused by :func:`resolve_backend` first. Nothing is checked on the ``meta`` device.
    """
    device = torch.device(device)
    be = resolve_fast_or_reference(
        "auto" if name == "fused" else name,
        device,
        dtype,
        key=key,
        fast="mamba_ssm",
        reason=lambda dev, dt: _unavailable_reason("mamba_ssm", dev, dt),
    )
    if device.type == "meta" or be != "mamba_ssm":
        return False
    if name == "mamba_ssm":
        why = fused_split_reason(device, dtype, conv_kernel, d_inner=d_inner, conv_dim=conv_dim, nheads=nheads)
        if why is not None:
            raise ConfigError(
                key,
                name,
                f"auto | reference (the fused Mamba2 path mamba_split_conv1d_scan_combined cannot run: {why})",
            )
        return True
    return use_fused_split("auto", str(device), dtype, int(conv_kernel), int(d_inner), int(conv_dim), int(nheads))


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int = 256,
    D: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = (0.0, _INF),
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    backend: str = "auto",
    seq_idx: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Mamba2 SSD scan ``H_t = exp(Δ_t A_h) H_{t-1} + Δ_t x_t B_tᵀ``, ``y_t = H_t C_t + D_h x_t`` (Dao & Gu 2024).

    Args:
        x: (B, T, H, P) inputs (heads × head dim), any floating dtype; T >= 1 (T = 1 is a decode step).
        dt: (B, T, H) raw time step (before dt_bias / softplus).
        A: (H,) per-head decay rate, negative (``-exp(A_log)``).
        B, C: (B, T, G, N) input / output projections, H % G == 0; head h uses group ``h // (H // G)``.
        chunk_size: positive int, the SSD chunk length (mamba_ssm's ``chunk_size``; Mamba2 uses 256).
        D: (H,) (or (H, P)) skip weight; None = no ``D·x`` term.
        dt_bias: (H,) added to dt before the softplus; None = 0.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: (lo, hi); Δ is clamped to it (always, as the kernels do; the default (0, inf) is a no-op after a
            softplus).
        initial_state: (B, H, P, N) state before x (continuation / chunked prefill), or None for zeros.
        output_final_state: also return the state after the last token.
        backend: one of :data:`BACKENDS` (see :func:`resolve_backend`). ``mamba_ssm`` uses
            ``mamba_chunk_scan_combined``, or ``selective_state_update`` for T == 1 when autograd is off.
        seq_idx: (B, T) integer index of each token's document in its row (runs of equal ids), or None: the state
            restarts from zero at every document start (document masking). ``mamba_ssm`` passes it (int32) to
            ``mamba_chunk_scan_combined(seq_idx=...)`` (mamba-ssm 2.3.1 ``ssd_combined.py``: "seq_idx: (batch,
            seqlen)"; its kernels zero the state and the intra-chunk terms across a change of id); the reference
            runs the documents as one zero-padded batch (:func:`canonlm.ops.varlen.pack`). Needs no
            ``initial_state`` and ``output_final_state=False``.

    Returns:
        (y (B, T, H, P) in x.dtype, final state (B, H, P, N) -- float32, float64 for float64 inputs on the
        reference -- or None).

    Raises:
        ValueError: bad shapes / devices / dtypes, ``chunk_size`` not a positive int, bad ``dt_limit``.
        ConfigError: unknown or unavailable backend.
    """
    Bsz, T, H, P, G, N = _validate(x, dt, A, B, C, D, dt_bias, initial_state)
    Q = _check_chunk(chunk_size)
    lim = _check_limit(dt_limit)
    be = _select(backend, str(x.device), x.dtype)
    if seq_idx is not None:
        if (
            tuple(seq_idx.shape) != (Bsz, T)
            or seq_idx.is_floating_point()
            or initial_state is not None
            or output_final_state
        ):
            raise ValueError(
                f"ssd_scan: seq_idx {tuple(seq_idx.shape)} {seq_idx.dtype}, initial_state "
                f"{'given' if initial_state is not None else 'None'}, output_final_state="
                f"{output_final_state}; allowed: integer seq_idx (B, T) = {(Bsz, T)}, no initial_state, "
                f"output_final_state=False"
            )
        if be == "mamba_ssm":
            return _mamba.chunk_scan(
                x,
                dt,
                A,
                B,
                C,
                Q,
                D,
                dt_bias,
                dt_softplus,
                lim,
                None,
                False,
                seq_idx=seq_idx.to(torch.int32).contiguous(),
            )
        _, cu_cpu = varlen.cu_seqlens_of(seq_idx)
        flat = (t.reshape(1, Bsz * T, *t.shape[2:]) for t in (x, dt, B, C))
        packed, valid = zip(*(varlen.pack(t, cu_cpu) for t in flat))
        px, pdt, pB, pC = packed
        y, _ = ssd_scan_reference(
            px, pdt, A, pB, pC, chunk_size=Q, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=lim
        )
        return varlen.unpack(y, valid[0]).view(Bsz, T, H, P), None
    if be == "mamba_ssm":
        if T == 1 and not torch.is_grad_enabled():
            return _mamba.state_update(x, dt, A, B, C, D, dt_bias, dt_softplus, lim, initial_state, output_final_state)
        return _mamba.chunk_scan(x, dt, A, B, C, Q, D, dt_bias, dt_softplus, lim, initial_state, output_final_state)
    return ssd_scan_reference(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=Q,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=lim,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


# ----------------------------------------------------------------------------------------------------------------
# Mamba2 mixer core: conv1d over xBC -> SSD -> gated RMSNorm -> out-proj (HF transformers ``Mamba2Mixer``)
# ----------------------------------------------------------------------------------------------------------------


def gated_rmsnorm(
    y: Tensor,
    z: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    ngroups: int = 1,
    norm_before_gate: bool = False,
) -> Tensor:
    """Mamba2's gated RMSNorm over groups of ``d / ngroups`` channels, in float32 (float64 for float64 inputs).

    ``norm_before_gate=False`` (Mamba2 / canonlm default): ``RMSNorm(y ⊙ silu(z)) ⊙ weight``; ``True``:
    ``RMSNorm(y) ⊙ weight ⊙ silu(z)``. RMSNorm(u) = u / sqrt(mean_group(u²) + eps). ``z=None``: no gate;
    ``weight=None``: no norm, only the gate ``y ⊙ silu(z)`` (mamba_ssm's behaviour without ``rmsnorm_weight``).

    Args: y, z (..., d); weight (d,) or None; d % ngroups == 0. Returns (..., d) in the compute dtype.
    Raises ValueError on bad shapes.
    """
    d = y.shape[-1]
    if z is not None and z.shape != y.shape:
        raise ValueError(f"gated_rmsnorm: z.shape={tuple(z.shape)}; allowed: y's shape {tuple(y.shape)}")
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"gated_rmsnorm: weight.shape={tuple(weight.shape)}; allowed: ({d},) or None")
    if ngroups < 1 or d % ngroups != 0:
        raise ValueError(f"gated_rmsnorm: ngroups={ngroups}; allowed: a positive divisor of d={d}")
    cd = compute_dtype(y, z, weight)
    u = y.to(cd)
    gate = None if z is None else F.silu(z.to(cd))
    if weight is None:
        return u if gate is None else u * gate
    if gate is not None and not norm_before_gate:
        u = u * gate
    ug = u.reshape(*u.shape[:-1], ngroups, d // ngroups)
    u = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).reshape(u.shape) * weight.to(cd)
    if gate is not None and norm_before_gate:
        u = u * gate
    return u


def _split_dims(
    zxbcdt, conv_weight, conv_bias, dt_bias, A, D, headdim, ngroups, activation, rmsnorm_weight, outproj_weight
) -> tuple[int, int, int, int, int]:
    """(H, P, G, N, conv_dim) after validating the fused-mixer arguments; ValueError otherwise."""
    if not isinstance(zxbcdt, Tensor) or zxbcdt.dim() != 3:
        raise ValueError(f"split_conv1d_scan: zxbcdt.shape={shape_of(zxbcdt)}; allowed: (B, T, 2HP + 2GN + H)")
    if not isinstance(A, Tensor) or A.dim() != 1:
        raise ValueError(f"split_conv1d_scan: A.shape={shape_of(A)}; allowed: (H,)")
    H = A.shape[0]
    P, G = int(headdim), int(ngroups)
    if P < 1 or G < 1 or H % G != 0:
        raise ValueError(
            f"split_conv1d_scan: headdim={headdim}, ngroups={ngroups}; allowed: headdim >= 1 and "
            f"ngroups a positive divisor of H={H}"
        )
    d_inner = H * P
    if not isinstance(conv_weight, Tensor) or conv_weight.dim() != 2:
        raise ValueError(
            f"split_conv1d_scan: conv_weight.shape={shape_of(conv_weight)}; allowed: (conv_dim, W) "
            f"(an nn.Conv1d weight (conv_dim, 1, W) must be squeezed)"
        )
    conv_dim = conv_weight.shape[0]
    gn2 = conv_dim - d_inner
    if gn2 <= 0 or gn2 % (2 * G) != 0:
        raise ValueError(
            f"split_conv1d_scan: conv_weight.shape={tuple(conv_weight.shape)}; allowed: conv_dim = "
            f"H*headdim + 2*ngroups*N = {d_inner} + 2*{G}*N"
        )
    N = gn2 // (2 * G)
    want = 2 * d_inner + gn2 + H
    if zxbcdt.shape[-1] != want:
        raise ValueError(
            f"split_conv1d_scan: zxbcdt.shape={tuple(zxbcdt.shape)}; allowed: last dim 2*H*P + 2*G*N "
            f"+ H = {want} (z {d_inner}, xBC {conv_dim}, dt {H})"
        )
    if conv_bias is not None and tuple(conv_bias.shape) != (conv_dim,):
        raise ValueError(f"split_conv1d_scan: conv_bias.shape={shape_of(conv_bias)}; allowed: ({conv_dim},) or None")
    if dt_bias is not None and tuple(dt_bias.shape) != (H,):
        raise ValueError(f"split_conv1d_scan: dt_bias.shape={shape_of(dt_bias)}; allowed: ({H},)")
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"split_conv1d_scan: D.shape={shape_of(D)}; allowed: ({H},) or ({H}, {P})")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"split_conv1d_scan: activation={activation!r}; allowed: 'silu' (= 'swish') or None")
    if rmsnorm_weight is not None and tuple(rmsnorm_weight.shape) != (d_inner,):
        raise ValueError(f"split_conv1d_scan: rmsnorm_weight.shape={shape_of(rmsnorm_weight)}; allowed: ({d_inner},)")
    if outproj_weight is not None and (outproj_weight.dim() != 2 or outproj_weight.shape[1] != d_inner):
        raise ValueError(
            f"split_conv1d_scan: outproj_weight.shape={shape_of(outproj_weight)}; allowed: (out_dim, {d_inner})"
        )
    return H, P, G, N, conv_dim


def split_conv1d_scan_reference(
    zxbcdt: Tensor,
    conv_weight: Tensor,
    conv_bias: Optional[Tensor],
    dt_bias: Optional[Tensor],
    A: Tensor,
    D: Optional[Tensor],
    *,
    chunk_size: int,
    activation: Optional[str],
    rmsnorm_weight: Optional[Tensor],
    rmsnorm_eps: float,
    outproj_weight: Optional[Tensor],
    headdim: int,
    ngroups: int,
    norm_before_gate: bool = False,
    dt_limit: Sequence[float] = (0.0, _INF),
) -> Tensor:
    """Plain-torch Mamba2 mixer core (what ``mamba_split_conv1d_scan_combined`` fuses).

    ``zxbcdt`` (B, T, 2·H·P + 2·G·N + H) is split as ``[z (H·P), xBC (H·P + 2·G·N), dt (H)]``;
    ``xBC ← act(causal_conv1d(xBC, conv_weight (conv_dim, W), conv_bias))`` (non-residual, act = SiLU for
    ``activation="silu"``, identity for None; :func:`canonlm.ops.canon.causal_conv1d_reference`); ``xBC = [x (H·P),
    B (G·N), C (G·N)]``; ``y = ssd_scan_reference(x, dt, A, B, C, D, dt_bias, dt_softplus=True, dt_limit)``;
    ``y ← gated_rmsnorm(y, z, rmsnorm_weight, rmsnorm_eps, ngroups, norm_before_gate)``; ``out = y W_outᵀ`` (no
    bias; skipped when ``outproj_weight`` is None).

    ``noconv1d`` (Mamba2 without its conv, Result 7.1) is ``conv_weight[:, :] = [0, …, 0, 1]``, ``conv_bias=None``,
    ``activation=None``: xBC passes through unchanged.

    Computes in float32 (float64 for float64 zxbcdt) with autocast disabled; differentiable w.r.t. every tensor.
    Returns (B, T, out_dim) (or (B, T, H·P) without out-proj) in zxbcdt.dtype.

    Raises:
        ValueError: inconsistent shapes, unknown activation, bad chunk_size / dt_limit.
    """
    from canonlm.ops.canon import causal_conv1d_reference

    H, P, G, N, conv_dim = _split_dims(
        zxbcdt, conv_weight, conv_bias, dt_bias, A, D, headdim, ngroups, activation, rmsnorm_weight, outproj_weight
    )
    Bsz, T, _ = zxbcdt.shape
    d_inner = H * P
    cd = compute_dtype(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, rmsnorm_weight, outproj_weight)
    with no_autocast(zxbcdt.device):
        z, xBC, dt = zxbcdt.to(cd).split([d_inner, conv_dim, H], dim=-1)
        xBC = causal_conv1d_reference(
            xBC,
            conv_weight.to(cd),
            None if conv_bias is None else conv_bias.to(cd),
            residual=False,
            activation=activation in ("silu", "swish"),
        )
        x, Bm, Cm = xBC.split([d_inner, G * N, G * N], dim=-1)
        y, _ = ssd_scan_reference(
            x.reshape(Bsz, T, H, P),
            dt,
            A,
            Bm.reshape(Bsz, T, G, N),
            Cm.reshape(Bsz, T, G, N),
            chunk_size=chunk_size,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=dt_limit,
        )
        y = gated_rmsnorm(y.reshape(Bsz, T, d_inner), z, rmsnorm_weight, rmsnorm_eps, G, norm_before_gate)
        if outproj_weight is not None:
            y = F.linear(y, outproj_weight.to(cd))
    return y.to(zxbcdt.dtype)


def split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv_weight: Tensor,
    conv_bias: Optional[Tensor],
    dt_bias: Optional[Tensor],
    A: Tensor,
    D: Optional[Tensor],
    *,
    chunk_size: int,
    activation: Optional[str],
    rmsnorm_weight: Optional[Tensor],
    rmsnorm_eps: float,
    outproj_weight: Optional[Tensor],
    headdim: int,
    ngroups: int,
    norm_before_gate: bool = False,
    dt_limit: Sequence[float] = (0.0, _INF),
) -> Tensor:
    """Fused Mamba2 mixer core: thin wrapper of mamba_ssm's ``mamba_split_conv1d_scan_combined`` (CUDA only).

    Same arguments and result as :func:`split_conv1d_scan_reference` (the documented composition); the time step is
    always ``softplus(dt + dt_bias)`` clamped to ``dt_limit``. The kernel keeps x/B/C/z in zxbcdt's dtype, states and
    the norm in float32. ``D=None`` / ``dt_bias=None`` are passed to the kernel as zeros (it requires both).

    Raises:
        ConfigError("model.kernels.ssd", "mamba_ssm", ...): not on CUDA, mamba_ssm not importable, float64, or
            the fused path cannot run (:func:`fused_split_reason`: conv width not 2-4, the causal-conv1d entry points
            the installed mamba-ssm calls missing or with other arguments, channels not aligned for causal-conv1d).
        ValueError: inconsistent shapes, unknown activation, bad chunk_size / dt_limit.
    """
    H, P, G, N, conv_dim = _split_dims(
        zxbcdt, conv_weight, conv_bias, dt_bias, A, D, headdim, ngroups, activation, rmsnorm_weight, outproj_weight
    )
    Q = _check_chunk(chunk_size)
    lim = _check_limit(dt_limit)
    resolve_backend("mamba_ssm", zxbcdt.device, zxbcdt.dtype)
    why = fused_split_reason(
        zxbcdt.device, zxbcdt.dtype, int(conv_weight.shape[1]), d_inner=H * P, conv_dim=conv_dim, nheads=H
    )
    if why is not None:
        raise ConfigError(
            CONFIG_KEY,
            "mamba_ssm",
            f"auto | reference (the fused Mamba2 path mamba_split_conv1d_scan_combined cannot run: {why})",
        )
    if D is None:
        D = torch.zeros(H, device=zxbcdt.device, dtype=torch.float32)
    if dt_bias is None:
        dt_bias = torch.zeros(H, device=zxbcdt.device, dtype=torch.float32)
    return _mamba.split_conv1d_scan(
        zxbcdt,
        conv_weight,
        conv_bias,
        dt_bias,
        A,
        D,
        chunk_size=Q,
        activation=activation,
        rmsnorm_weight=rmsnorm_weight,
        rmsnorm_eps=rmsnorm_eps,
        outproj_weight=outproj_weight,
        headdim=P,
        ngroups=G,
        norm_before_gate=norm_before_gate,
        dt_limit=lim,
    )
