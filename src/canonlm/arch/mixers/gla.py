"""Gated Linear Attention token mixer with Canon-B / the short convs ``b`` (Yang et al. 2024; paper App. C).

    q, k = W_q x, W_k x  (d -> key_dim);  v = W_v x  (d -> value_dim)
    [Canon-B on [q ; k ; v]]  [b: SiLU short conv on each of q, k, v | else SiLU (official) or nothing (upstream)]
    gk = logsigmoid(gk_proj x) / gate_logit_normalizer        (B, T, H, d_k), log-space forget gate
    o  = chunk_gla(q, k, v, gk)                                (B, T, H, d_v); S_t = diag(exp gk_t) S_{t-1} + k_t v_tᵀ
    y  = o_proj( RMSNorm_per_head(o) · silu(g_proj x) )

Paper synthetic GLA = fla's defaults (4 heads, expand_k 0.5, expand_v 1, full-rank output gate): 4d² per mixer.
GLA5 (Part 4.2) = expand_k 1, expand_v 2, rank-16 output gate: ≈ 6d².
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.config import ModelConfig
from canonlm.arch.mixers._shortconv import build_qkv, qkv_forward
from canonlm.arch.modules import GatedRMSNorm, at_least_fp32, LowRankLinear
from canonlm.ops import gla as gla_ops

_warned_b = False


class GLA(nn.Module):
    """GLA mixer (fla ``GatedLinearAttention`` semantics; official GLA5 Canon variant).

    Parameters: ``q_proj, k_proj (d -> key_dim)``, ``v_proj (d -> value_dim)``, no biases; ``gk_proj``
    LowRankLinear(d, gate_low_rank_dim, key_dim, bias); ``g_proj`` Linear(d, value_dim) (``output_gate_rank=0``)
    or LowRankLinear(d, r, value_dim, bias); ``g_norm`` per-head GatedRMSNorm(d_v); ``o_proj (value_dim -> d)``;
    Canon-B over ``2·key_dim + value_dim`` channels (``B`` in canon.set; the official code fences it, canonlm allows it
    with a warning); short convs ``conv_q, conv_k (key_dim)``, ``conv_v (value_dim)`` (``b``).

    Forward: ``x (B, T, d)``, ``cos``/``sin`` ignored (no positional encoding), ``cache`` layer dict or None ->
    ``(B, T, d)``. With a cache the recurrent state ``cache["state"] (B, H, d_k, d_v)`` (fp32) and the conv
    states carry over, so token-by-token calls equal one call. ``docs`` (:class:`~canonlm.arch.doc_mask.DocMask`,
    not with a cache): document masking -- Canon-B / short convs restart per document, and the B rows run flattened
    as one varlen sequence whose state restarts at every document (``chunk_gla(cu_seqlens=...)``).
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        global _warned_b
        d, H, Kd, Vd = cfg.d_model, cfg.n_heads, cfg.key_dim, cfg.value_dim
        self.n_heads, self.head_k_dim, self.head_v_dim = H, cfg.head_k_dim, cfg.head_v_dim
        self.normalizer, self.chunk_size = cfg.gate_logit_normalizer, cfg.chunk_size
        self.backend = backends["gla"]
        build_qkv(self, cfg, backends["canon"])
        if self.canon_b is not None and not _warned_b:
            _warned_b = True
            warnings.warn(
                "canonlm: Canon-B in GLA is allowed but untested by the paper's authors (the official code "
                "fences it); the paper's default for GLA is canon=AbCD",
                UserWarning,
                stacklevel=2,
            )
        self.gk_proj = LowRankLinear(d, cfg.gate_low_rank_dim, Kd, bias=True)
        r = cfg.output_gate_rank
        self.g_proj = nn.Linear(d, Vd, bias=False) if r == 0 else LowRankLinear(d, r, Vd, bias=True)
        self.g_norm = GatedRMSNorm(self.head_v_dim, cfg.norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(Vd, d, bias=False)

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
        gk = F.logsigmoid(at_least_fp32(self.gk_proj(x))) / self.normalizer
        if docs is not None:
            if cache is not None:
                raise ValueError("GLA: document masking is not supported with a decode cache")
            o, _ = gla_ops.chunk_gla(
                q.reshape(1, B * T, H, -1),
                k.reshape(1, B * T, H, -1),
                v.reshape(1, B * T, H, -1),
                gk.reshape(1, B * T, H, -1),
                chunk_size=self.chunk_size,
                backend=self.backend,
                cu_seqlens=docs.cu_seqlens,
                cu_seqlens_cpu=docs.cu_seqlens_cpu,
            )
            o = self.g_norm(o.view(B, T, H, -1), self.g_proj(x).view(B, T, H, -1))
            return self.o_proj(o.flatten(2))
        state = None if cache is None else cache.get("state")
        o, state = gla_ops.chunk_gla(
            q.view(B, T, H, -1),
            k.view(B, T, H, -1),
            v.view(B, T, H, -1),
            gk.view(B, T, H, -1),
            initial_state=state,
            output_final_state=cache is not None,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
        if cache is not None:
            cache["state"] = state
        o = self.g_norm(o, self.g_proj(x).view(B, T, H, -1))
        return self.o_proj(o.flatten(2))
