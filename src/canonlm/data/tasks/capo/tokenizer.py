"""Capo's tokenizer: train, cache and load the byte-level BPE (one job: the ``tokenizers.Tokenizer`` a task uses).

The paper uses GPT-2's tokenizer (Part 4.1 App. A.3); by default canonlm uses its own byte-level BPE (``tokenizers``:
ByteLevel pre-tokenizer with the GPT-2 regex, BPE model, ``bpe_vocab_size``) trained on ``bpe_train_bios`` biographies
of a fixed random sample (:func:`bpe_training_texts`) and cached as ``<cache_dir>/capo/bpe-<hash>.json``
(:func:`bpe_key`: hash of the lists, templates, vocabulary size, sample size and the ``tokenizers`` version; written
atomically). ``cache_dir: null`` means ``$CANONLM_CACHE``, else ``$XDG_CACHE_HOME/canonlm``, else ``~/.cache/canonlm``
(:func:`default_cache_dir`). ``tokenizer: <path>`` uses a local tokenizer instead (:func:`load_tokenizer`:
``tokenizer.json``, or a directory holding ``tokenizer.json`` or GPT-2's ``vocab.json`` + ``merges.txt``; the paper's
models use GPT-2's tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from canonlm.data.seeding import below, instance_keys, stable_hash64, words
from canonlm.data.tasks.capo.assets import MAX_TEMPLATES
from canonlm.data.tasks.capo.render import ORDERS, compose_text, field_texts
from canonlm.utils.io import atomic_write_text

EOS_TEXT = "<|endoftext|>"
_TOKENIZER_RECIPE = 1  # bump when the BPE training recipe changes (part of the cache key)
_BPE_SEED = 0x5EED_B1E5  # the BPE training sample is the same for every task seed and N


def _tokenizers():
    import tokenizers

    return tokenizers


def default_cache_dir() -> Path:
    """``$CANONLM_CACHE``, else ``$XDG_CACHE_HOME/canonlm``, else ``~/.cache/canonlm``."""
    env = os.environ.get("CANONLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "canonlm"


def from_json(text: str):
    """The ``tokenizers.Tokenizer`` serialised as ``text`` (``Tokenizer.to_str()``)."""
    return _tokenizers().Tokenizer.from_str(text)


def load_tokenizer(path: str | os.PathLike):
    """Load a local tokenizer: a ``tokenizer.json`` file, or a directory with ``tokenizer.json`` or GPT-2's
    ``vocab.json`` + ``merges.txt`` (byte-level BPE). Returns a ``tokenizers.Tokenizer``; FileNotFoundError /
    ValueError if nothing loadable is there."""
    tk = _tokenizers()
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return tk.Tokenizer.from_file(str(p / "tokenizer.json"))
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            tok = tk.Tokenizer(tk.models.BPE.from_file(str(p / "vocab.json"), str(p / "merges.txt")))
            tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = tk.decoders.ByteLevel()
            return tok
        raise FileNotFoundError(f"{p}: no tokenizer.json, nor vocab.json + merges.txt")
    if p.is_file():
        return tk.Tokenizer.from_file(str(p))
    raise FileNotFoundError(f"{p}: no such tokenizer file or directory")


def train_bpe(texts: Sequence[str], vocab_size: int):
    """Train a GPT-2-style byte-level BPE on ``texts`` (ByteLevel pre-tokenizer with the GPT-2 regex, no prefix
    space; all 256 byte symbols in the alphabet; special token ``<|endoftext|>``). Deterministic for given inputs.
    Returns a ``tokenizers.Tokenizer``."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=[EOS_TEXT],
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return tok


def bpe_training_texts(assets: Mapping[str, Any], n: int) -> list[str]:
    """The ``n`` biographies the BPE is trained on: people drawn uniformly from the full lists of ``assets`` (not
    the population), birth years 1900-2099, templates from the full 50-template pools, random sentence order; a fixed
    sample (independent of seed and N, so every task with the same lists shares one tokenizer)."""
    A = assets
    key = stable_hash64("canonlm.data", "capo", "bpe-sample", _TOKENIZER_RECIPE, _BPE_SEED)
    k = instance_keys(key, np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))
    draw = lambda p, hi: below(words(k, p, 0), hi)
    recs = dict(
        first=draw(0, len(A["first_names"])),
        middle=draw(1, len(A["middle_names"])),
        last=draw(2, len(A["last_names"])),
        month=draw(3, 12),
        day=draw(4, 28),
        year=1900 + draw(5, 200),
        city=draw(6, len(A["birth_cities"])),
        univ=draw(7, len(A["universities"])),
        major=draw(8, len(A["majors"])),
        emp=draw(9, len(A["employers"])),
        gender=draw(10, 2),
    )
    tmpl = np.stack([draw(11 + a, MAX_TEMPLATES) for a in range(6)], axis=1)
    order = ORDERS[draw(17, 720)]
    texts = []
    for b in range(n):
        fields = field_texts(A, {key_: int(v[b]) for key_, v in recs.items()}, 0)
        texts.append(
            compose_text(
                fields,
                [int(t) for t in tmpl[b]],
                [int(o) for o in order[b]],
                int(recs["gender"][b]),
                pools=A["templates"],
            )
        )
    return texts


def bpe_key(assets_digest: str, vocab_size: int, n_bios: int) -> str:
    """16 hex digits naming the cached BPE of (the assets' digest, ``vocab_size``, ``n_bios``, this recipe, the
    ``tokenizers`` version)."""
    return "{:016x}".format(
        stable_hash64(
            "canonlm.data",
            "capo",
            "bpe",
            _TOKENIZER_RECIPE,
            assets_digest,
            vocab_size,
            n_bios,
            _tokenizers().__version__,
        )
    )


def cached_bpe(cache_dir: Path, assets: Mapping[str, Any], vocab_size: int, n_bios: int) -> tuple[Any, Path]:
    """(tokenizer, its cache path ``<cache_dir>/capo/bpe-<bpe_key>.json``): loaded from the cache if the file loads,
    else trained on :func:`bpe_training_texts` and written atomically (a corrupt entry is rebuilt; an unwritable
    cache keeps the in-memory tokenizer, which is deterministic)."""
    path = cache_dir / "capo" / f"bpe-{bpe_key(assets['digest'], vocab_size, n_bios)}.json"
    if path.is_file():
        try:
            return _tokenizers().Tokenizer.from_file(str(path)), path
        except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt
            pass
    tok = train_bpe(bpe_training_texts(assets, n_bios), vocab_size)
    try:
        atomic_write_text(path, tok.to_str())
    except OSError:  # read-only cache: keep the in-memory tokenizer (still deterministic)
        pass
    return tok, path
