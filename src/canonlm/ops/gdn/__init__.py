"""GDN op: the gated delta rule (Yang et al. 2025; ``fla.ops.gated_delta_rule``), chunked via the WY/UT form.

Public API (the model calls only these names)::

    chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm=True, chunk_size=64, backend="auto") -> (o, final_state)
    chunk_gated_delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm=True, chunk_size=64) -> (o, final_state)
    resolve_backend(name, device, dtype) -> str
    BACKENDS, CONFIG_KEY

Math, per batch row and head, in the ``[K, V]`` state convention of fla (S_t in R^{K x V}, the transpose
of the ``d_v x d_k`` state of Yang et al. 2025)::

    q_t, k_t <- q_t / sqrt(|q_t|^2 + 1e-6), k_t / sqrt(|k_t|^2 + 1e-6)      (only if use_qk_l2norm; fla's formula)
    a_t   = exp(g_t)                       g_t <= 0 log-space decay, a scalar per (token, head)
    w_t^T = beta_t (v_t^T - a_t k_t^T S_{t-1})                            (the delta-rule correction)
    S_t   = a_t S_{t-1} + k_t w_t^T        (= a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T)
    o_t^T = (scale q_t)^T S_t,             scale = K**-0.5 by default; S_0 = initial_state or 0.

Chunked form (derived from the recurrence); a chunk of C positions with entry state S_0, in-chunk cumulative log decay
``gamma_t = sum_{j<=t} g_j``, ``Gamma_t = exp(gamma_t)``, rows of K, V, Q the k_t, v_t, scale*q_t::

    (I + A) W = diag(beta) (V - diag(Gamma) K S_0),   A_tj = beta_t exp(gamma_t - gamma_j) k_t.k_j  (j < t, else 0)
    =>  W = U - Wk S_0  with  U = (I + A)^-1 diag(beta) V,  Wk = (I + A)^-1 diag(beta Gamma) K      (UT transform)
    O   = diag(Gamma) Q S_0 + P W,         P_tj = exp(gamma_t - gamma_j) q_t.k_j  (j <= t, else 0)
        = Qe S_0 + P U,                    Qe = diag(Gamma) Q - P Wk
    S_C = Gamma_C S_0 + Kd^T W,            Kd_j = exp(gamma_C - gamma_j) k_j
        = M S_0 + N,                       M = Gamma_C I - Kd^T Wk,  N = Kd^T U

Everything except ``S <- M S + N`` is independent of the chunk-to-chunk state, so the reference computes A, the one
unit-lower-triangular solve (``torch.linalg.solve_triangular(..., upper=False, unitriangular=True)`` on the
concatenated right-hand side [diag(beta) V | diag(beta Gamma) K]), P, Qe, PU, M and N for all chunks at once; the
Python loop over chunks does one batched (K x K)(K x V) matmul per chunk, and the outputs ``Qe S_0 + PU`` are again
one batched matmul after the loop. Pairwise decays are ``exp(gamma_t - gamma_j)`` with j > t masked *before* the exp
(never ``Gamma_t / Gamma_j``), so strongly negative g underflows to 0 instead of overflowing.

Backends (``kernels.gdn`` in the Hydra config; ``model.kernels.gdn`` in errors):

* ``reference`` -- :func:`chunk_gated_delta_rule_reference` (pure PyTorch, any device/dtype, differentiable).
* ``fla``       -- fla's Triton ``chunk_gated_delta_rule`` (CUDA; differentiable), or ``fused_recurrent_gated_delta_rule``
  for T <= 64 without autograd (decode); see :mod:`canonlm.ops.gdn._fla`.
* ``auto``      -- ``fla`` on a CUDA device when fla imports and accepts the dtype, else ``reference``.

Variable-length input (``cu_seqlens``, fla's convention: batch 1, the sequences concatenated along T): the state
starts at zero at every ``cu_seqlens[n]`` (document masking). ``fla`` passes ``cu_seqlens`` / ``cu_seqlens_cpu`` to
``chunk_gated_delta_rule``; ``reference`` runs the sequences as one zero-padded batch
(:func:`canonlm.ops.varlen.pack`; padded positions have q = k = v = 0, beta = 0, g = 0, after each sequence's end).
"""

from __future__ import annotations

import operator
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.ops import varlen
from canonlm.ops._dispatch import (
    compute_dtype,
    cuda_reason,
    make_selector,
    no_autocast,
    resolve_fast_or_reference,
    shape_of,
)

from . import _fla

__all__ = [
    "BACKENDS",
    "CONFIG_KEY",
    "L2NORM_EPS",
    "available_backends",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "resolve_backend",
]

BACKENDS = ("auto", "reference", "fla")
CONFIG_KEY = "model.kernels.gdn"
#: eps of the q/k L2 normalisation ``x / sqrt(sum(x**2) + eps)`` (fla's ``l2norm_fwd`` default and the
#: constant of its fused recurrent kernel).
L2NORM_EPS = 1e-6

_warned_dtype: set = set()
#: Largest key head dim fla's chunked delta-rule kernels accept (fla/ops/common/chunk_delta_h.py asserts K <= 256).
FLA_MAX_HEAD_K = 256


def fla_shape_reason(head_k: int) -> Optional[str]:
    """None when fla's GDN kernels take key head dim ``head_k``, else why not (a ConfigError / warning text)."""
    if head_k > FLA_MAX_HEAD_K:
        return (
            f"fla's chunk_gated_delta_rule supports key head dims <= {FLA_MAX_HEAD_K} (got d_k = {head_k}; "
            f"raise model.n_heads)"
        )
    return None


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------


def _validate(q, k, v, g, beta, initial_state, chunk_size, where: str) -> None:
    """One ValueError naming every expected shape when anything does not fit."""
    try:
        ok = not isinstance(chunk_size, bool) and operator.index(chunk_size) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{where}: chunk_size={chunk_size!r}; allowed: a positive int (e.g. 64)")
    ok = all(isinstance(t, Tensor) for t in (q, k, v, g, beta)) and q.dim() == 4 and v.dim() == 4
    if ok:
        B, T, H, K = q.shape
        ok = (
            tuple(k.shape) == (B, T, H, K)
            and v.shape[:3] == (B, T, H)
            and tuple(g.shape) == (B, T, H)
            and tuple(beta.shape) == (B, T, H)
            and T >= 1
            and K >= 1
            and v.shape[3] >= 1
            and (
                initial_state is None
                or (isinstance(initial_state, Tensor) and tuple(initial_state.shape) == (B, H, K, v.shape[3]))
            )
        )
        ok = ok and all(t.is_floating_point() for t in (q, k, v, g, beta))
        ok = ok and all(
            t.device == q.device for t in (k, v, g, beta) + (() if initial_state is None else (initial_state,))
        )
    if not ok:
        raise ValueError(
            f"{where}: got q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)}, g {shape_of(g)}, beta {shape_of(beta)}, "
            f"initial_state {None if initial_state is None else shape_of(initial_state)}; allowed: floating-point "
            f"tensors on one device with q, k (B, T, H, K), v (B, T, H, V), g, beta (B, T, H), T >= 1, "
            f"initial_state (B, H, K, V) or None"
        )


# ----------------------------------------------------------------------------------------------------------------
# pure-PyTorch reference (chunked WY/UT form)
# ----------------------------------------------------------------------------------------------------------------


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dim (fla's in-kernel q/k normalisation)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated delta rule in pure PyTorch, chunked via the WY/UT form (math in the module doc).

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V); any floating dtypes, one device.
        g: (B, T, H) log-space decay (<= 0; ``a_t = exp(g_t)``). beta: (B, T, H), in (0, 1).
        scale: query scale, default ``K**-0.5``.
        initial_state: (B, H, K, V) entry state (``[K, V]`` convention) or None (zeros).
        output_final_state: also return the state after the last token.
        use_qk_l2norm: L2-normalise q and k over K first, ``x / sqrt(sum(x**2) + 1e-6)`` (fla's
            ``use_qk_l2norm_in_kernel=True``).
        chunk_size: positive int; the chunk length actually used is ``min(chunk_size, T)``. T is zero-padded
            internally to a multiple of it (padded k, v, q, beta = 0 and g = 0, which leaves outputs and the final
            state unchanged), so any T >= 1 works. The result does not depend on chunk_size (up to rounding).

    Computes in float32 (float64 if any input is float64) with autocast disabled; differentiable w.r.t. q, k, v, g,
    beta and initial_state (plain autograd through ``solve_triangular`` and matmuls).

    Returns:
        (o (B, T, H, V) in v.dtype, final_state (B, H, K, V) in the compute dtype (float32, or float64) or None).

    Raises:
        ValueError: bad shapes/devices/dtypes, T == 0, or chunk_size not a positive int.
    """
    _validate(q, k, v, g, beta, initial_state, chunk_size, "chunk_gated_delta_rule_reference")
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else float(scale)
    C = min(operator.index(chunk_size), T)
    n = -(-T // C)
    pad = n * C - T
    with no_autocast(q.device):
        qc, kc = q.to(cd), k.to(cd)
        if use_qk_l2norm:
            qc, kc = l2norm(qc), l2norm(kc)

        def chunks(x: Tensor) -> Tensor:
            # (B, T, H, ...) -> (B, H, n, C, ...), zero-padded on the time axis
            x = x.to(cd).transpose(1, 2)
            if pad:
                x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
            return x.reshape(B, H, n, C, *x.shape[3:])

        Q, Kx, Vx = chunks(qc * scale), chunks(kc), chunks(v)
        gam = chunks(g).cumsum(-1)  # (B, H, n, C): gamma_t
        bet = chunks(beta)  # (B, H, n, C)

        # pairwise decays exp(gamma_t - gamma_j), j > t masked before the exp
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        D = (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # (B,H,n,C,C)

        # UT transform: (I + A) [U | Wk] = [diag(beta) V | diag(beta Gamma) K], A strictly lower triangular
        kk = Kx @ Kx.transpose(-1, -2)
        A = (bet.unsqueeze(-1) * D * kk).tril(-1)
        Gam = gam.exp()
        rhs = torch.cat([bet.unsqueeze(-1) * Vx, (bet * Gam).unsqueeze(-1) * Kx], dim=-1)
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        U, Wk = sol[..., :V], sol[..., V:]  # (B,H,n,C,V), (B,H,n,C,K)

        P = (Q @ Kx.transpose(-1, -2)) * D  # diagonal included
        Qe = Gam.unsqueeze(-1) * Q - P @ Wk  # (B,H,n,C,K)
        PU = P @ U  # (B,H,n,C,V)

        Kd = (gam[..., -1:] - gam).exp().unsqueeze(-1) * Kx  # exp(gamma_C - gamma_j) k_j
        KdT = Kd.transpose(-1, -2)
        eye = torch.eye(K, dtype=cd, device=q.device)
        M = Gam[..., -1, None, None] * eye - KdT @ Wk  # (B,H,n,K,K)
        N = KdT @ U  # (B,H,n,K,V)

        # the only sequential part: S <- M_c S + N_c over chunks
        S = torch.zeros(B, H, K, V, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
        # chunk-major lists via one copy each (slicing M[:, :, c] per step would make autograd scatter every step's
        # gradient into a zero tensor of M's full size: O(n^2) memory traffic in the backward)
        Ms = M.permute(2, 0, 1, 3, 4).reshape(n, B * H, K, K).unbind(0)
        Ns = N.permute(2, 0, 1, 3, 4).reshape(n, B * H, K, V).unbind(0)
        S = S.reshape(B * H, K, V)
        entries = []
        for c in range(n):
            entries.append(S)
            S = torch.baddbmm(Ns[c], Ms[c], S)
        S0 = torch.stack(entries, dim=1).reshape(B, H, n, K, V)  # entry state of every chunk
        S = S.reshape(B, H, K, V)
        O = Qe @ S0 + PU  # (B,H,n,C,V)
        o = O.reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2).to(v.dtype)
    return o, (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------------------------


def _fla_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None if backend ``fla`` can run on (device, dtype), else why not."""
    reason = cuda_reason(device)
    if reason is not None:
        return reason
    fns, err = _fla.functions()
    if fns is None:
        return f"fla.ops.gated_delta_rule.chunk_gated_delta_rule is not importable ({err})"
    return _fla.dtype_reason(dtype)


def available_backends(device, dtype: torch.dtype = torch.float32) -> dict:
    """Map every concrete backend name to None (runs on (device, dtype)) or the reason it cannot. fla is imported only
    for a CUDA device with CUDA available."""
    device = torch.device(device)
    return {"reference": None, "fla": _fla_reason(device, dtype)}


def resolve_backend(name: str, device, dtype: torch.dtype) -> str:
    """Concrete GDN backend for q/k/v on ``device`` with compute dtype ``dtype``.

    ``"auto"``: ``fla`` on a CUDA device when ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` imports and the
    kernel accepts ``dtype`` (float16/bfloat16, and float32 unless the installed fla refuses it -- fla-core 0.6.0
    accepts it, the 0.2/0.3 line asserts "ChunkGatedDeltaRuleFunction does not support float32"), else
    ``reference``. Falling back on CUDA *only* because of the dtype warns once per dtype. ``"reference"`` always
    runs. ``"fla"`` is returned when it can run here. On the ``meta`` device ``name`` is returned unchecked.

    Raises:
        ConfigError("model.kernels.gdn", name, allowed): unknown name, or ``fla`` on CPU / without an importable
        fla / with a dtype its kernel refuses; ``allowed`` says what runs here and why ``fla`` does not.
    """
    dev = torch.device(device)
    bf16_ok = name != "reference" and dev.type == "cuda" and _fla_reason(dev, torch.bfloat16) is None
    hint = "; enable bf16 mixed precision (trainer.precision=bf16-mixed) to use fla" if bf16_ok else ""
    be = resolve_fast_or_reference(name, device, dtype, key=CONFIG_KEY, fast="fla", reason=_fla_reason, hint=hint)
    if name == "auto" and be == "reference" and bf16_ok and dtype not in _warned_dtype:  # refused only for its dtype
        _warned_dtype.add(dtype)
        warnings.warn(
            f"canonlm: GDN kernels.gdn=auto uses the slow pure-PyTorch reference on CUDA because "
            f"{_fla_reason(dev, dtype)}{hint}",
            RuntimeWarning,
            stacklevel=2,
        )
    return be


_select = make_selector(resolve_backend, meta_auto="reference")


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str = "auto",
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """GDN token mixing (gated delta rule, Yang et al. 2025): see the module doc for the recurrence.

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V) (any T >= 1: prefill, T=1 decode steps, T not a multiple of chunk_size).
        g: (B, T, H) log-space decay (<= 0), e.g. ``-exp(A_log) * softplus(a_proj(x) + dt_bias)`` in fp32.
        beta: (B, T, H) in (0, 1), e.g. ``sigmoid(b_proj(x))``.
        scale: query scale, default ``K**-0.5``.
        initial_state: (B, H, K, V) (``[K, V]`` convention, fla's layout) or None.
        output_final_state: also return the state after the last token (decode cache / chunked prefill).
        use_qk_l2norm: L2-normalise q and k over K first (``x / sqrt(sum(x**2) + 1e-6)``; fla's
            ``use_qk_l2norm_in_kernel=True``, the GDN2 setting).
        chunk_size: positive int; the reference's chunk length. fla uses its own chunk size (64).
        backend: one of :data:`BACKENDS` (see :func:`resolve_backend`); the dtype checked is
            ``promote_types(q, k, v)``. ``auto`` also falls back to the reference for key head dims fla refuses
            (:func:`fla_shape_reason`).
        cu_seqlens, cu_seqlens_cpu: int64 (N + 1,) cumulative lengths of N sequences concatenated in a batch of 1
            (on q's device and on the CPU; :func:`canonlm.ops.varlen.cu_seqlens_of`), or None: the state restarts
            from zero at each sequence start. Needs B == 1, no ``initial_state``, ``output_final_state=False``.

    Returns:
        (o (B, T, H, V) in v.dtype, final_state (B, H, K, V) float32 -- float64 for float64 inputs on the reference
        -- or None).

    Raises:
        ValueError: bad shapes/devices/dtypes, T == 0, chunk_size not a positive int, or ``fla`` with K > 256.
        ConfigError: unknown or unavailable backend (raised before any work).
    """
    _validate(q, k, v, g, beta, initial_state, chunk_size, "chunk_gated_delta_rule")
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    be = _select(backend, str(q.device), dtype)
    if be == "fla" and fla_shape_reason(q.shape[-1]) is not None:
        if backend != "auto":
            raise ValueError(f"chunk_gated_delta_rule: backend 'fla' cannot run: {fla_shape_reason(q.shape[-1])}")
        be = "reference"  # auto: the shape fallback (CanonLM reports it once, at build time)
    if cu_seqlens is not None:
        varlen.check_varlen_call(
            "chunk_gated_delta_rule", q, cu_seqlens, cu_seqlens_cpu, initial_state, output_final_state
        )
        if be == "fla":
            scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
            return _fla.forward_varlen(q, k, v, g, beta, scale, bool(use_qk_l2norm), cu_seqlens, cu_seqlens_cpu), None
        packed, valid = zip(*(varlen.pack(t, cu_seqlens_cpu) for t in (q, k, v, g, beta)))
        o, _ = chunk_gated_delta_rule_reference(
            *packed, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
        )
        return varlen.unpack(o, valid[0]), None
    if be == "fla":
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _fla.forward(q, k, v, g, beta, scale, initial_state, bool(output_final_state), bool(use_qk_l2norm))
    return chunk_gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )
