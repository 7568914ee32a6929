"""Real-text pretraining from prepared token shards: the ``text`` task and its stream.

A corpus is tokenized once by ``python -m canonlm.data.prepare`` (:mod:`canonlm.data.prepare`) into a *prepared
directory*::

    <data_dir>/meta.json                    format, tokenizer (path, kind, sha256), vocab_size, eos_id, dtype,
                                            split rule, per-split shard list with token / document counts
    <data_dir>/<split>_<k:05d>.bin          raw token ids (uint16 if vocab_size <= 65536, else uint32), memory-mapped
    <data_dir>/<split>_<k:05d>.idx.npy      int64 (n_docs, 2): [document index, first token offset] per document

Documents are assigned to train / val / test by a seeded hash of their index (disjoint by construction).

Windows (this module). With window length T, shard s of a split holds ``floor(tokens_s / T)`` non-overlapping *slots*
(slot j = tokens ``[j*T, (j+1)*T)``; the < T leftover tokens of a shard are never used; windows never cross a shard).
With S slots in the split, window ``w`` is slot ``perm_e(w mod S)`` where ``e = w // S`` is the epoch and
``perm_e`` a seeded pseudo-random permutation of ``[0, S)`` (a 4-round Feistel network on the next even power of two,
cycle-walked into range; key = hash of (seed, split, e)). So window w is a pure function of (seed, split, w, prepared
data), costs O(1) memory (no permutation table), every epoch visits every slot exactly once, and the stream is the
same for any world size, DataLoader worker count and after resume (same contract as
:class:`canonlm.data.stream.SyntheticStream`).

Mixtures (``task.sources``: several prepared corpora with weights and repetition caps, or concatenated in order as
the paper's Result 12) keep that contract: a mixture window is a pure function of (seed, split, T, w) too, and is
the window its source would give alone at that source's own index (:class:`TextTask` for the rules).

Per-token outputs (B, T): ``tokens`` int64, ``loss_mask`` bool (all True except position 0: every token is a
target), ``answer_id`` int32 (all -1: nothing is "scored"; the metric is the loss / perplexity), ``group`` int32 (0);
a mixture's batches also carry ``source`` int64 (B,), and with ``task.doc_mask`` ``doc_ids`` int32 (B, T) (the
document index of each token within its window row, from the shards' ``idx.npy`` offsets).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from canonlm.data import ConfigError
from canonlm.data.seeding import GOLDEN, mix64, stable_hash64
from canonlm.data.stream import StepStream, check_arg_int
from canonlm.data.tasks._common import check_int, excl_cumsum, merge_config

FORMAT = "canonlm-text-v1"
META = "meta.json"
SPLITS = ("train", "val", "test")
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
)


# ============================================================================================== tokenizers
def tokenizer_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a tokenizer: the file itself, or for a directory the sorted (name, bytes) of its tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``, ``*.model``, vocab/merges files; model weights are ignored).
    Raises FileNotFoundError if the path does not exist."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and (f.name in _TOKENIZER_FILES or f.suffix == ".model"))
    else:
        raise FileNotFoundError(f"tokenizer: {path} does not exist")
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class TextTokenizer:
    """A local Hugging Face tokenizer behind one small interface (never touches the network).

    Args:
        path: a ``tokenizer.json`` file (loaded with ``tokenizers.Tokenizer.from_file``), or a directory: loaded with
            ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`` when it holds a
            ``tokenizer_config.json`` (or no ``tokenizer.json``) and transformers is installed, else its
            ``tokenizer.json`` with the ``tokenizers`` library.
        eos_token: the end-of-document token (string); None = the tokenizer's own EOS (transformers) or the first of
            ``EOS_CANDIDATES`` in the vocabulary (tokenizers); ``eos_id`` is None if there is none.
    Attributes: path (str, absolute), kind (``"tokenizers"`` | ``"transformers"``), vocab_size (int: largest id + 1,
        added tokens included), eos_id (int | None), eos_token (str | None), sha256 (:func:`tokenizer_sha256`).
    Raises FileNotFoundError for a missing path, ValueError for an unusable path or unknown ``eos_token``,
        ImportError (with the pip command) if the needed library is missing.
    """

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(
                f"tokenizer: {path} does not exist (expected a tokenizer.json file or a local "
                "Hugging Face tokenizer directory)"
            )
        self.path = str(p.resolve())
        self._hf = None
        self._tk = None
        use_tf = p.is_dir() and ((p / "tokenizer_config.json").is_file() or not (p / "tokenizer.json").is_file())
        if use_tf:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                if not (p / "tokenizer.json").is_file():
                    raise ImportError(f"tokenizer: {path} needs transformers (pip install transformers)") from None
                use_tf = False
        if use_tf:
            try:
                self._hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            except Exception as e:  # noqa: BLE001 -- report any loader failure with the path
                raise ValueError(
                    f"tokenizer: cannot load {path} with transformers.AutoTokenizer (local_files_only=True): {e}"
                ) from None
            self.kind = "transformers"
            vocab = self._hf.get_vocab()
            self.vocab_size = max(len(self._hf), max(vocab.values()) + 1 if vocab else 0)
            if eos_token is None:
                self.eos_id = self._hf.eos_token_id
            else:
                self.eos_id = self._hf.convert_tokens_to_ids(eos_token)
                if self.eos_id is None or self.eos_id == self._hf.unk_token_id and eos_token != self._hf.unk_token:
                    raise ValueError(f"tokenizer: eos token {eos_token!r} is not in the vocabulary of {path}")
        else:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ImportError("tokenizer: the tokenizers library is needed (pip install tokenizers)") from None
            f = p if p.is_file() else p / "tokenizer.json"
            try:
                self._tk = Tokenizer.from_file(str(f))
            except Exception as e:  # noqa: BLE001 -- tokenizers raises its own exception types; re-raised as one clear error
                raise ValueError(f"tokenizer: cannot load {f} with tokenizers.Tokenizer.from_file: {e}") from None
            self.kind = "tokenizers"
            vocab = self._tk.get_vocab(with_added_tokens=True)
            self.vocab_size = max(
                self._tk.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1 if vocab else 0
            )
            if eos_token is None:
                self.eos_id = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
            else:
                if eos_token not in vocab:
                    raise ValueError(f"tokenizer: eos token {eos_token!r} is not in the vocabulary of {path}")
                self.eos_id = vocab[eos_token]
        self.eos_token = None if self.eos_id is None else self.id_to_token(self.eos_id)
        self.sha256 = tokenizer_sha256(p)

    # ------------------------------------------------------------------ interface
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no BOS/EOS added)."""
        if self._tk is not None:
            return self._tk.encode(text, add_special_tokens=False).ids
        return list(self._hf.encode(text, add_special_tokens=False))

    __call__ = encode

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of many texts (parallel inside the Rust tokenizer)."""
        if not texts:
            return []
        if self._tk is not None:
            return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]
        return [list(x) for x in self._hf(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped by default)."""
        ids = [int(i) for i in ids]
        if self._tk is not None:
            return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary string of id ``i`` (None if unused)."""
        if self._tk is not None:
            return self._tk.id_to_token(int(i))
        return self._hf.convert_ids_to_tokens(int(i))

    def as_transformers(self):
        """This tokenizer as a transformers tokenizer object: the loaded ``AutoTokenizer`` (kind ``transformers``) or
        a ``PreTrainedTokenizerFast`` around the ``tokenizers.Tokenizer`` (kind ``tokenizers``); no token is added.
        Raises ImportError when transformers is not installed."""
        if self._hf is not None:
            return self._hf
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self._tk)

    def describe(self) -> dict[str, Any]:
        """JSON-able identity: path, kind, sha256, vocab_size, eos_id, eos_token."""
        return dict(
            path=self.path,
            kind=self.kind,
            sha256=self.sha256,
            vocab_size=self.vocab_size,
            eos_id=self.eos_id,
            eos_token=self.eos_token,
        )


def load_tokenizer(path: str | os.PathLike, eos_token: str | None = None) -> TextTokenizer:
    """:class:`TextTokenizer` of a local tokenizer file/dir (see there for the rules and errors)."""
    return TextTokenizer(path, eos_token=eos_token)


# ============================================================================================== meta / shards
def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` if every id of a ``vocab_size`` vocabulary fits in 16 bits, else ``"uint32"``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``<data_dir>/meta.json`` of a prepared directory.

    Returns the meta dict. Raises ValueError (message names the problem) for a missing directory / meta.json, a wrong
    format, a missing shard or a shard whose size disagrees with its recorded token count.
    """
    d = Path(data_dir)
    if not d.is_dir():
        raise ValueError(f"{data_dir} is not a directory")
    f = d / META
    if not f.is_file():
        raise ValueError(f"{data_dir} has no {META} (prepare it with python -m canonlm.data.prepare)")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f}: format {meta.get('format')!r}, expected {FORMAT!r}")
    dtype = meta.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{f}: dtype {dtype!r}, expected uint16 | uint32")
    item = np.dtype(dtype).itemsize
    for split in SPLITS:
        info = meta.get("splits", {}).get(split)
        if info is None:
            raise ValueError(f"{f}: split {split!r} missing")
        for sh in info["shards"]:
            p = d / sh["file"]
            if not p.is_file():
                raise ValueError(f"{data_dir}: shard {sh['file']} is missing")
            if p.stat().st_size != sh["tokens"] * item:
                raise ValueError(
                    f"{data_dir}: shard {sh['file']} has {p.stat().st_size} bytes, expected "
                    f"{sh['tokens']} tokens x {item} bytes"
                )
    return meta


# ============================================================================================== permutation
_ROUNDS = 4


def feistel_permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Seeded pseudo-random permutation of ``[0, n)``, elementwise.

    Args:
        x: int64 array of values in [0, n). n: domain size (>= 1). keys: uint64 array broadcastable to x (one key =
            one permutation).
    Returns int64 array (x's shape): ``perm_key(x)``; for a fixed key the map is a bijection of [0, n).
    Method: 4-round balanced Feistel network on ``2**m`` values (m = the even number of bits >= log2 n), round
    function = SplitMix64 finaliser of (half-block, round key); values that land outside [0, n) are re-encrypted
    until they fall inside (cycle walking, which keeps the restriction a bijection; < 4 passes expected).
    """
    x = np.asarray(x, dtype=np.int64)
    shape = x.shape
    x = x.reshape(-1)
    n = int(n)
    if n < 1:
        raise ValueError(f"n={n!r} is not allowed; allowed: an integer >= 1")
    if n == 1:
        return np.zeros(shape, dtype=np.int64)
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = np.broadcast_to(np.asarray(keys, dtype=np.uint64), shape).reshape(-1)
    rk = [mix64(keys + np.uint64(((r + 1) * int(GOLDEN)) % 2**64)) for r in range(_ROUNDS)]

    def enc(v: np.ndarray, sel: np.ndarray | slice) -> np.ndarray:
        left, right = v >> half, v & mask
        for r in range(_ROUNDS):
            f = mix64(right * GOLDEN ^ rk[r][sel]) & mask
            left, right = right, left ^ f
        return (left << half) | right

    y = enc(x.astype(np.uint64), slice(None))
    out = y.copy()
    todo = np.nonzero(out >= np.uint64(n))[0]
    while todo.size:
        v = enc(out[todo], todo)
        out[todo] = v
        todo = todo[v >= np.uint64(n)]
    return out.astype(np.int64).reshape(shape)


# ============================================================================================== task
_DEFAULTS: dict[str, Any] = dict(
    name="text",
    data_dir=None,
    sources=None,
    mix="weighted",
    context=1024,
    seed=0,
    tail="drop",
    vocab_multiple=1,
    doc_mask=False,
    vocab_size=None,
    tokenizer_name=None,
)
KEYS = tuple(_DEFAULTS)
#: Keys added after the first text release, with their defaults: a checkpoint written before them (its task config
#: lacks them) resumes when they hold these values (``canonlm.train.run``).
ADDED_KEYS: dict[str, Any] = dict(sources=None, mix="weighted", doc_mask=False)
#: Keys that describe the tokenizer a corpus is (to be) prepared with, for planning before it exists
#: (``python -m canonlm.estimate``; :class:`TextPlan`): ``vocab_size`` (its vocabulary; null = the corpus' meta.json
#: alone) and ``tokenizer_name`` (a human name for printouts). A prepared corpus' own meta.json always gives the
#: vocabulary the model is built with; they change nothing that trains, so a resumed run does not compare them.
PLAN_KEYS = ("vocab_size", "tokenizer_name")
#: The task keys that name a prepared corpus (``task.data_dir`` and ``task.sources.<name>.data_dir``).
_CORPUS_KEYS = ("data_dir", "sources")
#: ``task.mix`` options: ``weighted`` (each source at its weight, block-deterministic) | ``concat`` (the sources'
#: slots concatenated in the listed order, one permutation over all of them: the paper's Result 12).
MIX_MODES = ("weighted", "concat")
#: Windows per block of the weighted schedule: every block of ``MIX_BLOCK`` consecutive training windows holds
#: exactly ``counts[s]`` windows of source s (the weights apportioned to the block by largest remainder), in a
#: seeded order; a weight below 1 / MIX_BLOCK of the total is refused.
MIX_BLOCK = 1 << 16
_SOURCE_KEYS = ("data_dir", "weight", "max_epochs")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DD_ALLOWED = "a directory written by `python -m canonlm.data.prepare` (meta.json + token shards)"
_SAME_TOKENIZER = (
    ("tokenizer sha256", ("tokenizer", "sha256")),
    ("vocab_size", ("vocab_size",)),
    ("eos_id", ("eos_id",)),
    ("dtype", ("dtype",)),
)


def round_vocab(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (``task.vocab_multiple``): the model's embedding rows."""
    return -(-int(vocab) // int(multiple)) * int(multiple)


def _tokenizer_label(name: str | None) -> str:
    return f"the {name} tokenizer" if name else "the tokenizer task.vocab_size declares"


def _check_settings(task: Any, c: Mapping[str, Any]) -> None:
    """Check the keys of a text task config ``c`` (defaults merged) that name no corpus and set them on ``task``:
    context, seed, tail, vocab_multiple, doc_mask, mix, and the plan keys (:data:`PLAN_KEYS`) as
    ``declared_vocab_size`` (int or None) and ``tokenizer_name`` (str or None). Raises ConfigError naming the key."""
    task.context = check_int("context", c["context"], 2)
    task.seed = check_int("seed", c["seed"], 0)
    if c["tail"] != "drop":
        raise ConfigError("task.tail", c["tail"], "drop (text windows are contiguous token slices; nothing is cut)")
    task.tail = "drop"
    task.vocab_multiple = check_int("vocab_multiple", c["vocab_multiple"], 1)
    if not isinstance(c["doc_mask"], bool):
        raise ConfigError(
            "task.doc_mask",
            c["doc_mask"],
            "true or false (batches carry doc_ids: the document index of every token within its window)",
        )
    task.doc_mask = c["doc_mask"]
    if c["mix"] not in MIX_MODES:
        raise ConfigError("task.mix", c["mix"], " | ".join(MIX_MODES))
    task.mix = c["mix"]
    v = c["vocab_size"]
    task.declared_vocab_size = (
        None
        if v is None
        else check_int(
            "vocab_size",
            v,
            2,
            allowed="null (the prepared corpus' meta.json gives the vocabulary) or an integer >= 2: "
            "the vocabulary of the tokenizer the corpus is prepared with (Llama-2 32000, Llama-3 128256), which an "
            "estimate uses before the corpus exists",
        )
    )
    t = c["tokenizer_name"]
    if t is not None and not (isinstance(t, str) and t.strip()):
        raise ConfigError(
            "task.tokenizer_name",
            t,
            "null or a non-empty name of the tokenizer task.vocab_size describes, for printouts (e.g. Llama-2)",
        )
    if t is not None and v is None:
        raise ConfigError(
            "task.tokenizer_name",
            t,
            "null while task.vocab_size is null (it names the tokenizer whose vocabulary task.vocab_size declares)",
        )
    task.tokenizer_name = None if t is None else t.strip()


class _Layout:
    """Slots of one split for one window length T over the shards of every source (in source order): shard files,
    their document-index files, slots per shard and their cumulative sum, and where each source's slots start.

    Attributes: files / index_files (list[Path]), T, slots (int64 (shards,)), cum (int64 (shards+1,): first slot of
    each shard), total (slots of the split), src_start (int64 (sources+1,): first slot of each source), src_slots
    (int64 (sources,): slots of each source)."""

    def __init__(
        self,
        files: list[Path],
        tokens: list[int],
        T: int,
        index_files: list[Path] | None = None,
        shard_source: list[int] | None = None,
        n_sources: int = 1,
    ):
        self.files = files
        self.index_files = index_files or [f.with_name(f.name[:-4] + ".idx.npy") for f in files]
        self.T = T
        self.slots = np.array([t // T for t in tokens], dtype=np.int64)
        self.cum = np.zeros(len(files) + 1, dtype=np.int64)
        np.cumsum(self.slots, out=self.cum[1:])
        self.total = int(self.cum[-1])
        src = np.asarray(shard_source if shard_source is not None else [0] * len(files), dtype=np.int64)
        self.src_slots = np.bincount(src, weights=self.slots, minlength=n_sources).astype(np.int64)
        self.src_start = np.zeros(n_sources + 1, dtype=np.int64)
        np.cumsum(self.src_slots, out=self.src_start[1:])


def _number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Largest-remainder (Hamilton) apportionment: int64 (n,) counts summing to ``total`` with
    ``counts[s]`` = floor or ceil of ``total * w_s / sum(w)`` (remainders ties broken by the lower index).
    ``weights``: positive finite numbers."""
    w = np.asarray(weights, dtype=np.float64)
    q = w / w.sum() * total
    c = np.floor(q).astype(np.int64)
    order = np.argsort(-(q - c), kind="stable")
    c[order[: total - int(c.sum())]] += 1
    return c


class _TextMetrics:
    """What the training loop reads of a text task, whether its corpus is read (:class:`TextTask`) or only planned
    (:class:`TextPlan`): one metric group (the loss of every token), no chance level, teacher-forced evaluation."""

    group_name = "text"
    group_labels = {0: "text"}
    pad_id = 0
    num_groups = 1
    chance = None
    eval_mode = "teacher_forced"
    #: what a text run measures (``results.json`` ``metric``): no answers, only the language-modelling loss
    metric = (
        "loss: mean cross-entropy in nats per token (and its perplexity) under teacher forcing over every token "
        "of each source's held-out split, overall and per source ('sources'); no answer accuracy"
    )


class TextTask(_TextMetrics):
    """Causal-LM pretraining on one prepared token corpus or a mixture of several (``text`` task). Build with
    :func:`canonlm.data.tasks.build_task` (``build_task("text", cfg)``).

    Config keys: ``name`` (``"text"``); ``data_dir`` (one prepared directory) or ``sources`` (a mixture: a mapping
    ``{name: {data_dir, weight, max_epochs}}`` or a list of such mappings with an optional ``name``, default the
    directory's name; exactly one of the two); ``mix`` (``weighted`` | ``concat``, below); ``context`` (window T,
    tokens); ``seed`` (data order); ``tail`` (only ``drop``); ``vocab_multiple`` (round ``vocab_size`` up to a
    multiple of this; 1 = the tokenizer's size); ``doc_mask`` (bool: batches also carry ``doc_ids``);
    ``vocab_size`` / ``tokenizer_name`` (:data:`PLAN_KEYS`: the vocabulary, and a name, of the tokenizer the corpus
    is expected to be prepared with, or null; the corpus' meta.json still gives the model's vocabulary:
    :meth:`vocab_mismatch` says when the two differ).

    One corpus: window w of a split = slot ``perm_e(w mod S)`` of its S slots (module docstring).

    Mixtures (training split):
    * ``mix: weighted``: source s has share ``weight_s / sum(weights)``. Training windows come in blocks of
      :data:`MIX_BLOCK`: block b holds exactly ``counts[s]`` (:func:`apportion` of the weights to the block) windows
      of each source, at positions given by a seeded permutation of the block (Feistel, key = hash(seed, b)): the
      window at block position p is source s = the owner of element ``perm_b(p)`` of ``[source 0 x counts[0],
      source 1 x counts[1], ...]``, with s's own window index ``k = b * counts[s] + (positions before p in block b
      that hold s)`` -- so each source's own windows are used in order 0, 1, 2, ... -- and is that source's window k
      exactly as the source alone would give it (its own epochs and permutations, same seed). A block's assignment
      is computed once per process (O(MIX_BLOCK), cached).
      So a window is O(1) to find, a pure function of (seed, split, T, w), and the number of windows each source
      gives in any prefix of the stream is exact (:meth:`source_windows`); proportions are exact per block
      (realised shares differ from the weights by < 1 / MIX_BLOCK plus the partial block).
      ``max_epochs`` (null = no cap): source s gives at most ``floor(max_epochs * S_s)`` windows (``S_s`` = its
      training slots; :meth:`source_table`). A run that would need more is refused before it starts
      (:meth:`check_run`, ConfigError naming ``task.sources.<name>.max_epochs``); weights are never renormalised
      (a capped source running out would change the mixture). A window beyond a cap raises ValueError.
    * ``mix: concat``: the sources' training slots are concatenated in the listed order and windows are one
      permutation over all of them, epoch by epoch (the paper's Result 12: SlimPajama then FineWeb-Edu, tokenized
      in order and concatenated, random windows): each source's share is its share of the slots; ``weight`` and
      ``max_epochs`` must be null.
    Evaluation splits (val / test) of a mixture: window w is window ``w // n`` of source ``w mod n`` (n sources,
    each its own val / test split and permutation), so a pass evaluates every source on nearly the same number of
    windows, and each on the windows it would give alone.
    Sources must be prepared with the same tokenizer (sha256), vocab_size, eos_id and dtype (meta.json).

    Attributes: name, cfg, sources (list of dicts: name, data_dir (Path), meta, weight, max_epochs), source_names,
        is_mixture (more than one source), mix, data_dir (Path of the first source), context, seed, tail, doc_mask,
        meta (meta.json of the first source), vocab_size (the corpus' ``vocab_size`` rounded up to
        ``vocab_multiple``), corpus_vocab_size (meta.json's), declared_vocab_size (``task.vocab_size``: int or None),
        tokenizer_name (str or None), vocab_multiple, pad_id (0; there is no padding in text windows), eos_id
        (int | None), num_groups 1, group_name ``"text"``, group_labels ``{0: "text"}``, chance None, eval_mode
        ``"teacher_forced"``, tokenizer_path (str), mix_counts (int64 (n,): windows of each source per block;
        weighted mixtures only, else None).
    Raises ConfigError naming the key (``task.<key>``, ``task.sources.<name>.<key>``): unknown keys, both or neither
        of ``data_dir`` / ``sources``, a bad ``data_dir`` (missing, not prepared, damaged, an empty split), source
        names that are not ``[A-Za-z0-9][A-Za-z0-9_.-]*`` or repeat, a directory used twice, weights that are not
        numbers > 0 (or below 1 / MIX_BLOCK of the total), ``max_epochs`` not null or a number > 0 (or too small to
        give one window), weight / max_epochs with ``mix=concat``, sources whose tokenizer / vocab / EOS / dtype
        differ, a ``context`` < 2 or longer than every shard of a split of a source, ``tail`` other than drop, a bad
        ``seed`` / ``vocab_multiple`` / ``mix`` / ``doc_mask`` / ``vocab_size`` / ``tokenizer_name``.
    """

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"text": _DEFAULTS}, KEYS, mismatch="text")
        self.name = name
        _check_settings(self, c)
        self.sources = self._read_sources(c)
        self.source_names = [s["name"] for s in self.sources]
        self.is_mixture = len(self.sources) > 1
        first = self.sources[0]
        self.meta = first["meta"]
        self.data_dir = first["data_dir"]
        self.corpus_vocab_size = int(self.meta["vocab_size"])
        self.vocab_size = round_vocab(self.corpus_vocab_size, self.vocab_multiple)
        self.eos_id = self.meta.get("eos_id")
        self.tokenizer_path = self.meta.get("tokenizer", {}).get("path")
        self._dtype = np.dtype(self.meta["dtype"])
        self.cfg = {**c, "data_dir": None if c["data_dir"] is None or c["sources"] is not None else str(c["data_dir"])}
        self._maps: dict[str, Any] = {}
        self._maps_pid = os.getpid()
        self._layouts: dict[tuple[str, int], _Layout] = {}
        self._tok: TextTokenizer | None = None
        for i, src in enumerate(self.sources):
            for split in SPLITS:
                if self.layout(split, self.context).src_slots[i] > 0:
                    continue
                dd = src["data_dir_given"]
                info = src["meta"]["splits"][split]
                if info["tokens"] == 0:
                    raise ConfigError(
                        src["key"] + ".data_dir" if self.is_mixture or c["sources"] is not None else "task.data_dir",
                        str(dd),
                        f"{_DD_ALLOWED}; problem: split {split!r} is empty (prepare with a larger "
                        "--val-fraction / --test-fraction or more documents)",
                    )
                longest = max(sh["tokens"] for sh in info["shards"])
                raise ConfigError(
                    "task.context",
                    self.context,
                    f"an integer <= {longest}, the longest {split} shard of {dd} in tokens "
                    "(a window must fit inside one shard)",
                )
        self.mix_counts = None
        if self.is_mixture and self.mix == "weighted":
            self.mix_counts = apportion([s["weight"] for s in self.sources], MIX_BLOCK)
            for s, cnt in zip(self.sources, self.mix_counts):
                if cnt == 0:
                    raise ConfigError(
                        s["key"] + ".weight",
                        s["weight"],
                        f"a weight of at least 1/{MIX_BLOCK} of the total weight (each block of "
                        f"{MIX_BLOCK} windows holds a whole number of windows of every source)",
                    )
        for i, s in enumerate(self.sources):
            if s["max_epochs"] is not None and self.capacity(i) == 0:
                raise ConfigError(
                    s["key"] + ".max_epochs",
                    s["max_epochs"],
                    f"null or a number >= {1 / self.layout('train', self.context).src_slots[i]:.3g} "
                    f"(it must give at least one of the source's "
                    f"{self.layout('train', self.context).src_slots[i]} training windows)",
                )

    # ------------------------------------------------------------------ sources
    def _read_sources(self, c: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The sources of ``c`` checked and their meta.json read (class docstring for the rules)."""
        dd, src, concat = c["data_dir"], c["sources"], c["mix"] == "concat"
        have_dd = isinstance(dd, (str, os.PathLike)) and str(dd) not in ("", "???")
        if src is None:
            if not have_dd:
                raise ConfigError("task.data_dir", dd, _DD_ALLOWED + " (or task.sources: several corpora)")
            items = [("task.data_dir", Path(str(dd)).name or "text", {"data_dir": dd})]
        else:
            if dd is not None and str(dd) != "???":
                raise ConfigError(
                    "task.sources",
                    src,
                    "null when task.data_dir is set (one corpus as task.data_dir or several as task.sources, not both)",
                )
            shape = (
                "a mapping {name: {data_dir, weight, max_epochs}} or a list of mappings {data_dir, weight, "
                "max_epochs, name}"
            )
            if isinstance(src, Mapping):
                items = [(f"task.sources.{k}", str(k), v) for k, v in src.items()]
            elif isinstance(src, (list, tuple)):
                items = []
                for i, v in enumerate(src):
                    if not isinstance(v, Mapping):
                        raise ConfigError(f"task.sources.{i}", v, "a mapping of data_dir, weight, max_epochs, name")
                    nm = v.get("name")
                    if nm is None and isinstance(v.get("data_dir"), (str, os.PathLike)):
                        nm = Path(str(v["data_dir"])).name
                    items.append((f"task.sources.{i}", str(nm), {k: x for k, x in v.items() if k != "name"}))
            else:
                raise ConfigError("task.sources", src, "null, " + shape)
            if not items:
                raise ConfigError("task.sources", src, "at least one source: " + shape)
        out: list[dict[str, Any]] = []
        seen_dirs: dict[Path, str] = {}
        for key, name, v in items:
            if not isinstance(v, Mapping):
                raise ConfigError(key, v, "a mapping of data_dir, weight, max_epochs")
            if src is not None and not _NAME_RE.match(name):
                raise ConfigError(
                    key,
                    name,
                    "a source name of letters, digits, '_', '.', '-' (it names the "
                    "source's metrics: train/tokens/<name>, val/<name>/loss)",
                )
            if name in (s["name"] for s in out):
                raise ConfigError(key, name, "a name no other source has")
            unknown = sorted(set(v) - set(_SOURCE_KEYS), key=str)
            if unknown:
                raise ConfigError(f"{key}.{unknown[0]}", v[unknown[0]], f"a known key: {', '.join(_SOURCE_KEYS)}")
            sdd = v.get("data_dir")
            dkey = key if key == "task.data_dir" else f"{key}.data_dir"
            if not isinstance(sdd, (str, os.PathLike)) or str(sdd) in ("", "???"):
                raise ConfigError(dkey, sdd, _DD_ALLOWED)
            weight, cap = v.get("weight"), v.get("max_epochs")
            if concat and len(items) > 1:
                for k2, x in (("weight", weight), ("max_epochs", cap)):
                    if x is not None:
                        raise ConfigError(
                            f"{key}.{k2}",
                            x,
                            "null with task.mix=concat (the sources are concatenated "
                            "in order: each gives its share of the slots, epochs run over all of them)",
                        )
            elif weight is None and len(items) > 1:
                raise ConfigError(
                    f"{key}.weight",
                    weight,
                    "a number > 0 (the source's share is its weight / the "
                    "sum of the weights), or task.mix=concat for shares by size",
                )
            elif weight is not None and not (_number(weight) and weight > 0):
                raise ConfigError(
                    f"{key}.weight", weight, "a number > 0 (the source's share is its weight / the sum of the weights)"
                )
            if cap is not None and not (_number(cap) and cap > 0):
                raise ConfigError(
                    f"{key}.max_epochs",
                    cap,
                    "null (no cap) or a number > 0: the most passes over the source's training windows",
                )
            try:
                meta = read_meta(sdd)
            except ValueError as e:
                raise ConfigError(dkey, str(sdd), f"{_DD_ALLOWED}; problem: {e}") from None
            real = Path(sdd).resolve()
            if real in seen_dirs:
                raise ConfigError(dkey, str(sdd), f"a directory no other source uses (source {seen_dirs[real]} has it)")
            seen_dirs[real] = name
            if out:
                ref = out[0]
                for what, path in _SAME_TOKENIZER:
                    a, b = ref["meta"], meta
                    for p in path:
                        a, b = (a or {}).get(p), (b or {}).get(p)
                    if a != b:
                        raise ConfigError(
                            dkey,
                            str(sdd),
                            f"a corpus prepared like source {ref['name']} "
                            f"({ref['data_dir_given']}): the same tokenizer, vocab_size, eos_id and "
                            f"dtype; {what} is {b!r} here, {a!r} there",
                        )
            out.append(
                dict(
                    key=key, name=name, data_dir=real, data_dir_given=str(sdd), meta=meta, weight=weight, max_epochs=cap
                )
            )
        if len(out) == 1 and out[0]["weight"] is None:
            out[0]["weight"] = 1.0
        return out

    def vocab_source(self) -> str:
        """Where the vocabulary comes from, for printouts: ``"the corpus' meta.json, <dir>/meta.json"`` (a mixture:
        ``"the corpora's meta.json, <dir>/meta.json and 1 more"``), with the declared tokenizer when it agrees and
        the rounding of ``vocab_multiple``."""
        n = len(self.sources) - 1
        whose = "the corpora's" if n else "the corpus'"
        where = f"{whose} meta.json, {Path(self.sources[0]['data_dir_given']) / META}" + (f" and {n} more" if n else "")
        if self.declared_vocab_size == self.corpus_vocab_size:
            where += f"; {_tokenizer_label(self.tokenizer_name)}'s, as task.vocab_size declares"
        if self.vocab_size != self.corpus_vocab_size:
            where += f"; {self.corpus_vocab_size:,} rounded up to task.vocab_multiple={self.vocab_multiple}"
        return where

    def vocab_mismatch(self) -> str | None:
        """None when ``task.vocab_size`` is null or equals the corpus' vocabulary; else one sentence naming both
        (``"the corpus <dir> has a vocabulary of 4,096 (its meta.json); task.vocab_size declares 32,000 (the
        Llama-2 tokenizer)"``)."""
        if self.declared_vocab_size is None or self.declared_vocab_size == self.corpus_vocab_size:
            return None
        return (
            f"the corpus {self.sources[0]['data_dir_given']} has a vocabulary of {self.corpus_vocab_size:,} (its "
            f"meta.json); task.vocab_size declares {self.declared_vocab_size:,} "
            f"({_tokenizer_label(self.tokenizer_name)})"
        )

    def capacity(self, source: int, window: int | None = None) -> int | None:
        """Training windows source ``source`` (index) can give under its cap: ``floor(max_epochs * S)`` with S its
        training slots of ``window`` (default: context) tokens; None = no cap."""
        cap = self.sources[source]["max_epochs"]
        if cap is None:
            return None
        S = int(self.layout("train", int(window or self.context)).src_slots[source])
        return int(math.floor(cap * S + 1e-9))

    def source_table(self, window: int | None = None) -> dict[str, dict[str, Any]]:
        """Per source (by name): ``data_dir``, ``weight``, ``share`` (the fraction of training windows it gives:
        weighted ``counts[s] / MIX_BLOCK``, concat its fraction of the slots), ``train_windows`` (its distinct
        training windows, one epoch), ``max_epochs`` and ``capacity`` (windows under the cap; None = no cap).
        JSON-able."""
        T = int(window or self.context)
        lay = self.layout("train", T)
        out = {}
        for i, s in enumerate(self.sources):
            if self.mix_counts is not None:
                share = float(self.mix_counts[i] / MIX_BLOCK)
            else:
                share = float(lay.src_slots[i] / max(lay.total, 1))
            out[s["name"]] = dict(
                data_dir=str(s["data_dir"]),
                weight=s["weight"],
                share=share,
                train_windows=int(lay.src_slots[i]),
                max_epochs=s["max_epochs"],
                capacity=self.capacity(i, T),
            )
        return out

    # ------------------------------------------------------------------ pickling (DataLoader workers)
    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["_maps"] = {}
        st["_tok"] = None
        st.pop("_count_cache", None)
        st.pop("_block_cache", None)
        return st

    # ------------------------------------------------------------------ layout and windows
    def layout(self, split: str, window: int) -> _Layout:
        """Slots of ``split`` over every source's shards for windows of ``window`` tokens (cached). ValueError for a
        bad split."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed; allowed: {' | '.join(SPLITS)}")
        key = (split, int(window))
        lays = self.__dict__.setdefault("_layouts", {})
        if key not in lays:
            files, tokens, index, owner = [], [], [], []
            for i, src in enumerate(self.sources):
                for sh in src["meta"]["splits"][split]["shards"]:
                    f = src["data_dir"] / sh["file"]
                    files.append(f)
                    tokens.append(int(sh["tokens"]))
                    index.append(
                        src["data_dir"] / sh["index"] if sh.get("index") else f.with_name(f.name[:-4] + ".idx.npy")
                    )
                    owner.append(i)
            lays[key] = _Layout(files, tokens, int(window), index, owner, len(self.sources))
        return lays[key]

    def num_windows(self, split: str, window: int | None = None) -> int:
        """Number of distinct windows (slots) of ``split`` over all sources (one epoch), for ``window`` (default:
        context) tokens."""
        return self.layout(split, window or self.context).total

    def _map(self, f: Path, index: bool = False) -> np.ndarray:
        if self._maps_pid != os.getpid():  # forked worker: reopen
            self._maps, self._maps_pid = {}, os.getpid()
        key = ("idx:" if index else "") + str(f)
        if key not in self._maps:
            if index:  # distinct first-token offsets of the shard's documents, increasing
                self._maps[key] = np.unique(np.load(f, mmap_mode="r")[:, 1].astype(np.int64))
            else:
                self._maps[key] = np.memmap(f, dtype=self._dtype, mode="r")
        return self._maps[key]

    @staticmethod
    def _permuted(split: str, k: np.ndarray, S: int, window: int, seed: int) -> np.ndarray:
        """Slot in [0, S) of window k of one S-slot space: epoch ``k // S`` permutes the slots (module docstring)."""
        epoch = (k // S).astype(np.uint64)
        base = np.uint64(stable_hash64("text-windows", int(seed), split, int(window)))
        keys = mix64(base + (epoch + np.uint64(1)) * GOLDEN)
        return feistel_permute(k % S, S, keys)

    def _block(self, b: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b`` of a weighted mixture's training windows: (source int64 (MIX_BLOCK,), rank int64
        (MIX_BLOCK,)) by position in the block; rank = how many earlier positions of the block hold the same source.
        Cached (the last 8 blocks of this process)."""
        cache = self.__dict__.setdefault("_block_cache", {})
        key = (int(seed), int(b))
        if key not in cache:
            K = MIX_BLOCK
            cumc = excl_cumsum(self.mix_counts)
            k = mix64(
                np.array([stable_hash64("text-mix", int(seed))], dtype=np.uint64)
                + np.array([int(b) + 1], dtype=np.uint64) * GOLDEN
            )
            j = feistel_permute(np.arange(K, dtype=np.int64), K, k)
            src = np.searchsorted(cumc, j, side="right") - 1
            rank = np.empty(K, dtype=np.int64)
            for s in range(len(self.mix_counts)):
                sel = src == s
                rank[sel] = np.arange(int(sel.sum()), dtype=np.int64)
            if len(cache) >= 8:
                cache.pop(next(iter(cache)))
            cache[key] = (src, rank)
        return cache[key]

    def _weighted(self, w: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's own window index) of training windows ``w`` of a weighted mixture."""
        b, p = np.divmod(w, MIX_BLOCK)
        src = np.empty_like(w)
        k = np.empty_like(w)
        for blk in np.unique(b):
            sel = b == blk
            bs, br = self._block(int(blk), seed)
            src[sel] = bs[p[sel]]
            k[sel] = int(blk) * self.mix_counts[src[sel]] + br[p[sel]]
        return src, k

    def locate(
        self, split: str, w: Sequence[int] | np.ndarray, window: int | None = None, seed: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where windows ``w`` (int64 (n,), >= 0) come from: (source int64 (n,), the source's own window index int64
        (n,) -- for ``mix=concat`` training windows the slot within the source --, slot int64 (n,) in
        :meth:`layout`'s numbering). Rules: class docstring. Raises ValueError for negative indices and for a window
        beyond a source's ``max_epochs`` cap."""
        T = int(window or self.context)
        seed = self.seed if seed is None else int(seed)
        w = np.asarray(w, dtype=np.int64).reshape(-1)
        if (w < 0).any():
            raise ValueError("window indices must be >= 0")
        lay = self.layout(split, T)
        n = len(self.sources)
        if n == 1 or (split == "train" and self.mix == "concat"):
            slot = self._permuted(split, w, lay.total, T, seed)
            src = np.searchsorted(lay.src_start, slot, side="right") - 1
            k = w if n == 1 else slot - lay.src_start[src]
        else:
            if split == "train":
                src, k = self._weighted(w, seed)
            else:
                src, k = w % n, w // n
            slot = np.empty_like(w)
            for s in np.unique(src):
                sel = src == s
                slot[sel] = lay.src_start[s] + self._permuted(split, k[sel], int(lay.src_slots[s]), T, seed)
        if split == "train" and any(x["max_epochs"] is not None for x in self.sources):
            for s in np.unique(src):
                cap = self.capacity(int(s), T)
                if cap is not None and int(k[src == s].max()) >= cap:
                    raise ValueError(
                        f"training window {int(w[src == s][k[src == s] >= cap][0])} needs window "
                        f"{int(k[src == s].max())} of source {self.source_names[s]}, beyond its cap of "
                        f"{cap} windows (max_epochs={self.sources[s]['max_epochs']}); the run is longer "
                        "than the cap supplies (TextTask.check_run)"
                    )
        return src, k, slot

    def slots(self, split: str, w: np.ndarray, window: int, seed: int) -> np.ndarray:
        """int64 (n,): the slot of windows ``w`` in :meth:`layout`'s numbering (one corpus: its slot 0..S-1)."""
        return self.locate(split, w, window, seed)[2]

    def gather(
        self,
        split: str,
        w: Sequence[int] | np.ndarray,
        window: int | None = None,
        seed: int | None = None,
        doc_ids: bool = False,
    ) -> dict[str, np.ndarray]:
        """Windows ``w`` read from the shards: ``tokens`` int64 (n, T), ``source`` int64 (n,) (index into
        :attr:`sources`) and, with ``doc_ids``, ``doc_ids`` int32 (n, T): for each token the index of its document
        within the window row (0 for the first, +1 at each document start inside the row; starts from the shard's
        ``idx.npy`` first-token offsets)."""
        T = int(window or self.context)
        lay = self.layout(split, T)
        src, _, slot = self.locate(split, w, T, seed)
        shard = np.searchsorted(lay.cum, slot, side="right") - 1
        start = (slot - lay.cum[shard]) * T
        out = np.empty((slot.shape[0], T), dtype=np.int64)
        docs = np.empty((slot.shape[0], T), dtype=np.int32) if doc_ids else None
        for r in range(slot.shape[0]):
            k, s0 = int(shard[r]), int(start[r])
            out[r] = self._map(lay.files[k])[s0 : s0 + T]
            if docs is not None:  # +1 at every document start in (s0, s0 + T)
                offs = self._map(lay.index_files[k], index=True)
                inside = offs[np.searchsorted(offs, s0, side="right") : np.searchsorted(offs, s0 + T, side="left")]
                marks = np.zeros(T, dtype=np.int32)
                marks[inside - s0] = 1
                np.cumsum(marks, out=docs[r])
        res = {"tokens": out, "source": src}
        if docs is not None:
            res["doc_ids"] = docs
        return res

    def windows(
        self, split: str, w: Sequence[int] | np.ndarray, window: int | None = None, seed: int | None = None
    ) -> np.ndarray:
        """Token windows: int64 (n, T) for window indices ``w`` (T = ``window`` or the context; seed default: the
        task's). Window w is a pure function of (seed, split, T, w) and the prepared data."""
        T = int(window or self.context)
        if self.layout(split, T).total == 0:
            raise ValueError(f"split {split!r} has no window of {T} tokens")
        return self.gather(split, w, T, seed)["tokens"]

    # ------------------------------------------------------------------ accounting
    def source_windows(self, n: int, window: int | None = None, seed: int | None = None) -> np.ndarray:
        """int64 (sources,): how many of the training windows ``[0, n)`` each source gives (exact). Weighted: closed
        form per block plus the partial block (O(MIX_BLOCK)); concat: the windows counted since the previous call
        (cached; whole epochs in closed form), O(n) the first time; one corpus: ``[n]``."""
        T = int(window or self.context)
        seed = self.seed if seed is None else int(seed)
        n = int(n)
        ns = len(self.sources)
        if ns == 1:
            return np.array([n], dtype=np.int64)
        if self.mix_counts is not None:
            full, rest = divmod(n, MIX_BLOCK)
            counts = full * self.mix_counts
            if rest:
                counts = counts + np.bincount(self._block(full, seed)[0][:rest], minlength=ns)
            return counts.astype(np.int64)
        lay = self.layout("train", T)
        S = lay.total
        cache = self.__dict__.setdefault("_count_cache", {})
        n0, counts = cache.get((T, seed), (0, np.zeros(ns, dtype=np.int64)))
        if n < n0:
            n0, counts = 0, np.zeros(ns, dtype=np.int64)
        counts = counts.copy()
        while n0 < n:
            end = (n0 // S + 1) * S
            if n0 % S == 0 and end <= n:
                counts += lay.src_slots
                n0 = end
                continue
            m = min(n, end, n0 + (1 << 20))
            slot = self._permuted("train", np.arange(n0, m, dtype=np.int64), S, T, seed)
            counts += np.bincount(np.searchsorted(lay.src_start, slot, side="right") - 1, minlength=ns)
            n0 = m
        cache[(T, seed)] = (n, counts.copy())
        return counts

    def check_run(self, train_windows: int, window: int | None = None, what: str = "") -> None:
        """Refuse a run of ``train_windows`` training windows that a source's ``max_epochs`` cap cannot supply:
        ConfigError(``task.sources.<name>.max_epochs``) with the epochs the run needs. ``what``: how the run length
        was set (for the message). Nothing to check without caps."""
        T = int(window or self.context)
        if all(s["max_epochs"] is None for s in self.sources):
            return
        need = self.source_windows(train_windows, T)  # each source's own windows are used in order: 0, 1, 2, ...
        for i, s in enumerate(self.sources):
            cap = self.capacity(i, T)
            if cap is not None and need[i] > cap:
                S = int(self.layout("train", T).src_slots[i])
                raise ConfigError(
                    s["key"] + ".max_epochs",
                    s["max_epochs"],
                    f"a cap of at least {need[i] / S:.4g} epochs, or a shorter run: {train_windows} "
                    f"training windows{what} take {need[i]} windows of {T} tokens from source "
                    f"{s['name']}, which has {S} (cap: {cap}); weights are not renormalised when a "
                    "source runs out",
                )

    def make_stream(
        self,
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
    ) -> "TextStream":
        """The :class:`TextStream` of ``split`` (same arguments and contract as
        :class:`canonlm.data.stream.SyntheticStream`)."""
        return TextStream(
            self,
            split,
            window=window,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            start_step=start_step,
            num_steps=num_steps,
            tail=tail,
        )

    # ------------------------------------------------------------------ task protocol
    def max_instance_len(self, split: str) -> int:
        """1: text has no instances; any context >= 2 is accepted by the trainer's context check."""
        return 1

    def min_instance_len(self, split: str) -> int:
        """1 (see :meth:`max_instance_len`)."""
        return 1

    def _no_instances(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "the text task has no generated instances: windows come from prepared token "
            "shards through make_stream() (TextStream), which the trainer must use"
        )

    generate = estimate_lengths = instance = _no_instances

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer recorded in meta.json (loaded on first use). FileNotFoundError if it moved."""
        if self.__dict__.get("_tok") is None:
            t = self.meta.get("tokenizer", {})
            self._tok = TextTokenizer(t["path"], eos_token=t.get("eos_token"))
        return self._tok

    def token_names(self) -> list[str]:
        """Vocabulary strings by id (``"<unused>"`` for ids the tokenizer does not define)."""
        tok = self.tokenizer()
        return [tok.id_to_token(i) or "<unused>" for i in range(self.vocab_size)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of token ids (with the recorded tokenizer)."""
        return self.tokenizer().decode(ids, skip_special_tokens=False)


# ============================================================================================== plan
def unset_corpora(task: Any) -> list[tuple[str, Any, str]]:
    """The corpus keys of a composed ``text`` task node (``cfg.task``, an OmegaConf ``DictConfig``) that are unset:
    ``???`` itself, or an interpolation that ends at ``???`` (a real-life preset's ``${paths.corpora.slimpajama}``
    before the user names the prepared corpus). ``task.data_dir`` counts only without ``task.sources``.

    Returns ``[(task key, its raw value, the unset key)]`` in config order, e.g. ``("task.sources.slimpajama.data_dir",
    "${paths.corpora.slimpajama}", "paths.corpora.slimpajama")`` (the unset key is the task key itself for a plain
    ``???`` or an interpolation with more than one reference); [] when every corpus key resolves (to anything:
    :class:`TextTask` checks the paths) or ``task`` is not a ``DictConfig``."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

    out: list[tuple[str, Any, str]] = []
    if not isinstance(task, DictConfig):
        return out

    def unset(node: Any, key: Any, dotted: str) -> bool:
        try:
            node[key]
        except (MissingMandatoryValue, InterpolationToMissingValueError):
            raw = OmegaConf.to_container(node, resolve=False)[key]
            ref = re.fullmatch(r"\$\{([A-Za-z0-9_.\-]+)\}", str(raw))
            out.append((dotted, raw, ref.group(1) if ref else dotted))
            return True
        return False

    if "sources" in task.keys() and unset(task, "sources", "task.sources"):  # `in` skips ??? values: keys() has them
        return out
    src = task.get("sources", None)
    if isinstance(src, (DictConfig, ListConfig)):
        for k in list(src.keys()) if isinstance(src, DictConfig) else range(len(src)):
            item = src[k]
            if isinstance(item, DictConfig) and "data_dir" in item.keys():
                unset(item, "data_dir", f"task.sources.{k}.data_dir")
    elif src is None and "data_dir" in task.keys():
        unset(task, "data_dir", "task.data_dir")
    return out


class TextPlan(_TextMetrics):
    """The ``text`` task of a run planned before its corpus is prepared (``python -m canonlm.estimate``; it is never
    trained: ``train.py`` refuses an unset corpus): the keys that name no corpus, checked as :class:`TextTask` checks
    them, and the vocabulary the config declares (``task.vocab_size``, e.g. a real-life preset's Llama-2 32,000,
    rounded up to ``task.vocab_multiple``) in place of the corpus' meta.json.

    Args: name: the registry key (``"text"``). cfg: the task config without its corpus keys (``data_dir``,
        ``sources``; plain values). unset: :func:`unset_corpora`'s entries (at least one).
    Attributes (those of :class:`TextTask` that need no corpus): name, context, seed, tail, doc_mask, mix,
        vocab_multiple, declared_vocab_size, tokenizer_name, vocab_size, corpus_vocab_size (None), unset, planned
        (True), num_groups (1), group_name, is_mixture (False: the sources are not read).
    Raises ConfigError as TextTask for those keys, and, when ``task.vocab_size`` is null (nothing gives the
    vocabulary then), naming the first unset corpus key and its raw value.
    """

    planned = True
    is_mixture = False
    corpus_vocab_size = None

    def __init__(self, name: str, cfg: Mapping[str, Any], unset: Sequence[tuple[str, Any, str]]):
        if not unset:
            raise ValueError("TextPlan: no unset corpus key (build a TextTask)")
        c = merge_config(
            name, {k: v for k, v in cfg.items() if k not in _CORPUS_KEYS}, {"text": _DEFAULTS}, KEYS, mismatch="text"
        )
        self.name = name
        self.unset = [tuple(u) for u in unset]
        _check_settings(self, c)
        if self.declared_vocab_size is None:
            key, raw, missing = self.unset[0]
            unset_key = f"{missing} is unset; " if missing != key else ""
            raise ConfigError(
                key,
                raw,
                f"{_DD_ALLOWED} ({unset_key}its meta.json gives the vocabulary), or, to "
                "estimate the run before the corpus exists, task.vocab_size: the vocabulary of the "
                "tokenizer it will be prepared with (Llama-2 32000)",
            )
        self.vocab_size = round_vocab(self.declared_vocab_size, self.vocab_multiple)

    def max_instance_len(self, split: str) -> int:
        """1, as :meth:`TextTask.max_instance_len`."""
        return 1

    def min_instance_len(self, split: str) -> int:
        """1, as :meth:`TextTask.min_instance_len`."""
        return 1

    def vocab_source(self) -> str:
        """Where the vocabulary comes from, for printouts: ``"the Llama-2 tokenizer, task.vocab_size; corpus not
        prepared yet: paths.corpora.slimpajama is unset"`` (with the rounding of ``vocab_multiple``)."""
        keys = [u[2] for u in self.unset]
        named = f"the {self.tokenizer_name} tokenizer, " if self.tokenizer_name else ""
        where = f"{named}task.vocab_size; corpus not prepared yet: " + (
            f"{keys[0]} is unset" if len(keys) == 1 else f"{', '.join(keys)} are unset"
        )
        if self.vocab_size != self.declared_vocab_size:
            where += f"; {self.declared_vocab_size:,} rounded up to task.vocab_multiple={self.vocab_multiple}"
        return where

    def vocab_mismatch(self) -> str | None:
        """None: there is no corpus to differ from."""
        return None


def plan_text_task(task: Any) -> TextPlan | None:
    """:class:`TextPlan` of a composed ``text`` task node (``cfg.task``) when some corpus key is unset
    (:func:`unset_corpora`), else None (build the :class:`TextTask`). Raises ConfigError as TextPlan."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    unset = unset_corpora(task)
    if not unset:
        return None
    cfg = {
        k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
        for k, v in ((k, task[k]) for k in task.keys() if k not in _CORPUS_KEYS)
    }
    return TextPlan(str(cfg.get("name", "text")), cfg, unset)


# ============================================================================================== stream
class TextStream(StepStream):
    """IterableDataset of per-rank batches of text windows (interface of
    :class:`canonlm.data.stream.SyntheticStream`; steps, workers, state and length: :class:`StepStream`).

    Args:
        task: a :class:`TextTask`. split: train | val | test. window: T tokens per window (<= the shortest usable
            shard; every source's split needs at least one slot). batch_size: B windows per rank per step. seed:
            data seed. rank / world_size: this rank's slice of every global step. start_step: first global step.
            num_steps: None = infinite (training); otherwise the fixed steps ``[start_step, start_step +
            num_steps)``, replayed in full by every ``iter()``. tail: only ``drop``.
    Global steps, DataLoader workers, ``state_dict`` / ``load_state_dict`` and ``len``: :class:`StepStream`.
    Yields dicts of CPU torch tensors (B, T): ``tokens`` int64, ``loss_mask`` bool (False only at t = 0),
        ``answer_id`` int32 (-1), ``group`` int32 (0); a mixture also ``source`` int64 (B,) (the row's source index,
        :attr:`TextTask.source_names`); with ``task.doc_mask`` also ``doc_ids`` int32 (B, T)
        (:meth:`TextTask.gather`).
    Raises ConfigError("task.tail") for a tail other than drop, ConfigError("task.context") if no window of T tokens
        fits in a source's split, ValueError for bad sizes / ranks / steps / split, and (while iterating) for a
        window beyond a source's ``max_epochs`` cap.
    """

    def __init__(
        self,
        task: TextTask,
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
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed; allowed: {' | '.join(SPLITS)}")
        self.window = check_arg_int("window", window, 2)
        lay = task.layout(split, self.window)
        if lay.total == 0 or (lay.src_slots == 0).any():
            raise ConfigError(
                "task.context",
                window,
                f"a window that fits in a {split} shard of {task.data_dir}"
                if not task.is_mixture
                else f"a window that fits in a {split} shard of every source",
            )
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
        if tail != "drop":
            raise ConfigError("task.tail", tail, "drop")

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch at global step ``step`` (a pure function of the step); shapes as in the class doc."""
        g = self.task.gather(self.split, self._step_windows(step), self.window, self.seed, doc_ids=self.task.doc_mask)
        tok = g["tokens"]
        B, T = tok.shape
        loss = np.ones((B, T), dtype=bool)
        loss[:, 0] = False
        out = {
            "tokens": torch.from_numpy(tok),
            "loss_mask": torch.from_numpy(loss),
            "answer_id": torch.full((B, T), -1, dtype=torch.int32),
            "group": torch.zeros((B, T), dtype=torch.int32),
        }
        if self.task.is_mixture:
            out["source"] = torch.from_numpy(g["source"].astype(np.int64))
        if "doc_ids" in g:
            out["doc_ids"] = torch.from_numpy(g["doc_ids"])
        return out


def perplexity(loss_nats: float) -> float:
    """exp(loss) (per-token perplexity of a mean cross-entropy in nats); inf on overflow."""
    try:
        return math.exp(loss_nats)
    except OverflowError:
        return math.inf


__all__ = [
    "TextTask",
    "TextPlan",
    "TextStream",
    "TextTokenizer",
    "plan_text_task",
    "unset_corpora",
    "round_vocab",
    "PLAN_KEYS",
    "load_tokenizer",
    "tokenizer_sha256",
    "read_meta",
    "dtype_for_vocab",
    "feistel_permute",
    "apportion",
    "perplexity",
    "FORMAT",
    "META",
    "SPLITS",
    "MIX_BLOCK",
    "MIX_MODES",
    "ADDED_KEYS",
]
