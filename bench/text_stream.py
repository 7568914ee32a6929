"""Training-stream throughput of the ``text`` task: tokens/s of the batches the trainer's DataLoader yields, against
what one GPU consumes.

What is timed: ``canonlm.train.datamodule.SyntheticDataModule(task, ...).train_dataloader()`` -- the object Lightning
iterates in ``python train.py task=text`` -- i.e. :class:`canonlm.data.text.TextStream` (window w = a seeded
permutation of the T-token slots of the memory-mapped train shards) in a ``torch.utils.data.DataLoader`` with
``data.num_workers`` workers, grouped by ``StepGroups`` (which adds ``step_loss_tokens``). Each configuration: a fresh
loader, ``--warmup`` batches (worker start-up), then the wall time of ``--steps`` batches; tokens = B x T per batch.

Reference: 305,238 tokens/s, canonlm Llama 12L768D without Canon at T=2048, batch 8, on one H200 (docs/gpu.md,
measured for issue 25; issue 27 rounds it to ~300k tokens/s for one H100). The ratio stream / GPU says how many such
GPUs one rank's loader could feed (per core used: the DataLoader workers plus the main process).

Data: ``--data-dir`` (a prepared directory), or prepared here from the real corpus of
``bench/prepare_throughput.py`` (texts shipped in /usr/share/doc, ``--max-mb`` MB, byte-level BPE vocab 16384).

Usage: python bench/text_stream.py [--data-dir DIR] [--context 2048] [--batch 8] [--workers 0,1,2] [--steps 400]
       [--warmup 20] [--max-mb 24]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

GPU_TOKENS_PER_S = 305_238  # docs/gpu.md: canonlm Llama 12L768D, no Canon, T=2048, B=8, one H200 (issue 25)


def measure(data_dir: Path, context: int, batch: int, workers: int, steps: int, warmup: int) -> float:
    """Tokens/s of the training loader (see the module docstring) over ``steps`` batches after ``warmup``."""
    from canonlm.data.tasks import build_task
    from canonlm.train.datamodule import SyntheticDataModule

    cfg = {"name": "text", "data_dir": str(data_dir), "context": context, "seed": 0}
    task = build_task("text", cfg)
    dm = SyntheticDataModule(task, cfg, batch_size=batch, num_workers=workers)
    it = iter(dm.train_dataloader())
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        b = next(it)
        tokens += b["tokens"].numel()
    dt = time.perf_counter() - t0
    del it
    return tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-mb", type=float, default=24.0)
    a = ap.parse_args()
    tmp = None
    data = a.data_dir
    if data is None:
        from prepare_throughput import build, corpus_files, train_tokenizer

        tmp = Path(tempfile.mkdtemp(prefix="stream_bench_"))
        files, nbytes = corpus_files(a.max_mb)
        train_tokenizer(files, tmp / "tokenizer.json", 16384)
        meta, dt, _ = build(files, tmp / "tokenizer.json", tmp / "prepared", 2)
        data = tmp / "prepared"
        print(f"prepared {len(files)} files ({nbytes / 1e6:.1f} MB, {meta['tokens']:,} tokens) in {dt:.1f} s")
    try:
        print(
            f"stream: T={a.context}, batch {a.batch} ({a.context * a.batch:,} tokens per batch), {a.steps} batches "
            f"after {a.warmup}; reference: {GPU_TOKENS_PER_S:,} tokens/s (12L768D on one GPU)"
        )
        print("num_workers | tokens/s | stream / GPU | load avg")
        for w in [int(x) for x in a.workers.split(",")]:
            r = measure(data, a.context, a.batch, w, a.steps, a.warmup)
            print(f"{w} | {r:,.0f} | {r / GPU_TOKENS_PER_S:.1f}x | {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
