"""Weights & Biases for canonlm: offline by default (``logger=wandb``; sync later with ``wandb sync <dir>``).

* :func:`logger_config` -- the ``logger.wandb`` node completed for one run before Lightning's ``WandbLogger`` is
  instantiated (``canonlm.train.run``): a stable ``id`` (``<run_name>-<hash of the run dir>``, in a multirun
  ``<sweep time>-<job>-<hash>``: a resumed run, e.g. ``ckpt_path=auto`` or a requeued or re-run sweep job, continues
  its wandb run with ``resume: allow``; parallel multirun jobs get distinct ids), the
  ``group`` of a Hydra multirun (``<task_name>/<sweep time>``, the sweep dir; a single run has none), ``tags``
  ``arch:<arch>``, ``canon:<set>`` (``canon:none`` for an empty set), ``pos:<type>`` (``none`` for the linear
  models), ``task:<name>`` after the user's ``tags``, and ``job_type: train``. The resolved ``wandb.init`` arguments
  are written to ``<run dir>/wandb_init.json``; wandb itself stores an offline run under
  ``<run dir>/wandb/offline-run-<time>-<id>/`` (one such directory per attempt, all with the same id).
  Accuracy by k reaches the run's history as the ``val/acc_k<k>`` / ``test/acc_k<k>`` metrics the module logs.
* :func:`log_report` -- ``python -m canonlm.train.report <sweep> --out DIR --wandb``: one wandb run of
  ``job_type: report`` in the sweep's group (offline unless ``WANDB_MODE`` says otherwise) with every PNG of the
  report as a ``wandb.Image`` and every CSV table as a ``wandb.Table``, stored under ``DIR/wandb/``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from canonlm.utils.io import atomic_write_text

INIT_FILE = "wandb_init.json"


def stable_id(run_name: Any, output_dir: str) -> str:
    """``<run_name>-<8 hex digits of sha1(run dir)>``: the same for every attempt of a run directory."""
    return f"{run_name}-{hashlib.sha1(str(output_dir).encode()).hexdigest()[:8]}"


def sweep_group(sweep_dir: str | Path) -> str:
    """The group of a sweep directory: ``<task_name>/<sweep time>`` for canonlm's
    ``<log_dir>/<task_name>/multiruns/<time>``, else the directory's name."""
    p = Path(str(sweep_dir))
    if p.parent.name == "multiruns" and p.parent.parent.name:
        return f"{p.parent.parent.name}/{p.name}"
    return p.name or str(p)


def multirun_sweep_dir() -> str | None:
    """``hydra.sweep.dir`` inside a Hydra multirun job, else None (a single run, or not under Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return str(HydraConfig.get().sweep.dir)
    except Exception:  # noqa: BLE001 -- no Hydra context (tests, eval): no sweep
        pass
    return None


def run_tags(cfg: DictConfig) -> list[str]:
    """``arch:<arch>``, ``canon:<set or none>``, ``pos:<type>`` (``none`` for linear models, which have no
    positional encoding), ``task:<name>``."""
    from canonlm.arch.config import position_encoding  # torch comes with canonlm.arch: only when a run logs

    arch = str(OmegaConf.select(cfg, "model.arch", default="llama"))
    canon = OmegaConf.select(cfg, "canon.set", default="")
    pos = position_encoding(arch, OmegaConf.select(cfg, "pos.type", default="none"))
    task = OmegaConf.select(cfg, "task.name", default="unknown")
    return [f"arch:{arch}", f"canon:{canon or 'none'}", f"pos:{pos}", f"task:{task}"]


def require_wandb(key: str = "logger", value: str = "wandb", instead: str = "logger=csv or logger=none") -> None:
    """Raise ConfigError(key, value, ``instead`` + how to install wandb) when the optional ``wandb`` package cannot be
    imported (the ``wandb`` extra: ``pip install 'canonlm[wandb]'``, part of ``dev``); called before anything is
    written."""
    from canonlm.errors import ConfigError

    try:
        import wandb  # noqa: F401 -- imported to check that wandb is installed
    except ImportError as e:
        raise ConfigError(
            key,
            value,
            f"{instead} here: wandb is not installed ({e}); install the wandb extra: "
            "pip install 'canonlm[wandb]' (or bash scripts/setup.sh wandb)",
        ) from None


def logger_config(lg: DictConfig, cfg: DictConfig, output_dir: str, rank0: bool = True) -> DictConfig:
    """The ``logger.wandb`` node with ``id``, ``group``, ``tags`` and ``job_type`` filled in (values set in the
    config win; tags are the user's followed by :func:`run_tags`), ready for ``hydra.utils.instantiate``. With
    ``rank0`` also writes the resolved arguments to ``<output_dir>/wandb_init.json`` (:func:`write_init_file`).
    Raises ConfigError("logger", "wandb", ...) when wandb is not installed (:func:`require_wandb`)."""
    require_wandb()
    kw = OmegaConf.to_container(lg, resolve=True)
    sweep = multirun_sweep_dir()
    if kw.get("id") is None:  # a multirun job's run_name is the time of each attempt: name it by its sweep and job
        kw["id"] = stable_id(
            f"{Path(sweep).name}-{Path(output_dir).name}" if sweep else cfg.get("run_name"), output_dir
        )
    if kw.get("group") is None:
        kw["group"] = sweep_group(sweep) if sweep else None
    kw["job_type"] = kw.get("job_type") or "train"
    tags = [str(t) for t in (kw.get("tags") or [])]
    kw["tags"] = list(dict.fromkeys(tags + run_tags(cfg)))
    node = OmegaConf.create(kw)
    if rank0:
        write_init_file(node, output_dir)
    return node


def write_init_file(node: DictConfig, output_dir: str) -> None:
    """Write the ``wandb.init`` arguments of a :func:`logger_config` node (its keys without a leading ``_``, plus the
    ``mode`` it runs in: ``WANDB_MODE``, else offline / online) to ``<output_dir>/wandb_init.json``, atomically."""
    kw = OmegaConf.to_container(node, resolve=True)
    info = {k: v for k, v in kw.items() if not k.startswith("_")}
    info["mode"] = os.environ.get("WANDB_MODE") or ("offline" if kw.get("offline") else "online")
    atomic_write_text(Path(output_dir) / INIT_FILE, json.dumps(info, indent=1, default=str))


def _report_group(roots: list[Path], runs: list[dict[str, Any]]) -> tuple[str, str]:
    """(group, project) of a report: those its runs were logged with (``wandb_init.json``, the most common), else
    the first root's :func:`sweep_group` and ``canonlm``."""
    groups: Counter = Counter()
    projects: Counter = Counter()
    for r in runs:
        try:
            info = json.loads((Path(r["dir"]) / INIT_FILE).read_text())
        except (OSError, ValueError, KeyError):
            continue
        if info.get("group"):
            groups[info["group"]] += 1
        if info.get("project"):
            projects[info["project"]] += 1
    group = groups.most_common(1)[0][0] if groups else sweep_group(Path(roots[0]).resolve())
    return group, (projects.most_common(1)[0][0] if projects else "canonlm")


def log_report(out: Path, files: dict[str, bytes], roots: list[Path], runs: list[dict[str, Any]]) -> str:
    """Log a written report (``--out`` DIR holding ``files``) as one wandb run of ``job_type: report`` in the
    sweep's group: each ``*.png`` as ``wandb.Image`` under ``figures/<name>``, each ``*.csv`` as ``wandb.Table``
    under ``tables/<name>``, ``report.json`` in the run's config. Offline unless ``WANDB_MODE`` is set; stored under
    ``out/wandb/``. Returns the wandb run directory."""
    import wandb

    out = Path(out)
    group, project = _report_group(roots, runs)
    try:
        doc = json.loads(files.get("report.json", b"{}"))
    except ValueError:
        doc = {}
    run = wandb.init(
        project=project,
        group=group,
        job_type="report",
        name=f"report-{group.replace('/', '-')}",
        dir=str(out),
        mode=os.environ.get("WANDB_MODE") or "offline",
        tags=["report"],
        config={"roots": [str(r) for r in roots], "rows": doc.get("rows"), "cols": doc.get("cols")},
        reinit="finish_previous",
    )
    try:
        data: dict[str, Any] = {}
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext == ".png":
                data[f"figures/{stem}"] = wandb.Image(str(out / name), caption=name)
            elif ext == ".csv":
                rows = list(csv.reader(io.StringIO(files[name].decode())))
                if rows:
                    data[f"tables/{stem}"] = wandb.Table(columns=rows[0], data=rows[1:])
        run.log(data)
        return str(Path(run.dir).parent)
    finally:
        run.finish()
