"""Tokenize a local text corpus into memory-mappable token shards for the ``text`` task.

    python -m canonlm.data.prepare --input <file|dir|glob> --tokenizer <tokenizer.json | local HF tokenizer dir> \\
        --out <dir> [--format auto|text|jsonl|parquet] [--text-key text] [--text-unit line|paragraph|file] \\
        [--val-fraction 0.005] [--test-fraction 0.005] [--seed 0] [--shard-tokens N] [--append-eos] \\
        [--eos-token TOKEN] [--force]

Documents:
* ``text`` files (``.txt``, ``.text``, ``.md``; ``--format text``): ``--text-unit line`` (default) = one document per
  line (the usual layout of dumps such as one-article-per-line Wikipedia text), ``paragraph`` = blocks separated by
  blank lines, ``file`` = the whole file. The line break ending a line is not part of the document.
* ``jsonl`` (``.jsonl``, ``.ndjson``, ``.json``): one JSON object per line, text in field ``--text-key`` (a ``.json``
  file that starts with ``[`` is read as one array of objects or strings).
* ``parquet``: column ``--text-key`` (needs pyarrow).
* ``.gz`` files are decompressed on the fly (format from the inner suffix). Directories are searched recursively for
  these suffixes (with an explicit ``--format``: every non-hidden file); files are processed in sorted path order.
  Documents that are empty or whitespace-only are skipped and not counted; the remaining ones are numbered 0, 1, 2,
  ... in reading order (the *document index*).

Tokenization: the tokenizer's ids without special tokens; ``--append-eos`` appends the EOS id (the tokenizer's own,
or ``--eos-token``) after every document, so windows see document boundaries.

Splits: document i goes to val if ``u_i < val_fraction``, to test if ``val_fraction <= u_i < val_fraction +
test_fraction``, else to train, where ``u_i`` is a uniform hash of (seed, i) (SplitMix64, :mod:`canonlm.data.seeding`)
-- disjoint by construction and independent of the tokenizer. If a split with a positive fraction would stay empty
(tiny corpora), the train document(s) with the smallest ``u_i`` are moved there (val first, then test).

Errors (:class:`PrepareError`; the CLI prints one line ``canonlm.data.prepare: error: ...`` and exits with status 2):
bad options, missing / unreadable inputs (naming the file), input that is not valid UTF-8 (naming the file and the
line), malformed JSON, a missing tokenizer, an output folder that cannot be created or written, and an existing
``--out`` (see below).

Output (written to a temporary sibling directory and renamed into place at the end): ``meta.json``,
``<split>_<k:05d>.bin`` (raw ids, uint16 if vocab_size <= 65536 else uint32) and ``<split>_<k:05d>.idx.npy`` (int64
(documents, 2): document index, first token offset). A shard is closed once it holds at least ``--shard-tokens``
tokens (documents are never split across shards).

Existing ``--out``: an empty directory is simply used. Anything else is refused unless ``--force`` is given, and
``--force`` only ever replaces a directory that is a prepared corpus -- its ``meta.json`` carries the format tag
``"format": "canonlm-text-v<N>"``. A non-empty directory without that tag (or with an unreadable meta.json), or a
path that is not a directory, is never deleted: prepare stops with a PrepareError naming the path and the reason.
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
from typing import Any, Iterator

import numpy as np

from canonlm.data.seeding import instance_keys, stable_hash64, to_unit
from canonlm.data.text import FORMAT, META, SPLITS, TextTokenizer, dtype_for_vocab

SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
            ".parquet": "parquet"}
TEXT_UNITS = ("line", "paragraph", "file")
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
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".") and (
                fmt != "auto" or (f.suffixes[-2] if f.suffix == ".gz" and len(f.suffixes) >= 2 else f.suffix).lower()
                in SUFFIXES))
        except OSError as e:
            raise PrepareError(f"input directory {spec}: cannot list {e.filename or spec}: "
                               f"{e.strerror or e}") from None
        if not files:
            raise PrepareError(f"input directory {spec} holds no file with a known suffix "
                               f"({', '.join(sorted(SUFFIXES))}, optionally .gz)")
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
                return line + _lines_in(chunk[:max(e.start - pending, 0)], prev_cr), consumed - pending + e.start
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
        raise PrepareError(f"{loc}: not valid UTF-8 ({e.reason}{at}); re-encode the file as UTF-8, e.g. "
                           "iconv -f latin1 -t utf-8") from None
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
            raise PrepareError(f"{path}: no column {text_key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                               "set --text-key")
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
        self.shards.append(dict(file=f"{self._name}.bin", index=f"{self._name}.idx.npy", tokens=self._tokens,
                                documents=len(self._docs)))

    def finish(self) -> dict[str, Any]:
        self._close()
        return dict(tokens=self.tokens, documents=self.documents, shards=self.shards)


# ============================================================================================== driver
def _format_tag_ok(tag: Any) -> bool:
    return isinstance(tag, str) and tag.startswith(FORMAT.rsplit("-v", 1)[0] + "-v")


def check_out_dir(out: Path, force: bool) -> bool:
    """Whether ``--out`` may be (re)written: returns True if ``out`` exists and will be replaced, False if it does not
    exist or is an empty directory (used as is).

    Raises PrepareError naming the path and the reason when ``out`` is not a directory, is non-empty without
    ``force``, or (with ``force``) is a non-empty directory that is not a prepared corpus (no ``meta.json`` with a
    ``canonlm-text-v<N>`` format tag) -- such a directory is never deleted."""
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a directory; choose another --out "
                           "(--force only replaces a prepared corpus directory)")
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
        why = (f"its {META} has no canonlm format tag (found {tag!r})" if meta.is_file()
               else f"it holds no {META}")
        raise PrepareError(f"--out {out} is a non-empty directory that is not a canonlm prepared corpus ({why}); "
                           "refusing to delete it even with --force -- choose another --out or empty it yourself")
    return True


def prepare(inputs: str | list[str | Path], tokenizer: str | os.PathLike, out: str | os.PathLike, *,
            fmt: str = "auto", text_key: str = "text", text_unit: str = "line", val_fraction: float = 0.005,
            test_fraction: float = 0.005, seed: int = 0, shard_tokens: int = 1 << 28, append_eos: bool = False,
            eos_token: str | None = None, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Tokenize ``inputs`` into a prepared directory ``out`` (rules in the module docstring).

    Args: as the CLI flags (``inputs``: one ``--input`` spec or a list of files).
    Returns the meta dict written to ``out/meta.json``.
    Raises PrepareError for bad options, missing / unreadable / non-UTF-8 inputs, a missing tokenizer, an existing
        ``out`` that may not be replaced (:func:`check_out_dir`), an output folder that cannot be written, an eos
        needed but unknown, or a corpus too small to fill every split with a positive fraction. Nothing is left
        behind on error (the temporary directory is removed; an existing ``out`` is untouched).
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
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {shard_tokens!r} is not allowed; allowed: an integer >= 1")
    out = Path(out).expanduser().resolve()
    check_out_dir(out, force)
    files = resolve_inputs(inputs, fmt) if isinstance(inputs, (str, os.PathLike)) else [Path(f) for f in inputs]
    for f in files:
        if not f.is_file():
            raise PrepareError(f"input {f} does not exist")
    kinds = [_kind(f, fmt) for f in files]
    try:
        tok = TextTokenizer(tokenizer, eos_token=eos_token)
    except (ValueError, ImportError) as e:
        raise PrepareError(str(e)) from None
    except OSError as e:  # FileNotFoundError (its message names the path), PermissionError, I/O errors
        raise PrepareError(str(e) if isinstance(e, FileNotFoundError) and not e.filename else
                           f"tokenizer {e.filename or tokenizer}: cannot read: {e.strerror or e}") from None
    if append_eos and tok.eos_id is None:
        raise PrepareError(f"--append-eos: tokenizer {tokenizer} has no EOS token; name one with --eos-token")
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size))

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        blocker = next((a for a in (out.parent, *out.parent.parents) if a.exists() or a.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise PrepareError(f"--out {out}: cannot create the output folder {out.parent}: {blocker} is a file, "
                               "not a folder") from None
        raise PrepareError(f"--out {out}: cannot create {e.filename or tmp} in the output folder {out.parent}: "
                           f"{e.strerror or e}") from None
    try:
        meta = _run(files, kinds, tok, tmp, dtype=dtype, text_key=text_key, text_unit=text_unit,
                    val_fraction=val_fraction, test_fraction=test_fraction, seed=seed, shard_tokens=shard_tokens,
                    append_eos=append_eos, progress=progress)
        meta.update(format=FORMAT, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    inputs=[str(f.resolve()) for f in files], input_formats=sorted(set(kinds)), text_key=text_key,
                    text_unit=text_unit, tokenizer=tok.describe(), vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                    append_eos=append_eos, dtype=dtype.name)
        mtmp = tmp / f".{META}.tmp"
        mtmp.write_text(json.dumps(meta, indent=1))
        os.replace(mtmp, tmp / META)
        trash = None
        if check_out_dir(out, force):  # re-checked: the directory may have changed while we were tokenizing
            trash = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, trash)
        elif out.is_dir():
            out.rmdir()  # empty
        try:
            os.rename(tmp, out)
        except OSError:
            if trash is not None:  # put the previous corpus back
                os.rename(trash, out)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(f"--out {out}: cannot write {e.filename or tmp}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _run(files: list[Path], kinds: list[str], tok: TextTokenizer, root: Path, *, dtype: np.dtype, text_key: str,
         text_unit: str, val_fraction: float, test_fraction: float, seed: int, shard_tokens: int, append_eos: bool,
         progress: bool) -> dict[str, Any]:
    writers = [_ShardWriter(root, s, dtype, shard_tokens) for s in SPLITS]
    eos = np.array([tok.eos_id], dtype=np.int64) if append_eos else None
    # train documents held back (smallest hash first) in case val/test would stay empty (tiny corpora)
    need_val, need_test = val_fraction > 0, test_fraction > 0
    held: list[tuple[float, int, np.ndarray]] = []
    n_docs = 0
    n_chars = 0
    t0 = last = time.perf_counter()

    def report(final: bool = False) -> None:
        dt = max(time.perf_counter() - t0, 1e-9)
        ntok = sum(w.tokens for w in writers) + sum(int(h[2].shape[0]) for h in held)
        print(f"[prepare] {n_docs:,} docs, {ntok:,} tokens, {n_chars / 1e6:,.1f}M chars, "
              f"{ntok / dt / 1e6:.2f}M tokens/s" + (" (done)" if final else ""), file=sys.stderr, flush=True)

    def process(batch: list[str]) -> None:
        nonlocal n_docs, held
        ids_list = tok.encode_batch(batch)
        idx = np.arange(n_docs, n_docs + len(batch), dtype=np.int64)
        u = split_hash(seed, idx)
        sp = assign_splits(u, val_fraction, test_fraction)
        for r, ids in enumerate(ids_list):
            arr = np.asarray(ids, dtype=np.int64)
            if eos is not None:
                arr = np.concatenate([arr, eos])
            s = int(sp[r])
            if s == 0 and ((need_val and writers[1].documents == 0) or (need_test and writers[2].documents == 0)):
                held.append((float(u[r]), int(idx[r]), arr))
                held.sort(key=lambda h: h[0])
                while len(held) > 2:
                    _, i, a = held.pop()
                    writers[0].add(i, a)
                continue
            writers[s].add(int(idx[r]), arr)
            if held and not ((need_val and writers[1].documents == 0) or (need_test and writers[2].documents == 0)):
                for _, i, a in sorted(held, key=lambda h: h[1]):
                    writers[0].add(i, a)
                held = []
        n_docs += len(batch)

    batch: list[str] = []
    chars = 0
    for f, kind in zip(files, kinds):
        for doc in iter_documents(f, kind, text_key=text_key, text_unit=text_unit):
            batch.append(doc)
            chars += len(doc)
            n_chars += len(doc)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                process(batch)
                batch, chars = [], 0
                if progress and time.perf_counter() - last > 2.0:
                    report()
                    last = time.perf_counter()
    if batch:
        process(batch)
    # empty-split fallback: move the held train documents with the smallest hash
    held.sort(key=lambda h: h[0])
    if need_val and writers[1].documents == 0 and held:
        _, i, a = held.pop(0)
        writers[1].add(i, a)
    if need_test and writers[2].documents == 0 and held:
        _, i, a = held.pop(0)
        writers[2].add(i, a)
    for _, i, a in sorted(held, key=lambda h: h[1]):
        writers[0].add(i, a)
    if progress:
        report(final=True)
    splits = {s: w.finish() for s, w in zip(SPLITS, writers)}
    if n_docs == 0:
        raise PrepareError("the input holds no non-empty document")
    for s, frac in (("train", 1.0), ("val", val_fraction), ("test", test_fraction)):
        if frac > 0 and splits[s]["documents"] == 0:
            raise PrepareError(f"only {n_docs} document(s): split {s!r} would be empty; give more documents "
                               "(or set its fraction to 0)")
    rule = ("val: u < val_fraction; test: val_fraction <= u < val_fraction + test_fraction; train: else; u = "
            "to_unit(instance_keys(stable_hash64('canonlm-text-split', seed), 0, doc_index)); an empty val/test "
            "takes the train document(s) with the smallest u")
    return dict(documents=n_docs, characters=n_chars, tokens=sum(v["tokens"] for v in splits.values()),
                split_rule=dict(seed=seed, val_fraction=val_fraction, test_fraction=test_fraction, rule=rule),
                shard_tokens=shard_tokens, splits=splits)


# ============================================================================================== CLI
def main(argv: list[str] | None = None) -> int:
    """Command line ``python -m canonlm.data.prepare`` (flags and rules in the module docstring; ``--help``).

    Args: argv: the arguments without the program name (None = ``sys.argv[1:]``).
    Returns the exit status: 0 = the corpus was written (a one-line summary on stdout; progress lines on stderr
        unless ``--quiet``); 2 = a user error (:class:`PrepareError`: bad option values, missing / unreadable /
        non-UTF-8 input, missing tokenizer, an ``--out`` that may not be replaced, an unwritable output folder, ...)
        reported as one line ``canonlm.data.prepare: error: <message>`` on stderr, nothing written.
        argparse itself exits with status 2 (usage on stderr) for unknown or missing flags.
    """
    ap = argparse.ArgumentParser(prog="python -m canonlm.data.prepare",
                                 description="Tokenize local text into token shards for task=text.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--input", required=True, help="a file, a directory (recursive) or a glob")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or a local Hugging Face tokenizer directory")
    ap.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    ap.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"))
    ap.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    ap.add_argument("--text-unit", default="line", choices=TEXT_UNITS, help="document unit of text files")
    ap.add_argument("--val-fraction", type=float, default=0.005)
    ap.add_argument("--test-fraction", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=0, help="seed of the document -> split hash")
    ap.add_argument("--shard-tokens", type=int, default=1 << 28, help="close a shard after this many tokens")
    ap.add_argument("--append-eos", action="store_true", help="append the EOS id after every document")
    ap.add_argument("--eos-token", default=None, help="EOS token string (default: the tokenizer's)")
    ap.add_argument("--force", action="store_true",
                    help="replace an existing --out, only if it is a prepared corpus (meta.json with a canonlm format "
                         "tag); any other non-empty directory is never deleted")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    a = ap.parse_args(argv)
    try:
        meta = prepare(a.input, a.tokenizer, a.out, fmt=a.format, text_key=a.text_key, text_unit=a.text_unit,
                       val_fraction=a.val_fraction, test_fraction=a.test_fraction, seed=a.seed,
                       shard_tokens=a.shard_tokens, append_eos=a.append_eos, eos_token=a.eos_token, force=a.force,
                       progress=not a.quiet)
    except (PrepareError, OSError) as e:  # OSError: a last resort, PrepareError covers the known cases
        print("canonlm.data.prepare: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    s = meta["splits"]
    print(f"wrote {a.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']}, vocab "
          f"{meta['vocab_size']:,}); train {s['train']['tokens']:,} / val {s['val']['tokens']:,} / test "
          f"{s['test']['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
