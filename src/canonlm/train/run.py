"""``run(cfg)``: validate the whole config, build task, model, data and trainer, train, test, report.

Before Hydra runs anything, ``train.py`` composes every job of its command line as Hydra will (each job of a ``-m``
sweep) and checks it (:func:`check_command_line`'s steps): Hydra's own errors, the directory Hydra will create, the
keys and the declared rules (:func:`canonlm.config.strict.check_light`, no torch), then :func:`check_job` (step 1
below, with the device and memory checks for jobs that run on this machine). A refusal there leaves nothing at all:
Hydra has not created the run (or sweep) directory yet.

Order within a job (nothing is written before every check has passed: a refused config leaves no ``.hydra/``,
``checkpoints/`` or run log, and the run directory Hydra made for it is removed again):
0. the kernel cache (``paths.kernel_cache``, :func:`canonlm.utils.kernel_cache.configure`): Triton's, fla's,
   mamba-ssm's and inductor's caches in one directory, set before any kernel can compile; a value that cannot be a
   directory of this user's raises ConfigError;
1. :func:`check_job`: every key is one canonlm reads (:func:`canonlm.config.strict.check_keys`), task (generator
   parameters, context window vs the largest instance), model config (sizes, Canon letters, RoPE fraction), the
   training keys of :data:`canonlm.config.rules.TRAINING_RULES` (booleans, seed, ...) and the schedule, the batch
   split, kernels requested explicitly, the memory of a training step (:func:`check_memory`), the optimizer's
   arguments (built once on a one-element tensor) — each bad value raises :class:`canonlm.errors.ConfigError`
   naming the key, the value and what is allowed; Lightning is not imported yet, so these answer in seconds;
2. checkpoints: temp files of interrupted saves are removed; ``ckpt_path=auto`` (the default inside a Hydra
   multirun job, so a requeued sweep job resumes by itself) picks the newest loadable checkpoint and says which;
   an explicit path is read; either is refused with one message when it is truncated or was made by another model
   or task (:mod:`canonlm.train.checkpoint`); a run dir that already holds checkpoints or results is never
   overwritten by a fresh run; ``init_from`` is read and compared with the model;
3. Lightning: the Trainer itself (its own checks of the values, strategy and devices; constructing it writes
   nothing; its warnings are held until the checks passed), the ``callbacks`` / ``logger`` entries (an argument
   their class refuses is a ConfigError), ``data.batch_size`` against the world size x ``accumulate_grad_batches``
   it chose, and last the run directory: writable, with room for one checkpoint. Lines for the run log are held in
   memory until here;
4. ``.hydra/`` (config.yaml, hydra.yaml, overrides.yaml), seed, model, fit, test, ``results.json`` + accuracy
   table. A preemption (SIGTERM, or SLURM's warning signal) or too many non-finite steps in a row stop training
   with ``last.ckpt`` saved and raise :class:`canonlm.errors.RunStopped` (no test, no ``results.json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from canonlm.arch.config import ModelConfig, position_encoding
from canonlm.arch.memory import human_bytes
from canonlm.config.build import build_configs
from canonlm.config.resolvers import register_resolvers
from canonlm.config.rules import check_training, micro_batch, plain
from canonlm.errors import ConfigError
from canonlm.utils.io import atomic_write_text, remove_empty_dirs
from canonlm.utils.kernel_cache import configure as configure_kernel_cache

register_resolvers()  # also in Hydra launcher workers (submitit pickles `main`; train.py's import never runs there)

log = logging.getLogger("canonlm")


def resolve_max_steps(cfg: DictConfig, task: Any) -> None:
    """The run's length, written into ``cfg.trainer.max_steps``: exactly one of ``trainer.max_steps`` and
    ``data.max_tokens`` is given (the other null or absent; ConfigError naming the second one when both are given,
    ``trainer.max_steps`` when neither is).

    * ``data.max_tokens`` (a number >= 1): ``trainer.max_steps = ceil(max_tokens / (data.batch_size x
      task.context))`` -- ``data.batch_size`` is the global number of windows per optimizer step (any world size
      and accumulation), so the run reads ``max_steps x batch_size x context >= max_tokens`` tokens;
    * ``trainer.max_steps: auto`` -> the task's own schedule (Capo: the steps that show every person
      ``task.exposures`` times at ``data.batch_size`` windows per step, Part 3.3's 100 exposures); ConfigError for
      a task that has no schedule of its own.
    Then a task with repetition caps (``text`` mixtures, ``max_epochs``) checks that they supply the run
    (:meth:`canonlm.data.text.TextTask.check_run`). Raises ConfigError; writes nothing to disk."""
    import math

    from omegaconf import open_dict

    from canonlm.config.rules import check_value

    steps = cfg.trainer.get("max_steps")
    max_tokens = plain(OmegaConf.select(cfg, "data.max_tokens", default=None))
    what = ""
    if max_tokens is not None:
        if steps is not None:
            raise ConfigError(
                "data.max_tokens",
                max_tokens,
                f"null while trainer.max_steps is set ({steps}): give "
                "exactly one of trainer.max_steps and data.max_tokens (add trainer.max_steps=null)",
            )
        check_value("data.max_tokens", max_tokens)
        batch = check_value("data.batch_size", plain(cfg.data.batch_size))
        context = int(cfg.task.context)
        per_step = int(batch) * context
        with open_dict(cfg):
            cfg.trainer.max_steps = int(math.ceil(max_tokens / per_step))
        what = f" (data.max_tokens={max_tokens:g})"
        if launch_rank() == 0:
            log.info(
                "data.max_tokens=%s -> trainer.max_steps=%d (%d windows x %d tokens = %d tokens per step; "
                "%d tokens in all)",
                f"{max_tokens:g}",
                cfg.trainer.max_steps,
                batch,
                context,
                per_step,
                cfg.trainer.max_steps * per_step,
            )
    elif steps is None:
        raise ConfigError(
            "trainer.max_steps",
            None,
            "a positive integer, or null with data.max_tokens set: give "
            "exactly one of trainer.max_steps and data.max_tokens",
        )
    elif steps == "auto":
        if not hasattr(task, "steps_for_exposures"):
            raise ConfigError(
                "trainer.max_steps", "auto", f"a positive integer (task {task.name} has no schedule of its own)"
            )
        with open_dict(cfg):
            cfg.trainer.max_steps = int(task.steps_for_exposures(int(cfg.data.batch_size)))
        log.info("trainer.max_steps=auto -> %d steps (%s)", cfg.trainer.max_steps, task.name)
    if hasattr(task, "check_run"):
        steps = check_value("trainer.max_steps", plain(cfg.trainer.max_steps))
        batch = check_value("data.batch_size", plain(cfg.data.batch_size))
        task.check_run(int(steps) * int(batch), what=what or f" (trainer.max_steps={steps} x data.batch_size={batch})")


def validate_training(cfg: DictConfig, optimizer: bool = True) -> None:
    """Checks of the training keys that Lightning would only report late (or never): the declared table
    (:data:`canonlm.config.rules.TRAINING_RULES`, the ``sched.*`` keys, ``seed`` and the booleans included), the
    learning-rate schedule built once (:func:`canonlm.train.schedule.lr_multiplier`), then the optimizer's
    arguments: names, booleans, and the optimizer built once on a one-element tensor
    (:func:`canonlm.config.strict.optimizer_problem`; ``optimizer=False``: not yet, :func:`check_job` does it last).
    Raises ConfigError for the first bad key."""
    from canonlm.train.schedule import lr_multiplier

    check_training(cfg)
    lr_multiplier(plain(cfg.sched), 1)
    if optimizer:
        _check_optimizer(cfg)


def _check_optimizer(cfg: DictConfig) -> None:
    from canonlm.config.strict import optimizer_problem

    err = optimizer_problem(cfg)
    if err is not None:
        raise err


def _device_of(cfg: DictConfig) -> torch.device:
    acc = cfg.trainer.get("accelerator", "auto")
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _declared_world_size(cfg: DictConfig) -> int | None:
    """``trainer.devices`` x ``trainer.num_nodes`` when both are positive integers (the world size Lightning then
    runs, or refuses), else None."""
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (devices, nodes)):
        return devices * nodes
    return None


def _strategy(cfg: DictConfig):
    s = cfg.strategy
    if s.name == "auto":
        return "auto"
    if s.name in ("ddp", "ddp_spawn"):
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(
            start_method="spawn" if s.name == "ddp_spawn" else "popen",
            find_unused_parameters=bool(s.get("find_unused_parameters", False)),
        )
    from canonlm.train.checkpoint import AtomicModelParallelStrategy

    devices = cfg.trainer.devices
    if devices in ("auto", -1):
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    world = int(devices) * int(cfg.trainer.get("num_nodes", 1))
    # Always pass the data-parallel size explicitly (the "auto" defaults give every rank the same batch).
    return AtomicModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _is_multirun() -> bool:
    """True inside a Hydra multirun job (basic or submitit launcher)."""
    from canonlm.train.wandb_utils import multirun_sweep_dir

    return multirun_sweep_dir() is not None


def launch_rank() -> int:
    """This process's global rank as the launcher set it (``RANK``, srun's ``SLURM_PROCID``, Lightning's
    ``LOCAL_RANK`` for its own subprocesses), 0 for a single process: read before any process group exists."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def resolve_ckpt(cfg: DictConfig, output_dir: str, check=None) -> str | None:
    """The checkpoint to start from, or None for a fresh run.

    ``ckpt_path``: ``auto`` -> the newest loadable checkpoint of ``<output_dir>/checkpoints``
    (:func:`canonlm.train.checkpoint.find_resume_checkpoint`), or None when there is none; ``null`` -> ``auto``
    inside a Hydra multirun job (a requeued or re-run sweep job resumes in its own directory), else a fresh run,
    refused when the directory already holds checkpoints or ``results.json``; a path -> that checkpoint, read and
    checked. ``check(info)`` validates the chosen checkpoint against the model and task (raises CheckpointError).
    Raises ConfigError / CheckpointError, never starts fresh beside old checkpoints."""
    from canonlm.train.checkpoint import find_resume_checkpoint, has_checkpoints, inspect_checkpoint

    ck = cfg.get("ckpt_path")
    if ck is None and cfg.get("train", True) and _is_multirun():
        ck = "auto"
    if ck == "auto":
        info = find_resume_checkpoint(output_dir, check=check)
        if info is not None:
            if launch_rank() == 0:
                log.info("ckpt_path=auto: resuming from %s (step %d)", info.path, info.step)
            return info.path
        return None
    if ck is None:
        if cfg.get("train", True) and (has_checkpoints(output_dir) or (Path(output_dir) / "results.json").exists()):
            raise ConfigError(
                "run_name",
                cfg.get("run_name"),
                f"a fresh name: {output_dir} already holds a run (checkpoints or results.json); "
                "pass ckpt_path=auto to resume it",
            )
        return None
    info = inspect_checkpoint(ck)
    if check is not None:
        check(info)
    return str(ck)


def _finished_results(cfg: DictConfig, output_dir: str) -> dict[str, Any] | None:
    """A multirun job whose directory already holds ``results.json`` at ``trainer.max_steps`` (a re-run of a sweep
    with a fixed ``hydra.sweep.dir``, or a requeue after the end): its results, so the job is not trained again."""
    res = Path(output_dir) / "results.json"
    if not (_is_multirun() and res.is_file() and cfg.get("ckpt_path") is None):
        return None
    try:
        results = json.loads(res.read_text())
    except (OSError, ValueError):
        return None
    return results if int(results.get("steps", -1)) >= int(cfg.trainer.max_steps) else None


def _save_hydra_files(cfg: DictConfig, output_dir: str) -> None:
    """Write ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into the run directory, as Hydra's
    ``run_job`` does when ``hydra.output_subdir`` is set (canonlm sets it to null so that a refused config writes
    nothing, and writes them here once the config has passed). No-op outside a Hydra job."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return
        hc = HydraConfig.get()
    except Exception:  # noqa: BLE001 -- not under Hydra (an in-process run): no .hydra files to save
        return
    d = Path(output_dir) / ".hydra"
    atomic_write_text(d / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(d / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
    atomic_write_text(d / "overrides.yaml", OmegaConf.to_yaml(hc.overrides.task))


def _check_init_from(path: str, mcfg: ModelConfig) -> None:
    """``init_from``: the weights exist, can be read without unpickling and compute the configured model's function
    (:func:`canonlm.hf.io.read_weights`, :func:`canonlm.hf.mapping.structural_differences`); raises ConfigError."""
    from canonlm.hf.io import read_weights
    from canonlm.hf.mapping import InteropError, structural_differences

    if not Path(path).expanduser().exists():
        raise ConfigError(
            "init_from", path, "null or an existing canonlm checkpoint, run directory or Hugging Face directory"
        )
    try:
        src_cfg, _ = read_weights(path)
    except InteropError as e:
        raise ConfigError("init_from", path, f"weights canonlm can read ({e})") from None
    diff = structural_differences(src_cfg, mcfg)
    if diff:
        raise ConfigError(
            "init_from",
            path,
            "weights of the configured model; they differ in " + "; ".join(diff[:6]) + " (value there vs here)",
        )


def _local_cuda_device() -> torch.device:
    """The CUDA device this process trains on: ``LOCAL_RANK`` (Lightning's launcher, torchrun) or ``SLURM_LOCALID``
    (srun), else device 0 (a single process, or rank 0 before it launches the others)."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return torch.device("cuda", int(os.environ[var]))
    return torch.device("cuda", 0)


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) a training process on ``device`` can use: on CUDA the device's free memory
    (``torch.cuda.mem_get_info``, evaluated only for a run on CUDA: it creates the CUDA context on the device this
    process will train on anyway); on the CPU the kernel's estimate of the memory available without swapping
    (``MemAvailable`` of ``/proc/meminfo``; elsewhere the free physical pages, ``os.sysconf``)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"{device} has {human_bytes(free)} free of {human_bytes(total)}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    n = int(line.split()[1]) * 1024
                    return n, f"the machine has {human_bytes(n)} available (MemAvailable)"
    except OSError:
        pass
    n = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(n), f"the machine has {human_bytes(n)} of free physical memory"


def check_memory(cfg: DictConfig, mcfg: ModelConfig, device: torch.device) -> int | None:
    """Refuse a run whose training step cannot fit in memory: :func:`canonlm.arch.memory.training_memory` (a lower
    bound: parameters, gradients, AdamW state, activations and batch data of one micro-batch per process, with
    document masking's mask, index tensors and ``doc_ids`` under ``task.doc_mask=true``) against
    :func:`available_memory`. On the CPU the ranks of this machine (``trainer.devices``) share its memory; on CUDA
    each rank has its device. The micro-batch's part is compared first (it needs no model: a huge batch is refused
    in a second), then the whole with the parameter count of the model built on the meta device. Raises ConfigError
    naming ``data.batch_size`` when the micro-batch's activations and data are the larger part, else
    ``model.size``, with the numbers. A device whose memory cannot be queried (no CUDA runtime although CUDA was
    asked for: Lightning refuses that itself) is not checked. Returns the parameter count when it was computed."""
    from canonlm.arch.memory import count_parameters, strategy_memory

    if device.type == "cuda" and not torch.cuda.is_available():
        return None  # no GPU here: Lightning refuses the accelerator itself (one line, before anything is written)
    try:
        have, where = available_memory(_local_cuda_device() if device.type == "cuda" else device)
    except (RuntimeError, AssertionError, OSError, ValueError):  # the device cannot be queried: nothing to compare
        return None
    accumulate = cfg.trainer.get("accumulate_grad_batches") or 1
    world = _declared_world_size(cfg)
    if world is None:
        world = (torch.cuda.device_count() if device.type == "cuda" else 1) * int(cfg.trainer.get("num_nodes") or 1)
    here = int(cfg.trainer.devices) if device.type == "cpu" and isinstance(cfg.trainer.get("devices"), int) else 1
    mb = -(-int(cfg.data.batch_size) // max(1, world * int(accumulate)))

    def need(n_params: int):  # the arithmetic python -m canonlm.estimate prints (one mapping of the settings)
        return strategy_memory(
            mcfg,
            mb,
            mcfg.max_seq_len,
            strategy=cfg.strategy.name,
            world_size=max(1, world),
            precision=cfg.trainer.precision,
            param_dtype=cfg.strategy.get("param_dtype"),
            accumulate=int(accumulate),
            activation_checkpointing=bool(cfg.get("activation_checkpointing", False)),
            amsgrad=bool(cfg.optim.get("amsgrad")),
            n_params=n_params,
            doc_mask=OmegaConf.select(cfg, "task.doc_mask", default=False) is True,
        )

    n_params, est = None, need(0)
    if est.total * here <= have:
        n_params = count_parameters(mcfg)
        est = need(n_params)
        if est.total * here <= have:
            return n_params
    per = f" per process x {here} processes on this machine" if here > 1 else " per process"
    masked = (
        f" (document masking {human_bytes(est.doc_masking.activations)} of them)" if est.doc_masking is not None else ""
    )
    what = (
        est.describe()
        if n_params is not None
        else (
            f"activations {human_bytes(est.activations)}{masked}, batch data {human_bytes(est.batch)}; before the "
            "model's parameters, gradients and optimizer state"
        )
    )
    key, value = (
        ("data.batch_size", cfg.data.batch_size) if est.batch_dominated else ("model.size", cfg.model.get("size"))
    )
    raise ConfigError(
        key,
        value,
        f"a run that fits in memory: training needs at least {human_bytes(est.total)}"
        f"{per} ({what}; micro-batch {mb} windows x {mcfg.max_seq_len} tokens) and {where}",
    )


def check_job(cfg: DictConfig, device_checks: bool = True, plan: bool = False) -> tuple[Any, ModelConfig, int | None]:
    """Every check of a job's config that needs neither Lightning nor its run directory (module docstring, step 1),
    in order: the keys (:func:`canonlm.config.strict.check_keys`), task and model config, ``trainer.max_steps:
    auto``, the training keys and the schedule, the batch split; with ``device_checks`` (the job runs on this
    machine) the kernels requested for the device it will use and the memory of a training step
    (:func:`check_memory`); last the optimizer's arguments (built once on a one-element tensor). The Canon set is
    written back as the model records it (``AbbCD`` -> ``AbCD``), so the saved config is what trains.

    A ``text`` task whose prepared corpus' vocabulary differs from the one ``task.vocab_size`` declares (a
    real-life preset's Llama-2 32,000 on a corpus of another tokenizer) is refused, naming ``task.vocab_size``: the
    run would train another model than the preset's (give ``task.vocab_size=<the corpus'>`` or ``null`` to train it
    anyway). ``plan`` (``python -m canonlm.estimate``, never training): instead, a ``text`` task whose corpus keys
    are unset is planned with the declared vocabulary (:class:`canonlm.data.text.TextPlan`, whose repetition caps
    are not checked), and a differing vocabulary is left to the caller (``task.vocab_mismatch()``).

    Returns (task, model config, parameter count when the memory check computed it). Raises ConfigError (a value
    whose interpolation does not resolve included); writes nothing."""
    from canonlm.config.strict import interpolation_errors

    with interpolation_errors(cfg):
        return _check_job(cfg, device_checks, plan)


def _planned_text(cfg: DictConfig) -> tuple[Any, ModelConfig] | None:
    """(:class:`canonlm.data.text.TextPlan`, model config) of a ``text`` job whose corpus is unset, or None (any
    other job): the model is :func:`canonlm.config.build.build_configs`'s, with the declared vocabulary."""
    if OmegaConf.select(cfg, "task.name", default=None) != "text":
        return None
    from canonlm.arch.config import build_model_config
    from canonlm.data.text import plan_text_task

    task = plan_text_task(cfg.task)
    if task is None:
        return None
    model = dict(plain(cfg.model))  # as build_configs (the text task sets no model keys of its own)
    model["ops"] = cfg.get("ops", "auto")
    model["kernels"] = {k: v for k, v in (plain(cfg.get("kernels")) or {}).items() if v is not None}
    return task, build_model_config(
        model, plain(cfg.canon), plain(cfg.pos), vocab_size=task.vocab_size, max_seq_len=task.context
    )


def _check_job(cfg: DictConfig, device_checks: bool, plan: bool = False) -> tuple[Any, ModelConfig, int | None]:
    from omegaconf import open_dict

    from canonlm.config.strict import check_keys

    check_keys(cfg)
    planned = _planned_text(cfg) if plan else None
    task, mcfg = planned if planned is not None else build_configs(cfg)
    mismatch = task.vocab_mismatch() if hasattr(task, "vocab_mismatch") else None
    if mismatch is not None and not plan:
        raise ConfigError(
            "task.vocab_size",
            task.declared_vocab_size,
            f"the vocabulary of the corpus it trains on: "
            f"{mismatch}, so this run would train another model than the config declares; prepare the "
            f"corpus with that tokenizer, or give task.vocab_size={task.corpus_vocab_size} (or null) to "
            "train on this one",
        )
    if OmegaConf.select(cfg, "canon.set", default=None) not in (None, mcfg.canon.set):
        with open_dict(cfg):
            cfg.canon.set = mcfg.canon.set
    resolve_max_steps(cfg, task)
    if OmegaConf.select(cfg, "task.doc_mask", default=False) is True:
        from canonlm.arch import doc_mask_problem

        why = doc_mask_problem(mcfg)  # a model that cannot keep documents apart: refused, never silently mixed
        if why is not None:
            raise ConfigError("task.doc_mask", True, f"false for this model ({why})")
    validate_training(cfg, optimizer=False)
    world = _declared_world_size(cfg)
    if world is not None:  # else Lightning decides it (devices=auto / -1 / a list): checked once the Trainer exists
        micro_batch(cfg.data.batch_size, world, cfg.trainer.get("accumulate_grad_batches") or 1)
    n_params = None
    if device_checks:
        device = _device_of(cfg)
        from canonlm.arch.model import compute_dtype_for, resolve_backends

        resolve_backends(
            mcfg,
            device,
            compute_dtype_for(  # the dtype rule of LMModule.place_model
                cfg.trainer.precision, cfg.strategy.get("param_dtype") if cfg.strategy.name == "fsdp2" else None
            ),
        )
        n_params = check_memory(cfg, mcfg, device)
    _check_optimizer(cfg)  # last: building the optimizer once imports torch._dynamo (1-2 s on a small machine)
    return task, mcfg, n_params


def check_jobs(jobs: list) -> int:
    """:func:`check_job` for every job of :func:`canonlm.config.strict.compose_jobs` (within its Hydra runtime;
    device and memory checks only for jobs that run on this machine: not those a SLURM launcher submits). Returns
    the number of jobs. Raises ConfigError."""
    for job in jobs:
        with job.active() as cfg:
            check_job(cfg, device_checks=job.local)
    return len(jobs)


def check_command_line(argv: list[str], config_dir: str | os.PathLike, config_name: str = "train") -> int:
    """``train.py``'s checks before Hydra runs anything: every job of ``argv`` composed as Hydra will compose it
    (:func:`canonlm.config.strict.compose_jobs`: Hydra's own errors become one ConfigError), then for each job the
    checks without torch (:func:`canonlm.config.strict.check_light`: the directory Hydra will create before the
    task function runs, the keys, the declared rules), then :func:`check_jobs`. Returns the number of jobs checked
    (0 for ``--help``, ``--cfg``, ``--info``: Hydra's own output). Raises ConfigError; writes nothing (Hydra's
    global state is left cleared). ``train.py`` runs the same steps, importing this module (and torch) only after
    the light checks passed."""
    from canonlm.config.strict import check_light, compose_jobs, runs_jobs

    if not runs_jobs(argv):
        return 0
    jobs = compose_jobs(argv, config_dir, config_name)
    for job in jobs:
        with job.active():
            check_light(job)
    return check_jobs(jobs)


def _check_config(cfg: DictConfig) -> tuple[Any, ModelConfig, str | None, int]:
    """Every check that needs no Lightning, in order (module docstring, steps 1-2): (task, model config, checkpoint
    to resume or None, parameter count). Raises ConfigError (CheckpointError) with one message; writes nothing
    (it only removes what interrupted saves left in ``checkpoints/``)."""
    from canonlm.train.checkpoint import check_compatible, remove_stale_temps

    output_dir = Path(str(cfg.paths.output_dir))
    task, mcfg, n_params = check_job(cfg)
    from canonlm.arch.model import CanonLM

    with torch.device("meta"):
        meta_model = CanonLM(mcfg)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    n_params = meta_model.num_params()
    del meta_model
    if launch_rank() == 0:
        for line in remove_stale_temps(output_dir / "checkpoints"):
            log.warning("%s", line)
    task_cfg = plain(cfg.task)
    ckpt = resolve_ckpt(
        cfg,
        str(output_dir),
        check=lambda info: check_compatible(info, mcfg, _task_cfg_as_saved(task_cfg, info), shapes),
    )
    init = cfg.get("init_from")
    if init is not None and ckpt is None:
        _check_init_from(str(init), mcfg)
    return task, mcfg, ckpt, n_params


def _task_cfg_as_saved(task_cfg: dict[str, Any], info: Any) -> dict[str, Any]:
    """``task_cfg`` without the keys a task gained after ``info``'s checkpoint was written, where they hold their
    defaults (text: ``sources``, ``mix``, ``doc_mask`` of :data:`canonlm.data.text.ADDED_KEYS`), so that a run
    started before those keys existed resumes; any other difference is still one (``check_compatible``). The text
    task's plan keys (:data:`canonlm.data.text.PLAN_KEYS`: the declared tokenizer, which changes nothing that trains;
    the model's vocabulary is compared through its weights' shapes) are taken as the checkpoint has them."""
    saved = (info.meta or {}).get("task") if info.meta is not None else None
    if not saved or task_cfg.get("name") != "text":
        return task_cfg
    from canonlm.data.text import ADDED_KEYS, PLAN_KEYS

    out = {
        k: v
        for k, v in task_cfg.items()
        if k not in PLAN_KEYS and (k in saved or k not in ADDED_KEYS or ADDED_KEYS[k] != v)
    }
    return {**out, **{k: saved[k] for k in PLAN_KEYS if k in saved}}


def prepare_run(cfg: DictConfig) -> tuple[Any, ModelConfig, str | None]:
    """Every check that needs no Lightning (module docstring, steps 1-2): returns (task, model config, checkpoint to
    resume or None). Raises ConfigError (CheckpointError) with one message; writes nothing."""
    return _check_config(cfg)[:3]


class _Hold(logging.Filter):
    """Keeps the records a handler would write, instead of writing them (:func:`_nothing_written_until_checked`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def _nothing_written_until_checked(output_dir: Path, log_dir: Path) -> Iterator[None]:
    """Around the checks of a run: lines bound for the run log (``<run dir>/<task_name>.log``, Hydra's file handler)
    are held in memory meanwhile (the console still shows them). When the body raises ConfigError they are dropped
    and the run directory Hydra created for this process is removed again with the parent folders left empty, up to
    ``paths.log_dir`` (only when it was empty at the start); otherwise they are written, in order, at the end."""
    import shutil

    was_empty = output_dir.is_dir() and not any(output_dir.iterdir())
    files = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve().parent == output_dir.resolve()
    ]
    hold = _Hold()
    for h in files:
        h.addFilter(hold)
    refused = False
    try:
        yield
    except ConfigError:
        refused = True
        raise
    finally:
        for h in files:
            h.removeFilter(hold)
            if refused:
                h.close()
            else:
                for record in hold.records:
                    h.handle(record)
        if refused and was_empty and output_dir.is_dir():
            shutil.rmtree(output_dir, ignore_errors=True)
            remove_empty_dirs(output_dir.resolve().parent, log_dir.resolve().parent)


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
    # evaluation metrics are all-reduced by the module itself and logged from rank 0 (LMModule._eval_end)
    warnings.filterwarnings("ignore", message=".*It is recommended to use `self.log\\(.*sync_dist=True.*")
    # handled by canonlm: SLURM jobs are launched by submitit with srun and get SLURMEnvironment (_build_trainer); a
    # run outside SLURM is one process (or Lightning's own launcher), so srun on PATH is no mistake
    warnings.filterwarnings("ignore", message=".*The `srun` command is available on your system but is not used.*")
    # a resume writes into its own checkpoints/ on purpose; a fresh run beside checkpoints is refused (resolve_ckpt)
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")


def _trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The ``trainer`` node as ``lightning.Trainer`` keyword arguments, each name checked against the signature of
    ``Trainer.__init__`` (``strategy``, ``callbacks``, ``logger`` and ``plugins`` come from their own config groups).
    ``val_check_interval`` counts optimizer steps in the config and batches in Lightning: an integer is multiplied
    by ``accumulate_grad_batches``. Raises ConfigError("trainer.<name>", value, the accepted names)."""
    import inspect

    import lightning.pytorch as L

    kwargs = plain(cfg.trainer)
    kwargs.pop("_target_", None)
    own = ("strategy", "callbacks", "logger", "plugins")
    names = [n for n in inspect.signature(L.Trainer.__init__).parameters if n not in ("self", *own)]
    for key, value in kwargs.items():
        if key not in names:
            raise ConfigError(
                f"trainer.{key}",
                value,
                (
                    "set by the strategy / callbacks / logger config groups, not trainer.*"
                    if key in own
                    else "an argument of lightning.Trainer: " + ", ".join(names)
                ),
            )
    accumulate = kwargs.get("accumulate_grad_batches") or 1
    if isinstance(kwargs.get("val_check_interval"), int) and isinstance(accumulate, int):
        kwargs["val_check_interval"] *= accumulate
    return kwargs


def _lightning_key(message: str, kwargs: dict[str, Any]) -> str | None:
    """The ``trainer`` argument a ``lightning.Trainer`` error is about: the first of ``kwargs``'s names the message
    mentions (```max_epochs` must be ...``, ``Trainer(devices=0)``, ``accelerator='abacus'``), else ``accelerator``
    when a device accelerator was asked for and the message is about that device ("No supported gpu backend
    found!"), else None (the whole ``trainer`` node is named)."""
    import re

    hits = [
        (m.start(), k)
        for k in kwargs
        if k != "default_root_dir"
        for m in [re.search(rf"(?<![A-Za-z_]){re.escape(k)}(?![A-Za-z_])", message)]
        if m
    ]
    if hits:
        return min(hits)[1]
    if str(kwargs.get("accelerator")) in ("gpu", "cuda", "mps", "tpu") and re.search(
        r"\b(gpu|cuda|mps|tpu)\b", message, flags=re.I
    ):
        return "accelerator"
    return None


def _instantiate(key: str, node: Any) -> Any:
    """``hydra.utils.instantiate(node)`` for an entry of the extension points ``callbacks`` / ``logger``; an entry
    its class refuses (an unknown argument, a bad value, a ``_target_`` that does not import) raises ConfigError
    naming ``key`` with the class's first line, instead of Hydra's traceback (nothing is written yet: constructing
    a callback or logger writes nothing)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except ConfigError:
        raise
    except (InstantiationException, TypeError, ValueError, ImportError) as e:
        import re

        cause = e.__cause__ or e
        first = " ".join(str(cause).split())[:300] or type(cause).__name__
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        arg = re.search(r"unexpected keyword argument '(\w+)'", first)
        if arg and isinstance(node, DictConfig) and arg.group(1) in node:  # name the key and the one it meant
            import inspect

            from hydra._internal.utils import _locate

            from canonlm.config.strict import unknown_key_error

            try:
                names = [n for n in inspect.signature(_locate(str(target))).parameters if n not in ("args", "kwargs")]
            except Exception:  # noqa: BLE001 -- no signature to suggest from
                names = []
            raise unknown_key_error(
                f"{key}.{arg.group(1)}", plain(node[arg.group(1)]), [f"{key}.{n}" for n in names]
            ) from None
        raise ConfigError(key, plain(node), f"arguments {target or 'its _target_'} accepts ({first})") from None


_HELD_WARNINGS: list = []  # Lightning's warnings from constructing the Trainer, shown once the checks passed


def _build_trainer(cfg: DictConfig, task: Any, output_dir: str) -> tuple[Any, Any, list[Any]]:
    """(Trainer, data module, wandb logger nodes) as configured: Lightning's own checks of the ``trainer`` arguments,
    the strategy and the devices run here (``lightning.Trainer`` writes nothing when constructed), then the batch
    arithmetic of the world size it chose. The warnings Lightning gives while constructing the Trainer are held
    (``_HELD_WARNINGS``) and shown by :func:`run` once every check passed (a refusal stays one line). Raises
    ConfigError."""
    import lightning.pytorch as L
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from canonlm.train.checkpoint import AtomicCheckpointIO
    from canonlm.train.datamodule import SyntheticDataModule
    from canonlm.train.loggers import JSONLLogger

    _tidy_logging()
    dm = SyntheticDataModule(
        task,
        plain(cfg.task),
        batch_size=cfg.data.batch_size,
        num_workers=cfg.data.num_workers,
        val_windows=cfg.data.val_windows,
        test_windows=cfg.data.test_windows,
    )
    callbacks = [
        _instantiate(f"callbacks.{name}", c) for name, c in (cfg.get("callbacks") or {}).items() if c is not None
    ]
    loggers, wandb_nodes = [], []
    for name, lg in (cfg.get("logger") or {}).items():
        if lg is None:
            continue
        if name == "wandb":  # stable id (a resume continues its run), sweep group, arch/canon/pos/task tags
            from canonlm.train.wandb_utils import logger_config

            lg = logger_config(lg, cfg, output_dir, rank0=False)  # wandb_init.json is written once checked
            wandb_nodes.append(lg)
        loggers.append(_instantiate(f"logger.{name}", lg))
    loggers.append(JSONLLogger(output_dir))
    kwargs = _trainer_kwargs(cfg)
    plugins: list[Any] = [] if cfg.strategy.name == "fsdp2" else [AtomicCheckpointIO()]
    if os.environ.get("SLURM_JOB_ID"):
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=False))  # the Preemption callback owns requeueing
    strategy = _strategy(cfg)
    import warnings

    try:  # Lightning's warnings while it checks (e.g. "srun is available but not used"): shown once all checks pass
        with warnings.catch_warnings(record=True) as caught:
            trainer = L.Trainer(**kwargs, strategy=strategy, callbacks=callbacks, logger=loggers, plugins=plugins)
        _HELD_WARNINGS.extend(caught)
    except (MisconfigurationException, ValueError, TypeError, ImportError) as e:
        key = _lightning_key(str(e), kwargs)
        if key is None:
            raise ConfigError(
                "trainer",
                {k: v for k, v in kwargs.items() if k != "default_root_dir"},
                f"arguments Lightning accepts on this machine ({e})",
            ) from None
        raise ConfigError(f"trainer.{key}", kwargs[key], f"a value Lightning accepts on this machine ({e})") from None
    dm.micro_batch(trainer.world_size, trainer.accumulate_grad_batches)
    return trainer, dm, wandb_nodes


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate as configured; returns the results dict also written to ``<run dir>/results.json``.

    Raises ConfigError (before anything is written) and :class:`RunStopped` (training stopped early with a saved
    checkpoint)."""
    from canonlm.train.checkpoint import check_run_dir, estimate_checkpoint_bytes

    output_dir = str(cfg.paths.output_dir)
    with _nothing_written_until_checked(Path(output_dir), Path(str(cfg.paths.log_dir))):
        # 0. the kernel cache, before anything can compile a kernel (every process and SLURM job runs this)
        configure_kernel_cache(cfg.paths.get("kernel_cache"), key="paths.kernel_cache", base=cfg.paths.get("root_dir"))
        # 1-2. the config and the checkpoint choices, before Lightning is imported
        task, mcfg, ckpt, n_params = _check_config(cfg)
        done = _finished_results(cfg, output_dir)
        if done is not None:
            log.info("%s already finished (%d steps, results.json): not trained again", output_dir, done["steps"])
            return done
        # 3. Lightning's checks (trainer arguments, strategy, devices), the batch arithmetic, the run directory
        trainer, dm, wandb_nodes = _build_trainer(cfg, task, output_dir)
        if (
            cfg.get("train", True)
            and cfg.get("callbacks")
            and (cfg.callbacks.get("checkpoint") is not None or cfg.callbacks.get("preemption") is not None)
        ):
            check_run_dir(Path(output_dir), estimate_checkpoint_bytes(n_params))  # the one check that writes
    import warnings

    for w in _HELD_WARNINGS:  # the checks passed: Lightning's warnings from constructing the Trainer
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    _HELD_WARNINGS.clear()

    # 4. write the config, seed, model, train, test
    import lightning.pytorch as L
    from hydra.utils import instantiate

    from canonlm.train.module import LMModule
    from canonlm.train.wandb_utils import write_init_file
    from canonlm.utils.allocator import tune_malloc

    if launch_rank() == 0:
        _save_hydra_files(cfg, output_dir)
        for node in wandb_nodes:
            write_init_file(node, output_dir)
    tune_malloc()  # keep freed activations in the process (canonlm.utils.allocator): ~20 % faster CPU steps
    task_cfg = plain(cfg.task)
    L.seed_everything(int(cfg.seed), workers=False, verbose=False)
    fsdp = plain(cfg.strategy) if cfg.strategy.name == "fsdp2" else None
    module = LMModule(
        mcfg,
        optimizer=instantiate(cfg.optim),
        sched=plain(cfg.sched),
        total_steps=cfg.trainer.max_steps,
        loss=plain(cfg.loss),
        num_groups=task.num_groups,
        group_name=getattr(task, "group_name", "group"),
        compile=bool(cfg.get("compile", False)),
        activation_checkpointing=bool(cfg.get("activation_checkpointing", False)),
        fsdp=fsdp,
        task=task,
        gen_eval=plain(cfg.data.get("gen_eval")) or {},
        task_cfg=task_cfg,
        max_nonfinite_steps=int(cfg.get("max_nonfinite_steps", 5)),
    )
    if cfg.get("init_from") is not None and ckpt is None:  # weights only; a resumed checkpoint restores its own
        from canonlm.hf.io import load_init_weights

        load_init_weights(str(cfg.init_from), module.model)
        if trainer.is_global_zero:
            log.info("init_from=%s: weights loaded (fresh optimizer and schedule)", cfg.init_from)
    module.tokens_per_step = int(cfg.data.batch_size) * int(task_cfg["context"])
    module.windows_per_step = int(cfg.data.batch_size)
    # the backends, resolved where Lightning will run the model (configure_model resolves them again, alike):
    # printed, and recorded in hparams.json and results.json with the document-masking setting
    module.place_model(trainer)
    resolved = {"backends": module.model.backend_report(), "doc_mask": bool(task_cfg.get("doc_mask", False))}

    n_params = module.model.num_params()
    pos_type = position_encoding(mcfg.arch, mcfg.pos.type)
    if trainer.is_global_zero:
        log.info(
            "task %s | vocab %d | context %d | model %s %dL %dD %dH canon=%r pos=%s | %.2fM params | world size %d",
            task.name,
            task.vocab_size,
            task_cfg["context"],
            mcfg.arch,
            mcfg.n_layers,
            mcfg.d_model,
            mcfg.n_heads,
            mcfg.canon.set,
            pos_type,
            n_params / 1e6,
            trainer.world_size,
        )
        log.info(
            "%s; document masking %s",
            module.model.backend_line(),
            "on (task.doc_mask=true)" if resolved["doc_mask"] else "off",
        )
        for op, note in resolved["backends"]["notes"].items():
            log.info("  %s: %s", op, note)
        for lg in trainer.loggers:  # ``resolved``: what this machine runs (train/cells.py keeps it out of cells)
            lg.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True), "resolved": resolved})
        if getattr(task, "is_mixture", False):
            for name, row in task.source_table().items():
                log.info(
                    "source %s: share %.4f of the training windows (weight %s), %d windows of %d tokens per "
                    "epoch, cap %s",
                    name,
                    row["share"],
                    row["weight"],
                    row["train_windows"],
                    task_cfg["context"],
                    "none"
                    if row["capacity"] is None
                    else f"{row['capacity']} windows (max_epochs={row['max_epochs']})",
                )
        log.info(
            "run length: %d steps x %d tokens = %d tokens",
            cfg.trainer.max_steps,
            module.tokens_per_step,
            int(cfg.trainer.max_steps) * module.tokens_per_step,
        )

    # 5. train + test
    if cfg.get("train", True):
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)  # may raise RunStopped
    if cfg.get("test", True):
        trainer.test(module, datamodule=dm, ckpt_path=None, verbose=False)

    results = {
        "task": task.name,
        "task_config": task_cfg,
        "model": {
            "arch": mcfg.arch,
            "size": f"{mcfg.n_layers}L{mcfg.d_model}D",
            "n_heads": mcfg.n_heads,
            "canon": mcfg.canon.set,
            "pos": pos_type,
            "qk_norm": mcfg.qk_norm,
            "params": n_params,
            "tie_embeddings": mcfg.tie_embeddings,
        },
        "steps": trainer.global_step,
        "tokens_seen": trainer.global_step * module.tokens_per_step,
        **(
            {"max_tokens": plain(OmegaConf.select(cfg, "data.max_tokens", default=None))}
            if OmegaConf.select(cfg, "data.max_tokens", default=None) is not None
            else {}
        ),
        **(
            {
                "sources": {
                    name: {**row, "tokens_seen": int(n) * int(task_cfg["context"])}
                    for (name, row), n in zip(
                        task.source_table().items(), task.source_windows(trainer.global_step * module.windows_per_step)
                    )
                }
            }
            if getattr(task, "is_mixture", False)
            else {}
        ),
        "doc_mask": resolved["doc_mask"],
        "backends": resolved["backends"],
        "train_time_s": round(module.train_time_s, 1),
        "attempts": module.attempts,
        "world_size": trainer.world_size,
        "nonfinite_steps": module.nonfinite_steps,
        "metric": getattr(task, "metric", None)
        or (
            "generation accuracy (the task's validator on the model's generations)"
            if getattr(task, "eval_mode", "teacher_forced") == "generate"
            else "answer_exact (whole answer right under teacher forcing), token_acc per answer token"
        ),
        **{split: module.results[split] for split in ("val", "test") if split in module.results},
    }
    if trainer.is_global_zero:
        path = atomic_write_text(Path(output_dir) / "results.json", json.dumps(results, indent=1, default=str))
        print(format_table(results, task), flush=True)
        print(f"results: {path}", flush=True)
    return results


def _chance_text(task: Any) -> str:
    """ "; chance X %" (with the reason where it is about 0: ``references.CHANCE_NOTE``), or "" without one."""
    from canonlm.data.tasks.references import CHANCE_NOTE

    chance = getattr(task, "chance", None)
    note = CHANCE_NOTE.get(task.name)
    if chance is None and note is None:
        return ""
    return f"; chance ~{100 * (chance or 0):.{1 if chance else 0}f} %" + (f" ({note})" if note else "")


def format_table(results: dict[str, Any], task: Any) -> str:
    """Human-readable table of the last evaluation (test, else val): accuracy by group with the task's chance level,
    the task's extra metrics with what they mean and their untrained scale (``task.explain_metrics``: Capo's bits,
    Lano's KL), the paper's numbers to read them against (``canonlm.data.tasks.references.PAPER``), and the run's
    length, time and loss."""
    from canonlm.data.tasks.references import PAPER

    split = "test" if "test" in results else "val"
    res = results.get(split)
    if not res:
        return "(no evaluation was run)"
    g = res.get("group_name", "group")
    lines = []
    gen = res.get("generate")
    extras: dict[str, float] = {}
    if gen is not None:
        lines += [
            f"{task.name}: generation accuracy by {g} ({split} split, {gen['samples']} samples, "
            "accepted by the task's validator)" + _chance_text(task),
            f"  {g:>6} {'samples':>8} {'acc':>8}",
        ]
        for k, row in gen["by_group"].items():
            lines.append(f"  {k:>6} {row['samples']:>8} {100 * row['acc']:>7.1f}%")
        lines.append(f"  {'all':>6} {gen['samples']:>8} {100 * gen['acc']:>7.1f}%")
        for k, v in gen.items():
            if k not in ("by_group", "samples", "acc"):
                lines.append(f"  {k} {v:.6g}")
                extras[k] = v
    elif res["by_group"]:
        lines += [
            f"{task.name}: accuracy by {g} ({split} split, whole-answer exact match under teacher forcing)"
            + _chance_text(task),
            f"  {g:>4} {'answers':>8} {'exact':>8} {'token':>8}",
        ]
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
        sources = res.get("sources") or {}
        if sources:
            w = max(len("source"), *(len(n) for n in sources))
            lines.append(f"  {'source':<{w}} {'loss':>8} {'ppl':>10} {'tokens':>12}  ({split} split of each source)")
            for name, row in sources.items():
                lines.append(f"  {name:<{w}} {row['loss']:>8.4f} {row['ppl']:>10.3f} {row['tokens']:>12,}")
    for k, v in (res.get("task_metrics") or {}).items():
        lines.append(f"  {k} {v:.6g}")
        extras[k] = v
    if extras and hasattr(task, "explain_metrics"):
        lines += [f"  {x}" for x in task.explain_metrics(extras)]
    if PAPER.get(task.name):
        lines.append(f"  read against: {PAPER[task.name]} (at CPU scale read the direction, not the level)")
    attempts = results.get("attempts", 1)
    lines.append(
        f"  steps {results['steps']}, tokens {results['tokens_seen'] / 1e6:.2f}M, "
        f"training time {results['train_time_s']:.0f} s"
        + (f" over {attempts} attempts" if attempts and attempts > 1 else "")
        + (f", {results['nonfinite_steps']} non-finite steps skipped" if results.get("nonfinite_steps") else "")
        + f", loss {res['loss']:.4f}"
    )
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
