"""LightningModule for causal-LM pretraining on masked synthetic streams.

Loss (paper App. A): next-token cross-entropy (fp32) on the tokens whose ``loss_mask`` is set,
normalised by the number of loss tokens summed over all data-parallel ranks, optional z-loss.
Validation/test: teacher-forced argmax predictions scored per answer (whole-answer exact match) and per answer
token, grouped by the task's metric group (Depo: hop count k), reduced across ranks, plus the per-group summed NLL
of the scored tokens (Capo's bits). Tasks with an ``evaluate`` hook (Brevo, Lano: generation accuracy; Lano: KL) are
also evaluated by generation at the end of each validation and test pass, and ``finalize_metrics`` (Capo: bits per
parameter) turns the tables into the task's headline numbers (paper App. A; Capo: Part 3.3 Def. 4.3).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable, Mapping

import lightning.pytorch as L
import torch
import torch.distributed as dist

from canonlm.arch.config import ModelConfig
from canonlm.arch.loss import lm_loss
from canonlm.arch.model import CanonLM, compute_dtype_for
import numpy as np
import torch.nn.functional as F

from canonlm.data.lm import LanguageModel
from canonlm.data.metrics import score_answers
from canonlm.train.schedule import lr_multiplier

log = logging.getLogger("canonlm")

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s of one device, for MFU (tokens/s is the primary metric), keyed
# by the exact name torch.cuda.get_device_name reports. Values: torchtitan's get_peak_flops (torchtitan/tools/utils.py)
# and NVIDIA's data sheets, which quote the sparse figure (twice these); docs/mfu.md lists the sources. Names are
# matched exactly, never as substrings: "NVIDIA L40" is a prefix of "NVIDIA L40S" (twice the peak) and "NVIDIA H200"
# of "NVIDIA H200 NVL" (835, not 989 TFLOP/s); a MIG slice ("... MIG 1g.10gb") or an unlisted part gets no MFU.
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA B200": 2.25e15,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12,  # with fp32 accumulation (what PyTorch's bf16 matmuls use)
}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat`` field 22, the start time in clock ticks since
    boot, against ``/proc/uptime``), or None where that cannot be read."""
    import os

    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s (FLOP per second) of the CUDA device called ``name``, exactly as
    ``torch.cuda.get_device_name`` reports it (e.g. ``"NVIDIA H100 80GB HBM3"``), from :data:`PEAK_FLOPS`; None for
    a name that is not in the table (no MFU rather than a wrong one)."""
    return PEAK_FLOPS.get(name.strip())


def _peak_flops(device: torch.device) -> float | None:
    """:func:`peak_flops` of a torch device's name, or None (CPU, unknown device)."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def _peak_mem_gb(device: torch.device) -> float:
    """Peak memory of this process in GiB (2**30 bytes): ``torch.cuda.max_memory_allocated`` on CUDA, else the
    peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # POSIX only

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


class LMModule(L.LightningModule):
    """Causal LM training/evaluation around :class:`canonlm.arch.model.CanonLM` (Llama, GLA, GDN or Mamba2 with
    Canon layers).

    Args:
        model_cfg: validated model config (vocab size and max length already set from the task).
        optimizer: a partial ``torch.optim`` constructor (Hydra ``_partial_``) taking the parameter groups.
        sched: schedule config for :func:`canonlm.train.schedule.lr_multiplier`.
        total_steps: optimizer steps of the whole run (``trainer.max_steps``).
        loss: ``{"z_loss": none|lingua|palm, "z_coef": float}``.
        num_groups / group_name: metric groups of the task (Depo: k = 0..K, name "k").
        compile / activation_checkpointing / fsdp: applied in :meth:`configure_model` in torchtitan's order
            (activation checkpointing inside each block, then per-block ``compile()`` -- which traces the checkpoint
            and so the recompute -- then ``fully_shard``).
        task: the task object (optional): its ``evaluate`` / ``eval_samples`` / ``finalize_metrics`` hooks are used.
        gen_eval: ``{"samples": int | None (None = task.eval_samples(split)), "batch_size": int, "on_val": bool}``.
        task_cfg: the task's config dict, stored in every checkpoint (with the model config) so that a resume
            with another task or model is refused (:func:`canonlm.train.checkpoint.check_compatible`).
        max_nonfinite_steps: a step whose loss or gradient norm is not finite is skipped (no parameter or
            optimizer-state update) and counted (``train/nonfinite_steps``); this many in a row stop the run with
            ``last.ckpt`` saved (:class:`canonlm.errors.RunStopped`, exit code 3). The decision stays on the device
            (:meth:`configure_gradient_clipping`), so a run of skipped steps is noticed at the next logging step.
    Host syncs: the training step keeps its loss, gradient norm and skip flags on the device; they are read in one
    copy every ``trainer.log_every_n_steps`` optimizer steps (and at the last step, a checkpoint and the end of
    ``fit``), where the ``train/*`` and ``perf/*`` metrics are logged. With an optimizer that skips a step on the
    device (torch's ``found_inf``: ``torch.optim.AdamW``, ``Adam`` or ``SGD`` with ``fused=True``) nothing else waits
    for the device between logging steps; any other optimizer needs one host sync per step to skip one.
    Training time (``train_time_s``), attempts (fit starts) and the skipped-step count are kept in the checkpoint
    and accumulate across resumes.
    Batches are dicts of (B, T) tensors: ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` int32, ``group`` int32;
    a text mixture's also carry ``source`` int64 (B,), from which validation / test log ``{split}/<source>/loss``
    and ``/ppl`` (each source's own split), and ``train/tokens/<source>`` is logged at the logging steps.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        optimizer: Callable[..., torch.optim.Optimizer],
        sched: Mapping[str, Any],
        total_steps: int,
        loss: Mapping[str, Any],
        num_groups: int,
        group_name: str = "group",
        compile: bool = False,
        activation_checkpointing: bool = False,
        fsdp: Mapping[str, Any] | None = None,
        task: Any = None,
        gen_eval: Mapping[str, Any] | None = None,
        task_cfg: Mapping[str, Any] | None = None,
        max_nonfinite_steps: int = 5,
    ):
        super().__init__()
        self.task_cfg = dict(task_cfg or {})
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.nonfinite_steps = 0  # skipped steps, whole run (all attempts), as of the last read
        self._nonfinite_run = 0  # skipped steps in a row, as of the last read
        self._loss_bad: torch.Tensor | None = None  # device bool: a micro-batch loss of this step was not finite
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, device bool "skipped") not read yet
        self._step_stats: torch.Tensor | None = None  # device (3,): last micro-batch's loss, nll, loss tokens
        self._grad_norm: torch.Tensor | None = None  # device 0-d: last step's gradient norm before clipping
        self._seq_len = 0
        self.stop_reason: str | None = None
        self.train_time_prior = 0.0  # seconds of training in earlier attempts (from the checkpoint)
        self.attempts = 0
        self._fit_t0: float | None = None
        self._fit_time = 0.0
        self.first_step_s: float | None = None  # seconds to the first optimizer step of this fit (perf/first_step_s)
        self._fit_step0 = 0  # global_step when this fit started
        self.task = task
        self.gen_eval = {"samples": None, "batch_size": 64, "on_val": True, **dict(gen_eval or {})}
        self.model = CanonLM(model_cfg)
        self.optimizer_factory = optimizer
        self.sched = dict(sched)
        self.total_steps = int(total_steps)
        self.loss_cfg = dict(loss)
        self.num_groups = int(num_groups)
        self.group_name = group_name
        self.compile_blocks = bool(compile)
        self._loss_fn: Callable = lm_loss  # torch.compile(lm_loss) once configure_model has compiled the blocks
        self.activation_checkpointing = bool(activation_checkpointing)
        self.fsdp = dict(fsdp) if fsdp else None
        self._configured = False
        self._counts: dict[str, dict[str, torch.Tensor]] = {}
        self._loss_sums: dict[str, torch.Tensor] = {}
        self._t_last: float | None = None  # start of the perf clock's current interval (None: not started)
        self._step_last = 0
        self._paused_at: float | None = None  # perf clock paused (validation, a checkpoint write) since then
        self._excluded_s = 0.0  # seconds of pauses inside the current interval
        self._t_batch_end: float | None = None  # end of the previous on_train_batch_end (data-wait clock)
        self._wait_sum = 0.0  # seconds waited for batches since the last perf log
        self.tokens_per_step = 0  # set by the run from the data config (global windows x window length)
        self.windows_per_step = 0  # set by the run: global windows per optimizer step (data.batch_size)
        self._source_sums: dict[str, torch.Tensor] = {}  # split -> float64 (sources, 2): nll sum, loss tokens
        self.results: dict[str, Any] = {}

    # ------------------------------------------------------------------ model setup
    def compute_dtype(self, trainer: L.Trainer | None = None) -> torch.dtype:
        """The dtype the model's kernels compute in under ``trainer`` (default: the attached one): bf16 when the
        trainer precision says bf16 or FSDP2 casts the parameters to bf16 (``strategy.param_dtype``), fp16 for
        ``16-mixed``, else fp32 (:func:`canonlm.arch.model.compute_dtype_for`, the rule ``prepare_run`` checks
        before the run)."""
        trainer = trainer if trainer is not None else self._trainer
        prec = str(trainer.precision) if trainer is not None else "32-true"
        fsdp_dtype = self.fsdp.get("param_dtype", "bf16") if self.fsdp is not None else None
        return compute_dtype_for(prec, fsdp_dtype)

    def place_model(self, trainer: L.Trainer | None = None) -> dict[str, str]:
        """Resolve the model's op backends for where ``trainer`` (default: the attached one) runs it (the strategy's
        root device, which the model is moved to right after :meth:`configure_model`) and :meth:`compute_dtype`:
        ``CanonLM.place``. The run calls it once before ``fit`` to print and record the choice
        (``CanonLM.backend_report``); :meth:`configure_model` calls it again (the same answer). Returns the
        concrete backends; raises ConfigError (a pinned kernel or ``ops=fused`` that cannot run there) before any
        training or evaluation step."""
        trainer = trainer if trainer is not None else self._trainer
        device = trainer.strategy.root_device if trainer is not None else self.device
        return self.model.place(device, self.compute_dtype(trainer), compiled=self.compile_blocks)

    def configure_model(self) -> None:
        """Place the model (:meth:`place_model`), then activation checkpointing (inside each block), per-block
        ``compile()`` (:meth:`CanonLM.compile_blocks`; the compiled block contains the checkpoint, so the compiler
        sees the recompute; the loss is compiled too, as torchtitan compiles its loss) and FSDP2 ``fully_shard``
        (torchtitan's order). Runs once per module (Lightning calls it for fit, validate and test)."""
        if self._configured:
            return
        self.place_model()
        self._configured = True
        if self.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        if self.compile_blocks:  # each block, and the loss (fp32 upcast, logsumexp, gather: one fused kernel)
            self.model.compile_blocks()
            self._loss_fn = torch.compile(lm_loss)
        if self.fsdp is not None and getattr(self, "device_mesh", None) is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
            mp = MixedPrecisionPolicy(
                param_dtype=dtypes[self.fsdp.get("param_dtype", "bf16")],
                reduce_dtype=dtypes[self.fsdp.get("reduce_dtype", "fp32")],
            )
            mesh = self.device_mesh["data_parallel"]
            reshard = bool(self.fsdp.get("reshard_after_forward", True))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
            fully_shard(self.model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of ``tokens`` (B, T); ``doc_ids`` (B, T) int, each token's document within its row
        (``task.doc_mask=true``: no token sees another document, :meth:`canonlm.arch.model.CanonLM.forward`)."""
        return self.model(tokens, doc_ids=doc_ids)

    # ------------------------------------------------------------------ loss
    def _global_sum(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            x = x.detach().clone()
            dist.all_reduce(x)
        return x

    def _loss(self, batch: Mapping[str, torch.Tensor]):
        tokens = batch["tokens"]
        doc_ids = batch.get("doc_ids")  # only with task.doc_mask=true (canonlm.data.text)
        logits = self.model(tokens, doc_ids=doc_ids)
        out = self._loss_fn(
            logits[:, :-1],
            tokens[:, 1:],
            batch["loss_mask"][:, 1:],
            z_loss=self.loss_cfg.get("z_loss", "none"),
            z_coef=float(self.loss_cfg.get("z_coef", 1e-4)),
        )
        return logits, out

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Loss of one micro-batch, scaled so that the optimizer step's gradient is
        ``sum over micro-batches and ranks of loss_sum / (loss tokens of the whole step on all ranks)``:
        Lightning divides by ``accumulate_grad_batches`` and DDP/FSDP average over ranks, so the returned value is
        ``loss_sum * world * accumulate / n_step`` with ``n_step`` = all-reduced ``batch["step_loss_tokens"]``
        (the global per-token mean). Keeps on the device (read at logging steps, :meth:`_read_device`) this
        micro-batch's mean loss / nll over its loss tokens (all ranks), its loss-token count, and whether the loss
        is finite."""
        _, out = self._loss(batch)
        world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
        n_local = batch.get("step_loss_tokens", out["n_tokens"]).to(self.device, torch.float32)
        # one collective for the step's token count and the logged sums: [n_step, n_micro, nll_sum, loss_sum]
        sums = self._global_sum(
            torch.stack(
                [
                    n_local,
                    out["n_tokens"].detach().float(),
                    out["nll_sum"].detach().float(),
                    out["loss_sum"].detach().float(),
                ]
            )
        )
        n_step, n_micro = sums[0].clamp_min(1.0), sums[1].clamp_min(1.0)
        loss = out["loss_sum"] * (world * accumulate / n_step)
        bad = ~torch.isfinite(sums[3])  # all-reduced: every rank takes the same decision
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        self._step_stats = torch.stack([sums[3] / n_micro, sums[2] / n_micro, n_micro])
        self._seq_len = int(batch["tokens"].shape[1])
        return loss

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Once per optimizer step, after backward and ``on_before_optimizer_step`` (Lightning calls this hook instead
        of clipping itself, ``Precision._clip_gradients``), without waiting for the device:

        1. clipping to ``trainer.gradient_clip_val`` with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
           gradients; its returned total norm (before clipping) is the step's only gradient norm (a DTensor's
           ``full_tensor`` under FSDP2; DDP gradients are already averaged, so every rank decides alike). Without
           norm clipping (``gradient_clip_val`` null or 0, or ``gradient_clip_algorithm=value``, which then clips
           with ``clip_grad_value_``) the same call with ``max_norm=inf`` measures the norm. Under ``16-mixed`` with
           an optimizer that unscales itself the gradients are unscaled first (``GradScaler.unscale_``; Lightning
           leaves it to the optimizer);
        2. a step whose norm or micro-batch loss is not finite is skipped: the flag goes to the optimizer as
           torch's ``found_inf`` (``fused=True`` AdamW / Adam / SGD then leave parameters, moments and step count
           untouched on the device; under a GradScaler its own ``found_inf``, set from the same non-finite
           gradients, decides);
           other optimizers get their gradients set to None, which needs the flag on the host (one sync);
        3. the flag is queued for :meth:`_read_device`; at a logging step (every ``log_every_n_steps`` and the last
           step) the queued values are read and logged (:meth:`_log_interval`)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        skips_on_device = getattr(optimizer, "_step_supports_amp_scaling", False)
        if scaler is not None and skips_on_device:
            scaler.unscale_(optimizer)  # MixedPrecision.optimizer_step leaves it to such optimizers
        by_value = gradient_clip_algorithm == "value"
        max_norm = gradient_clip_val if gradient_clip_val and not by_value else math.inf  # inf: the norm only
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # the total norm of the clipping itself
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of the shards' partial norms
            norm = norm.full_tensor()
        if gradient_clip_val and by_value:
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        bad = ~torch.isfinite(norm)
        if self._loss_bad is not None:
            bad = bad | self._loss_bad
        self._loss_bad = None
        if not skips_on_device:
            if bool(bad):  # host sync: these optimizers skip a parameter only when its gradient is None
                for p in params:
                    p.grad = None
        elif scaler is None:
            optimizer.found_inf = bad.float()  # read by the optimizer step that follows (0-d, as GradScaler's)
        step = self.trainer.global_step + 1  # the step being completed
        self._pending.append((step, bad))
        self._grad_norm = norm
        max_steps = self.trainer.max_steps
        if step % max(self.trainer.log_every_n_steps, 1) == 0 or 0 < max_steps <= step:
            self._log_interval(step)

    def _read_device(self) -> dict[str, float]:
        """The one host sync of a logging interval: reads, in one copy, the last micro-batch's ``train/loss``,
        ``train/nll``, ``train/loss_tokens``, the last ``train/grad_norm`` and the queued skip flags, which are
        folded into :attr:`nonfinite_steps` (and :attr:`stop_reason` once ``max_nonfinite_steps`` were skipped in a
        row). Returns the train metrics (Python floats)."""
        names = (["train/loss", "train/nll", "train/loss_tokens"] if self._step_stats is not None else []) + (
            ["train/grad_norm"] if self._grad_norm is not None else []
        )
        parts = [t.detach().double().reshape(-1) for t in (self._step_stats, self._grad_norm) if t is not None]
        parts += [flag.double().reshape(1) for _, flag in self._pending]
        if not parts:
            return {}
        values = torch.cat(parts).tolist()
        for (step, _), skipped in zip(self._pending, values[len(names) :]):
            if not skipped:
                self._nonfinite_run = 0
                continue
            self.nonfinite_steps += 1
            self._nonfinite_run += 1
            if self._nonfinite_run == self.max_nonfinite_steps and self.stop_reason is None:
                self.stop_reason = (
                    f"{self._nonfinite_run} optimizer steps in a row (steps "
                    f"{step - self._nonfinite_run + 1}-{step}) had a non-finite loss or gradient "
                    f"norm and were skipped (max_nonfinite_steps={self.max_nonfinite_steps}); lower "
                    "optim.lr, raise sched.warmup_steps or use trainer.precision=32-true"
                )
        self._pending = []
        return dict(zip(names, values))

    def _log_host(self, name: str, value: float, prog_bar: bool = False) -> None:
        """``self.log`` of a host number as a float64 CPU tensor: Lightning would put a Python number on the module's
        device (a blocking copy on CUDA), and it reads every progress-bar value back at each batch end
        (``_ResultCollection.metrics``), which for a CUDA tensor is a host sync per step."""
        self.log(name, torch.tensor(value, dtype=torch.float64), prog_bar=prog_bar)

    def _log_interval(self, step: int) -> None:
        """Logging step ``step`` (the optimizer step being completed, after its backward): :meth:`_read_device`,
        then ``train/loss`` (progress bar), ``train/nll``, ``train/loss_tokens``, ``train/grad_norm`` (NaN or inf
        for a skipped step), ``train/nonfinite_steps`` (when any), and since the previous logging step
        ``perf/tokens_per_s`` (progress bar; all ranks), ``perf/step_time_s`` (seconds per step),
        ``perf/data_wait_s`` (seconds per step spent between the end of one batch and the start of the next, i.e.
        waiting for data), ``perf/peak_mem_gb`` (GiB, :func:`_peak_mem_gb`), ``perf/tokens_seen``, for a text mixture
        ``train/tokens/<source>`` (:meth:`_log_source_tokens`) and, on CUDA
        devices in :data:`PEAK_FLOPS`, ``perf/mfu`` (:func:`canonlm.arch.flops.mfu`). The read waits for this
        step's backward, so the time between two logging steps is the device time of the steps in between, less
        the pauses of the clock (:meth:`_pause_clock`): validation passes with their generation evaluation and
        checkpoint writes do not count as training time."""
        from canonlm.arch.flops import mfu

        for name, value in self._read_device().items():
            self._log_host(name, value, prog_bar=name == "train/loss")
        if self.nonfinite_steps:
            self._log_host("train/nonfinite_steps", float(self.nonfinite_steps))
        self._resume_clock()
        now = time.perf_counter()
        if self._t_last is not None and step > self._step_last:
            n = step - self._step_last
            dt = now - self._t_last - self._excluded_s
            tok_s = n * self.tokens_per_step / max(dt, 1e-9)
            self._log_host("perf/tokens_per_s", tok_s, prog_bar=True)
            self._log_host("perf/step_time_s", dt / n)
            self._log_host("perf/data_wait_s", self._wait_sum / n)
            self._log_host("perf/peak_mem_gb", _peak_mem_gb(self.device))
            self._log_host("perf/tokens_seen", float(step * self.tokens_per_step))
            self._log_source_tokens(step)
            peak = _peak_flops(self.device)
            if peak is not None:
                self._log_host(
                    "perf/mfu", mfu(tok_s, self.model.flops_per_token(self._seq_len), peak, self.trainer.world_size)
                )
        self._t_last, self._step_last = now, step
        self._wait_sum = self._excluded_s = 0.0

    def _pause_clock(self) -> None:
        """Stop the training-throughput clock of ``perf/tokens_per_s`` / ``step_time_s`` / ``mfu`` (no-op before the
        clock starts or while paused). Called when a validation pass starts (its generation evaluation runs inside
        it) and when a checkpoint is written (:meth:`on_save_checkpoint`, before the write). On CUDA it first waits
        for the device, so the queued kernels of the training steps are timed as training, not as the pause."""
        if self._t_last is None or self._paused_at is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._paused_at = time.perf_counter()

    def _resume_clock(self) -> None:
        """Restart the clock paused by :meth:`_pause_clock`: the pause is left out of the current interval. Called
        when a validation pass ends and at the next training batch boundary after a checkpoint write."""
        if self._paused_at is not None:
            self._excluded_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def _log_source_tokens(self, step: int) -> None:
        """``train/tokens/<source>`` of a text mixture: the tokens each source gave in the first ``step`` optimizer
        steps (``step x windows_per_step`` global windows x the window length), counted from the stream's
        deterministic schedule (:meth:`canonlm.data.text.TextTask.source_windows`), so the count is exact after a
        resume at any world size."""
        names = self._source_names()
        if not names or self.windows_per_step <= 0:
            return
        T = int(self.task.context)
        for name, n in zip(names, self.task.source_windows(step * self.windows_per_step, T)):
            self._log_host(f"train/tokens/{name}", float(int(n) * T))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._resume_clock()
        if self._t_batch_end is not None:  # time since the previous batch ended = waiting for this batch
            self._wait_sum += time.perf_counter() - self._t_batch_end

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop the run once a read (:meth:`_read_device`) found ``max_nonfinite_steps`` skipped steps in a row:
        ``last.ckpt`` is saved at this step and :class:`canonlm.errors.RunStopped` (exit code 3) is raised. Starts
        the perf clock and the data-wait clock."""
        if self.stop_reason is not None:
            from canonlm.train.callbacks import last_checkpoint_path

            path = last_checkpoint_path(self.trainer)
            self.trainer.save_checkpoint(path, weights_only=False)
            self.stop_reason += f"; saved {path} at step {self.trainer.global_step}"
            if self.trainer.is_global_zero:  # this step's metrics are not flushed by Lightning after the raise
                for lg in self.trainer.loggers:
                    lg.log_metrics(
                        {"train/nonfinite_steps": float(self.nonfinite_steps)}, step=self.trainer.global_step
                    )
            from canonlm.errors import RunStopped

            raise RunStopped(f"training stopped: {self.stop_reason}", 3)
        self._resume_clock()  # after a checkpoint written by a callback at this batch end (they run before this hook)
        if self.first_step_s is None and self.trainer.global_step > self._fit_step0:  # first optimizer step done
            self._first_step_done()
        if self._t_last is None:  # the perf clock starts at the end of the first batch of this fit (after warm-up)
            self._t_last, self._step_last = time.perf_counter(), self.trainer.global_step
        self._t_batch_end = time.perf_counter()

    def _first_step_done(self) -> None:
        """After the first optimizer step of this fit (the first batch end at which ``global_step`` moved: with
        gradient accumulation, the last micro-batch of the first step): wait for the device once, then log
        ``perf/first_step_s`` (seconds from the start of training to the end of that step: kernel compiles,
        autotuning, ``torch.compile`` and cache loads all land here) and a log line with the process's age too (what
        a user waits after typing the command; :func:`process_age_s`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        first = time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else float("nan")
        self.first_step_s = first
        if self.trainer.is_global_zero:  # straight to the loggers: one row, at this step (self.log would repeat it)
            for lg in self.trainer.loggers:
                lg.log_metrics({"perf/first_step_s": first}, step=self.trainer.global_step)
            age = process_age_s()
            log.info(
                "first optimizer step done %.1f s after training started%s",
                first,
                "" if age is None else f" ({age:.1f} s after the process started)",
            )

    # ------------------------------------------------------------------ run state kept in checkpoints
    @property
    def train_time_s(self) -> float:
        """Seconds spent in ``fit`` over all attempts of this run (earlier ones from the checkpoint)."""
        running = time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else 0.0
        return self.train_time_prior + self._fit_time + running

    def on_train_start(self) -> None:
        self.attempts += 1
        self._fit_t0 = time.perf_counter()
        self._fit_step0 = self.trainer.global_step  # a resumed fit starts past 0
        self.first_step_s = None

    def on_train_end(self) -> None:
        self._read_device()  # the skip flags queued since the last logging step: nonfinite_steps for the results
        if self._fit_t0 is not None:
            self._fit_time += time.perf_counter() - self._fit_t0
            self._fit_t0 = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add ``checkpoint["canonlm"]``: format, model config, task config, training time, attempts and skipped
        steps (plain Python values, so the file loads with ``torch.load(weights_only=True)``). Pauses the throughput
        clock: the write that follows is not training time (:meth:`_pause_clock`)."""
        import dataclasses

        from canonlm.train.checkpoint import CKPT_FORMAT

        self._pause_clock()
        self._read_device()  # the skip flags queued since the last logging step
        checkpoint["canonlm"] = {
            "format": CKPT_FORMAT,
            "model": dataclasses.asdict(self.model.cfg),
            "task": self.task_cfg,
            "train_time_s": float(self.train_time_s),
            "attempts": int(self.attempts),
            "nonfinite_steps": int(self.nonfinite_steps),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get("canonlm") or {}
        self.train_time_prior = float(meta.get("train_time_s", 0.0))
        self.attempts = int(meta.get("attempts", 0))
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self._fit_time = 0.0

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: Mapping[str, torch.Tensor], split: str) -> None:
        logits, out = self._loss(batch)
        tokens = batch["tokens"]
        pred = torch.full_like(tokens, -1)
        pred[:, 1:] = logits[:, :-1].argmax(-1)
        nll = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
        nll[:, 1:] = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), tokens[:, 1:], reduction="none")
        counts = score_answers(pred, batch, self.num_groups, nll=nll)
        acc = self._counts.setdefault(
            split, {k: torch.zeros(self.num_groups, dtype=v.dtype, device=self.device) for k, v in counts.items()}
        )
        for k, v in counts.items():
            acc[k] += v.to(self.device)
        sums = self._loss_sums.setdefault(split, torch.zeros(2, dtype=torch.float64, device=self.device))
        sums[0] += out["nll_sum"].detach().double()
        sums[1] += out["n_tokens"].detach().double()
        if "source" in batch and self._source_names():  # a text mixture: nll and loss tokens per source (rows)
            mask = batch["loss_mask"][:, 1:].to(nll.device)
            rows = torch.stack([torch.where(mask, nll[:, 1:], 0.0).double().sum(1), mask.double().sum(1)], 1)
            acc_s = self._source_sums.setdefault(
                split, torch.zeros(len(self._source_names()), 2, dtype=torch.float64, device=self.device)
            )
            acc_s.index_add_(0, batch["source"].to(self.device, torch.long), rows.to(self.device))

    def _source_names(self) -> list[str]:
        """The sources of a text mixture (``task.source_names``), else []."""
        if self.task is None or not getattr(self.task, "is_mixture", False):
            return []
        return list(self.task.source_names)

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_end(self, split: str) -> None:
        counts = self._counts.pop(split, None)
        sums = self._loss_sums.pop(split, None)
        if counts is None:
            return
        counts = {k: self._global_sum(v) for k, v in counts.items()}
        sums = self._global_sum(sums)
        table = summarize_counts({k: v.cpu().tolist() for k, v in counts.items()})
        nll = float(sums[0] / sums[1].clamp_min(1))
        metrics = {f"{split}/loss": nll, f"{split}/ppl": math.exp(min(nll, 700.0))}
        for g, row in table["by_group"].items():
            metrics[f"{split}/acc_{self.group_name}{g}"] = row["acc"]
            metrics[f"{split}/token_acc_{self.group_name}{g}"] = row["token_acc"]
        if table["overall"]["answers"] > 0:  # tasks scored by generation only (Brevo, Lano) have no answers here
            metrics[f"{split}/acc"] = table["overall"]["acc"]
            metrics[f"{split}/token_acc"] = table["overall"]["token_acc"]
        per_source = {}
        src_sums = self._source_sums.pop(split, None)
        if src_sums is not None:  # text mixtures: {split}/<source>/loss, /ppl over that source's own split
            src_sums = self._global_sum(src_sums).cpu().tolist()
            for name, (s_nll, s_tok) in zip(self._source_names(), src_sums):
                if s_tok > 0:
                    s_loss = s_nll / s_tok
                    per_source[name] = {"loss": s_loss, "ppl": math.exp(min(s_loss, 700.0)), "tokens": int(s_tok)}
                    metrics[f"{split}/{name}/loss"] = s_loss
                    metrics[f"{split}/{name}/ppl"] = per_source[name]["ppl"]
        for k, v in metrics.items():
            self.log(k, v, prog_bar=k == f"{split}/acc", rank_zero_only=True)
        self.results[split] = {"loss": nll, "ppl": metrics[f"{split}/ppl"], "group_name": self.group_name, **table}
        if per_source:
            self.results[split]["sources"] = per_source
        if self.task is not None and hasattr(self.task, "finalize_metrics"):
            extra = self.task.finalize_metrics(split, table, self.model_info())
            for k, v in extra.items():
                self.log(f"{split}/{k}", float(v), rank_zero_only=True)
            self.results[split]["task_metrics"] = dict(extra)

    def model_info(self) -> dict[str, Any]:
        """Parameter facts for task metrics: ``num_params`` (unique parameters; tied embeddings counted once),
        ``embedding_params`` (input embedding), ``d_model``, ``tie_embeddings``, ``vocab_size`` (embedding rows)."""
        cfg = self.model.cfg
        return {
            "num_params": int(self.model.num_params()),
            "vocab_size": int(cfg.vocab_size),
            "embedding_params": int(self.model.tok_emb.weight.numel()),
            "d_model": int(cfg.d_model),
            "tie_embeddings": bool(getattr(cfg, "tie_embeddings", False)),
        }

    # ------------------------------------------------------------------ generative evaluation
    def language_model(self, lockstep: bool = False) -> LanguageModel:
        """The model as a :class:`canonlm.data.lm.LanguageModel` (for the tasks' ``evaluate`` hooks), under the
        trainer's precision context (the autocast of the training steps). ``lockstep``: sharded models (FSDP) run
        the same number of forward passes on every rank (the stop decision is all-reduced)."""
        ctx = None
        if self._trainer is not None:
            ctx = self.trainer.precision_plugin.forward_context
        sync = None
        if lockstep and dist.is_available() and dist.is_initialized():

            def sync(local_any: bool) -> bool:
                flag = torch.tensor([1.0 if local_any else 0.0], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                return bool(flag.item() > 0)

        return LanguageModel(
            self.model,
            vocab_size=self.model.cfg.vocab_size,
            device=self.device,
            batch_size=int(self.gen_eval["batch_size"]),
            max_len=int(self.model.cfg.max_seq_len),
            context=ctx,
            sync=sync,
        )

    def generative_eval(self, split: str) -> dict[str, Any] | None:
        """Run the task's ``evaluate`` hook on ``split`` (DDP: samples sharded over ranks; FSDP: every rank runs all
        of them in lockstep, since sharded forwards are collectives), reduce, log ``{split}/gen_acc``,
        ``{split}/gen_acc_<group><g>`` and the mean of every extra per-sample metric (NaN = not measured)."""
        task = self.task
        if task is None or not hasattr(task, "evaluate"):
            return None
        n = self.gen_eval.get("samples")
        n = int(task.eval_samples(split) if n is None else n)
        if n <= 0:
            return None
        world = self.trainer.world_size if self._trainer is not None else 1
        rank = self.trainer.global_rank if self._trainer is not None else 0
        # DDP: prompts sharded over ranks (each rank has >= 1, so every rank returns the same metric keys).
        # FSDP: forwards are collectives, so every rank runs every prompt in lockstep and nothing is reduced.
        shard = self.fsdp is None and 1 < world <= n
        idx = np.arange(n, dtype=np.int64)
        if shard:
            idx = idx[rank::world]
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            out = task.evaluate(self.language_model(lockstep=self.fsdp is not None and world > 1), split, idx)
        self.model.train(was_training)
        G = self.num_groups
        grp = np.clip(np.asarray(out["group"], dtype=np.int64), 0, G - 1)
        corr = np.asarray(out["correct"], dtype=bool)
        extra_keys = sorted(k for k in out if k not in ("correct", "group"))
        vec = [
            np.bincount(grp, weights=corr.astype(np.float64), minlength=G),
            np.bincount(grp, minlength=G).astype(np.float64),
        ]
        for k in extra_keys:
            v = np.asarray(out[k], dtype=np.float64)
            ok = ~np.isnan(v)
            vec.append(np.array([v[ok].sum(), float(ok.sum())]))
        flat = torch.from_numpy(np.concatenate(vec)).to(self.device)
        if shard:
            flat = self._global_sum(flat)
        flat = flat.cpu().numpy()
        correct, total = flat[:G], flat[G : 2 * G]
        res: dict[str, Any] = {"by_group": {}, "samples": int(total.sum())}
        for g in range(G):
            if total[g] > 0:
                res["by_group"][g] = {"samples": int(total[g]), "acc": float(correct[g] / total[g])}
                self.log(f"{split}/gen_acc_{self.group_name}{g}", float(correct[g] / total[g]), rank_zero_only=True)
        res["acc"] = float(correct.sum() / max(total.sum(), 1))
        self.log(f"{split}/gen_acc", res["acc"], prog_bar=True, rank_zero_only=True)
        for j, k in enumerate(extra_keys):
            s_, c_ = flat[2 * G + 2 * j], flat[2 * G + 2 * j + 1]
            res[k] = float(s_ / c_) if c_ > 0 else math.nan
            self.log(f"{split}/{k}", res[k], rank_zero_only=True)
        return res

    def on_validation_start(self) -> None:
        self._t_batch_end = None  # a validation pass between two training batches is not data wait
        self._pause_clock()  # nor training time (generation evaluation included: on_validation_epoch_end)

    def on_validation_end(self) -> None:
        self._resume_clock()

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")
        if self.gen_eval.get("on_val", True) and not self.trainer.sanity_checking:
            gen = self.generative_eval("val")
            if gen is not None:
                self.results.setdefault("val", {})["generate"] = gen

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")
        gen = self.generative_eval("test")
        if gen is not None:
            self.results.setdefault("test", {})["generate"] = gen

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = self.optimizer_factory(groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(self.sched, self.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def summarize_counts(counts: Mapping[str, list[int]]) -> dict[str, Any]:
    """Turn per-group counts (lists indexed by group) into accuracies.

    Returns ``{"by_group": {g: {"answers", "acc", "tokens", "token_acc"[, "nll_sum"]}} for groups with answers,
    "overall": {...}}``; accuracies are fractions in [0, 1] (None without answers); ``nll_sum`` (nats) when ``counts``
    has it.
    """
    by_group = {}
    ac, at, tc, tt = (counts[k] for k in ("answers_correct", "answers_total", "tokens_correct", "tokens_total"))
    ns = counts.get("nll_sum")
    for g in range(len(at)):
        if at[g] > 0:
            by_group[g] = {
                "answers": int(at[g]),
                "acc": ac[g] / at[g],
                "tokens": int(tt[g]),
                "token_acc": tc[g] / max(tt[g], 1),
            }
            if ns is not None:
                by_group[g]["nll_sum"] = float(ns[g])
    A, T = sum(at), sum(tt)
    overall = {
        "answers": int(A),
        "acc": sum(ac) / A if A else None,
        "tokens": int(T),
        "token_acc": sum(tc) / T if T else None,
    }
    return {"by_group": by_group, "overall": overall}
