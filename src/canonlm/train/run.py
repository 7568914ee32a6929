"""``run(cfg)``: validate the whole config, build task, model, data and trainer, train, test, report.

Order (nothing is built or trained before every check has passed):
1. task (generator parameters, context window vs the largest instance), model config (sizes, Canon letters, RoPE
   fraction), schedule, loss, kernels requested explicitly — each bad value raises
   :class:`canonlm.arch.config.ConfigError` naming the key, the value and what is allowed;
2. run directory: ``ckpt_path=auto`` resumes from ``<run dir>/checkpoints/last.ckpt``; a run dir that already
   holds checkpoints or results is never overwritten by a fresh run;
3. seed, model, Lightning Trainer, fit, test, ``results.json`` + accuracy table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from canonlm.arch.config import ConfigError, ModelConfig, build_model_config
from canonlm.data.tasks import build_task
from canonlm.train.resolvers import register_resolvers
from canonlm.utils.io import atomic_write_text

register_resolvers()  # also in Hydra launcher workers (submitit pickles `main`; train.py's import never runs there)

log = logging.getLogger("canonlm")

STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp2")
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true")


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def build_configs(cfg: DictConfig) -> tuple[Any, ModelConfig]:
    """Validate and build (task, model config) from the composed config; raises ConfigError."""
    task_cfg = _container(cfg.task)
    task = build_task(task_cfg.get("name"), task_cfg)
    for split in ("train", "val", "test"):
        need = task.max_instance_len(split)
        if int(task_cfg["context"]) < need:
            raise ConfigError("task.context", task_cfg["context"],
                              f"a window of at least {need} tokens (the longest {split} instance of {task.name})")
    model = dict(_container(cfg.model))
    model["ops"] = cfg.get("ops", "auto")
    model["kernels"] = {k: v for k, v in (_container(cfg.get("kernels")) or {}).items() if v is not None}
    for key, val in (task.model_overrides() if hasattr(task, "model_overrides") else {}).items():
        if key in model and model[key] != val:  # what the task requires (Capo: tied embeddings, paper App. C)
            log.info("task %s sets model.%s=%r (the config had %r)", task.name, key, val, model[key])
        model[key] = val
    mcfg = build_model_config(model, _container(cfg.canon), _container(cfg.pos),
                              vocab_size=task.vocab_size, max_seq_len=int(task_cfg["context"]))
    return task, mcfg


def resolve_max_steps(cfg: DictConfig, task: Any) -> None:
    """``trainer.max_steps: auto`` -> the task's own schedule (Capo: the steps that show every person
    ``task.exposures`` times at ``data.batch_size`` windows per step, tasks.md §4.3), written into ``cfg``.
    Raises ConfigError for ``auto`` with a task that has no schedule of its own."""
    from omegaconf import open_dict

    if cfg.trainer.get("max_steps") != "auto":
        return
    if not hasattr(task, "steps_for_exposures"):
        raise ConfigError("trainer.max_steps", "auto",
                          f"a positive integer (task {task.name} has no schedule of its own)")
    with open_dict(cfg):
        cfg.trainer.max_steps = int(task.steps_for_exposures(int(cfg.data.batch_size)))
    log.info("trainer.max_steps=auto -> %d steps (%s)", cfg.trainer.max_steps, task.name)


def validate_training(cfg: DictConfig) -> None:
    """Checks of the training keys that Lightning would only report late (or never)."""
    from canonlm.train.schedule import lr_multiplier

    lr_multiplier(_container(cfg.sched), 1)
    z = cfg.loss.get("z_loss", "none")
    if z not in ("none", "lingua", "palm"):
        raise ConfigError("loss.z_loss", z, "none | lingua | palm")
    zc = cfg.loss.get("z_coef")
    if isinstance(zc, bool) or not isinstance(zc, (int, float)) or zc < 0:
        raise ConfigError("loss.z_coef", zc, "a number >= 0")
    betas = cfg.optim.get("betas")
    if betas is not None and (len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError("optim.betas", list(betas) if hasattr(betas, "__len__") else betas,
                          "two numbers in [0, 1), e.g. [0.9, 0.98]")
    for key, lo in (("eps", 0.0), ("weight_decay", -1e-12)):
        v = cfg.optim.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > lo):
            raise ConfigError(f"optim.{key}", v, "a positive number" if key == "eps" else "a number >= 0")
    name = cfg.strategy.get("name")
    if name not in STRATEGIES:
        raise ConfigError("strategy.name", name, " | ".join(STRATEGIES))
    prec = str(cfg.trainer.get("precision"))
    if prec not in PRECISIONS:
        raise ConfigError("trainer.precision", prec, " | ".join(PRECISIONS))
    steps = cfg.trainer.get("max_steps")
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError("trainer.max_steps", steps, "a positive integer (training is step-based)")
    lr = cfg.optim.get("lr")
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError("optim.lr", lr, "a positive float")
    if cfg.get("ckpt_path") not in (None, "auto") and not Path(str(cfg.ckpt_path)).exists():
        raise ConfigError("ckpt_path", cfg.ckpt_path, "null | auto | an existing checkpoint path")
    for key in ("batch_size", "val_windows", "test_windows"):
        v = cfg.data.get(key)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"data.{key}", v, "a positive integer")
    if not isinstance(cfg.data.get("num_workers"), int) or cfg.data.num_workers < 0:
        raise ConfigError("data.num_workers", cfg.data.get("num_workers"), "an integer >= 0")
    ge = cfg.data.get("gen_eval") or {}
    unknown = sorted(set(ge) - {"samples", "batch_size", "on_val"})
    if unknown:
        raise ConfigError(f"data.gen_eval.{unknown[0]}", ge[unknown[0]], "a known key: samples, batch_size, on_val")
    v = ge.get("samples")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ConfigError("data.gen_eval.samples", v, "null (the task's default) or an integer >= 0")
    v = ge.get("batch_size", 64)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError("data.gen_eval.batch_size", v, "a positive integer")
    if not isinstance(ge.get("on_val", True), bool):
        raise ConfigError("data.gen_eval.on_val", ge.get("on_val"), "true | false")


def _device_of(cfg: DictConfig) -> torch.device:
    acc = cfg.trainer.get("accelerator", "auto")
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _strategy(cfg: DictConfig):
    s = cfg.strategy
    if s.name == "auto":
        return "auto"
    if s.name in ("ddp", "ddp_spawn"):
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(start_method="spawn" if s.name == "ddp_spawn" else "popen",
                           find_unused_parameters=bool(s.get("find_unused_parameters", False)))
    from lightning.pytorch.strategies import ModelParallelStrategy

    devices = cfg.trainer.devices
    if devices in ("auto", -1):
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    world = int(devices) * int(cfg.trainer.get("num_nodes", 1))
    # P1: always pass the data-parallel size explicitly (the "auto" defaults give every rank the same batch).
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def resolve_ckpt(cfg: DictConfig, output_dir: str) -> str | None:
    """Resolve ``ckpt_path``; refuse to start a fresh run in a directory that holds a previous run's results."""
    from canonlm.train.checkpoint import find_last

    ck = cfg.get("ckpt_path")
    if ck == "auto":
        return find_last(output_dir)
    if ck is None and cfg.get("train", True):
        ckdir, res = Path(output_dir) / "checkpoints", Path(output_dir) / "results.json"
        if (ckdir.is_dir() and any(ckdir.iterdir())) or res.exists():
            raise ConfigError("run_name", cfg.get("run_name"),
                              f"a fresh name: {output_dir} already holds a run (checkpoints or results.json); "
                              "pass ckpt_path=auto to resume it")
    return ck


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage() and "LitLogger" not in record.getMessage()


def _tidy_logging() -> None:
    """Send Lightning's messages once, through the root handlers Hydra configured (console + run log file), and drop
    Lightning's advertising tips and the known-harmless warnings of our iterable streams."""
    import warnings

    lg = logging.getLogger("lightning")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers which may be a bottleneck.*")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate as configured; returns the results dict also written to ``<run dir>/results.json``."""
    import lightning.pytorch as L
    from hydra.utils import instantiate
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from canonlm.train.checkpoint import AtomicCheckpointIO
    from canonlm.train.datamodule import SyntheticDataModule
    from canonlm.train.loggers import JSONLLogger
    from canonlm.train.module import LMModule
    from canonlm.utils.allocator import tune_malloc

    _tidy_logging()
    tune_malloc()  # keep freed activations in the process (canonlm.utils.allocator): ~20 % faster CPU steps
    # 1. validate everything before building anything
    task, mcfg = build_configs(cfg)
    resolve_max_steps(cfg, task)
    validate_training(cfg)
    device = _device_of(cfg)
    from canonlm.arch.model import resolve_backends

    resolve_backends(mcfg, device, torch.bfloat16 if "bf16" in str(cfg.trainer.precision) else torch.float32)
    output_dir = str(cfg.paths.output_dir)
    ckpt = resolve_ckpt(cfg, output_dir)

    # 2. build: the Trainer first (Lightning's own argument checks, world size), then data and model
    task_cfg = _container(cfg.task)
    dm = SyntheticDataModule(task, task_cfg, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers,
                             val_windows=cfg.data.val_windows, test_windows=cfg.data.test_windows)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = []
    for name, lg in (cfg.get("logger") or {}).items():
        if lg is None:
            continue
        if name == "wandb" and lg.get("id") is None:  # stable across resumes, distinct across multirun jobs
            lg = OmegaConf.merge(lg, {"id": f"{cfg.get('run_name')}-{hashlib.sha1(output_dir.encode()).hexdigest()[:8]}"})
        loggers.append(instantiate(lg))
    loggers.append(JSONLLogger(output_dir))
    trainer_kwargs = _container(cfg.trainer)
    trainer_kwargs.pop("_target_", None)
    accumulate = int(trainer_kwargs.get("accumulate_grad_batches") or 1)
    if isinstance(trainer_kwargs.get("val_check_interval"), int):  # config: optimizer steps; Lightning: batches
        trainer_kwargs["val_check_interval"] *= accumulate
    plugins: list[Any] = [] if cfg.strategy.name == "fsdp2" else [AtomicCheckpointIO()]
    if os.environ.get("SLURM_JOB_ID"):
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=False))  # the Preemption callback owns requeueing (P9)
    try:
        trainer = L.Trainer(**trainer_kwargs, strategy=_strategy(cfg), callbacks=callbacks, logger=loggers,
                            plugins=plugins)
    except (MisconfigurationException, ValueError, TypeError) as e:
        raise ConfigError("trainer", {k: v for k, v in trainer_kwargs.items() if k != "default_root_dir"},
                          f"arguments Lightning accepts on this machine ({e})") from None
    dm.micro_batch(trainer.world_size, trainer.accumulate_grad_batches)  # raises ConfigError before building

    L.seed_everything(int(cfg.seed), workers=False, verbose=False)
    fsdp = _container(cfg.strategy) if cfg.strategy.name == "fsdp2" else None
    module = LMModule(mcfg, optimizer=instantiate(cfg.optim), sched=_container(cfg.sched),
                      total_steps=cfg.trainer.max_steps, loss=_container(cfg.loss), num_groups=task.num_groups,
                      group_name=getattr(task, "group_name", "group"), compile=bool(cfg.get("compile", False)),
                      activation_checkpointing=bool(cfg.get("activation_checkpointing", False)), fsdp=fsdp,
                      task=task, gen_eval=_container(cfg.data.get("gen_eval")) or {})
    module.tokens_per_step = int(cfg.data.batch_size) * int(task_cfg["context"])

    n_params = module.model.num_params()
    pos_type = mcfg.pos.type if mcfg.arch == "llama" else "none"  # linear mixers have no positional encoding
    if trainer.is_global_zero:
        log.info("task %s | vocab %d | context %d | model %s %dL %dD %dH canon=%r pos=%s | %.2fM params",
                 task.name, task.vocab_size, task_cfg["context"], mcfg.arch, mcfg.n_layers, mcfg.d_model,
                 mcfg.n_heads, mcfg.canon.set, pos_type, n_params / 1e6)
        for lg in loggers:
            lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    # 3. train + test
    t0 = time.perf_counter()
    if cfg.get("train", True):
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    train_time = time.perf_counter() - t0
    if cfg.get("test", True):
        trainer.test(module, datamodule=dm, ckpt_path=None, verbose=False)

    results = {
        "task": task.name,
        "task_config": task_cfg,
        "model": {"arch": mcfg.arch, "size": f"{mcfg.n_layers}L{mcfg.d_model}D", "n_heads": mcfg.n_heads,
                  "canon": mcfg.canon.set, "pos": pos_type, "qk_norm": mcfg.qk_norm, "params": n_params,
                  "tie_embeddings": mcfg.tie_embeddings},
        "steps": trainer.global_step,
        "tokens_seen": trainer.global_step * module.tokens_per_step,
        "train_time_s": round(train_time, 1),
        "metric": ("generation accuracy (the task's validator on the model's generations)"
                   if getattr(task, "eval_mode", "teacher_forced") == "generate" else
                   "answer_exact (whole answer right under teacher forcing), token_acc per answer token"),
        **{split: module.results[split] for split in ("val", "test") if split in module.results},
    }
    if trainer.is_global_zero:
        path = atomic_write_text(Path(output_dir) / "results.json", json.dumps(results, indent=1, default=str))
        print(format_table(results, task), flush=True)
        print(f"results: {path}", flush=True)
    return results


def format_table(results: dict[str, Any], task: Any) -> str:
    """Human-readable accuracy-by-group table of the last evaluation (test, else val)."""
    split = "test" if "test" in results else "val"
    res = results.get(split)
    if not res:
        return "(no evaluation was run)"
    g = res.get("group_name", "group")
    chance = getattr(task, "chance", None)
    lines = []
    gen = res.get("generate")
    if gen is not None:
        lines += [f"{task.name}: generation accuracy by {g} ({split} split, {gen['samples']} samples, "
                  "accepted by the task's validator)", f"  {g:>6} {'samples':>8} {'acc':>8}"]
        for k, row in gen["by_group"].items():
            lines.append(f"  {k:>6} {row['samples']:>8} {100 * row['acc']:>7.1f}%")
        lines.append(f"  {'all':>6} {gen['samples']:>8} {100 * gen['acc']:>7.1f}%")
        for k, v in gen.items():
            if k not in ("by_group", "samples", "acc"):
                lines.append(f"  {k} {v:.6g}")
    elif res["by_group"]:
        lines += [f"{task.name}: accuracy by {g} ({split} split, whole-answer exact match under teacher forcing)"
                  + (f"; chance ~ {100 * chance:.1f}%" if chance else ""),
                  f"  {g:>4} {'answers':>8} {'exact':>8} {'token':>8}"]
        labels = getattr(task, "group_labels", None) or {}
        w = max([4, len(g)] + [len(str(labels.get(int(k), k))) for k in res["by_group"]])
        lines[-1] = f"  {g:>{w}} {'answers':>8} {'exact':>8} {'token':>8}"
        for k, row in res["by_group"].items():
            name = labels.get(int(k), k)
            lines.append(f"  {name:>{w}} {row['answers']:>8} {100 * row['acc']:>7.1f}% {100 * row['token_acc']:>7.1f}%")
        o = res["overall"]
        lines.append(f"  {'all':>{w}} {o['answers']:>8} {100 * o['acc']:>7.1f}% {100 * o['token_acc']:>7.1f}%")
    else:
        ppl = res.get("ppl", float("nan"))
        lines.append(f"{task.name}: {split} loss {res['loss']:.4f} nats/token, perplexity {ppl:.3f}")
    for k, v in (res.get("task_metrics") or {}).items():
        lines.append(f"  {k} {v:.6g}")
    lines.append(f"  steps {results['steps']}, tokens {results['tokens_seen'] / 1e6:.2f}M, "
                 f"training time {results['train_time_s']:.0f} s, loss {res['loss']:.4f}")
    return "\n".join(lines)


def main(cfg: DictConfig) -> float | None:
    """Hydra entry point body: run and return the task's headline number for sweepers (generation accuracy for
    Brevo/Lano, bits per parameter for Capo, else the overall teacher-forced accuracy)."""
    results = run(cfg)
    split = "test" if "test" in results else "val"
    res = results.get(split, {})
    if "generate" in res:
        return res["generate"]["acc"]
    if "bits_per_param" in (res.get("task_metrics") or {}):
        return res["task_metrics"]["bits_per_param"]
    return res.get("overall", {}).get("acc")
