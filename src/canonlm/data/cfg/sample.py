"""Counter-based top-down sampler of a layered PCFG (paper App. A.5), compiled with numba.

Sentence of key ``k`` (a uint64 instance key of :mod:`canonlm.data.seeding`): level by level from the root, the
non-terminal at position p of level l picks rule ``w % #rules`` with ``w = words(k, purpose, p)``,
``purpose = _PURPOSE_BASE + attempt * (depth + 1) + l``; the next level is the concatenation of the chosen rules'
children. ``attempt`` starts at 0; a sentence longer than ``max_len`` is redrawn with ``attempt + 1`` (rejection:
the result is the length-``<= max_len`` conditional of the grammar's law; with ``max_len >= sentence_max_len`` no
draw is ever rejected). The words are exactly :func:`canonlm.data.seeding.words` (SplitMix64 of a counter, drawn
with :mod:`canonlm.data.seeding_numba`), so a sentence is a pure function of (key, grammar, max_len), whatever
else is sampled in the same call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from canonlm.data.cfg.grammar import Grammar
from canonlm.data.seeding_numba import word_at, word_base

_PURPOSE_BASE = 16  # purposes 0..15 are left to the task (evaluation keys etc.)
_MAX_ATTEMPTS = 1_000_000


@njit(cache=True)
def _sample_kernel(keys, max_len, prefix_tok, lvl_off, rule_off, child_off, child, depth, purpose_base, cap_hint):
    """Sample one sentence per key. Returns (tokens int64 (S,), offsets int64 (I+1,), attempts int64 (I,)).

    Each instance is ``[prefix_tok] + sentence`` when prefix_tok > 0 (else the bare sentence). attempts[r] = number
    of rejected draws of instance r (sentences longer than max_len). attempts[r] = -1 if _MAX_ATTEMPTS draws failed.
    """
    I = keys.shape[0]
    has_pre = 1 if prefix_tok > 0 else 0
    T_first = lvl_off[depth]
    cap = max(cap_hint, I * has_pre + 16)
    out = np.empty(cap, dtype=np.int64)
    offsets = np.zeros(I + 1, dtype=np.int64)
    attempts = np.zeros(I, dtype=np.int64)
    buf_a = np.empty(max_len + 1, dtype=np.int64)
    buf_b = np.empty(max_len + 1, dtype=np.int64)
    pos = 0
    for r in range(I):
        key = keys[r]
        att = 0
        n = 0
        while True:
            cur = buf_a
            nxt = buf_b
            cur[0] = 0  # the root (global symbol 0)
            n = 1
            ok = True
            for lv in range(depth):
                base = word_base(key, purpose_base + att * (depth + 1) + lv)
                m = 0
                for p in range(n):
                    g = cur[p]
                    r0 = rule_off[g]
                    deg = rule_off[g + 1] - r0
                    if deg == 1:
                        k = r0
                    else:
                        w = word_at(base, p)
                        k = r0 + np.int64(w % np.uint64(deg))
                    c0 = child_off[k]
                    c1 = child_off[k + 1]
                    if m + (c1 - c0) > max_len:
                        ok = False
                        break
                    for c in range(c0, c1):
                        nxt[m] = child[c]
                        m += 1
                if not ok:
                    break
                cur, nxt = nxt, cur
                n = m
            if ok:
                break
            att += 1
            if att >= 1000000:
                attempts[r] = -1
                return out[:0], offsets, attempts
        attempts[r] = att
        need = pos + n + has_pre
        if need > out.shape[0]:
            new_cap = max(need, 2 * out.shape[0])
            bigger = np.empty(new_cap, dtype=np.int64)
            bigger[:pos] = out[:pos]
            out = bigger
        if has_pre:
            out[pos] = prefix_tok
            pos += 1
        for p in range(n):
            out[pos + p] = cur[p] - T_first + 1
        pos += n
        offsets[r + 1] = pos
    return out[:pos], offsets, attempts


def sample_sentences(
    grammar: Grammar,
    keys: np.ndarray,
    max_len: int | None = None,
    prefix_bos: bool = False,
    mean_len: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample one sentence per key (single-threaded numba kernel).

    Args:
        grammar: the PCFG. keys: uint64 (I,) instance keys (:func:`canonlm.data.seeding.instance_keys`).
        max_len: reject and redraw sentences longer than this (None = ``grammar.sentence_max_len``: no rejection).
            Must be >= ``grammar.sentence_min_len``.
        prefix_bos: prepend ``grammar.bos_id`` to every sentence (the task's instance layout ``<bos> s``).
        mean_len: expected sentence length (sizes the output buffer; optional).
    Returns: (tokens int64 (S,), offsets int64 (I+1,), attempts int64 (I,)): instance r is
        ``tokens[offsets[r]:offsets[r+1]]`` (terminal tokens 1..|T|, preceded by <bos> with prefix_bos);
        attempts[r] = rejected draws before the accepted one.
    Raises: ValueError for max_len < sentence_min_len; RuntimeError if an instance needed 10**6 draws.
    """
    keys = np.ascontiguousarray(np.asarray(keys, dtype=np.uint64).reshape(-1))
    ml = grammar.sentence_max_len if max_len is None else min(int(max_len), grammar.sentence_max_len)
    if ml < grammar.sentence_min_len:
        raise ValueError(
            f"max_len={max_len!r} is not allowed; allowed: an integer >= the shortest sentence "
            f"({grammar.sentence_min_len})"
        )
    f = grammar.flat
    mean = float(mean_len) if mean_len else 0.5 * (grammar.sentence_min_len + ml)
    cap_hint = int(keys.shape[0] * (mean * 1.25 + 1)) + ml + 1
    tok, off, att = _sample_kernel(
        keys,
        ml,
        grammar.bos_id if prefix_bos else 0,
        f.lvl_off,
        f.rule_off,
        f.child_off,
        f.child,
        f.depth,
        _PURPOSE_BASE,
        cap_hint,
    )
    if keys.shape[0] and att.min() < 0:
        raise RuntimeError(f"a sentence of length <= {ml} was not found in {_MAX_ATTEMPTS} draws")
    return tok, off, att


__all__ = ["sample_sentences"]
