"""Deterministic, resumable, rank- and worker-sharded stream of packed windows.

Global step s covers the global windows ``[s*B*W, (s+1)*B*W)`` (B = per-rank batch, W = world size); rank r takes
the contiguous slice ``[s*B*W + r*B, s*B*W + (r+1)*B)``. Each window is a pure function of (seed, task, split,
window index) (:mod:`canonlm.data.packing`), so the stream is identical for any world size (concatenate the rank
slices), any DataLoader worker count, and after a resume.

:class:`StepStream` owns that step plumbing (argument checks, rank / worker step assignment, state, length) for every
stream: :class:`SyntheticStream` (packed task instances), ``canonlm.data.tasks.capo.CapoStream`` and
``canonlm.data.text.TextStream`` only turn global steps into batches.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from canonlm.data.packing import TAILS, check_window, pack_windows
from canonlm.data import ConfigError

_WINDOWS_PER_CALL = 64  # windows packed per vectorised call (amortises numpy's per-call overhead)


def check_arg_int(name: str, v: Any, lo: int) -> int:
    """``int(v)`` for an integer (Python or numpy, not a bool) >= ``lo``; ValueError ``"<name>=<repr> is not
    allowed; allowed: an integer >= <lo>"`` otherwise (stream arguments: sizes, ranks, steps)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= {lo}")
    return int(v)


class StepStream(IterableDataset):
    """Base of the step-indexed streams (:class:`SyntheticStream`, ``CapoStream``, ``TextStream``): argument checks,
    the rank / worker assignment of global steps, resumable state and length. A subclass only says how global steps
    become batches: :meth:`batch` (one step) and, to build several steps in one call, :meth:`_batches`.

    Args (checked here, in this order; subclasses check their window, split and tail around ``super().__init__``):
        task, split: stored as given. batch_size: B >= 1 windows per rank per step. world_size >= 1; rank in
        [0, world_size). seed >= 0. start_step >= 0: first global step. num_steps: None = infinite (training);
        otherwise the fixed steps ``[start_step, start_step + num_steps)``, replayed in full by every ``iter()``.
    Steps: global step s covers global windows ``[s*B*W, (s+1)*B*W)`` (W = world size); rank r takes the contiguous
        slice ``[s*B*W + r*B, s*B*W + (r+1)*B)`` (:meth:`window_indices`).
    Workers: with ``DataLoader(stream, batch_size=None, num_workers=n)`` worker w yields the steps
        ``first + w, first + w + n, ...``, which the DataLoader's round robin returns in step order, so the stream
        does not depend on n.
    State: ``state_dict() -> {"step": next global step}``; ``load_state_dict`` (or ``start_step``) resumes exactly.
        An infinite stream iterated in this process advances its cursor as batches are handed out; with worker
        processes the copy in the main process does not advance, so the consumer derives the step from the number
        of batches it consumed. Finite streams keep their start.
    Raises ValueError (:func:`check_arg_int` wording) for a bad size, rank, seed or step.
    """

    def __init__(
        self,
        task: Any,
        split: str,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        num_steps: int | None = None,
    ):
        super().__init__()
        self.task = task
        self.split = split
        self.batch_size = check_arg_int("batch_size", batch_size, 1)
        self.world_size = check_arg_int("world_size", world_size, 1)
        self.rank = check_arg_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={rank!r} is not allowed; allowed: an integer in [0, world_size={world_size})")
        self.seed = check_arg_int("seed", seed, 0)
        self.start_step = check_arg_int("start_step", start_step, 0)
        self.num_steps = None if num_steps is None else check_arg_int("num_steps", num_steps, 0)
        self._step = self.start_step

    # ------------------------------------------------------------------ to implement
    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch at global step ``step`` (a pure function of the step): dict of (B, T) CPU tensors."""
        raise NotImplementedError

    def _batches(self, steps: list[int]) -> Iterable[dict[str, torch.Tensor]]:
        """The batches of ``steps`` (this worker's next global steps, increasing), in order. Default: one
        :meth:`batch` per step; override to build several steps at once."""
        return (self.batch(st) for st in steps)

    def _steps_per_call(self) -> int:
        """How many of a worker's steps :meth:`_batches` receives at once (default 1)."""
        return 1

    # ------------------------------------------------------------------ indexing
    def window_indices(self, step: int) -> np.ndarray:
        """int64 (B,): global window indices of this rank at global step ``step``."""
        base = (step * self.world_size + self.rank) * self.batch_size
        return np.arange(base, base + self.batch_size, dtype=np.int64)

    def _step_windows(self, step: Any) -> np.ndarray:
        """:meth:`window_indices` of a user-given step; ValueError for a step that is not an integer >= 0."""
        return self.window_indices(check_arg_int("step", step, 0))

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Number of steps of a finite stream; TypeError for an infinite one (DataLoader/Lightning then treat it as
        unsized)."""
        if self.num_steps is None:
            raise TypeError(f"infinite {type(self).__name__} (num_steps=None) has no length")
        return self.num_steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        finite = self.num_steps is not None
        first = self.start_step if finite else self._step
        end = first + self.num_steps if finite else None
        per_call = self._steps_per_call()
        s = first + wid
        while end is None or s < end:
            steps = [s + j * nw for j in range(per_call) if end is None or s + j * nw < end]
            for st, b in zip(steps, self._batches(steps)):
                if info is None and not finite:
                    self._step = st + 1  # before yielding: state_dict() after consuming this batch points past it
                yield b
            s = steps[-1] + nw

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        """``{"step": next global step}`` (finite streams: their start step)."""
        return {"step": self.start_step if self.num_steps is not None else self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["step"]`` (finite streams: move their start). ValueError if missing or negative."""
        if "step" not in state:
            raise ValueError(f"state={state!r} is not allowed; allowed: a dict with key 'step'")
        step = check_arg_int("step", state["step"], 0)
        if self.num_steps is not None:
            self.start_step = step
        self._step = step


class SyntheticStream(StepStream):
    """IterableDataset of per-rank batches of packed windows (:class:`StepStream`: steps, workers, state, length).

    Args:
        task: from :func:`canonlm.data.tasks.build_task`. split: train | val | test.
        window: T, tokens per window (>= ``task.max_instance_len(split)``). batch_size: B, windows per rank per step.
        seed: data seed. rank / world_size: this rank's slice of every global step.
        start_step: first global step. num_steps: None = infinite (training); otherwise the stream is the fixed
            set of steps ``[start_step, start_step + num_steps)``, replayed in full by every ``iter()`` (evaluation).
        tail: ``drop`` | ``carry``; carry_group: windows per carry block (:mod:`canonlm.data.packing`).
    Yields: dicts of torch tensors of shape (B, T): ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` int32,
        ``group`` int32 (CPU; the DataLoader moves them). Several of a worker's steps are packed per vectorised call
        (speed only: the batches are the same).
    Workers and state: as :class:`StepStream` (e.g. the lead's ``start_step = global_step * accumulate``).
    Raises: ConfigError("task.context") for a too-short window, ConfigError("task.tail") for an unknown tail,
        ValueError for bad sizes/ranks/steps or split.
    """

    def __init__(
        self,
        task: Any,
        split: str,
        *,
        window: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        num_steps: int | None = None,
        tail: str = "drop",
        carry_group: int = 8,
    ):
        self.window = check_window(task, split, window)
        super().__init__(
            task,
            split,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            start_step=start_step,
            num_steps=num_steps,
        )
        if tail not in TAILS:
            raise ConfigError("task.tail", tail, " | ".join(TAILS))
        self.tail = tail
        self.carry_group = check_arg_int("carry_group", carry_group, 1)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch at global step ``step`` (pure function of the step); shapes as in the class doc."""
        out = pack_windows(
            self.task,
            self.split,
            self._step_windows(step),
            self.window,
            self.seed,
            tail=self.tail,
            carry_group=self.carry_group,
        )
        return {k: torch.from_numpy(v) for k, v in out.items()}

    def _steps_per_call(self) -> int:
        return max(1, -(-_WINDOWS_PER_CALL // self.batch_size))  # amortise numpy's per-call overhead

    def _batches(self, steps: list[int]) -> Iterator[dict[str, torch.Tensor]]:
        B = self.batch_size
        idx = np.concatenate([self.window_indices(st) for st in steps])
        out = pack_windows(
            self.task, self.split, idx, self.window, self.seed, tail=self.tail, carry_group=self.carry_group
        )
        for j in range(len(steps)):
            yield {k: torch.from_numpy(v[j * B : (j + 1) * B].copy()) for k, v in out.items()}


__all__ = ["StepStream", "SyntheticStream", "check_arg_int"]
