"""The gated delta rule as a plain loop over tokens: the recurrence written straight from its definition, kept beside
the chunked WY/UT reference and fla's kernels as their oracle. It shares no code with :mod:`canonlm.ops.gdn`. Used by
the tests, ``bench/`` and ``python -m canonlm.selfcheck``; never by a model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def gdn_loop(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule one token at a time (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks: Improving
    Mamba2 with Delta Rule", ``S_t = S_{t-1} a_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`` in their ``[V, K]``
    layout), written in fla's ``[K, V]`` state layout per batch row and head::

        q, k <- x / sqrt(sum(x**2) + 1e-6)                  (use_qk_l2norm only; fla's in-kernel normalisation)
        a_t = exp(g_t);   w_t = beta_t (v_t - a_t S_{t-1}^T k_t)
        S_t = a_t S_{t-1} + k_t w_t^T;    o_t = S_t^T (scale q_t)

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V); g: (B, T, H) log-space decay; beta: (B, T, H).
        scale: default ``K ** -0.5``. initial_state: (B, H, K, V) or None (zeros).
    Returns:
        ``(o (B, T, H, V), S_T (B, H, K, V))`` in float64: every input is upcast first. Differentiable w.r.t. every
        tensor argument.
    """
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = (
        torch.zeros(B, H, K, V, dtype=torch.float64, device=q.device)
        if initial_state is None
        else initial_state.double()
    )
    outs = []
    for t in range(T):
        a = g[:, t].exp()  # (B, H)
        kt, vt, qt = k[:, t], v[:, t], q[:, t] * scale  # (B, H, K|V)
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)  # S^T k
        w = beta[:, t, :, None] * (vt - a[..., None] * pred)
        S = a[..., None, None] * S + kt[..., :, None] * w[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(outs, dim=1), S
