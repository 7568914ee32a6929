"""Tokenize local text corpora into memory-mappable token shards for the ``text`` task -- in parallel, restartable
after a kill, and split over SLURM array tasks.

    python -m canonlm.data.prepare --input <file|dir|glob> [--input ...] --tokenizer <tokenizer.json | local HF
        tokenizer dir> --out <dir> [--workers N] [--num-tasks K --task-index i] [--format auto|text|jsonl|parquet]
        [--text-key text] [--text-unit line|paragraph|file] [--val-fraction 0.005] [--test-fraction 0.005]
        [--seed 0] [--shard-tokens N] [--append-eos] [--eos-token TOKEN] [--force]
    python -m canonlm.data.prepare --finalize --out <dir>

Documents:
* ``text`` files (``.txt``, ``.text``, ``.md``; ``--format text``): ``--text-unit line`` (default) = one document per
  line (the usual layout of dumps such as one-article-per-line Wikipedia text), ``paragraph`` = blocks separated by
  blank lines, ``file`` = the whole file. The line break ending a line is not part of the document.
* ``jsonl`` (``.jsonl``, ``.ndjson``, ``.json``): one JSON object per line, text in field ``--text-key`` (a ``.json``
  file that starts with ``[`` is read as one array of objects or strings).
* ``parquet``: column ``--text-key`` (needs pyarrow).
* ``.gz`` files are decompressed on the fly (format from the inner suffix). Directories are searched recursively for
  these suffixes (with an explicit ``--format``: every non-hidden file). ``--input`` may be repeated; the input files
  are the files of each ``--input`` in the order given (a directory's or a glob's files in sorted path order), and a
  file named twice is refused. Documents that are empty or whitespace-only are skipped and not counted; the remaining
  ones are numbered 0, 1, 2, ... in reading order over all input files (the *document index*).

Tokenization: the tokenizer's ids without special tokens; ``--append-eos`` appends the EOS id (the tokenizer's own,
or ``--eos-token``) after every document, so windows see document boundaries.

Splits: document i goes to val if ``u_i < val_fraction``, to test if ``val_fraction <= u_i < val_fraction +
test_fraction``, else to train, where ``u_i`` is a uniform hash of (seed, i) (SplitMix64, :mod:`canonlm.data.seeding`)
-- disjoint by construction and independent of the tokenizer, the worker count and the task count. If a split with a
positive fraction would stay empty (tiny corpora), the train document with the smallest ``u_i`` is moved there (val
first, then test).

Work units, workers, tasks and restart. Each input file is one *work unit*. A unit is tokenized by one process into
its own shards (a shard never spans two input files), written under ``<out>/.prepare/units/`` in a temporary
directory that is renamed into place when the unit is complete; then its manifest ``.prepare/done/u<NNNNN>.json`` is
written atomically -- the done marker. A unit needs the number of documents of the units before it (its first
document index): counts are cached in ``.prepare/counts/`` by whichever process reads that file first (the unit's own
tokenizer run, or a count-only pass of another process that needs it), so no process waits for another.

* ``--workers N``: N processes (``concurrent.futures.ProcessPoolExecutor``) tokenize this task's units.
* ``--num-tasks K --task-index i`` (i defaults to ``$SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN``): this task
  prepares only its share of the units (greedy by file size: largest unit first to the least loaded task), e.g. one
  task per node of ``sbatch --array=0-<K-1>``. The task that finds every unit done finalizes; ``--finalize`` does it
  by hand (e.g. after a task was killed while finalizing).
* Restart: rerun the same command (any ``--workers``, any ``--num-tasks``): done units are skipped and kept, a
  half-written unit (no done marker) is deleted and redone. The inputs (paths, sizes, modification times) and every
  option that changes the output are recorded in ``.prepare/plan.json``; a rerun with different ones is refused with
  one line naming the first difference (``--force`` starts over, single task only).
* Finalize: shards are renamed to ``<split>_<k:05d>.bin`` in unit order; consecutive shards smaller than
  ``min(--shard-tokens, 2**22)`` tokens (the tail of each input file's split) are concatenated so that small files
  do not leave many tiny shards (a window never crosses a shard); ``meta.json`` is written last and ``.prepare/``
  removed. The output depends only on the inputs and options, never on the number of workers or tasks.

Errors (:class:`PrepareError`; the CLI prints one line ``canonlm.data.prepare: error: ...`` and exits with status 2):
bad options, missing / unreadable inputs (naming the file), input that is not valid UTF-8 (naming the file and the
line), malformed JSON, a missing tokenizer, an output folder that cannot be created or written, an existing
``--out`` (see below) and a resume with other inputs / options. A fresh single-task run that fails leaves nothing
behind; a resumed run or an array task keeps the done units.

Output: ``meta.json``, ``<split>_<k:05d>.bin`` (raw ids, uint16 if vocab_size <= 65536 else uint32) and
``<split>_<k:05d>.idx.npy`` (int64 (documents, 2): document index, first token offset). Within an input file, a
shard is closed once it holds at least ``--shard-tokens`` tokens (documents are never split across shards).

Existing ``--out``: an empty directory is simply used, and one holding only an unfinished ``.prepare/`` is resumed.
Anything else is refused unless ``--force`` is given, and ``--force`` only ever replaces a directory that is a
prepared corpus -- its ``meta.json`` carries the format tag ``"format": "canonlm-text-v<N>"`` -- deleting it before
the new preparation starts. A non-empty directory without that tag (or with an unreadable meta.json), or a path that
is not a directory, is never deleted: prepare stops with a PrepareError naming the path and the reason.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import os
import re
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from canonlm.data.seeding import instance_keys, stable_hash64, to_unit
from canonlm.data.text import FORMAT, META, SPLITS, TextTokenizer, dtype_for_vocab

SUFFIXES = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
TEXT_UNITS = ("line", "paragraph", "file")
WORK = ".prepare"  # the work folder inside --out while a preparation is unfinished
PLAN_FORMAT = "canonlm-prepare-plan-v1"
MERGE_BELOW = 1 << 22  # finalize concatenates consecutive shards below min(shard_tokens, this) tokens
_BATCH_DOCS = 1024
_BATCH_CHARS = 4 << 20
_WRITE_BUF = 8 << 20  # bytes buffered per shard before a write


class PrepareError(Exception):
    """A user-facing problem with the inputs or options (the CLI prints it and exits with status 2)."""


# ============================================================================================== inputs
def _kind(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suf = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) >= 2 else path.suffix
    if suf.lower() not in SUFFIXES:
        raise PrepareError(f"input {path}: unknown suffix {suf!r}; use --format text|jsonl|parquet")
    return SUFFIXES[suf.lower()]


def resolve_inputs(spec: str, fmt: str = "auto") -> list[Path]:
    """Input files of ``--input``: a file, a directory (recursive, known suffixes, sorted) or a glob (sorted).
    Raises PrepareError if nothing matches."""
    p = Path(spec).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        try:
            files = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and not f.name.startswith(".")
                and (
                    fmt != "auto"
                    or (f.suffixes[-2] if f.suffix == ".gz" and len(f.suffixes) >= 2 else f.suffix).lower() in SUFFIXES
                )
            )
        except OSError as e:
            raise PrepareError(f"input directory {spec}: cannot list {e.filename or spec}: {e.strerror or e}") from None
        if not files:
            others = sorted({f.suffix or f.name for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")})
            what = f"; it holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''} files" if others else ""
            raise PrepareError(
                f"input directory {spec} holds no file with a known suffix "
                f"({', '.join(sorted(SUFFIXES))}, optionally .gz){what}; to read every file of it "
                f"as text, add --format text (or jsonl | parquet)"
            )
        return files
    files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise PrepareError(f"input {spec}: no such file or directory, and no file matches it as a glob")
    return files


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


_NEWLINE = re.compile(rb"\r\n|\r|\n")  # the line ends of universal-newline reading (text files, newline="")


def decode_error_position(path: Path) -> tuple[int, int] | None:
    """(line, byte offset) of the first byte sequence of ``path`` (``.gz`` decompressed) that is not valid UTF-8,
    or None if the whole file decodes. Lines count from 1 (``\\n``, ``\\r\\n`` and ``\\r`` end a line); the
    offset counts from 0 in the (decompressed) file. Used to report encoding errors; reads the file in 1 MiB chunks."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")()
    line, consumed, prev_cr = 1, 0, False
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                dec.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                # e.object = the bytes held back from the previous chunk (an unfinished sequence, no line end) + chunk
                pending = len(e.object) - len(chunk)
                return line + _lines_in(chunk[: max(e.start - pending, 0)], prev_cr), consumed - pending + e.start
            if not chunk:
                return None
            line += _lines_in(chunk, prev_cr)
            prev_cr = chunk.endswith(b"\r")
            consumed += len(chunk)


def _lines_in(b: bytes, prev_cr: bool) -> int:
    """Line ends in ``b`` (a ``\\r\\n`` split across the previous chunk's end counts once)."""
    n = len(_NEWLINE.findall(b))
    if prev_cr and b.startswith(b"\n"):
        n -= 1
    return n


def iter_documents(path: Path, kind: str, text_key: str = "text", text_unit: str = "line") -> Iterator[str]:
    """Documents of one input file (see the module docstring), empty / whitespace-only ones skipped.

    Raises PrepareError (naming the file) for malformed JSON (with the line), a missing field, a non-string text, a
    missing pyarrow, text that is not valid UTF-8 (with the line and byte offset), and an unreadable file
    (permissions, a corrupt ``.gz`` / parquet file, I/O errors)."""
    try:
        yield from _iter_documents(path, kind, text_key, text_unit)
    except UnicodeDecodeError as e:
        where = None
        if kind != "parquet":
            try:
                where = decode_error_position(path)
            except (OSError, EOFError, zlib.error):
                where = None
        loc = f"{path}:{where[0]}" if where else str(path)
        at = f" at byte {where[1]}" if where else ""
        raise PrepareError(
            f"{loc}: not valid UTF-8 ({e.reason}{at}); re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from None
    except (OSError, EOFError, zlib.error) as e:  # permissions, I/O, corrupt or truncated .gz
        why = getattr(e, "strerror", None) or " ".join(str(e).split()) or type(e).__name__
        raise PrepareError(f"input {path}: cannot read: {why}") from None


def _iter_documents(path: Path, kind: str, text_key: str, text_unit: str) -> Iterator[str]:
    if kind == "text":
        with _open_text(path) as f:
            if text_unit == "file":
                doc = f.read()
                if doc.strip():
                    yield doc
            elif text_unit == "line":
                for line in f:
                    line = line.rstrip("\r\n")
                    if line.strip():
                        yield line
            else:
                para: list[str] = []
                for line in f:
                    line = line.rstrip("\r\n")
                    if line.strip():
                        para.append(line)
                    elif para:
                        yield "\n".join(para)
                        para = []
                if para:
                    yield "\n".join(para)
    elif kind == "jsonl":
        with _open_text(path) as f:
            is_array = f.read(1 << 12).lstrip().startswith("[")
        with _open_text(path) as f:
            if is_array:
                try:
                    items = json.load(f)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}: invalid JSON array: {e}") from None
                for n, obj in enumerate(items):
                    doc = _field(obj, text_key, f"{path}[{n}]")
                    if doc.strip():
                        yield doc
                return
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}:{n}: invalid JSON: {e}") from None
                doc = _field(obj, text_key, f"{path}:{n}")
                if doc.strip():
                    yield doc
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError("reading parquet needs pyarrow: pip install pyarrow") from None
        try:
            pf = pq.ParquetFile(path)
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise PrepareError(f"input {path}: cannot read as parquet: {' '.join(str(e).split())}") from None
        if text_key not in pf.schema_arrow.names:
            raise PrepareError(
                f"{path}: no column {text_key!r} (columns: {', '.join(pf.schema_arrow.names)}); set --text-key"
            )
        for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
            for doc in batch.column(0).to_pylist():
                if doc is None:
                    continue
                if not isinstance(doc, str):
                    raise PrepareError(f"{path}: column {text_key!r} holds {type(doc).__name__}, expected strings")
                if doc.strip():
                    yield doc
    else:
        raise PrepareError(f"--format {kind!r} is not allowed; allowed: auto | text | jsonl | parquet")


def _field(obj: Any, key: str, where: str) -> str:
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict) or key not in obj:
        raise PrepareError(f"{where}: no field {key!r} (set --text-key)")
    v = obj[key]
    if v is None:
        return ""
    if not isinstance(v, str):
        raise PrepareError(f"{where}: field {key!r} is {type(v).__name__}, expected a string")
    return v


# ============================================================================================== splits
def split_hash(seed: int, idx: np.ndarray) -> np.ndarray:
    """float64 (n,) uniform in [0, 1): the split hash u_i of document indices ``idx`` (int64 (n,)) for ``seed``."""
    ns = stable_hash64("canonlm-text-split", int(seed))
    return to_unit(instance_keys(ns, np.zeros_like(idx), idx))


def assign_splits(u: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    """int8 (n,): 0 = train, 1 = val, 2 = test from hashes ``u`` (threshold rule of the module docstring, without
    the empty-split fallback)."""
    out = np.zeros(u.shape[0], dtype=np.int8)
    out[u < val_fraction] = 1
    out[(u >= val_fraction) & (u < val_fraction + test_fraction)] = 2
    return out


# ============================================================================================== writer
class _ShardWriter:
    """Append documents of one split to ``<split>_<k>.bin`` shards (+ index files)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._f = None
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._tokens = 0
        self._docs: list[tuple[int, int]] = []
        self.tokens = 0
        self.documents = 0

    def _open(self) -> None:
        k = len(self.shards)
        self._name = f"{self.split}_{k:05d}"
        self._f = open(self.root / f"{self._name}.bin", "wb")
        self._tokens = 0
        self._docs = []

    def _flush(self) -> None:
        if self._buf:
            self._f.write(b"".join(self._buf))
            self._buf, self._buf_bytes = [], 0

    def add(self, doc_index: int, ids: np.ndarray) -> None:
        if self._f is None:
            self._open()
        self._docs.append((doc_index, self._tokens))
        b = ids.astype(self.dtype, copy=False).tobytes()
        self._buf.append(b)
        self._buf_bytes += len(b)
        self._tokens += int(ids.shape[0])
        self.tokens += int(ids.shape[0])
        self.documents += 1
        if self._buf_bytes >= _WRITE_BUF:
            self._flush()
        if self._tokens >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        if self._f is None:
            return
        self._flush()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        idx = np.array(self._docs, dtype=np.int64).reshape(-1, 2)
        np.save(self.root / f"{self._name}.idx.npy", idx)
        self.shards.append(
            dict(
                file=f"{self._name}.bin", index=f"{self._name}.idx.npy", tokens=self._tokens, documents=len(self._docs)
            )
        )

    def finish(self) -> dict[str, Any]:
        self._close()
        return dict(tokens=self.tokens, documents=self.documents, shards=self.shards)


# ============================================================================================== small helpers
def _format_tag_ok(tag: Any) -> bool:
    return isinstance(tag, str) and tag.startswith(FORMAT.rsplit("-v", 1)[0] + "-v")


def _atomic_write(path: Path, text: str, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` via a unique temporary sibling, fsync (unless told not to) and ``os.replace`` (no
    reader sees a part)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read_json(path: Path) -> Any:
    """Parsed JSON of ``path``, or None if it does not exist or is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def check_out_dir(out: Path, force: bool) -> bool:
    """Whether ``--out`` may be (re)written: returns True if ``out`` exists and will be replaced, False if it does not
    exist or is an empty directory (used as is).

    Raises PrepareError naming the path and the reason when ``out`` is not a directory, is non-empty without
    ``force``, or (with ``force``) is a non-empty directory that is not a prepared corpus (no ``meta.json`` with a
    ``canonlm-text-v<N>`` format tag) -- such a directory is never deleted."""
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise PrepareError(
            f"--out {out} exists and is not a directory; choose another --out "
            "(--force only replaces a prepared corpus directory)"
        )
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise PrepareError(f"--out {out}: cannot list the existing directory: {e.strerror or e}") from None
    if empty:
        return False
    if not force:
        raise PrepareError(f"--out {out} already exists; pass --force to replace it")
    meta = out / META
    try:
        tag = json.loads(meta.read_text(encoding="utf-8")).get("format") if meta.is_file() else None
    except (OSError, ValueError, AttributeError):
        tag = None
    if not _format_tag_ok(tag):
        why = f"its {META} has no canonlm format tag (found {tag!r})" if meta.is_file() else f"it holds no {META}"
        raise PrepareError(
            f"--out {out} is a non-empty directory that is not a canonlm prepared corpus ({why}); "
            "refusing to delete it even with --force -- choose another --out or empty it yourself"
        )
    return True


# ============================================================================================== plan
_FLAGS = dict(
    fmt="--format",
    text_key="--text-key",
    text_unit="--text-unit",
    val_fraction="--val-fraction",
    test_fraction="--test-fraction",
    seed="--seed",
    shard_tokens="--shard-tokens",
    append_eos="--append-eos",
    eos_token="--eos-token",
)


def assign_units(sizes: Sequence[int], num_tasks: int) -> list[int]:
    """The task (0..num_tasks-1) of each work unit: largest unit first (ties: lower unit) to the task with the
    smallest total size so far (ties: lower task). Deterministic, so every array task computes the same map."""
    load = [0] * num_tasks
    owner = [0] * len(sizes)
    for u in sorted(range(len(sizes)), key=lambda u: (-int(sizes[u]), u)):
        t = min(range(num_tasks), key=lambda t: (load[t], t))
        owner[u] = t
        load[t] += int(sizes[u])
    return owner


def _plan_diff(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first difference between two plans as ``--flag: <there>, <now>`` text, or None if they agree."""
    if old.get("format") != new.get("format"):
        return f"plan format {old.get('format')!r} there, {new.get('format')!r} now"
    for k, flag in _FLAGS.items():
        a, b = old.get("options", {}).get(k), new["options"][k]
        if a != b:
            return f"{flag} {a!r} there, {b!r} now"
    a, b = old.get("tokenizer", {}), new["tokenizer"]
    if (a.get("sha256"), a.get("eos_id")) != (b["sha256"], b["eos_id"]):
        return (
            f"--tokenizer {a.get('path')} (sha256 {str(a.get('sha256'))[:12]}) there, {b['path']} "
            f"(sha256 {b['sha256'][:12]}) now"
        )
    ia, ib = old.get("inputs", []), new["inputs"]
    if len(ia) != len(ib):
        return f"--input: {len(ia)} files there, {len(ib)} now"
    for n, (x, y) in enumerate(zip(ia, ib)):
        if x.get("path") != y["path"]:
            return f"--input: file {n} is {x.get('path')} there, {y['path']} now"
        if (x.get("size"), x.get("mtime_ns")) != (y["size"], y["mtime_ns"]):
            return f"--input {y['path']} changed since (size {x.get('size')} -> {y['size']} bytes or modified)"
    return None


def _claim(out: Path, plan: dict[str, Any], force: bool, single: bool) -> tuple[Path, bool]:
    """Create or resume the work folder ``<out>/.prepare`` for ``plan``. Returns (work folder, fresh) -- fresh: this
    call started the preparation (so a failing single-task run may remove what it made). Raises PrepareError for an
    ``out`` that may not be used (see the module docstring) and for a resume with another plan."""
    work = out / WORK
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            check_out_dir(out, force)  # raises: not a directory
        try:
            names = {p.name for p in out.iterdir()}
        except OSError as e:
            raise PrepareError(f"--out {out}: cannot list the existing directory: {e.strerror or e}") from None
        if names and names != {WORK}:  # a complete corpus or someone else's files
            if check_out_dir(out, force):
                if not single:
                    raise PrepareError(f"--out {out} already exists; --force is allowed only with --num-tasks 1")
                shutil.rmtree(out)
        elif names == {WORK}:
            old = _read_json(work / "plan.json")
            diff = "no readable plan.json" if not isinstance(old, dict) else _plan_diff(old, plan)
            if diff is None:
                return work, False
            if not (force and single):
                raise PrepareError(
                    f"--out {out} holds an unfinished preparation made with other inputs or options "
                    f"({diff}); rerun with the same ones to resume, or pass --force (with "
                    "--num-tasks 1) to start over"
                )
            shutil.rmtree(work)
    try:
        for d in (out, work, work / "units", work / "counts", work / "done"):
            d.mkdir(parents=d is out, exist_ok=True)
    except OSError as e:
        blocker = next((a for a in (out, *out.parents) if a.exists() or a.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise PrepareError(
                f"--out {out}: cannot create the output folder {out.parent}: {blocker} is a file, not a folder"
            ) from None
        raise PrepareError(
            f"--out {out}: cannot create {e.filename or out} in the output folder {out.parent}: {e.strerror or e}"
        ) from None
    # the plan: first writer wins (os.link fails if it exists), later tasks compare
    tmp = work / f".plan.json.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.write_text(json.dumps(plan, indent=1))
    try:
        os.link(tmp, work / "plan.json")
        fresh = True
    except FileExistsError:
        fresh = False
    finally:
        tmp.unlink()
    if not fresh:
        diff = _plan_diff(_read_json(work / "plan.json") or {}, plan)
        if diff is not None:
            raise PrepareError(
                f"--out {out}: another task started this preparation with other inputs or options ({diff})"
            )
    return work, fresh


# ============================================================================================== work units
_G: dict[str, Any] = {}  # per-process state: work folder, plan, tokenizer


def _init_process(work: str, plan: dict[str, Any], single_threaded: bool) -> None:
    """ProcessPoolExecutor initializer: remember the work folder and plan; with several workers the tokenizer runs
    one thread per process (``TOKENIZERS_PARALLELISM=false``) so N workers use N cores, not N x cores."""
    if single_threaded:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _G.clear()
    _G.update(work=Path(work), plan=plan, tok=None)


def _tokenizer() -> TextTokenizer:
    if _G.get("tok") is None:
        t, o = _G["plan"]["tokenizer"], _G["plan"]["options"]
        _G["tok"] = TextTokenizer(t["path"], eos_token=o["eos_token"])
    return _G["tok"]


def _unit_name(u: int) -> str:
    return f"u{u:05d}"


def _count(u: int) -> dict[str, int]:
    """{documents, characters} of unit ``u`` (cached in ``.prepare/counts``; read from its file if missing)."""
    work, plan = _G["work"], _G["plan"]
    cache = _G.setdefault("counts", {})  # counts never change once written: read each file once per process
    if u in cache:
        return cache[u]
    f = work / "counts" / f"{_unit_name(u)}.json"
    c = _read_json(f)
    if c is None:
        inp, o = plan["inputs"][u], plan["options"]
        n = chars = 0
        for doc in iter_documents(Path(inp["path"]), inp["kind"], text_key=o["text_key"], text_unit=o["text_unit"]):
            n += 1
            chars += len(doc)
        c = dict(documents=n, characters=chars)
        _atomic_write(f, json.dumps(c), fsync=False)  # a lost count is recounted
    cache[u] = c
    return c


def _run_unit(u: int) -> dict[str, Any]:
    """Tokenize work unit ``u`` (input file ``u`` of the plan) unless its done marker exists. Returns its manifest
    (with ``skipped`` True if it was already done)."""
    work, plan = _G["work"], _G["plan"]
    name = _unit_name(u)
    done = work / "done" / f"{name}.json"
    m = _read_json(done)
    if m is not None:
        return dict(m, skipped=True)
    t0 = time.perf_counter()
    o, inp = plan["options"], plan["inputs"][u]
    first = sum(_count(v)["documents"] for v in range(u))  # this unit's first document index
    units = work / "units"
    tmp = units / f"{name}.tmp"  # one owner per unit: a folder of this name is a killed run's leftover
    for stale in (tmp, units / name):  # no done marker: half written, or complete but unconfirmed
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    tok = _tokenizer()
    dtype = np.dtype(dtype_for_vocab(plan["tokenizer"]["vocab_size"]))
    writers = [_ShardWriter(tmp, s, dtype, o["shard_tokens"]) for s in SPLITS]
    eos = np.array([tok.eos_id], dtype=np.int64) if o["append_eos"] else None
    low: list[list[Any]] = []  # the 2 train documents with the smallest u: [u, doc index, shard, row]
    n = chars = 0

    def process(batch: list[str]) -> None:
        nonlocal n
        ids_list = tok.encode_batch(batch)
        idx = np.arange(first + n, first + n + len(batch), dtype=np.int64)
        uu = split_hash(o["seed"], idx)
        sp = assign_splits(uu, o["val_fraction"], o["test_fraction"])
        for r, ids in enumerate(ids_list):
            arr = np.asarray(ids, dtype=np.int64)
            if eos is not None:
                arr = np.concatenate([arr, eos])
            w = writers[int(sp[r])]
            if sp[r] == 0:
                cand = [float(uu[r]), int(idx[r]), len(w.shards), len(w._docs) if w._f is not None else 0]
                if len(low) < 2 or cand < low[-1]:
                    low.append(cand)
                    low.sort()
                    del low[2:]
            w.add(int(idx[r]), arr)
        n += len(batch)

    batch: list[str] = []
    bchars = 0
    try:
        for doc in iter_documents(Path(inp["path"]), inp["kind"], text_key=o["text_key"], text_unit=o["text_unit"]):
            batch.append(doc)
            bchars += len(doc)
            chars += len(doc)
            if len(batch) >= _BATCH_DOCS or bchars >= _BATCH_CHARS:
                process(batch)
                batch, bchars = [], 0
        if batch:
            process(batch)
        splits = {s: w.finish() for s, w in zip(SPLITS, writers)}
    except BaseException:
        for w in writers:
            if w._f is not None:
                w._f.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counted = _read_json(work / "counts" / f"{name}.json")
    if counted is not None and counted.get("documents") != n:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(
            f"input {inp['path']} changed while it was being prepared ({counted.get('documents')} "
            f"documents counted, {n} tokenized); rerun with --force"
        )
    os.rename(tmp, units / name)
    if counted is None:
        _atomic_write(work / "counts" / f"{name}.json", json.dumps(dict(documents=n, characters=chars)), fsync=False)
    m = dict(
        unit=u,
        input=inp["path"],
        first_document=first,
        documents=n,
        characters=chars,
        tokens=sum(s["tokens"] for s in splits.values()),
        splits=splits,
        lowest_train=low,
        seconds=round(time.perf_counter() - t0, 3),
    )
    _atomic_write(done, json.dumps(m))
    return dict(m, skipped=False)


# ============================================================================================== finalize
def _pieces(work: Path, mans: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    out = []
    for m in mans:
        ud = work / "units" / _unit_name(m["unit"])
        for sh in m["splits"][split]["shards"]:
            out.append(
                dict(
                    bin=ud / sh["file"], idx=ud / sh["index"], tokens=sh["tokens"], documents=sh["documents"], keep=None
                )
            )
    return out


def _select(p: dict[str, Any], keep: list[int], dtype: np.dtype) -> dict[str, Any]:
    """Piece ``p`` restricted to rows ``keep`` of its index (tokens / documents recounted)."""
    idx = np.load(p["idx"])
    ends = np.append(idx[1:, 1], os.path.getsize(p["bin"]) // dtype.itemsize)
    keep = sorted(keep)
    return dict(p, keep=keep, tokens=int(sum(ends[r] - idx[r, 1] for r in keep)), documents=len(keep))


def _groups(pieces: list[dict[str, Any]], merge_below: int) -> list[list[dict[str, Any]]]:
    """Final shards of one split from its pieces (unit shards in unit order): consecutive pieces are gathered until
    a group holds >= ``merge_below`` tokens; a whole piece of that size stays at the head of its own group, and small
    pieces that come before it are appended to the previous group (or, at the start of the split, put in front of
    it). So every final shard holds >= merge_below tokens unless the split is smaller, and only small pieces are
    copied (a group's first whole piece is renamed, the others appended to it)."""
    groups: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    cur_t = 0
    for p in pieces:
        if p["tokens"] == 0:
            continue
        if p["keep"] is None and p["tokens"] >= merge_below:
            if cur and groups:
                groups[-1].extend(cur)
            elif cur:  # small pieces at the start of the split: in front of the first big one
                groups.append([*cur, p])
                cur, cur_t = [], 0
                continue
            groups.append([p])
            cur, cur_t = [], 0
            continue
        cur.append(p)
        cur_t += p["tokens"]
        if cur_t >= merge_below:
            groups.append(cur)
            cur, cur_t = [], 0
    if cur:
        if groups:
            groups[-1].extend(cur)
        else:
            groups.append(cur)
    return groups


def _append_docs(f: Any, p: dict[str, Any], pos: int, dtype: np.dtype) -> tuple[list[np.ndarray], int]:
    """Write the documents of piece ``p`` (all, or its ``keep`` rows) to the open file ``f``, whose end is at token
    ``pos``. Returns (their index rows with offsets from ``pos``, the new end)."""
    mm = np.memmap(p["bin"], dtype=dtype, mode="r")
    idx = np.load(p["idx"])
    rows = []
    if p["keep"] is None:
        f.write(mm.tobytes())
        rows.append(idx + np.array([0, pos], dtype=np.int64))
        pos += mm.shape[0]
    else:
        ends = np.append(idx[1:, 1], mm.shape[0])
        for r in p["keep"]:
            s, e = int(idx[r, 1]), int(ends[r])
            f.write(mm[s:e].tobytes())
            rows.append(np.array([[idx[r, 0], pos]], dtype=np.int64))
            pos += e - s
    del mm
    return rows, pos


def _write_group(out: Path, name: str, group: list[dict[str, Any]], dtype: np.dtype) -> dict[str, Any]:
    """Write one final shard ``<name>.bin`` + ``<name>.idx.npy`` from its pieces. A group that starts with a whole
    piece renames that piece's file (to ``.<name>.bin.part``) and appends the others to it; otherwise every document
    is copied into a temporary file. The index is always written anew. Idempotent: a shard in place is kept, and a
    ``.part`` file left by a killed finalize is cut back to its first piece and completed."""
    dbin, didx = out / f"{name}.bin", out / f"{name}.idx.npy"
    info = dict(
        file=dbin.name,
        index=didx.name,
        tokens=sum(p["tokens"] for p in group),
        documents=sum(p["documents"] for p in group),
    )
    if dbin.exists() and didx.exists():
        return info
    head = group[0]
    if head["keep"] is None:
        part = out / f".{dbin.name}.part"
        if head["bin"].exists():
            os.replace(head["bin"], part)
        elif not part.exists():
            raise PrepareError(f"finalize: {head['bin']} is missing (the work folder was changed); rerun with --force")
        rows, pos = [np.load(head["idx"])], head["tokens"]
        mode, rest = "r+b", group[1:]
    else:
        part = out / f".{dbin.name}.tmp-{os.getpid()}"
        rows, pos, mode, rest = [], 0, "wb", group
    if rest or mode == "wb" or part.stat().st_size != pos * dtype.itemsize:
        with open(part, mode) as f:
            if mode == "r+b":
                f.truncate(pos * dtype.itemsize)
                f.seek(0, os.SEEK_END)
            for p in rest:
                r, pos = _append_docs(f, p, pos, dtype)
                rows += r
            f.flush()
            os.fsync(f.fileno())
    tidx = out / f".{name}.idx.tmp-{os.getpid()}.npy"
    np.save(tidx, np.concatenate(rows).astype(np.int64).reshape(-1, 2))
    os.replace(tidx, didx)
    os.replace(part, dbin)
    return info


def _finalize(out: Path, work: Path, plan: dict[str, Any], *, explicit: bool) -> dict[str, Any] | None:
    """Merge the done units into the prepared directory (``meta.json`` last, then ``.prepare/`` removed).

    Returns the meta dict, or None when a unit is not done yet or another task holds the finalize lock (and
    ``explicit`` is False). Raises PrepareError when ``explicit`` and a unit is missing, or when a split with a
    positive fraction stays empty."""
    n_units = len(plan["inputs"])
    mans = [_read_json(work / "done" / f"{_unit_name(u)}.json") for u in range(n_units)]
    missing = [u for u, m in enumerate(mans) if m is None]
    if missing:
        if explicit:
            u = missing[0]
            raise PrepareError(
                f"--finalize: {len(missing)} of {n_units} work units are not done (first: "
                f"{plan['inputs'][u]['path']}); run the preparation (or its array tasks) again first"
            )
        return None
    try:
        os.close(os.open(work / "finalize.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if not explicit:
            return None
    try:
        return _merge(out, work, plan, mans)
    except PrepareError:
        (work / "finalize.lock").unlink(missing_ok=True)
        raise


def _merge(out: Path, work: Path, plan: dict[str, Any], mans: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of :func:`_finalize` once every unit is done and the lock is held."""
    n_units = len(mans)
    o = plan["options"]
    dtype = np.dtype(dtype_for_vocab(plan["tokenizer"]["vocab_size"]))
    n_docs = sum(m["documents"] for m in mans)
    if n_docs == 0:
        raise PrepareError("the input holds no non-empty document")
    pieces = {s: _pieces(work, mans, s) for s in SPLITS}
    # empty-split fallback: the train document(s) with the smallest u move to val, then test
    cands = sorted([c, m["unit"]] for m in mans for c in m["lowest_train"])
    for s, frac in (("val", o["val_fraction"]), ("test", o["test_fraction"])):
        if frac > 0 and sum(p["documents"] for p in pieces[s]) == 0 and cands:
            (_, _doc, k, row), unit = cands.pop(0)
            ud = work / "units" / _unit_name(unit)
            src = next(i for i, p in enumerate(pieces["train"]) if p["bin"] == ud / f"train_{k:05d}.bin")
            p = pieces["train"][src]
            rows = [r for r in (range(p["documents"]) if p["keep"] is None else p["keep"]) if r != row]
            pieces[s] = [_select(p, [row], dtype)]
            pieces["train"][src] = _select(p, rows, dtype)
    for s, frac in (("train", 1.0), ("val", o["val_fraction"]), ("test", o["test_fraction"])):
        if frac > 0 and sum(p["documents"] for p in pieces[s]) == 0:
            raise PrepareError(
                f"only {n_docs} document(s): split {s!r} would be empty; give more documents (or set its fraction to 0)"
            )
    merge_below = min(int(o["shard_tokens"]), MERGE_BELOW)
    splits = {}
    for s in SPLITS:
        shards = [_write_group(out, f"{s}_{k:05d}", g, dtype) for k, g in enumerate(_groups(pieces[s], merge_below))]
        splits[s] = dict(
            tokens=sum(x["tokens"] for x in shards), documents=sum(x["documents"] for x in shards), shards=shards
        )
    rule = (
        "val: u < val_fraction; test: val_fraction <= u < val_fraction + test_fraction; train: else; u = "
        "to_unit(instance_keys(stable_hash64('canonlm-text-split', seed), 0, doc_index)); an empty val/test "
        "takes the train document with the smallest u"
    )
    t = plan["tokenizer"]
    meta = dict(
        documents=n_docs,
        characters=sum(m["characters"] for m in mans),
        tokens=sum(v["tokens"] for v in splits.values()),
        split_rule=dict(seed=o["seed"], val_fraction=o["val_fraction"], test_fraction=o["test_fraction"], rule=rule),
        shard_tokens=o["shard_tokens"],
        splits=splits,
        format=FORMAT,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        inputs=[i["path"] for i in plan["inputs"]],
        input_formats=sorted({i["kind"] for i in plan["inputs"]}),
        text_key=o["text_key"],
        text_unit=o["text_unit"],
        tokenizer={k: t[k] for k in ("path", "kind", "sha256", "vocab_size", "eos_id", "eos_token")},
        vocab_size=t["vocab_size"],
        eos_id=t["eos_id"],
        append_eos=o["append_eos"],
        dtype=dtype.name,
        prepare=dict(plan_hash=stable_hash64(plan), units=n_units, merge_below=merge_below),
    )
    _atomic_write(out / META, json.dumps(meta, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return meta


# ============================================================================================== driver
def _task_from_env(num_tasks: int, task_index: int | None) -> int:
    env = os.environ
    if task_index is None:
        if num_tasks == 1:
            if int(env.get("SLURM_ARRAY_TASK_COUNT", "1") or 1) > 1:
                raise PrepareError(
                    f"running in a SLURM array of {env['SLURM_ARRAY_TASK_COUNT']} tasks with "
                    "--num-tasks 1: every task would prepare everything; pass --num-tasks "
                    f"{env['SLURM_ARRAY_TASK_COUNT']}"
                )
            return 0
        if "SLURM_ARRAY_TASK_ID" not in env:
            raise PrepareError(
                f"--num-tasks {num_tasks} needs --task-index (or SLURM_ARRAY_TASK_ID, set by sbatch --array)"
            )
        try:
            task_index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0") or 0)
        except ValueError:
            raise PrepareError(f"SLURM_ARRAY_TASK_ID {env['SLURM_ARRAY_TASK_ID']!r} is not an integer") from None
    if not 0 <= task_index < num_tasks:
        raise PrepareError(
            f"--task-index {task_index!r} is not allowed; allowed: 0 .. {num_tasks - 1} (--num-tasks "
            f"{num_tasks}; from SLURM: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN)"
        )
    return task_index


def prepare(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str = "auto",
    text_key: str = "text",
    text_unit: str = "line",
    val_fraction: float = 0.005,
    test_fraction: float = 0.005,
    seed: int = 0,
    shard_tokens: int = 1 << 28,
    append_eos: bool = False,
    eos_token: str | None = None,
    force: bool = False,
    progress: bool = True,
    workers: int = 1,
    num_tasks: int = 1,
    task_index: int | None = None,
) -> dict[str, Any] | None:
    """Tokenize ``inputs`` into a prepared directory ``out`` (rules in the module docstring).

    Args: as the CLI flags. ``inputs``: one ``--input`` spec (file, directory or glob) or a list of them.
        ``workers``: processes of this task. ``num_tasks`` / ``task_index``: this task's share of the work units
        (``task_index`` None = 0, or from ``SLURM_ARRAY_TASK_ID`` when ``num_tasks`` > 1).
    Returns the meta dict written to ``out/meta.json`` (for an array task: also when ``out`` was already complete
        with the same inputs and options), or None when this task did its units but others remain (the last task to
        finish finalizes; or :func:`finalize`).
    Raises PrepareError for bad options, missing / unreadable / non-UTF-8 inputs, a missing tokenizer, an existing
        ``out`` that may not be replaced (:func:`check_out_dir`), a resume with other inputs or options, an output
        folder that cannot be written, an eos needed but unknown, or a corpus too small to fill every split with a
        positive fraction. A fresh single-task run leaves nothing behind on error; otherwise the done units stay.
    """
    if text_unit not in TEXT_UNITS:
        raise PrepareError(f"--text-unit {text_unit!r} is not allowed; allowed: {' | '.join(TEXT_UNITS)}")
    if fmt not in ("auto", "text", "jsonl", "parquet"):
        raise PrepareError(f"--format {fmt!r} is not allowed; allowed: auto | text | jsonl | parquet")
    for name, v in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)):
        if not 0.0 <= v < 1.0:
            raise PrepareError(f"{name} {v!r} is not allowed; allowed: a number in [0, 1)")
    if val_fraction + test_fraction >= 1.0:
        raise PrepareError("--val-fraction + --test-fraction must be < 1 (train needs documents)")
    for name, v in (("--shard-tokens", shard_tokens), ("--workers", workers), ("--num-tasks", num_tasks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PrepareError(f"{name} {v!r} is not allowed; allowed: an integer >= 1")
    if force and num_tasks > 1:
        raise PrepareError(
            "--force is allowed only with --num-tasks 1 (array tasks start at different times and "
            "would delete each other's work); remove --out or run once without --num-tasks"
        )
    task_index = _task_from_env(num_tasks, task_index)
    out = Path(out).expanduser().resolve()
    specs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not specs:
        raise PrepareError("--input: no input given")
    files: list[Path] = []
    for spec in specs:
        files += resolve_inputs(str(spec), fmt)
    seen: dict[Path, int] = {}
    for f in files:
        if not f.is_file():
            raise PrepareError(f"input {f} does not exist")
        r = f.resolve()
        if r in seen:
            raise PrepareError(f"input {f} is given twice (--input names it more than once)")
        seen[r] = 1
    kinds = [_kind(f, fmt) for f in files]
    try:
        tok = TextTokenizer(tokenizer, eos_token=eos_token)
    except (ValueError, ImportError) as e:
        raise PrepareError(str(e)) from None
    except OSError as e:  # FileNotFoundError (its message names the path), PermissionError, I/O errors
        raise PrepareError(
            str(e)
            if isinstance(e, FileNotFoundError) and not e.filename
            else f"tokenizer {e.filename or tokenizer}: cannot read: {e.strerror or e}"
        ) from None
    if append_eos and tok.eos_id is None:
        raise PrepareError(f"--append-eos: tokenizer {tokenizer} has no EOS token; name one with --eos-token")
    ins = []
    for f, k in zip(files, kinds):
        st = f.stat()
        ins.append(dict(path=os.path.abspath(f), kind=k, size=st.st_size, mtime_ns=st.st_mtime_ns))
    opts = dict(
        fmt=fmt,
        text_key=text_key,
        text_unit=text_unit,
        val_fraction=float(val_fraction),
        test_fraction=float(test_fraction),
        seed=int(seed),
        shard_tokens=int(shard_tokens),
        append_eos=bool(append_eos),
        eos_token=eos_token,
    )
    plan = dict(format=PLAN_FORMAT, options=opts, tokenizer=tok.describe(), inputs=ins)
    single = num_tasks == 1
    if not single:  # an array task started again after the corpus was finished (e.g. requeued): nothing to do
        done = _read_json(out / META)
        if isinstance(done, dict) and (done.get("prepare") or {}).get("plan_hash") == stable_hash64(plan):
            if progress:
                print(
                    f"[prepare] task {task_index}/{num_tasks}: {out} is already complete (same inputs and options)",
                    file=sys.stderr,
                    flush=True,
                )
            return done
    existed = out.is_dir()
    work, fresh = _claim(out, plan, force, single)
    try:
        return _work(out, work, plan, workers=workers, num_tasks=num_tasks, task_index=task_index, progress=progress)
    except BaseException as e:
        if single and fresh and isinstance(e, (PrepareError, OSError)):
            shutil.rmtree(work if existed else out, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, PrepareError):
            raise PrepareError(f"--out {out}: cannot write {e.filename or out}: {e.strerror or e}") from None
        raise


def _work(
    out: Path, work: Path, plan: dict[str, Any], *, workers: int, num_tasks: int, task_index: int, progress: bool
) -> dict[str, Any] | None:
    """Run this task's work units (skipping done ones) with ``workers`` processes, then try to finalize."""
    owner = assign_units([i["size"] for i in plan["inputs"]], num_tasks)
    mine = [u for u, t in enumerate(owner) if t == task_index]
    done = [u for u in mine if (work / "done" / f"{_unit_name(u)}.json").is_file()]
    todo = [u for u in mine if u not in set(done)]
    n_units = len(plan["inputs"])
    tag = f"[prepare] task {task_index}/{num_tasks}: " if num_tasks > 1 else "[prepare] "
    if progress:
        print(
            f"{tag}{len(mine)} of {n_units} units are this task's; {len(done)} of them already done (kept), "
            f"{len(todo)} to prepare with {min(workers, max(len(todo), 1))} process(es)",
            file=sys.stderr,
            flush=True,
        )
    t0 = last = time.perf_counter()
    stats = dict(units=0, documents=0, tokens=0, characters=0)

    def note(m: dict[str, Any]) -> None:
        nonlocal last
        stats["units"] += 1
        if not m["skipped"]:
            for k in ("documents", "tokens", "characters"):
                stats[k] += m[k]
        now = time.perf_counter()
        if progress and (now - last > 2.0 or stats["units"] == len(todo)):
            last = now
            print(
                f"{tag}{stats['units']}/{len(todo)} units done (last: {Path(m['input']).name}); "
                f"{stats['documents']:,} docs, {stats['tokens']:,} tokens, "
                f"{stats['tokens'] / max(now - t0, 1e-9) / 1e6:.2f}M tokens/s",
                file=sys.stderr,
                flush=True,
            )

    if workers == 1 or len(todo) <= 1:
        _init_process(str(work), plan, single_threaded=False)
        for u in todo:
            note(_run_unit(u))
    else:
        import multiprocessing
        from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ProcessPoolExecutor(
            max_workers=min(workers, len(todo)),
            mp_context=ctx,
            initializer=_init_process,
            initargs=(str(work), plan, True),
        ) as ex:
            pending = {ex.submit(_run_unit, u) for u in todo}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in finished:
                    if f.exception() is not None:
                        for p in pending:
                            p.cancel()
                        raise f.exception()
                    note(f.result())
    if progress:
        dt = max(time.perf_counter() - t0, 1e-9)
        print(
            f"{tag}{stats['units']} units prepared, {len(done)} already done: {stats['documents']:,} docs, "
            f"{stats['tokens']:,} tokens, {stats['characters'] / 1e6:,.1f}M chars in {dt:.1f} s, "
            f"{stats['tokens'] / dt / 1e6:.2f}M tokens/s (done)",
            file=sys.stderr,
            flush=True,
        )
    return _finalize(out, work, plan, explicit=num_tasks == 1)


def finalize(out: str | os.PathLike) -> dict[str, Any]:
    """Finalize an array preparation by hand (``--finalize``): merge the done units of ``<out>/.prepare`` into the
    prepared directory. Returns the meta dict. Raises PrepareError if ``out`` holds no unfinished preparation or a
    unit is not done. Run it only when no task of that preparation is still running."""
    out = Path(out).expanduser().resolve()
    work = out / WORK
    plan = _read_json(work / "plan.json")
    if not isinstance(plan, dict):
        if (out / META).is_file() and _format_tag_ok((_read_json(out / META) or {}).get("format")):
            raise PrepareError(f"--finalize: {out} is already a complete prepared corpus")
        raise PrepareError(f"--finalize: {out} holds no unfinished preparation ({WORK}/plan.json is missing)")
    meta = _finalize(out, work, plan, explicit=True)
    assert meta is not None
    return meta


# ============================================================================================== CLI
def main(argv: list[str] | None = None) -> int:
    """Command line ``python -m canonlm.data.prepare`` (flags and rules in the module docstring; ``--help``).

    Args: argv: the arguments without the program name (None = ``sys.argv[1:]``).
    Returns the exit status: 0 = the corpus was written (a one-line summary on stdout; progress lines on stderr
        unless ``--quiet``), or this array task's units are done and others remain (a line saying so); 2 = a user
        error (:class:`PrepareError`: bad option values, missing / unreadable / non-UTF-8 input, missing tokenizer,
        an ``--out`` that may not be replaced, a resume with other inputs or options, an unwritable output folder,
        ...) reported as one line ``canonlm.data.prepare: error: <message>`` on stderr, nothing written by a fresh
        single-task run. argparse itself exits with status 2 (usage on stderr) for unknown or missing flags.
    """
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.data.prepare",
        description="Tokenize local text into token shards for task=text.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--input", action="append", help="a file, a directory (recursive) or a glob; repeat for more")
    ap.add_argument("--tokenizer", help="tokenizer.json or a local Hugging Face tokenizer directory")
    ap.add_argument(
        "--out",
        required=True,
        help="output directory (must not exist unless --force, or an unfinished "
        "preparation of the same inputs and options: resumed)",
    )
    ap.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"))
    ap.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    ap.add_argument("--text-unit", default="line", choices=TEXT_UNITS, help="document unit of text files")
    ap.add_argument("--val-fraction", type=float, default=0.005)
    ap.add_argument("--test-fraction", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=0, help="seed of the document -> split hash")
    ap.add_argument("--shard-tokens", type=int, default=1 << 28, help="close a shard after this many tokens")
    ap.add_argument("--append-eos", action="store_true", help="append the EOS id after every document")
    ap.add_argument("--eos-token", default=None, help="EOS token string (default: the tokenizer's)")
    ap.add_argument("--workers", type=int, default=1, help="worker processes of this task")
    ap.add_argument("--num-tasks", type=int, default=1, help="split the input files over this many tasks (nodes)")
    ap.add_argument(
        "--task-index",
        type=int,
        default=None,
        help="this task, 0..num-tasks-1 (default: $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN)",
    )
    ap.add_argument(
        "--finalize",
        action="store_true",
        help="only merge the done units of --out into meta.json + shards (after an array run)",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out, only if it is a prepared corpus (meta.json with a canonlm format "
        "tag); any other non-empty directory is never deleted",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    a = ap.parse_args(argv)
    if not a.finalize:
        missing = [f for f, v in (("--input", a.input), ("--tokenizer", a.tokenizer)) if v is None]
        if missing:
            ap.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        if a.finalize:
            meta = finalize(a.out)
        else:
            meta = prepare(
                a.input,
                a.tokenizer,
                a.out,
                fmt=a.format,
                text_key=a.text_key,
                text_unit=a.text_unit,
                val_fraction=a.val_fraction,
                test_fraction=a.test_fraction,
                seed=a.seed,
                shard_tokens=a.shard_tokens,
                append_eos=a.append_eos,
                eos_token=a.eos_token,
                force=a.force,
                progress=not a.quiet,
                workers=a.workers,
                num_tasks=a.num_tasks,
                task_index=a.task_index,
            )
    except (PrepareError, OSError) as e:  # OSError: a last resort, PrepareError covers the known cases
        print("canonlm.data.prepare: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    if meta is None:
        print(
            f"task done: {a.out} waits for the other tasks' units (the last task to finish finalizes; or run "
            f"python -m canonlm.data.prepare --finalize --out {a.out})"
        )
        return 0
    s = meta["splits"]
    print(
        f"wrote {a.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']}, vocab "
        f"{meta['vocab_size']:,}); train {s['train']['tokens']:,} / val {s['val']['tokens']:,} / test "
        f"{s['test']['tokens']:,} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
