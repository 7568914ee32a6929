"""Reading and writing: canonlm run directories / checkpoints <-> Hugging Face directories (``config.json`` +
safetensors). The conversions themselves are in :mod:`canonlm.hf.mapping`.

Nothing here unpickles: Hugging Face weights are read with ``safetensors`` only (a ``pytorch_model.bin`` is refused),
canonlm checkpoints with ``torch.load(weights_only=True)``. Every output is written atomically (a hidden temporary
sibling, then one rename) and never over something that exists: an existing non-empty output directory or an
existing output file is refused before anything is read. Errors are :class:`~canonlm.hf.mapping.InteropError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from canonlm.arch.config import ModelConfig
from canonlm.config.build import build_configs
from canonlm.config.rundir import (
    CHECKPOINT,
    has_run_config,
    is_distributed_checkpoint,
    load_run_config,
    read_distributed_checkpoint,
    task_config,
)
from canonlm.hf import lingua
from canonlm.hf.card import generation_config, model_card
from canonlm.hf.remote.bundle import BundleError, bundle_sources
from canonlm.hf.tokenizer import TOKENIZER_CLASS, export_tokenizer, save_tokenizer
from canonlm.hf.mapping import (
    InteropError,
    from_hf_config,
    from_hf_state_dict,
    hf_format,
    model_config_from_dict,
    structural_differences,
    to_hf_config,
    to_hf_state_dict,
)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
IMPORTED_TASK = "hf_import"  # checkpoint["canonlm"]["task"]["name"] of an imported model


# ============================================================================================ reading
def read_hf_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config dict, {name: tensor})`` of a Hugging Face model directory: ``config.json`` and ``model.safetensors``
    or a sharded ``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor). Tensors keep
    their stored dtype, on the CPU. Raises InteropError (no directory, no / bad config.json, only pickled
    ``*.bin`` weights, a missing shard or a tensor the index names that its shard lacks)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise InteropError(f"{d}: not a directory (expected a Hugging Face model directory with config.json)")
    try:
        cfg = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise InteropError(f"{d} has no config.json (not a Hugging Face model directory)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InteropError(f"{d / 'config.json'} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise InteropError(f"{d / 'config.json'}: expected a JSON object")
    from safetensors import safe_open

    if (d / SAFETENSORS_INDEX).is_file():
        try:
            wmap = json.loads((d / SAFETENSORS_INDEX).read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise InteropError(f"{d / SAFETENSORS_INDEX} cannot be read ({type(e).__name__}: {e})") from None
        files: dict[str, list[str]] = {}
        for name, shard in wmap.items():
            files.setdefault(shard, []).append(name)
    elif (d / SAFETENSORS).is_file():
        files = {SAFETENSORS: None}  # type: ignore[dict-item]
    else:
        pickled = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pth"))
        raise InteropError(
            f"{d} has no {SAFETENSORS} or {SAFETENSORS_INDEX}"
            + (
                f" (only pickled weights: {', '.join(pickled[:3])}; canonlm reads safetensors only -- "
                "convert with transformers' save_pretrained(safe_serialization=True))"
                if pickled
                else ""
            )
        )
    sd: dict[str, torch.Tensor] = {}
    for shard, names in files.items():
        f = d / shard
        if not f.is_file():
            raise InteropError(f"{d}: shard {shard} named by {SAFETENSORS_INDEX} is missing")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                keys = set(fh.keys())
                for name in sorted(keys) if names is None else names:
                    if name not in keys:
                        raise InteropError(f"{f}: tensor {name} named by {SAFETENSORS_INDEX} is not in the shard")
                    sd[name] = fh.get_tensor(name)
        except InteropError:
            raise
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            raise InteropError(f"{f} cannot be read as safetensors: {type(e).__name__}: {e}") from None
    return cfg, sd


def _load_ckpt(path: Path) -> dict[str, Any]:
    if is_distributed_checkpoint(path):
        try:
            state = read_distributed_checkpoint(path)
        except ValueError as e:
            raise InteropError(str(e)) from None
        return state
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch.load raises many types (pickle, zip, EOF); re-raised as one InteropError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise InteropError(f"checkpoint {path} cannot be read with torch.load(weights_only=True): {first}") from None
    if not isinstance(state, dict):
        raise InteropError(f"checkpoint {path}: expected a dict, found {type(state).__name__}")
    return state


def read_canonlm(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """``(ModelConfig, CanonLM state dict, checkpoint["canonlm"] meta)`` of a canonlm run directory (its
    ``checkpoints/last.ckpt``) or a checkpoint file. The config comes from ``checkpoint["canonlm"]["model"]``; a
    checkpoint without it falls back to the run's ``.hydra/config.yaml`` (:func:`canonlm.config.build.build_configs`
    on :func:`canonlm.config.rundir.load_run_config`, as ``canonlm.eval.load`` does). Raises
    InteropError (nothing there, unreadable file, no config found). A distributed FSDP2 checkpoint folder
    (``last.ckpt`` of a ``strategy=fsdp2`` run) is read whole (:func:`canonlm.config.rundir.read_distributed_checkpoint`)."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / CHECKPOINT).exists():
        ck, run_dir = p / CHECKPOINT, p
    elif p.is_file() or is_distributed_checkpoint(p):
        ck = p
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else p.parent
    elif p.is_dir():
        raise InteropError(f"{p} has no {CHECKPOINT} (not a canonlm run directory)")
    else:
        raise InteropError(f"{p}: no such run directory or checkpoint file")
    if ck.is_dir() and not is_distributed_checkpoint(ck):
        raise InteropError(
            f"{ck} is a directory without .metadata (neither a checkpoint file nor a distributed FSDP2 checkpoint)"
        )
    state = _load_ckpt(ck)
    meta = state.get("canonlm") or {}
    sd = state.get("state_dict", state)
    sd = {
        k[len("model.") :]: v
        for k, v in sd.items()
        if isinstance(k, str) and k.startswith("model.") and isinstance(v, torch.Tensor)
    }
    if not sd:
        raise InteropError(f"checkpoint {ck} holds no model tensors (state_dict keys 'model.<name>')")
    if isinstance(meta.get("model"), Mapping):
        cfg = model_config_from_dict(meta["model"])
    elif has_run_config(run_dir):
        try:
            _, cfg = build_configs(load_run_config(run_dir))
        except Exception as e:  # noqa: BLE001 -- ConfigError and friends, reported as one line
            raise InteropError(f"{run_dir}: the run's config does not build: {e}") from None
        meta = {"task": task_config(run_dir, ck)}
    else:
        raise InteropError(
            f"checkpoint {ck} records no model config (checkpoint['canonlm']['model']) and has no run "
            "directory with .hydra/config.yaml beside it"
        )
    return cfg, sd, dict(meta)


# ============================================================================================ writing
def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(
            f"{out} exists and is not an empty directory; refusing to write into it (nothing is "
            "overwritten) -- choose a new path"
        )
    if not out.parent.is_dir():
        raise InteropError(f"{out.parent} does not exist (the parent of the output directory must exist)")


def _commit_dir(tmp: Path, out: Path) -> None:
    """Rename the filled temporary directory onto ``out`` (absent or empty): one atomic step."""
    try:
        os.replace(tmp, out)
    except OSError as e:
        raise InteropError(f"cannot move the output into {out}: {e} (was something written there meanwhile?)") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete the hidden temporaries ``.<out name>.tmp-<pid>`` (folders or files) that an export or import killed
    by SIGKILL / a crash left beside ``out``: those whose process no longer exists (a live one is another export
    at work and is left alone). Returns what was removed."""
    gone = []
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def _tmp_dir(out: Path) -> Path:
    remove_stale_temporaries(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


EXPORT_FORMATS = ("auto", "canonlm", "official", "llamacanon")
REMOTE_AUTO_MAP = {
    "AutoConfig": "configuration_canonlm.CanonLMConfig",
    "AutoModelForCausalLM": "modeling_canonlm.CanonLMForCausalLM",
}


def remote_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the ``canonlm`` export format: ``model_type: "canonlm"``, ``auto_map`` naming the modeling
    code bundled beside it (:mod:`canonlm.hf.remote`), and the model config under ``canonlm`` -- with the backend
    choices reset (``ops: auto``, no ``kernels`` pins: a kernel the training machine pinned, e.g. flash, is chosen
    again where the export is loaded); ``tie_word_embeddings`` says whether canonlm ties the LM head to the
    embedding (transformers then saves and resizes them as one)."""
    portable = dataclasses.replace(cfg, ops="auto", kernels={})
    return {
        "architectures": ["CanonLMForCausalLM"],
        "model_type": "canonlm",
        "auto_map": dict(REMOTE_AUTO_MAP),
        "canonlm": dataclasses.asdict(portable),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _choose_format(cfg: ModelConfig, fmt: str) -> str:
    if fmt not in EXPORT_FORMATS:
        raise InteropError(f"--format={fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if fmt != "auto":
        return fmt
    try:
        return "native" if hf_format(cfg) == "native" else "canonlm"
    except InteropError:
        return "canonlm"


def export_model(src: str | os.PathLike, out: str | os.PathLike, *, fmt: str = "auto") -> dict[str, Any]:
    """Write a canonlm model (run directory or checkpoint file) as a Hugging Face directory ``out`` that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Formats (``fmt``):

    * ``"auto"`` (default): ``"native"`` for a Llama without Canon, QK-norm or partial RoPE -- transformers'
      own ``LlamaForCausalLM`` (``config.json`` from :func:`canonlm.hf.mapping.to_hf_config` + ``model.safetensors``;
      loads with nothing else) --, else ``"canonlm"``.
    * ``"canonlm"``: any canonlm model (Llama with Canon / partial RoPE / QK-norm, GLA, GDN, Mamba2): ``config.json``
      (:func:`remote_config`), ``model.safetensors`` (keys ``model.<CanonLM key>``, float32) and the modeling code
      of :mod:`canonlm.hf.remote` with every canonlm module it needs, bundled into flat files
      (:func:`canonlm.hf.remote.bundle.bundle_sources`): ``from_pretrained(out, trust_remote_code=True)`` needs torch
      and transformers only, not canonlm.
    * ``"official"``: the lingua layout the released checkpoints ship in and the official
      ``LlamaCanonForCausalLM.from_pretrained`` reads -- ``default/params.json`` + ``default/consolidated.pth``
      (:func:`canonlm.hf.lingua.to_lingua`; RoPE converted to lingua's interleaved pairing) -- plus a
      ``config.json`` whose ``auto_map`` names the official classes, so ``AutoModelForCausalLM.from_pretrained(out,
      trust_remote_code=True)`` loads it once the release's ``configuration_llama_canon.py``,
      ``modeling_llama_canon.py`` and ``canon_helper.py`` are placed beside it (the exporter never ships them).
    * ``"llamacanon"``: the official ``LlamaCanonConfig`` fields (``model_type: "LlamaCanon"``) in ``config.json``
      with the weights in safetensors under the official names; the official classes build it with
      ``AutoModelForCausalLM.from_config`` + ``load_state_dict`` (their ``from_pretrained`` reads the lingua layout).

    Every format also gets a tokenizer transformers loads (:func:`canonlm.hf.tokenizer.export_tokenizer`: the
    prepared one of a ``text`` run, checked against its recorded SHA-256; a word-level one over a synthetic task's
    vocabulary), the BOS / EOS / PAD ids in ``config.json``, ``generation_config.json`` (greedy, the ids, no
    ``max_length``) and a model card
    (``README.md``, :func:`canonlm.hf.card.model_card`). Stale temporaries of an export that was killed are removed
    first (:func:`remove_stale_temporaries`). Returns a summary dict (format, class, paths, tensors, token ids).
    Raises InteropError (a model the chosen format cannot express, unknown ``fmt``, bad source, a text run's
    tokenizer missing or changed, modeling code that cannot be bundled, ``out`` exists and is not empty); nothing is
    written then."""
    out = Path(out).expanduser().absolute()
    _check_out_dir(out)
    cfg, sd, meta = read_canonlm(src)
    shown = _choose_format(cfg, fmt)
    tok, ids, tok_note = export_tokenizer(meta.get("task"), cfg.vocab_size, max_seq_len=cfg.max_seq_len)
    tensors: dict[str, torch.Tensor] = {}
    try:
        if shown == "official":
            params, state = lingua.to_lingua(cfg, sd, name=out.name)
            icfg = dataclasses.replace(cfg, pos=dataclasses.replace(cfg.pos, pairing="interleaved"))
            hcfg = to_hf_config(icfg, official=True)
        elif shown == "canonlm":
            hcfg = remote_config(cfg)
            tensors = {f"model.{k}": v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in sd.items()}
        else:
            hcfg = to_hf_config(cfg, official=shown == "llamacanon")
            tensors = to_hf_state_dict(cfg, sd, official=shown == "llamacanon")
    except InteropError as e:
        raise InteropError(
            f"--format {shown}: {e} (--format canonlm, the default for such a model, exports every canonlm model)"
        ) from None
    hcfg.update(ids)
    code: dict[str, str] = {}
    if shown == "canonlm":
        try:
            code = bundle_sources()
        except BundleError as e:
            raise InteropError(f"the modeling code cannot be bundled: {e}") from None
    seen: set[int] = set()
    n_params = sum(v.numel() for v in sd.values() if not (v.data_ptr() in seen or seen.add(v.data_ptr())))
    card = model_card(cfg, shown, meta, _run_dir_of(src), tok_note, n_params, ids)
    from safetensors.torch import save_file

    tmp = _tmp_dir(out)
    try:
        (tmp / "config.json").write_text(json.dumps(hcfg, indent=2, sort_keys=True) + "\n")
        if shown == "official":
            (tmp / lingua.DEFAULT_VARIANT).mkdir()
            (tmp / lingua.DEFAULT_VARIANT / lingua.PARAMS).write_text(json.dumps(params, indent=2) + "\n")
            torch.save({"model": state}, tmp / lingua.DEFAULT_VARIANT / lingua.WEIGHTS)
            n_tensors = len(state)
        else:
            save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})
            n_tensors = len(tensors)
        for name, text in code.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if tok is not None:
            save_tokenizer(tok, tmp)
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(card)
        _commit_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "format": shown,
        "class": hcfg["architectures"][0],
        "model_type": hcfg["model_type"],
        "tensors": n_tensors,
        "tokenizer": TOKENIZER_CLASS if tok is not None else None,
        **{k: v for k, v in ids.items() if v is not None},
    }


def _run_dir_of(src: str | os.PathLike) -> Path | None:
    """The run directory of an export source (a run directory, or a checkpoint in ``<run>/checkpoints/``)."""
    p = Path(src).expanduser()
    if p.is_dir():
        return p
    if p.parent.name == "checkpoints":
        return p.parent.parent
    return None


def hf_to_canonlm(
    src: str | os.PathLike, variant: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """``(ModelConfig, CanonLM state dict (float32), hf config dict)`` of a Hugging Face directory (official
    LlamaCanon or native Llama, safetensors) or of the official lingua layout (``<src>/<variant>/params.json`` +
    ``consolidated.pth``, :mod:`canonlm.hf.lingua`). The lingua layout is read when ``variant`` is given or when
    ``<src>/default/params.json`` exists; its config dict then also holds ``"_lingua"`` (variant, params, skipped
    keys). Raises InteropError (see :func:`read_hf_dir`, :func:`canonlm.hf.lingua.read_lingua_dir`,
    :func:`~canonlm.hf.mapping.from_hf_config`, :func:`~canonlm.hf.mapping.from_hf_state_dict`)."""
    if variant is not None or lingua.is_lingua_dir(src):
        v = variant or lingua.DEFAULT_VARIANT
        hcfg, hsd, info = lingua.read_lingua_dir(src, v)
        cfg = from_hf_config(hcfg)
        sd = from_hf_state_dict(cfg, hsd, source=f"{Path(src) / v / lingua.WEIGHTS}")
        return cfg, sd, {**hcfg, "_lingua": info}
    hcfg, hsd = read_hf_dir(src)
    if hcfg.get("model_type") == "canonlm":  # canonlm's own export format: the model config is recorded whole
        if not isinstance(hcfg.get("canonlm"), Mapping):
            raise InteropError(f"{src}/config.json: model_type 'canonlm' without its 'canonlm' model config")
        cfg = model_config_from_dict(hcfg["canonlm"])
        sd = {k[len("model.") :]: v.to(torch.float32) for k, v in hsd.items() if k.startswith("model.")}
        if cfg.tie_embeddings and "lm_head.weight" not in sd and "tok_emb.weight" in sd:
            sd["lm_head.weight"] = sd["tok_emb.weight"]  # transformers' save_pretrained drops the tied copy
        _compare_keys(f"{src}", cfg, sd, other=sorted(k for k in hsd if not k.startswith("model.")))
        return cfg, sd, hcfg
    cfg = from_hf_config(hcfg)
    return cfg, from_hf_state_dict(cfg, hsd, source=f"{src}"), hcfg


def _compare_keys(what: str, cfg: ModelConfig, sd: Mapping[str, torch.Tensor], other: list[str]) -> None:
    """Raise InteropError unless ``sd`` has exactly the keys and shapes of ``CanonLM(cfg)``."""
    from canonlm.hf.mapping import compare_shapes, expected_canonlm_shapes

    got = {k: tuple(v.shape) for k, v in sd.items()}
    got.update({k: () for k in other})
    compare_shapes(what, got, expected_canonlm_shapes(cfg))


def checkpoint_dict(cfg: ModelConfig, sd: Mapping[str, torch.Tensor], source: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint dict in the layout training writes (``state_dict`` keys ``model.<CanonLM key>``, the
    ``canonlm`` block of :meth:`canonlm.train.module.LMModule.on_save_checkpoint`), without optimizer state: it
    serves ``init_from`` and evaluation, not resuming. ``canonlm.task`` is ``{"name": "hf_import", "context":
    max_seq_len, ...source}``; tied embeddings stay one shared tensor."""
    state = {f"model.{k}": v for k, v in sd.items()}
    if cfg.tie_embeddings:
        state["model.lm_head.weight"] = state["model.tok_emb.weight"]
    return {
        "state_dict": state,
        "global_step": 0,
        "epoch": 0,
        "canonlm": {
            "format": 1,
            "model": dataclasses.asdict(cfg),
            "task": {"name": IMPORTED_TASK, "context": int(cfg.max_seq_len), **dict(source)},
            "train_time_s": 0.0,
            "attempts": 0,
            "nonfinite_steps": 0,
        },
    }


def import_hf(src: str | os.PathLike, out: str | os.PathLike, *, variant: str | None = None) -> dict[str, Any]:
    """Convert a Hugging Face directory (official LlamaCanon or native Llama; sharded or not) or a released
    checkpoint in the official lingua layout (``<src>/<variant>/params.json`` + ``consolidated.pth``; see
    :func:`hf_to_canonlm`) into a canonlm checkpoint. ``out`` ending in ``.ckpt`` is that file; anything else is a
    run directory that gets ``checkpoints/last.ckpt``. Returns a summary dict. Raises InteropError (unmappable
    config, missing / unexpected / mis-shaped tensors, ``out`` exists); nothing is written then."""
    out = Path(out).expanduser().absolute()
    as_file = out.suffix == ".ckpt"
    if as_file:
        if out.exists():
            raise InteropError(f"{out} exists; refusing to overwrite it -- choose a new path")
        if not out.parent.is_dir():
            raise InteropError(f"{out.parent} does not exist (the parent of the output file must exist)")
    else:
        _check_out_dir(out)
    cfg, sd, hcfg = hf_to_canonlm(src, variant)
    source = {"source": str(Path(src).expanduser().absolute()), "model_type": hcfg.get("model_type")}
    li = hcfg.get("_lingua")
    if li:
        source.update(layout="lingua", variant=li["variant"])
    ck = checkpoint_dict(cfg, sd, source)
    if as_file:
        remove_stale_temporaries(out)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        try:
            torch.save(ck, tmp)
            try:
                os.link(tmp, out)  # fails if out appeared meanwhile: never overwrites
            except FileExistsError:
                raise InteropError(f"{out} appeared while converting; refusing to overwrite it") from None
        finally:
            if tmp.exists():
                tmp.unlink()
        path = out
    else:
        tmp = _tmp_dir(out)
        try:
            (tmp / "checkpoints").mkdir()
            torch.save(ck, tmp / CHECKPOINT)
            _commit_dir(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        path = out / CHECKPOINT
    c = cfg
    return {
        "out": str(path),
        "model_type": hcfg.get("model_type"),
        "tensors": len(sd),
        **({"layout": "lingua", "variant": li["variant"], "skipped": li["skipped"]} if li else {}),
        "model": f"{c.n_layers}L{c.d_model}D heads {c.n_heads}/{c.kv_heads} canon={c.canon.set or 'none'} "
        f"pos={c.pos.type}({c.pos.pairing}, rope_dim {c.rope_dim}) qk_norm={c.qk_norm}",
    }


# ============================================================================================ training / eval
def read_weights(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(ModelConfig, CanonLM state dict)`` of a canonlm checkpoint / run directory, or of a Hugging Face directory
    (a directory with ``config.json``), converted in memory. Raises InteropError."""
    p = Path(path).expanduser()
    if p.is_dir() and not (p / CHECKPOINT).exists() and ((p / "config.json").is_file() or lingua.is_lingua_dir(p)):
        cfg, sd, _ = hf_to_canonlm(p)
        return cfg, sd
    cfg, sd, _ = read_canonlm(p)
    return cfg, sd


def load_init_weights(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Copy the weights of ``path`` into ``model`` (a :class:`~canonlm.arch.model.CanonLM`) in place: training's
    ``init_from=<path>`` (weights only; optimizer, step and schedule start fresh).

    ``path``: a canonlm checkpoint file (e.g. one written by ``python -m canonlm.export --from-hf``), a run directory
    (its ``checkpoints/last.ckpt``), or a Hugging Face directory (official LlamaCanon / native Llama, converted in
    memory). Call it on the materialised, unsharded model (after ``to_empty`` + ``init_weights`` on a meta build,
    before ``fully_shard``). Tensors are cast to each parameter's dtype / device.
    Raises InteropError when the source cannot be read, or when its model differs from ``model.cfg`` in anything
    that changes the function (shapes, Canon set / kernel / residual / activation / bias, RoPE width / pairing /
    theta, norms, activation, tying); ``max_seq_len``, backends and inits may differ."""
    cfg, sd = read_weights(path)
    mine = getattr(model, "cfg", None)
    if mine is not None:
        diff = structural_differences(cfg, mine)
        if diff:
            raise InteropError(
                f"init_from={path}: its model differs from the configured one (value there vs "
                f"here): {'; '.join(diff[:6])}"
            )
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    bad = [k for k in sorted(set(own) & set(sd)) if tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or bad:
        raise InteropError(
            f"init_from={path} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, shape mismatches "
            f"{[(k, tuple(sd[k].shape), tuple(own[k].shape)) for k in bad[:3]]}"
        )
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(sd[k].to(dtype=t.dtype, device=t.device))


def load_canonlm_checkpoint(path: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """``(CanonLM in eval mode, placed on device in fp32, checkpoint["canonlm"] meta)`` of a checkpoint file or run
    directory, built from the config the checkpoint records (no ``.hydra`` needed; what an evaluator needs for an
    imported model, which is float32 and pins no kernel). Raises InteropError; ConfigError (``CanonLM.place``) for
    a recorded kernel pin that cannot run there in fp32 -- e.g. ``model.kernels.attention=flash`` (fp16/bf16 only)
    on CUDA: load such a trained run with :func:`canonlm.eval.load.load_model`, which runs it in its training
    precision."""
    from canonlm.arch.model import CanonLM

    cfg, sd, meta = read_canonlm(path)
    model = CanonLM(cfg)
    model.load_state_dict(sd, strict=True)
    model.eval().to(device)
    model.place(torch.device(device), torch.float32)
    return model, meta
