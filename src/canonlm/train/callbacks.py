"""Callbacks: progress that works in a terminal and in batch logs; SLURM preemption."""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar

from canonlm.config.rules import check_value


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    h, m, sec = s // 3600, (s % 3600) // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def _fmt(v: Any) -> str:
    v = float(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


class LineProgress(ProgressBar):
    """One plain line per ``every`` optimizer steps (and one per validation), for SLURM / CI logs.

    Line: ``[step 250/1500  17%] train/loss 1.23 | perf/tokens_per_s 1.5e+04 | ... | 1m02s elapsed, eta 5m10s``.
    A validation or test pass that runs longer than ``eval_every_s`` seconds also prints a line every
    ``eval_every_s`` seconds: ``[test] batch 120/500  24% | 1m02s elapsed, eta 3m16s`` (a paper-scale Capo test
    scores every person and runs for minutes; on a cluster silence looks like a hung job).
    """

    def __init__(self, every: int | None = None, eval_every_s: float = 30.0):
        super().__init__()
        self._enabled = True
        self.every = every
        self.eval_every_s = float(eval_every_s)
        self._t0: float | None = None
        self._last = -1
        self._eval_t0: float | None = None
        self._eval_last = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, msg: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(msg, flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        every = self.every or max(trainer.log_every_n_steps, 1)
        if step == self._last or (step % every and step != trainer.max_steps):
            return
        self._last = step
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        done = max(step - self._start_step, 1)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        eta = elapsed / done * (total - step) if total else 0.0
        metrics = self.get_metrics(trainer, pl_module)
        keys = [k for k in metrics if k.startswith(("train/", "perf/tokens_per_s"))]
        parts = " | ".join(f"{k} {_fmt(metrics[k])}" for k in keys if k != "v_num")
        pct = f"{100 * step / total:3.0f}%" if total else ""
        self._print(f"[step {step}/{total or '?'} {pct}] {parts} | {_fmt_time(elapsed)} elapsed, eta {_fmt_time(eta)}")

    def _eval_line(self, trainer, pl_module, split: str) -> None:
        res = getattr(pl_module, "results", {}).get(split)
        if not res:
            return
        g = res.get("group_name", "group")
        parts = [f"loss {res['loss']:.4f}"]
        if res["overall"]["answers"]:
            accs = " ".join(f"{g}={k}:{100 * row['acc']:.1f}%" for k, row in res["by_group"].items())
            parts.append(f"exact acc {accs} | overall {100 * res['overall']['acc']:.1f}%")
        gen = res.get("generate")
        if gen is not None:
            accs = " ".join(f"{g}={k}:{100 * row['acc']:.1f}%" for k, row in gen["by_group"].items())
            extra = "".join(f" | {k} {v:.4g}" for k, v in gen.items() if k not in ("by_group", "samples", "acc"))
            parts.append(f"generation acc {100 * gen['acc']:.1f}% ({gen['samples']} samples; {accs}){extra}")
        for k, v in (res.get("task_metrics") or {}).items():
            parts.append(f"{k} {v:.4g}")
        self._print(f"[{split} @ step {trainer.global_step}] " + " | ".join(parts))

    def _eval_start(self) -> None:
        self._eval_t0 = self._eval_last = time.perf_counter()

    def _eval_batch(self, trainer, split: str, batch_idx: int, dataloader_idx: int) -> None:
        now = time.perf_counter()
        if self._eval_t0 is None or now - self._eval_last < self.eval_every_s:
            return
        self._eval_last = now
        totals = trainer.num_val_batches if split == "val" else trainer.num_test_batches
        total = totals[dataloader_idx] if dataloader_idx < len(totals) else float("inf")
        done = batch_idx + 1
        elapsed = now - self._eval_t0
        if total != float("inf") and total > 0:
            eta = elapsed / done * (total - done)
            self._print(
                f"[{split}] batch {done}/{int(total)} {100 * done / total:3.0f}% | "
                f"{_fmt_time(elapsed)} elapsed, eta {_fmt_time(eta)}"
            )
        else:
            self._print(f"[{split}] batch {done} | {_fmt_time(elapsed)} elapsed")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._eval_start()

    def on_test_start(self, trainer, pl_module) -> None:
        self._eval_start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._eval_batch(trainer, "val", batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch(trainer, "test", batch_idx, dataloader_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._eval_line(trainer, pl_module, "val")

    def on_test_end(self, trainer, pl_module) -> None:
        self._eval_line(trainer, pl_module, "test")


def Progress(refresh_rate: int | None = None, force: str | None = None, eval_every_s: float = 30.0) -> ProgressBar:
    """Progress callback: a tqdm bar on an interactive terminal (with validation and test bars), :class:`LineProgress`
    otherwise.

    ``force``: ``"bar"`` or ``"lines"`` to override the TTY detection. ``refresh_rate``: bar refresh (steps).
    ``eval_every_s``: seconds between progress lines of a long validation or test pass (lines mode).
    """
    use_bar = sys.stdout.isatty() if force is None else force == "bar"
    if use_bar:
        return TQDMProgressBar(refresh_rate=refresh_rate or 1)
    return LineProgress(every=refresh_rate, eval_every_s=eval_every_s)


# Preemption outcomes, in order of precedence when ranks disagree (the max wins).
NONE, TERMINATED, REQUEUED = 0, 1, 2


class Preemption(Callback):
    """Save at a step boundary when the job is told to stop, on every rank together (engineering practice of
    lingua: the signal handler only sets a flag; saving inside a handler can hang a collective or corrupt a file).

    Two signals are handled from the start of training (installed in ``on_train_start``, after Lightning's own
    handlers, which they replace for the duration of ``fit``; restored at its end):

    * the SLURM warning signal ``signal_name`` (``#SBATCH --signal=USR2@120``; slurm/launch.py's ``--signal``):
      save ``<checkpoints>/last.ckpt``, rank 0 runs ``scontrol requeue $SLURM_JOB_ID``, stop. Only under SLURM;
    * ``SIGTERM`` (what SLURM sends before ``scontrol requeue``, ``scancel`` or a node drain kills the job, and
      ``kill <pid>`` anywhere): save ``last.ckpt`` and stop, without requeueing (SLURM requeues by itself when
      that was the reason). SLURM's ``KillWait`` (30 s by default) is the time left for the save.

    The flag is reduced (max) over the ranks at every step end, so all ranks save the same step. The reduction runs on
    a CPU (gloo) process group made at the start of training, so it never waits for the GPU: no host-device sync
    per step on NCCL runs. After the save
    ``outcome`` is ``REQUEUED`` or ``TERMINATED`` (``NONE`` otherwise), ``saved`` the checkpoint path, and
    :class:`canonlm.errors.RunStopped` is raised out of ``fit`` (no validation, test or ``results.json``; exit
    code 0 after a self-requeue, 143 after SIGTERM); the next start with ``ckpt_path=auto`` (or a Hydra multirun
    job, which resumes by itself) continues from that step.

    Args: signal_name: ``"SIGUSR2"`` (submitit's default; NCCL may use USR1); requeue: run ``scontrol requeue``
    on the warning signal; sigterm: also save on SIGTERM. Raises ConfigError for a ``signal_name`` its rule in
    :data:`canonlm.config.rules.TRAINING_RULES` refuses (not a catchable signal, or SIGTERM).
    """

    def __init__(self, signal_name: str = "SIGUSR2", requeue: bool = True, sigterm: bool = True):
        super().__init__()
        self.signal_name = check_value("callbacks.preemption.signal_name", signal_name)
        self.requeue = requeue
        self.sigterm = sigterm
        self._got = NONE
        self._previous: dict[int, object] = {}
        self._group = None  # CPU (gloo) process group for the per-step flag reduction, when distributed
        self.outcome = NONE
        self.saved: str | None = None
        self.step: int | None = None

    def _install(self, signum: int, code: int) -> None:
        import signal

        def handler(s, frame, code=code):
            self._got = max(self._got, code)

        self._previous[signum] = signal.getsignal(signum)
        signal.signal(signum, handler)

    def on_train_start(self, trainer, pl_module) -> None:
        import os
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        import torch.distributed as dist

        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized() and self._group is None:
            # every rank reaches on_train_start: a collective call, as new_group requires
            self._group = dist.new_group(backend="gloo")
        if os.environ.get("SLURM_JOB_ID"):
            self._install(getattr(signal, self.signal_name), REQUEUED)
        if self.sigterm:
            self._install(signal.SIGTERM, TERMINATED)

    def _restore(self) -> None:
        import signal

        for signum, h in self._previous.items():
            signal.signal(signum, h if h is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        """After a preemption stop the process is on its way out: SLURM's SIGTERM (which follows our own
        ``scontrol requeue``) must not reach Lightning's handler, which broadcasts to ranks that may have exited
        already. Keep flag-only handlers; restore the previous ones after any other exception."""
        if self.outcome == NONE:
            self._restore()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import os
        import subprocess

        import torch

        if not self._previous:
            return
        code = self._got
        if trainer.world_size > 1:
            flag = torch.tensor([code], dtype=torch.int64)  # on the CPU: no wait for the GPU's queue
            if self._group is not None:
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
            else:
                flag = trainer.strategy.reduce(flag.to(pl_module.device), reduce_op="max")
            code = int(flag.item())
        if code == NONE:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        self.saved, self.step = path, trainer.global_step
        self.outcome = code
        job = os.environ.get("SLURM_JOB_ID")
        if code == REQUEUED and self.requeue and job and trainer.is_global_zero:
            array = os.environ.get("SLURM_ARRAY_JOB_ID")
            job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else job
            r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            what = (
                f"requeued job {job}"
                if r.returncode == 0
                else f"could not requeue job {job} (scontrol: {(r.stderr or r.stdout).strip()})"
            )
        else:
            what = "stopping (SIGTERM)" if code == TERMINATED else "stopping"
        if trainer.is_global_zero:
            print(f"[preemption] saved {path} at step {trainer.global_step}; {what}", flush=True)
        from canonlm.errors import RunStopped

        how = "requeued itself" if code == REQUEUED else "was terminated (SIGTERM)"
        raise RunStopped(
            f"preempted: the job {how}; saved {path} at step {trainer.global_step}; the next start "
            "with ckpt_path=auto resumes from it",
            0 if code == REQUEUED else 143,
        )


def last_checkpoint_path(trainer) -> str:
    """``<checkpoint callback dirpath>/last.ckpt``, or ``<default_root_dir>/checkpoints/last.ckpt`` without one."""
    import os

    ckpt_dir = None
    for cb in trainer.checkpoint_callbacks:
        ckpt_dir = getattr(cb, "dirpath", None) or ckpt_dir
    return os.path.join(ckpt_dir or os.path.join(trainer.default_root_dir, "checkpoints"), "last.ckpt")


def StepCheckpoint(
    dirpath: str,
    every_n_train_steps: int = 500,
    keep_last: int | None = None,
    filename: str = "step{step:07d}",
    save_last: bool = True,
    **kwargs,
):
    """Lightning ``ModelCheckpoint`` every ``every_n_train_steps`` optimizer steps plus ``last.ckpt``.

    ``keep_last``: keep only the N newest step checkpoints (``save_top_k=N`` ranked by the step; ``last.ckpt`` is
    always kept); ``None`` keeps all. Existing names are replaced, never versioned (``last-v1.ckpt``). Raises
    :class:`canonlm.errors.ConfigError` for a value its rule in :data:`canonlm.config.rules.TRAINING_RULES` refuses
    (not a positive integer)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    check_value("callbacks.checkpoint.keep_last", keep_last)
    check_value("callbacks.checkpoint.every_n_train_steps", every_n_train_steps)
    top = {"save_top_k": -1} if keep_last is None else {"save_top_k": keep_last, "monitor": "step", "mode": "max"}
    # enable_version_counter=False: a name that exists (a resumed run's last.ckpt, a step redone after a requeue) is
    # replaced atomically, never turned into last-v1.ckpt beside it
    return ModelCheckpoint(
        dirpath=dirpath,
        filename=filename,
        every_n_train_steps=every_n_train_steps,
        save_last=save_last,
        auto_insert_metric_name=False,
        enable_version_counter=False,
        **top,
        **kwargs,
    )
