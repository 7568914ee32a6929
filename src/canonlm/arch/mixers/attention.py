"""Causal softmax attention with fused qkv, QK-norm, Canon-B and (partial) RoPE (paper §4; Su et al. 2021)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.canon import Canon
from canonlm.arch.config import ModelConfig
from canonlm.arch.modules import RMSNorm
from canonlm.arch.positional import apply_rope
from canonlm.ops import attention as attention_ops


class Attention(nn.Module):
    """Causal self-attention with fused qkv, QK-norm, Canon-B and (partial) RoPE (paper §4; Su et al. 2021).

    Parameters: ``wqkv (d -> (H + 2 H_kv)·d_head)``, ``wo (H·d_head -> d)``, no biases; QK-norm gains:
    ``whole`` -> ``q_norm (H·d_head)`` and ``k_norm (H_kv·d_head)`` (official); ``per_head`` -> ``q_norm (d_head)``
    and ``k_norm (d_head)`` shared by all heads; Canon-B over ``(H + 2 H_kv)·d_head`` channels.

    Forward (the signature every token mixer shares): ``x (B, T, d)``, ``cos``/``sin`` ``(T, rope_dim/2)`` for the
    positions of these T tokens, or None (NoPE), ``cache`` a layer dict of
    :class:`~canonlm.arch.cache.DecodeCache` or None -> ``(B, T, d)``. With a cache, k/v of the new tokens are
    appended to ``cache["k"]``/``cache["v"]`` ``(B, S, H_kv, d_head)`` and the queries attend to all S positions.
    ``docs`` (:class:`~canonlm.arch.doc_mask.DocMask`, not with a cache): document masking -- block-causal attention
    and Canon-B restarting per document; RoPE keeps the window's positions (relative: see that module).
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        H, Hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, dh
        self.qk_norm, self.pairing, self.backend = cfg.qk_norm, cfg.pos.pairing, backends["attention"]
        self.wqkv = nn.Linear(cfg.d_model, (H + 2 * Hkv) * dh, bias=False)
        self.wo = nn.Linear(H * dh, cfg.d_model, bias=False)
        if cfg.qk_norm == "whole":
            self.q_norm, self.k_norm = RMSNorm(H * dh, cfg.norm_eps), RMSNorm(Hkv * dh, cfg.norm_eps)
        elif cfg.qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(dh, cfg.norm_eps), RMSNorm(dh, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.canon_b = (
            Canon((H + 2 * Hkv) * dh, cfg.canon, backends["canon"], cache_key="canon_b") if cfg.canon.has("B") else None
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: dict | None = None, docs=None
    ) -> torch.Tensor:
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.q_norm is None and self.canon_b is None and type(self.wqkv) is nn.Linear:
            # Plain attention: three matmuls on row slices of the fused weight (same math). Their gradients need no
            # concatenation into a (B, T, (H + 2Hkv)·dh) tensor in the backward. Only for a plain nn.Linear: a module
            # that wraps or replaces it (a peft LoRA layer, a quantized Linear) is called, so what it adds is not
            # bypassed by reading its weight.
            wq, wk, wv = self.wqkv.weight.split([H * dh, Hkv * dh, Hkv * dh], dim=0)
            q = F.linear(x, wq).unflatten(-1, (H, dh))
            k = F.linear(x, wk).unflatten(-1, (Hkv, dh))
            v = F.linear(x, wv).unflatten(-1, (Hkv, dh))
            if cos is not None:
                q, k = apply_rope(q, cos, sin, self.pairing), apply_rope(k, cos, sin, self.pairing)
        else:
            qkv = self.wqkv(x)  # (B, T, (H + 2Hkv)·dh) = [q ; k ; v]
            if self.q_norm is not None:
                q, k, v = qkv.split([H * dh, Hkv * dh, Hkv * dh], dim=-1)
                if self.qk_norm == "per_head":
                    q = self.q_norm(q.unflatten(-1, (H, dh))).flatten(-2)
                    k = self.k_norm(k.unflatten(-1, (Hkv, dh))).flatten(-2)
                else:
                    q, k = self.q_norm(q), self.k_norm(k)
                qkv = torch.cat([q, k, v], dim=-1)
            if self.canon_b is not None:
                qkv = self.canon_b(qkv, cache, docs)
            qk, v = qkv.unflatten(-1, (H + 2 * Hkv, dh)).split([H + Hkv, Hkv], dim=2)  # (B, T, heads, dh) views
            if cos is not None:
                qk = apply_rope(qk, cos, sin, self.pairing)  # q and k rotated in one call
            q, k = qk.split([H, Hkv], dim=2)
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k.to(cache["k"].dtype)], dim=1)
                v = torch.cat([cache["v"], v.to(cache["v"].dtype)], dim=1)
            cache["k"], cache["v"] = k, v
        if docs is not None:
            o = attention_ops.attention(
                q,
                k,
                v,
                causal=True,
                backend=self.backend,
                doc_mask=docs.attn_mask,
                cu_seqlens=docs.cu_seqlens,
                max_seqlen=docs.max_seqlen,
            )
        else:
            o = attention_ops.attention(q, k, v, causal=True, backend=self.backend)  # (B, T, H, dh)
        return self.wo(o.flatten(2))
