"""Building blocks of LlamaCanon: RMSNorm and the (gated or standard) MLP with Canon-D (paper §4)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.canon import Canon
from canonlm.arch.config import CanonConfig, ConfigError

ACTIVATIONS = ("silu", "relu2", "gelu")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 when it already is (gates and decays are computed in at least fp32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def compute_cast(x: torch.Tensor) -> torch.dtype:
    """The dtype a float32 activation is computed in: the autocast dtype when autocast is enabled on x's device type
    (``torch.get_autocast_dtype``; bf16 under ``trainer.precision=bf16-mixed``), else x.dtype. Other dtypes (bf16,
    fp16, fp64) and meta tensors (no autocast state) are returned unchanged."""
    if x.dtype == torch.float32 and not x.is_meta and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2, -1) + eps) * g`` over the last dim, computed in float32 (as HF ``LlamaRMSNorm``).

    Args:
        dim: normalised width (last dim of the input).
        eps: added to the mean square (``model.norm_eps``; 1e-6 HF-style presets, 1e-5 lingua recipes).
    Parameters: ``weight (dim,)`` learnable gain, initialised to 1.
    Forward: ``x (..., dim)`` any float dtype -> same shape, ``F.rms_norm`` on the (at least) fp32 upcast. The output
    has x's dtype, except that a float32 input under autocast returns the autocast dtype (:func:`compute_cast`): the
    residual stream is fp32, and every consumer of a pre-norm (Canon-A / C, the Linears, the LM head) computes in the
    autocast dtype anyway (a Linear under autocast rounds its input to it: the same rounding, done once here), so
    Canon-A and Canon-C read and write bf16 instead of fp32 (half the bytes) and the cast fuses into the norm.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)  # at least fp32 (bf16/fp16 upcast; fp64 stays fp64)
        return F.rms_norm(x.to(dt), (self.dim,), self.weight.to(dt), self.eps).to(compute_cast(x))

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
    """Feed-forward sub-layer with optional Canon-D (paper §4, Result 5).

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

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        kind: str = "gated",
        act: str = "silu",
        canon: CanonConfig | None = None,
        canon_backend: str = "auto",
    ):
        super().__init__()
        if kind not in ("gated", "standard"):
            raise ConfigError("model.mlp", kind, "gated | standard")
        if act not in ACTIVATIONS:
            raise ConfigError("model.mlp_act", act, " | ".join(ACTIVATIONS))
        self.kind, self.act, self.d_ff = kind, act, d_ff
        up = 2 * d_ff if kind == "gated" else d_ff
        self.w13 = nn.Linear(d_model, up, bias=False)  # gated: [W1 ; W3]; standard: W1
        self.canon_d = (
            Canon(up, canon, canon_backend, cache_key="canon_d") if canon is not None and canon.has("D") else None
        )
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, docs=None) -> torch.Tensor:
        """``x (B, T, d)`` -> ``(B, T, d)``; ``cache``: a decode-cache layer dict for Canon-D's history (or None);
        ``docs`` (:class:`canonlm.ops.varlen.Documents`): document masking of Canon-D (:class:`~canonlm.arch.canon.Canon`),
        or None."""
        if self.kind == "gated" and self.canon_d is None and type(self.w13) is nn.Linear:
            # No Canon-D: two matmuls on row slices of the fused weight. Same math; the backward then needs no
            # concatenation of the (B, T, 2·d_ff) gate/up gradients (a full activation-sized copy per layer). Only
            # for a plain nn.Linear: a module that wraps or replaces it (a peft LoRA layer, a quantized Linear) is
            # called, so what it adds is not bypassed by reading its weight.
            w1, w3 = self.w13.weight.chunk(2, dim=0)
            return self.w2(activation(self.act, F.linear(x, w1)) * F.linear(x, w3))
        h = self.w13(x)
        if self.canon_d is not None:
            h = self.canon_d(h, cache, docs)
        if self.kind == "gated":
            gate, up = h.chunk(2, dim=-1)
            return self.w2(activation(self.act, gate) * up)
        return self.w2(activation(self.act, h))


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU output gate, in float32 (fla ``FusedRMSNormSwishGate``).

    ``norm_before_gate=True`` (fla ``FusedRMSNormGated`` with swish, GLA / GDN): ``y = RMSNorm(x) · w · silu(g)``.
    ``norm_before_gate=False`` (Mamba2, ``MambaRMSNormGated`` / mamba_ssm ``norm_before_gate=False``):
    ``y = RMSNorm(x · silu(g)) · w``. The mean square runs over groups of ``group_size`` channels of the last dim
    (default: all ``dim``; Mamba2 uses d_inner / n_groups).

    Args: dim: width of the last dim (GLA/GDN: the per-head d_v, weight shared by heads; Mamba2: d_inner);
        eps; norm_before_gate; group_size (must divide dim).
    Parameters: ``weight (dim,)`` = 1 at init.
    Forward: ``x, g`` of equal shape ``(..., dim)`` -> ``(..., dim)`` in x.dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, norm_before_gate: bool = True, group_size: int | None = None):
        super().__init__()
        group_size = dim if group_size is None else int(group_size)
        if group_size < 1 or dim % group_size:
            raise ValueError(f"GatedRMSNorm: group_size={group_size} must divide dim={dim}")
        self.dim, self.eps, self.norm_before_gate, self.group_size = dim, eps, norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf, gf = x.to(dt), F.silu(g.to(dt))
        if not self.norm_before_gate:
            xf = xf * gf
        if self.group_size != self.dim:
            shape = xf.shape
            xf = F.rms_norm(xf.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps).reshape(shape)
            xf = xf * self.weight.to(dt)
        else:
            xf = F.rms_norm(xf, (self.dim,), self.weight.to(dt), self.eps)
        if self.norm_before_gate:
            xf = xf * gf
        return xf.to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, norm_before_gate={self.norm_before_gate}, group_size={self.group_size}"


class LowRankLinear(nn.Sequential):
    """``Linear(d_in, rank, bias=False)`` then ``Linear(rank, d_out, bias)``: fla's low-rank gate projections (GLA
    forget gate ``gk_proj``, GLA5 / GDN2 output gate ``g_proj``; official linear models). Both halves carry
    ``split_init = rank``: under ``model.init=linear_0.02_split`` they get σ = √std / rank^¼ so the product keeps the
    ≈ std entry scale of a full matrix. Forward: ``(..., d_in) -> (..., d_out)``."""

    def __init__(self, d_in: int, rank: int, d_out: int, bias: bool = True):
        super().__init__(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=bias))
        for m in self:
            m.split_init = rank
