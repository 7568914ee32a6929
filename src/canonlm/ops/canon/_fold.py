"""The Canon residual folded into the weight (shared by the torch path and the CUDA wrappers)."""

from __future__ import annotations

import torch
from torch import Tensor


def fold_residual(weight: Tensor) -> Tensor:
    """``weight + e_{K-1}``: the Canon residual folded into the current-token tap.

    Without an activation, ``x_t + b + sum_i w[:, i] * x_{t-K+1+i}`` equals the same convolution with ``w[:, K-1] + 1``
    in place of ``w[:, K-1]`` (the residual adds x_t once, and tap K-1 multiplies x_t), so a kernel computes Canon in
    one pass: no separate add in the forward, and no ``dx + dy`` sum of the residual's gradient in the backward
    (autograd would otherwise add the kernel's dx and the residual's dy in a separate kernel). The history taps, the
    bias and an initial state are untouched; the gradient of the folded weight is the gradient of ``weight``.

    Args: weight (C, K), any floating dtype. Returns a new (C, K) tensor of weight's dtype (differentiable).
    """
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"fold_residual: weight.shape={tuple(weight.shape)}; allowed: (C, K) with K >= 1")
    return torch.cat([weight[:, :-1], weight[:, -1:] + 1], dim=1)
