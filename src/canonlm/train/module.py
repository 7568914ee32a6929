"""LightningModule for causal-LM pretraining on masked synthetic streams.

Loss (models.md §2, tasks.md §1.1): next-token cross-entropy (fp32) on the tokens whose ``loss_mask`` is set,
normalised by the number of loss tokens summed over all data-parallel ranks (engineering.md P25), optional z-loss.
Validation/test: teacher-forced argmax predictions scored per answer (whole-answer exact match) and per answer
token, grouped by the task's metric group (Depo: hop count k), reduced across ranks.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import lightning.pytorch as L
import torch
import torch.distributed as dist

from canonlm.arch.config import ModelConfig
from canonlm.arch.loss import lm_loss
from canonlm.arch.model import LlamaCanon
from canonlm.data.metrics import score_answers
from canonlm.train.schedule import lr_multiplier

# Dense bf16 peak FLOP/s per device, for MFU (torchtitan-style table; tokens/s is the primary metric, P23).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10": 125e12, "L40": 181e12, "4090": 165e12}


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_FLOPS.items():
        if key in name:
            return val
    return None


class LMModule(L.LightningModule):
    """Causal LM training/evaluation around :class:`canonlm.arch.model.LlamaCanon`.

    Args:
        model_cfg: validated model config (vocab size and max length already set from the task).
        optimizer: a partial ``torch.optim`` constructor (Hydra ``_partial_``) taking the parameter groups.
        sched: schedule config for :func:`canonlm.train.schedule.lr_multiplier`.
        total_steps: optimizer steps of the whole run (``trainer.max_steps``).
        loss: ``{"z_loss": none|lingua|palm, "z_coef": float}``.
        num_groups / group_name: metric groups of the task (Depo: k = 0..K, name "k").
        compile / activation_checkpointing / fsdp: applied in :meth:`configure_model` in torchtitan's order
            (activation checkpointing, then per-block ``compile()``, then ``fully_shard``).
    Batches are dicts of (B, T) tensors: ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` int32, ``group`` int32.
    """

    def __init__(self, model_cfg: ModelConfig, optimizer: Callable[..., torch.optim.Optimizer],
                 sched: Mapping[str, Any], total_steps: int, loss: Mapping[str, Any], num_groups: int,
                 group_name: str = "group", compile: bool = False, activation_checkpointing: bool = False,
                 fsdp: Mapping[str, Any] | None = None):
        super().__init__()
        self.model = LlamaCanon(model_cfg)
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
        self.tokens_per_step = 0  # set by the run from the data config (global windows x window length)
        self.results: dict[str, Any] = {}

    # ------------------------------------------------------------------ model setup
    def configure_model(self) -> None:
        if self._configured:
            return
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
        self.log("train/loss", loss_global, prog_bar=True)
        self.log("train/nll", nll, prog_bar=False)
        self.log("train/loss_tokens", n_micro)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        step = self.trainer.global_step
        if step % max(self.trainer.log_every_n_steps, 1) == 0:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
                gn = torch.linalg.vector_norm(norms)
                if hasattr(gn, "full_tensor"):
                    gn = gn.full_tensor()
                self.log("train/grad_norm", gn)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        now = time.perf_counter()
        every = max(self.trainer.log_every_n_steps, 1)
        if self._t_last is None:
            self._t_last, self._step_last = now, step
            return
        if step - self._step_last >= every:
            dt = now - self._t_last
            tok_s = (step - self._step_last) * self.tokens_per_step / max(dt, 1e-9)
            self.log("perf/tokens_per_s", tok_s, prog_bar=True)
            self.log("perf/step_time_s", dt / (step - self._step_last))
            self.log("perf/tokens_seen", float(step * self.tokens_per_step))
            peak = _peak_flops(self.device)
            if peak:
                flops = self.model.flops_per_token(batch["tokens"].shape[1])
                self.log("perf/mfu", tok_s * flops / (peak * self.trainer.world_size))
            self._t_last, self._step_last = now, step

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: Mapping[str, torch.Tensor], split: str) -> None:
        logits, out = self._loss(batch)
        pred = torch.full_like(batch["tokens"], -1)
        pred[:, 1:] = logits[:, :-1].argmax(-1)
        counts = score_answers(pred, batch, self.num_groups)
        acc = self._counts.setdefault(split, {k: torch.zeros(self.num_groups, dtype=torch.long, device=self.device)
                                              for k in counts})
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
        metrics = {f"{split}/loss": nll}
        for g, row in table["by_group"].items():
            metrics[f"{split}/acc_{self.group_name}{g}"] = row["acc"]
            metrics[f"{split}/token_acc_{self.group_name}{g}"] = row["token_acc"]
        metrics[f"{split}/acc"] = table["overall"]["acc"]
        metrics[f"{split}/token_acc"] = table["overall"]["token_acc"]
        for k, v in metrics.items():
            self.log(k, v, prog_bar=k == f"{split}/acc", rank_zero_only=True)
        self.results[split] = {"loss": nll, "group_name": self.group_name, **table}

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

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

    Returns ``{"by_group": {g: {"answers", "acc", "tokens", "token_acc"}} for groups with answers, "overall": {...}}``;
    accuracies are fractions in [0, 1].
    """
    by_group = {}
    ac, at, tc, tt = (counts[k] for k in ("answers_correct", "answers_total", "tokens_correct", "tokens_total"))
    for g in range(len(at)):
        if at[g] > 0:
            by_group[g] = {"answers": int(at[g]), "acc": ac[g] / at[g],
                           "tokens": int(tt[g]), "token_acc": tc[g] / max(tt[g], 1)}
    A, T = sum(at), sum(tt)
    overall = {"answers": int(A), "acc": sum(ac) / A if A else math.nan,
               "tokens": int(T), "token_acc": sum(tc) / T if T else math.nan}
    return {"by_group": by_group, "overall": overall}
