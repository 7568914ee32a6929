"""LlamaCanon: a pre-norm Llama decoder with Canon layers at A, B, C, D (paper §4, App. C; spec models.md §1.2, §2).

    input_ids (B, T) -> tok_emb -> n_layers x Block -> RMSNorm -> lm_head -> logits (B, T, V)

    Block (pre-norm; Canon sites per models.md §1.2):
        x = x + Wo · attention(RoPE(CanonB(QKnorm(Wqkv · CanonA(RMSNorm(x))))))
        x = x + W2 · act·gate(CanonD(W13 · CanonC(RMSNorm(x))))

One fused ``wqkv`` Linear (output ``[q ; k ; v]``, ``(H + 2 H_kv) · d_head`` channels) and one fused ``w13`` Linear
(``[W1 x ; W3 x]``) let Canon-B / Canon-D act on the concatenations without a ``cat``; parameter counts equal those
of separate Linears. RoPE rotates q and k in one call, and the attention op takes the (B, T, H, D) layout, so q/k/v
are head views (no transposes or copies) of the projection / RoPE outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from canonlm.arch.canon import Canon
from canonlm.arch.config import ConfigError, ModelConfig, validate
from canonlm.arch.modules import MLP, RMSNorm
from canonlm.arch.positional import apply_rope, rope_angles
from canonlm.ops import attention as attention_ops
from canonlm.ops import canon as canon_ops

OPS = ("canon", "attention")


def resolve_backends(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """Concrete backend of every op for ``device`` and compute ``dtype`` (models.md §1.6; engineering.md P7).

    The requested name of op ``o`` is ``cfg.kernels[o]`` if pinned (a pin wins over ``cfg.ops``), else ``cfg.ops``:
    ``auto`` (fast path when available), ``reference`` (pure-PyTorch oracles), ``fused`` (a fast kernel is
    required). Canon names go to ``canonlm.ops.canon.resolve_backend`` (``fused`` = its ``auto`` choice, refused
    when that is a plain-torch path); attention names to :func:`canonlm.ops.attention.resolve_backend`
    (``auto``/``fused`` = SDPA). On the ``meta`` device Canon is not probed (``auto`` unless ``reference``).

    Returns:
        ``{"canon": name, "attention": name}``.
    Raises:
        ConfigError("model.kernels.<op>" when pinned, else "model.ops", name, allowed) when a requested backend is
        unknown or cannot run on (device, dtype) -- before any tensor work.
    """
    device = torch.device(device)
    out = {}
    for op in OPS:
        name = cfg.kernels.get(op, cfg.ops)
        key = f"model.kernels.{op}" if op in cfg.kernels else "model.ops"
        try:
            if op == "attention":
                out[op] = attention_ops.resolve_backend(name, device, dtype)
            elif device.type == "meta":
                out[op] = "reference" if name == "reference" else "auto"
            elif name == "fused":
                out[op] = canon_ops.resolve_backend("auto", device, dtype)
                if out[op] in ("torch", "reference"):
                    raise ConfigError(key, name, f"auto | reference (no fused Canon kernel for {device.type}/{dtype}:"
                                                 f" {canon_ops.available_backends(device, dtype)})")
            else:
                out[op] = canon_ops.resolve_backend(name, device, dtype)
        except ConfigError as e:
            raise ConfigError(key, name, e.allowed) from None
        except ValueError as e:
            raise ConfigError(key, name, str(e)) from None
    return out


def _module_backends(cfg: ModelConfig, resolved: dict[str, str]) -> dict[str, str]:
    """Names handed to the modules: the resolved ones, except a Canon request of ``auto`` stays ``auto`` so the op
    can still fall back per shape (e.g. dao needs C % 8 == 0) and follow the tensors' device."""
    canon_req = cfg.kernels.get("canon", cfg.ops)
    return {"canon": "auto" if canon_req == "auto" else resolved["canon"], "attention": resolved["attention"]}


class Attention(nn.Module):
    """Causal self-attention with fused qkv, QK-norm, Canon-B and (partial) RoPE (models.md §1.2, §2).

    Parameters: ``wqkv (d -> (H + 2 H_kv)·d_head)``, ``wo (H·d_head -> d)``, no biases; QK-norm gains:
    ``whole`` -> ``q_norm (H·d_head)`` and ``k_norm (H_kv·d_head)`` (official); ``per_head`` -> ``q_norm (d_head)``
    and ``k_norm (d_head)`` shared by all heads; Canon-B over ``(H + 2 H_kv)·d_head`` channels.
    Forward: ``x (B, T, d)``, ``cos``/``sin`` ``(T, rope_dim/2)`` or None (NoPE) -> ``(B, T, d)``.
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
        self.canon_b = Canon((H + 2 * Hkv) * dh, cfg.canon, backends["canon"]) if cfg.canon.has("B") else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.q_norm is None and self.canon_b is None:
            # Plain attention: three matmuls on row slices of the fused weight (same math). Their gradients need no
            # concatenation into a (B, T, (H + 2Hkv)·dh) tensor in the backward.
            wq, wk, wv = self.wqkv.weight.split([H * dh, Hkv * dh, Hkv * dh], dim=0)
            q = F.linear(x, wq).unflatten(-1, (H, dh))
            k = F.linear(x, wk).unflatten(-1, (Hkv, dh))
            v = F.linear(x, wv).unflatten(-1, (Hkv, dh))
            if cos is not None:
                q, k = apply_rope(q, cos, sin, self.pairing), apply_rope(k, cos, sin, self.pairing)
            o = attention_ops.attention(q, k, v, causal=True, backend=self.backend)
            return self.wo(o.flatten(2))
        qkv = self.wqkv(x)                                             # (B, T, (H + 2Hkv)·dh) = [q ; k ; v]
        if self.q_norm is not None:
            q, k, v = qkv.split([H * dh, Hkv * dh, Hkv * dh], dim=-1)
            if self.qk_norm == "per_head":
                q = self.q_norm(q.unflatten(-1, (H, dh))).flatten(-2)
                k = self.k_norm(k.unflatten(-1, (Hkv, dh))).flatten(-2)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            qkv = torch.cat([q, k, v], dim=-1)
        if self.canon_b is not None:
            qkv = self.canon_b(qkv)
        qk, v = qkv.unflatten(-1, (H + 2 * Hkv, dh)).split([H + Hkv, Hkv], dim=2)  # (B, T, heads, dh) views
        if cos is not None:
            qk = apply_rope(qk, cos, sin, self.pairing)                # q and k rotated in one call
        q, k = qk.split([H, Hkv], dim=2)
        o = attention_ops.attention(q, k, v, causal=True, backend=self.backend)  # (B, T, H, dh)
        return self.wo(o.flatten(2))


class Block(nn.Module):
    """Pre-norm Llama block with optional Canon-A (after ``attn_norm``) and Canon-C (after ``mlp_norm``).

    Forward: ``x (B, T, d)`` residual stream (fp32 params: fp32 stream) -> ``(B, T, d)``.
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        d, c = cfg.d_model, cfg.canon
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.canon_a = Canon(d, c, backends["canon"]) if c.has("A") else None
        self.attn = Attention(cfg, backends)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.canon_c = Canon(d, c, backends["canon"]) if c.has("C") else None
        self.mlp = MLP(d, cfg.ffn_dim, cfg.mlp, cfg.mlp_act, c, backends["canon"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.canon_a is not None:
            h = self.canon_a(h)
        x = x + self.attn(h, cos, sin)
        h = self.mlp_norm(x)
        if self.canon_c is not None:
            h = self.canon_c(h)
        return x + self.mlp(h)


class LlamaCanon(nn.Module):
    """Llama decoder + Canon layers (models.md §1.2, §2). Build with a validated :class:`ModelConfig`.

    Modules: ``tok_emb`` (V, d) · ``blocks`` (``nn.ModuleList`` of :class:`Block`; the FSDP2 / compile unit) ·
    ``norm`` (final RMSNorm) · ``lm_head`` (d -> V, no bias; shares ``tok_emb.weight`` iff ``cfg.tie_embeddings``).
    Buffers (non-persistent, float32): ``rope_cos``/``rope_sin`` ``(max_seq_len, rope_dim/2)``, absent for NoPE.

    Backends are resolved at construction for the current default device (``torch.empty(0).device``, so
    ``with torch.device("meta")`` builds skip the checks) and fp32; call :meth:`check_backends` after moving
    the model / choosing the compute dtype. Raises ConfigError (bad config or unavailable backend).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = validate(cfg)
        self.backends = resolve_backends(cfg, torch.empty(0).device, torch.get_default_dtype())
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, _module_backends(cfg, self.backends)) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.rope_dim:
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.rope_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.rope_dim // 2), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.activation_checkpointing = False
        self.init_weights()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` LongTensor (B, T), T <= max_seq_len -> logits (B, T, V) in the compute dtype (fp32, or
        the autocast dtype). Raises ValueError on a bad rank or T > ``cfg.max_seq_len``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected (B, T)")
        T = input_ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"input_ids: T={T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (``torch.utils.checkpoint``,
        non-reentrant, one checkpoint per block; engineering.md P6: apply before compile and fully_shard -- the
        call wraps the block module, so a compiled / FSDP2-sharded block is recomputed as a whole)."""
        self.activation_checkpointing = bool(enabled)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables (models.md §2 "init", §1.1; §7.4 item 2).

        ``hf_normal``: Linear/Embedding weights ~ N(0, init_std). ``lingua``: trunc-normal (±3σ) with σ = d^-1/2,
        except MLP ``w2`` σ = d_ff^-1/2 (no depth scaling). Norm gains = 1. Canon weights are redrawn by
        :meth:`Canon.reset_parameters` (PyTorch default U(-1/√K, 1/√K), or identity / fixed), never by the
        model-level scheme. Re-runnable after ``to_empty`` (meta-device / FSDP2 builds).
        """
        cfg = self.cfg
        for name, m in self.named_modules():
            if isinstance(m, (Canon, RMSNorm)):
                m.reset_parameters()
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                if cfg.init == "hf_normal":
                    nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)
                else:
                    std = (cfg.ffn_dim if name.endswith("mlp.w2") else cfg.d_model) ** -0.5
                    nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        if self.rope_cos is not None and self.rope_cos.device.type != "meta":
            cos, sin = rope_angles(cfg.rope_dim, cfg.max_seq_len, cfg.pos.theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def check_backends(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
        """Re-resolve the op backends for ``device`` and compute ``dtype`` (e.g. ``torch.bfloat16`` under
        autocast) and set them on every Canon / Attention module (a Canon ``auto`` request stays ``auto`` in the
        modules, see :func:`_module_backends`). Returns the concrete ``{"canon": .., "attention": ..}``.
        Raises ConfigError like :func:`resolve_backends`."""
        self.backends = resolve_backends(self.cfg, device, dtype)
        names = _module_backends(self.cfg, self.backends)
        for m in self.modules():
            if isinstance(m, Canon):
                m.backend = names["canon"]
            elif isinstance(m, Attention):
                m.backend = names["attention"]
        return dict(self.backends)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared/tied tensors counted once; DTensors by global size). ``non_embedding``
        drops the token embedding and the LM head (the paper's "≈ 12·d²·layers" count, tasks.md §1.2)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for MFU: ``6·N + 12·L·d·T`` (PaLM App. B; lingua,
        engineering.md P23). N = parameters taking part in matmuls/convs = all parameters minus the embedding
        lookup table, plus the LM head when tied (it still does a d x V matmul). The attention term counts the
        full T x T score and value products (no causal halving), as PaLM does."""
        cfg = self.cfg
        n = self.num_params() - self.tok_emb.weight.numel()
        if cfg.tie_embeddings:
            n += self.lm_head.weight.numel()
        return float(6 * n + 12 * cfg.n_layers * cfg.d_model * seq_len)
