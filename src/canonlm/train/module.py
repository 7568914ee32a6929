"""LightningModule for causal-LM pretraining on masked synthetic streams.

Loss (models.md §2, tasks.md §1.1): next-token cross-entropy (fp32) on the tokens whose ``loss_mask`` is set,
normalised by the number of loss tokens summed over all data-parallel ranks (engineering.md P25), optional z-loss.
Validation/test: teacher-forced argmax predictions scored per answer (whole-answer exact match) and per answer
token, grouped by the task's metric group (Depo: hop count k), reduced across ranks, plus the per-group summed NLL
of the scored tokens (Capo's bits). Tasks with an ``evaluate`` hook (Brevo, Lano: generation accuracy; Lano: KL) are
also evaluated by generation at the end of each validation and test pass, and ``finalize_metrics`` (Capo: bits per
parameter) turns the tables into the task's headline numbers (spec tasks.md §3.4, §4.4, §6.4).
"""

from __future__ import annotations

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

# Dense (no sparsity) bf16 peak FLOP/s per device, for MFU (NVIDIA data sheets, as torchtitan's get_peak_flops;
# tokens/s is the primary metric). "H100" alone is the SXM part; PCIe and NVL parts are matched first.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "B200": 2.25e15,
              "A100": 312e12, "A10": 125e12, "L40": 181e12, "4090": 165e12}


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one CUDA device, from its name (:data:`PEAK_FLOPS`, first match), or None (CPU,
    unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_FLOPS.items():
        if all(part in name for part in key.split()):
            return val
    return None


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
            (activation checkpointing, then per-block ``compile()``, then ``fully_shard``).
        task: the task object (optional): its ``evaluate`` / ``eval_samples`` / ``finalize_metrics`` hooks are used.
        gen_eval: ``{"samples": int | None (None = task.eval_samples(split)), "batch_size": int, "on_val": bool}``.
        task_cfg: the task's config dict, stored in every checkpoint (with the model config) so that a resume
            with another task or model is refused (:func:`canonlm.train.checkpoint.check_compatible`).
        max_nonfinite_steps: a step whose loss or gradient norm is not finite is skipped (no parameter or
            optimizer-state update) and counted (``train/nonfinite_steps``); this many in a row stop the run with
            ``last.ckpt`` saved (:class:`canonlm.errors.RunStopped`, exit code 3).
    Training time (``train_time_s``), attempts (fit starts) and the skipped-step count are kept in the checkpoint
    and accumulate across resumes.
    Batches are dicts of (B, T) tensors: ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` int32, ``group`` int32.
    """

    def __init__(self, model_cfg: ModelConfig, optimizer: Callable[..., torch.optim.Optimizer],
                 sched: Mapping[str, Any], total_steps: int, loss: Mapping[str, Any], num_groups: int,
                 group_name: str = "group", compile: bool = False, activation_checkpointing: bool = False,
                 fsdp: Mapping[str, Any] | None = None, task: Any = None,
                 gen_eval: Mapping[str, Any] | None = None, task_cfg: Mapping[str, Any] | None = None,
                 max_nonfinite_steps: int = 5):
        super().__init__()
        self.task_cfg = dict(task_cfg or {})
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.nonfinite_steps = 0        # skipped steps, whole run (all attempts)
        self._nonfinite_run = 0         # skipped steps in a row
        self._micro_nonfinite = False   # a micro-batch loss of the current step was not finite
        self.stop_reason: str | None = None
        self.train_time_prior = 0.0     # seconds of training in earlier attempts (from the checkpoint)
        self.attempts = 0
        self._fit_t0: float | None = None
        self._fit_time = 0.0
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
        self.activation_checkpointing = bool(activation_checkpointing)
        self.fsdp = dict(fsdp) if fsdp else None
        self._configured = False
        self._counts: dict[str, dict[str, torch.Tensor]] = {}
        self._loss_sums: dict[str, torch.Tensor] = {}
        self._t_last: float | None = None
        self._step_last = 0
        self._t_batch_end: float | None = None  # end of the previous on_train_batch_end (data-wait clock)
        self._wait_sum = 0.0                    # seconds waited for batches since the last perf log
        self.tokens_per_step = 0  # set by the run from the data config (global windows x window length)
        self.results: dict[str, Any] = {}

    # ------------------------------------------------------------------ model setup
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model's kernels compute in: bf16 when the trainer precision says bf16 or FSDP2 casts the
        parameters to bf16 (``strategy.param_dtype``), fp16 for ``16-mixed``, else fp32
        (:func:`canonlm.arch.model.compute_dtype_for`, the rule ``prepare_run`` checks before the run)."""
        prec = str(self.trainer.precision) if self._trainer is not None else "32-true"
        fsdp_dtype = self.fsdp.get("param_dtype", "bf16") if self.fsdp is not None else None
        return compute_dtype_for(prec, fsdp_dtype)

    def place_model(self) -> dict[str, str]:
        """Resolve the model's op backends for where Lightning runs it (the strategy's root device, which the model
        is moved to right after :meth:`configure_model`) and :meth:`compute_dtype`: ``CanonLM.place``. Returns the
        concrete backends; raises ConfigError (a pinned kernel or ``ops=fused`` that cannot run there) before any
        training or evaluation step."""
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        return self.model.place(device, self.compute_dtype())

    def configure_model(self) -> None:
        """Place the model (:meth:`place_model`), then activation checkpointing, per-block ``compile()`` and FSDP2
        ``fully_shard`` (torchtitan's order). Runs once per module (Lightning calls it for fit, validate and test)."""
        if self._configured:
            return
        self.place_model()
        self._configured = True
        if self.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        if self.compile_blocks:
            for block in self.model.blocks:
                block.compile()
        if self.fsdp is not None and getattr(self, "device_mesh", None) is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
            mp = MixedPrecisionPolicy(param_dtype=dtypes[self.fsdp.get("param_dtype", "bf16")],
                                      reduce_dtype=dtypes[self.fsdp.get("reduce_dtype", "fp32")])
            mesh = self.device_mesh["data_parallel"]
            reshard = bool(self.fsdp.get("reshard_after_forward", True))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
            fully_shard(self.model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    # ------------------------------------------------------------------ loss
    def _global_sum(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            x = x.detach().clone()
            dist.all_reduce(x)
        return x

    def _loss(self, batch: Mapping[str, torch.Tensor]):
        tokens = batch["tokens"]
        logits = self.model(tokens)
        out = lm_loss(logits[:, :-1], tokens[:, 1:], batch["loss_mask"][:, 1:],
                      z_loss=self.loss_cfg.get("z_loss", "none"), z_coef=float(self.loss_cfg.get("z_coef", 1e-4)))
        return logits, out

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Loss of one micro-batch, scaled so that the optimizer step's gradient is
        ``sum over micro-batches and ranks of loss_sum / (loss tokens of the whole step on all ranks)``:
        Lightning divides by ``accumulate_grad_batches`` and DDP/FSDP average over ranks, so the returned value is
        ``loss_sum * world * accumulate / n_step`` with ``n_step`` = all-reduced ``batch["step_loss_tokens"]``
        (engineering.md P25). Logs ``train/loss`` (this micro-batch's mean over its loss tokens, all ranks)."""
        _, out = self._loss(batch)
        world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
        n_local = batch.get("step_loss_tokens", out["n_tokens"]).to(self.device, torch.float32)
        # one collective for the step's token count and the logged sums: [n_step, n_micro, nll_sum, loss_sum]
        sums = self._global_sum(torch.stack([n_local, out["n_tokens"].detach().float(),
                                             out["nll_sum"].detach().float(), out["loss_sum"].detach().float()]))
        n_step, n_micro = sums[0].clamp_min(1.0), sums[1].clamp_min(1.0)
        loss = out["loss_sum"] * (world * accumulate / n_step)
        nll, loss_global = sums[2] / n_micro, sums[3] / n_micro
        if not bool(torch.isfinite(loss_global)):  # all-reduced: every rank takes the same decision
            self._micro_nonfinite = True
        self.log("train/loss", loss_global, prog_bar=True)
        self.log("train/nll", nll, prog_bar=False)
        self.log("train/loss_tokens", n_micro)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After backward, before clipping and the optimizer step (Lightning ``Precision._after_closure``): the
        global gradient norm (a DTensor's ``full_tensor`` under FSDP2; DDP gradients are already averaged, so every
        rank decides alike). A non-finite loss or norm skips the step: every gradient is set to ``None``, which
        ``torch.optim`` steps skip entirely (no moment, weight-decay or step-count update)."""
        step = self.trainer.global_step
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        gn = None
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
            gn = torch.linalg.vector_norm(norms)
            if hasattr(gn, "full_tensor"):
                gn = gn.full_tensor()
        bad = self._micro_nonfinite or (gn is not None and not bool(torch.isfinite(gn)))
        self._micro_nonfinite = False
        if bad:
            for p in self.parameters():
                p.grad = None
            self.nonfinite_steps += 1
            self._nonfinite_run += 1
            self.log("train/nonfinite_steps", float(self.nonfinite_steps))
            if self._nonfinite_run >= self.max_nonfinite_steps:
                self.stop_reason = (f"{self._nonfinite_run} optimizer steps in a row (steps {step - self._nonfinite_run + 2}"
                                    f"-{step + 1}) had a non-finite loss or gradient norm and were skipped "
                                    f"(max_nonfinite_steps={self.max_nonfinite_steps}); lower optim.lr, raise "
                                    "sched.warmup_steps or use trainer.precision=32-true")
            return
        self._nonfinite_run = 0
        if gn is not None and step % max(self.trainer.log_every_n_steps, 1) == 0:
            self.log("train/grad_norm", gn)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._t_batch_end is not None:  # time since the previous batch ended = waiting for this batch
            self._wait_sum += time.perf_counter() - self._t_batch_end

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Every ``log_every_n_steps`` optimizer steps log ``perf/tokens_per_s``, ``perf/step_time_s`` (seconds per
        step), ``perf/data_wait_s`` (seconds per step spent between the end of one batch and the start of the next,
        i.e. waiting for data), ``perf/peak_mem_gb`` (GiB, :func:`_peak_mem_gb`), ``perf/tokens_seen`` and on
        CUDA devices with a known peak ``perf/mfu``."""
        if self.stop_reason is not None:
            from canonlm.train.callbacks import last_checkpoint_path

            path = last_checkpoint_path(self.trainer)
            self.trainer.save_checkpoint(path, weights_only=False)
            self.stop_reason += f"; saved {path} at step {self.trainer.global_step}"
            if self.trainer.is_global_zero:  # this step's metrics are not flushed by Lightning after the raise
                for lg in self.trainer.loggers:
                    lg.log_metrics({"train/nonfinite_steps": float(self.nonfinite_steps)}, step=self.trainer.global_step)
            from canonlm.errors import RunStopped

            raise RunStopped(f"training stopped: {self.stop_reason}", 3)
        step = self.trainer.global_step
        now = time.perf_counter()
        every = max(self.trainer.log_every_n_steps, 1)
        if self._t_last is None:
            self._t_last, self._step_last = now, step
            self._wait_sum = 0.0
            self._t_batch_end = time.perf_counter()
            return
        if step - self._step_last >= every:
            dt = now - self._t_last
            tok_s = (step - self._step_last) * self.tokens_per_step / max(dt, 1e-9)
            self.log("perf/tokens_per_s", tok_s, prog_bar=True)
            self.log("perf/step_time_s", dt / (step - self._step_last))
            self.log("perf/data_wait_s", self._wait_sum / (step - self._step_last))
            self.log("perf/peak_mem_gb", _peak_mem_gb(self.device))
            self.log("perf/tokens_seen", float(step * self.tokens_per_step))
            peak = _peak_flops(self.device)
            if peak:
                flops = self.model.flops_per_token(batch["tokens"].shape[1])
                self.log("perf/mfu", tok_s * flops / (peak * self.trainer.world_size))  # tok_s: all ranks
            self._t_last, self._step_last = now, step
            self._wait_sum = 0.0
        self._t_batch_end = time.perf_counter()

    # ------------------------------------------------------------------ run state kept in checkpoints
    @property
    def train_time_s(self) -> float:
        """Seconds spent in ``fit`` over all attempts of this run (earlier ones from the checkpoint)."""
        running = time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else 0.0
        return self.train_time_prior + self._fit_time + running

    def on_train_start(self) -> None:
        self.attempts += 1
        self._fit_t0 = time.perf_counter()

    def on_train_end(self) -> None:
        if self._fit_t0 is not None:
            self._fit_time += time.perf_counter() - self._fit_t0
            self._fit_t0 = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add ``checkpoint["canonlm"]``: format, model config, task config, training time, attempts and skipped
        steps (plain Python values, so the file loads with ``torch.load(weights_only=True)``)."""
        import dataclasses

        from canonlm.train.checkpoint import CKPT_FORMAT

        checkpoint["canonlm"] = {"format": CKPT_FORMAT, "model": dataclasses.asdict(self.model.cfg),
                                 "task": self.task_cfg,
                                 "train_time_s": float(self.train_time_s), "attempts": int(self.attempts),
                                 "nonfinite_steps": int(self.nonfinite_steps)}

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
        acc = self._counts.setdefault(split, {k: torch.zeros(self.num_groups, dtype=v.dtype, device=self.device)
                                              for k, v in counts.items()})
        for k, v in counts.items():
            acc[k] += v.to(self.device)
        sums = self._loss_sums.setdefault(split, torch.zeros(2, dtype=torch.float64, device=self.device))
        sums[0] += out["nll_sum"].detach().double()
        sums[1] += out["n_tokens"].detach().double()

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
        for k, v in metrics.items():
            self.log(k, v, prog_bar=k == f"{split}/acc", rank_zero_only=True)
        self.results[split] = {"loss": nll, "ppl": metrics[f"{split}/ppl"], "group_name": self.group_name, **table}
        if self.task is not None and hasattr(self.task, "finalize_metrics"):
            extra = self.task.finalize_metrics(split, table, self.model_info())
            for k, v in extra.items():
                self.log(f"{split}/{k}", float(v), rank_zero_only=True)
            self.results[split]["task_metrics"] = dict(extra)

    def model_info(self) -> dict[str, Any]:
        """Parameter facts for task metrics: ``num_params`` (unique parameters; tied embeddings counted once),
        ``embedding_params`` (input embedding), ``d_model``, ``tie_embeddings``."""
        cfg = self.model.cfg
        return {"num_params": int(self.model.num_params()),
                "embedding_params": int(self.model.tok_emb.weight.numel()),
                "d_model": int(cfg.d_model), "tie_embeddings": bool(getattr(cfg, "tie_embeddings", False))}

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
        return LanguageModel(self.model, vocab_size=self.model.cfg.vocab_size, device=self.device,
                             batch_size=int(self.gen_eval["batch_size"]), max_len=int(self.model.cfg.max_seq_len),
                             context=ctx, sync=sync)

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
        vec = [np.bincount(grp, weights=corr.astype(np.float64), minlength=G),
               np.bincount(grp, minlength=G).astype(np.float64)]
        for k in extra_keys:
            v = np.asarray(out[k], dtype=np.float64)
            ok = ~np.isnan(v)
            vec.append(np.array([v[ok].sum(), float(ok.sum())]))
        flat = torch.from_numpy(np.concatenate(vec)).to(self.device)
        if shard:
            flat = self._global_sum(flat)
        flat = flat.cpu().numpy()
        correct, total = flat[:G], flat[G:2 * G]
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
            by_group[g] = {"answers": int(at[g]), "acc": ac[g] / at[g],
                           "tokens": int(tt[g]), "token_acc": tc[g] / max(tt[g], 1)}
            if ns is not None:
                by_group[g]["nll_sum"] = float(ns[g])
    A, T = sum(at), sum(tt)
    overall = {"answers": int(A), "acc": sum(ac) / A if A else None,
               "tokens": int(T), "token_acc": sum(tc) / T if T else None}
    return {"by_group": by_group, "overall": overall}
