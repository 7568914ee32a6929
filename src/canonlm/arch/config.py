"""Typed model configuration and its validation (spec models.md §1.8, §2, §7.1).

The Hydra groups ``arch`` (→ ``model``), ``canon`` and ``pos`` map one to one onto :class:`ModelConfig`,
:class:`CanonConfig` and :class:`PosConfig`. :func:`build_model_config` validates everything before any tensor is
allocated and raises :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping


from canonlm.errors import ConfigError  # the one shared error type (stdlib-only module)


# Model sizes of the paper's synthetic grid (tasks.md §1.2) plus tiny CPU sizes. Name -> (n_layers, d_model, n_heads).
SIZES: dict[str, tuple[int, int, int]] = {
    "8L512D": (8, 512, 8),
    "12L512D": (12, 512, 8),
    "8L768D": (8, 768, 12),
    "12L768D": (12, 768, 12),
    # CPU sizes (head_dim 32 / 64)
    "2L64D": (2, 64, 2),
    "4L128D": (4, 128, 4),
    "4L256D": (4, 256, 4),
}
_SIZE_RE = re.compile(r"^(\d+)L(\d+)D$")

CANON_LETTERS = "ABCD"  # Llama placements; lowercase 'b' (mixer's native conv) is for linear models only


@dataclass
class CanonConfig:
    """Canon layers (models.md §1.1, §1.8).

    set: placements, any subset of ``ABCD`` written as a string (``"ABCD"``, ``"AC"``, ``""`` = none); duplicate
        letters are ignored (official strings such as ``"AABD"`` are accepted).
    kernel: taps K (the CUDA kernels support 2, 3, 4; the reference any K >= 1).
    residual: ``h + conv(h)`` (paper default) vs ``conv(h)``.
    activation: SiLU after the conv (paper: off).
    bias: per-channel bias, zero-initialised (paper: off).
    trainable: False = cst-Canon (weights frozen at init; Fig. 24).
    init: ``default`` (PyTorch kaiming-uniform a=sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K))), ``identity``
        (last tap 1, others 0), ``fixed`` (per-lag scalars 1, .4, .2, .1 of footnote 10, current token first).
    """

    set: str = ""
    kernel: int = 4
    residual: bool = True
    activation: bool = False
    bias: bool = False
    trainable: bool = True
    init: str = "default"

    @property
    def letters(self) -> frozenset[str]:
        return frozenset(self.set)

    def has(self, letter: str) -> bool:
        return letter in self.set


@dataclass
class PosConfig:
    """Position encoding (models.md §2, §4.2).

    type: ``rope`` | ``partial_rope`` | ``nope``.
    theta: RoPE base.
    fraction: for ``partial_rope``, the fraction of each head's dims that is rotated (paper's reduced RoPE: 0.25);
        must lie in (0, 1]; the rotated width ``rope_dim = round(fraction * head_dim)`` must be even.
    pairing: ``half`` (HF rotate_half, channels i and i + r/2) | ``interleaved`` (lingua, channels 2i and 2i+1).
    """

    type: str = "rope"
    theta: float = 10000.0
    fraction: float = 1.0
    pairing: str = "half"


@dataclass
class ModelConfig:
    """Llama-style decoder with Canon layers (models.md §1.2, §2).

    Sizes: ``n_layers``, ``d_model``, ``n_heads`` (``head_dim = d_model // n_heads``), ``n_kv_heads`` (GQA; None =
    n_heads), ``d_ff`` (None = gated: ``ffn_multiple_of * ceil(8 d / 3 / ffn_multiple_of)``; standard: 4 d).
    ``mlp``: ``gated`` (SwiGLU) | ``standard``; ``mlp_act``: ``silu`` | ``relu2`` | ``gelu``.
    ``qk_norm``: ``none`` | ``whole`` (RMSNorm over all projected q / k channels, official) | ``per_head``.
    ``init``: ``hf_normal`` (normal(0, init_std), synthetic presets) | ``lingua`` (trunc-normal d^-1/2). Canon
    weights always keep PyTorch's default init.
    ``ops``: ``auto`` | ``reference`` | ``fused``; ``kernels`` may pin one op: ``{"canon": ..., "attention": ...}``.
    """

    vocab_size: int = 128
    arch: str = "llama"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    ffn_multiple_of: int = 256
    mlp: str = "gated"
    mlp_act: str = "silu"
    norm_eps: float = 1e-6
    qk_norm: str = "none"
    init: str = "hf_normal"
    init_std: float = 0.02
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    ops: str = "auto"
    kernels: dict[str, str] = field(default_factory=dict)
    canon: CanonConfig = field(default_factory=CanonConfig)
    pos: PosConfig = field(default_factory=PosConfig)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width: ``d_ff`` if set; standard MLP 4d; gated ``m * ceil(8d / 3 / m)`` with
        ``m = ffn_multiple_of`` (default 256: "8/3·d rounded up to 256", models.md §2 / lingua; ``m = 1`` gives
        HF's unrounded 8d/3 (ceil), tasks.md §1.2). E.g. d=768 -> 2048, d=512 -> 1536, d=128 -> 512."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "standard":
            return 4 * self.d_model
        m = self.ffn_multiple_of
        return m * math.ceil(8 * self.d_model / 3 / m)

    @property
    def rope_dim(self) -> int:
        """Rotated channels per head (0 for NoPE)."""
        if self.pos.type == "nope":
            return 0
        if self.pos.type == "rope":
            return self.head_dim
        return int(round(self.pos.fraction * self.head_dim))


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(key, value, " | ".join(map(str, allowed)))


def _positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "a positive integer")


def _positive_float(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(key, value, "a positive number")


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true | false")


def parse_size(size: str) -> tuple[int, int, int]:
    """``"12L768D"`` -> (12, 768, 12). Known names use the paper's head counts; other ``<L>L<D>D`` strings get
    head_dim 64 (or 32 when d_model < 256). Raises ConfigError for anything else."""
    if size in SIZES:
        return SIZES[size]
    m = _SIZE_RE.match(str(size))
    if not m:
        raise ConfigError("model.size", size, f"one of {', '.join(SIZES)} or '<layers>L<d_model>D'")
    n_layers, d = int(m.group(1)), int(m.group(2))
    hd = 64 if d >= 256 else 32
    return n_layers, d, max(1, d // hd)


def validate(cfg: ModelConfig) -> ModelConfig:
    """Check every field; raise :class:`ConfigError` on the first bad one. Returns ``cfg``."""
    _choice("model.arch", cfg.arch, ("llama",))
    for key in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "ffn_multiple_of"):
        _positive_int(f"model.{key}", getattr(cfg, key))
    if cfg.d_model % cfg.n_heads:
        raise ConfigError("model.n_heads", cfg.n_heads,
                          f"a divisor of model.d_model={cfg.d_model} (head_dim = d_model / n_heads)")
    if cfg.n_kv_heads is not None:
        _positive_int("model.n_kv_heads", cfg.n_kv_heads)
        if cfg.n_heads % cfg.n_kv_heads:
            raise ConfigError("model.n_kv_heads", cfg.n_kv_heads, f"a divisor of model.n_heads={cfg.n_heads}")
    if cfg.d_ff is not None:
        _positive_int("model.d_ff", cfg.d_ff)
    _choice("model.mlp", cfg.mlp, ("gated", "standard"))
    _choice("model.mlp_act", cfg.mlp_act, ("silu", "relu2", "gelu"))
    _choice("model.qk_norm", cfg.qk_norm, ("none", "whole", "per_head"))
    _choice("model.init", cfg.init, ("hf_normal", "lingua"))
    _positive_float("model.init_std", cfg.init_std)
    _positive_float("model.norm_eps", cfg.norm_eps)
    _bool("model.tie_embeddings", cfg.tie_embeddings)
    _choice("model.ops", cfg.ops, ("auto", "reference", "fused"))
    for op, backend in cfg.kernels.items():
        _choice("model.kernels", op, ("canon", "attention"))

    c = cfg.canon
    bad = sorted(set(c.set) - set(CANON_LETTERS))
    if bad:
        raise ConfigError("canon.set", c.set, f"a string of letters from {CANON_LETTERS!r} (e.g. 'ABCD', 'AC', '')"
                          + (" — lowercase 'b' is the native conv of linear models (GLA/GDN/Mamba2), not Llama"
                             if "b" in bad else ""))
    _positive_int("canon.kernel", c.kernel)
    _choice("canon.init", c.init, ("default", "identity", "fixed"))
    for key in ("residual", "activation", "bias", "trainable"):
        _bool(f"canon.{key}", getattr(c, key))

    p = cfg.pos
    _choice("pos.type", p.type, ("rope", "partial_rope", "nope"))
    _choice("pos.pairing", p.pairing, ("half", "interleaved"))
    _positive_float("pos.theta", p.theta)
    if p.type == "partial_rope":
        if isinstance(p.fraction, bool) or not isinstance(p.fraction, (int, float)) or not 0.0 < p.fraction <= 1.0:
            raise ConfigError("pos.fraction", p.fraction, "a fraction of head dims in (0, 1] (paper's reduced RoPE: 0.25)")
        r = cfg.rope_dim
        if r < 2 or r % 2:
            raise ConfigError("pos.fraction", p.fraction,
                              f"a fraction whose rotated width round(fraction*head_dim={cfg.head_dim}) is even and >= 2 (got {r})")
    elif p.type == "rope" and cfg.head_dim % 2:
        raise ConfigError("model.n_heads", cfg.n_heads, f"a head count giving an even head_dim for RoPE "
                          f"(d_model={cfg.d_model} / n_heads = {cfg.head_dim}), or pos=nope")
    return cfg


def build_model_config(model: Mapping[str, Any], canon: Mapping[str, Any] | None = None,
                       pos: Mapping[str, Any] | None = None, **overrides: Any) -> ModelConfig:
    """Build and validate a :class:`ModelConfig` from plain mappings (e.g. Hydra nodes converted to dicts).

    ``model`` may hold ``size`` (``"12L768D"``); explicit ``n_layers`` / ``d_model`` / ``n_heads`` win over it.
    Unknown keys raise :class:`ConfigError`. ``overrides`` (e.g. ``vocab_size``, ``max_seq_len``) win over ``model``.
    """
    model = dict(model)
    model.update(overrides)
    size = model.pop("size", None)
    if size is not None:
        n_layers, d_model, n_heads = parse_size(size)
        for k, v in (("n_layers", n_layers), ("d_model", d_model), ("n_heads", n_heads)):
            if model.get(k) is None:
                model[k] = v
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"canon", "pos"}
    for k in list(model):
        if k not in known:
            raise ConfigError(f"model.{k}", model[k], "one of " + ", ".join(sorted(known | {"size"})))
    model = {k: v for k, v in model.items() if v is not None or k in ("n_kv_heads", "d_ff")}
    model["kernels"] = dict(model.get("kernels") or {})

    def sub(cls, node, prefix):
        node = dict(node or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for k in node:
            if k not in names:
                raise ConfigError(f"{prefix}.{k}", node[k], "one of " + ", ".join(sorted(names)))
        return cls(**node)

    canon_cfg = sub(CanonConfig, canon, "canon")
    canon_cfg.set = "".join(dict.fromkeys(str(canon_cfg.set or "")))  # dedupe, keep order
    return validate(ModelConfig(canon=canon_cfg, pos=sub(PosConfig, pos, "pos"), **model))
