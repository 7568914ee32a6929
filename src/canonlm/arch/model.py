"""CanonLM: a pre-norm decoder with Canon layers at A, B, C, D around one token mixer per block (paper §4, §5,
App. C; spec models.md §1.2, §1.3, §2, §3). ``arch=llama`` is LlamaCanon; ``gla`` / ``gdn`` / ``mamba2`` swap the
attention for a linear mixer (:mod:`canonlm.arch.mixers`), everything else stays.

    input_ids (B, T) -> tok_emb -> n_layers x Block -> RMSNorm -> lm_head -> logits (B, T, V)

    Block (pre-norm; Canon sites per models.md §1.2):
        x = x + mixer(CanonA(RMSNorm(x)))            Llama: Wo · attention(RoPE(CanonB(QKnorm(Wqkv · .))))
        x = x + W2 · act·gate(CanonD(W13 · CanonC(RMSNorm(x))))      (absent for Mamba2 without MLP)

Llama uses one fused ``wqkv`` Linear (output ``[q ; k ; v]``) and one fused ``w13`` Linear (``[W1 x ; W3 x]``) so
Canon-B / Canon-D act on the concatenations without a ``cat``; parameter counts equal those of separate Linears.

Decoding: ``model(ids, cache=model.new_cache())`` processes any number of new tokens and carries KV, Canon, short-conv
and recurrent states in the :class:`~canonlm.arch.cache.DecodeCache`; token-by-token calls give the logits of one
full forward (models.md §6).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from canonlm.arch.cache import DecodeCache
from canonlm.arch.canon import Canon
from canonlm.arch.config import ConfigError, ModelConfig, validate
from canonlm.arch.mixers import GLA, Attention, GatedDeltaNet, Mamba2Mixer, build_mixer
from canonlm.arch.modules import MLP, GatedRMSNorm, RMSNorm
from canonlm.arch.positional import rope_angles
from canonlm.ops import attention as attention_ops
from canonlm.ops import canon as canon_ops
from canonlm.ops import gdn as gdn_ops
from canonlm.ops import gla as gla_ops
from canonlm.ops import ssd as ssd_ops

# The sequence ops each architecture uses (besides Canon), and their modules (each has resolve_backend).
MIXER_OP = {"llama": "attention", "gla": "gla", "gdn": "gdn", "mamba2": "ssd"}
_LINEAR_OPS = {"gla": gla_ops, "gdn": gdn_ops, "ssd": ssd_ops}


def _fast_shape_reason(cfg: ModelConfig, op: str, backend: str) -> str | None:
    """Why the fast kernel ``backend`` of ``op`` cannot take this model's shapes, or None (the ops own the limits)."""
    if op == "gdn" and backend == "fla":
        return gdn_ops.fla_shape_reason(cfg.head_k_dim)
    return None


def resolve_backends(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """Concrete backend of every op the architecture uses for ``device`` and compute ``dtype`` (models.md §1.6;
    engineering.md P7): ``canon`` always, plus ``attention`` (llama), ``gla``, ``gdn`` or ``ssd`` (Mamba2).

    The requested name of op ``o`` is ``cfg.kernels[o]`` if pinned (a pin wins over ``cfg.ops``), else ``cfg.ops``:
    ``auto`` (fast path when available), ``reference`` (pure-PyTorch oracles), ``fused`` (a fast kernel is
    required). Canon names go to ``canonlm.ops.canon.resolve_backend`` (``fused`` = its ``auto`` choice, refused
    when that is a plain-torch path); attention names to :func:`canonlm.ops.attention.resolve_backend`
    (``auto``/``fused`` = SDPA); GLA / GDN / SSD names to ``canonlm.ops.<op>.resolve_backend`` (``fused`` = their
    ``auto`` choice, refused when that is the reference). On the ``meta`` device nothing is probed (``auto`` unless
    ``reference``). Pins of ops the architecture does not use are ignored.

    Returns:
        ``{"canon": name, <mixer op>: name}``.
    Raises:
        ConfigError("model.kernels.<op>" when pinned, else "model.ops", name, allowed) when a requested backend is
        unknown or cannot run on (device, dtype) -- before any tensor work.
    """
    device = torch.device(device)
    out = {}
    for op in ("canon", MIXER_OP[cfg.arch]):
        name = cfg.kernels.get(op, cfg.ops)
        key = f"model.kernels.{op}" if op in cfg.kernels else "model.ops"
        try:
            if op == "attention":
                out[op] = attention_ops.resolve_backend(name, device, dtype)
            elif device.type == "meta":
                out[op] = "reference" if name == "reference" else "auto"
            elif op == "canon":
                if name == "fused":
                    out[op] = canon_ops.resolve_backend("auto", device, dtype)
                    if out[op] in ("torch", "reference"):
                        raise ConfigError(key, name, f"auto | reference (no fused Canon kernel for {device.type}/"
                                                     f"{dtype}: {canon_ops.available_backends(device, dtype)})")
                else:
                    out[op] = canon_ops.resolve_backend(name, device, dtype)
            else:
                mod = _LINEAR_OPS[op]
                out[op] = mod.resolve_backend("auto" if name == "fused" else name, device, dtype)
                if name == "fused" and out[op] == "reference":
                    fast = [b for b in mod.BACKENDS if b not in ("auto", "reference")]
                    raise ConfigError(key, name, f"auto | reference (no fused {op} kernel for {device.type}/{dtype}: "
                                                 f"{' / '.join(fast)} need a CUDA device and the library)")
                reason = _fast_shape_reason(cfg, op, out[op])
                if reason is not None:
                    if name == "auto":
                        warnings.warn(f"canonlm: {reason}; using the reference {op} op", RuntimeWarning, stacklevel=2)
                        out[op] = "reference"
                    else:
                        raise ConfigError(key, name, f"auto | reference ({reason})")
        except ConfigError as e:
            raise ConfigError(key, name, e.allowed) from None
        except ValueError as e:
            raise ConfigError(key, name, str(e)) from None
    return out


def _module_backends(cfg: ModelConfig, resolved: dict[str, str]) -> dict[str, str]:
    """Names handed to the modules: the resolved ones, except an ``auto`` request of Canon or a linear op stays
    ``auto`` so the op can still fall back per shape (e.g. dao needs C % 8 == 0, fla's GDN d_k <= 256) and follow the
    tensors' device."""
    out = dict(resolved)
    for op in resolved:
        if op != "attention" and cfg.kernels.get(op, cfg.ops) == "auto":
            out[op] = "auto"
    return out


class Block(nn.Module):
    """Pre-norm block: ``attn_norm`` → Canon-A → token mixer ``attn`` (:mod:`canonlm.arch.mixers`) → +residual;
    ``mlp_norm`` → Canon-C → MLP (with Canon-D) → +residual (no MLP sub-layer when ``model.mlp=none``).

    Forward: ``x (B, T, d)`` residual stream, ``cos``/``sin`` RoPE tables of these positions (or None), ``cache`` a
    layer dict of :class:`~canonlm.arch.cache.DecodeCache` (or None) -> ``(B, T, d)``.
    """

    def __init__(self, cfg: ModelConfig, backends: dict[str, str]):
        super().__init__()
        d, c = cfg.d_model, cfg.canon
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.canon_a = Canon(d, c, backends["canon"], cache_key="canon_a") if c.has("A") else None
        self.attn = build_mixer(cfg, backends)
        if cfg.has_mlp:
            self.mlp_norm = RMSNorm(d, cfg.norm_eps)
            self.canon_c = Canon(d, c, backends["canon"], cache_key="canon_c") if c.has("C") else None
            self.mlp = MLP(d, cfg.ffn_dim, cfg.mlp, cfg.mlp_act, c, backends["canon"])
        else:
            self.mlp_norm = self.canon_c = self.mlp = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: dict | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.canon_a is not None:
            h = self.canon_a(h, cache)
        x = x + self.attn(h, cos, sin, cache)
        if self.mlp is None:
            return x
        h = self.mlp_norm(x)
        if self.canon_c is not None:
            h = self.canon_c(h, cache)
        return x + self.mlp(h, cache)


class CanonLM(nn.Module):
    """Decoder LM + Canon layers: Llama (models.md §1.2, §2) or GLA / GDN / Mamba2 (§1.3, §3), by ``cfg.arch``.
    Build with a validated :class:`ModelConfig`. ``LlamaCanon`` is the same class.

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

    def forward(self, input_ids: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """``input_ids`` LongTensor (B, T) -> logits (B, T, V) in the compute dtype (fp32, or the autocast dtype).

        With ``cache`` (from :meth:`new_cache`), the T tokens continue the sequences the cache has seen: positions
        ``cache.seen .. cache.seen + T - 1``; the cache is updated in place (``seen += T``). Prefill, chunked
        prefill and one-token decode steps all give the logits of one full forward over the whole sequence.
        Raises ValueError on a bad rank, a cache of another batch size, or (Llama) positions beyond
        ``cfg.max_seq_len``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected (B, T)")
        T = input_ids.shape[1]
        t0 = 0 if cache is None else cache.seen
        if cache is not None:
            if len(cache.layers) != len(self.blocks):
                raise ValueError(f"cache: {len(cache.layers)} layers, the model has {len(self.blocks)}")
            if cache.batch_size not in (None, input_ids.shape[0]):
                raise ValueError(f"cache: holds {cache.batch_size} rows, input_ids has {input_ids.shape[0]}")
        if self.cfg.arch == "llama" and t0 + T > self.cfg.max_seq_len:
            raise ValueError(f"input_ids: positions up to {t0 + T} exceed model.max_seq_len={self.cfg.max_seq_len}")
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[t0:t0 + T], self.rope_sin[t0:t0 + T]
        x = self.tok_emb(input_ids)
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, cos, sin, cache.layers[i])
            elif self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        if cache is not None:
            cache.seen += T
        return self.lm_head(self.norm(x))

    def new_cache(self) -> DecodeCache:
        """An empty :class:`~canonlm.arch.cache.DecodeCache` for this model (filled by the first forward)."""
        return DecodeCache(len(self.blocks))

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (``torch.utils.checkpoint``,
        non-reentrant, one checkpoint per block; engineering.md P6: apply before compile and fully_shard -- the
        call wraps the block module, so a compiled / FSDP2-sharded block is recomputed as a whole)."""
        self.activation_checkpointing = bool(enabled)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables (models.md §2 "init", §1.1, §3.3, §3.4; §7.4 item 2).

        ``hf_normal``: Linear/Embedding weights ~ N(0, init_std), biases 0 (the paper's synthetic Llama = HF, and
        GLA / GDN = fla's ``initializer_range``). ``linear_0.02_split`` (GLA5 / GDN2): the same, except the halves
        of a low-rank product (``split_init = r``) get σ = √init_std / r^¼. For both, a mixer's own short conv
        (``b``) is drawn like a Linear (normal(0, init_std)), as fla does. ``lingua``: trunc-normal (±3σ) with
        σ = d^-1/2, except MLP ``w2`` σ = d_ff^-1/2. ``mamba2_default`` (HF Mamba2): Linear layers keep PyTorch's
        default (kaiming-uniform) draw with zero biases, embedding ~ N(0, 0.1), conv1d default with a zero bias.
        Norm gains = 1. Canon weights are redrawn by :meth:`Canon.reset_parameters` (PyTorch default
        U(-1/√K, 1/√K), or identity / fixed), never by the model-level scheme. GDN / Mamba2 decay parameters
        (``A_log``, ``dt_bias``, ``D``) get their own init (``init_special_``). Re-runnable after ``to_empty``
        (meta-device / FSDP2 builds).
        """
        cfg = self.cfg
        for name, m in self.named_modules():
            if isinstance(m, (RMSNorm, GatedRMSNorm)):
                m.reset_parameters()
            elif isinstance(m, Canon):
                m.reset_parameters()
                if m.native and cfg.init in ("hf_normal", "linear_0.02_split"):
                    nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                if cfg.init == "mamba2_default":
                    if isinstance(m, nn.Embedding):
                        nn.init.normal_(m.weight, mean=0.0, std=0.1)
                    else:
                        m.reset_parameters()
                elif cfg.init == "lingua":
                    std = (cfg.ffn_dim if name.endswith("mlp.w2") else cfg.d_model) ** -0.5
                    nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
                else:
                    r = getattr(m, "split_init", None)
                    std = cfg.init_std ** 0.5 / r ** 0.25 if (r and cfg.init == "linear_0.02_split") else cfg.init_std
                    nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, (GatedDeltaNet, Mamba2Mixer)):
                m.init_special_()
        if self.rope_cos is not None and self.rope_cos.device.type != "meta":
            cos, sin = rope_angles(cfg.rope_dim, cfg.max_seq_len, cfg.pos.theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def check_backends(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
        """Re-resolve the op backends for ``device`` and compute ``dtype`` (e.g. ``torch.bfloat16`` under
        autocast) and set them on every Canon and token-mixer module (an ``auto`` request of Canon or a linear op stays
        ``auto`` in the modules, see :func:`_module_backends`). Returns the concrete ``{"canon": .., <op>: ..}``.
        Raises ConfigError like :func:`resolve_backends`."""
        self.backends = resolve_backends(self.cfg, device, dtype)
        names = _module_backends(self.cfg, self.backends)
        op = MIXER_OP[self.cfg.arch]
        for m in self.modules():
            if isinstance(m, Canon):
                m.backend = names["canon"]
            elif isinstance(m, (Attention, GLA, GatedDeltaNet, Mamba2Mixer)):
                m.backend = names[op]
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
        full T x T score and value products (no causal halving), as PaLM does. Linear mixers (GLA / GDN / Mamba2)
        have no T x T term: their state update and read-out are counted as ``6 · 2 · L · H · d_k · d_v`` per token
        (one outer-product update and one state read per token, forward + backward; the chunked form's intra-chunk
        products are an implementation detail)."""
        cfg = self.cfg
        n = self.num_params() - self.tok_emb.weight.numel()
        if cfg.tie_embeddings:
            n += self.lm_head.weight.numel()
        if cfg.arch == "llama":
            return float(6 * n + 12 * cfg.n_layers * cfg.d_model * seq_len)
        state = cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim  # Mamba2: H · N · P
        return float(6 * n + 12 * cfg.n_layers * state)


LlamaCanon = CanonLM  # the Transformer is ``arch=llama``; kept as the name the paper and the release use
