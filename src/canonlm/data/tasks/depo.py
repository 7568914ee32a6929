"""Depo1 / Depo2: k-hop traversal of an in-context cycle (paper App. A.1).

One instance (paper App. A.1):

    <bos> x1 y1 x2 y2 ... xn yn <query_k1> q1 <ans> a1 ... <query_kt> qt <ans> at [<eos>]

* n in {3..N}, P(n) ∝ 1/(n + sqrt N) (train); n = N (val/test).
* n distinct names; a name has length l uniform in [min_len, max_len]; its first l-1 tokens are uniform in 1..V,
  its last token uniform in V+1..2V. Distinct by rejection: the names are the first n distinct ones of an i.i.d.
  stream of draws (exactly what sequential rejection sampling produces).
* The names are shuffled into a cycle name_0 -> name_1 -> ... -> name_{n-1} -> name_0; the n edges (x, succ(x))
  are listed in a uniformly random order.
* t = min(n_queries, n) distinct sources q_j, uniformly chosen, each with depth k_j (train: uniform in 1..K;
  eval: ``eval_k_mode``, paper App. A.1); the answer a_j is the k_j-th successor of q_j (wrapping around).
* Loss targets (``loss_on: answers``, paper): ``<ans>`` and the answer tokens (and ``<eos>`` when enabled);
  ``loss_on: all``: every token. Scored (metric) tokens: the answer tokens only, grouped by k.

Vocabulary (``vocab: compact``): 0 = pad, 1..V = non-final name tokens, V+1..2V = final name tokens,
2V+1 = ``<bos>``, 2V+2 = ``<ans>``, 2V+2+k = ``<query_k>`` (k = 1..K), 2V+K+3 = ``<eos>`` (only if ``eos``);
``vocab_size = 2V + K + 3 (+1 with eos)``. ``vocab: official`` uses the release's ids (nodes 1..2V,
``<query_k>`` = 9000+k, ``<ans>`` = 9500, ``<bos>`` = 9999 as in Brevo (undefined in the release), ``<eos>`` = 9998
[gap, as Brevo's]) with ``vocab_size = 10000``; the instances are identical up to the id map.

Generation is vectorised over many instances at once with the counter-based words of
:mod:`canonlm.data.seeding`, so instance (w, i) of a split is a pure function of (seed, task name, generative
parameters, split, w, i), whatever else is generated in the same call.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from canonlm.data import ConfigError
from canonlm.data.seeding import below, instance_keys, words
from canonlm.data.tasks import Instance, InstanceBatch, check_split
from canonlm.data.tasks._common import (
    cached_namespace,
    check_bool,
    check_choice,
    check_indices,
    check_int,
    decode_names,
    draw_sizes,
    excl_cumsum,
    is_int,
    merge_config,
    name_space,
    name_token_rows,
    parse_index,
    size_law_cdf,
    size_law_probs,
)

_COMMON = dict(
    n_queries=10,
    eos=False,
    loss_on="answers",
    vocab="compact",
    context=2048,
    tail="drop",
    eval_k_mode="powers_of_two",
    eval_k=None,
    seed=0,
)
DEFAULTS: dict[str, dict[str, Any]] = {
    # paper App. A.1: Depo1 N in {225, 300, 375}, K = 8, V = 50, names of 1-2 tokens.
    "depo1": dict(name="depo1", N=225, K=8, vocab_V=50, min_len=1, max_len=2, **_COMMON),
    # Depo2 N in {75, 100, 125}, K = 16, V = 4 (paper; release demo V = 3), names of 5-7 tokens.
    "depo2": dict(name="depo2", N=75, K=16, vocab_V=4, min_len=5, max_len=7, **_COMMON),
}
KEYS = tuple(DEFAULTS["depo1"])

# Purposes of the random words of one instance (see canonlm.data.seeding.words).
_P_N, _P_NAME, _P_CYCLE, _P_EDGE, _P_QUERY, _P_K = range(6)
_MAX_NAMES = 2**40  # bound on V**max_len (modulo bias of seeding.below < 2**-24)
_OFFICIAL = dict(bos=9999, ans=9500, eos=9998, query_base=9000, vocab_size=10000)


class DepoTask:
    """Depo task (paper App. A.1). Build with :func:`canonlm.data.tasks.build_task`.

    Attributes:
        name: ``"depo1"`` | ``"depo2"``. cfg: the validated config (dict with every key of ``KEYS``).
        N, K, V, min_len, max_len, n_queries, eos, loss_on, vocab, context, tail, eval_k_mode, eval_k, seed: config.
        vocab_size: int, pad id 0 included. pad_id: 0 (never a loss target).
        num_groups: K + 1 (metric group = k; 0 = not scored). group_name: ``"k"``.
        bos_id, ans_id, eos_id (None without eos): special ids; ``query_id(k)`` -> id of ``<query_k>``.
        eval_ks: tuple of the depths eval queries use (powers_of_two: {1, 2, 4, ..} ∪ {K}; fixed: eval_k).
        chance: 1 / N, the whole-answer accuracy of guessing one of the n = N names of an eval instance (the floor
            failing models sit at in the paper's tables).
    Raises ConfigError (naming ``task.<key>``) for unknown keys, wrong types, N < 3, K < 1, vocab_V < 1,
    min_len > max_len, fewer distinct names than N, V**max_len > 2**40, unknown name / loss_on / vocab / tail /
    eval_k_mode, eval_k missing (fixed) or given (powers_of_two) or outside [1, K], official ids overflowing.
    """

    group_name = "k"
    pad_id = 0

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, DEFAULTS, KEYS)
        self.name = name
        self.N = check_int("N", c["N"], 3)
        self.K = check_int("K", c["K"], 1)
        self.V = check_int("vocab_V", c["vocab_V"], 1)
        self.min_len = check_int("min_len", c["min_len"], 1)
        self.max_len = check_int("max_len", c["max_len"], 1)
        if self.min_len > self.max_len:
            raise ConfigError("task.min_len", self.min_len, f"an integer <= task.max_len={self.max_len}")
        if self.V**self.max_len > _MAX_NAMES:
            raise ConfigError(
                "task.max_len", self.max_len, f"an integer with vocab_V**max_len <= 2**40 (vocab_V={self.V})"
            )
        self.n_queries = check_int("n_queries", c["n_queries"], 1)
        self.eos = check_bool("eos", c["eos"])
        self.loss_on = check_choice("loss_on", c["loss_on"], ("answers", "all"))
        self.vocab = check_choice("vocab", c["vocab"], ("compact", "official"))
        self.context = check_int("context", c["context"], 1)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.eval_k_mode = check_choice("eval_k_mode", c["eval_k_mode"], ("powers_of_two", "fixed"))
        self.seed = check_int("seed", c["seed"], 0)
        ek = c["eval_k"]
        if self.eval_k_mode == "fixed":
            if (
                isinstance(ek, (str, bytes))
                or not isinstance(ek, Sequence)
                or len(ek) == 0
                or not all(is_int(k) and 1 <= k <= self.K for k in ek)
            ):
                raise ConfigError(
                    "task.eval_k", ek, f"a non-empty list of integers in [1, K={self.K}] (eval_k_mode=fixed)"
                )
            self.eval_k = [int(k) for k in ek]
            self.eval_ks = tuple(sorted(set(self.eval_k)))
        else:
            if ek is not None:
                raise ConfigError("task.eval_k", ek, "null when eval_k_mode=powers_of_two (set eval_k_mode=fixed)")
            self.eval_k = None
            self.eval_ks = tuple(sorted({2**e for e in range(self.K.bit_length()) if 2**e <= self.K} | {self.K}))

        # names: length index li = l - min_len; cnt[li] = V**l names of length l; global code = off[li] + c
        self._cnt, self._name_off = name_space(self.V, self.min_len, self.max_len, self.N)
        self._nl = len(self._cnt)
        self._total_names = int(self._name_off[-1])
        if self.vocab == "official" and (2 * self.V >= _OFFICIAL["query_base"]):
            raise ConfigError("task.vocab_V", self.V, "< 4500 with vocab=official (node ids 1..2V below 9000)")
        if self.vocab == "official" and self.K >= _OFFICIAL["ans"] - _OFFICIAL["query_base"]:
            raise ConfigError("task.K", self.K, "< 500 with vocab=official (<query_k> = 9000+k below <ans> = 9500)")
        self.cfg = {**c, "eval_k": self.eval_k}

        # compact ids
        V, K = self.V, self.K
        self._c_bos, self._c_ans, self._c_q0 = 2 * V + 1, 2 * V + 2, 2 * V + 2
        self._c_eos = 2 * V + K + 3
        compact_size = 2 * V + K + 3 + int(self.eos)
        if self.vocab == "compact":
            self.vocab_size = compact_size
            self._lut = None
        else:
            self.vocab_size = _OFFICIAL["vocab_size"]
            lut = np.arange(compact_size, dtype=np.int64)
            lut[self._c_bos] = _OFFICIAL["bos"]
            lut[self._c_ans] = _OFFICIAL["ans"]
            lut[self._c_q0 + 1 : self._c_q0 + K + 1] = _OFFICIAL["query_base"] + np.arange(1, K + 1)
            if self.eos:
                lut[self._c_eos] = _OFFICIAL["eos"]
            self._lut = lut
        self.bos_id = self._map(self._c_bos)
        self.ans_id = self._map(self._c_ans)
        self.eos_id = self._map(self._c_eos) if self.eos else None
        self.num_groups = K + 1
        self.chance = 1.0 / self.N

        self._special_rows = 3 + K  # table rows after the names: bos, ans, eos, query_1..query_K
        self._vpow = self.V ** np.arange(self.max_len, dtype=np.int64)
        self._n_cdf = size_law_cdf(self.N)
        self._m_table, self._len_est = self._candidate_tables()
        self._ns_cache: dict[tuple[str, int], int] = {}
        self._tab_dtype = np.int16 if self._c_eos < 2**15 else np.int64  # small table: less memory traffic
        self._gtab = (
            self._build_table(np.arange(self._total_names, dtype=np.int64)) if self._total_names <= 2**18 else None
        )

    # ------------------------------------------------------------------ vocabulary
    def _map(self, compact_id: int) -> int:
        return int(compact_id if self._lut is None else self._lut[compact_id])

    def query_id(self, k: int) -> int:
        """Token id of ``<query_k>``, k in [1, K]; ValueError otherwise."""
        if not is_int(k) or not 1 <= k <= self.K:
            raise ValueError(f"k={k!r} is not allowed; allowed: an integer in [1, {self.K}]")
        return self._map(self._c_q0 + k)

    def token_names(self) -> list[str]:
        """Printable name of every id, index = id (length ``vocab_size``): ``<pad>``, ``p1..pV`` (non-final name
        tokens), ``e1..eV`` (final name tokens), ``<bos>``, ``<ans>``, ``<query_1>..<query_K>``, ``<eos>``;
        ids unused by ``vocab: official`` are ``<unused_id>``."""
        V = self.V
        compact = (
            ["<pad>"]
            + [f"p{v}" for v in range(1, V + 1)]
            + [f"e{v}" for v in range(1, V + 1)]
            + ["<bos>", "<ans>"]
            + [f"<query_{k}>" for k in range(1, self.K + 1)]
            + (["<eos>"] if self.eos else [])
        )
        if self._lut is None:
            return compact
        names = [f"<unused_{i}>" for i in range(self.vocab_size)]
        for cid, nm in enumerate(compact):
            names[int(self._lut[cid])] = nm
        return names

    def decode(self, ids: Any) -> str:
        """Human-readable text of a 1-D id sequence (list, numpy array or torch tensor).

        Name tokens are joined with ``.`` into names (a final token ``e*`` closes a name); names and special tokens
        are separated by spaces; unknown ids print as ``<unk_id>``. Example: ``<bos> p3.e7 e2 <query_2> e2 <ans> e5``.
        """
        V = self.V
        return decode_names(ids, self.token_names(), lambda t: 1 <= t <= 2 * V, lambda t: t > V)

    # ------------------------------------------------------------------ sizes
    def size_probs(self) -> np.ndarray:
        """float64 (N+1,): P(n) of training instances, index = n (0 for n < 3); P(n) ∝ 1/(n + sqrt N)
        (paper App. A.1)."""
        return size_law_probs(self._n_cdf)

    def _sum_longest(self, n: int) -> int:
        """Total length of the n longest distinct names."""
        left, tot = n, 0
        for li in range(self._nl - 1, -1, -1):
            take = min(left, int(self._cnt[li]))
            tot += take * (self.min_len + li)
            left -= take
        return tot

    def max_instance_len(self, split: str) -> int:
        """Longest possible instance of ``split`` in tokens (n = N in every split):
        ``1 + 2 * (sum of the N longest name lengths) + t * (2 + 2 * max_len) + eos``, t = min(n_queries, N)."""
        check_split(split)
        t = min(self.n_queries, self.N)
        return 1 + 2 * self._sum_longest(self.N) + t * (2 + 2 * self.max_len) + int(self.eos)

    def min_instance_len(self, split: str) -> int:
        """Shortest possible instance of ``split`` in tokens (n = 3 for train, N otherwise; shortest names)."""
        check_split(split)
        n = 3 if split == "train" else self.N
        t = min(self.n_queries, n)
        shortest, left = 0, n
        for li in range(self._nl):
            take = min(left, int(self._cnt[li]))
            shortest += take * (self.min_len + li)
            left -= take
        return 1 + 2 * shortest + t * (2 + 2 * self.min_len) + int(self.eos)

    def _candidate_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Per n: number of name draws that yields n distinct names with high probability (an efficiency guess
        only: results never depend on it), and the expected instance length (used to size packing rounds)."""
        cnt = self._cnt.astype(np.float64)
        logq = np.log1p(-1.0 / (self._nl * cnt))  # log P(a given name of length l is not hit by one draw)
        n = np.arange(self.N + 1, dtype=np.float64)
        m_max = max(64, 64 * self.N)
        grid = np.arange(1, m_max + 1, dtype=np.float64)
        hit = -np.expm1(grid[:, None] * logq[None, :]) * cnt[None, :]  # (m, nl) expected distinct per length
        distinct = hit.sum(1)
        target = np.minimum(n + 4.0 * np.sqrt(n) + 4.0, self._total_names - 0.5)
        m_table = np.minimum(np.searchsorted(distinct, target) + 1, m_max).astype(np.int64)
        m_mean = np.minimum(np.searchsorted(distinct, n), m_max - 1)
        lens = np.arange(self.min_len, self.max_len + 1, dtype=np.float64)
        lbar = (hit[m_mean] * lens).sum(1) / np.maximum(hit[m_mean].sum(1), 1e-12)
        t = np.minimum(n, self.n_queries)
        est = 1 + int(self.eos) + (2 * n + 2 * t) * lbar + 2 * t
        return m_table, est

    def estimate_lengths(self, split: str, w: np.ndarray, i: np.ndarray, seed: int | None = None) -> np.ndarray:
        """float64 (I,): expected length of instances (w, i) given their size n (cheap: one random word each).
        Used by packing to decide how many instances to generate; never affects the data."""
        return self._len_est[self._sizes(split, instance_keys(self._namespace(split, seed), w, i))]

    # ------------------------------------------------------------------ generation
    def _namespace(self, split: str, seed: int | None) -> int:
        def parts() -> tuple:
            gen = dict(
                N=self.N, K=self.K, V=self.V, min_len=self.min_len, max_len=self.max_len, n_queries=self.n_queries
            )
            if split != "train":  # eval-only parameters must not change the training stream
                gen.update(eval_k_mode=self.eval_k_mode, eval_k=self.eval_k)
            return "canonlm.data", "depo", self.name, gen

        return cached_namespace(self._ns_cache, split, seed, self.seed, parts)

    def _sizes(self, split: str, keys: np.ndarray) -> np.ndarray:
        return draw_sizes(split, keys, self.N, self._n_cdf, _P_N)

    def _draw_names(self, keys: np.ndarray, n: np.ndarray, noff: np.ndarray) -> np.ndarray:
        """First n distinct names of each instance's i.i.d. stream of name draws.

        Returns int64 (S,): name codes (``name_off[l - min_len] + index within length l``), grouped by instance in
        order of first occurrence."""
        S = int(noff[-1])
        out = np.empty(S, dtype=np.int64)
        idx = np.arange(keys.shape[0])
        m = self._m_table[n]
        total = np.int64(self._total_names)
        while idx.size:
            nn = n[idx]
            moff = excl_cumsum(m)
            inst = np.repeat(np.arange(idx.size), m)
            j = np.arange(int(moff[-1]), dtype=np.int64) - moff[inst]
            wd = words(keys[idx][inst], _P_NAME, j)
            li = below(wd, self._nl)
            c = below(wd // np.uint64(self._nl), self._cnt[li])
            gcode = self._name_off[li] + c
            code = inst * total + gcode
            order = np.argsort(code, kind="stable")
            sc = code[order]
            first = np.ones(sc.shape[0], dtype=bool)
            first[1:] = sc[1:] != sc[:-1]
            fpos = np.sort(order[first])  # candidate positions of first occurrences, grouped by instance
            finst = inst[fpos]
            ndist = np.bincount(finst, minlength=idx.size)
            rank = np.arange(fpos.shape[0]) - excl_cumsum(ndist)[finst]
            ok = ndist >= nn
            keep = (rank < nn[finst]) & ok[finst]
            dest = noff[idx[finst[keep]]] + rank[keep]
            out[dest] = gcode[fpos[keep]]
            idx, m = idx[~ok], m[~ok] * 2  # rare: draw a longer prefix of the same stream
        return out

    def _build_table(self, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token rows of names ``code`` (int64 (S,)) followed by the special rows <bos>, <ans>, <eos>,
        <query_1..K>: (tokens (S+3+K, max_len) int16/int64, compact ids, 0 beyond a name's length; lengths int64)."""
        S = code.shape[0]
        tok, L = name_token_rows(code, self._name_off, self.min_len, self.max_len, self.V, self._vpow)
        tab_tok = np.zeros((S + self._special_rows, self.max_len), dtype=self._tab_dtype)
        tab_tok[:S] = tok
        tab_tok[S:, 0] = [self._c_bos, self._c_ans, self._c_eos] + list(range(self._c_q0 + 1, self._c_q0 + self.K + 1))
        tab_len = np.ones(S + self._special_rows, dtype=np.int64)
        tab_len[:S] = L
        return tab_tok, tab_len

    def _token_table(self, code: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(token table, lengths, table row of each name in ``code``, row of <bos>). Uses the precomputed table of
        all names when it is small, else a per-call table of the names in use."""
        if self._gtab is not None:
            return self._gtab[0], self._gtab[1], code, self._total_names
        tab_tok, tab_len = self._build_table(code)
        return tab_tok, tab_len, np.arange(code.shape[0], dtype=np.int64), code.shape[0]

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Generate instances ``(w[r], i[r])`` of ``split`` (vectorised over all of them).

        Args: split: train | val | test. w, i: non-negative integer arrays of equal length I (window index,
            instance index within the window). seed: data seed (default: the config's ``seed``).
        Returns: :class:`InstanceBatch` (instances in request order; one answer per query, group = k); meta:
            ``n`` int64 (I,) nodes per instance, ``k`` int32 (Q,) depth per query.
        Raises ValueError for a bad split, negative or mismatched indices.
        """
        check_split(split)
        w, i = check_indices(w, i)
        if w.size >= 2**21:
            raise ValueError(f"at most 2**21 - 1 instances per call, got {w.size}")
        keys = instance_keys(self._namespace(split, seed), w, i)
        I = keys.shape[0]
        n = self._sizes(split, keys)
        t = np.minimum(n, self.n_queries)
        noff = excl_cumsum(n)
        toff = excl_cumsum(t)
        S, Q = int(noff[-1]), int(toff[-1])

        code = self._draw_names(keys, n, noff)
        inst_s = np.repeat(np.arange(I, dtype=np.int64), n)
        r = np.arange(S, dtype=np.int64) - noff[inst_s]

        # three independent uniform permutations per instance (cycle order, edge order, query choice): one sort
        # of (purpose, instance, random 40-bit key)
        p3 = np.arange(3, dtype=np.int64)[:, None]
        rnd = words(keys[inst_s][None, :], p3 + _P_CYCLE, r[None, :])  # (3, S)
        sk = (((p3 * I + inst_s[None, :]) << 40) | (rnd >> np.uint64(24)).astype(np.int64)).reshape(-1)
        perm = np.concatenate([r, r, r])[np.argsort(sk, kind="stable")]
        cyc, edge, qry = perm[:S], perm[S : 2 * S], perm[2 * S :]
        tab_tok, tab_len, name_row, R_BOS = self._token_table(code)
        cycle_name = name_row[noff[inst_s] + cyc]  # token-table row of the name at cycle position r
        nrep = n[inst_s]
        src = cycle_name[noff[inst_s] + edge]
        tgt = cycle_name[noff[inst_s] + (edge + 1) % nrep]

        inst_q = np.repeat(np.arange(I, dtype=np.int64), t)
        jq = np.arange(Q, dtype=np.int64) - toff[inst_q]
        p_q = qry[noff[inst_q] + jq]
        if split == "train":
            k = 1 + below(words(keys[inst_q], _P_K, jq), self.K)
        elif self.eval_k_mode == "powers_of_two":
            ks = np.asarray(self.eval_ks, dtype=np.int64)
            k = ks[below(words(keys[inst_q], _P_K, jq), ks.size)]
        else:
            ks = np.asarray(self.eval_k, dtype=np.int64)
            k = ks[below(words(keys, _P_K, 0), ks.size)][inst_q]
        q_name = cycle_name[noff[inst_q] + p_q]
        a_name = cycle_name[noff[inst_q] + (p_q + k) % n[inst_q]]

        # item sequence (names and specials), then tokens
        eos = int(self.eos)
        n_items = 1 + 2 * n + 4 * t + eos
        ioff = excl_cumsum(n_items)
        R_ANS, R_EOS, R_Q0 = R_BOS + 1, R_BOS + 2, R_BOS + 2
        items = np.empty(int(ioff[-1]), dtype=np.int64)
        items[ioff[:-1]] = R_BOS
        pe = ioff[inst_s] + 1 + 2 * r
        items[pe] = src
        items[pe + 1] = tgt
        pq = ioff[inst_q] + 1 + 2 * n[inst_q] + 4 * jq
        items[pq] = R_Q0 + k
        items[pq + 1] = q_name
        items[pq + 2] = R_ANS
        items[pq + 3] = a_name
        if eos:
            items[ioff[1:] - 1] = R_EOS

        ml = self.max_len
        ilen = tab_len[items]
        if ml == 1:
            tokens = tab_tok[items, 0]
        else:
            tokens = tab_tok[items][np.arange(ml)[None, :] < ilen[:, None]]
        tokens = (tokens if self._lut is None else self._lut[tokens]).astype(np.int64, copy=False)
        tcum = excl_cumsum(ilen)
        offsets = tcum[ioff]
        n_tok = int(tcum[-1])

        # loss targets: all tokens, or the (few) <ans> / answer / <eos> positions
        a_start, a_len = tcum[pq + 3], ilen[pq + 3]
        if self.loss_on == "all":
            loss = np.ones(n_tok, dtype=bool)
        else:
            loss = np.zeros(n_tok, dtype=bool)
            a_off = excl_cumsum(a_len)
            a_q = np.repeat(np.arange(Q, dtype=np.int64), a_len)
            loss[a_start[a_q] + np.arange(int(a_off[-1]), dtype=np.int64) - a_off[a_q]] = True
            loss[tcum[pq + 2]] = True
            if eos:
                loss[tcum[ioff[1:]] - 1] = True
        return InstanceBatch(
            tokens=tokens,
            loss_mask=loss,
            offsets=offsets,
            ans_inst=inst_q,
            ans_start=a_start - offsets[inst_q],
            ans_len=a_len,
            ans_group=k.astype(np.int32),
            ans_offsets=toff,
            meta={"n": n, "k": k.astype(np.int32)},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One instance. ``index`` = (w, i) (window w, i-th instance of it; packing's key) or an int i, meaning
        (i, 0). Returns :class:`Instance` with meta ``n`` (int) and ``k`` (int32 (t,)). ValueError on bad input."""
        w, i = parse_index(index)
        b = self.generate(split, [w], [i], seed)
        aid, grp = b.token_answers()
        return Instance(
            tokens=b.tokens,
            loss_mask=b.loss_mask,
            answer_id=aid,
            group=grp,
            meta={"n": int(b.meta["n"][0]), "k": b.meta["k"]},
        )

    def __repr__(self) -> str:
        return (
            f"DepoTask({self.name}: N={self.N}, K={self.K}, V={self.V}, len={self.min_len}..{self.max_len}, "
            f"vocab_size={self.vocab_size})"
        )
