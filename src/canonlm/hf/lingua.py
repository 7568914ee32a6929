"""The lingua checkpoint layout of the official PhysicsLM4 release: ``<dir>/<variant>/params.json`` +
``<dir>/<variant>/consolidated.pth`` (variant ``default``).

This is the layout the 16 released Llama / LlamaCanon checkpoints ship in, and the one the official
``LlamaCanonForCausalLM.from_pretrained`` (release file ``huggingface/modeling_llama_canon.py``) reads -- also when
``AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)`` reaches it through ``auto_map``:

* ``params.json`` is the lingua training config. The official loader reads ``model.dim``, ``n_layers``, ``n_heads``,
  ``n_kv_heads`` (absent or null: ``n_heads``), ``vocab_size``, ``hidden_dim`` (null: ``256 * ceil(8 * dim / 3 /
  256)``), ``norm_eps``, ``rope_theta``, ``rope_dim`` (null, or ``>= dim / n_heads``: full RoPE), ``qk_norm``,
  ``canon_set`` and ``data.seq_len``; everything else takes ``LlamaCanonConfig``'s defaults (Canon kernel 4 with
  the residual, no activation, no bias; SiLU MLP; untied output) and RoPE uses lingua's interleaved pairing
  (``rope_version='lingua'``, canonlm ``pos.pairing=interleaved``).
* ``consolidated.pth`` is ``{"model": state_dict}`` with lingua names (``tok_embeddings``, ``layers.<i>.attention.wq``
  / ``wk`` / ``wv`` / ``wo`` / ``q_norm`` / ``k_norm`` / ``canonB``, ``layers.<i>.feed_forward.w1`` (gate) / ``w3``
  (up) / ``w2`` / ``canonD``, ``layers.<i>.canonA`` / ``canonC``, ``attention_norm``, ``ffn_norm``, ``norm``,
  ``output``), mapped to Hugging Face names as the release's ``load_from_lingua_state`` does; keys it skips (lingua's
  ``rope_embeddings.freqs_cis`` buffer) are skipped here too and reported.

Reading goes through the Hugging Face names, so :func:`canonlm.hf.mapping.from_hf_config` /
:func:`~canonlm.hf.mapping.from_hf_state_dict` check every shape. Writing (:func:`to_lingua`) produces files the
official loader reads back to the same function; it refuses what that loader cannot express (it ignores every Canon
option but ``canon_set``, and the MLP activation). Nothing here unpickles: ``torch.load(weights_only=True)``.
Errors are :class:`~canonlm.hf.mapping.InteropError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from canonlm.arch.config import ModelConfig
from canonlm.arch.positional import interleaved_to_half_permutation
from canonlm.hf.mapping import OFFICIAL_MODEL_TYPE, InteropError, hf_format, to_hf_state_dict

PARAMS = "params.json"
WEIGHTS = "consolidated.pth"
DEFAULT_VARIANT = "default"
# LlamaCanonConfig's defaults for the Canon options the official from_pretrained never passes
OFFICIAL_CANON_DEFAULTS = {"canon_kernel": 4, "canon_residual": True, "canon_activation": False, "canon_bias": False}
_REQUIRED = ("dim", "n_layers", "n_heads", "vocab_size")


def lingua_hidden_dim(dim: int) -> int:
    """The MLP width the official loader uses when ``params.json`` has ``hidden_dim: null``:
    ``256 * ceil(8 * dim / 3 / 256)`` (``LlamaCanonForCausalLM.from_pretrained``)."""
    return 256 * ((dim * 8 + 3 * 256 - 1) // (3 * 256))


def lingua_files(path: str | os.PathLike, variant: str = DEFAULT_VARIANT) -> tuple[Path, Path] | None:
    """``(params.json, consolidated.pth)`` of ``<path>/<variant>/`` when ``params.json`` is there, else None."""
    d = Path(path).expanduser() / variant
    return (d / PARAMS, d / WEIGHTS) if (d / PARAMS).is_file() else None


def is_lingua_dir(path: str | os.PathLike, variant: str = DEFAULT_VARIANT) -> bool:
    """True when ``path`` holds the lingua layout for ``variant`` (``<path>/<variant>/params.json``)."""
    return lingua_files(path, variant) is not None


# ============================================================================================ lingua -> HF names
def lingua_to_hf_config(params: Mapping[str, Any], *, source: str = PARAMS) -> dict[str, Any]:
    """The official ``LlamaCanonConfig`` fields (``model_type: "LlamaCanon"``, ``rope_version: "lingua"``) that
    ``LlamaCanonForCausalLM.from_pretrained`` builds from a lingua ``params.json`` dict, as a ``config.json`` dict
    for :func:`canonlm.hf.mapping.from_hf_config`.

    Raises InteropError naming the key when the official loader could not build a working model from ``params``
    either (a required key missing; ``norm_eps`` / ``rope_theta`` / ``data.seq_len`` missing or null, which it would
    pass on as null), or when ``params`` sets a Canon option that loader ignores (``canon_kernel``,
    ``canon_residual``, ``canon_activation``, ``canon_bias``) to a value other than its default: the released
    classes would then compute a different function from the same file."""
    m, data = params.get("model"), params.get("data")
    if not isinstance(m, Mapping):
        raise InteropError(f"{source}: no 'model' section (a lingua params.json has model.dim, model.n_layers, ...)")
    for key in _REQUIRED:
        v = m.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InteropError(f"{source}: model.{key}={v!r}; a positive integer is required")
    if "hidden_dim" not in m:
        raise InteropError(
            f"{source}: model.hidden_dim is missing (the official loader requires the key; null "
            f"means 256 * ceil(8 * dim / 3 / 256) = {lingua_hidden_dim(m['dim'])})"
        )
    for key in ("norm_eps", "rope_theta"):
        if not isinstance(m.get(key), (int, float)) or isinstance(m.get(key), bool):
            raise InteropError(
                f"{source}: model.{key}={m.get(key)!r}; a number is required (the official loader "
                "passes it on as it is)"
            )
    seq_len = data.get("seq_len") if isinstance(data, Mapping) else None
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise InteropError(
            f"{source}: data.seq_len={seq_len!r}; a positive integer is required (the official "
            "loader's max_position_embeddings)"
        )
    for key, default in OFFICIAL_CANON_DEFAULTS.items():
        if key in m and m[key] != default:
            raise InteropError(
                f"{source}: model.{key}={m[key]!r} differs from {default!r}, the value the official "
                "LlamaCanonForCausalLM.from_pretrained uses (it reads only canon_set of the Canon "
                "options); canonlm refuses a file the released classes would read differently"
            )
    hidden = m["hidden_dim"] if m["hidden_dim"] is not None else lingua_hidden_dim(m["dim"])
    head_dim = m["dim"] // m["n_heads"]
    rope_dim = m.get("rope_dim")
    if isinstance(rope_dim, int) and not isinstance(rope_dim, bool) and rope_dim >= head_dim:
        rope_dim = None  # the official loader rotates the whole head then
    return {
        "model_type": OFFICIAL_MODEL_TYPE,
        "vocab_size": m["vocab_size"],
        "hidden_size": m["dim"],
        "intermediate_size": hidden,
        "num_hidden_layers": m["n_layers"],
        "num_attention_heads": m["n_heads"],
        "num_key_value_heads": m.get("n_kv_heads") or m["n_heads"],
        "qk_norm": m.get("qk_norm", False),
        "rope_dim": rope_dim,
        "canon_set": m.get("canon_set", "") or "",
        "rope_theta": float(m["rope_theta"]),
        "rms_norm_eps": float(m["norm_eps"]),
        "max_position_embeddings": seq_len,
        "rope_version": "lingua",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **OFFICIAL_CANON_DEFAULTS,
    }


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_ATTN = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "canonB": "canonB",
}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "canonD": "canonD"}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "canonA": "canonA",
    "canonC": "canonC",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ATTN_BACK, _FFN_BACK, _TOP_BACK, _BLOCK_BACK = ({v: k for k, v in m.items()} for m in (_ATTN, _FFN, _TOP, _BLOCK))


def lingua_to_hf_state_dict(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``({Hugging Face name: tensor}, [skipped lingua keys])``: the renaming of the release's
    ``LlamaCanonForCausalLM.load_from_lingua_state``, for keys ending in ``.weight`` (a lingua ``.bias`` or any
    other suffix keeps it and is then reported as unexpected by the shape check). Keys that function skips (not a
    layer / embedding / norm / output tensor, e.g. ``rope_embeddings.freqs_cis``) are returned as skipped."""
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for k, v in sd.items():
        lm = _LAYER.match(k)
        new = None
        if lm:
            i, rest = lm.groups()
            head, _, tail = rest.partition(".")
            sub, _, suffix = tail.partition(".")
            if head == "attention" and sub in _ATTN:
                new = f"model.layers.{i}.self_attn.{_ATTN[sub]}.{suffix}"
            elif head == "feed_forward" and sub in _FFN:
                new = f"model.layers.{i}.mlp.{_FFN[sub]}.{suffix}"
            elif head in _BLOCK:
                new = f"model.layers.{i}.{_BLOCK[head]}.{tail}"
        else:
            head, _, tail = k.partition(".")
            if head in _TOP:
                new = f"{_TOP[head]}.{tail}"
        if new is None:
            skipped.append(k)
        else:
            out[new] = v
    return out, skipped


def read_lingua_dir(
    path: str | os.PathLike, variant: str = DEFAULT_VARIANT
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """``(config.json-style dict, {Hugging Face name: tensor}, info)`` of ``<path>/<variant>/`` in the lingua layout;
    ``info`` holds ``variant``, ``params`` (the file's ``model`` section) and ``skipped`` (lingua keys the official
    loader skips). ``consolidated.pth`` is read with ``torch.load(weights_only=True)`` and must be
    ``{"model": state_dict}``. Raises InteropError (no such variant -- naming the variants present --, unreadable or
    incomplete files, and everything :func:`lingua_to_hf_config` refuses)."""
    root = Path(path).expanduser()
    files = lingua_files(root, variant)
    if files is None:
        present = sorted(p.parent.name for p in root.glob(f"*/{PARAMS}")) if root.is_dir() else []
        raise InteropError(
            f"{root}: no {variant}/{PARAMS} (the lingua layout is <dir>/<variant>/{PARAMS} + "
            f"<variant>/{WEIGHTS}; variants here: {', '.join(present) or 'none'})"
        )
    params_path, weights_path = files
    try:
        params = json.loads(params_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InteropError(f"{params_path} cannot be read: {e}") from None
    if not isinstance(params, dict):
        raise InteropError(f"{params_path}: expected a JSON object")
    hcfg = lingua_to_hf_config(params, source=str(params_path))
    if not weights_path.is_file():
        raise InteropError(f"{root}: {variant}/{WEIGHTS} is missing (beside {variant}/{PARAMS})")
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch.load raises many types (pickle, zip, EOF); re-raised as one InteropError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise InteropError(f"{weights_path} cannot be read with torch.load(weights_only=True): {first}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), Mapping):
        raise InteropError(
            f"{weights_path}: expected {{'model': state_dict}} (the lingua consolidated layout), found "
            f"{type(state).__name__} with keys {sorted(state)[:5] if isinstance(state, dict) else []}"
        )
    tensors = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    hsd, skipped = lingua_to_hf_state_dict(tensors)
    return hcfg, hsd, {"variant": variant, "params": dict(params["model"]), "skipped": skipped}


# ============================================================================================ canonlm -> lingua
def _official_refusals(cfg: ModelConfig) -> list[str]:
    """What the official lingua loader cannot express for ``cfg`` (it ignores these config options)."""
    c, out = cfg.canon, []
    if c.set:
        for key, ours in (
            ("canon_kernel", c.kernel),
            ("canon_residual", c.residual),
            ("canon_activation", c.activation),
        ):
            if ours != OFFICIAL_CANON_DEFAULTS[key]:
                out.append(
                    f"canon.{key.removeprefix('canon_')}={ours!r} (it always uses {OFFICIAL_CANON_DEFAULTS[key]!r})"
                )
    if cfg.mlp_act != "silu":
        out.append(f"model.mlp_act={cfg.mlp_act!r} (it always uses silu)")
    return out


def to_interleaved(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` of a ``pos.pairing=half`` model rewritten for ``interleaved`` pairing (same function): the rotated
    channels of every q / k head are permuted (the inverse of
    :func:`canonlm.arch.positional.interleaved_to_half_permutation`) in ``attn.wqkv`` rows, the whole-vector QK-norm
    gains and the q / k rows of Canon-B -- every per-channel parameter those channels meet. A model already
    ``interleaved`` is returned as is."""
    if cfg.pos.pairing == "interleaved" or not cfg.rope_dim:
        return dict(sd)
    H, Hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    inv = torch.argsort(interleaved_to_half_permutation(dh, cfg.rope_dim))

    def rows(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, dh, *t.shape[1:])[:, inv].reshape(t.shape)

    def qk(t: torch.Tensor) -> torch.Tensor:  # rows [q (H*dh) ; k (Hkv*dh) ; rest]
        q, k, rest = t.split([H * dh, Hkv * dh, t.shape[0] - (H + Hkv) * dh], dim=0)
        return torch.cat([rows(q, H), rows(k, Hkv), rest], dim=0)

    out = dict(sd)
    for i in range(cfg.n_layers):
        b = f"blocks.{i}.attn."
        out[b + "wqkv.weight"] = qk(sd[b + "wqkv.weight"])
        if cfg.qk_norm == "whole":
            out[b + "q_norm.weight"] = rows(sd[b + "q_norm.weight"], H)
            out[b + "k_norm.weight"] = rows(sd[b + "k_norm.weight"], Hkv)
        for name in ("canon_b.weight", "canon_b.bias"):
            if b + name in sd:
                out[b + name] = qk(sd[b + name])
    return out


def to_lingua(
    cfg: ModelConfig, sd: Mapping[str, torch.Tensor], *, name: str = "canonlm"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(params.json dict, lingua state dict)`` for a canonlm Llama, in the layout the official
    ``LlamaCanonForCausalLM.from_pretrained`` reads (save the state as ``{"model": state}``).

    ``pos.pairing=half`` models are converted to interleaved pairing (:func:`to_interleaved`); tied embeddings are
    written as an equal ``output.weight`` (the official loader unties them; same function). Raises InteropError for
    everything :func:`canonlm.hf.mapping.hf_format` refuses and for options the official loader ignores: a Canon
    kernel other than 4, no Canon residual, a Canon activation, an MLP activation other than SiLU."""
    hf_format(cfg)
    bad = _official_refusals(cfg)
    if bad:
        raise InteropError(
            "the lingua layout cannot hold this model: the official LlamaCanonForCausalLM."
            f"from_pretrained ignores {'; '.join(bad)}; export the default format instead"
        )
    icfg = dataclasses.replace(cfg, pos=dataclasses.replace(cfg.pos, pairing="interleaved"))
    hsd = to_hf_state_dict(icfg, to_interleaved(cfg, sd), official=True)
    if "lm_head.weight" not in hsd:
        hsd["lm_head.weight"] = hsd["model.embed_tokens.weight"].clone()
    state: dict[str, torch.Tensor] = {}
    for k, v in hsd.items():
        lm = re.match(r"^model\.layers\.(\d+)\.(.+)$", k)
        if lm is None:
            head, _, tail = k.rpartition(".")
            state[f"{_TOP_BACK[head]}.{tail}"] = v
            continue
        i, rest = lm.groups()
        owner, _, tail = rest.partition(".")
        sub, _, suffix = tail.partition(".")
        if owner == "self_attn":
            state[f"layers.{i}.attention.{_ATTN_BACK[sub]}.{suffix}"] = v
        elif owner == "mlp":
            state[f"layers.{i}.feed_forward.{_FFN_BACK[sub]}.{suffix}"] = v
        else:
            state[f"layers.{i}.{_BLOCK_BACK[owner]}.{tail}"] = v
    model = {
        "dim": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size,
        "hidden_dim": cfg.ffn_dim,
        "norm_eps": cfg.norm_eps,
        "rope_theta": float(cfg.pos.theta),
        "rope_dim": None if cfg.rope_dim == cfg.head_dim else cfg.rope_dim,
        "qk_norm": cfg.qk_norm == "whole",
        "canon_set": cfg.canon.set,
    }
    if not math.isfinite(model["rope_theta"]):
        raise InteropError(f"pos.theta={cfg.pos.theta!r} is not finite")
    return {"name": name, "model": model, "data": {"seq_len": int(cfg.max_seq_len)}}, state
