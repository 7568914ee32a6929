"""Brevo1 / Brevo2: list every vertex a query vertex depends on, in topological order (paper
App. A.2).

One instance (paper App. A.2):

    <bos> x1 y1 x2 y2 ... xm ym <query> q <ans> a1 ... ap [q] <eos>

* n in {3..N}, P(n) ∝ 1/(n + sqrt N) (train); n = N (val/test).
* n distinct vertex names. Brevo1: one token each, drawn without replacement from 1..N. Brevo2 (as Depo, paper
  App. A.1): a name has length l uniform in [min_len, max_len], its first l-1 tokens uniform in 1..V and its last token
  uniform in V+1..2V; the names are the first n distinct ones of an i.i.d. stream of draws, then put in a uniformly
  random construction order (so the order never depends on how likely a name was to be drawn early).
* DAG over the construction order 0..n-1: Lf uniform in {1, ..., R((n-1)/4) + 1} with R = ceil (``leaf_rounding:
  ceil``, paper) or floor (``floor``, release); vertices 0..Lf-1 are leaves. Each later vertex v picks m uniform in
  {1, ..., min(D, c)} distinct parents, uniformly among the c earlier vertices whose out-degree is still < D
  (D = ``max_degree``, 4 in the paper). c >= 1 always holds (the in-degrees of vertices Lf..v-1 sum to at most
  D (v - Lf) < D v), so every non-leaf vertex has a parent and no vertex is isolated except childless leaves (which
  then never appear in the tokens). Edge parent -> child means "child depends on parent".
* Query q: uniform in {floor(3n/4), ..., n-1} (``query_pool: last_quarter``, paper) or q = n-1 (``last``, what the
  release does). floor(3n/4) >= Lf for every n >= 3, so q is never a leaf and has at least one ancestor.
* Answer: the ancestors of q (transitive parents) in a randomised Kahn order (each step emits a uniformly chosen
  vertex among those whose parents have all been emitted), leaves first; ``answer_includes_query: true`` (release)
  appends q itself, which every topological order puts last. The answer randomness does not depend on the switch:
  the two settings give the same instance up to the appended q.
* The m edges (parent, child) are listed in a uniformly random order.
* Loss targets (``loss_on: answers``, paper = release): ``<ans>``, the answer tokens and ``<eos>``; ``all``: every
  token. Teacher-forced answer scoring is meaningless (the order is not unique), so instances carry no scored
  answers: the metric is generative (:meth:`BrevoTask.evaluate`).
* Per-instance metadata: ``n``, ``depth`` (the minimum number of edges from a leaf to q inside q's ancestor sub-DAG,
  paper Fig. 9; metric group = min(depth, DEPTH_CAP)), ``n_leaves`` (Lf), ``query`` (q's construction
  index), ``n_edges`` (m), ``n_answer`` (answer vertices, q included when appended), ``prompt_len`` (tokens up to
  and including ``<ans>``).

Vocabulary (``vocab: compact``): 0 = pad; names (Brevo1: 1..N; Brevo2: 1..V non-final and V+1..2V
final name tokens); then ``<bos>``, ``<query>``, ``<ans>``, ``<eos>`` (``vocab_size = N + 5`` / ``2V + 5``).
``vocab: official`` keeps the name ids and uses the release's ``<bos>`` = 9999, ``<query>`` = 9997 and
``<ans>`` = ``<eos>`` = 9998 (the release's collision); ``vocab_size = 10000``. The instances
are identical up to the id map; the validator only looks for ``<eos>`` after the prompt, so the collision is
harmless there.

All per-instance work (names, DAG, query, ancestors, Kahn order, depth, token layout) runs in one numba kernel
(``@njit(cache=True)``) drawing its words with :mod:`canonlm.data.seeding_numba` (bit-identical to
:func:`canonlm.data.seeding.words`), so instance (w, i) of a split is a pure function of (seed, task name,
generative parameters, split, w, i), whatever else is generated in the same call. Random-word purposes: 0 size,
1 names, 2 construction order, 3 Lf, 4 parents, 5 query, 6 Kahn order, 7 edge order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from canonlm.data import ConfigError
from canonlm.data.seeding import instance_keys, mix64, stable_hash64, words
from canonlm.data.seeding_numba import word, word_below
from canonlm.data.tasks import Instance, InstanceBatch, Prompts, check_split
from canonlm.data.tasks._common import (
    cached_namespace,
    check_bool,
    check_choice,
    check_indices,
    check_int,
    decode_names,
    draw_sizes,
    is_int,
    merge_config,
    name_space,
    name_token_rows,
    parse_index,
    size_law_cdf,
    size_law_probs,
)

_COMMON = dict(
    max_degree=4,
    leaf_rounding="ceil",
    query_pool="last_quarter",
    answer_includes_query=False,
    loss_on="answers",
    vocab="compact",
    tail="drop",
    seed=0,
    eval_num_samples=1000,
    max_instance_tokens="auto",
)
DEFAULTS: dict[str, dict[str, Any]] = {
    # paper App. A.2: Brevo1 N in {70, 90, 110}, one-token names, context 1024.
    "brevo1": dict(name="brevo1", N=70, vocab_V=None, min_len=1, max_len=1, context=1024, **_COMMON),
    # Brevo2 N in {30, 40, 50}, names of 2-4 tokens over V = 4 (+4 final tokens), context 1536.
    "brevo2": dict(name="brevo2", N=30, vocab_V=4, min_len=2, max_len=4, context=1536, **_COMMON),
}
KEYS = tuple(DEFAULTS["brevo1"])
_CAP_MAX_REJECT = 1e-3  # share of eval instances the length cap may redraw (measured: 0 at the paper's windows)

DEPTH_CAP = 8  # metric group = min(depth, DEPTH_CAP): depths >= 8 share the last group (measured max 7 at N=110)
_MAX_NAMES = 2**20  # bound on the Brevo2 name space (the kernel keeps a "seen" flag per possible name)
_OFFICIAL = dict(bos=9999, query=9997, ans=9998, eos=9998, vocab_size=10000)
_P_N, _P_NAME, _P_ORDER, _P_LF, _P_DAG, _P_QUERY, _P_TOPO, _P_EDGE = range(8)
_P_EVAL = 8  # prompt keys of generative evaluation (unused by greedy decoding)
_META = ("n", "depth", "n_leaves", "query", "n_edges", "n_answer", "prompt_len")


# ---------------------------------------------------------------------------------------------- numba kernel
@njit(cache=True)
def _write_name(tokens, pos, tab_tok, tab_len, c):
    for t in range(tab_len[c]):
        tokens[pos + t] = tab_tok[c, t]
    return pos + tab_len[c]


@njit(cache=True)
def _brevo_kernel(
    keys,
    n_arr,
    multi,
    N,
    D,
    ceil_leaf,
    q_last,
    incl,
    loss_all,
    tab_tok,
    tab_len,
    n_len,
    name_off,
    id_bos,
    id_query,
    id_ans,
    id_eos,
    len_bound,
    cap0,
):
    """Generate instances (keys[r], n_arr[r]); see the module docstring for the process.

    multi: 0 = Brevo1 names (partial Fisher-Yates over the N one-token names), 1 = Brevo2 names (first n distinct
    of an i.i.d. stream, then shuffled). tab_tok (total_names, max_len) / tab_len (total_names,): tokens of each
    name code; n_len (nl,) / name_off (nl+1,): names per length index and code offsets. len_bound (N+1,): upper
    bound on an instance's length given n (buffer sizing). Returns tokens int64 (S,), loss bool (S,), offsets int64
    (I+1,), meta int64 (I, 7) in the order of ``_META``.
    """
    I = keys.shape[0]
    total = tab_len.shape[0]
    nl = n_len.shape[0]
    offsets = np.zeros(I + 1, dtype=np.int64)
    meta = np.zeros((I, 7), dtype=np.int64)
    cap = max(cap0, 16)
    tokens = np.empty(cap, dtype=np.int64)
    loss = np.empty(cap, dtype=np.bool_)
    pool = np.arange(N)
    seen = np.zeros(total if multi else 1, dtype=np.bool_)
    code = np.empty(N, dtype=np.int64)
    par = np.empty((N, D), dtype=np.int64)
    npar = np.zeros(N, dtype=np.int64)
    chi = np.empty((N, D), dtype=np.int64)
    nchi = np.zeros(N, dtype=np.int64)
    cand = np.empty(N, dtype=np.int64)
    ep = np.empty(N * D + 1, dtype=np.int64)
    ec = np.empty(N * D + 1, dtype=np.int64)
    mark = np.zeros(N, dtype=np.bool_)
    depth = np.zeros(N, dtype=np.int64)
    indeg = np.zeros(N, dtype=np.int64)
    ready = np.empty(N, dtype=np.int64)
    order = np.empty(N, dtype=np.int64)
    unl = np.uint64(nl)
    pos = 0
    for r in range(I):
        key = keys[r]
        n = n_arr[r]
        # ---- names, in construction order
        if multi == 0:
            for v in range(N):
                pool[v] = v
            for v in range(n):
                s = v + word_below(key, 1, v, N - v)
                tmp = pool[v]
                pool[v] = pool[s]
                pool[s] = tmp
                code[v] = pool[v]
        else:
            got = 0
            j = 0
            while got < n:
                w = word(key, 1, j)
                j += 1
                li = np.int64(w % unl)
                g = name_off[li] + np.int64((w // unl) % np.uint64(n_len[li]))
                if not seen[g]:
                    seen[g] = True
                    code[got] = g
                    got += 1
            for v in range(n):
                seen[code[v]] = False
            for v in range(n - 1, 0, -1):
                s = word_below(key, 2, v, v + 1)
                tmp = code[v]
                code[v] = code[s]
                code[s] = tmp
        # ---- DAG
        lf_max = ((n + 2) // 4 if ceil_leaf else (n - 1) // 4) + 1
        lf = 1 + word_below(key, 3, 0, lf_max)
        for v in range(n):
            npar[v] = 0
            nchi[v] = 0
        nc = 0
        for v in range(lf):
            cand[nc] = v
            nc += 1
        E = 0
        jd = 0
        for v in range(lf, n):
            mm = D if nc > D else nc
            m = 1 + word_below(key, 4, jd, mm)
            jd += 1
            for t in range(m):
                s = t + word_below(key, 4, jd, nc - t)
                jd += 1
                p = cand[s]
                cand[s] = cand[t]
                cand[t] = p
                par[v, t] = p
                chi[p, nchi[p]] = v
                nchi[p] += 1
                ep[E] = p
                ec[E] = v
                E += 1
            npar[v] = m
            for t in range(m - 1, -1, -1):  # drop parents that became full (swap-remove)
                if nchi[cand[t]] >= D:
                    nc -= 1
                    cand[t] = cand[nc]
            cand[nc] = v
            nc += 1
        # ---- query, ancestors, depth
        if q_last:
            q = n - 1
        else:
            s0 = (3 * n) // 4
            q = s0 + word_below(key, 5, 0, n - s0)
        for v in range(n):
            mark[v] = False
        mark[q] = True
        for v in range(q - 1, -1, -1):
            for t in range(nchi[v]):
                if mark[chi[v, t]]:
                    mark[v] = True
                    break
        mark[q] = False
        for v in range(q + 1):
            if npar[v] == 0:
                depth[v] = 0
            else:
                d = depth[par[v, 0]]
                for t in range(1, npar[v]):
                    if depth[par[v, t]] < d:
                        d = depth[par[v, t]]
                depth[v] = d + 1
        # ---- randomised Kahn order of the ancestors
        nr = 0
        for v in range(q):
            if mark[v]:
                indeg[v] = npar[v]
                if npar[v] == 0:
                    ready[nr] = v
                    nr += 1
        na = 0
        jt = 0
        while nr > 0:
            s = word_below(key, 6, jt, nr)
            jt += 1
            v = ready[s]
            nr -= 1
            ready[s] = ready[nr]
            order[na] = v
            na += 1
            for t in range(nchi[v]):
                c = chi[v, t]
                if mark[c]:
                    indeg[c] -= 1
                    if indeg[c] == 0:
                        ready[nr] = c
                        nr += 1
        # ---- edge order
        for e in range(E - 1, 0, -1):
            s = word_below(key, 7, e, e + 1)
            tmp = ep[e]
            ep[e] = ep[s]
            ep[s] = tmp
            tmp = ec[e]
            ec[e] = ec[s]
            ec[s] = tmp
        # ---- tokens
        need = len_bound[n]
        if pos + need > cap:
            cap = max(2 * cap, pos + need)
            t2 = np.empty(cap, dtype=np.int64)
            t2[:pos] = tokens[:pos]
            tokens = t2
            l2 = np.empty(cap, dtype=np.bool_)
            l2[:pos] = loss[:pos]
            loss = l2
        start = pos
        tokens[pos] = id_bos
        pos += 1
        for e in range(E):
            pos = _write_name(tokens, pos, tab_tok, tab_len, code[ep[e]])
            pos = _write_name(tokens, pos, tab_tok, tab_len, code[ec[e]])
        tokens[pos] = id_query
        pos = _write_name(tokens, pos + 1, tab_tok, tab_len, code[q])
        tokens[pos] = id_ans
        ans_pos = pos
        pos += 1
        for a in range(na):
            pos = _write_name(tokens, pos, tab_tok, tab_len, code[order[a]])
        if incl:
            pos = _write_name(tokens, pos, tab_tok, tab_len, code[q])
        tokens[pos] = id_eos
        pos += 1
        for t in range(start, pos):
            loss[t] = loss_all or t >= ans_pos
        offsets[r + 1] = pos
        meta[r, 0] = n
        meta[r, 1] = depth[q]
        meta[r, 2] = lf
        meta[r, 3] = q
        meta[r, 4] = E
        meta[r, 5] = na + (1 if incl else 0)
        meta[r, 6] = ans_pos + 1 - start
    return tokens[:pos].copy(), loss[:pos].copy(), offsets, meta


# ---------------------------------------------------------------------------------------------- task
class BrevoTask:
    """Brevo task (paper App. A.2). Build with :func:`canonlm.data.tasks.build_task`.

    Attributes:
        name: ``"brevo1"`` | ``"brevo2"``. cfg: the validated config (dict with every key of ``KEYS``).
        N, V (None for Brevo1), min_len, max_len, max_degree, leaf_rounding, query_pool, answer_includes_query,
            loss_on, vocab, context, tail, seed, eval_num_samples: config values.
        vocab_size: int, pad id 0 included. pad_id: 0. bos_id, query_id, ans_id, eos_id: special ids (official
            vocabulary: ans_id == eos_id == 9998).
        eval_mode: ``"generate"``. num_groups: min(N - 1, DEPTH_CAP) + 1 (metric group = q's depth, capped; depth
            >= 1 always, so group 0 stays empty; N - 1 is the largest possible depth). group_name: ``"depth"``.
            group_labels: printable group names (the capped group reads ``"8+"``). chance: 0.0.
    Raises ConfigError (naming ``task.<key>``) for unknown keys, wrong types, N < 3, max_degree < 1, Brevo1 with
    vocab_V not null or name lengths other than 1, Brevo2 with vocab_V < 1, min_len > max_len, fewer distinct names
    than N or more than 2**20, unknown leaf_rounding / query_pool / loss_on / vocab / tail, a non-boolean
    answer_includes_query, eval_num_samples < 1, and name ids reaching the official specials (>= 9997).
    """

    group_name = "depth"
    pad_id = 0
    eval_mode = "generate"
    chance = 0.0

    def __init__(self, name: str, cfg: Mapping[str, Any]):
        c = merge_config(name, cfg, DEFAULTS, KEYS)
        self.name = name
        self.multi = name == "brevo2"
        self.N = check_int("N", c["N"], 3)
        if self.multi:
            self.V = check_int("vocab_V", c["vocab_V"], 1)
            self.min_len = check_int("min_len", c["min_len"], 1)
            self.max_len = check_int("max_len", c["max_len"], 1)
            if self.min_len > self.max_len:
                raise ConfigError("task.min_len", self.min_len, f"an integer <= task.max_len={self.max_len}")
            if self.max_len > 40 or sum(self.V**ln for ln in range(self.min_len, self.max_len + 1)) > _MAX_NAMES:
                raise ConfigError(
                    "task.max_len", self.max_len, f"a length with at most 2**20 possible names (vocab_V={self.V})"
                )
        else:
            if c["vocab_V"] is not None:
                raise ConfigError("task.vocab_V", c["vocab_V"], "null for brevo1 (its names are the ids 1..N)")
            for key in ("min_len", "max_len"):
                if not is_int(c[key]) or c[key] != 1:
                    raise ConfigError(f"task.{key}", c[key], "1 for brevo1 (one-token names)")
            self.V, self.min_len, self.max_len = None, 1, 1
        self.max_degree = check_int("max_degree", c["max_degree"], 1)
        self.leaf_rounding = check_choice("leaf_rounding", c["leaf_rounding"], ("ceil", "floor"))
        self.query_pool = check_choice("query_pool", c["query_pool"], ("last_quarter", "last"))
        self.answer_includes_query = check_bool("answer_includes_query", c["answer_includes_query"], "false | true")
        self.loss_on = check_choice("loss_on", c["loss_on"], ("answers", "all"))
        self.vocab = check_choice("vocab", c["vocab"], ("compact", "official"))
        self.context = check_int("context", c["context"], 1)
        self.tail = check_choice("tail", c["tail"], ("drop", "carry"))
        self.seed = check_int("seed", c["seed"], 0)
        self.eval_num_samples = check_int("eval_num_samples", c["eval_num_samples"], 1)
        cap = c["max_instance_tokens"]
        if cap == "auto":
            cap = self.context
        elif cap is not None and (not is_int(cap) or cap < 1):
            raise ConfigError("task.max_instance_tokens", cap, "auto (= context) | null (no cap) | an integer >= 1")
        self.length_cap = None if cap is None else int(cap)

        # names: code -> tokens. Brevo1: code c is the token c + 1. Brevo2: codes grouped by length (as Depo).
        if self.multi:
            self._n_len, self._name_off = name_space(self.V, self.min_len, self.max_len, self.N)
            self._total_names = int(self._name_off[-1])
            self._n_name_ids = 2 * self.V
        else:
            self._n_len = np.array([self.N], dtype=np.int64)
            self._name_off = np.array([0, self.N], dtype=np.int64)
            self._total_names = self.N
            self._n_name_ids = self.N
        if self.vocab == "official" and self._n_name_ids >= _OFFICIAL["query"]:
            raise ConfigError(
                "task.N" if not self.multi else "task.vocab_V",
                self.N if not self.multi else self.V,
                "name ids below 9997 with vocab=official (N <= 9996 / 2 * vocab_V <= 9996)",
            )
        self.cfg = dict(c)

        k = self._n_name_ids
        if self.vocab == "compact":
            self.bos_id, self.query_id, self.ans_id, self.eos_id = k + 1, k + 2, k + 3, k + 4
            self.vocab_size = k + 5
        else:
            self.bos_id, self.query_id = _OFFICIAL["bos"], _OFFICIAL["query"]
            self.ans_id, self.eos_id = _OFFICIAL["ans"], _OFFICIAL["eos"]
            self.vocab_size = _OFFICIAL["vocab_size"]
        self.num_groups = min(self.N - 1, DEPTH_CAP) + 1
        self.group_labels = {g: str(g) for g in range(self.num_groups)}
        if self.N - 1 > DEPTH_CAP:
            self.group_labels[DEPTH_CAP] = f"{DEPTH_CAP}+"

        self._n_cdf = size_law_cdf(self.N)
        self._tab_tok, self._tab_len = self._name_table()
        self._len_bound = np.array([self._length_bound(n) for n in range(self.N + 1)], dtype=np.int64)
        self._len_est: np.ndarray | None = None  # mean length per n, simulated on first use (estimate_lengths)
        self._ns_cache: dict[tuple[str, int], int] = {}
        self._check_cap(c["max_instance_tokens"])

    def _check_cap(self, setting: Any) -> None:
        """``max_instance_tokens: auto`` (cap = context) may only redraw a negligible share of eval instances (n = N):
        measured on 2000 simulated instances, at most ``_CAP_MAX_REJECT``, else ConfigError("task.context"). Any cap
        below the shortest n = N instance is a ConfigError (task.context for auto, else task.max_instance_tokens);
        an explicit integer cap above it is the user's choice."""
        cap = self.length_cap
        if cap is None or cap >= int(self._len_bound[self.N]):
            return
        key, val = ("task.context", self.context) if setting == "auto" else ("task.max_instance_tokens", setting)
        if cap < self.min_instance_len("val"):
            raise ConfigError(
                key, val, f"an integer >= {self.min_instance_len('val')} (the shortest instance at n = N = {self.N})"
            )
        if setting != "auto":  # an explicit cap is the user's choice (it must only admit some instance)
            return
        keys = instance_keys(stable_hash64("canonlm.data", "brevo", "cap-check"), np.arange(2000), 0)
        lengths = np.diff(self._run(keys, np.full(2000, self.N, dtype=np.int64))[2])
        frac = float((lengths > cap).mean())
        if frac > _CAP_MAX_REJECT:
            need = int(np.quantile(lengths, 1 - _CAP_MAX_REJECT / 2)) + 1
            raise ConfigError(
                key,
                val,
                f"a larger window: {frac:.1%} of the n = N instances are longer than {cap} "
                f"tokens and would be redrawn (at most {_CAP_MAX_REJECT:g} allowed; about "
                f">= {need} tokens needed, exact bound {int(self._len_bound[self.N])})",
            )

    # ------------------------------------------------------------------ vocabulary
    def _name_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of every name code: (int64 (total_names, max_len), 0 beyond the name's length; int64 lengths)."""
        if not self.multi:
            return np.arange(1, self.N + 1, dtype=np.int64)[:, None], np.ones(self.N, dtype=np.int64)
        tok, L = name_token_rows(
            np.arange(self._total_names, dtype=np.int64),
            self._name_off,
            self.min_len,
            self.max_len,
            self.V,
            self.V ** np.arange(self.max_len, dtype=np.int64),
        )
        return tok.astype(np.int64), L.astype(np.int64)

    def token_names(self) -> list[str]:
        """Printable name of every id, index = id (length ``vocab_size``): ``<pad>``, the name tokens (Brevo1
        ``v1..vN``; Brevo2 ``p1..pV`` non-final, ``e1..eV`` final), ``<bos>``, ``<query>``, ``<ans>``, ``<eos>``
        (official vocabulary: id 9998 is ``<ans|eos>``, unused ids ``<unused_id>``)."""
        if self.multi:
            names = [f"p{v}" for v in range(1, self.V + 1)] + [f"e{v}" for v in range(1, self.V + 1)]
        else:
            names = [f"v{v}" for v in range(1, self.N + 1)]
        if self.vocab == "compact":
            return ["<pad>"] + names + ["<bos>", "<query>", "<ans>", "<eos>"]
        out = [f"<unused_{i}>" for i in range(self.vocab_size)]
        out[0] = "<pad>"
        out[1 : 1 + len(names)] = names
        out[self.bos_id], out[self.query_id], out[self.ans_id] = "<bos>", "<query>", "<ans|eos>"
        return out

    def _is_name_token(self, t: int) -> bool:
        return 1 <= t <= self._n_name_ids

    def _is_final(self, t: int) -> bool:
        return (not self.multi and 1 <= t <= self.N) or (self.multi and self.V < t <= 2 * self.V)

    def decode(self, ids: Any) -> str:
        """Human-readable text of a 1-D id sequence (list, numpy array or torch tensor): tokens of a Brevo2 name are
        joined with ``.`` (a final token ``e*`` closes a name); names and specials are separated by spaces; unknown
        ids print as ``<unk_id>``. Example (Brevo2, V=4): ``<bos> p3.e1 p2.p2.e4 <query> p2.p2.e4 <ans> p3.e1 <eos>``.
        """
        return decode_names(ids, self.token_names(), self._is_name_token, self._is_final)

    # ------------------------------------------------------------------ sizes and lengths
    def size_probs(self) -> np.ndarray:
        """float64 (N+1,): P(n) of training instances, index = n (0 for n < 3); P(n) ∝ 1/(n + sqrt N)
        (paper App. A.2)."""
        return size_law_probs(self._n_cdf)

    def max_edges(self, n: int) -> int:
        """Largest possible number of edges of an n-vertex DAG: sum_{i=1}^{n-1} min(i, max_degree) (one leaf,
        vertex i choosing min(i, D) parents)."""
        return sum(min(i, self.max_degree) for i in range(1, n))

    def _length_bound(self, n: int) -> int:
        """Upper bound on the length of an instance with n vertices (0 for n < 3).

        Tokens = 4 specials + sum over vertices of len(name) * weight, weight = in-degree + out-degree + [answer
        vertex] + [query] (+1 for q when appended). The weights sum to at most W = 2 E_max + n + incl and each is at
        most 2D + 1 (+incl for q). The bound gives the largest weights to the longest of the n longest distinct
        names; it is attained whenever those names all have the same length (Brevo1; Brevo2 with N <=
        V**max_len), by the DAG where vertex i takes parents i-1..i-D (Lf = 1, q = n-1, all others ancestors)."""
        if n < 3:
            return 0
        incl = int(self.answer_includes_query)
        W = 2 * self.max_edges(n) + n + incl
        lens: list[int] = []
        left = n
        for li in range(len(self._n_len) - 1, -1, -1):
            take = min(left, int(self._n_len[li]))
            lens += [self.min_len + li] * take
            left -= take
        cap = 2 * self.max_degree + 1
        tot = 0
        for r, L in enumerate(lens):
            w = min(cap + (incl if r == 0 else 0), W)
            tot += w * L
            W -= w
        return 4 + tot

    def max_instance_len(self, split: str) -> int:
        """Longest possible instance of ``split`` in tokens (n = N in every split): ``4 + sum len(name) * weight``
        (see ``_length_bound``); Brevo1: ``2 E_max(N) + N + 4 (+1 with answer_includes_query)``, E_max(N) =
        4N - 10 for D = 4 (974 at N=110); Brevo2 with N <= 256: ``4 + 4 (2 E_max(N) + N (+1))`` (1724 at N=50, more
        than the paper's 1536 context although the measured maximum is 1,081: see the report)."""
        check_split(split)
        bound = int(self._len_bound[self.N])
        return bound if self.length_cap is None else min(bound, max(self.length_cap, self.min_instance_len(split)))

    def min_instance_len(self, split: str) -> int:
        """Shortest possible instance of ``split`` (n = 3 for train, N otherwise): at least n - Lf_max edges, one
        answer vertex, all names of min_len tokens: ``4 + min_len * (2 (n - Lf_max) + 2 + incl)``."""
        check_split(split)
        n = 3 if split == "train" else self.N
        lf_max = (-(-(n - 1) // 4) if self.leaf_rounding == "ceil" else (n - 1) // 4) + 1
        return 4 + self.min_len * (2 * (n - lf_max) + 2 + int(self.answer_includes_query))

    def estimate_lengths(self, split: str, w: np.ndarray, i: np.ndarray, seed: int | None = None) -> np.ndarray:
        """float64 (I,): expected length of instances (w, i) given their size n (one random word each; the mean
        length per n is simulated once, 64 instances per n). Used by packing; never affects the data.
        Raises ValueError for an unknown split."""
        check_split(split)
        if self._len_est is None:
            est = np.zeros(self.N + 1)
            n = np.repeat(np.arange(3, self.N + 1, dtype=np.int64), 64)
            keys = instance_keys(stable_hash64("canonlm.data", "brevo", "length-estimate"), np.arange(n.size), 0)
            b = self._run(keys, n)
            est[3:] = np.bincount(n - 3, weights=np.diff(b[2]).astype(np.float64)) / 64
            self._len_est = est
        keys = instance_keys(self._namespace(split, seed), np.asarray(w), np.asarray(i))
        return self._len_est[self._sizes(split, keys.reshape(-1))]

    # ------------------------------------------------------------------ generation
    def _namespace(self, split: str, seed: int | None) -> int:
        # loss_on, vocab, answer_includes_query only relabel / extend: same graphs
        return cached_namespace(
            self._ns_cache,
            split,
            seed,
            self.seed,
            lambda: (
                "canonlm.data",
                "brevo",
                self.name,
                dict(
                    N=self.N,
                    V=self.V,
                    min_len=self.min_len,
                    max_len=self.max_len,
                    max_degree=self.max_degree,
                    leaf_rounding=self.leaf_rounding,
                    query_pool=self.query_pool,
                ),
            ),
        )

    def _sizes(self, split: str, keys: np.ndarray) -> np.ndarray:
        return draw_sizes(split, keys, self.N, self._n_cdf, _P_N)

    def _run(self, keys: np.ndarray, n: np.ndarray):
        cap0 = int(self._len_bound[n].sum()) if n.size < 64 else int(n.size * (8 + 4 * self.max_len * n.mean())) + 64
        return _brevo_kernel(
            keys,
            n,
            int(self.multi),
            self.N,
            self.max_degree,
            self.leaf_rounding == "ceil",
            self.query_pool == "last",
            self.answer_includes_query,
            self.loss_on == "all",
            self._tab_tok,
            self._tab_len,
            self._n_len,
            self._name_off,
            self.bos_id,
            self.query_id,
            self.ans_id,
            self.eos_id,
            self._len_bound,
            cap0,
        )

    def generate(self, split: str, w: Any, i: Any, seed: int | None = None) -> InstanceBatch:
        """Generate instances ``(w[r], i[r])`` of ``split``.

        Args: split: train | val | test. w, i: non-negative integer arrays of equal length I (window index,
            instance index within the window). seed: data seed (default: the config's ``seed``).
        Returns: :class:`InstanceBatch` in request order with **no scored answers** (Q = 0: the answer order is not
            unique, so Brevo is scored generatively by :meth:`evaluate`); meta: int64 (I,) arrays ``n``, ``depth``,
            ``n_leaves``, ``query``, ``n_edges``, ``n_answer``, ``prompt_len`` (module docstring).
        Raises ValueError for a bad split, negative or mismatched indices.
        """
        check_split(split)
        w, i = check_indices(w, i)
        keys = instance_keys(self._namespace(split, seed), w, i)
        n = self._sizes(split, keys)
        tokens, loss, offsets, meta = self._run(keys, n)
        cap = self.length_cap
        if cap is not None and cap < int(self._len_bound[n].max(initial=0)):
            # Redraw the (practically never seen) instances longer than the cap with the same n and a derived key,
            # so every instance fits its window (the release's measured max is 1,081 < 1536 at Brevo2 N=50).
            attempt = 0
            while True:
                over = np.diff(offsets) > cap
                if not over.any():
                    break
                attempt += 1
                if attempt > 1000:
                    raise RuntimeError(f"brevo: max_instance_tokens={cap} rejects almost every instance; raise it")
                keys = keys.copy()
                keys[over] = mix64(keys[over] ^ np.uint64(0xA5A5A5A5A5A5A5A5 + attempt))
                tokens, loss, offsets, meta = self._run(keys, n)
        I = keys.shape[0]
        e64 = np.zeros(0, dtype=np.int64)
        return InstanceBatch(
            tokens=tokens,
            loss_mask=loss,
            offsets=offsets,
            ans_inst=e64,
            ans_start=e64.copy(),
            ans_len=e64.copy(),
            ans_group=np.zeros(0, dtype=np.int32),
            ans_offsets=np.zeros(I + 1, dtype=np.int64),
            meta={k: np.ascontiguousarray(meta[:, c]) for c, k in enumerate(_META)},
        )

    def instance(self, split: str, index: int | tuple[int, int], seed: int | None = None) -> Instance:
        """One instance. ``index`` = (w, i) (window w, i-th instance of it; packing's key) or an int i, meaning
        (i, 0). Returns :class:`Instance` (answer_id -1 and group 0 everywhere) with int meta ``n``, ``depth``,
        ``n_leaves``, ``query``, ``n_edges``, ``n_answer``, ``prompt_len``. ValueError on bad input."""
        w, i = parse_index(index)
        b = self.generate(split, [w], [i], seed)
        L = b.tokens.shape[0]
        return Instance(
            tokens=b.tokens,
            loss_mask=b.loss_mask,
            answer_id=np.full(L, -1, dtype=np.int32),
            group=np.zeros(L, dtype=np.int32),
            meta={k: int(v[0]) for k, v in b.meta.items()},
        )

    # ------------------------------------------------------------------ generative evaluation
    def eval_samples(self, split: str) -> int:
        """Default number of evaluation prompts (``eval_num_samples``, default 1000)."""
        check_split(split)
        return self.eval_num_samples

    @property
    def max_new_tokens(self) -> int:
        """Generation cap: (N + 2) * max_len + 1 (N + 2 names and ``<eos>``)."""
        return (self.N + 2) * self.max_len + 1

    def prompts(self, split: str, idx: Any, seed: int | None = None) -> Prompts:
        """Evaluation prompts: instance (idx[r], 0) of ``split`` cut after its ``<ans>`` (n = N outside train).

        Returns :class:`Prompts` (greedy: temperature 0, stop at ``<eos>``, max_new_tokens = (N + 2) * max_len + 1;
        keys are counter-based per prompt; group = min(depth, DEPTH_CAP)); meta: the instance meta arrays (int64
        (n,)) and ``full`` (list of the complete instances' token arrays, for inspection)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        b = self.generate(split, idx, np.zeros_like(idx), seed)
        full = [b.tokens[b.offsets[r] : b.offsets[r + 1]] for r in range(idx.size)]
        pl = b.meta["prompt_len"]
        keys = words(instance_keys(self._namespace(split, seed), idx, np.zeros_like(idx)), _P_EVAL, 0)
        return Prompts(
            prompts=[f[: pl[r]] for r, f in enumerate(full)],
            max_new_tokens=self.max_new_tokens,
            stop_ids=(self.eos_id,),
            temperature=0.0,
            keys=keys,
            group=np.minimum(b.meta["depth"], DEPTH_CAP).astype(np.int64),
            meta={**b.meta, "full": full},
        )

    def evaluate(self, lm: Any, split: str, idx: Any) -> dict[str, np.ndarray]:
        """Generative accuracy (paper App. A.2): greedy generation from each prompt of :meth:`prompts`, accepted by
        :meth:`check_answer`.

        Args: lm: :class:`canonlm.data.lm.LanguageModel`. split: val | test (train works too). idx: sample indices
            (int array (n,)); sample idx[r] is instance (idx[r], 0) of the split.
        Returns: ``correct`` bool (n,), ``group`` int64 (n,) = min(depth, DEPTH_CAP), ``set_correct`` float64 (n,)
            (1.0 when the emitted names form the right set, whatever their order or duplicates; diagnostic).
        """
        P = self.prompts(split, idx)
        gens = lm.generate(P.prompts, P.max_new_tokens, stop_ids=P.stop_ids, temperature=P.temperature, keys=P.keys)
        ok = np.zeros(len(gens), dtype=bool)
        set_ok = np.zeros(len(gens), dtype=np.float64)
        for r, g in enumerate(gens):
            good, reason = self.answer_verdict(P.prompts[r], g)
            ok[r] = good
            set_ok[r] = reason in ("ok", "order", "duplicate")
        return {"correct": ok, "group": P.group, "set_correct": set_ok}

    def explain_metrics(self, metrics: Mapping[str, float]) -> list[str]:
        """How to read :meth:`evaluate`'s diagnostic (printed under a run's closing table). Returns a list of str
        (empty without ``set_correct``)."""
        if "set_correct" not in metrics:
            return []
        return [
            "set_correct = the fraction of answers that name the right set of vertices, in any order (a "
            "diagnostic: the score is the valid topological order, paper App. A.2)"
        ]

    def _read_name(self, toks: Sequence[int], p: int) -> tuple[tuple[int, ...] | None, int]:
        """Read one name at p: (name tuple, next position), or (None, position of the offending token)."""
        if not self.multi:
            t = toks[p] if p < len(toks) else -1
            return ((t,), p + 1) if 1 <= t <= self.N else (None, p)
        s = p
        while p < len(toks) and 1 <= toks[p] <= self.V:
            p += 1
        if p >= len(toks) or not self.V < toks[p] <= 2 * self.V or not self.min_len <= p + 1 - s <= self.max_len:
            return None, p
        return tuple(toks[s : p + 1]), p + 1

    def parse_prompt(self, prompt: Any) -> tuple[dict, tuple[int, ...]]:
        """Graph of a prompt ``<bos> edges <query> q <ans>`` (further tokens are ignored).

        Args: prompt: token ids (array-like or :class:`Instance`). Returns (parents, q): ``parents`` maps every
        vertex name (tuple of token ids) appearing in an edge or as q to the set of its parents' names.
        Raises ValueError if the prompt is malformed."""
        toks = [int(x) for x in (prompt.tokens if isinstance(prompt, Instance) else np.asarray(prompt).reshape(-1))]
        if not toks or toks[0] != self.bos_id:
            raise ValueError("prompt must start with <bos>")
        parents: dict[tuple[int, ...], set] = {}
        p, names = 1, []
        while p < len(toks) and toks[p] != self.query_id:
            nm, p = self._read_name(toks, p)
            if nm is None:
                raise ValueError(f"malformed name in the prompt at position {p}")
            names.append(nm)
        if p >= len(toks) or len(names) % 2:
            raise ValueError("prompt edges must be complete (parent, child) pairs followed by <query>")
        for a, b in zip(names[0::2], names[1::2]):
            parents.setdefault(a, set())
            parents.setdefault(b, set()).add(a)
        q, p = self._read_name(toks, p + 1)
        if q is None or p >= len(toks) or toks[p] != self.ans_id:
            raise ValueError("prompt must end with <query> q <ans>")
        parents.setdefault(q, set())
        return parents, q

    def answer_verdict(self, prompt: Any, generated: Any) -> tuple[bool, str]:
        """Validate a generated answer against the prompt's graph (paper App. A.2).

        Args: prompt: the prompt (or the whole instance) token ids; generated: the generated ids (after ``<ans>``).
        Returns (accepted, reason): reason is ``"ok"`` or the first failure among ``"no_eos"`` (the generation does
        not end with ``<eos>``), ``"invalid"`` (a token that is not a well-formed name, including a second
        ``<eos>``/``<ans>``), ``"missing"``, ``"extra"`` (a name that is not a required vertex, e.g. q when
        ``answer_includes_query`` is false), ``"duplicate"``, ``"order"`` (a vertex before one of its parents).
        Accepted iff the emitted names are exactly the ancestors of q (plus q with ``answer_includes_query``), each
        once, every vertex after all of its parents, followed by ``<eos>``.
        Raises ValueError for a malformed prompt."""
        parents, q = self.parse_prompt(prompt)
        gen = [int(x) for x in np.asarray(generated).reshape(-1)]
        if not gen or gen[-1] != self.eos_id:
            return False, "no_eos"
        body = gen[:-1]
        emitted, p = [], 0
        while p < len(body):
            nm, p = self._read_name(body, p)
            if nm is None:
                return False, "invalid"
            emitted.append(nm)
        want, stack = set(), [q]
        while stack:  # ancestors of q
            for a in parents.get(stack.pop(), ()):
                if a not in want:
                    want.add(a)
                    stack.append(a)
        if self.answer_includes_query:
            want.add(q)
        got = set(emitted)
        if want - got:
            return False, "missing"
        if got - want:
            return False, "extra"
        if len(got) != len(emitted):
            return False, "duplicate"
        at = {v: r for r, v in enumerate(emitted)}
        if any(at[a] > at[v] for v in emitted for a in parents[v]):
            return False, "order"
        return True, "ok"

    def check_answer(self, prompt: Any, generated: Any) -> bool:
        """True iff :meth:`answer_verdict` accepts ``generated`` for ``prompt`` (see there)."""
        return self.answer_verdict(prompt, generated)[0]

    def __repr__(self) -> str:
        names = f"V={self.V}, len={self.min_len}..{self.max_len}" if self.multi else "one-token names"
        return f"BrevoTask({self.name}: N={self.N}, {names}, D={self.max_degree}, vocab_size={self.vocab_size})"
