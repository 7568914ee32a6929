"""LightningDataModule over the deterministic synthetic streams of :mod:`canonlm.data`.

``data.batch_size`` is the GLOBAL number of windows per optimizer step; each rank gets
``batch_size / (world_size * accumulate_grad_batches)`` windows per micro-batch, so the data seen per optimizer
step is identical for any number of GPUs (paper §3, App. A). The training stream starts at micro-batch
``global_step * accumulate_grad_batches``, so a resumed run continues exactly where the checkpoint was written;
the stream itself is a pure function of (seed, task, split, window index).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Mapping

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from canonlm.config.rules import micro_batch
from canonlm.data.stream import SyntheticStream


class StepGroups:
    """Iterate a loader in groups of ``accumulate`` micro-batches (one optimizer step) and add to every batch
    ``step_loss_tokens``: int64 0-d tensor, this rank's number of loss tokens (``loss_mask[:, 1:]``) in the whole
    group. The module all-reduces it to normalise the step's loss by the global loss-token count (not each
    micro-batch's mean). Batches are otherwise passed through unchanged (dicts of (B, T) tensors)."""

    def __init__(self, loader: DataLoader, accumulate: int):
        self.loader, self.accumulate = loader, max(int(accumulate), 1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        it = iter(self.loader)
        while True:
            group = list(itertools.islice(it, self.accumulate))
            if not group:
                return
            n = torch.tensor(sum(int(b["loss_mask"][:, 1:].sum()) for b in group), dtype=torch.long)
            for b in group:
                b["step_loss_tokens"] = n
                yield b


class SyntheticDataModule(L.LightningDataModule):
    """Train/val/test loaders for one task.

    Args:
        task: a task from :func:`canonlm.data.tasks.build_task`.
        task_cfg: the task config (``context``, ``tail``, ``seed`` are read).
        batch_size: global windows per optimizer step. val_windows / test_windows: windows per evaluation pass.
        num_workers: DataLoader workers per rank (the stream does not depend on it: each worker builds every
            n-th step, :class:`canonlm.data.stream.StepStream`); the val loader keeps its workers between passes
            (``persistent_workers``). Batches are put in pinned memory when the trainer runs on CUDA.
    Raises ConfigError (``data.batch_size``) when the batch does not split evenly over ranks x accumulation.
    """

    def __init__(
        self,
        task: Any,
        task_cfg: Mapping[str, Any],
        batch_size: int,
        num_workers: int = 0,
        val_windows: int = 128,
        test_windows: int = 512,
    ):
        super().__init__()
        self.task = task
        self.window = int(task_cfg["context"])
        self.tail = task_cfg.get("tail", "drop")
        self.seed = int(task_cfg.get("seed", 0))
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.val_windows = int(val_windows)
        self.test_windows = int(test_windows)

    def micro_batch(self, world_size: int, accumulate: int) -> int:
        """Windows per rank per micro-batch (:func:`canonlm.config.rules.micro_batch`); raises ConfigError if
        ``batch_size`` does not divide evenly."""
        return micro_batch(self.batch_size, world_size, accumulate)

    def _loader(
        self, split: str, start_step: int = 0, num_windows: int | None = None, num_steps: int | None = None
    ) -> DataLoader:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        micro = self.micro_batch(world, accumulate)
        if num_windows is not None:
            num_steps = max(1, math.ceil(num_windows / (micro * world)))
        kw = dict(
            window=self.window,
            batch_size=micro,
            seed=self.seed,
            rank=rank,
            world_size=world,
            start_step=start_step,
            num_steps=num_steps,
            tail=self.tail,
        )
        if hasattr(self.task, "make_stream"):  # tasks with their own stream (text shards, Capo's exposure schedule)
            ds = self.task.make_stream(split, **kw)
        else:
            ds = SyntheticStream(self.task, split, **kw)
        pin = trainer is not None and trainer.strategy.root_device.type == "cuda"
        # every validation pass iterates the same val loader again: keep its workers (the training stream is one
        # infinite pass, the test one pass)
        return DataLoader(
            ds,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=pin,
            persistent_workers=self.num_workers > 0 and split == "val",
        )

    def train_dataloader(self) -> StepGroups:
        """The training stream from micro-batch ``global_step * accumulate_grad_batches`` (exact resume), in
        optimizer-step groups carrying ``step_loss_tokens`` (:class:`StepGroups`). Under ``overfit_batches=n``
        (debug=overfit) the same first n micro-batches are replayed every epoch."""
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        overfit = trainer.overfit_batches if trainer is not None else 0
        if overfit and overfit >= 1:
            return StepGroups(self._loader("train", start_step=0, num_steps=int(overfit)), accumulate)
        start = trainer.global_step * accumulate if trainer is not None else 0
        return StepGroups(self._loader("train", start_step=start), accumulate)

    def _eval_windows(self, split: str, default: int) -> int:
        """Windows of an evaluation pass: the task's own count when it has one (Capo: every evaluated person's
        rendering exactly once), else ``data.val_windows`` / ``data.test_windows``."""
        if hasattr(self.task, "eval_windows"):
            return max(1, int(self.task.eval_windows(split, self.window)))
        return default

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", num_windows=self._eval_windows("val", self.val_windows))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", num_windows=self._eval_windows("test", self.test_windows))
