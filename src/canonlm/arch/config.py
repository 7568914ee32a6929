"""Typed model configuration and its validation (paper §3, §4, App. C).

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


# Model sizes of the paper's synthetic grid (paper §3) plus tiny CPU sizes. Name -> (n_layers, d_model, n_heads).
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
LINEAR_CANON_LETTERS = "AbBCD"  # GLA / GDN / Mamba2: 'b' = the mixer's own short conv (paper §4)

# Token-mixer families (paper App. C). The Hydra `arch` presets (gla5, gdn2, mamba2_mlp, ...) are settings of these.
ARCHS = ("llama", "gla", "gdn", "mamba2")
LINEAR_ARCHS = ("gla", "gdn", "mamba2")


def position_encoding(arch: str, pos_type: str) -> str:
    """The positional encoding a model of ``arch`` applies: ``pos_type`` (``rope`` | ``partial_rope`` | ``nope``,
    the ``pos`` group) for Llama, ``"none"`` for the linear mixers (GLA, GDN, Mamba2), which take no positions
    whatever the composed ``pos`` group says."""
    return "none" if arch in LINEAR_ARCHS else pos_type


INITS = ("hf_normal", "lingua", "linear_0.02_split", "mamba2_default")


@dataclass
class CanonConfig:
    """Canon layers (paper §4, eq. 4.1).

    set: placements written as a string (``"ABCD"``, ``"AC"``, ``""`` = none), each letter once; the release's
        spellings ``"AbbCD"`` / ``"bb"`` are read as ``"AbCD"`` / ``"b"`` (:func:`canon_set`). Llama: letters from
        ``ABCD``. GLA / GDN / Mamba2: letters from ``AbBCD``, where lowercase ``b`` keeps the mixer's own
        non-residual SiLU short conv (paper §4) and its absence removes it; ``canon=AbCD`` is the paper's default for
        linear models.
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
    """Position encoding (RoPE: Su et al. 2021; NoPE, ALiBi: paper Result 3).

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
    """Decoder LM with Canon layers: Llama (paper §4) or a linear token mixer (GLA, GDN, Mamba2; App. C).

    Sizes: ``n_layers``, ``d_model``, ``n_heads`` (``head_dim = d_model // n_heads``), ``n_kv_heads`` (GQA; None =
    n_heads), ``d_ff`` (None = gated: ``ffn_multiple_of * ceil(8 d / 3 / ffn_multiple_of)``; standard: 4 d).
    ``mlp``: ``gated`` (SwiGLU) | ``standard``; ``mlp_act``: ``silu`` | ``relu2`` | ``gelu``.
    ``qk_norm``: ``none`` | ``whole`` (RMSNorm over all projected q / k channels, official) | ``per_head``.
    ``init``: ``hf_normal`` (normal(0, init_std), synthetic presets) | ``lingua`` (trunc-normal d^-1/2). Canon
    weights always keep PyTorch's default init.
    ``ops``: ``auto`` | ``reference`` | ``fused``; ``kernels`` may pin one op: ``{"canon" | "attention" | "gla" |
    "gdn" | "ssd": backend}``.

    Linear token mixers (``arch`` = ``gla`` | ``gdn`` | ``mamba2``; paper App. C; keys as in fla / HF Mamba2):
    ``n_heads`` None = the paper's rule (GLA: 4; GDN: max(4, d // 128); Mamba2: 16); ``expand_k`` / ``expand_v``:
    key / value width = expand · d (GLA 0.5 / 1, GLA5 1 / 2, GDN 0.75 / 1.5, GDN2 1 / 2); ``gate_low_rank_dim``:
    rank of GLA's forget-gate projection (16); ``key_head_dim``: when ``n_heads`` is None, heads =
    max(1, round(key_dim / key_head_dim)) (GLA5 / GDN2: 128, i.e. 16 heads at d=2048); ``gate_logit_normalizer``:
    GLA's gate = logsigmoid(.) / this (16);
    ``output_gate_rank``: 0 = full-rank output gate d -> value_dim, r > 0 = Linear(d, r) ∘ Linear(r, value_dim, bias)
    (GLA5 / GDN2: 16); ``conv_kernel``: width of the mixer's own short conv (4); ``no_conv_act``: what replaces the
    short conv on q/k/v when ``b`` is absent (``silu``, official; ``none``, upstream GLA); ``chunk_size``: chunk of
    the chunked GLA/GDN/SSD algorithms (speed only, not results); ``ssm_state``: Mamba2 state size N (paper 64,
    4.2 recipes 128); ``mamba_expand``: d_inner = expand · d (2); ``n_groups``: Mamba2 B/C groups G (1);
    ``n_layers_factor``: blocks per size-layer (Mamba2 without MLP: 2, the paper's 2ℓ layers); ``ffn_ratio``:
    d_ff = ffn_ratio · d when set (GLA5 / GDN2 / Mamba2(mlp): 2); ``mlp`` may be ``none`` (Mamba2 without MLP).
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
    # linear token mixers (ignored by llama)
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    output_gate_rank: int = 0
    key_head_dim: int | None = None
    conv_kernel: int = 4
    no_conv_act: str = "silu"
    chunk_size: int = 64
    ssm_state: int = 64
    mamba_expand: int = 2
    n_groups: int = 1
    n_layers_factor: int = 1
    ffn_ratio: float | None = None
    canon: CanonConfig = field(default_factory=CanonConfig)
    pos: PosConfig = field(default_factory=PosConfig)

    @property
    def head_dim(self) -> int:
        """Attention head width d / H (Llama). Linear mixers: see :attr:`head_k_dim`, :attr:`head_v_dim`."""
        return self.d_model // self.n_heads

    @property
    def key_dim(self) -> int:
        """GLA / GDN total key width ``expand_k · d`` (q and k projections)."""
        return int(round(self.expand_k * self.d_model))

    @property
    def value_dim(self) -> int:
        """GLA / GDN total value width ``expand_v · d``; Mamba2: d_inner = ``mamba_expand · d``."""
        if self.arch == "mamba2":
            return self.mamba_expand * self.d_model
        return int(round(self.expand_v * self.d_model))

    @property
    def head_k_dim(self) -> int:
        """Per-head key width d_k (GLA / GDN); Mamba2: the state size N."""
        return self.ssm_state if self.arch == "mamba2" else self.key_dim // self.n_heads

    @property
    def head_v_dim(self) -> int:
        """Per-head value width d_v (GLA / GDN); Mamba2: head_dim P = d_inner / H."""
        return self.value_dim // self.n_heads

    @property
    def has_mlp(self) -> bool:
        """False for ``mlp: none`` (Mamba2 without MLP): the block is norm -> Canon-A -> mixer only."""
        return self.mlp != "none"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width: ``d_ff`` if set; standard MLP 4d; gated ``m * ceil(8d / 3 / m)`` with
        ``m = ffn_multiple_of`` (default 256: "8/3·d rounded up to 256", lingua; ``m = 1`` gives
        HF's unrounded 8d/3 (ceil)). E.g. d=768 -> 2048, d=512 -> 1536, d=128 -> 512."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "none":
            return 0
        if self.ffn_ratio is not None:
            return int(round(self.ffn_ratio * self.d_model))
        if self.mlp == "standard":
            return 4 * self.d_model
        m = self.ffn_multiple_of
        return m * math.ceil(8 * self.d_model / 3 / m)

    @property
    def rope_dim(self) -> int:
        """Rotated channels per head (0 for NoPE and for the linear mixers, which have no positional encoding)."""
        if position_encoding(self.arch, self.pos.type) in ("nope", "none"):
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


def default_heads(
    arch: str, d_model: int, size_heads: int | None, key_dim: int | None = None, key_head_dim: int | None = None
) -> int:
    """The paper's head count for ``arch`` when ``model.n_heads`` is null (paper App. C): with
    ``key_head_dim`` set (GLA5 / GDN2: 128), ``max(1, round(key_dim / key_head_dim))`` (16 / 24 / 32 heads at
    d = 2048 / 3072 / 4096); else GLA 4; GDN ``max(4, d // 128)`` (4 at d=512, 6 at d=768: d_k = 96 with
    expand_k = 0.75); Mamba2 16 (head_dim 2d/16); Llama the size's heads."""
    if key_head_dim and key_dim and arch in ("gla", "gdn"):
        return max(1, round(key_dim / key_head_dim))
    if arch == "gla":
        return 4
    if arch == "gdn":
        return max(4, d_model // 128)
    if arch == "mamba2":
        return 16
    return int(size_heads or 1)


def _validate_linear(cfg: ModelConfig) -> None:
    d, H = cfg.d_model, cfg.n_heads
    for key in (
        "gate_low_rank_dim",
        "conv_kernel",
        "chunk_size",
        "ssm_state",
        "mamba_expand",
        "n_groups",
        "n_layers_factor",
    ):
        _positive_int(f"model.{key}", getattr(cfg, key))
    if cfg.key_head_dim is not None:
        _positive_int("model.key_head_dim", cfg.key_head_dim)
    if not isinstance(cfg.output_gate_rank, int) or isinstance(cfg.output_gate_rank, bool) or cfg.output_gate_rank < 0:
        raise ConfigError(
            "model.output_gate_rank", cfg.output_gate_rank, "0 (full-rank output gate) or a positive rank"
        )
    _positive_float("model.gate_logit_normalizer", cfg.gate_logit_normalizer)
    _choice("model.no_conv_act", cfg.no_conv_act, ("silu", "none"))
    if cfg.arch == "mamba2":
        if (cfg.mamba_expand * d) % H:
            raise ConfigError(
                "model.n_heads",
                H,
                f"a divisor of d_inner = mamba_expand * d_model = {cfg.mamba_expand * d}"
                " (Mamba2 head_dim = d_inner / n_heads)",
            )
        if H % cfg.n_groups:
            raise ConfigError(
                "model.n_groups", cfg.n_groups, f"a divisor of model.n_heads={H} (heads share B/C per group)"
            )
        return
    for key, width in (("expand_k", cfg.key_dim), ("expand_v", cfg.value_dim)):
        _positive_float(f"model.{key}", getattr(cfg, key))
        if abs(getattr(cfg, key) * d - width) > 1e-6 or width < H or width % H:
            raise ConfigError(
                f"model.{key}",
                getattr(cfg, key),
                f"a factor making {key} * d_model (d_model={d}) an integer divisible by n_heads={H}",
            )


def validate(cfg: ModelConfig) -> ModelConfig:
    """Check every field; raise :class:`ConfigError` on the first bad one. Returns ``cfg``."""
    _choice("model.arch", cfg.arch, ARCHS)
    for key in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "ffn_multiple_of"):
        _positive_int(f"model.{key}", getattr(cfg, key))
    linear = cfg.arch in LINEAR_ARCHS
    if not linear and cfg.d_model % cfg.n_heads:
        raise ConfigError(
            "model.n_heads", cfg.n_heads, f"a divisor of model.d_model={cfg.d_model} (head_dim = d_model / n_heads)"
        )
    if cfg.n_kv_heads is not None:
        _positive_int("model.n_kv_heads", cfg.n_kv_heads)
        if linear:
            raise ConfigError("model.n_kv_heads", cfg.n_kv_heads, f"null (GQA is an attention option; arch={cfg.arch})")
        if cfg.n_heads % cfg.n_kv_heads:
            raise ConfigError("model.n_kv_heads", cfg.n_kv_heads, f"a divisor of model.n_heads={cfg.n_heads}")
    if cfg.d_ff is not None:
        _positive_int("model.d_ff", cfg.d_ff)
    if cfg.ffn_ratio is not None:
        _positive_float("model.ffn_ratio", cfg.ffn_ratio)
    _choice("model.mlp", cfg.mlp, ("gated", "standard", "none") if cfg.arch == "mamba2" else ("gated", "standard"))
    _choice("model.mlp_act", cfg.mlp_act, ("silu", "relu2", "gelu"))
    _choice("model.qk_norm", cfg.qk_norm, ("none", "whole", "per_head"))
    if linear and cfg.qk_norm != "none":
        raise ConfigError("model.qk_norm", cfg.qk_norm, f"none (QK-norm is an attention option; arch={cfg.arch})")
    _choice("model.init", cfg.init, INITS)
    _positive_float("model.init_std", cfg.init_std)
    _positive_float("model.norm_eps", cfg.norm_eps)
    _bool("model.tie_embeddings", cfg.tie_embeddings)
    _choice("model.ops", cfg.ops, ("auto", "reference", "fused"))
    for op in cfg.kernels:
        _choice("model.kernels", op, ("canon", "attention", "gla", "gdn", "ssd"))
    if linear:
        _validate_linear(cfg)

    c = cfg.canon
    letters = LINEAR_CANON_LETTERS if linear else CANON_LETTERS
    bad = sorted(set(c.set) - set(letters))
    if bad:
        if linear:
            raise ConfigError(
                "canon.set",
                c.set,
                f"a string of letters from {letters!r} for arch={cfg.arch} (e.g. "
                "'AbCD' = the paper's default, 'b' = the original model, '' = no conv at all)",
            )
        raise ConfigError(
            "canon.set",
            c.set,
            f"a string of letters from {CANON_LETTERS!r} (e.g. 'ABCD', 'AC', '')"
            + (
                " — lowercase 'b' is the native conv of linear models (GLA/GDN/Mamba2), not Llama" if "b" in bad else ""
            ),
        )
    if not cfg.has_mlp and (c.has("C") or c.has("D")):
        raise ConfigError(
            "canon.set",
            c.set,
            f"letters from 'AbB' for arch={cfg.arch} without an MLP (model.mlp=none"
            " has no Canon-C / Canon-D sites; arch=mamba2 has the MLP for Canon-AbCD)",
        )
    _positive_int("canon.kernel", c.kernel)
    _choice("canon.init", c.init, ("default", "identity", "fixed"))
    for key in ("residual", "activation", "bias", "trainable"):
        _bool(f"canon.{key}", getattr(c, key))

    p = cfg.pos
    _choice("pos.type", p.type, ("rope", "partial_rope", "nope"))
    _choice("pos.pairing", p.pairing, ("half", "interleaved"))
    _positive_float("pos.theta", p.theta)
    if linear:
        return cfg  # linear mixers have no positional encoding: `pos` does not apply
    if p.type == "partial_rope":
        if isinstance(p.fraction, bool) or not isinstance(p.fraction, (int, float)) or not 0.0 < p.fraction <= 1.0:
            raise ConfigError(
                "pos.fraction", p.fraction, "a fraction of head dims in (0, 1] (paper's reduced RoPE: 0.25)"
            )
        r = cfg.rope_dim
        if r < 2 or r % 2:
            raise ConfigError(
                "pos.fraction",
                p.fraction,
                f"a fraction whose rotated width round(fraction*head_dim={cfg.head_dim}) is even and >= 2 (got {r})",
            )
    elif p.type == "rope" and cfg.head_dim % 2:
        raise ConfigError(
            "model.n_heads",
            cfg.n_heads,
            f"a head count giving an even head_dim for RoPE "
            f"(d_model={cfg.d_model} / n_heads = {cfg.head_dim}), or pos=nope",
        )
    return cfg


def canon_set(value: Any) -> str:
    """The Canon set ``value`` names, as the model config records it: each letter once, in the order given.

    Every letter may appear once; lowercase ``b`` may appear twice, because the release spells the sets with the
    mixer's own conv ``"AbbCD"`` and ``"bb"`` (= ``"AbCD"`` and ``"b"``; the doubled ``b`` keeps the file names apart
    from ``ABCD`` / ``B`` on case-insensitive file systems, spec: the official ``canon_set`` is tested with
    ``'b' in s``), and those two spellings are normalised to one ``b``. Any other repeated letter (``"AAB"``) raises
    ConfigError("canon.set", ...): normalising it silently would give identical models different labels. ``None``
    is ``""`` (no Canon layer). Which letters are allowed for an architecture is :func:`validate`'s check."""
    s = "" if value is None else value
    if not isinstance(s, str):
        raise ConfigError("canon.set", value, "a string of Canon letters, e.g. 'ABCD', 'AC', '' (none)")
    repeated = sorted({c for c in s if s.count(c) > (2 if c == "b" else 1)})
    if repeated:
        raise ConfigError(
            "canon.set",
            value,
            "each letter at most once (the release's 'AbbCD' / 'bb' may double "
            f"the b), e.g. {''.join(dict.fromkeys(s))!r}; repeated: {', '.join(repeated)}",
        )
    return "".join(dict.fromkeys(s))


def build_model_config(
    model: Mapping[str, Any],
    canon: Mapping[str, Any] | None = None,
    pos: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> ModelConfig:
    """Build and validate a :class:`ModelConfig` from plain mappings (e.g. Hydra nodes converted to dicts).

    ``model`` may hold ``size`` (``"12L768D"``); explicit ``n_layers`` / ``d_model`` / ``n_heads`` win over it.
    Unknown keys raise :class:`ConfigError`. ``overrides`` (e.g. ``vocab_size``, ``max_seq_len``) win over ``model``.
    """
    model = dict(model)
    model.update(overrides)
    size = model.pop("size", None)
    arch = model.get("arch", "llama")
    size_heads = None
    if size is not None:
        n_layers, d_model, size_heads = parse_size(size)
        factor = model.get("n_layers_factor") or 1
        if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
            raise ConfigError("model.n_layers_factor", factor, "a positive integer")
        for k, v in (("n_layers", n_layers * factor), ("d_model", d_model)):
            if model.get(k) is None:
                model[k] = v
    if (
        model.get("n_heads") is None
        and isinstance(model.get("d_model"), int)
        and (size_heads is not None or arch in LINEAR_ARCHS)
    ):
        kd, khd = model.get("expand_k", ModelConfig.expand_k), model.get("key_head_dim")
        valid = isinstance(kd, (int, float)) and isinstance(khd, int) and not isinstance(khd, bool) and khd > 0
        # an invalid expand_k / key_head_dim falls back to the arch's rule here and is reported by validate()
        model["n_heads"] = default_heads(
            arch,
            model["d_model"],
            size_heads,
            int(round(kd * model["d_model"])) if valid else None,
            khd if valid else None,
        )
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"canon", "pos"}
    for k in list(model):
        if k not in known:
            raise ConfigError(f"model.{k}", model[k], "one of " + ", ".join(sorted(known | {"size"})))
    model = {
        k: v for k, v in model.items() if v is not None or k in ("n_kv_heads", "d_ff", "ffn_ratio", "key_head_dim")
    }
    model["kernels"] = dict(model.get("kernels") or {})

    def sub(cls, node, prefix):
        node = dict(node or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for k in node:
            if k not in names:
                raise ConfigError(f"{prefix}.{k}", node[k], "one of " + ", ".join(sorted(names)))
        return cls(**node)

    canon_cfg = sub(CanonConfig, canon, "canon")
    canon_cfg.set = canon_set(canon_cfg.set)
    return validate(ModelConfig(canon=canon_cfg, pos=sub(PosConfig, pos, "pos"), **model))
