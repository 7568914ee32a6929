"""Gated DeltaNet token mixer with Canon-B / the short convs ``b`` (Yang et al. 2025; paper App. C).

    q, k = W_q x, W_k x (d -> H·d_k);  v = W_v x (d -> H·d_v)
    [Canon-B on [q ; k ; v]]  [b: SiLU short conv on each of q, k, v | else SiLU (or nothing: no_conv_act=none)]
    beta = sigmoid(b_proj x)                       (B, T, H)
    g    = -exp(A_log) · softplus(a_proj x + dt_bias)   (B, T, H), log-space decay, fp32
    o    = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
           S_t = α_t S_{t-1} + k_t w_tᵀ, w_tᵀ = β_t (v_tᵀ − α_t k_tᵀ S_{t-1}), o_t = S_tᵀ (d_k^-½ q_t), α_t = exp g_t
    y    = o_proj( RMSNorm_per_head(o) · silu(g_proj x) )

Paper synthetic GDN: d_k = 96 (expand_k 0.75), d_v = 192 (expand_v 1.5), heads max(4, d/128), full-rank output gate,
MLP 2d (6d² + 6d²). GDN2 (Part 4.2): d_k = d / H, expand_v 2, rank-16 output gate.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.config import ModelConfig
from canonlm.arch.mixers._shortconv import build_qkv, qkv_forward
from canonlm.arch.modules import GatedRMSNorm, at_least_fp32, LowRankLinear
from canonlm.ops import gdn as gdn_ops

# Decay parameter init (as fla / mamba_ssm): A ~ U(0, 16); dt ~ logU[1e-3, 0.1], floor 1e-4.
A_INIT_RANGE = (0.0, 16.0)
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


@torch.no_grad()
def init_dt_bias_(dt_bias: torch.Tensor) -> None:
    """``dt_bias = softplus⁻¹(dt)`` with ``dt = exp(U(log 1e-3, log 0.1))`` clamped to >= 1e-4 (Mamba / fla init).
    Works on regular tensors and FSDP2 DTensors (the draw is made ``like`` the parameter)."""
    u = torch.empty_like(dt_bias, dtype=torch.float32).uniform_()
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp_(min=DT_FLOOR)
    dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class GatedDeltaNet(nn.Module):
    """GDN mixer (fla ``GatedDeltaNet`` semantics; official GDN2 Canon variant).

    Parameters: ``q_proj, k_proj (d -> key_dim)``, ``v_proj (d -> value_dim)``, ``a_proj, b_proj (d -> H)``, no
    biases; ``A_log (H,)``, ``dt_bias (H,)`` (no weight decay: 1-D); ``g_proj`` Linear(d, value_dim) or
    LowRankLinear(d, r, value_dim, bias); ``o_norm`` per-head GatedRMSNorm(d_v); ``o_proj (value_dim -> d)``;
    Canon-B over ``2·key_dim + value_dim`` (``B``); short convs ``conv_q, conv_k, conv_v`` (``b``).

    Forward: ``x (B, T, d)``, cos/sin ignored, ``cache`` layer dict or None -> ``(B, T, d)``; the cache holds
    ``state (B, H, d_k, d_v)`` (fp32) and the conv states. ``docs`` (:class:`~canonlm.arch.doc_mask.DocMask`, not
    with a cache): document masking -- Canon-B / short convs restart per document, and the B rows run flattened as
    one varlen sequence whose state restarts at every document (``chunk_gated_delta_rule(cu_seqlens=...)``).
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        d, H, Vd = cfg.d_model, cfg.n_heads, cfg.value_dim
        self.n_heads = H
        self.chunk_size, self.backend = cfg.chunk_size, backends["gdn"]
        build_qkv(self, cfg, backends["canon"])
        self.a_proj = nn.Linear(d, H, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        r = cfg.output_gate_rank
        self.g_proj = nn.Linear(d, Vd, bias=False) if r == 0 else LowRankLinear(d, r, Vd, bias=True)
        self.o_norm = GatedRMSNorm(cfg.head_v_dim, cfg.norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(Vd, d, bias=False)
        self.init_special_()

    @torch.no_grad()
    def init_special_(self) -> None:
        """``A_log = log U(0, 16)`` and ``dt_bias`` per :func:`init_dt_bias_` (re-run after meta / FSDP builds)."""
        if self.A_log.device.type == "meta":
            return
        self.A_log.copy_(
            torch.empty_like(self.A_log, dtype=torch.float32).uniform_(*A_INIT_RANGE).clamp(min=1e-4).log()
        )
        init_dt_bias_(self.dt_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: dict | None = None,
        docs=None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q, k, v = qkv_forward(self, x, cache, docs)
        beta = torch.sigmoid(at_least_fp32(self.b_proj(x)))
        g = -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(self.a_proj(x)) + at_least_fp32(self.dt_bias))
        if docs is not None:
            if cache is not None:
                raise ValueError("GatedDeltaNet: document masking is not supported with a decode cache")
            o, _ = gdn_ops.chunk_gated_delta_rule(
                q.reshape(1, B * T, H, -1),
                k.reshape(1, B * T, H, -1),
                v.reshape(1, B * T, H, -1),
                g.reshape(1, B * T, H),
                beta.reshape(1, B * T, H),
                use_qk_l2norm=True,
                chunk_size=self.chunk_size,
                backend=self.backend,
                cu_seqlens=docs.cu_seqlens,
                cu_seqlens_cpu=docs.cu_seqlens_cpu,
            )
            o = self.o_norm(o.view(B, T, H, -1), self.g_proj(x).view(B, T, H, -1))
            return self.o_proj(o.flatten(2))
        state = None if cache is None else cache.get("state")
        o, state = gdn_ops.chunk_gated_delta_rule(
            q.view(B, T, H, -1),
            k.view(B, T, H, -1),
            v.view(B, T, H, -1),
            g,
            beta,
            initial_state=state,
            output_final_state=cache is not None,
            use_qk_l2norm=True,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
        if cache is not None:
            cache["state"] = state
        o = self.o_norm(o, self.g_proj(x).view(B, T, H, -1))
        return self.o_proj(o.flatten(2))
