"""Depo generator throughput per core vs the official release.

Measured like the official anchors: one process pinned to one core, tokens = length of the emitted id lists,
median of ``--reps`` repetitions of at least ``--seconds`` s (of CPU time) each. Rows:

* ``gen``: ``task.generate`` on batches of ``--batch`` train (or test) instances (the vectorised path that packing
  uses); ``gen/1``: one instance per call (``task.instance``; per-call overhead dominates);
* ``pack``: ``pack_windows`` of 16 windows x 2048 tokens per call, in tokens of packed windows (the cut tails that
  left-aligned packing discards are generated but not counted); ``stream``: ``SyntheticStream`` batches of 16 x 2048
  in-process (it packs 64 windows per call); "s/step" = one core's time for a paper step of 128 x 2048 tokens.

The ratio column divides by the official single-core rate of the same setting (the official Depo2
rows used the release's default V = 3, so the Depo2 comparison rows use V = 3 too).

    .venv/bin/python bench/depo_generator.py            # full (about 2 min)
    .venv/bin/python bench/depo_generator.py --quick    # 1 rep of 1 s
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from canonlm.data.packing import pack_windows
from canonlm.data.stream import SyntheticStream
from canonlm.data.tasks import build_task

from _timing import rate  # bench/ is on sys.path when a script runs

# (label, task, cfg, split, official tokens/s per core, measured, or None)
ROWS = [
    ("Depo1 N=375 K=8 V=50 train", "depo1", dict(N=375, K=8), "train", 339_600),
    ("Depo1 N=225 K=8 V=50 train", "depo1", dict(N=225, K=8), "train", 644_400),
    ("Depo1 N=375 test (n=N)", "depo1", dict(N=375, K=8), "test", 829_300),
    ("Depo2 N=125 K=16 V=3 train", "depo2", dict(N=125, K=16, vocab_V=3), "train", 2_519_500),
    ("Depo2 N=125 K=16 V=3 test (n=N)", "depo2", dict(N=125, K=16, vocab_V=3), "test", 5_015_300),
    ("Depo2 N=125 K=16 V=4 train (paper V)", "depo2", dict(N=125, K=16, vocab_V=4), "train", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256, help="instances per generate() call")
    ap.add_argument("--quick", action="store_true", help="1 rep of 1 s")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the first allowed)")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.reps = 1.0, 1
    cpu = a.cpu if a.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    print(f"pinned to core {cpu}; numpy {np.__version__}; {a.reps} rep(s) x >= {a.seconds:g} s, median")
    print("tokens/s = tokens per CPU-second of the pinned core (wall-clock rate in brackets)")
    hdr = (
        f"{'setting':40s} {'path':7s} {'tokens/s':>12s} {'(wall)':>12s} {'official':>10s} {'ratio':>7s} {'s/step':>7s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for label, name, cfg, split, official in ROWS:
        task = build_task(name, cfg)
        ctr = {"w": 0}

        def gen():
            w = np.arange(ctr["w"], ctr["w"] + a.batch)
            ctr["w"] += a.batch
            return int(task.generate(split, w, np.zeros(a.batch, dtype=np.int64)).tokens.shape[0])

        def gen1():
            ctr["w"] += 1
            return len(task.instance(split, ctr["w"]))

        def pack():
            w = np.arange(ctr["w"], ctr["w"] + 16)
            ctr["w"] += 16
            return int(pack_windows(task, split, w, 2048, 0)["tokens"].size)

        it = iter(SyntheticStream(task, split, window=2048, batch_size=16, seed=0))

        def stream():
            return int(next(it)["tokens"].numel())

        for path, fn in (("gen", gen), ("gen/1", gen1), ("pack", pack), ("stream", stream)):
            r, rw = rate(fn, a.seconds, a.reps)
            off = f"{official:>10,d}" if official else f"{'-':>10s}"
            ratio = f"{r / official:7.1f}" if official else f"{'-':>7s}"
            step = f"{128 * 2048 / r:7.3f}" if path in ("pack", "stream") else f"{'':7s}"
            print(f"{label:40s} {path:7s} {r:12,.0f} {f'({rw:,.0f})':>12s} {off} {ratio} {step}", flush=True)


if __name__ == "__main__":
    main()
