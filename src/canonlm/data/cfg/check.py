"""Recogniser: is a terminal string derivable from the root of a layered grammar? (paper App. A.5)

Layered CYK on bitsets, compiled with numba. For every level, bottom-up, and every symbol A of that level and start
position i, ``E[A, i]`` is the bitset of end positions j such that A =>* s[i:j]. Terminal a: ``E[a, i] = {i+1}`` iff
s_i = a. Rule A -> X1 .. Xm: start from F = E[X1, i] and replace F by the union of E[Xk, e] over e in F for
k = 2..m; A's ends are the union over its rules. A level-l symbol only spans lengths in [minlen(A), maxlen(A)], so
starts with i + minlen(A) > n are skipped; at the root only start 0 matters and s is accepted iff n is in
E[root, 0]. Work per sentence is O(levels x rules x n x (ends per start) x n/64) words and memory
O(symbols per level x n x n/64) bytes: milliseconds and well under a megabyte for the paper's grammars.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from canonlm.data.cfg.grammar import Grammar


@njit(cache=True, inline="always")
def _ctz(x):
    """Index of the lowest set bit of a non-zero uint64 (bit scan by halving)."""
    n = 0
    if (x & np.uint64(0xFFFFFFFF)) == 0:
        n += 32
        x >>= np.uint64(32)
    if (x & np.uint64(0xFFFF)) == 0:
        n += 16
        x >>= np.uint64(16)
    if (x & np.uint64(0xFF)) == 0:
        n += 8
        x >>= np.uint64(8)
    if (x & np.uint64(0xF)) == 0:
        n += 4
        x >>= np.uint64(4)
    if (x & np.uint64(0x3)) == 0:
        n += 2
        x >>= np.uint64(2)
    if (x & np.uint64(0x1)) == 0:
        n += 1
    return n


@njit(cache=True)
def _recognise_one(s, lvl_off, rule_off, child_off, child, minlen, maxlen, depth, T):
    n = s.shape[0]
    if n < minlen[0] or n > maxlen[0]:
        return False
    for i in range(n):
        if s[i] < 1 or s[i] > T:
            return False
    W = (n + 1 + 63) // 64
    one = np.uint64(1)
    # child level table: terminals
    E_child = np.zeros((T, n + 1, W), dtype=np.uint64)
    any_child = np.zeros((T, n + 1), dtype=np.bool_)
    for i in range(n):
        a = s[i] - 1
        E_child[a, i, (i + 1) >> 6] |= one << np.uint64((i + 1) & 63)
        any_child[a, i] = True
    F = np.zeros(W, dtype=np.uint64)
    G = np.zeros(W, dtype=np.uint64)
    for lv in range(depth - 1, -1, -1):
        g0 = lvl_off[lv]
        c0 = lvl_off[lv + 1]
        size = lvl_off[lv + 1] - g0
        E = np.zeros((size, n + 1, W), dtype=np.uint64)
        anyE = np.zeros((size, n + 1), dtype=np.bool_)
        for a in range(size):
            g = g0 + a
            i_max = n - minlen[g]
            if lv == 0:
                i_max = 0
            for i in range(i_max + 1):
                for k in range(rule_off[g], rule_off[g + 1]):
                    x = child[child_off[k]] - c0
                    if not any_child[x, i]:
                        continue
                    for w in range(W):
                        F[w] = E_child[x, i, w]
                    alive = True
                    for cpos in range(child_off[k] + 1, child_off[k + 1]):
                        x = child[cpos] - c0
                        for w in range(W):
                            G[w] = 0
                        alive = False
                        for w in range(W):
                            bits = F[w]
                            while bits != 0:
                                b = _ctz(bits)
                                bits &= bits - one
                                e = (w << 6) + b
                                if any_child[x, e]:
                                    alive = True
                                    for w2 in range(W):
                                        G[w2] |= E_child[x, e, w2]
                        if not alive:
                            break
                        for w in range(W):
                            F[w] = G[w]
                    if alive:
                        nz = False
                        for w in range(W):
                            E[a, i, w] |= F[w]
                            if F[w] != 0:
                                nz = True
                        if nz:
                            anyE[a, i] = True
        E_child = E
        any_child = anyE
    return (E_child[0, 0, n >> 6] >> np.uint64(n & 63)) & one == one


@njit(cache=True)
def _recognise_many(tokens, offsets, lvl_off, rule_off, child_off, child, minlen, maxlen, depth, T):
    m = offsets.shape[0] - 1
    out = np.zeros(m, dtype=np.bool_)
    for r in range(m):
        out[r] = _recognise_one(
            tokens[offsets[r] : offsets[r + 1]], lvl_off, rule_off, child_off, child, minlen, maxlen, depth, T
        )
    return out


def _ragged(sentences) -> tuple[np.ndarray, np.ndarray]:
    seqs = [np.asarray(s.tolist() if hasattr(s, "tolist") else s, dtype=np.int64).reshape(-1) for s in sentences]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([s.shape[0] for s in seqs], out=offsets[1:])
    tokens = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    return np.ascontiguousarray(tokens, dtype=np.int64), offsets


def check(grammar: Grammar, sentences: Sequence) -> np.ndarray:
    """Which sentences are derivable from the grammar's root.

    Args:
        grammar: the PCFG. sentences: a sequence of m 1-D integer sequences (arrays, lists or tensors) of terminal
            tokens 1..|T| (no <bos>).
    Returns: bool (m,). The empty sentence and any sentence containing a token outside 1..|T| (e.g. <bos> or pad)
        are not derivable (False).
    """
    tokens, offsets = _ragged(sentences)
    return check_ragged(grammar, tokens, offsets)


def check_ragged(grammar: Grammar, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`check` on a ragged batch: sentence r is ``tokens[offsets[r]:offsets[r+1]]``.

    Args: tokens: int (S,). offsets: int (m+1,), non-decreasing, offsets[0] >= 0, offsets[-1] <= S.
    Returns: bool (m,). Raises ValueError for malformed offsets.
    """
    tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
    offsets = np.ascontiguousarray(np.asarray(offsets, dtype=np.int64).reshape(-1))
    if offsets.shape[0] < 1 or offsets[0] < 0 or offsets[-1] > tokens.shape[0] or (np.diff(offsets) < 0).any():
        raise ValueError("offsets must be non-decreasing indices into tokens, (m+1,) with m >= 0")
    f = grammar.flat
    return _recognise_many(
        tokens, offsets, f.lvl_off, f.rule_off, f.child_off, f.child, f.minlen, f.maxlen, f.depth, f.num_terminals
    )


__all__ = ["check", "check_ragged"]
