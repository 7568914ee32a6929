"""Training lines: ``train.py`` in a subprocess with a probe callback that records the steps, the placed backends,
the kernels that really ran and when the first optimizer step ended, judged on the run's ``metrics.jsonl`` (tokens/s,
peak memory, MFU, losses). The line's compile time is the subprocess's start-up up to the end of its first optimizer
step (imports, data, model, kernel compiles and autotuning); its check time is the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from canonlm.ops import backend_calls
from canonlm.selfcheck import models
from canonlm.selfcheck.environment import ROOT
from canonlm.selfcheck.models import MIXER_OP, required_ops, with_split
from canonlm.selfcheck import triton_hooks
from canonlm.selfcheck.verdict import (
    FAIL,
    PASS,
    Fail,
    Skip,
    add_compile_time,
    budget_reason,
    fmt_backends,
    fmt_ran,
    judge_ran,
    remaining_s,
    short,
)


def train_probe(out: str, autotune: str = "full"):
    """Lightning callback for the self-check's training runs (instantiated by Hydra from
    ``+callbacks.selfcheck._target_=canonlm.selfcheck.training.train_probe``). From the start of training it counts
    the calls of every sequence op's backends (:func:`canonlm.ops.backend_calls`; a missing entry point fails the
    run); at its end, rank 0 writes ``out`` (JSON) with the steps done, world size, the backends the model was placed
    with, ``ran`` (``{op: {backend: calls}}``), for Mamba2 ``fused_split_reason`` (None: the fused split kernel can
    run for this model, :func:`~canonlm.selfcheck.models.fused_split_reason`), the peak memory in GiB (CUDA:
    ``max_memory_allocated``; CPU: peak RSS), ``first_step_wall`` (``time.time()`` when the first optimizer step had
    finished on the device) and, with CUDA, ``kernels`` (Triton kernels built / loaded from the cache,
    :func:`~canonlm.selfcheck.triton_hooks.count_compiles`) and ``autotune`` (the mode in force, or why the
    first-config mode could not be installed).

    ``autotune="first"`` (what the self-check passes by default) installs
    :func:`~canonlm.selfcheck.triton_hooks.first_config_autotune` for the process when CUDA is available, before
    any kernel runs; ``"full"`` leaves Triton's autotuning as training has it. Raises ValueError for another value.
    """
    import lightning.pytorch as L
    import torch

    if autotune not in triton_hooks.AUTOTUNE_MODES:
        raise ValueError(f"train_probe: autotune={autotune!r}; allowed: {', '.join(triton_hooks.AUTOTUNE_MODES)}")
    mode = autotune
    if torch.cuda.is_available():
        triton_hooks.count_compiles()
        if autotune == "first":
            why = triton_hooks.install_first_config_autotune()
            mode = "first" if why is None else f"full ({why})"

    class _Probe(L.Callback):
        def __init__(self):
            self._calls = contextlib.ExitStack()
            self._ran: dict = {}
            self._first_step_wall = None

        def on_train_start(self, trainer, pl_module):
            self._ran = self._calls.enter_context(backend_calls(set(MIXER_OP.values()) | {"canon"}))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self._first_step_wall is None:
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize(pl_module.device)
                self._first_step_wall = time.time()

        def teardown(self, trainer, pl_module, stage):
            self._calls.close()

        def on_train_end(self, trainer, pl_module):
            self._calls.close()
            if not trainer.is_global_zero:
                return
            import torch

            model = pl_module.model
            dev = pl_module.device
            if dev.type == "cuda":
                peak = torch.cuda.max_memory_allocated(dev) / 2**30
            else:
                import resource

                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                peak = rss / 2**30 if sys.platform == "darwin" else rss / 2**20
            placed = getattr(model, "placement", None)
            info = {
                "steps": int(trainer.global_step),
                "world_size": int(trainer.world_size),
                "device": str(dev),
                "precision": str(trainer.precision),
                "peak_mem_gib": peak,
                "backends": dict(getattr(model, "backends", {}) or {}),
                "placed": None if placed is None else [str(placed[0]), str(placed[1])],
                "ran": self._ran,
                "first_step_wall": self._first_step_wall,
                "autotune": mode,
            }
            if dev.type == "cuda":
                info["kernels"] = triton_hooks.kernel_counts()
            if model.cfg.arch == "mamba2" and placed is not None:
                info["fused_split_reason"] = models.fused_split_reason(model, *placed)
            from canonlm.utils.io import atomic_write_text

            atomic_write_text(out, json.dumps(info))

    return _Probe()


#: Child processes running now, so that a worker told to stop can stop them too.
_children: set = set()


def run_child(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)``, except that on the timeout the
    child is killed and TimeoutExpired raised without reading its pipes to the end (train.py's data-loader workers,
    its children, may hold them open; they are in the worker's process group, which the self-check stops at its
    deadline). While it runs the child is in :data:`_children` (:func:`kill_children`)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    _children.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    finally:
        _children.discard(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_children() -> None:
    """Kill every child :func:`run_child` is waiting for (a worker stopped at the deadline)."""
    for p in list(_children):
        try:
            p.kill()
        except OSError:
            pass


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


@dataclasses.dataclass
class TrainSpec:
    """One training line: what to run and what it must show. ``autotune``: the probe's mode (:func:`train_probe`)."""

    label: str
    arch: str
    canon: str
    overrides: list
    steps: int
    world: int
    device: str  # "cuda" | "cpu"
    timeout: float
    autotune: str = "full"


def training_line(spec: dict, workdir: str) -> tuple[str, str]:
    """:func:`run_training` for a :class:`TrainSpec` given as a dict (the self-check's plans are JSON); on a CUDA
    ``spec["device"]`` CUDA must be available (else Skip ``no CUDA``)."""
    from canonlm.selfcheck.environment import need_cuda

    s = TrainSpec(**spec)
    need_cuda(s.device)
    return run_training(s, Path(workdir))


def fsdp2_line(
    label: str, arch: str, canon: str, size: str, steps: int, batch: int, autotune: str, workdir: str
) -> tuple[str, str]:
    """``train.py`` with ``strategy=fsdp2`` across all visible GPUs (fp32 weights, ``trainer.precision=32-true``);
    Skip with fewer than two GPUs or without CUDA."""
    import torch

    from canonlm.selfcheck.environment import need_cuda

    need_cuda("cuda")
    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"needs >= 2 GPUs ({n} visible)")
    over = [
        f"model.size={size}",
        "task=depo1",
        "trainer=gpu",
        f"trainer.devices={n}",
        "trainer.precision=32-true",
        "strategy=fsdp2",
        "trainer.log_every_n_steps=5",
        f"data.batch_size={batch * n}",
    ]
    return run_training(TrainSpec(label, arch, canon, over, steps, n, "cuda", 1800, autotune), Path(workdir))


def run_training(spec: TrainSpec, workdir: Path) -> tuple[str, str]:
    """Run ``train.py`` for ``spec`` in a subprocess (``logger=none``, ``callbacks=none`` plus :func:`train_probe`,
    no validation or test) and judge it with :func:`judge_training`; on CUDA every op must run its fast path when
    its library is installed (:func:`~canonlm.selfcheck.models.expected_fast`).

    The subprocess's start-up up to the end of its first optimizer step (the probe's ``first_step_wall``) is added to
    the line's compile time (:func:`~canonlm.selfcheck.verdict.add_compile_time`), with the Triton kernels it built
    and loaded. The run may last ``spec.timeout`` seconds, or until the self-check's deadline
    (:func:`~canonlm.selfcheck.verdict.remaining_s`) if that comes first.

    Raises Skip without a checkout's ``train.py`` and when the deadline stopped the run (the budget's reason), Fail
    when the run exits non-zero or exceeds ``spec.timeout`` (the last output lines and the run directory in the
    message)."""
    train_py = ROOT / "train.py"
    if not train_py.is_file() or not (ROOT / "conf").is_dir():
        raise Skip(f"no train.py / conf/ at {ROOT} (run from a source checkout: pip install -e .)")
    name = spec.label.replace(" ", "_").replace("=", "-").replace("/", "-")
    probe = workdir / f"{name}.probe.json"
    cmd = [
        sys.executable,
        str(train_py),
        f"arch={spec.arch}",
        f"canon={spec.canon}",
        *spec.overrides,
        f"trainer.max_steps={spec.steps}",
        "trainer.limit_val_batches=0",
        "test=false",
        "logger=none",
        "callbacks=none",
        f"+callbacks.selfcheck._target_={__name__}.train_probe",
        f"+callbacks.selfcheck.out={probe}",
        f"+callbacks.selfcheck.autotune={spec.autotune}",
        f"paths.log_dir={workdir}",
        f"run_name={name}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    left = remaining_s()
    timeout, by_budget = float(spec.timeout), False
    if left is not None and left < timeout:
        timeout, by_budget = max(0.5, left), True
    t_launch = time.time()
    try:
        p = run_child(cmd, timeout=timeout, cwd=str(workdir), env=env)
    except subprocess.TimeoutExpired:
        add_compile_time(time.time() - t_launch)  # it never got past its start-up as far as this line can tell
        if by_budget:
            raise Skip(budget_reason(time.time() - t_launch)) from None
        raise Fail(f"train.py did not finish within {spec.timeout:.0f} s") from None
    t_end = time.time()
    run_dir = workdir / "train" / "runs" / name
    info = json.loads(probe.read_text()) if probe.is_file() else {}
    first = info.get("first_step_wall")
    kernels = info.get("kernels") or {}
    add_compile_time(
        (first - t_launch) if isinstance(first, (int, float)) and t_launch <= first <= t_end else t_end - t_launch,
        kernels.get("built", 0),
        kernels.get("loaded", 0),
    )
    if p.returncode != 0:
        tail = [ln for ln in (p.stderr + "\n" + p.stdout).splitlines() if ln.strip()][-3:]
        raise Fail(f"train.py exit {p.returncode}: {short(' / '.join(tail), 400)} (run dir {run_dir})")
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    want, why = None, None
    if spec.device == "cuda":
        import torch

        try:
            want = models.expected_fast(spec.arch, torch.bfloat16)
        except Skip as e:
            want, why = {}, str(e)
    status, detail = judge_training(spec, rows, info, want)
    if why is not None:
        detail += f" (no fast {MIXER_OP[spec.arch]} kernel: {why})"
    if spec.device == "cuda":
        detail += f"; autotune {info.get('autotune', spec.autotune)}" + (
            ": throughput not a benchmark" if str(info.get("autotune", "")) == "first" else ""
        )
    if status == FAIL:
        detail += f" (run dir {run_dir})"
    return status, detail


def judge_training(spec: TrainSpec, rows: list[dict], info: dict, want: Optional[dict]) -> tuple[str, str]:
    """Verdict of a finished training run.

    Args:
        spec: what was run. rows: the run's ``metrics.jsonl`` rows. info: what :func:`train_probe` wrote (steps,
            world_size, backends the model was placed with, ``ran`` = ``{op: {backend: calls}}`` observed during
            training, ``fused_split_reason`` for Mamba2, peak memory). want: ``{op: fast backend}`` that must have
            run (None: no requirement, e.g. on the CPU); Mamba2's ``mamba_ssm`` becomes the fused ``split`` when
            ``fused_split_reason`` is None.
    Returns:
        ``(PASS | FAIL, detail)``: FAIL when fewer steps ran than asked, a loss is missing or not finite, the world
        size differs, or (with ``want``) the calls were not recorded, an op ran anything but its wanted fast backend
        (a reference fallback, or Mamba2's unfused path where the fused one can run), or a required op
        (:func:`~canonlm.selfcheck.models.required_ops`) did not run. The detail gives tokens/s (median of the
        ``perf/tokens_per_s`` rows after the first), peak memory (GiB; the larger of the ``perf/peak_mem_gb`` rows and
        the probe), MFU (median ``perf/mfu``), the first and last loss, the placed backends and the calls.
    """
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    if info.get("steps") != spec.steps:
        return FAIL, f"{info.get('steps')} optimizer steps done, {spec.steps} asked"
    if not losses or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        return FAIL, f"non-finite or missing train/loss in metrics.jsonl: {losses[:5]}"
    if spec.world and info.get("world_size") != spec.world:
        return FAIL, f"world size {info.get('world_size')}, expected {spec.world}"
    tps = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]
    mfu = [r["perf/mfu"] for r in rows if "perf/mfu" in r]
    mem = [r["perf/peak_mem_gb"] for r in rows if "perf/peak_mem_gb" in r]
    mem += [info["peak_mem_gib"]] if isinstance(info.get("peak_mem_gib"), (int, float)) else []
    tok_s = _median(tps[1:] or tps)
    backends = info.get("backends") or {}
    ran = info.get("ran")
    parts = [
        f"tokens/s {tok_s:,.0f}" if tok_s else "tokens/s n/a (no perf/tokens_per_s rows)",
        f"peak mem {max(mem):.2f} GiB" if mem else "peak mem n/a",
        f"MFU {100 * _median(mfu[1:] or mfu):.1f}%"
        if mfu
        else ("MFU n/a (GPU not in the peak-FLOPs table)" if spec.device == "cuda" else "MFU n/a (CPU)"),
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        f"ops {fmt_backends(backends)}" if backends else "ops ?",
        f"ran {fmt_ran(ran)}" if ran is not None else "ran ? (not recorded)",
    ]
    detail = "; ".join(parts)
    if want:
        if ran is None:
            return FAIL, f"the probe recorded no kernel calls; {detail}"
        split = info.get("fused_split_reason", "not recorded")
        bad = judge_ran(with_split(want, split), ran, required_ops(spec.arch, spec.canon))
        if bad:
            return FAIL, f"{bad}; {detail}"
    return PASS, detail
