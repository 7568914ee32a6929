"""Capo (bioS) generator throughput per core vs the official release.

The official single-core anchors count GPT-2 *pre-tokens* of the rendered text: 1,644,800 /s for template filling
(``get_text_simple3``) and 1,192,200 /s with the sentence permutation (``augmentation_permutation2``); neither
includes BPE tokenisation. canonlm's rows count emitted BPE tokens (more than pre-tokens at the same text), after
tokenisation, so the ratios are conservative. The brief's target: >= 3x the official rate with permutation, i.e.
>= 3.6M BPE tokens/s per core.

Rows (one process pinned to one core; tokens per CPU-second, median of ``--reps`` reps of >= ``--seconds`` s):

* ``render``: ``task.render`` of ``--batch`` biographies per call (train pass renderings, fresh sentence order and
  templates per exposure; the raw generator);
* ``windows``: ``task.train_windows`` of 96 windows x 512 tokens per call (a paper step for N = 500K: the consecutive
  exposure stream with answers, loss masks and per-token groups);
* ``stream``: ``CapoStream`` batches of 96 x 512 in-process (torch tensors);
* ``eval``: ``task.eval_batch_windows`` of the test split (whole biographies per window), 96 x 512 per call.

Each row is run with ``permute_sentences: true`` (ratio to 1,192,200) and ``false`` (ratio to 1,644,800).

    .venv/bin/python bench/capo_generator.py            # full (about 2 min)
    .venv/bin/python bench/capo_generator.py --quick    # 1 rep of 1 s
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from canonlm.data.tasks import build_task

from _timing import rate  # bench/ is on sys.path when a script runs

OFFICIAL = {True: 1_192_200, False: 1_644_800}


def row_functions(task, batch: int, stream_cls) -> dict:
    """One callable per row; each call generates a chunk and returns its number of tokens."""
    ctr = {"p": 0, "w": 0, "e": 0}
    N = task.N

    def render():
        start = ctr["p"]
        ctr["p"] += batch
        k = np.arange(start, start + batch, dtype=np.int64)
        return int(task.render("train", k // N, k % N)["tokens"].shape[0])

    def windows():
        w = np.arange(ctr["w"], ctr["w"] + 96)
        ctr["w"] += 96
        return int(task.train_windows(w, 512)["tokens"].size)

    it = iter(stream_cls(task, "train", window=512, batch_size=96, seed=0))

    def stream():
        return int(next(it)["tokens"].numel())

    n_eval = task.eval_windows("test", 512)

    def evalw():
        w = (np.arange(ctr["e"], ctr["e"] + 96)) % n_eval
        ctr["e"] += 96
        return int(task.eval_batch_windows("test", w, 512)["tokens"].size)

    return {"render": render, "windows": windows, "stream": stream, "eval": evalw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096, help="biographies per render() call")
    ap.add_argument("--N", type=int, default=100_000, help="population size")
    ap.add_argument("--quick", action="store_true", help="1 rep of 1 s")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the first allowed)")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.reps = 1.0, 1
    cpu = a.cpu if a.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    from canonlm.data.tasks.capo import CapoStream

    print(f"pinned to core {cpu}; numpy {np.__version__}; N={a.N}; {a.reps} rep(s) x >= {a.seconds:g} s, median")
    print("tokens/s = BPE tokens per CPU-second of the pinned core (wall-clock rate in brackets)")
    hdr = f"{'setting':28s} {'path':8s} {'tokens/s':>12s} {'(wall)':>12s} {'official':>10s} {'ratio':>6s}"
    print(hdr)
    print("-" * len(hdr))
    for permute in (True, False):
        task = build_task("capo", dict(N=a.N, permute_sentences=permute))
        label = f"bioS permute={str(permute).lower()}"
        for path, fn in row_functions(task, a.batch, CapoStream).items():
            r, rw = rate(fn, a.seconds, a.reps)
            off = OFFICIAL[permute]
            print(f"{label:28s} {path:8s} {r:12,.0f} {f'({rw:,.0f})':>12s} {off:>10,d} {r / off:6.1f}", flush=True)
    print(f"mean biography: {task.mean_bio_len():.1f} BPE tokens (+<EOS>); compact vocabulary {task.vocab_size}")


if __name__ == "__main__":
    main()
