"""GLA as a plain loop over tokens: the recurrence written straight from its definition, kept beside the chunked
reference and fla's kernels as their oracle. It shares no code with :mod:`canonlm.ops.gla`. Used by the tests,
``bench/`` and ``python -m canonlm.selfcheck``; never by a model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def gla_loop(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None, initial_state: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Gated linear attention one token at a time (Yang et al. 2024, "Gated Linear Attention Transformers with
    Hardware-Efficient Training", the recurrent form; fla's ``[K, V]`` state layout)::

        S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,      S_0 = initial_state (or 0)
        o_t = S_t^T (scale * q_t)

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V); g: (B, T, H, K) log-space forget gate, one value per key channel.
        scale: default ``K ** -0.5``. initial_state: (B, H, K, V) or None.
    Returns:
        ``(o (B, T, H, V), S_T (B, H, K, V))`` in float64: every input is upcast first. Differentiable w.r.t. every
        tensor argument (autograd through the loop is the gradient oracle).
    """
    q, k, v, g = (t.double() for t in (q, k, v, g))
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K**-0.5 if scale is None else scale
    S = (
        torch.zeros(B, H, K, V, dtype=torch.float64, device=q.device)
        if initial_state is None
        else initial_state.double()
    )
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append((S * (s * q[:, t]).unsqueeze(-1)).sum(-2))  # S^T (s q): sum over K
    return torch.stack(outs, dim=1), S
