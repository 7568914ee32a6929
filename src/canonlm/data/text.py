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

Per-token outputs (B, T): ``tokens`` int64, ``loss_mask`` bool (all True except position 0: every token is a
target), ``answer_id`` int32 (all -1: nothing is "scored"; the metric is the loss / perplexity), ``group`` int32 (0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from canonlm.data import ConfigError
from canonlm.data.seeding import GOLDEN, mix64, stable_hash64
from canonlm.data.stream import StepStream, check_arg_int
from canonlm.data.tasks._common import check_int, merge_config

FORMAT = "canonlm-text-v1"
META = "meta.json"
SPLITS = ("train", "val", "test")
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json")


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
            raise FileNotFoundError(f"tokenizer: {path} does not exist (expected a tokenizer.json file or a local "
                                    "Hugging Face tokenizer directory)")
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
                raise ValueError(f"tokenizer: cannot load {path} with transformers.AutoTokenizer "
                                 f"(local_files_only=True): {e}") from None
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
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"tokenizer: cannot load {f} with tokenizers.Tokenizer.from_file: {e}") from None
            self.kind = "tokenizers"
            vocab = self._tk.get_vocab(with_added_tokens=True)
            self.vocab_size = max(self._tk.get_vocab_size(with_added_tokens=True),
                                  max(vocab.values()) + 1 if vocab else 0)
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
        return dict(path=self.path, kind=self.kind, sha256=self.sha256, vocab_size=self.vocab_size,
                    eos_id=self.eos_id, eos_token=self.eos_token)


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
                raise ValueError(f"{data_dir}: shard {sh['file']} has {p.stat().st_size} bytes, expected "
                                 f"{sh['tokens']} tokens x {item} bytes")
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
_DEFAULTS: dict[str, Any] = dict(name="text", data_dir=None, context=1024, seed=0, tail="drop", vocab_multiple=1)
KEYS = tuple(_DEFAULTS)


class _Layout:
    """Slots of one split for one window length T: shard files, slots per shard and their cumulative sum."""

    def __init__(self, files: list[Path], tokens: list[int], T: int):
        self.files = files
        self.T = T
        self.slots = np.array([t // T for t in tokens], dtype=np.int64)
        self.cum = np.zeros(len(files) + 1, dtype=np.int64)
        np.cumsum(self.slots, out=self.cum[1:])
        self.total = int(self.cum[-1])


class TextTask:
    """Causal-LM pretraining on a prepared token corpus (``text`` task). Build with
    :func:`canonlm.data.tasks.build_task` (``build_task("text", cfg)``).

    Config keys: ``name`` (``"text"``), ``data_dir`` (a prepared directory), ``context`` (window T, tokens),
    ``seed`` (data order), ``tail`` (only ``drop``: windows are plain token slices, nothing is cut), ``vocab_multiple``
    (round ``vocab_size`` up to a multiple of this, e.g. 64 for GPU-friendly embedding shapes; 1 = the tokenizer's
    size).
    Attributes: name, cfg, data_dir (Path), context, seed, tail, meta (dict of meta.json), vocab_size, pad_id (0; there
        is no padding in text windows), eos_id (int | None), num_groups 1, group_name ``"text"``, group_labels
        ``{0: "text"}``, chance None, eval_mode ``"teacher_forced"``, tokenizer_path (str).
    Raises ConfigError(``task.<key>``) for unknown keys, a bad ``data_dir`` (missing, not prepared, damaged), a
        ``context`` < 2 or longer than every shard of a split, ``tail`` other than drop, a bad ``seed`` /
        ``vocab_multiple``.
    """

    group_name = "text"
    group_labels = {0: "text"}
    pad_id = 0
    num_groups = 1
    chance = None
    eval_mode = "teacher_forced"

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, {"text": _DEFAULTS}, KEYS, mismatch="text")
        self.name = name
        self.context = check_int("context", c["context"], 2)
        self.seed = check_int("seed", c["seed"], 0)
        if c["tail"] != "drop":
            raise ConfigError("task.tail", c["tail"], "drop (text windows are contiguous token slices; nothing is cut)")
        self.tail = "drop"
        check_int("vocab_multiple", c["vocab_multiple"], 1)
        dd = c["data_dir"]
        allowed = "a directory written by `python -m canonlm.data.prepare` (meta.json + token shards)"
        if not isinstance(dd, (str, os.PathLike)) or str(dd) in ("", "???"):
            raise ConfigError("task.data_dir", dd, allowed)
        try:
            self.meta = read_meta(dd)
        except ValueError as e:
            raise ConfigError("task.data_dir", str(dd), f"{allowed}; problem: {e}") from None
        self.data_dir = Path(dd).resolve()
        base = int(self.meta["vocab_size"])
        m = int(c["vocab_multiple"])
        self.vocab_size = -(-base // m) * m
        self.eos_id = self.meta.get("eos_id")
        self.tokenizer_path = self.meta.get("tokenizer", {}).get("path")
        self._dtype = np.dtype(self.meta["dtype"])
        self.cfg = {**c, "data_dir": str(dd)}
        for split in SPLITS:
            lay = self.layout(split, self.context)
            if lay.total == 0:
                info = self.meta["splits"][split]
                if info["tokens"] == 0:
                    raise ConfigError("task.data_dir", str(dd), f"{allowed}; problem: split {split!r} is empty "
                                      "(prepare with a larger --val-fraction / --test-fraction or more documents)")
                longest = max(sh["tokens"] for sh in info["shards"])
                raise ConfigError("task.context", self.context,
                                  f"an integer <= {longest}, the longest {split} shard of {dd} in tokens "
                                  "(a window must fit inside one shard)")
        self._maps: dict[str, np.memmap] = {}
        self._maps_pid = os.getpid()
        self._layouts: dict[tuple[str, int], _Layout] = {}
        self._tok: TextTokenizer | None = None

    # ------------------------------------------------------------------ pickling (DataLoader workers)
    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["_maps"] = {}
        st["_tok"] = None
        return st

    # ------------------------------------------------------------------ layout and windows
    def layout(self, split: str, window: int) -> _Layout:
        """Slots of ``split`` for windows of ``window`` tokens (cached). ValueError for a bad split."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed; allowed: {' | '.join(SPLITS)}")
        key = (split, int(window))
        lays = self.__dict__.setdefault("_layouts", {})
        if key not in lays:
            shards = self.meta["splits"][split]["shards"]
            lays[key] = _Layout([self.data_dir / s["file"] for s in shards], [int(s["tokens"]) for s in shards],
                                int(window))
        return lays[key]

    def num_windows(self, split: str, window: int | None = None) -> int:
        """Number of distinct windows (slots) of ``split`` (one epoch), for ``window`` (default: context) tokens."""
        return self.layout(split, window or self.context).total

    def _map(self, f: Path) -> np.memmap:
        if self._maps_pid != os.getpid():  # forked worker: reopen
            self._maps, self._maps_pid = {}, os.getpid()
        key = str(f)
        if key not in self._maps:
            self._maps[key] = np.memmap(f, dtype=self._dtype, mode="r")
        return self._maps[key]

    def slots(self, split: str, w: np.ndarray, window: int, seed: int) -> np.ndarray:
        """int64 (n,): the slot (0..S-1) of windows ``w`` (int64 (n,), >= 0) -- see the module docstring."""
        lay = self.layout(split, window)
        w = np.asarray(w, dtype=np.int64)
        if (w < 0).any():
            raise ValueError("window indices must be >= 0")
        S = lay.total
        epoch = (w // S).astype(np.uint64)
        base = np.uint64(stable_hash64("text-windows", int(seed), split, int(window)))
        keys = mix64(base + (epoch + np.uint64(1)) * GOLDEN)
        return feistel_permute(w % S, S, keys)

    def windows(self, split: str, w: Sequence[int] | np.ndarray, window: int | None = None,
                seed: int | None = None) -> np.ndarray:
        """Token windows: int64 (n, T) for window indices ``w`` (T = ``window`` or the context; seed default: the
        task's). Window w is a pure function of (seed, split, T, w) and the prepared data."""
        T = int(window or self.context)
        seed = self.seed if seed is None else int(seed)
        lay = self.layout(split, T)
        if lay.total == 0:
            raise ValueError(f"split {split!r} has no window of {T} tokens")
        slot = self.slots(split, np.asarray(w, dtype=np.int64).reshape(-1), T, seed)
        shard = np.searchsorted(lay.cum, slot, side="right") - 1
        start = (slot - lay.cum[shard]) * T
        out = np.empty((slot.shape[0], T), dtype=np.int64)
        for r in range(slot.shape[0]):
            mm = self._map(lay.files[int(shard[r])])
            out[r] = mm[int(start[r]):int(start[r]) + T]
        return out

    def make_stream(self, split: str, *, window: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                    start_step: int = 0, num_steps: int | None = None, tail: str = "drop") -> "TextStream":
        """The :class:`TextStream` of ``split`` (same arguments and contract as
        :class:`canonlm.data.stream.SyntheticStream`)."""
        return TextStream(self, split, window=window, batch_size=batch_size, seed=seed, rank=rank,
                          world_size=world_size, start_step=start_step, num_steps=num_steps, tail=tail)

    # ------------------------------------------------------------------ task protocol
    def max_instance_len(self, split: str) -> int:
        """1: text has no instances; any context >= 2 is accepted by the trainer's context check."""
        return 1

    def min_instance_len(self, split: str) -> int:
        """1 (see :meth:`max_instance_len`)."""
        return 1

    def _no_instances(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the text task has no generated instances: windows come from prepared token "
                                  "shards through make_stream() (TextStream), which the trainer must use")

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


# ============================================================================================== stream
class TextStream(StepStream):
    """IterableDataset of per-rank batches of text windows (interface of
    :class:`canonlm.data.stream.SyntheticStream`; steps, workers, state and length: :class:`StepStream`).

    Args:
        task: a :class:`TextTask`. split: train | val | test. window: T tokens per window (<= the shortest usable
            shard; the split needs at least one slot). batch_size: B windows per rank per step. seed: data seed.
        rank / world_size: this rank's slice of every global step. start_step: first global step. num_steps: None =
            infinite (training); otherwise the fixed steps ``[start_step, start_step + num_steps)``, replayed in full
            by every ``iter()``. tail: only ``drop``.
    Global steps, DataLoader workers, ``state_dict`` / ``load_state_dict`` and ``len``: :class:`StepStream`.
    Yields dicts of CPU torch tensors (B, T): ``tokens`` int64, ``loss_mask`` bool (False only at t = 0),
        ``answer_id`` int32 (-1), ``group`` int32 (0).
    Raises ConfigError("task.tail") for a tail other than drop, ConfigError("task.context") if no window of T tokens
        fits in the split, ValueError for bad sizes / ranks / steps / split.
    """

    def __init__(self, task: TextTask, split: str, *, window: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, start_step: int = 0, num_steps: int | None = None, tail: str = "drop"):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed; allowed: {' | '.join(SPLITS)}")
        self.window = check_arg_int("window", window, 2)
        if task.layout(split, self.window).total == 0:
            raise ConfigError("task.context", window, f"a window that fits in a {split} shard of {task.data_dir}")
        super().__init__(task, split, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         start_step=start_step, num_steps=num_steps)
        if tail != "drop":
            raise ConfigError("task.tail", tail, "drop")

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch at global step ``step`` (a pure function of the step); shapes as in the class doc."""
        tok = self.task.windows(self.split, self._step_windows(step), self.window, self.seed)
        B, T = tok.shape
        loss = np.ones((B, T), dtype=bool)
        loss[:, 0] = False
        return {"tokens": torch.from_numpy(tok), "loss_mask": torch.from_numpy(loss),
                "answer_id": torch.full((B, T), -1, dtype=torch.int32), "group": torch.zeros((B, T), dtype=torch.int32)}


def perplexity(loss_nats: float) -> float:
    """exp(loss) (per-token perplexity of a mean cross-entropy in nats); inf on overflow."""
    try:
        return math.exp(loss_nats)
    except OverflowError:
        return math.inf


__all__ = ["TextTask", "TextStream", "TextTokenizer", "load_tokenizer", "tokenizer_sha256", "read_meta",
           "dtype_for_vocab", "feistel_permute", "perplexity", "FORMAT", "META", "SPLITS"]
