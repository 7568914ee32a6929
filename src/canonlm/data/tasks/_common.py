"""Helpers shared by the task modules: config validation, index parsing, namespaces, the Depo/Brevo graph-size law,
printing token ids (paper App. A.1, A.2).

Every task constructor validates its config the same way (unknown keys, name mismatch, defaults merged, then one
check per key raising :class:`canonlm.errors.ConfigError` naming ``task.<key>``, the value and what is allowed), and
every ``generate`` / ``instance`` parses its (window, instance) indices the same way. The exact error texts are part
of the behaviour (tests and users read them), so each helper documents the message it raises.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.seeding import stable_hash64, to_unit, words


def is_int(v: Any) -> bool:
    """True for an integral number (Python int, numpy integer) that is not a bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def check_int(key: str, v: Any, lo: int, hi: int | None = None, allowed: str | None = None) -> int:
    """``int(v)`` if ``v`` is an integer (not a bool) in ``[lo, hi]`` (``hi`` None = no upper bound).

    Raises ConfigError(``task.<key>``, v, allowed) otherwise; ``allowed`` defaults to ``"an integer >= lo"``
    (no ``hi``) or ``"an integer in [lo, hi]"``.
    """
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        if allowed is None:
            allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ConfigError(f"task.{key}", v, allowed)
    return int(v)


def check_choice(key: str, v: Any, allowed: Sequence[str]) -> str:
    """``v`` if it is one of the strings ``allowed``; ConfigError(``task.<key>``, v, ``"a | b | ..."``) otherwise."""
    if not isinstance(v, str) or v not in allowed:
        raise ConfigError(f"task.{key}", v, " | ".join(allowed))
    return v


def check_bool(key: str, v: Any, allowed: str = "true | false") -> bool:
    """``v`` if it is a bool (not merely truthy); ConfigError(``task.<key>``, v, allowed) otherwise."""
    if not isinstance(v, bool):
        raise ConfigError(f"task.{key}", v, allowed)
    return v


def merge_config(
    name: str,
    cfg: Mapping[str, Any],
    defaults: Mapping[str, Mapping[str, Any]],
    keys: Sequence[str],
    mismatch: str | None = None,
) -> dict[str, Any]:
    """The prologue of every task constructor: ``{**defaults[name], **cfg}`` after checking the name and keys.

    Args: name: the registry key the task is built with. cfg: the user's config (missing keys take defaults).
        defaults: registry key -> default config of the task(s) the class implements. keys: the known config keys
        (in the order the error lists them). mismatch: the ``allowed`` text for a ``cfg["name"]`` that differs from
        ``name`` (default ``"'<name>' (the registry key it was built with)"``).
    Returns a new dict with every key of ``defaults[name]``.
    Raises ConfigError, in this order: ``task.name`` (name not in ``defaults``; allowed: the names joined by
    ``" | "``), ``task.<k>`` for the first unknown key k (sorted as strings; allowed: ``"a known key: <keys>"``),
    ``task.name`` if ``cfg["name"]`` differs from ``name``.
    """
    if name not in defaults:
        raise ConfigError("task.name", name, " | ".join(defaults))
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(keys), key=str)
    if unknown:
        raise ConfigError(f"task.{unknown[0]}", cfg[unknown[0]], f"a known key: {', '.join(keys)}")
    if cfg.get("name", name) != name:
        raise ConfigError(
            "task.name", cfg["name"], f"{name!r} (the registry key it was built with)" if mismatch is None else mismatch
        )
    return {**defaults[name], **cfg}


def excl_cumsum(x: np.ndarray) -> np.ndarray:
    """int64 (len(x)+1,): the exclusive prefix sum ``[0, x0, x0+x1, ...]`` of a 1-D array."""
    out = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def check_indices(w: Any, i: Any) -> tuple[np.ndarray, np.ndarray]:
    """(w, i) as flat int64 arrays of instance keys (window index, instance index within the window).

    Raises ValueError ``"w and i must have the same length, got <a> and <b>"`` or ``"window and instance indices
    must be >= 0"``.
    """
    w = np.asarray(w, dtype=np.int64).reshape(-1)
    i = np.asarray(i, dtype=np.int64).reshape(-1)
    if w.shape != i.shape:
        raise ValueError(f"w and i must have the same length, got {w.shape[0]} and {i.shape[0]}")
    if w.size and (w.min() < 0 or i.min() < 0):
        raise ValueError("window and instance indices must be >= 0")
    return w, i


def parse_index(index: Any, from_int: Callable[[int], tuple[int, int]] | None = None) -> tuple[int, int]:
    """(w, i) of a task's ``instance(split, index)`` argument: a pair of ints, or an int k mapped by ``from_int``
    (default: ``(k, 0)``, window k). The values are not range-checked here (``generate`` does that).

    Raises ValueError ``"index=<repr> is not allowed; allowed: an int or a pair (window, instance) of ints"``.
    """
    if is_int(index):
        return (int(index), 0) if from_int is None else from_int(int(index))
    if isinstance(index, tuple) and len(index) == 2 and all(is_int(x) for x in index):
        return int(index[0]), int(index[1])
    raise ValueError(f"index={index!r} is not allowed; allowed: an int or a pair (window, instance) of ints")


def cached_namespace(cache: dict, split: str, seed: Any, default_seed: int, parts: Callable[[], Sequence[Any]]) -> int:
    """The 64-bit namespace ``stable_hash64(*parts(), split, seed)`` of a task's split (:mod:`canonlm.data.seeding`),
    cached in ``cache`` per (split, seed); ``parts`` (called only on a cache miss) names the task and its generative
    parameters. ``seed`` None means ``default_seed``.

    Raises ValueError ``"seed=<repr> is not allowed; allowed: an integer"`` for a non-integer seed.
    """
    seed = default_seed if seed is None else seed
    if not is_int(seed):
        raise ValueError(f"seed={seed!r} is not allowed; allowed: an integer")
    key = (split, int(seed))
    ns = cache.get(key)
    if ns is None:
        ns = cache[key] = stable_hash64(*parts(), split, int(seed))
    return ns


# ---------------------------------------------------------------------------------------------- Depo / Brevo sizes
def size_law_cdf(N: int) -> np.ndarray:
    """float64 (N-2,): cumulative P(n) over n = 3..N of the training size law P(n) ∝ 1/(n + sqrt N) (Depo and Brevo,
    paper App. A.1, A.2); the last entry is exactly 1."""
    n = np.arange(3, N + 1, dtype=np.float64)
    p = 1.0 / (n + math.sqrt(N))
    cdf = np.cumsum(p / p.sum())
    cdf[-1] = 1.0
    return cdf


def size_law_probs(cdf: np.ndarray) -> np.ndarray:
    """float64 (N+1,): P(n) indexed by n (0 for n < 3) of a :func:`size_law_cdf` (N = len(cdf) + 2)."""
    p = np.zeros(cdf.shape[0] + 3)
    p[3:] = np.diff(np.concatenate([[0.0], cdf]))
    return p


def draw_sizes(split: str, keys: np.ndarray, N: int, cdf: np.ndarray, purpose: int) -> np.ndarray:
    """int64 (I,): the size n of each instance key (uint64 (I,)): train -> n = 3 + (index of the word
    ``words(key, purpose, 0)``, as a unit float, in ``cdf``); val/test -> n = N."""
    if split == "train":
        u = to_unit(words(keys, purpose, 0))
        return 3 + np.searchsorted(cdf, u, side="right").astype(np.int64)
    return np.full(keys.shape[0], N, dtype=np.int64)


# ---------------------------------------------------------------------------------------------- Depo / Brevo2 names
def name_space(V: int, min_len: int, max_len: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """The multi-token names of Depo and Brevo2 (paper App. A.1): a name of length l has l-1 tokens in 1..V
    and a final token in V+1..2V; names are numbered by length index li = l - min_len, then in base V.

    Returns (count int64 (nl,): V**l names of each length; off int64 (nl+1,): first code of each length, off[-1] =
    the number of names). Raises ConfigError(``task.vocab_V``, V, "a value giving at least N=<N> distinct names
    (lengths <min_len>..<max_len> give <total>)") if there are fewer than N names.
    """
    count = V ** np.arange(min_len, max_len + 1, dtype=np.int64)
    off = excl_cumsum(count)
    if int(off[-1]) < N:
        raise ConfigError(
            "task.vocab_V",
            V,
            f"a value giving at least N={N} distinct names (lengths {min_len}..{max_len} give {int(off[-1])})",
        )
    return count, off


def name_token_rows(
    code: np.ndarray, off: np.ndarray, min_len: int, max_len: int, V: int, vpow: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the names ``code`` (int64 (S,), numbered as in :func:`name_space` with offsets ``off``):
    (tokens int64 (S, max_len), token j = base-V digit j of the code within its length + 1, the last one + V,
    0 beyond the name's length; lengths int64 (S,)). ``vpow`` = int64 V**arange(max_len)."""
    li = np.searchsorted(off, code, side="right") - 1
    c = code - off[li]
    L = min_len + li
    tok = 1 + (c[:, None] // vpow[None, :]) % V  # digit j <-> token j of the name
    tok[np.arange(code.shape[0]), L - 1] += V  # final token in V+1..2V
    tok[np.arange(max_len)[None, :] >= L[:, None]] = 0
    return tok, L


# ---------------------------------------------------------------------------------------------- printing ids
def _id_list(ids: Any) -> list:
    return ids.tolist() if hasattr(ids, "tolist") else ids


def decode_plain(ids: Any, names: Sequence[str]) -> str:
    """Space-separated ``names[id]`` of a 1-D id sequence (list, numpy array or torch tensor); an id outside
    ``[0, len(names))`` prints as ``<unk_id>``."""
    return " ".join(names[int(t)] if 0 <= int(t) < len(names) else f"<unk_{int(t)}>" for t in _id_list(ids))


def decode_names(
    ids: Any, names: Sequence[str], is_name: Callable[[int], bool], is_final: Callable[[int], bool]
) -> str:
    """Like :func:`decode_plain`, but consecutive name tokens (``is_name(id)``) are joined with ``.`` into one name,
    closed by a final token (``is_final(id)``); a name cut short by a non-name token or the end is printed with a
    trailing ``?``. Example: ``<bos> p3.e7 e2 <query_2> e2 <ans> e5``."""
    out: list[str] = []
    cur: list[str] = []
    for t in _id_list(ids):
        t = int(t)
        nm = names[t] if 0 <= t < len(names) else f"<unk_{t}>"
        if is_name(t):
            cur.append(nm)
            if is_final(t):
                out.append(".".join(cur))
                cur = []
            continue
        if cur:
            out.append(".".join(cur) + "?")  # unterminated name
            cur = []
        out.append(nm)
    if cur:
        out.append(".".join(cur) + "?")
    return " ".join(out)


__all__ = [
    "is_int",
    "check_int",
    "check_choice",
    "check_bool",
    "merge_config",
    "excl_cumsum",
    "check_indices",
    "parse_index",
    "cached_namespace",
    "size_law_cdf",
    "size_law_probs",
    "draw_sizes",
    "name_space",
    "name_token_rows",
    "decode_plain",
    "decode_names",
]
