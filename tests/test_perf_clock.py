"""Throughput counts training only: ``perf/tokens_per_s``, ``perf/step_time_s`` (and ``perf/mfu``, computed from
tokens/s) leave out validation passes, their generation evaluation and checkpoint writes
(``LMModule._pause_clock`` / ``_resume_clock``).

Oracle: the same tiny in-process training run (a real Lightning ``Trainer`` on the CPU) twice -- once with nothing
slow, once with a validation pass every 2 steps whose batch and generation evaluation each sleep, and a checkpoint
written every 2 steps by a ``CheckpointIO`` whose write sleeps. The sleeps add about 0.45 s per training step to the
wall time between logging steps; the step time measured with them must stay at the step time measured without them.
"""

from __future__ import annotations

import time
from functools import partial

import lightning.pytorch as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from conftest import compose
from test_grad_step import BATCH, TINY, Capture

SLEEP_S = 0.3  # each slow part; validation (batch + generation evaluation) and the write every 2 steps: 0.45 s/step


class SlowWrite(TorchCheckpointIO):
    """Writes the checkpoint as Lightning's default IO does, after sleeping (a slow filesystem)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(SLEEP_S)
        return super().save_checkpoint(checkpoint, path, storage_options)


def _fit(tmp_path, slow: bool) -> list[dict]:
    from canonlm.config.build import build_configs
    from canonlm.train.datamodule import SyntheticDataModule
    from canonlm.train.module import LMModule

    class Module(LMModule):
        def validation_step(self, batch, batch_idx):
            if slow:
                time.sleep(SLEEP_S)
            return super().validation_step(batch, batch_idx)

        def generative_eval(self, split):
            if slow:
                time.sleep(SLEEP_S)
            return super().generative_eval(split)

    torch.set_num_threads(1)
    cfg = compose(TINY)
    task, mcfg = build_configs(cfg)
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    L.seed_everything(0, verbose=False)
    module = Module(
        mcfg,
        optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=True),
        sched={"name": "constant"},
        total_steps=12,
        loss={},
        num_groups=task.num_groups,
    )
    module.tokens_per_step = BATCH * int(task_cfg["context"])
    logger = Capture()
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)] if slow else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        log_every_n_steps=4,
        logger=logger,
        enable_checkpointing=slow,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1 if slow else 0,
        val_check_interval=2 if slow else None,
        check_val_every_n_epoch=None,
        plugins=[SlowWrite()] if slow else [],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=SyntheticDataModule(task, task_cfg, batch_size=BATCH, val_windows=BATCH))
    if slow:  # the slow parts really ran: 6 validation passes and 6 checkpoints
        assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 6
    return [m for _, m in logger.rows if "perf/step_time_s" in m]


def test_validation_generation_and_checkpoint_writes_are_not_training_time(tmp_path):
    fast = _fit(tmp_path / "fast", slow=False)
    slow = _fit(tmp_path / "slow", slow=True)
    assert len(fast) == len(slow) == 3  # logging steps 4, 8, 12 (the clock starts after step 1)
    base = sorted(m["perf/step_time_s"] for m in fast)[1]
    # without the pauses every interval would hold 2 validation passes and 2 writes per 4 steps: >= 0.45 s per step
    for m in slow:
        assert m["perf/step_time_s"] < base + 0.15, (m, base)
        assert m["perf/tokens_per_s"] == pytest.approx(BATCH * 128 / m["perf/step_time_s"], rel=1e-6)
