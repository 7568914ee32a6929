"""From a composed config to what it describes: the task and the model config (:func:`build_configs`).

Training (:func:`canonlm.train.run.prepare_run`), evaluation (:func:`canonlm.eval.load.load_model`, on
:func:`canonlm.config.rundir.load_run_config`) and export (:func:`canonlm.hf.io.read_canonlm`) all rebuild a model
through this one function, so a run evaluates and exports with exactly the model it trained.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from canonlm.arch.config import ModelConfig, build_model_config
from canonlm.config.rules import plain
from canonlm.data.tasks import build_task
from canonlm.errors import ConfigError

log = logging.getLogger("canonlm")


def build_configs(cfg: DictConfig) -> tuple[Any, ModelConfig]:
    """(task, model config) from the composed config ``cfg`` (its ``task``, ``model``, ``canon``, ``pos``, ``ops``
    and ``kernels`` nodes).

    The task is :func:`canonlm.data.tasks.build_task` of ``task``; ``task.context`` must hold the longest instance of
    every split. The model is :func:`canonlm.arch.config.build_model_config` with the task's vocabulary and context
    as ``vocab_size`` / ``max_seq_len``, after the model keys the task requires (``task.model_overrides()``; Capo:
    tied embeddings, paper App. C), each logged when it changes the config.
    Raises ConfigError naming the first bad key (``task.*``, ``model.*``, ``canon.*``, ``pos.*``)."""
    task_cfg = plain(cfg.task)
    task = build_task(task_cfg.get("name"), task_cfg)
    for split in ("train", "val", "test"):
        need = task.max_instance_len(split)
        if int(task_cfg["context"]) < need:
            raise ConfigError(
                "task.context",
                task_cfg["context"],
                f"a window of at least {need} tokens (the longest {split} instance of {task.name})",
            )
    model = dict(plain(cfg.model))
    model["ops"] = cfg.get("ops", "auto")
    model["kernels"] = {k: v for k, v in (plain(cfg.get("kernels")) or {}).items() if v is not None}
    for key, val in (task.model_overrides() if hasattr(task, "model_overrides") else {}).items():
        if key in model and model[key] != val:
            log.info("task %s sets model.%s=%r (the config had %r)", task.name, key, val, model[key])
        model[key] = val
    mcfg = build_model_config(
        model, plain(cfg.canon), plain(cfg.pos), vocab_size=task.vocab_size, max_seq_len=int(task_cfg["context"])
    )
    return task, mcfg


__all__ = ["build_configs"]
