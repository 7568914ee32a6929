"""Canon op: residual causal depthwise 1-D convolution (paper eq. 4.1; spec models.md §1.1, §4.1).

CONTRACT (owned by the ops/canon author; other modules call only these names):

    causal_conv1d(x, weight, bias=None, *, residual=True, activation=False, backend="auto") -> Tensor
        x:      (B, T, C), any float dtype; channel-last (the C axis has stride 1 when contiguous).
        weight: (C, K); weight[:, K-1] multiplies the current token, weight[:, 0] the token K-1 steps back.
        bias:   (C,) or None.
        returns (B, T, C), same dtype as x:  y_t = [x_t +] act(b + sum_i weight[:, i] * x_{t-K+1+i}),  x_{<0} = 0.
        backend: "auto" | "reference" | op-specific fast paths.

This file currently holds only the reference; the fast paths are added by the ops/canon owner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            residual: bool = True, activation: bool = False) -> torch.Tensor:
    """Oracle: ``F.conv1d`` on a left-zero-padded (B, C, T) view. Shapes as in :func:`causal_conv1d`."""
    C, K = weight.shape
    xt = x.transpose(1, 2)
    y = F.conv1d(F.pad(xt, (K - 1, 0)), weight.unsqueeze(1), bias, groups=C).transpose(1, 2)
    if activation:
        y = F.silu(y)
    return x + y if residual else y


def causal_conv1d(x, weight, bias=None, *, residual=True, activation=False, backend="auto"):
    """Dispatch point; see the module docstring for shapes."""
    return causal_conv1d_reference(x, weight, bias, residual=residual, activation=activation)
