"""Capo evaluation windows (one job: which renderings val/test score, packed into windows, each scored once).

Part 3.3 Def. 4.3 measures knowledge on the training population itself; which renderings are scored is not stated by the
papers. canonlm scores fresh renderings of the training population (``eval_renderings_per_person`` each, own
namespaces): test = people 0..N-1, val = a seeded subset of ``val_people`` (default min(N, 1000)) people; biographies
are packed greedily into windows that start with ``<EOS>`` and hold whole biographies (the rest of a window is the
beginning of the next biography, loss on, not scored; windows past the end are all pad, loss off), so every evaluated
rendering is scored exactly once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from canonlm.data.seeding import instance_keys, words
from canonlm.data.tasks import check_split
from canonlm.data.tasks._common import excl_cumsum
from canonlm.data.tasks.capo.population import Population
from canonlm.data.tasks.capo.render import P_VAL, Renderer
from canonlm.data.tasks.capo.stream import fill_windows


class EvalWindows:
    """Evaluation renderings and their windows (seed None = the task's seed in every method).

    Args: N: people. val_people: people of the val subset. renderings: renderings per evaluated person. seed: the
        task's seed. eos_id: compact id of <EOS>. population, renderer: the task's :class:`Population` and
        :class:`Renderer`.
    """

    def __init__(
        self,
        N: int,
        val_people: int,
        renderings: int,
        seed: int,
        eos_id: int,
        population: Population,
        renderer: Renderer,
    ):
        self.N, self.val_people, self.renderings, self.seed, self.eos_id = N, val_people, renderings, seed, eos_id
        self.population, self.renderer = population, renderer
        self._cache: dict[tuple, dict[str, np.ndarray]] = {}

    def people(self, split: str, seed: int | None = None) -> np.ndarray:
        """int64: people evaluated in ``split``: train/test -> 0..N-1; val -> a seeded subset of ``val_people``
        people (sorted). ValueError for an unknown split."""
        check_split(split)
        if split != "val":
            return np.arange(self.N, dtype=np.int64)
        ns = self.renderer.namespace("val", seed)
        k = words(instance_keys(ns, np.zeros(self.N, np.int64), np.arange(self.N, dtype=np.int64)), P_VAL, 0)
        return np.sort(np.argsort(k, kind="stable")[: self.val_people])

    def layout(self, split: str, window: int, seed: int | None) -> dict[str, np.ndarray]:
        """Greedy packing of the evaluation biographies (rendering r of people[k], r-major) into windows that start
        with <EOS>: ``cum`` (n_bios+1,) offsets in the evaluation stream, ``b0`` / ``b1`` (windows,) first biography
        and one past the last whole biography of each window, ``r`` / ``person`` (n_bios,). Cached."""
        seed = self.seed if seed is None else int(seed)
        key = (split, seed, int(window))
        lay = self._cache.get(key)
        if lay is not None:
            return lay
        people = self.people(split, seed)
        R = self.renderings
        r = np.repeat(np.arange(R, dtype=np.int64), people.shape[0])
        person = np.tile(people, R)
        lens = self.renderer.lengths(self.population.get(seed), self.renderer.namespace(split, seed), r, person)
        cum = excl_cumsum(lens)
        cap = int(window) - 1
        n = person.shape[0]
        b0s, b1s = [], []
        b = 0
        while b < n:
            b1 = int(np.searchsorted(cum, cum[b] + cap, side="right")) - 1
            b1 = max(min(b1, n), b + 1)
            b0s.append(b)
            b1s.append(b1)
            b = b1
        lay = dict(cum=cum, b0=np.asarray(b0s, dtype=np.int64), b1=np.asarray(b1s, dtype=np.int64), r=r, person=person)
        self._cache[key] = lay
        return lay

    def batch(self, split: str, w: Any, window: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Evaluation windows ``w`` (int64 (W,)) of ``split`` of ``window`` tokens (T, at least the longest
        evaluation content; the caller checks): dict of (W, T) arrays ``tokens`` int64, ``loss_mask`` bool,
        ``answer_id`` int32, ``group`` int32. Window w = <EOS> + whole biographies b0[w]..b1[w]-1 (each + <EOS>) +
        the beginning of the next biography (loss on, not scored); windows past the end are all pad (0, loss off,
        no answers)."""
        w = np.asarray(w, dtype=np.int64).reshape(-1)
        T = int(window)
        lay = self.layout(split, T, seed)
        nw = lay["b0"].shape[0]
        out = dict(
            tokens=np.zeros((w.shape[0], T), np.int64),
            answer_id=np.full((w.shape[0], T), -1, np.int32),
            group=np.zeros((w.shape[0], T), np.int32),
            loss_mask=np.zeros((w.shape[0], T), bool),
        )
        live = np.flatnonzero(w < nw)
        if live.size == 0:
            return out
        ww = w[live]
        cum, n = lay["cum"], lay["person"].shape[0]
        b0 = lay["b0"][ww]
        b_end = np.minimum(lay["b1"][ww] + 1, n)  # + the partly shown next biography
        cnt = b_end - b0
        coff = excl_cumsum(cnt)
        bio = np.repeat(b0 - coff[:-1], cnt) + np.arange(int(coff[-1]))
        b = self.renderer.tokens(
            self.population.get(seed), self.renderer.namespace(split, seed), lay["r"][bio], lay["person"][bio]
        )
        # segment k: [<EOS>] + its biographies + pad to T
        seg_len = 1 + (cum[b_end] - cum[b0])
        soff = excl_cumsum(np.maximum(seg_len, T))
        seg = np.zeros(int(soff[-1]), dtype=np.int64)
        seg[soff[:-1]] = self.eos_id
        tok_src_off = b["offsets"][coff[:-1]]
        tl = b["offsets"][coff[1:]] - tok_src_off
        q = np.repeat(np.arange(live.shape[0]), tl)
        toff = excl_cumsum(tl)
        seg[soff[:-1][q] + 1 + np.arange(q.shape[0]) - toff[q]] = b["tokens"][
            tok_src_off[q] + np.arange(q.shape[0]) - toff[q]
        ]
        # answers of the whole biographies b0..b1-1 (positions in the segment buffer)
        kb = np.repeat(np.arange(live.shape[0]), cnt)  # window of each rendered bio
        whole = bio < lay["b1"][ww][kb]
        bstart = soff[:-1][kb] + 1 + b["offsets"][:-1] - tok_src_off[kb]
        sp = (bstart[:, None] + b["span_start"])[whole].reshape(-1)
        sl = b["span_len"][whole].reshape(-1)
        sg = np.broadcast_to(np.arange(1, 8, dtype=np.int64), b["span_start"].shape)[whole].reshape(-1)
        o = np.argsort(sp, kind="stable")
        fill_windows(out, live, soff[:-1], T, seg, sp[o], sl[o], sg[o], lo_ok=1)
        lm = np.arange(T)[None, :] < np.minimum(seg_len, T)[:, None]
        lm[:, 0] = False
        out["loss_mask"][live] = lm
        return out
