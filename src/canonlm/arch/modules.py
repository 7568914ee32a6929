"""Building blocks of LlamaCanon: RMSNorm and the (gated or standard) MLP with Canon-D (spec models.md §1.2, §2)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.canon import Canon
from canonlm.arch.config import CanonConfig, ConfigError

ACTIVATIONS = ("silu", "relu2", "gelu")


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2, -1) + eps) * g`` over the last dim, computed in float32 (models.md §2 "norm").

    Args:
        dim: normalised width (last dim of the input).
        eps: added to the mean square (``model.norm_eps``; 1e-6 HF-style presets, 1e-5 lingua recipes).
    Parameters: ``weight (dim,)`` learnable gain, initialised to 1.
    Forward: ``x (..., dim)`` any float dtype -> same shape and dtype as ``x`` (``F.rms_norm`` on the fp32 upcast,
    outside autocast's dtype policy).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)  # at least fp32 (bf16/fp16 upcast; fp64 stays fp64)
        return F.rms_norm(x.to(dt), (self.dim,), self.weight.to(dt), self.eps).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """``silu`` | ``relu2`` (``relu(x)**2``, paper Result 5) | ``gelu`` (exact erf form). ValueError otherwise."""
    if name == "silu":
        return F.silu(x)
    if name == "relu2":
        return F.relu(x).square()
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"activation={name!r}: allowed {' | '.join(ACTIVATIONS)}")


class MLP(nn.Module):
    """Feed-forward sub-layer with optional Canon-D (models.md §1.2, §2 "MLP"; paper Result 5).

    ``gated`` (SwiGLU, Llama): one fused ``w13 = Linear(d, 2·d_ff)`` whose output is ``[W1 x ; W3 x]`` (gate first,
    then up; the same parameter count as two Linears), Canon-D on those ``2·d_ff`` channels, then
    ``w2(act(gate) ⊙ up)`` with ``w2 = Linear(d_ff, d)``.
    ``standard`` ("GPT2(RoPE)"): ``w1 = Linear(d, d_ff)``, Canon-D on the ``d_ff`` channels, ``w2(act(.))``.
    No biases anywhere. Parameters: gated ``3·d·d_ff``, standard ``2·d·d_ff`` (+ Canon-D ``K·width``).

    Args:
        d_model, d_ff: widths; kind: ``gated`` | ``standard``; act: ``silu`` | ``relu2`` | ``gelu``;
        canon: Canon config; Canon-D is built iff ``"D" in canon.set``; canon_backend: its backend name.
    Forward: ``x (B, T, d)`` -> ``(B, T, d)`` (compute dtype). Raises ConfigError on a bad kind/act.
    """

    def __init__(self, d_model: int, d_ff: int, kind: str = "gated", act: str = "silu",
                 canon: CanonConfig | None = None, canon_backend: str = "auto"):
        super().__init__()
        if kind not in ("gated", "standard"):
            raise ConfigError("model.mlp", kind, "gated | standard")
        if act not in ACTIVATIONS:
            raise ConfigError("model.mlp_act", act, " | ".join(ACTIVATIONS))
        self.kind, self.act, self.d_ff = kind, act, d_ff
        up = 2 * d_ff if kind == "gated" else d_ff
        self.w13 = nn.Linear(d_model, up, bias=False)  # gated: [W1 ; W3]; standard: W1
        self.canon_d = Canon(up, canon, canon_backend) if canon is not None and canon.has("D") else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gated" and self.canon_d is None:
            # No Canon-D: two matmuls on row slices of the fused weight. Same math; the backward then needs no
            # concatenation of the (B, T, 2·d_ff) gate/up gradients (a full activation-sized copy per layer).
            w1, w3 = self.w13.weight.chunk(2, dim=0)
            return self.w2(activation(self.act, F.linear(x, w1)) * F.linear(x, w3))
        h = self.w13(x)
        if self.canon_d is not None:
            h = self.canon_d(h)
        if self.kind == "gated":
            gate, up = h.chunk(2, dim=-1)
            return self.w2(activation(self.act, gate) * up)
        return self.w2(activation(self.act, h))
