"""A saved training run: where its checkpoint is, its composed config, its task and tokenizer.

A training run (``python train.py ...``) lives in ``logs/<task_name>/runs/<run_name>/`` and holds
``.hydra/config.yaml`` (the composed config, written once the config passed its checks), ``.hydra/hydra.yaml``
(Hydra's runtime: the original working directory) and ``checkpoints/last.ckpt`` (Lightning's checkpoint; canonlm adds
``checkpoint["canonlm"]`` = ``{"model": <ModelConfig as a dict>, "task": <task config>, ...}``). A checkpoint without
a run's ``.hydra/config.yaml`` beside it (``python -m canonlm.export --from-hf`` output, or a training checkpoint
copied out of its run directory) is a run too when it records its model in ``checkpoint["canonlm"]["model"]``.

A run trained with ``strategy=fsdp2`` (Lightning's ``ModelParallelStrategy``) saves ``last.ckpt`` as a *directory*:
a ``torch.distributed.checkpoint`` (DCP) folder (``.metadata`` + ``*.distcp`` shards holding ``state_dict`` and
``optimizer_<i>``) plus ``meta.pt`` (everything else: step, loops, ``canonlm``). :func:`read_checkpoint` reads
such a folder whole (model tensors gathered into full tensors, any world size), so export and evaluation take it
directly.

Nothing here unpickles: checkpoints are read with ``torch.load(weights_only=True)``. Rebuilding the model is
:func:`canonlm.config.build.build_configs` on :func:`load_run_config`; loading it is :mod:`canonlm.eval.load`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict

from canonlm.config.resolvers import register_resolvers

#: The checkpoint of a run directory (``<run>/checkpoints/last.ckpt``).
CHECKPOINT = Path("checkpoints") / "last.ckpt"


def has_run_config(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a training run's ``.hydra/config.yaml``."""
    return (Path(run_dir) / ".hydra" / "config.yaml").is_file()


def recorded_meta(ck: str | Path) -> dict[str, Any] | None:
    """``checkpoint["canonlm"]`` of ``ck`` when it records the model config (``["model"]`` a dict), else None.
    Reads with ``torch.load(weights_only=True)`` (memory-mapped when the file allows it, so tensors are not read).
    Raises ValueError when the file cannot be read that way."""
    state = read_checkpoint(Path(ck), mmap=True)
    meta = state.get("canonlm") if isinstance(state, dict) else None
    return dict(meta) if isinstance(meta, dict) and isinstance(meta.get("model"), dict) else None


def resolve_run(run: str | Path, ckpt: str | Path | None = None) -> tuple[Path, Path]:
    """(run directory, checkpoint file) for ``run`` = a run directory or a ``.ckpt`` file (inside
    ``<run>/checkpoints/``, or anywhere when it records its model: ``checkpoint["canonlm"]["model"]``). ``ckpt``
    overrides the checkpoint (default ``<run>/checkpoints/last.ckpt``). Without ``.hydra/config.yaml`` the run
    directory is the checkpoint's folder (the one above ``checkpoints/``).
    Raises FileNotFoundError naming what is missing (a directory that is neither a run nor holds a checkpoint that
    records its model), ValueError (a checkpoint without a run config that cannot be read)."""
    p = Path(run).expanduser()
    if p.is_file():
        ck = p
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else p.parent
    elif p.is_dir():
        run_dir = p
        ck = p / CHECKPOINT
    else:
        raise FileNotFoundError(f"--run {run}: no such run directory or checkpoint file")
    if ckpt is not None:
        ck = Path(ckpt).expanduser()
    no_cfg = f"{run_dir} has no .hydra/config.yaml (not a run directory written by train.py)"
    hydra = has_run_config(run_dir)
    if not hydra and not ck.exists():
        raise FileNotFoundError(no_cfg)
    if ck.is_dir() and not is_distributed_checkpoint(ck):
        raise FileNotFoundError(
            f"checkpoint {ck} is a directory without .metadata (neither a checkpoint file nor a "
            "distributed FSDP2 checkpoint)"
        )
    if not ck.exists():
        raise FileNotFoundError(f"checkpoint {ck} does not exist")
    if not hydra and recorded_meta(ck) is None:
        raise FileNotFoundError(
            f"{no_cfg}, and checkpoint {ck} records no model config (checkpoint['canonlm']['model'])"
        )
    return run_dir.resolve(), ck.resolve()


def task_config(run_dir: str | Path, ck: str | Path) -> dict[str, Any]:
    """The resolved ``task`` node of a run (``.hydra/config.yaml``), else the checkpoint's recorded
    ``checkpoint["canonlm"]["task"]`` (``{}`` if none), as :func:`canonlm.eval.load.load_model` sets ``LoadedModel.task_cfg``."""
    if has_run_config(run_dir):
        return OmegaConf.to_container(load_run_config(run_dir).task, resolve=True)
    meta = recorded_meta(ck) or {}
    return dict(meta.get("task") or {})


def load_run_config(run_dir: str | Path):
    """The run's composed config with Hydra-runtime paths made concrete (``paths.root_dir`` = the run's original
    working directory from ``.hydra/hydra.yaml``, ``paths.output_dir`` = ``run_dir``), so it resolves outside Hydra;
    a relative ``task.data_dir`` that does not exist from here is resolved against that working directory."""
    register_resolvers()
    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cwd = None
    hy = run_dir / ".hydra" / "hydra.yaml"
    if hy.is_file():
        cwd = OmegaConf.select(OmegaConf.load(hy), "hydra.runtime.cwd", default=None)
    with open_dict(cfg):
        if "paths" in cfg:
            cfg.paths.root_dir = str(cwd or Path.cwd())
            cfg.paths.output_dir = str(run_dir)
            if "log_dir" in cfg.paths and "hydra:" in str(OmegaConf.to_container(cfg.paths)["log_dir"]):
                cfg.paths.log_dir = str(Path(cfg.paths.root_dir) / "logs")
        task = cfg.get("task")
        for node, key in _data_dir_nodes(task) if task is not None else ():
            dd = node.get(key)
            if isinstance(dd, str) and dd and not Path(dd).is_absolute() and not Path(dd).exists() and cwd:
                if (Path(cwd) / dd).exists():
                    node[key] = str(Path(cwd) / dd)
    return cfg


def _data_dir_nodes(task: Any) -> list[tuple[Any, str]]:
    """(node, key) of every prepared-data directory a ``text`` task config names: ``data_dir`` and each source's
    ``data_dir`` of a mixture (``sources``: a mapping ``{name: {data_dir, ...}}`` or a list of such mappings,
    :class:`canonlm.data.text.TextTask`), in the task's order."""
    out: list[tuple[Any, str]] = []
    if task.get("data_dir"):
        out.append((task, "data_dir"))
    src = task.get("sources")
    if src is None or isinstance(src, str):
        items = []
    elif hasattr(src, "keys"):  # dict / DictConfig
        items = list(src.values())
    else:  # list / ListConfig
        items = list(src)
    for v in items:
        if hasattr(v, "get") and v.get("data_dir"):
            out.append((v, "data_dir"))
    return out


def text_data_dirs(task_cfg: Any) -> list[str]:
    """The prepared-data directories of a ``text`` task config (one, or each source of a mixture, in order)."""
    return [str(node.get(key)) for node, key in _data_dir_nodes(task_cfg)]


DCP_METADATA, FABRIC_META = ".metadata", "meta.pt"


def is_distributed_checkpoint(ck: str | Path) -> bool:
    """Whether ``ck`` is a distributed (FSDP2 / DCP) checkpoint folder: a directory with a ``.metadata`` file."""
    return Path(ck).is_dir() and (Path(ck) / DCP_METADATA).is_file()


def read_distributed_checkpoint(ck: str | Path, model_only: bool = True) -> dict[str, Any]:
    """A distributed checkpoint folder (module docstring) as one checkpoint dict on the CPU: ``meta.pt`` (read with
    ``torch.load(weights_only=True)``) plus ``"state_dict"`` = the full, unsharded model tensors, loaded with
    ``torch.distributed.checkpoint.load`` into tensors shaped from the folder's ``.metadata`` (no process group
    needed; any number of shards). ``model_only=False`` also loads every other tensor entry (``optimizer_<i>``, as
    flat ``"<entry>.<key path>"`` keys). Raises ValueError naming the folder when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ck = Path(ck)
    try:
        reader = FileSystemReader(str(ck))
        md = reader.read_metadata().state_dict_metadata
        template: dict[str, dict[str, torch.Tensor]] = {}
        for key, m in md.items():
            if not isinstance(m, TensorStorageMetadata):
                continue
            top, _, rest = key.partition(".")
            if model_only and top != "state_dict":
                continue
            template.setdefault(top, {})[rest] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        load(template, storage_reader=reader)
    except Exception as e:  # noqa: BLE001 -- DCP raises its own error types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(
            f"distributed checkpoint {ck} cannot be read with torch.distributed.checkpoint: {first}"
        ) from None
    meta = {}
    if (ck / FABRIC_META).is_file():
        meta = read_checkpoint(ck / FABRIC_META)
    out = dict(meta)
    out["state_dict"] = template.pop("state_dict", {})
    for top, entries in template.items():
        out.update({f"{top}.{k}": v for k, v in entries.items()})
    return out


def read_checkpoint(ck: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dict, read with ``torch.load(weights_only=True)`` (no pickled code runs; canonlm's own
    checkpoints hold only tensors and plain values); ``mmap``: memory-map the tensors when the file format allows it
    (for reading only the metadata). A distributed FSDP2 checkpoint folder is read with
    :func:`read_distributed_checkpoint` (model tensors only; with ``mmap``, only its ``meta.pt``). Raises ValueError
    naming the file when it cannot be read that way (damaged, or a foreign file that pickles objects)."""
    if is_distributed_checkpoint(ck):
        if mmap:
            meta = Path(ck) / FABRIC_META
            return read_checkpoint(meta, mmap=True) if meta.is_file() else {}
        return read_distributed_checkpoint(ck)
    try:
        if mmap:
            try:
                return torch.load(ck, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # not a zip-format file: read it whole below
                pass
        return torch.load(ck, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- reported with the reader's first line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise ValueError(
            f"checkpoint {ck} cannot be read with torch.load(weights_only=True): {first[:300]}; "
            "canonlm never unpickles code from a checkpoint"
        ) from None


def tokenizer_record(task_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer`` record a ``text`` run's prepared data keeps in ``<task.data_dir>/meta.json`` (a mixture: its
    first source's, which every source shares) (``path``,
    ``sha256``, ``eos_token``, as :mod:`canonlm.data.prepare` writes it); ``{}`` when it has none. Raises OSError
    (no ``data_dir``, no such file) and ValueError (not a JSON object)."""
    dirs = text_data_dirs(task_cfg)  # a mixture's sources share one tokenizer (TextTask checks it): the first
    if not dirs:
        raise FileNotFoundError("the run's task config has no data_dir or sources (its prepared data)")
    f = Path(dirs[0]) / "meta.json"
    meta = json.loads(f.read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer") or {}, dict):
        raise ValueError(f"{f} is not the JSON object prepare writes")
    return dict(meta.get("tokenizer") or {})


def run_tokenizer(task_cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """(tokenizer path, eos token) recorded by a ``text`` run's prepared data (:func:`tokenizer_record`); (None,
    None) for other tasks or when the meta is unreadable."""
    if task_cfg.get("name") != "text" or not text_data_dirs(task_cfg):
        return None, None
    try:
        t = tokenizer_record(task_cfg)
    except (OSError, ValueError):
        return None, None
    return t.get("path"), t.get("eos_token")


__all__ = [
    "CHECKPOINT",
    "has_run_config",
    "is_distributed_checkpoint",
    "read_distributed_checkpoint",
    "load_run_config",
    "read_checkpoint",
    "recorded_meta",
    "resolve_run",
    "run_tokenizer",
    "task_config",
    "tokenizer_record",
]
