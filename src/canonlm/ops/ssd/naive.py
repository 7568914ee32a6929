"""Mamba2's SSD as a plain loop over tokens: the selective state-space recurrence written straight from its
definition, kept beside the chunked reference and mamba-ssm's kernels as their oracle. It shares no code with
:mod:`canonlm.ops.ssd`. Used by the tests, ``bench/`` and ``python -m canonlm.selfcheck``; never by a model."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def ssd_loop(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = (0.0, float("inf")),
    initial_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The Mamba2 scan one token at a time (Dao and Gu 2024, "Transformers are SSMs", the selective SSM with a scalar
    ``A`` per head), per batch row and head h, with group ``h // (H / G)`` supplying B and C::

        Δ_t = clamp(softplus(dt_t + dt_bias_h), *dt_limit)     (no softplus when dt_softplus is False)
        H_t = exp(Δ_t A_h) H_{t-1} + Δ_t x_t B_t^T             (H_t in R^{P x N}, H_0 = initial_state or 0)
        y_t = H_t C_t + D_h x_t

    softplus is written out, linear above 20 as in PyTorch and the mamba-ssm kernels.

    Args:
        x: (B, T, H, P); dt: (B, T, H) raw time step; A: (H,) negative; B, C: (B, T, G, N) with H % G == 0.
        D: (H,) or (H, P) or None; dt_bias: (H,) or None; dt_limit: (lo, hi); initial_state: (B, H, P, N) or None.
    Returns:
        ``(y (B, T, H, P), H_T (B, H, P, N))`` in float64: every input is upcast first. Differentiable w.r.t.
        every tensor argument.
    """
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    rep = H // G
    delta = dt if dt_bias is None else dt + dt_bias.double()
    if dt_softplus:
        delta = torch.where(delta > 20.0, delta, torch.log1p(torch.exp(delta.clamp(max=20.0))))
    delta = torch.clamp(delta, dt_limit[0], dt_limit[1])
    h = (
        torch.zeros(Bsz, H, P, N, dtype=torch.float64, device=x.device)
        if initial_state is None
        else initial_state.double()
    )
    ys = []
    for t in range(T):
        Bt = B[:, t].repeat_interleave(rep, dim=1)  # (B, H, N): head h -> group h // rep
        Ct = C[:, t].repeat_interleave(rep, dim=1)
        d = delta[:, t]  # (B, H)
        h = torch.exp(d * A)[:, :, None, None] * h + (d[:, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        y = (h * Ct[:, :, None, :]).sum(-1)  # (B, H, P)
        if D is not None:
            y = y + D.double().reshape(H, -1) * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1), h
