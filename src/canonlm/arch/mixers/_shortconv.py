"""The short convolutions that GLA / GDN / Mamba2 carry inside their mixer ("Canon-b", paper §4), and the
q/k/v front end GLA and GDN share: projections, Canon-B on [q ; k ; v], then ``b`` (or a plain SiLU)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from canonlm.arch.canon import Canon
from canonlm.arch.config import CanonConfig, ModelConfig


def short_conv(channels: int, kernel: int, backend: str, cache_key: str, bias: bool = False) -> Canon:
    """A mixer's own depthwise causal conv as the original authors configured it: non-residual, SiLU, kernel
    ``kernel`` (4), PyTorch default init (the model-level init may redraw it: GLA / GDN normal(0, 0.02); Mamba2
    keeps the default with a zero bias). ``bias``: Mamba2's conv1d has one, GLA / GDN's do not. Returns a
    :class:`~canonlm.arch.canon.Canon` with ``native=True`` (same op and decode cache as Canon)."""
    cfg = CanonConfig(
        set="b", kernel=kernel, residual=False, activation=True, bias=bias, trainable=True, init="default"
    )
    return Canon(channels, cfg, backend, cache_key=cache_key, native=True)


def build_qkv(mod: nn.Module, cfg: ModelConfig, canon_backend: str) -> None:
    """Give ``mod`` (GLA or GDN) its q/k/v front end: ``q_proj, k_proj (d -> key_dim)``, ``v_proj (d -> value_dim)``
    (no biases), ``canon_b`` (Canon-B over ``2·key_dim + value_dim``, if ``B`` in canon.set) and the short convs
    ``conv_q, conv_k, conv_v`` (if ``b``); sets ``key_dim``, ``value_dim`` and ``no_conv_act``."""
    d, Kd, Vd = cfg.d_model, cfg.key_dim, cfg.value_dim
    mod.key_dim, mod.value_dim, mod.no_conv_act = Kd, Vd, cfg.no_conv_act
    mod.q_proj = nn.Linear(d, Kd, bias=False)
    mod.k_proj = nn.Linear(d, Kd, bias=False)
    mod.v_proj = nn.Linear(d, Vd, bias=False)
    mod.canon_b = Canon(2 * Kd + Vd, cfg.canon, canon_backend, cache_key="canon_b") if cfg.canon.has("B") else None
    if cfg.canon.has("b"):
        mod.conv_q = short_conv(Kd, cfg.conv_kernel, canon_backend, "conv_q")
        mod.conv_k = short_conv(Kd, cfg.conv_kernel, canon_backend, "conv_k")
        mod.conv_v = short_conv(Vd, cfg.conv_kernel, canon_backend, "conv_v")
    else:
        mod.conv_q = mod.conv_k = mod.conv_v = None


def qkv_forward(mod: nn.Module, x: torch.Tensor, cache: dict | None, docs=None) -> tuple[torch.Tensor, ...]:
    """``x (B, T, d)`` -> ``q, k (B, T, key_dim)``, ``v (B, T, value_dim)`` through the front end of
    :func:`build_qkv`: projections, [Canon-B on the concatenation], then the short convs (``b``) or, without them,
    SiLU (``no_conv_act=silu``, the official code) or nothing (``none``). ``docs``
    (:class:`canonlm.ops.varlen.Documents`) or None: document masking of Canon-B and the short convs."""
    q, k, v = mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)
    if mod.canon_b is not None:
        Kd = mod.key_dim
        q, k, v = mod.canon_b(torch.cat([q, k, v], dim=-1), cache, docs).split([Kd, Kd, mod.value_dim], dim=-1)
    if mod.conv_q is not None:
        return mod.conv_q(q, cache, docs), mod.conv_k(k, cache, docs), mod.conv_v(v, cache, docs)
    if mod.no_conv_act == "silu":
        return F.silu(q), F.silu(k), F.silu(v)
    return q, k, v
