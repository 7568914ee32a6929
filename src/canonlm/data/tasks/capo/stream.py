"""Capo training stream: passes over the population cut into windows (one job: which tokens training step s reads).

Exposure schedule (not stated by the papers; Part 3.3 §2.3 concatenates biographies, cuts 512-token windows and counts
exposures per person). Pass p = 0, 1, 2, ... is a fresh random permutation of the population, every person re-rendered;
the biographies of pass 0, pass 1, ... each followed by ``<EOS>``, form one infinite token stream. ``window:
consecutive``: window w = stream tokens [w T, (w+1) T); ``random_offset``: [w T + o_w, w T + o_w + T) with o_w uniform
in [0, T) (counter-based; windows may overlap or skip up to T - 1 tokens). Window w is a pure function of its index:
per-pass total lengths and within-pass cumulative lengths come cheaply from cached fragment lengths, and the pass and
biography holding a token offset are found by binary search. Loss on every token (except position 0 of a window, never a
target); answers cut by a window end (or starting at position 0) are not scored.

:class:`CapoStream` is the DataLoader-facing stream of per-rank batches, for training and evaluation windows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from canonlm.data import ConfigError
from canonlm.data.seeding import below, instance_keys, words
from canonlm.data.stream import StepStream
from canonlm.data.tasks import check_split
from canonlm.data.tasks._common import excl_cumsum
from canonlm.data.tasks.capo.population import Population
from canonlm.data.tasks.capo.render import P_OFFSET, P_PERM, Renderer


def fill_windows(
    out: dict[str, np.ndarray],
    rows: np.ndarray,
    rel: np.ndarray,
    T: int,
    seg_tok: np.ndarray,
    span_pos: np.ndarray,
    span_len: np.ndarray,
    span_group: np.ndarray,
    lo_ok: int,
    valid_hi: np.ndarray | None = None,
) -> None:
    """Cut windows [rel[k], rel[k] + T) of a segment into ``out[...][rows[k]]`` with per-window answers: an answer
    is scored iff it lies in [rel + lo_ok, rel + T) (and ends at or before ``valid_hi[k]``, if given).

    ``out``: dict of (W, T) arrays ``tokens`` int64, ``answer_id`` int32 (dense per window, -1 = not scored),
    ``group`` int32 (0 = not scored); ``span_pos`` / ``span_len`` / ``span_group`` int64 (A,) answers of the
    segment in order of position."""
    gidx = rel[:, None] + np.arange(T)[None, :]
    out["tokens"][rows] = seg_tok[gidx]
    A = span_pos.shape[0]
    sid = np.full(seg_tok.shape[0], -1, dtype=np.int64)
    if A:
        aoff = excl_cumsum(span_len)
        q = np.repeat(np.arange(A), span_len)
        tpos = span_pos[q] + np.arange(q.shape[0]) - aoff[q]
        ok = (tpos >= 0) & (tpos < seg_tok.shape[0])
        sid[tpos[ok]] = q[ok]
    s = sid[gidx]
    has = s >= 0
    sc = np.where(has, s, 0)
    lo = rel[:, None] + lo_ok
    hi = rel[:, None] + T if valid_hi is None else np.minimum(rel + T, valid_hi)[:, None]
    valid = has & (span_pos[sc] >= lo) & (span_pos[sc] + span_len[sc] <= hi) if A else has
    first = np.where(valid, s, np.iinfo(np.int64).max).min(axis=1, keepdims=True)
    out["answer_id"][rows] = np.where(valid, s - first, -1).astype(np.int32)
    out["group"][rows] = np.where(valid, span_group[sc] if A else 0, 0).astype(np.int32)


class TrainLayout:
    """The training token stream of a task (seed None = the task's seed in every method).

    Args: N: people. window: ``consecutive`` | ``random_offset``. seed: the task's seed. population, renderer: the
        task's :class:`Population` and :class:`Renderer`.
    """

    def __init__(self, N: int, window: str, seed: int, population: Population, renderer: Renderer):
        self.N, self.window, self.seed, self.population, self.renderer = N, window, seed, population, renderer
        self._pass_total: dict[tuple[str, int], list[int]] = {}
        self._pass_cache: OrderedDict = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pass_cache": OrderedDict()}

    def pass_(self, p: int, seed: int | None) -> dict[str, np.ndarray]:
        """Pass p of the training stream (LRU-cached): ``perm`` int64 (N,) people in stream order, ``cum`` int64
        (N+1,) token offsets of its biographies from the pass start."""
        seed = self.seed if seed is None else int(seed)
        key = (seed, p)
        hit = self._pass_cache.get(key)
        if hit is not None:
            self._pass_cache.move_to_end(key)
            return hit
        ns = self.renderer.namespace("train", seed)
        people = np.arange(self.N, dtype=np.int64)
        pk = words(instance_keys(ns, np.full(self.N, p, dtype=np.int64), people), P_PERM, 0)
        perm = np.argsort(pk, kind="stable")
        lens = self.renderer.lengths(self.population.get(seed), ns, np.full(self.N, p, dtype=np.int64), perm)
        out = {"perm": perm, "cum": excl_cumsum(lens)}
        self._pass_cache[key] = out
        while len(self._pass_cache) > 3:
            self._pass_cache.popitem(last=False)
        return out

    def pass_starts(self, upto: int, seed: int | None = None) -> np.ndarray:
        """int64 (upto+1,): token offset of the start of passes 0..upto in the training stream (cached; one
        vectorised length computation per new pass)."""
        seed = self.seed if seed is None else int(seed)
        tot = self._pass_total.setdefault(("train", seed), [0])
        ns = self.renderer.namespace("train", seed)
        pop = self.population.get(seed)
        people = np.arange(self.N, dtype=np.int64)
        while len(tot) <= upto:
            p = len(tot) - 1
            tot.append(tot[-1] + int(self.renderer.lengths(pop, ns, np.full(self.N, p, dtype=np.int64), people).sum()))
        return np.asarray(tot[: upto + 1], dtype=np.int64)

    def _locate(self, off: int, seed: int | None) -> tuple[int, int, int]:
        """(pass, position in pass, token offset of that biography) of the biography holding stream token off."""
        seed = self.seed if seed is None else int(seed)
        tot = self._pass_total.setdefault(("train", seed), [0])
        while tot[-1] <= off:  # extend pass starts until the offset is covered
            self.pass_starts(len(tot), seed)
        p = int(np.searchsorted(np.asarray(tot), off, side="right")) - 1
        cum = self.pass_(p, seed)["cum"]
        j = int(np.searchsorted(cum, off - tot[p], side="right")) - 1
        return p, j, tot[p] + int(cum[j])

    def segment(self, lo: int, hi: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Training stream tokens [lo, hi) and the answers overlapping them.

        Returns dict: ``tokens`` int64 (hi-lo,); ``span_pos`` / ``span_len`` / ``span_group`` int64 (A,) [answers in
        order of position; positions are stream offsets]; ``people`` int64 (bios,), ``passes`` int64 (bios,),
        ``bio_start`` int64 (bios,) [stream offset of each biography touched]. ValueError for an empty or negative
        segment."""
        if lo < 0 or hi <= lo:
            raise ValueError(f"segment [{lo}, {hi}) is empty or negative")
        seed = self.seed if seed is None else int(seed)
        p, j, start = self._locate(lo, seed)
        passes, people = [], []
        need = hi - start
        got = 0
        while got < need:
            pa = self.pass_(p, seed)
            cum = pa["cum"]
            j2 = int(np.searchsorted(cum, cum[j] + (need - got), side="left"))
            j2 = min(max(j2, j + 1), self.N)
            people.append(pa["perm"][j:j2])
            passes.append(np.full(j2 - j, p, dtype=np.int64))
            got += int(cum[j2] - cum[j])
            p, j = (p + 1, 0) if j2 == self.N else (p, j2)
        people_a = np.concatenate(people)
        passes_a = np.concatenate(passes)
        b = self.renderer.tokens(self.population.get(seed), self.renderer.namespace("train", seed), passes_a, people_a)
        bio_start = start + b["offsets"][:-1]
        sp = (bio_start[:, None] + b["span_start"]).reshape(-1)
        sl = b["span_len"].reshape(-1)
        sg = np.broadcast_to(np.arange(1, 8, dtype=np.int64), b["span_start"].shape).reshape(-1)
        o = np.argsort(sp, kind="stable")
        sp, sl, sg = sp[o], sl[o], sg[o]
        keep = (sp + sl > lo) & (sp < hi)
        return dict(
            tokens=b["tokens"][lo - start : hi - start],
            span_pos=sp[keep],
            span_len=sl[keep],
            span_group=sg[keep],
            people=people_a,
            passes=passes_a,
            bio_start=bio_start,
        )

    def window_starts(self, w: np.ndarray, window: int, seed: int | None = None) -> np.ndarray:
        """int64: stream offset of training windows ``w`` (``consecutive``: w T; ``random_offset``: w T + o_w)."""
        w = np.asarray(w, dtype=np.int64)
        start = w * window
        if self.window == "random_offset":
            ns = self.renderer.namespace("train", seed)
            start = start + below(words(instance_keys(ns, w, np.zeros_like(w)), P_OFFSET, 0), window)
        return start

    def windows(self, w: Any, window: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Training windows ``w`` (int64 (W,)) of ``window`` tokens: dict of (W, T) arrays ``tokens`` int64,
        ``loss_mask`` bool (all but position 0), ``answer_id`` int32 (dense per window, -1 = not scored; answers
        must lie in [1, T)), ``group`` int32 (1..7 on scored tokens, 0 elsewhere)."""
        w = np.asarray(w, dtype=np.int64).reshape(-1)
        T = int(window)
        out = {
            k: np.empty((w.shape[0], T), dtype=dt)
            for k, dt in (("tokens", np.int64), ("answer_id", np.int32), ("group", np.int32))
        }
        starts = self.window_starts(w, T, seed)
        # render contiguous runs of windows together (a step's windows form one run)
        order = np.argsort(starts, kind="stable")
        s_sorted = starts[order]
        breaks = np.flatnonzero(np.diff(s_sorted) > T) + 1
        for run in np.split(np.arange(w.shape[0]), breaks):
            idx = order[run]
            lo, hi = int(starts[idx].min()), int(starts[idx].max()) + T
            seg = self.segment(lo, hi, seed)
            fill_windows(
                out,
                idx,
                starts[idx] - lo,
                T,
                seg["tokens"],
                seg["span_pos"] - lo,
                seg["span_len"],
                seg["span_group"],
                lo_ok=1,
            )
        out["loss_mask"] = np.ones((w.shape[0], T), dtype=bool)
        out["loss_mask"][:, 0] = False
        return out


class CapoStream(StepStream):
    """IterableDataset of per-rank batches of Capo windows (interface of
    :class:`canonlm.data.stream.SyntheticStream`; steps, workers, state and length: :class:`StepStream`).

    Global step s covers global windows [s B W, (s+1) B W) (B = per-rank batch, W = world size); rank r takes
    [s B W + r B, s B W + (r+1) B). train: windows of the consecutive exposure stream (:meth:`CapoTask.train_windows`;
    infinite); val/test: evaluation windows (:meth:`CapoTask.eval_batch_windows`; windows past the end are pad).
    Yields dicts of (B, T) CPU tensors ``tokens`` int64, ``loss_mask`` bool, ``answer_id`` int32, ``group`` int32.
    Raises ConfigError("task.context") for a window shorter than the longest instance, ConfigError("task.tail") for
    an unknown tail, ValueError for bad sizes, ranks, steps or split.
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
    ):
        check_split(split)
        need = task.max_instance_len(split)
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < need:
            raise ConfigError("task.context", window, f"an integer >= {need}, the longest {split} instance of capo")
        if tail not in ("drop", "carry"):
            raise ConfigError("task.tail", tail, "drop | carry")
        self.window, self.tail = int(window), tail
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

    def batch_numpy(self, step: int) -> dict[str, np.ndarray]:
        """This rank's batch at ``step`` as numpy arrays (pure function of the step)."""
        w = self._step_windows(step)
        if self.split == "train":
            return self.task.train_windows(w, self.window, self.seed)
        return self.task.eval_batch_windows(self.split, w, self.window, self.seed)

    def batch(self, step: int):
        """This rank's batch at ``step`` (dict of torch tensors, shapes in the class doc)."""
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.batch_numpy(step).items()}
