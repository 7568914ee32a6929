"""Preparation throughput on real text: tokens/s of ``canonlm.data.prepare`` at 1 and 2 worker processes.

Corpus (read in place, nothing copied): the text files Debian packages ship in ``/usr/share/doc`` -- their
``changelog*.gz`` / ``NEWS*.gz`` / ``README*.gz`` files (decompressed on the fly by prepare) and ``copyright`` files,
in sorted path order, each kept only if it decodes as UTF-8, until ``--max-mb`` MB of text; documents are paragraphs
(``--text-unit paragraph``), EOS appended. One input file = one work unit, as prepare defines it. ``--input DIR``
uses the ``.txt`` / ``.md`` / ``.jsonl`` files of another folder instead.

Tokenizer: a byte-level BPE (``--vocab``, default 16384, plus ``</s>``) trained with the ``tokenizers`` library on
the first 4 MB of the corpus; its training time is printed apart and not counted.

Each configuration prepares the whole corpus into a fresh folder (wall-clock time of :func:`prepare` from the call to
the written ``meta.json``, including finalize) and its CPU time (this process and its worker processes: on a
machine shared with other jobs, tokens per CPU-second is the figure that stays meaningful; the 1-minute load average
at the end of each row says how busy the machine was); ``--repeats`` runs, the fastest is reported. ``workers=1`` lets the
tokenizers library use its own threads (its default); with ``workers=N > 1`` each process tokenizes single-threaded
(``TOKENIZERS_PARALLELISM=false``, as prepare sets it), so N processes use N cores.

Usage: python bench/prepare_throughput.py [--max-mb 24] [--workers 1,2] [--vocab 16384] [--repeats 1]
       [--input DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

DOC = Path("/usr/share/doc")
_KEEP = ("changelog", "news", "readme", "copyright")


def corpus_files(max_mb: float, root: Path = DOC) -> tuple[list[Path], int]:
    """Real text files under ``root`` (see the module docstring) up to ``max_mb`` MB of decoded text.
    Returns (files in sorted path order, their total decoded bytes)."""
    files, total = [], 0
    for f in sorted(root.rglob("*")):
        name = f.name.lower()
        if f.is_symlink() or not f.is_file() or not name.startswith(_KEEP):
            continue
        if not (name.endswith(".gz") or name == "copyright"):
            continue
        try:
            data = gzip.decompress(f.read_bytes()) if name.endswith(".gz") else f.read_bytes()
            data.decode("utf-8")
        except (OSError, EOFError, UnicodeDecodeError):
            continue
        if not data.strip():
            continue
        files.append(f)
        total += len(data)
        if total >= max_mb * 1e6:
            break
    return files, total


def dir_files(root: Path) -> tuple[list[Path], int]:
    """``.txt`` / ``.md`` / ``.jsonl`` files under ``root`` (sorted) and their total size in bytes."""
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".jsonl"))
    return files, sum(f.stat().st_size for f in files)


def train_tokenizer(files: list[Path], path: Path, vocab: int, sample_mb: float = 4.0) -> float:
    """Train a byte-level BPE (``vocab`` ids incl. ``<pad>`` and ``</s>``) on the first ``sample_mb`` MB of
    ``files``; save it to ``path``. Returns the training seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, n = [], 0
    for f in files:
        data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        texts.append(data.decode("utf-8"))
        n += len(data)
        if n >= sample_mb * 1e6:
            break
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, tr)
    tok.save(str(path))
    return time.perf_counter() - t0


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def build(files: list[Path], tok: Path, out: Path, workers: int, fmt: str = "text") -> tuple[dict, float, float]:
    """Prepare ``files`` into ``out`` with ``workers`` processes. Returns (meta, wall seconds, CPU seconds of this
    process and its workers)."""
    from canonlm.data.prepare import prepare

    if out.exists():
        shutil.rmtree(out)
    c0, t0 = _cpu(), time.perf_counter()
    meta = prepare(
        [str(f) for f in files],
        tok,
        out,
        fmt=fmt,
        text_unit="paragraph",
        append_eos=True,
        progress=False,
        workers=workers,
    )
    return meta, time.perf_counter() - t0, _cpu() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-mb", type=float, default=24.0, help="MB of decoded text to prepare")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--input", type=Path, default=None, help="a folder of .txt/.md/.jsonl files instead")
    ap.add_argument("--keep", type=Path, default=None, help="keep the tokenizer and the last prepared corpus here")
    a = ap.parse_args()
    files, nbytes = dir_files(a.input) if a.input else corpus_files(a.max_mb)
    if not files:
        sys.exit("no input files found")
    fmt = "auto" if a.input else "text"
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="prep_bench_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tok = tmp / "tokenizer.json"
        secs = train_tokenizer(files, tok, a.vocab)
        print(
            f"corpus: {len(files)} files, {nbytes / 1e6:.1f} MB of text ({a.input or DOC}); tokenizer: byte-level "
            f"BPE, vocab {a.vocab}, trained in {secs:.1f} s; cpus: {os.cpu_count()}"
        )
        print("workers | documents | tokens | wall s | tokens/s | MB/s | CPU s | tokens per CPU-second | load avg")
        for w in [int(x) for x in a.workers.split(",")]:
            best = None
            for _ in range(a.repeats):
                meta, dt, cpu = build(files, tok, tmp / "prepared", w, fmt)
                if best is None or dt < best[0]:
                    best = (dt, cpu)
            dt, cpu = best
            print(
                f"{w} | {meta['documents']:,} | {meta['tokens']:,} | {dt:.2f} | {meta['tokens'] / dt:,.0f} | "
                f"{nbytes / 1e6 / dt:.2f} | {cpu:.1f} | {meta['tokens'] / cpu:,.0f} | "
                f"{os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
