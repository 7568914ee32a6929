"""Softmax attention as plain loops over batch rows, heads, queries and keys: the definition written out, kept beside
the matrix reference, SDPA and flash-attn as their oracle. It shares no code with :mod:`canonlm.ops.attention`. Used
by the tests; never by a model."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def attention_loop(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """``o_i = sum_j softmax_j(scale q_i . k_j) v_j`` over the keys query i may see (Vaswani et al. 2017, scaled
    dot-product attention), one (batch row, head, query) at a time.

    Args:
        q: (B, T, H, D); k, v: (B, S, H_kv, D) with ``H % H_kv == 0``; query head h uses kv head ``h // (H / H_kv)``
            (grouped-query attention). causal: query i sees keys ``0 .. i + S - T`` (bottom-right aligned; ``j <= i``
            when S == T), else all S keys. scale: default ``D ** -0.5``.
    Returns:
        (B, T, H, D) in float64 (every input is upcast first).
    """
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(B, T, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(T):
                n = i + S - T + 1 if causal else S
                s = torch.stack([(q[b, i, h] * k[b, j, g]).sum() * scale for j in range(n)])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[b, i, h] = sum(p[j] * v[b, j, g] for j in range(n))
    return out
