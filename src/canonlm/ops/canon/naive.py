"""The Canon conv as a plain loop over time and taps: the slowest, most literal form, kept beside the fast paths
as an oracle (like flash-linear-attention's ``naive.py`` files). Used by the tests, ``bench/`` and ``python -m
canonlm.selfcheck``; never by a model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def canon_loop(
    x: Tensor,
    w: Tensor,
    b: Optional[Tensor] = None,
    residual: bool = True,
    activation: bool = False,
    init: Optional[Tensor] = None,
) -> Tensor:
    """``y_t = [x_t +] act(b + sum_i w[:, i] * x_{t-K+1+i})`` by a plain Python loop over time and taps (the Canon
    layer, Allen-Zhu, Physics of Language Models Part 4.1, Sec. 4, eq. (4.1); act = SiLU when ``activation``).

    Args:
        x: (B, T, C) channel-last inputs. w: (C, K) taps, ``w[:, K-1]`` on the current token, ``w[:, 0]`` on the
            token K-1 back. b: (C,) or None. residual: add x_t. activation: SiLU after the sum.
        init: (B, C, K-1) the K-1 inputs before x (oldest first, column K-2 = time -1), or None for zeros.
    Returns:
        (B, T, C), computed in the dtype the inputs promote to (pass float64 tensors for an oracle; a float32 call
        stands in for a float32 kernel). Differentiable w.r.t. every tensor argument.
    """
    B, T, C = x.shape
    K = w.shape[1]
    hist = [init[:, :, j] for j in range(K - 1)] if init is not None else [x.new_zeros(B, C)] * (K - 1)
    seq = hist + [x[:, t] for t in range(T)]  # seq[t + K - 1] = x_t
    out = []
    for t in range(T):
        z = b.expand(B, C) if b is not None else x.new_zeros(B, C)
        for i in range(K):
            z = z + w[:, i] * seq[t + i]
        if activation:
            z = z * torch.sigmoid(z)
        out.append(x[:, t] + z if residual else z)
    return torch.stack(out, dim=1)
