"""Config and state-dict conversion between canonlm's ``CanonLM`` (``arch=llama``) and two Hugging Face formats.

* **native** -- transformers ``LlamaForCausalLM`` / ``LlamaConfig`` (``model_type: "llama"``): a Llama without Canon
  layers, with full RoPE and no QK-norm.
* **official** -- the PhysicsLM4 release's ``LlamaCanonForCausalLM`` / ``LlamaCanonConfig``
  (``model_type: "LlamaCanon"``; files ``configuration_llama_canon.py``, ``modeling_llama_canon.py``,
  ``canon_helper.py`` of the official release): Canon-A/B/C/D (``canon_set``, ``canon_kernel``, ``canon_residual``,
  ``canon_activation``, ``canon_bias``), ``qk_norm`` (one RMSNorm over all projected q / k channels), partial RoPE
  (``rope_dim``) and the two RoPE pairings (``rope_version``: ``huggingface`` = canonlm ``pos.pairing=half``,
  ``lingua`` = ``interleaved``).

Everything here works on plain dicts and CPU tensors; nothing imports transformers. Names (``<i>`` = layer):

======================================  ==============================================================
canonlm (``CanonLM.state_dict()``)      Hugging Face (both formats; Canon / QK-norm only in official)
======================================  ==============================================================
``tok_emb.weight (V, d)``               ``model.embed_tokens.weight``
``blocks.<i>.attn_norm.weight``         ``model.layers.<i>.input_layernorm.weight``
``blocks.<i>.canon_a.weight (d, K)``    ``model.layers.<i>.canonA.weight (d, 1, K)`` (+ ``.bias (d,)``)
``blocks.<i>.attn.wqkv.weight``         rows split into ``self_attn.q_proj`` (H·dh), ``k_proj``, ``v_proj`` (Hkv·dh)
``blocks.<i>.attn.q_norm/k_norm``       ``self_attn.q_norm.weight (H·dh)`` / ``k_norm.weight (Hkv·dh)``
``blocks.<i>.attn.canon_b.weight``      ``self_attn.canonB.weight ((H+2Hkv)·dh, 1, K)`` (channels ``[q ; k ; v]``)
``blocks.<i>.attn.wo.weight``           ``self_attn.o_proj.weight``
``blocks.<i>.mlp_norm.weight``          ``post_attention_layernorm.weight``
``blocks.<i>.canon_c.weight``           ``canonC.weight (d, 1, K)``
``blocks.<i>.mlp.w13.weight (2F, d)``   halves ``mlp.gate_proj`` (first) and ``mlp.up_proj``
``blocks.<i>.mlp.canon_d.weight``       ``mlp.canonD.weight (2F, 1, K)`` (channels ``[gate ; up]``)
``blocks.<i>.mlp.w2.weight``            ``mlp.down_proj.weight``
``norm.weight`` / ``lm_head.weight``    ``model.norm.weight`` / ``lm_head.weight`` (absent when tied)
======================================  ==============================================================

Canon taps: canonlm stores ``(C, K)``, the official ``ShortConvolution`` (an ``nn.Conv1d``) ``(C, 1, K)``; in both
the last tap multiplies the current token. Every error is an :class:`InteropError` naming what and why.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import torch

from canonlm.arch.config import ModelConfig, build_model_config
from canonlm.arch.positional import interleaved_to_half_permutation
from canonlm.errors import ConfigError

OFFICIAL_MODEL_TYPE = "LlamaCanon"
NATIVE_MODEL_TYPE = "llama"
OFFICIAL_AUTO_MAP = {
    "AutoConfig": "configuration_llama_canon.LlamaCanonConfig",
    "AutoModelForCausalLM": "modeling_llama_canon.LlamaCanonForCausalLM",
}
# canonlm mlp_act -> transformers ACT2FN name (and back; "swish" is ACT2FN's alias of SiLU)
_ACT_TO_HF = {"silu": "silu", "relu2": "relu2", "gelu": "gelu"}
_ACT_FROM_HF = {"silu": "silu", "swish": "silu", "relu2": "relu2", "gelu": "gelu"}
_CANON_SITES = {"A": ("canon_a", "canonA"), "C": ("canon_c", "canonC")}


class InteropError(ValueError):
    """A model, config or tensor set that cannot be converted: the message names what and why (CLI exit code 2)."""


# ============================================================================================ canonlm -> HF
def hf_format(cfg: ModelConfig) -> str:
    """``"native"`` (transformers ``LlamaForCausalLM``) or ``"official"`` (``LlamaCanonForCausalLM``) for ``cfg``.

    Raises InteropError when neither can express the model: a linear token mixer (GLA / GDN / Mamba2), NoPE, a
    non-gated MLP, per-head QK-norm, or Canon biases (the official ``canon_helper.create_canon`` refuses
    ``canon_bias=True``)."""
    if cfg.arch != "llama":
        raise InteropError(
            f"model.arch={cfg.arch!r} cannot be exported: only arch=llama maps to a Hugging Face class "
            "(transformers LlamaForCausalLM or the official LlamaCanonForCausalLM, both softmax attention); the "
            "GLA / Gated DeltaNet / Mamba2 token mixers have no counterpart there"
        )
    if cfg.pos.type == "nope":
        raise InteropError(
            "pos.type='nope' cannot be exported: LlamaForCausalLM and LlamaCanonForCausalLM always "
            "apply RoPE (LlamaCanon's rope_dim=0 falls back to full RoPE)"
        )
    if cfg.mlp != "gated":
        raise InteropError(
            f"model.mlp={cfg.mlp!r} cannot be exported: the Hugging Face Llama MLP is gated "
            "(gate_proj / up_proj / down_proj)"
        )
    if cfg.qk_norm == "per_head":
        raise InteropError(
            "model.qk_norm='per_head' cannot be exported: LlamaCanon's qk_norm is one RMSNorm over "
            "all projected q / k channels (canonlm qk_norm=whole)"
        )
    if cfg.canon.set and cfg.canon.bias:
        raise InteropError(
            "canon.bias=true cannot be exported: the official canon_helper.create_canon refuses "
            "canon_bias=True (assert), so LlamaCanonForCausalLM cannot load Canon biases"
        )
    if cfg.mlp_act not in _ACT_TO_HF:
        raise InteropError(f"model.mlp_act={cfg.mlp_act!r} has no transformers ACT2FN name")
    if not cfg.canon.set and cfg.qk_norm == "none" and cfg.rope_dim == cfg.head_dim:
        return "native"
    return "official"


def to_hf_config(cfg: ModelConfig, *, official: bool = False) -> dict[str, Any]:
    """The ``config.json`` dict for ``cfg`` (format chosen by :func:`hf_format`, or the official one whenever
    ``official``; raises its InteropError).

    Native: ``LlamaConfig`` fields (``rope_parameters`` for transformers 5.x and ``rope_theta`` for 4.x, both
    written). Official: ``LlamaCanonConfig`` fields plus ``auto_map`` naming ``configuration_llama_canon`` /
    ``modeling_llama_canon`` (the user places the official release's files beside ``config.json``).
    ``max_position_embeddings`` = ``cfg.max_seq_len`` (the trained context); ``torch_dtype`` float32."""
    fmt = "official" if official and hf_format(cfg) else hf_format(cfg)
    theta = float(cfg.pos.theta)
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if fmt == "native" else "LlamaCanonForCausalLM"],
        "model_type": NATIVE_MODEL_TYPE if fmt == "native" else OFFICIAL_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": _ACT_TO_HF[cfg.mlp_act],
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }
    if fmt == "native":
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        return out
    c = cfg.canon
    out.update(
        rope_scaling=None,
        canon_set=c.set,
        canon_kernel=c.kernel,
        canon_residual=c.residual,
        canon_activation=c.activation,
        canon_bias=bool(c.bias and c.set),
        qk_norm=cfg.qk_norm == "whole",
        rope_dim=None if cfg.rope_dim == cfg.head_dim else cfg.rope_dim,
        rope_version="huggingface" if cfg.pos.pairing == "half" else "lingua",
        auto_map=dict(OFFICIAL_AUTO_MAP),
    )
    return out


def _canon_to_hf(w: torch.Tensor) -> torch.Tensor:
    return w.unsqueeze(1)  # (C, K) -> (C, 1, K)


def to_hf_state_dict(
    cfg: ModelConfig, sd: Mapping[str, torch.Tensor], *, official: bool = False
) -> dict[str, torch.Tensor]:
    """canonlm ``CanonLM.state_dict()`` keys -> Hugging Face keys (module table), as fresh contiguous float tensors.

    Native format (:func:`hf_format`, unless ``official``) with ``pos.pairing=interleaved``: the rows of every q / k
    head are permuted to ``half`` pairing (:func:`canonlm.arch.positional.interleaved_to_half_permutation`; all q·k
    products are unchanged); the official format keeps the pairing (its ``rope_version`` says which). Tied
    embeddings: ``lm_head.weight`` is left out (transformers ties it). Raises InteropError (unexpressible config,
    missing / unexpected / mis-shaped tensors, checked against a ``meta``-device ``CanonLM(cfg)``)."""
    fmt = "official" if official and hf_format(cfg) else hf_format(cfg)
    _check_canonlm_tensors(cfg, sd)
    H, Hkv, dh, L = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.n_layers
    perm = interleaved_to_half_permutation(dh, dh) if fmt == "native" and cfg.pos.pairing == "interleaved" else None
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(L):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[b + "attn_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[b + "mlp_norm.weight"]
        q, k, v = sd[b + "attn.wqkv.weight"].split([H * dh, Hkv * dh, Hkv * dh], dim=0)
        if perm is not None:
            q = q.view(H, dh, -1)[:, perm].reshape(H * dh, -1)
            k = k.view(Hkv, dh, -1)[:, perm].reshape(Hkv * dh, -1)
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = sd[b + "attn.wo.weight"]
        gate, up = sd[b + "mlp.w13.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = sd[b + "mlp.w2.weight"]
        if cfg.qk_norm == "whole":
            out[h + "self_attn.q_norm.weight"] = sd[b + "attn.q_norm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[b + "attn.k_norm.weight"]
        for letter, (ours, theirs) in {
            **_CANON_SITES,
            "B": ("attn.canon_b", "self_attn.canonB"),
            "D": ("mlp.canon_d", "mlp.canonD"),
        }.items():
            if cfg.canon.has(letter):
                out[h + theirs + ".weight"] = _canon_to_hf(sd[b + ours + ".weight"])
                if cfg.canon.bias:
                    out[h + theirs + ".bias"] = sd[b + ours + ".bias"]
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in out.items()}


def _check_canonlm_tensors(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> None:
    """Compare ``sd`` with the keys and shapes of ``CanonLM(cfg)`` built on the meta device; raise InteropError."""
    expected = expected_canonlm_shapes(cfg)
    compare_shapes("the canonlm checkpoint", {k: tuple(v.shape) for k, v in sd.items()}, expected)


def expected_canonlm_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of ``CanonLM(cfg).state_dict()`` (built on the meta device: no memory, no kernels)."""
    from canonlm.arch.model import CanonLM

    meta_cfg = dataclasses.replace(cfg, ops="reference", kernels={})
    with torch.device("meta"):
        model = CanonLM(meta_cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def compare_shapes(what: str, got: Mapping[str, tuple], expected: Mapping[str, tuple]) -> None:
    """Raise InteropError naming the missing, unexpected and mis-shaped tensors of ``got`` (``{key: shape}``)
    against ``expected``; ``what`` names the source in the message."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(
                f"missing {len(missing)} tensor(s): {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")
            )
        if unexpected:
            parts.append(
                f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:6])}"
                + (" ..." if len(unexpected) > 6 else "")
            )
        raise InteropError(f"{what} does not match its config: " + "; ".join(parts))
    bad = [(k, got[k], expected[k]) for k in sorted(expected) if tuple(got[k]) != tuple(expected[k])]
    if bad:
        raise InteropError(
            f"{what} does not match its config: "
            + "; ".join(f"{k} has shape {tuple(g)}, expected {tuple(e)}" for k, g, e in bad[:4])
        )


# ============================================================================================ HF -> canonlm
def _get(c: Mapping[str, Any], key: str, default: Any = None) -> Any:
    v = c.get(key, default)
    return default if v is None and default is not None else v


def from_hf_config(c: Mapping[str, Any]) -> ModelConfig:
    """A validated canonlm :class:`ModelConfig` (``arch=llama``) for a ``config.json`` dict of transformers
    ``LlamaForCausalLM`` (``model_type: "llama"``) or the official ``LlamaCanonForCausalLM`` (``"LlamaCanon"``).

    ``d_ff`` = ``intermediate_size`` (official default when null: ``hidden_size * 8 // 3``), ``max_seq_len`` =
    ``max_position_embeddings``, ``init_std`` = ``initializer_range``; RoPE theta from ``rope_parameters`` (5.x) or
    ``rope_theta`` (4.x). Raises InteropError naming the key for anything canonlm cannot reproduce exactly: another
    ``model_type``, RoPE scaling (any ``rope_type`` but ``default``), attention / MLP biases, a ``head_dim`` other
    than ``hidden_size / num_attention_heads``, an activation other than silu / relu2 / gelu, a native Llama with
    ``partial_rotary_factor`` != 1, sliding windows, bad Canon / RoPE fields."""
    mt = c.get("model_type")
    if mt not in (NATIVE_MODEL_TYPE, OFFICIAL_MODEL_TYPE):
        raise InteropError(
            f"config.json: model_type={mt!r} cannot be imported; canonlm maps only "
            f"{NATIVE_MODEL_TYPE!r} (transformers LlamaForCausalLM) and {OFFICIAL_MODEL_TYPE!r} "
            "(the official LlamaCanonForCausalLM)"
        )
    official = mt == OFFICIAL_MODEL_TYPE

    def refuse(key: str, value: Any, why: str) -> InteropError:
        return InteropError(f"config.json: {key}={value!r} cannot be imported: {why}")

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise refuse(key, v, "a positive integer is required")
    d, H = c["hidden_size"], c["num_attention_heads"]
    Hkv = _get(c, "num_key_value_heads", H)
    if d % H:
        raise refuse("num_attention_heads", H, f"hidden_size={d} is not a multiple of it")
    hd = _get(c, "head_dim", d // H)
    if hd != d // H:
        raise refuse("head_dim", hd, f"canonlm's head width is hidden_size / num_attention_heads = {d // H}")
    rs = c.get("rope_scaling")
    rp = c.get("rope_parameters")
    for key, node in (("rope_scaling", rs), ("rope_parameters", rp)):
        if node is None:
            continue
        if not isinstance(node, Mapping):
            raise refuse(key, node, "expected a mapping or null")
        rtype = node.get("rope_type", node.get("type", "default"))
        if rtype != "default" or set(node) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}:
            raise refuse(
                key,
                dict(node),
                "RoPE scaling (linear / dynamic / yarn / llama3 ...) has no canonlm "
                "counterpart; only rope_type 'default' maps",
            )
    theta = (rp or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise refuse(key, c[key], "canonlm's Llama has no biases in its linear layers")
    if c.get("sliding_window") or c.get("use_sliding_window"):
        raise refuse("sliding_window", c.get("sliding_window"), "canonlm attends to every earlier position")
    act = c.get("hidden_act", "silu")
    if act not in _ACT_FROM_HF:
        raise refuse("hidden_act", act, "allowed: " + " | ".join(_ACT_FROM_HF))
    inter = c.get("intermediate_size")
    if inter is None:
        if not official:
            raise refuse("intermediate_size", inter, "a positive integer is required")
        inter = d * 8 // 3  # LlamaCanonMLP's default
    prf = (rp or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    pos: dict[str, Any] = {"type": "rope", "theta": float(theta), "pairing": "half"}
    canon: dict[str, Any] = {"set": ""}
    qk_norm = "none"
    if official:
        rv = c.get("rope_version", "huggingface")
        if rv not in ("huggingface", "lingua"):
            raise refuse("rope_version", rv, "allowed: huggingface | lingua")
        pos["pairing"] = "half" if rv == "huggingface" else "interleaved"
        rd = c.get("rope_dim")
        if rd is not None and rd != hd:
            if not isinstance(rd, int) or isinstance(rd, bool) or rd < 2 or rd % 2 or rd > hd:
                raise refuse("rope_dim", rd, f"an even integer in [2, head_dim={hd}] or null is required")
            pos.update(type="partial_rope", fraction=rd / hd)
        elif prf not in (None, 1, 1.0) and rd is None:
            raise refuse("partial_rotary_factor", prf, "LlamaCanon rotates rope_dim channels; set rope_dim instead")
        cs = c.get("canon_set") or ""
        if not isinstance(cs, str) or set(cs) - set("ABCD"):
            raise refuse("canon_set", cs, "a string of letters from 'ABCD' is required")
        canon = {
            "set": "".join(dict.fromkeys(cs)),
            "kernel": c.get("canon_kernel", 4),
            "residual": c.get("canon_residual", True),
            "activation": c.get("canon_activation", False),
            "bias": bool(c.get("canon_bias", False)),
        }
        qn = c.get("qk_norm", False)
        if qn not in (True, False):
            raise refuse("qk_norm", qn, "true | false")
        qk_norm = "whole" if qn else "none"
    elif prf not in (None, 1, 1.0):
        raise refuse(
            "partial_rotary_factor", prf, "LlamaForCausalLM's rotary code rotates the whole head; only 1.0 maps"
        )
    model = dict(
        arch="llama",
        vocab_size=c["vocab_size"],
        n_layers=c["num_hidden_layers"],
        d_model=d,
        n_heads=H,
        n_kv_heads=None if Hkv == H else Hkv,
        d_ff=inter,
        mlp="gated",
        mlp_act=_ACT_FROM_HF[act],
        norm_eps=float(_get(c, "rms_norm_eps", 1e-6)),
        qk_norm=qk_norm,
        init_std=float(_get(c, "initializer_range", 0.02)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(_get(c, "max_position_embeddings", 2048)),
    )
    try:
        return build_model_config(model, canon, pos)
    except ConfigError as e:
        raise InteropError(
            f"config.json cannot be imported: it maps to a canonlm config that is not valid: {e}"
        ) from None


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` a Hugging Face directory for ``cfg`` must hold (``lm_head.weight`` optional when tied)."""
    H, Hkv, dh, d, F_ = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model, cfg.ffn_dim
    K = cfg.canon.kernel
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    widths = {
        "A": ("canonA", d),
        "B": ("self_attn.canonB", (H + 2 * Hkv) * dh),
        "C": ("canonC", d),
        "D": ("mlp.canonD", 2 * F_),
    }
    for i in range(cfg.n_layers):
        h = f"model.layers.{i}."
        out.update(
            {
                h + "input_layernorm.weight": (d,),
                h + "post_attention_layernorm.weight": (d,),
                h + "self_attn.q_proj.weight": (H * dh, d),
                h + "self_attn.k_proj.weight": (Hkv * dh, d),
                h + "self_attn.v_proj.weight": (Hkv * dh, d),
                h + "self_attn.o_proj.weight": (d, H * dh),
                h + "mlp.gate_proj.weight": (F_, d),
                h + "mlp.up_proj.weight": (F_, d),
                h + "mlp.down_proj.weight": (d, F_),
            }
        )
        if cfg.qk_norm == "whole":
            out[h + "self_attn.q_norm.weight"] = (H * dh,)
            out[h + "self_attn.k_norm.weight"] = (Hkv * dh,)
        for letter, (name, width) in widths.items():
            if cfg.canon.has(letter):
                out[h + name + ".weight"] = (width, 1, K)
                if cfg.canon.bias:
                    out[h + name + ".bias"] = (width,)
    return out


_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # non-persistent buffers some old checkpoints saved


def from_hf_state_dict(
    cfg: ModelConfig, sd: Mapping[str, torch.Tensor], *, source: str = "the Hugging Face directory"
) -> dict[str, torch.Tensor]:
    """Hugging Face keys -> canonlm ``CanonLM.state_dict()`` keys (float32 CPU tensors; ``cfg`` from
    :func:`from_hf_config`). Tied embeddings: ``lm_head.weight`` is the embedding (an ``lm_head.weight`` in the file
    is ignored, as transformers does). Raises InteropError naming missing / unexpected / mis-shaped tensors."""
    got = {k: tuple(v.shape) for k, v in sd.items() if not _IGNORED_HF.search(k)}
    if cfg.tie_embeddings:
        got.pop("lm_head.weight", None)
    compare_shapes(source, got, expected_hf_shapes(cfg))
    f = {k: v.detach().to("cpu", torch.float32) for k, v in sd.items() if k in got}
    out: dict[str, torch.Tensor] = {
        "tok_emb.weight": f["model.embed_tokens.weight"],
        "norm.weight": f["model.norm.weight"],
    }
    out["lm_head.weight"] = out["tok_emb.weight"] if cfg.tie_embeddings else f["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[b + "attn_norm.weight"] = f[h + "input_layernorm.weight"]
        out[b + "mlp_norm.weight"] = f[h + "post_attention_layernorm.weight"]
        out[b + "attn.wqkv.weight"] = torch.cat([f[h + f"self_attn.{p}_proj.weight"] for p in "qkv"], dim=0)
        out[b + "attn.wo.weight"] = f[h + "self_attn.o_proj.weight"]
        out[b + "mlp.w13.weight"] = torch.cat([f[h + "mlp.gate_proj.weight"], f[h + "mlp.up_proj.weight"]], dim=0)
        out[b + "mlp.w2.weight"] = f[h + "mlp.down_proj.weight"]
        if cfg.qk_norm == "whole":
            out[b + "attn.q_norm.weight"] = f[h + "self_attn.q_norm.weight"]
            out[b + "attn.k_norm.weight"] = f[h + "self_attn.k_norm.weight"]
        for letter, (ours, theirs) in {
            **_CANON_SITES,
            "B": ("attn.canon_b", "self_attn.canonB"),
            "D": ("mlp.canon_d", "mlp.canonD"),
        }.items():
            if cfg.canon.has(letter):
                out[b + ours + ".weight"] = f[h + theirs + ".weight"].squeeze(1)
                if cfg.canon.bias:
                    out[b + ours + ".bias"] = f[h + theirs + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Rebuild a :class:`ModelConfig` from ``dataclasses.asdict(cfg)`` (what ``checkpoint["canonlm"]["model"]``
    holds). Raises InteropError when it does not build (names the key)."""
    d = dict(d)
    canon, pos = d.pop("canon", None), d.pop("pos", None)
    try:
        return build_model_config(d, canon, pos)
    except (ConfigError, TypeError) as e:
        raise InteropError(f"the checkpoint's model config does not build: {e}") from None


def structural_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Fields where two configs compute different functions from the same tensors (backend choices, ``max_seq_len``
    and inits are ignored): ``["pos.pairing: 'half' vs 'interleaved'", ...]``."""
    keys = (
        "arch",
        "vocab_size",
        "n_layers",
        "d_model",
        "n_heads",
        "kv_heads",
        "ffn_dim",
        "mlp",
        "mlp_act",
        "norm_eps",
        "qk_norm",
        "tie_embeddings",
        "rope_dim",
    )
    out = [f"model.{k}: {getattr(a, k)!r} vs {getattr(b, k)!r}" for k in keys if getattr(a, k) != getattr(b, k)]
    for k in ("set", "kernel", "residual", "activation", "bias"):
        va, vb = getattr(a.canon, k), getattr(b.canon, k)
        if k == "set":
            va, vb = frozenset(va), frozenset(vb)
        if va != vb and (k == "set" or a.canon.set):
            out.append(f"canon.{k}: {getattr(a.canon, k)!r} vs {getattr(b.canon, k)!r}")
    if a.rope_dim:
        for k in ("pairing", "theta"):
            va, vb = getattr(a.pos, k), getattr(b.pos, k)
            if va != vb and not (k == "theta" and math.isclose(va, vb, rel_tol=1e-9)):
                out.append(f"pos.{k}: {va!r} vs {vb!r}")
    return out
