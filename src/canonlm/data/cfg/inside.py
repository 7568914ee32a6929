"""Exact next-symbol distribution of a layered PCFG along a sentence, and the Lano KL (paper App. A.5).

For a sentence s (terminal tokens, length n) :func:`next_symbol_probs` returns p* float64 (n+1, C) over the symbols
C = [eos, 1, .., |T|]: row t = P(next symbol | <bos> s[:t]) under the PCFG with uniform rule choice (the release's
``solve_dp_prob_highprecision`` ground truth, without its 100-digit decimals).

Derivation (all leaves of a layered grammar sit on the terminal level, so the level-``depth`` node starting at
position t *is* token t):

1. Inside, bottom-up: In(A, i, j) = P(A =>* s[i:j]); terminal a: In(a, i, i+1) = [s_i = a]; rule A -> X1..Xm with
   probability 1/#rules(A): In(A, i, j) = sum_r 1/#rules sum over split points of prod_k In(Xk, ., .). Stored
   sparsely (only non-zero spans, per symbol and start; a level-l symbol spans lengths in [minlen, maxlen]).
2. Left-outside, top-down: LO(A, i) = P(the derivation has a level-l node A whose yield starts at i, and the
   yield left of it is s[:i]) (right context free). LO(root, 0) = 1; a node Q at i with rule Q -> X1..Xm gives
   child Xk the start e and weight LO(Q, i)/#rules(Q) * P(X1..X(k-1) =>* s[i:e]).
3. At the terminal level LO(c, t) = P(<bos> s[:t] c ...), the prefix probability of s[:t] followed by c; the
   probability that the sentence ends after s[:t] is In(root, 0, t). Hence
   Z_t = sum_c LO(c, t) + In(root, 0, t) = P(prefix s[:t]),
   p*(c | s[:t]) = LO(c, t) / Z_t, p*(eos | s[:t]) = In(root, 0, t) / Z_t; rows sum to 1 by construction.
   (This is the brief's prefix recursion Pre(A, i; t) evaluated for every t at once.)

Numerics: float64 with a per-token scale, In~(A, i, j) = In(A, i, j) e^{alpha (j-i)} and LO~(A, i) = LO(A, i)
e^{alpha i} (consistent under concatenation; the scales cancel in every ratio of step 3), alpha = the grammar's
mean -log P(derivation) per token. If any stored magnitude leaves [1e-280, 1e280] (possible only for very long or
atypical sentences) the computation is redone in log space (``method="auto"``). Both are exact to float64
rounding (checked against brute-force enumeration to 1e-12 in the tests).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numba import njit

from canonlm.data.cfg.grammar import Grammar

_LO_BOUND, _HI_BOUND = 1e-280, 1e280
SMOOTH = 1e-5  # the release's demo smoothing of both distributions


@njit(cache=True, inline="always")
def _add(a, b, use_log):
    if use_log:
        if a == -np.inf:
            return b
        if b == -np.inf:
            return a
        if a > b:
            return a + math.log1p(math.exp(b - a))
        return b + math.log1p(math.exp(a - b))
    return a + b


@njit(cache=True, inline="always")
def _mul(a, b, use_log):
    if use_log:
        return a + b
    return a * b


@njit(cache=True)
def _extend(fpos, fval, nf, x, n, row_cnt, row_start, ends, vals, acc2, zero, use_log):
    """Extend a frontier by one more child symbol: the weighted end positions ``fpos[:nf]`` / ``fval[:nf]`` of the
    children so far become the end positions after ``x`` (sum over x's stored inside spans starting at each of
    them). Writes the new frontier, in increasing position, back into ``fpos`` / ``fval`` and returns its size.
    ``acc2`` (n+1,) is all-``zero`` scratch on entry and on exit."""
    lo = n + 1
    hi = -1
    for q in range(nf):
        r2 = x * (n + 1) + fpos[q]
        st2 = row_start[r2]
        for q2 in range(row_cnt[r2]):
            e2 = ends[st2 + q2]
            acc2[e2] = _add(acc2[e2], _mul(fval[q], vals[st2 + q2], use_log), use_log)
            if e2 < lo:
                lo = e2
            if e2 > hi:
                hi = e2
    nf = 0
    for e2 in range(lo, hi + 1):
        if acc2[e2] != zero:
            fpos[nf] = e2
            fval[nf] = acc2[e2]
            nf += 1
            acc2[e2] = zero
    return nf


@njit(cache=True)
def _inside_kernel(s, lvl_off, rule_off, child_off, child, minlen, maxlen, depth, T, alpha, use_log):
    """Returns (p (n+1, T+1) float64, status): status 0 = ok, 1 = a scaled magnitude left the safe range (linear
    mode only; redo in log space), 2 = a token outside 1..T."""
    n = s.shape[0]
    G = lvl_off[depth + 1]
    NR = G * (n + 1)
    zero = -np.inf if use_log else 0.0
    one = 0.0 if use_log else 1.0
    p_out = np.full((n + 1, T + 1), np.nan)
    for i in range(n):
        if s[i] < 1 or s[i] > T:
            return p_out, 2
    row_start = np.zeros(NR, dtype=np.int64)
    row_cnt = np.zeros(NR, dtype=np.int64)
    cap = 4 * (n + 1) * 8 + 64
    ends = np.empty(cap, dtype=np.int64)
    vals = np.empty(cap, dtype=np.float64)
    nnz = 0
    vmin = np.inf
    vmax = 0.0
    tstep = alpha if use_log else math.exp(alpha)
    # terminal level
    t0 = lvl_off[depth]
    for i in range(n):
        row = (t0 + s[i] - 1) * (n + 1) + i
        row_start[row] = nnz
        row_cnt[row] = 1
        ends[nnz] = i + 1
        vals[nnz] = tstep
        nnz += 1
    acc = np.full(n + 1, zero)
    acc2 = np.full(n + 1, zero)
    fpos = np.empty(n + 1, dtype=np.int64)
    fval = np.empty(n + 1, dtype=np.float64)
    # ---------------------------------------------------------------- inside, bottom-up
    for lv in range(depth - 1, -1, -1):
        for g in range(lvl_off[lv], lvl_off[lv + 1]):
            deg = rule_off[g + 1] - rule_off[g]
            wr = -math.log(deg) if use_log else 1.0 / deg
            i_max = n - minlen[g]
            if lv == 0:
                i_max = min(i_max, 0)
            for i in range(i_max + 1):
                for k in range(rule_off[g], rule_off[g + 1]):
                    # frontier after the first child
                    x = child[child_off[k]]
                    r = x * (n + 1) + i
                    nf = row_cnt[r]
                    if nf == 0:
                        continue
                    st = row_start[r]
                    for q in range(nf):
                        fpos[q] = ends[st + q]
                        fval[q] = vals[st + q]
                    for cpos in range(child_off[k] + 1, child_off[k + 1]):
                        nf = _extend(
                            fpos, fval, nf, child[cpos], n, row_cnt, row_start, ends, vals, acc2, zero, use_log
                        )
                        if nf == 0:
                            break
                    for q in range(nf):
                        e = fpos[q]
                        acc[e] = _add(acc[e], _mul(wr, fval[q], use_log), use_log)
                # emit row (g, i)
                row = g * (n + 1) + i
                row_start[row] = nnz
                lo = i + minlen[g]
                hi = min(i + maxlen[g], n)
                for e in range(lo, hi + 1):
                    v = acc[e]
                    if v != zero:
                        if nnz >= ends.shape[0]:
                            new_cap = 2 * ends.shape[0]
                            e_new = np.empty(new_cap, dtype=np.int64)
                            v_new = np.empty(new_cap, dtype=np.float64)
                            e_new[:nnz] = ends[:nnz]
                            v_new[:nnz] = vals[:nnz]
                            ends = e_new
                            vals = v_new
                        ends[nnz] = e
                        vals[nnz] = v
                        nnz += 1
                        if not use_log:
                            if v < vmin:
                                vmin = v
                            if v > vmax:
                                vmax = v
                        acc[e] = zero
                row_cnt[row] = nnz - row_start[row]
    # ---------------------------------------------------------------- left-outside, top-down
    LO = np.full((G, n + 1), zero)
    LO[0, 0] = one
    for lv in range(depth):
        for g in range(lvl_off[lv], lvl_off[lv + 1]):
            deg = rule_off[g + 1] - rule_off[g]
            wr = -math.log(deg) if use_log else 1.0 / deg
            for i in range(n + 1):
                base = LO[g, i]
                if base == zero:
                    continue
                if not use_log:
                    if base < vmin:
                        vmin = base
                    if base > vmax:
                        vmax = base
                w0 = _mul(base, wr, use_log)
                for k in range(rule_off[g], rule_off[g + 1]):
                    nf = 1
                    fpos[0] = i
                    fval[0] = w0
                    c_end = child_off[k + 1]
                    for cpos in range(child_off[k], c_end):
                        x = child[cpos]
                        for q in range(nf):
                            e = fpos[q]
                            LO[x, e] = _add(LO[x, e], fval[q], use_log)
                        if cpos == c_end - 1:
                            break
                        nf = _extend(fpos, fval, nf, x, n, row_cnt, row_start, ends, vals, acc2, zero, use_log)
                        if nf == 0:
                            break
    if not use_log and (vmax > 1e280 or vmin < 1e-280):
        return p_out, 1
    # ---------------------------------------------------------------- normalise
    root_end = np.full(n + 1, zero)
    st = row_start[0]
    for q in range(row_cnt[0]):
        root_end[ends[st + q]] = vals[st + q]
    for t in range(n + 1):
        z = root_end[t]
        for c in range(T):
            z = _add(z, LO[t0 + c, t], use_log)
        if z == zero:
            continue  # impossible prefix: row stays NaN
        if use_log:
            p_out[t, 0] = math.exp(root_end[t] - z)
            for c in range(T):
                p_out[t, c + 1] = math.exp(LO[t0 + c, t] - z)
        else:
            p_out[t, 0] = root_end[t] / z
            for c in range(T):
                p_out[t, c + 1] = LO[t0 + c, t] / z
    return p_out, 0


def next_symbol_probs(grammar: Grammar, sentence: Sequence[int] | np.ndarray, method: str = "auto") -> np.ndarray:
    """Exact next-symbol distribution along ``sentence`` (module docstring).

    Args:
        grammar: the PCFG. sentence: terminal tokens 1..|T| (no <bos>), length n (may also be a prefix).
        method: ``auto`` (scaled float64, log space if the scaled range is exceeded) | ``scaled`` | ``log``.
    Returns: float64 (n+1, |T|+1); column 0 = eos, column c = terminal c; row t = P(next | <bos> s[:t]); rows of
        impossible prefixes (P(s[:t]) = 0) are NaN.
    Raises: ValueError for a token outside 1..|T|, an unknown method, or (``scaled``) a sentence whose scaled
        magnitudes leave float64's safe range.
    """
    if method not in ("auto", "scaled", "log"):
        raise ValueError(f"method={method!r} is not allowed; allowed: auto | scaled | log")
    s = np.ascontiguousarray(
        np.asarray(sentence.tolist() if hasattr(sentence, "tolist") else sentence, dtype=np.int64).reshape(-1)
    )
    f = grammar.flat
    alpha = _alpha(grammar)
    args = (s, f.lvl_off, f.rule_off, f.child_off, f.child, f.minlen, f.maxlen, f.depth, f.num_terminals, alpha)
    p, status = _inside_kernel(*args, method == "log")
    if status == 1:
        if method == "scaled":
            raise ValueError("scaled float64 range exceeded for this sentence; use method='log' or 'auto'")
        p, status = _inside_kernel(*args, True)
    if status == 2:
        raise ValueError(f"sentence tokens must lie in 1..{grammar.num_terminals} (no <bos>)")
    return p


def _alpha(grammar: Grammar) -> float:
    a = grammar.__dict__.get("_alpha_cache")
    if a is None:
        a = float(grammar.entropy_rate())
        object.__setattr__(grammar, "_alpha_cache", a)
    return a


def lano_kl(
    p_star: np.ndarray,
    model_logprobs: np.ndarray,
    symbol_ids: Sequence[int],
    restrict: str = "renormalize",
    weight: str = "exact",
) -> float:
    """KL between the exact next-symbol law and a model's, averaged over positions (paper App. A.5).

    Args:
        p_star: float (n+1, C), rows of :func:`next_symbol_probs` (C symbols, e.g. [eos, 1, .., |T|]).
        model_logprobs: float (n+1, V), the model's log-softmax over its whole vocabulary at the same positions
            (row t predicts the symbol after <bos> s[:t]; row n the end-of-sentence position).
        symbol_ids: the C vocabulary ids of the symbols, in p_star's column order (Lano: [<bos>, 1, .., |T|]).
        restrict: ``renormalize`` (default; the paper does not say): q = the model's softmax restricted to the C ids
            and renormalised, q(c) = exp(lp_c) / sum_c' exp(lp_c'). ``raw``: q(c) = exp(lp_c), the model's
            full-vocabulary probabilities of the C ids, not renormalised (they sum to 1 - m, m = the mass on other
            ids); the only renormalisation is then the smoothing's own division, so m changes the weight of the
            1e-5 smoothing relative to q (q~ = (q + 1e-5) / (1 - m + C 1e-5)).
        weight: ``exact`` (default): KL_t = sum_c p*(c) [log p~*(c) - log q~(c)];
            ``smoothed``: KL_t = sum_c p~*(c) [log p~*(c) - log q~(c)] (a true KL of the smoothed laws).
    Smoothing of both laws: x~ = (x + 1e-5) / sum(x + 1e-5).
    Returns: mean over the n+1 positions of KL_t (float, nats). Raises ValueError for shape mismatches or unknown
        modes.
    """
    p = np.asarray(p_star, dtype=np.float64)
    lp = np.asarray(model_logprobs, dtype=np.float64)
    ids = np.asarray(symbol_ids, dtype=np.int64)
    if p.ndim != 2 or lp.ndim != 2 or p.shape[0] != lp.shape[0] or p.shape[1] != ids.shape[0]:
        raise ValueError(
            f"p_star {p.shape}, model_logprobs {lp.shape}, symbol_ids {ids.shape}: need (R, C), (R, V) and (C,)"
        )
    if restrict not in ("renormalize", "raw"):
        raise ValueError(f"restrict={restrict!r} is not allowed; allowed: renormalize | raw")
    if weight not in ("exact", "smoothed"):
        raise ValueError(f"weight={weight!r} is not allowed; allowed: exact | smoothed")
    sel = lp[:, ids]
    if restrict == "renormalize":
        m = sel.max(1, keepdims=True)
        q = np.exp(sel - m)
        q /= q.sum(1, keepdims=True)
    else:
        q = np.exp(sel)
    ps = (p + SMOOTH) / (p + SMOOTH).sum(1, keepdims=True)
    qs = (q + SMOOTH) / (q + SMOOTH).sum(1, keepdims=True)
    w = p if weight == "exact" else ps
    return float((w * (np.log(ps) - np.log(qs))).sum(1).mean())


__all__ = ["next_symbol_probs", "lano_kl", "SMOOTH"]
