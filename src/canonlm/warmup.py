"""``python -m canonlm.warmup [--json PATH] <overrides>``: compile every kernel a run needs, once, into the kernel
cache.

The overrides are those of ``python train.py <overrides>``: the config is composed the same way (Hydra compose of
``conf/train.yaml`` with canonlm's resolvers), and the run's own code runs (:func:`canonlm.train.run.run`) for two
optimizer steps at the run's real shapes (its per-device micro-batch, context, world size, precision, strategy and
``compile`` setting), then one validation batch and one test batch -- with the task's generation-based evaluation
(Brevo, Lano) limited to one batch of prompts (``data.gen_eval.batch_size`` per rank) -- so that every Triton kernel,
autotune choice (fla, mamba-ssm) and, with ``compile=true``, every inductor graph of the training step, the evaluation
forward and decoding lands in the kernel cache (:mod:`canonlm.utils.kernel_cache`, ``paths.kernel_cache``). A later
``train.py`` with the same overrides then starts from a warm cache.

What warmup changes in the composed config (nothing else): ``trainer.max_steps=2``, validation once after step 2
(``trainer.val_check_interval``), ``trainer.limit_val_batches`` / ``limit_test_batches`` = 1 (0 stays 0),
``data.gen_eval.samples`` = one batch per rank, no loggers and no callbacks (no checkpoints, no progress bar; a
clock callback of its own), ``ckpt_path`` / ``init_from`` = null (a fresh model: the shapes are the same), and the
run directory: a temporary directory, removed afterwards (``results.json`` and ``metrics.jsonl`` of the two steps are
not kept). It prints what was compiled and cached, the time to the first optimizer step (since the command started,
and of the step itself), and the other phases; ``--json PATH`` also writes these numbers as JSON.

A sweep (``arch=llama,gla canon=AbCD``, with or without ``-m``) warms every combination, one fresh process each (so
each first-step time is that of a fresh process), and prints a table of them last.

Bad overrides: one line ``canonlm: error: ...`` on stderr and exit code 2, as ``train.py`` for a refused value
(:class:`canonlm.errors.ConfigError`); an override Hydra cannot apply (a misspelt key) is reported the same way. A run
stopped early exits with :class:`canonlm.errors.RunStopped`'s code; SIGTERM (``timeout``) exits with 143, the
temporary run directory removed.

Run it where the run will run: the same GPU type (compiled kernels and autotune choices are per GPU model), the same
devices per node (DDP / FSDP: the processes Lightning starts run the same warmup), the same kernel cache path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

_T0 = time.perf_counter()  # the command's start (this module is the first thing `python -m canonlm.warmup` runs)
CONF = Path(__file__).resolve().parents[2] / "conf"
_DIR_ENV = "CANONLM_WARMUP_DIR"  # the temporary run directory, handed to the processes Lightning starts (DDP)
STEPS = 2

# filled by StepClock in this process: perf_counter() times of the run's events
clock: dict[str, float] = {}


def _error(message: str) -> int:
    print(f"canonlm: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def compose(overrides: list[str]):
    """The config ``python train.py <overrides>`` runs (Hydra compose of ``conf/train.yaml`` with canonlm's
    resolvers; ``hydra.*`` and the run directory are not resolved here). Raises Hydra's errors for overrides it
    cannot apply."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    if not (CONF / "train.yaml").is_file():
        raise FileNotFoundError(f"no conf/train.yaml at {CONF} (run from a source checkout: pip install -e .)")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def warmup_config(cfg, run_dir: Path) -> None:
    """Turn the composed run config into its warmup (module docstring), in place: two steps, one validation and one
    test batch, one batch of generation prompts, no loggers / callbacks / checkpoints, run directory ``run_dir``."""
    from omegaconf import open_dict

    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    world = (
        devices * nodes
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (devices, nodes))
        else 1
    )
    with open_dict(cfg):
        cfg.trainer.max_steps = STEPS
        if cfg.data.get("max_tokens") is not None:
            cfg.data.max_tokens = None  # the token budget is the run's length; warmup's is its own STEPS
        cfg.trainer.val_check_interval = STEPS
        cfg.trainer.check_val_every_n_epoch = None
        for key in ("limit_val_batches", "limit_test_batches"):
            cfg.trainer[key] = 0 if cfg.trainer.get(key) in (0, 0.0) else 1
        cfg.trainer.enable_progress_bar = False
        cfg.trainer.enable_checkpointing = False
        gen = cfg.data.get("gen_eval")
        if gen is not None:
            gen.samples = int(gen.get("batch_size") or 1) * world
        cfg.logger = None
        cfg.callbacks = {"warmup_clock": {"_target_": "canonlm.warmup.StepClock"}}
        cfg.ckpt_path = None
        cfg.init_from = None
        cfg.run_name = "warmup"
        cfg.paths.output_dir = str(run_dir / "run")
        cfg.paths.log_dir = str(run_dir / "logs")


def StepClock():  # a Hydra `_target_`: builds the callback (Lightning is imported only here)
    """A Lightning callback recording ``time.perf_counter()`` of the run's events in :data:`clock`: the start of fit
    and of the first training batch, the end of each of the first optimizer steps (``step1``, ``step2``), the start
    and end of validation and test."""
    import lightning.pytorch as L

    class _StepClock(L.Callback):
        def _mark(self, name: str) -> None:
            clock.setdefault(name, time.perf_counter())

        def on_fit_start(self, trainer, pl_module):
            self._mark("fit_start")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._mark("first_batch")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= 1:
                self._mark(f"step{trainer.global_step}")

        def on_validation_start(self, trainer, pl_module):
            self._mark("val_start")

        def on_validation_end(self, trainer, pl_module):
            self._mark("val_end")

        def on_test_start(self, trainer, pl_module):
            self._mark("test_start")

        def on_test_end(self, trainer, pl_module):
            self._mark("test_end")

    return _StepClock()


def _tree(d: Optional[str]) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under ``d``."""
    out: dict[str, tuple[int, int]] = {}
    if not d or not os.path.isdir(d):
        return out
    for base, _, files in os.walk(d):
        for f in files:
            p = os.path.join(base, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out[os.path.relpath(p, d)] = (st.st_size, st.st_mtime_ns)
    return out


def _cache_dirs(root: Path) -> dict[str, str]:
    """The directories the libraries actually use (a user-set TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR wins)."""
    from canonlm.utils.kernel_cache import AUTOTUNE

    return {
        "triton": os.environ.get("TRITON_CACHE_DIR", str(root / "triton")),
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")),
        "autotune": str(root / AUTOTUNE),
    }


def _cache_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    delta = {}
    for name, files in after.items():
        old = before.get(name, {})
        new = [p for p in files if p not in old]
        rewritten = [p for p in files if p in old and files[p] != old[p]]
        delta[name] = {
            "files": len(files),
            "new": len(new),
            "rewritten": len(rewritten),
            "new_bytes": sum(files[p][0] for p in new),
        }
        if name == "triton":
            delta[name]["kernels_compiled"] = sum(os.path.basename(p).startswith("__grp__") for p in new)
            delta[name]["autotune_results_new"] = sum(p.endswith(".autotune.json") for p in new)
    return delta


def _counters() -> dict[str, int]:
    """inductor's FX graph cache and AOTAutograd cache hit / miss / bypass counts of this process (zeros when
    torch._dynamo was never imported)."""
    out = {}
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None) if utils else None
    for group, names in (
        ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
        ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
    ):
        for n in names:
            out[n] = int(counters[group][n]) if counters is not None else 0
    return out


def _since(a: str, b: str) -> Optional[float]:
    return round(clock[b] - clock[a], 2) if a in clock and b in clock else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def summary(cfg, root: Path, delta: dict, counters: dict, stats: dict, total_s: float) -> dict[str, Any]:
    """The numbers warmup reports (also ``--json``)."""
    t0 = _T0
    first = round(clock["step1"] - t0, 2) if "step1" in clock else None
    return {
        "kernel_cache": str(root),
        "cache_dirs": _cache_dirs(root),
        "compile": bool(cfg.get("compile", False)),
        "first_step_s": first,  # since the command started
        "first_step_itself_s": _since("first_batch", "step1"),  # the first optimizer step (compile included)
        "ready_s": round(clock["first_batch"] - t0, 2) if "first_batch" in clock else None,
        "second_step_s": _since("step1", "step2"),
        "validation_s": _since("val_start", "val_end"),
        "test_s": _since("test_start", "test_end"),
        "total_s": round(total_s, 2),
        "counters": counters,
        "mamba_autotune": dict(stats),
        "cache": delta,
    }


def _print_summary(s: dict[str, Any], label: str) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.1f} s"

    c, d, m = s["counters"], s["cache"], s["mamba_autotune"]
    gen = s.get("generation_prompts") or {}
    lines = [
        f"canonlm warmup: {label}",
        f"  kernel cache        {s['kernel_cache']}",
        f"  first optimizer step {fmt(s['first_step_s'])} after the command started (model and data ready at "
        f"{fmt(s['ready_s'])}; the step itself {fmt(s['first_step_itself_s'])})",
        f"  second step {fmt(s['second_step_s'])}; validation (1 batch) {fmt(s['validation_s'])}; "
        f"test (1 batch) {fmt(s['test_s'])}; total {fmt(s['total_s'])}",
        "  generation          "
        + (
            ", ".join(f"{k}: {v} prompts decoded" for k, v in gen.items() if v)
            or "none (the task is scored under teacher forcing)"
        ),
        f"  triton              {d['triton']['kernels_compiled']} kernels compiled, "
        f"{d['triton']['autotune_results_new']} new autotune results (fla); {d['triton']['files']} files in "
        f"{s['cache_dirs']['triton']}",
        f"  mamba-ssm autotune  {m['benchmarked']} benchmarked ({m['bench_s']:.1f} s), {m['restored']} restored "
        "from the cache",
        "  inductor            "
        + (
            f"FX graph cache {c['fxgraph_cache_hit']} hits, {c['fxgraph_cache_miss']} "
            f"misses, {c['fxgraph_cache_bypass']} bypassed; AOTAutograd cache "
            f"{c['autograd_cache_hit']} hits, {c['autograd_cache_miss']} misses"
            if s["compile"]
            else "compile=false (nothing to cache)"
        ),
        "  new in the cache    " + ", ".join(f"{k} +{v['new']} files ({_mb(v['new_bytes'])})" for k, v in d.items()),
    ]
    print("\n".join(lines), flush=True)


def _label(cfg) -> str:
    """One line naming the warmed config (architecture, Canon set, size, task, shapes, compile, precision,
    accelerator)."""
    try:
        canon = cfg.get("canon")
        return (
            f"arch={cfg.model.get('arch')} canon={(canon.get('set') if canon is not None else None) or 'none'} "
            f"size={cfg.model.get('size')} task={cfg.task.get('name')} context={cfg.task.get('context')} "
            f"batch={cfg.data.batch_size} compile={bool(cfg.get('compile', False))} "
            f"precision={cfg.trainer.get('precision')} accelerator={cfg.trainer.get('accelerator')}"
        )
    except Exception:  # noqa: BLE001 -- a label only
        return ""


def warm(overrides: list[str], json_path: Optional[str] = None) -> int:
    """Warm the kernel cache for one config (module docstring); returns the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException, FileNotFoundError) as e:
        return _error(e)
    from canonlm.errors import ConfigError, RunStopped
    from canonlm.train.run import launch_rank, run
    from canonlm.utils import kernel_cache

    import signal

    child = os.environ.get(_DIR_ENV)
    tmp = None
    # SIGTERM is held while the temporary directory is made and named: one that arrives in between is delivered
    # inside the ``try`` below, whose ``finally`` then knows the directory and removes it
    held = child is None and hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if held else None
    try:
        try:
            tmp = Path(child) if child else Path(tempfile.mkdtemp(prefix="canonlm-warmup-"))
            if not child:
                os.environ[_DIR_ENV] = str(tmp)
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            root = kernel_cache.configure(
                cfg.paths.get("kernel_cache"), key="paths.kernel_cache", base=cfg.paths.get("root_dir")
            )
            warmup_config(cfg, tmp)
        except ConfigError as e:
            return _error(e)
        label = _label(cfg)
        dirs = _cache_dirs(root)
        before = {k: _tree(v) for k, v in dirs.items()}
        out = io.StringIO()  # run() prints the results table of the two steps: not shown
        try:
            with contextlib.redirect_stdout(out):
                results = run(cfg)
        except ConfigError as e:
            return _error(e)
        except RunStopped as e:
            print(f"canonlm: {e}", file=sys.stderr, flush=True)
            return e.exit_code
        except BaseException:
            sys.stderr.write(out.getvalue())
            raise
        if launch_rank() != 0:
            return 0
        delta = _cache_delta(before, {k: _tree(v) for k, v in dirs.items()})
        s = summary(cfg, root, delta, _counters(), kernel_cache._stats, time.perf_counter() - _T0)
        s["overrides"], s["label"] = list(overrides), label
        s["generation_prompts"] = {
            split: (results.get(split) or {}).get("generate", {}).get("samples") for split in ("val", "test")
        }
        _print_summary(s, label)
        if json_path:
            Path(json_path).write_text(json.dumps(s, indent=1))
        return 0
    finally:
        if not child and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            os.environ.pop(_DIR_ENV, None)


def sweep(jobs: list[list[str]], json_path: Optional[str]) -> int:
    """Warm each job's config in a fresh process, in order; print a table of first-step times last."""
    rows, worst = [], 0
    for i, job in enumerate(jobs):
        fd, name = tempfile.mkstemp(prefix="canonlm-warmup-", suffix=".json")
        os.close(fd)
        out = Path(name)
        try:
            print(f"[{i + 1}/{len(jobs)}] {' '.join(job)}", flush=True)
            rc = subprocess.run([sys.executable, "-m", "canonlm.warmup", "--json", str(out), *job]).returncode
            s = json.loads(out.read_text()) if rc == 0 and out.stat().st_size else {}
        finally:
            out.unlink(missing_ok=True)
        rows.append((job, rc, s))
        worst = worst or rc
    print("\nwarmup sweep: first optimizer step since the command started (s), per config", flush=True)
    for job, rc, s in rows:
        first = s.get("first_step_s")
        print(f"  {' '.join(job):<60} " + (f"{first:8.1f}" if first is not None else f"  exit {rc}"), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps([{"overrides": j, "exit": rc, **s} for j, rc, s in rows], indent=1))
    return worst


def _exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a job's time limit) ends the command through ``SystemExit(143)``, so the temporary run
    directory is still removed; only where no handler is installed yet (the main thread of a plain process)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:

        def stop(signum, frame):
            raise SystemExit(143)

        signal.signal(signal.SIGTERM, stop)


def main(argv: Optional[list[str]] = None) -> int:
    """Parse ``[--json PATH] [-m] <overrides>`` and warm one config or each config of a sweep."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    json_path, overrides = None, []
    it = iter(argv)
    for a in it:
        if a == "--json":
            json_path = next(it, None)
            if json_path is None:
                return _error("--json needs a file path")
        elif a.startswith("--json="):
            json_path = a.split("=", 1)[1]
        elif a in ("-m", "--multirun"):
            continue
        elif a.startswith("-"):
            return _error(f"unknown option {a!r}; allowed: --json PATH, -m, and train.py's key=value overrides")
        else:
            overrides.append(a)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return _error(e)
    if any(o.is_sweep_override() for o in parsed):
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        return sweep(jobs, json_path)
    return warm(overrides, json_path)


if __name__ == "__main__":
    # one module object: Hydra's `_target_: canonlm.warmup.StepClock` must fill this module's `clock`
    sys.modules.setdefault("canonlm.warmup", sys.modules[__name__])
    _exit_on_sigterm()
    sys.exit(main())
