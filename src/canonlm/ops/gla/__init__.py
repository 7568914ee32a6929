"""GLA op: gated linear attention with a per-key-channel forget gate (Yang et al. 2024; ``fla.ops.gla.chunk_gla``).

Public API (the GLA mixer calls only these names)::

    chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64, backend="auto")
    chunk_gla_reference(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64)
    resolve_backend(name, device, dtype) -> str
    BACKENDS, CONFIG_KEY

Math (fla convention), per batch row and head, state ``S in R^{K x V}``, ``s = scale`` (default ``K**-0.5``)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T          S_0 = initial_state (or 0)
    o_t = S_t^T (s * q_t)

with q, k, g of shape (B, T, H, K), v (B, T, H, V); ``g`` is the log-space forget gate (<= 0 for a decay, e.g.
``logsigmoid(x) / 16``), one value per key channel.

Backends (``model.kernels.gla`` in the config and in errors):

* ``reference`` -- :func:`chunk_gla_reference`, the chunked pure-PyTorch algorithm below (CPU and any device).
* ``fla``       -- fla's Triton ``chunk_gla`` (training, prefill), ``fused_recurrent_gla`` for short no-grad calls
  (decode); CUDA only (see ``_fla.py``).
* ``auto``      -- ``fla`` on a CUDA device when ``fla.ops.gla`` imports and dtype is float16/bfloat16/float32, else
  ``reference``.

Reference algorithm (Yang et al. 2024). Time is cut into chunks of C = ``chunk_size`` positions; inside a chunk, with
entry state ``S_0`` and the in-chunk cumulative log-gate ``b_t = sum_{j<=t} g_j`` (per key channel)::

    o_t   = (s q_t * exp(b_t))^T S_0  +  sum_{j<=t} [sum_c s q_{t,c} k_{j,c} exp(b_{t,c} - b_{j,c})] v_j
    S_C   = diag(exp(b_C)) S_0 + sum_j (k_j * exp(b_C - b_j)) v_j^T

The only sequential part is the loop over chunks for ``S``; everything else is batched over all chunks. Every
exponent is <= 0 (g <= 0 makes b non-increasing), so nothing overflows. The intra-chunk pairwise decays
``exp(b_t - b_j)`` (j <= t) are never materialised as a (C, C, K) tensor per chunk: the chunk's lower triangle is
split recursively in halves; for the block "second half R x first half L" every j in L precedes every t in R, so
with the pivot ``r = b`` at the last position of L (``b_t <= r <= b_j``)::

    exp(b_t - b_j) = exp(b_t - r) * exp(r - b_j),   both factors <= 1,

and the block is one matmul ``(s q_R * exp(b_R - r)) (k_L * exp(r - b_L))^T``. If a factor underflows, the exact
product is smaller still, so the split is as safe as masking the upper triangle before ``exp``. The diagonal
(j = t) needs no decay. Cost: log2(C) levels of O(T K) elementwise work plus the usual O(T C K) matmuls; memory
O(T (K + V) + T/C K V). Chunks whose length is not a power of two are padded at their end with "null" positions
(q = k = v = 0, g = 0), which leave the state unchanged; T is padded the same way to a multiple of C.

Variable-length input (``cu_seqlens``, fla's convention: batch 1, the sequences concatenated along T): the state
starts at zero at every ``cu_seqlens[n]`` (document masking). ``fla`` passes ``cu_seqlens`` / ``cu_seqlens_cpu`` to
``chunk_gla``; ``reference`` runs the sequences as one zero-padded batch (:func:`canonlm.ops.varlen.pack`).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from canonlm.ops import varlen
from canonlm.ops._dispatch import compute_dtype, cuda_reason, make_selector, no_autocast, resolve_fast_or_reference

from . import _fla

__all__ = ["BACKENDS", "CONFIG_KEY", "available_backends", "chunk_gla", "chunk_gla_reference", "resolve_backend"]

BACKENDS = ("auto", "reference", "fla")
CONFIG_KEY = "model.kernels.gla"
_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool):
        raise ValueError(f"chunk_gla: chunk_size={chunk_size!r}; allowed: a positive int")
    try:
        c = operator.index(chunk_size)
    except TypeError:
        raise ValueError(f"chunk_gla: chunk_size={chunk_size!r}; allowed: a positive int") from None
    if c < 1:
        raise ValueError(f"chunk_gla: chunk_size={chunk_size!r}; allowed: a positive int")
    return c


def _validate(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor]) -> None:
    """One ValueError naming every shape when q, k, g (B, T, H, K), v (B, T, H, V), initial_state (B, H, K, V) or
    None do not fit together (T >= 1, K >= 1, V >= 1, floating dtypes, one device)."""
    ts = {"q": q, "k": k, "v": v, "g": g, "initial_state": initial_state}
    ok = all(isinstance(t, Tensor) for n, t in ts.items() if n != "initial_state" or t is not None)
    if ok:
        ok = (
            q.dim() == 4
            and k.shape == q.shape
            and g.shape == q.shape
            and v.dim() == 4
            and v.shape[:3] == q.shape[:3]
            and q.shape[1] >= 1
            and q.shape[3] >= 1
            and v.shape[3] >= 1
        )
    if ok and initial_state is not None:
        ok = tuple(initial_state.shape) == (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    if ok:
        ok = all(t.is_floating_point() and t.device == q.device for t in ts.values() if t is not None)
    if not ok:
        desc = ", ".join(
            f"{n} {tuple(t.shape)} {t.dtype} {t.device}" if isinstance(t, Tensor) else f"{n} {t!r}"
            for n, t in ts.items()
        )
        raise ValueError(
            f"chunk_gla: bad inputs ({desc}); allowed: q, k, g (B, T, H, K) with T >= 1, v (B, T, H, V), "
            f"initial_state (B, H, K, V) or None; floating dtypes, all on one device"
        )


# ----------------------------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------------------------


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous. A loss like ``o.sum()`` sends an expanded
    (stride-0) gradient, and a transposed/sliced output a strided one; ``bmm`` on such batches falls back to a slow
    per-matrix path on CPU (measured two orders of magnitude slower for (256, 64, 64) batches)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _chunks(x: Tensor, T: int, N: int, C: int, C2: int) -> Tensor:
    """(B, T, H, D) -> (B, H, N, C2, D): transpose, zero-pad T to N*C, split into N chunks of C, zero-pad each chunk
    to C2 positions."""
    B, _, H, D = x.shape
    x = x.transpose(1, 2)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, N * C - T))
    x = x.reshape(B, H, N, C, D)
    if C2 != C:
        x = F.pad(x, (0, 0, 0, C2 - C))
    return x.contiguous()


def _pair_blocks(x: Tensor, P: int, u: int) -> Tensor:
    """View of the "R x L" blocks of square matrices x (..., C2, C2) at split level u: for each of the P parent
    blocks of 2u positions on the diagonal, its lower-left u x u block (rows = second half R, cols = first half L).
    Returns a strided (..., u, u, P) view (writable)."""
    lead = x.shape[:-2]
    d = torch.diagonal(x.view(*lead, P, 2, u, P, 2, u), dim1=-6, dim2=-3)  # (..., 2, u, 2, u, P)
    return d[..., 1, :, 0, :, :]


def _levels(C2: int):
    """(P, u) per split level, coarse to fine: P parent blocks of 2u positions, halves of u."""
    u = C2 // 2
    while u >= 1:
        yield C2 // (2 * u), u
        u //= 2


def _halves(qs: Tensor, k: Tensor, b: Tensor, P: int, u: int):
    """For split level (P, u): pivot-decayed ``qs_R * exp(b_R - r)``, ``k_L * exp(r - b_L)`` (..., P, u, K) and the
    two factors, with r = b at the last position of L (all exponents <= 0 for non-increasing b)."""
    lead, K = qs.shape[:-2], qs.shape[-1]
    b6 = b.view(*lead, P, 2, u, K)
    bL, bR = b6[..., 0, :, :], b6[..., 1, :, :]
    r = bL[..., u - 1 : u, :]
    eR, eL = torch.exp(bR - r), torch.exp(r - bL)
    qR = qs.view(*lead, P, 2, u, K)[..., 1, :, :] * eR
    kL = k.view(*lead, P, 2, u, K)[..., 0, :, :] * eL
    return qR, kL, eR, eL


def _small_mm(a: Tensor, bt: Tensor) -> Tensor:
    """a (..., m, n) @ bt(..., p, n)^T for tiny m, p (1, 2): elementwise (batched BLAS on 1x1 / 2x2 blocks is slow)."""
    return (a.unsqueeze(-2) * bt.unsqueeze(-3)).sum(-1)


class _IntraChunk(torch.autograd.Function):
    """Intra-chunk GLA output ``o_t = sum_{j<=t} A_tj v_j``, ``A_tj = sum_c qs_{t,c} k_{j,c} exp(b_{t,c} - b_{j,c})``.

    Inputs qs, k, b (..., C2, K), v (..., C2, V), contiguous, one float dtype, C2 a power of two, b non-increasing
    along C2 (in-chunk cumulative log-gate). Forward builds A (..., C2, C2) block by block with the pivot splits
    (module docstring) and returns A @ v; saves qs, k, v, b and A. Backward (hand-written, so autograd does not keep
    per-level temporaries): dA = do v^T, dv = A^T do, then per level ``dq_R += (dA_RL k~_L) * exp(b_R - r)``,
    ``dk_L += (dA_RL^T q~_R) * exp(r - b_L)`` plus the diagonal terms, and ``db = qs * dq - k * dk`` (d/db_t of
    exp(b_t - b_j) is +1, of exp(b_j' - b_t) is -1; the diagonal terms cancel). Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, qs: Tensor, k: Tensor, v: Tensor, b: Tensor) -> Tensor:
        C2 = qs.shape[-2]
        A = qs.new_zeros(*qs.shape[:-1], C2)
        A.diagonal(dim1=-2, dim2=-1).copy_((qs * k).sum(-1))
        for P, u in _levels(C2):
            qR, kL, _, _ = _halves(qs, k, b, P, u)
            blk = _small_mm(qR, kL) if u <= 2 else torch.matmul(qR, kL.transpose(-1, -2))  # (..., P, u, u)
            _pair_blocks(A, P, u).copy_(blk.movedim(-3, -1))
        ctx.save_for_backward(qs, k, v, b, A)
        return torch.matmul(A, v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do: Tensor):
        qs, k, v, b, A = ctx.saved_tensors
        lead, (C2, K) = qs.shape[:-2], qs.shape[-2:]
        do = do.contiguous()
        dA = torch.matmul(do, v.transpose(-1, -2))  # only the lower triangle is read below
        dv = torch.matmul(A.transpose(-1, -2), do)
        dd = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        dq, dk = dd * k, dd * qs
        for P, u in _levels(C2):
            qR, kL, eR, eL = _halves(qs, k, b, P, u)
            dAb = _pair_blocks(dA, P, u).movedim(-1, -3)  # (..., P, u, u) strided
            if u <= 2:
                gq = (dAb.unsqueeze(-1) * kL.unsqueeze(-3)).sum(-2)
                gk = (dAb.unsqueeze(-1) * qR.unsqueeze(-2)).sum(-3)
            else:
                dAb = dAb.contiguous()
                gq = torch.matmul(dAb, kL)
                gk = torch.matmul(dAb.transpose(-1, -2), qR)
            dq.view(*lead, P, 2, u, K)[..., 1, :, :].addcmul_(gq, eR)
            dk.view(*lead, P, 2, u, K)[..., 0, :, :].addcmul_(gk, eL)
        db = qs * dq - k * dk
        return dq, dk, dv, db


def chunk_gla_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """Chunked pure-PyTorch GLA (algorithm in the module docstring). The CPU path and the oracle
    of the fused kernels.

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V); g: (B, T, H, K) log-space forget gate (<= 0; positive values are
            accepted, but then the decay factors grow and can overflow). Any T >= 1; any float dtypes, one device.
        scale: query scale, default ``K ** -0.5``.
        initial_state: (B, H, K, V) state before the first token (continuation / decode), or None for zeros.
        output_final_state: also return the state after the last token.
        chunk_size: positive int C, the length of the state-passing chunks (results do not depend on it beyond
            rounding). ``min(C, T)`` is used, so T=1 decode steps cost one position.

    Returns:
        ``(o, final_state)``: o (B, T, H, V) in v.dtype; final_state (B, H, K, V) in the compute dtype or None.
        The compute dtype is float64 if any of q, k, v, g is float64, else float32 (bf16/fp16 inputs are upcast;
        autocast is disabled inside). Differentiable w.r.t. q, k, v, g and initial_state.

    Raises:
        ValueError: bad shapes/dtypes/devices (one message naming all of them) or a non-positive chunk_size.
    """
    C = _check_chunk_size(chunk_size)
    _validate(q, k, v, g, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype(q, k, v, g)
    s = float(K**-0.5 if scale is None else scale)
    with no_autocast(q.device):
        C = min(C, T)
        N = -(-T // C)
        C2 = _next_pow2(C)
        qc, kc, vc, gc = (_chunks(t.to(cd), T, N, C, C2) for t in (q, k, v, g))  # (B, H, N, C2, .)
        qs = qc * s
        b = gc.cumsum(-2)  # in-chunk cumulative log-gate; null positions (g = 0) keep it flat
        o = _IntraChunk.apply(qs, kc, vc, b)

        # state recurrence over chunks: S_n = diag(exp(bC_n)) S_{n-1} + U_n
        bC = b[..., -1:, :]  # (B, H, N, 1, K) total log-gate of each chunk
        U = torch.matmul((kc * torch.exp(bC - b)).transpose(-1, -2), vc)  # (B, H, N, K, V)
        decay = torch.exp(bC).transpose(-1, -2)  # (B, H, N, K, 1)
        S = None if initial_state is None else initial_state.to(cd)
        entry = []
        for Un, dn in zip(U.unbind(2), decay.unbind(2)):
            entry.append(S)
            S = Un if S is None else torch.addcmul(Un, dn, S)
        if initial_state is None:
            entry[0] = torch.zeros_like(U[:, :, 0])
        if N > 1 or initial_state is not None:
            o = o + torch.matmul(qs * torch.exp(b), torch.stack(entry, dim=2))
        o = _ContiguousGrad.apply(o)
        o = o[..., :C, :].reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).to(v.dtype)
    return o, (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------------------------


def _fla_unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None if fla's GLA kernels can run on (device, dtype), else why not."""
    reason = cuda_reason(device)
    if reason is not None:
        return reason + " (fla's Triton kernels have no CPU driver)"
    if dtype not in _FLA_DTYPES:
        return f"supports float16, bfloat16 and float32 inputs (got {dtype})"
    fns, err = _fla.fla_functions()
    return None if fns is not None else f"fla.ops.gla is not importable ({err})"


def available_backends(device, dtype: torch.dtype = torch.float32) -> dict:
    """Map every concrete backend name to None (runs on (device, dtype)) or the reason it cannot. fla is imported only
    for a CUDA device with CUDA available."""
    device = torch.device(device)
    return {"reference": None, "fla": _fla_unavailable_reason(device, dtype)}


def resolve_backend(name: str, device, dtype: torch.dtype) -> str:
    """Concrete GLA backend for tensors on ``device`` with ``dtype``.

    ``"auto"``: ``fla`` on a CUDA device when ``fla.ops.gla`` imports (float16/bfloat16/float32), else
    ``reference``. ``"reference"`` always runs. ``"fla"`` is returned when it can run here. On the ``meta`` device
    (shape-only model construction) ``name`` is returned unchanged once it is known (``auto`` stays ``auto``).

    Raises:
        ConfigError("model.kernels.gla", name, allowed): unknown name, or ``fla`` where it cannot run (not CUDA,
        fla/triton not importable, float64) -- raised before any work; ``allowed`` says what runs here and why.
    """
    return resolve_fast_or_reference(name, device, dtype, key=CONFIG_KEY, fast="fla", reason=_fla_unavailable_reason)


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------

_select = make_selector(resolve_backend)


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """GLA op: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale * q_t)``.

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V); g: (B, T, H, K) log-space forget gate (<= 0), per key channel (fla
            convention). Any T >= 1: T=1 decode steps and T not a multiple of chunk_size included.
        scale: default ``K ** -0.5``.
        initial_state: (B, H, K, V) state to continue from (multi-token continuation, decode), or None.
        output_final_state: also return the state after the last token.
        chunk_size: positive int, chunk length of the reference (fla's kernels use their own fixed chunking).
        backend: one of :data:`BACKENDS` (see :func:`resolve_backend`); selected from q's device and dtype.
        cu_seqlens: int64 (N + 1,) cumulative lengths of N sequences concatenated in a batch of 1 (fla's varlen
            convention; :func:`canonlm.ops.varlen.cu_seqlens_of`), or None. The state restarts from zero at each
            sequence start (document masking). Needs B == 1, no ``initial_state`` and ``output_final_state=False``.
        cu_seqlens_cpu: the same on the CPU (required with ``cu_seqlens``: the reference sizes its batch from it,
            fla builds its chunk indices from it without a device sync).

    Returns:
        ``(o (B, T, H, V) in v.dtype, final_state (B, H, K, V) or None)``; final_state is float32 (float64 from the
        reference when an input is float64). fla: ``chunk_gla`` (differentiable), or ``fused_recurrent_gla`` when
        T <= 64 and ``torch.is_grad_enabled()`` is False.

    Raises:
        ValueError: bad shapes/dtypes/devices, or chunk_size not a positive int.
        ConfigError: unknown backend, or ``fla`` where it cannot run (see :func:`resolve_backend`).
    """
    _check_chunk_size(chunk_size)
    _validate(q, k, v, g, initial_state)
    be = _select(backend, str(q.device), q.dtype)
    if cu_seqlens is not None:
        varlen.check_varlen_call("chunk_gla", q, cu_seqlens, cu_seqlens_cpu, initial_state, output_final_state)
        if be == "fla":
            s = float(q.shape[-1] ** -0.5 if scale is None else scale)
            return _fla.fla_forward_varlen(q, k, v, g, s, cu_seqlens, cu_seqlens_cpu), None
        packed, valid = zip(*(varlen.pack(t, cu_seqlens_cpu) for t in (q, k, v, g)))
        o, _ = chunk_gla_reference(*packed, scale=scale, chunk_size=chunk_size)
        return varlen.unpack(o, valid[0]), None
    if be == "fla":
        s = float(q.shape[-1] ** -0.5 if scale is None else scale)
        return _fla.fla_forward(q, k, v, g, s, initial_state, output_final_state)
    return chunk_gla_reference(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )
