"""Counter-based random numbers: every draw is a pure function of (namespace, window, instance, purpose, counter).

No process-global RNG state is used anywhere in ``canonlm.data``: the
random word number ``j`` of purpose ``p`` of instance ``(w, i)`` in namespace ``ns`` is

    key(ns, w, i) = mix64(mix64(ns + w * G) + i * G)
    word          = mix64(key + (p * 2**32 + j + 1) * G)          (all arithmetic mod 2**64)

where ``G = 0x9E3779B97F4A7C15`` (the golden-ratio increment) and ``mix64`` is the SplitMix64 output function
(Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; finaliser constants of
Stafford's "Mix13"). Words of one instance are therefore consecutive outputs of SplitMix64 seeded with ``key``;
being counter-based, they vectorise over many instances at once in numpy, which a per-instance
``numpy.random.Generator`` cannot do. The namespace ``ns`` is a 64-bit blake2b digest of the seed, task name,
generative parameters and split, so splits (train / val / test) use disjoint namespaces.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

_GOLDEN_INT = 0x9E3779B97F4A7C15
GOLDEN = np.uint64(_GOLDEN_INT)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_PURPOSE_SHIFT = 2**32  # counters of one purpose: j < 2**32


def stable_hash64(*parts: Any) -> int:
    """64-bit blake2b digest of ``parts`` (JSON-serialised with sorted keys; tuples become lists).

    Stable across processes, platforms and Python versions (unlike ``hash``). Returns an int in [0, 2**64).
    Raises TypeError if a part is not JSON-serialisable.
    """
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_json_default).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    raise TypeError(f"stable_hash64: cannot serialise {type(x).__name__}")


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on a uint64 array (any shape); returns a new uint64 array."""
    z = np.asarray(z, dtype=np.uint64)
    if z.ndim == 0:  # 0-d operands would warn on the (intended) wrap-around
        return mix64(z.reshape(1)).reshape(())
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def instance_keys(ns: int, w: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Keys of instances ``(w, i)`` in namespace ``ns``.

    Args: ns: namespace in [0, 2**64); w, i: non-negative integer arrays (broadcastable), window and instance index.
    Returns a uint64 array of the broadcast shape.
    """
    w = np.asarray(w, dtype=np.uint64)
    i = np.asarray(i, dtype=np.uint64)
    if w.ndim == 0 or i.ndim == 0:
        shape = np.broadcast_shapes(w.shape, i.shape)
        w, i = np.broadcast_arrays(np.atleast_1d(w), np.atleast_1d(i))
        return instance_keys(ns, w, i).reshape(shape)
    return mix64(mix64(np.uint64(ns) + w * GOLDEN) + i * GOLDEN)


def words(keys: np.ndarray, purpose: int | np.ndarray, j: np.ndarray | int) -> np.ndarray:
    """Random 64-bit words: word ``j`` of ``purpose`` for each key (``keys``, ``purpose`` and ``j`` broadcast;
    0 <= j < 2**32, 0 <= purpose < 2**31).

    Returns uint64 of the broadcast shape; each word is uniform on [0, 2**64).
    """
    keys = np.asarray(keys, dtype=np.uint64)
    if keys.ndim == 0:
        return words(keys.reshape(1), purpose, j).reshape(np.broadcast_shapes((), np.shape(purpose), np.shape(j)))
    if isinstance(purpose, int) and isinstance(j, int):
        return mix64(keys + np.uint64(((purpose * _PURPOSE_SHIFT + j + 1) * _GOLDEN_INT) % 2**64))
    ctr = (
        np.asarray(j, dtype=np.uint64) + np.asarray(purpose, dtype=np.uint64) * np.uint64(_PURPOSE_SHIFT) + np.uint64(1)
    )
    return mix64(keys + ctr * GOLDEN)


def to_unit(w: np.ndarray) -> np.ndarray:
    """uint64 words -> float64 uniform on [0, 1) with 53 random bits (``(w >> 11) * 2**-53``)."""
    return (w >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def below(w: np.ndarray, high: np.ndarray | int) -> np.ndarray:
    """uint64 words -> integers uniform on [0, high) as int64, by ``w mod high``.

    ``high`` (int or array, broadcast) must be in [1, 2**40]: the modulo bias is then below ``high / 2**64 <
    2**-24`` in relative probability (callers validate their bounds). Returns int64.
    """
    return (w % np.asarray(high, dtype=np.uint64)).astype(np.int64)
