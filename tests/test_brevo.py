"""Brevo generator and evaluator (paper App. A.2): instances are parsed back from their tokens alone and re-derived
with naive loops (DAG rules, ancestor set by DFS, topological order, depth by BFS); distributions are compared with
the paper's formulas and with a plain-Python simulator of the generative process; the validator and evaluate() are
checked with oracle / uniform / garbage models; every config error is checked."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import deque

import numpy as np
import pytest
import torch

from canonlm.data import ConfigError
from canonlm.data.lm import LanguageModel
from canonlm.data.tasks import build_task

CAP = 8  # depth cap of the metric groups (documented in brevo.py)


# ---------------------------------------------------------------------------------------------- oracle parser
def ids_of(task):
    """Special ids re-derived from the documented layout (the module docstring), not from the code."""
    if task.vocab == "official":
        return dict(bos=9999, query=9997, ans=9998, eos=9998)
    k = task.N if task.name == "brevo1" else 2 * task.V
    return dict(bos=k + 1, query=k + 2, ans=k + 3, eos=k + 4)


def read_name(toks, p, task):
    """One vertex name at p -> (name tuple, next p). Brevo1: one token in 1..N; Brevo2: tokens in 1..V closed by
    one final token in V+1..2V, length in [min_len, max_len]."""
    if task.name == "brevo1":
        assert 1 <= toks[p] <= task.N, (p, toks[p])
        return (toks[p],), p + 1
    V, s = task.V, p
    while 1 <= toks[p] <= V:
        p += 1
    assert V < toks[p] <= 2 * V, f"name at {s} not closed by a final token"
    assert task.min_len <= p + 1 - s <= task.max_len
    return tuple(toks[s : p + 1]), p + 1


def ancestors(parents, q):
    """Naive DFS over parent sets."""
    seen, stack = set(), [q]
    while stack:
        for a in parents.get(stack.pop(), ()):
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def bfs_depth(parents, q):
    """Minimum number of edges from q back to a vertex without parents (BFS over parents)."""
    dist, dq = {q: 0}, deque([q])
    while dq:
        v = dq.popleft()
        if not parents.get(v):
            return dist[v]
        for a in parents[v]:
            if a not in dist:
                dist[a] = dist[v] + 1
                dq.append(a)
    raise AssertionError("no leaf reached")


def parse(task, tokens):
    """Parse an instance from its tokens: edges, q, answer; returns a dict (no checks beyond the syntax)."""
    ids = ids_of(task)
    toks = [int(x) for x in tokens]
    assert toks[0] == ids["bos"]
    p, names = 1, []
    while toks[p] != ids["query"]:
        nm, p = read_name(toks, p, task)
        names.append(nm)
    assert len(names) % 2 == 0
    edges = list(zip(names[0::2], names[1::2]))
    q, p = read_name(toks, p + 1, task)
    assert toks[p] == ids["ans"]
    ans_pos = p
    p += 1
    answer = []
    while toks[p] != ids["eos"]:
        nm, p = read_name(toks, p, task)
        answer.append(nm)
    assert p == len(toks) - 1, "tokens after <eos>"
    parents, children = {}, {}
    for a, b in edges:
        parents.setdefault(a, set())
        parents.setdefault(b, set()).add(a)
        children.setdefault(a, set()).add(b)
    parents.setdefault(q, set())
    return dict(toks=toks, edges=edges, q=q, answer=answer, ans_pos=ans_pos, parents=parents, children=children)


def is_acyclic(parents):
    indeg = {v: len(ps) for v, ps in parents.items()}
    kids = {}
    for v, ps in parents.items():
        for a in ps:
            kids.setdefault(a, []).append(v)
    ready = [v for v, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        v = ready.pop()
        seen += 1
        for c in kids.get(v, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    return seen == len(parents)


def parse_and_check(task, inst, split):
    """Every structural rule of paper App. A.2 that is visible in the tokens, plus the meta and the loss mask."""
    r = parse(task, inst.tokens)
    D = task.max_degree
    edges, parents, children, q, answer = r["edges"], r["parents"], r["children"], r["q"], r["answer"]
    assert len(set(edges)) == len(edges), "duplicate edge"
    assert all(a != b for a, b in edges), "self-loop"
    assert all(len(ps) <= D for ps in parents.values()), "in-degree > max_degree"
    assert all(len(cs) <= D for cs in children.values()), "out-degree > max_degree"
    assert is_acyclic(parents)
    n = inst.meta["n"]
    assert 3 <= n <= task.N and (split == "train" or n == task.N)
    assert len(parents) <= n  # childless leaves are invisible
    # every non-leaf has a parent: the vertices with parents are exactly the n - Lf non-leaves
    assert sum(1 for ps in parents.values() if ps) == n - inst.meta["n_leaves"]
    assert parents[q], "q must have a parent"
    anc = ancestors(parents, q)
    want = anc | {q} if task.answer_includes_query else anc
    assert len(set(answer)) == len(answer), "duplicate answer vertex"
    assert set(answer) == want
    pos = {v: i for i, v in enumerate(answer)}
    assert all(pos[a] < pos[v] for v in answer for a in parents[v]), "not a topological order"
    if task.answer_includes_query:
        assert answer[-1] == q
    assert answer[0] in anc and not parents[answer[0]], "the first answer vertex must be a leaf"
    assert inst.meta["depth"] == bfs_depth(parents, q)
    assert inst.meta["n_edges"] == len(edges) and inst.meta["n_answer"] == len(answer)
    assert inst.meta["prompt_len"] == r["ans_pos"] + 1
    L = len(r["toks"])
    expect_loss = np.ones(L, bool) if task.loss_on == "all" else np.arange(L) >= r["ans_pos"]
    np.testing.assert_array_equal(inst.loss_mask, expect_loss)
    assert (inst.answer_id == -1).all() and (inst.group == 0).all()
    assert task.min_instance_len(split) <= L <= task.max_instance_len(split)
    assert 0 not in r["toks"]
    return r


CONFIGS = [
    ("brevo1", dict(N=12, context=256)),
    ("brevo1", dict(N=40, leaf_rounding="floor", query_pool="last", answer_includes_query=True, vocab="official")),
    ("brevo1", dict(N=30, max_degree=2, loss_on="all")),
    ("brevo2", dict(N=8, context=256)),
    ("brevo2", dict(N=20, vocab_V=3, min_len=2, max_len=3, answer_includes_query=True)),
    ("brevo2", dict(N=16, vocab="official", loss_on="all", query_pool="last")),
    ("brevo2", dict(N=6, vocab_V=2, min_len=1, max_len=2)),  # exactly 6 names: all of them used
]


@pytest.mark.parametrize("name,cfg", CONFIGS)
@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_instances_parse_and_answers_rederived(name, cfg, split):
    task = build_task(name, cfg)
    for w in range(10):
        for i in (0, 5):
            parse_and_check(task, task.instance(split, (w, i)), split)


def test_generate_matches_single_instances_and_has_no_scored_answers():
    task = build_task("brevo2", dict(N=10))
    w = np.array([5, 0, 5, 9, 2**40])
    i = np.array([1, 0, 0, 7, 3])
    b = task.generate("train", w, i)
    assert b.ans_inst.size == 0 and b.ans_len.size == 0 and (b.ans_offsets == 0).all() and len(b) == 5
    aid, grp = b.token_answers()
    assert (aid == -1).all() and (grp == 0).all()
    assert b.tokens.dtype == np.int64 and b.loss_mask.dtype == bool
    for r in range(len(w)):
        one = task.instance("train", (int(w[r]), int(i[r])))
        s, e = b.offsets[r], b.offsets[r + 1]
        np.testing.assert_array_equal(b.tokens[s:e], one.tokens)
        np.testing.assert_array_equal(b.loss_mask[s:e], one.loss_mask)
        assert {k: int(v[r]) for k, v in b.meta.items()} == one.meta


# ---------------------------------------------------------------------------------------------- vocabularies
def test_compact_and_official_vocab_ids():
    t1 = build_task("brevo1", dict(N=12))
    assert (t1.vocab_size, t1.bos_id, t1.query_id, t1.ans_id, t1.eos_id) == (17, 13, 14, 15, 16)
    t2 = build_task("brevo2", dict(N=8))
    assert (t2.vocab_size, t2.bos_id, t2.query_id, t2.ans_id, t2.eos_id) == (13, 9, 10, 11, 12)
    names = t2.token_names()
    assert (
        len(names) == 13
        and names[0] == "<pad>"
        and names[5] == "e1"
        and names[9:] == ["<bos>", "<query>", "<ans>", "<eos>"]
    )
    for name, cfg, k in (("brevo1", dict(N=12), 12), ("brevo2", dict(N=8), 8)):
        a = build_task(name, cfg)
        b = build_task(name, dict(cfg, vocab="official"))
        assert (b.vocab_size, b.bos_id, b.query_id, b.ans_id, b.eos_id) == (10000, 9999, 9997, 9998, 9998)
        relabel = {k + 1: 9999, k + 2: 9997, k + 3: 9998, k + 4: 9998}
        for w in range(5):
            x, y = a.instance("val", w).tokens, b.instance("val", w).tokens
            np.testing.assert_array_equal([relabel.get(int(t), int(t)) for t in x], y)
        assert b.token_names()[9998] == "<ans|eos>"


def test_decode():
    t = build_task("brevo2", dict(N=8))
    assert (
        t.decode([9, 3, 5, 1, 2, 8, 10, 1, 2, 8, 11, 3, 5, 12, 0])
        == "<bos> p3.e1 p1.p2.e4 <query> p1.p2.e4 <ans> p3.e1 <eos> <pad>"
    )
    assert (
        build_task("brevo1", dict(N=12)).decode([13, 4, 7, 14, 7, 15, 4, 16]) == "<bos> v4 v7 <query> v7 <ans> v4 <eos>"
    )


# ---------------------------------------------------------------------------------------------- distributions
def chi2(counts, probs):
    exp = counts.sum() * probs
    return float(((counts - exp) ** 2 / exp).sum())


def test_size_distribution_matches_spec():
    """P(n) ∝ 1/(n + sqrt N) on 3..N (paper App. A.2): chi-square over 40k draws (df = 13; p ~ 1e-4 at 41)."""
    task = build_task("brevo1", dict(N=16))
    b = task.generate("train", np.arange(40000), np.zeros(40000, dtype=np.int64))
    counts = np.bincount(b.meta["n"], minlength=17)[3:]
    n = np.arange(3, 17)
    probs = 1 / (n + math.sqrt(16))
    assert chi2(counts, probs / probs.sum()) < 41
    assert b.meta["n"].min() >= 3 and b.meta["n"].max() <= 16


@pytest.mark.parametrize("rounding,top", [("ceil", 5), ("floor", 4)])
def test_leaf_count_range(rounding, top):
    """Lf uniform in {1..ceil((n-1)/4)+1} (paper) or {1..floor((n-1)/4)+1} (release); n = 14: 5 vs 4 values.
    Observable check: the vertices that have parents in the tokens number exactly n - Lf."""
    task = build_task("brevo1", dict(N=14, leaf_rounding=rounding))
    b = task.generate("val", np.arange(4000), np.zeros(4000, dtype=np.int64))
    lf = b.meta["n_leaves"]
    assert lf.min() == 1 and lf.max() == top
    assert chi2(np.bincount(lf, minlength=top + 1)[1:], np.full(top, 1 / top)) < 25
    for r in range(50):
        inst = task.instance("val", r)
        p = parse(task, inst.tokens)
        assert sum(1 for ps in p["parents"].values() if ps) == 14 - inst.meta["n_leaves"]


def test_query_pool():
    """last_quarter: q uniform on {floor(3n/4)..n-1}; last: q = n-1, so q never has a child in the tokens."""
    n = 20
    t = build_task("brevo1", dict(N=n))
    b = t.generate("val", np.arange(3000), np.zeros(3000, dtype=np.int64))
    pool = np.arange(15, 20)
    assert set(np.unique(b.meta["query"])) == set(pool)
    assert chi2(np.bincount(b.meta["query"] - 15, minlength=5), np.full(5, 0.2)) < 25
    has_child = [
        bool(parse(t, t.instance("val", w).tokens)["children"].get(parse(t, t.instance("val", w).tokens)["q"]))
        for w in range(200)
    ]
    assert 0 < sum(has_child) < 200
    last = build_task("brevo1", dict(N=n, query_pool="last"))
    b = last.generate("train", np.arange(2000), np.zeros(2000, dtype=np.int64))
    np.testing.assert_array_equal(b.meta["query"], b.meta["n"] - 1)
    for w in range(200):
        p = parse(last, last.instance("train", w).tokens)
        assert not p["children"].get(p["q"])


def simulate(rng, n, D=4, ceil=True, q_last=False):
    """Plain-Python re-implementation of the generative process of paper App. A.2 (vertices 0..n-1 in construction
    order) -> statistics that the tokens reveal."""
    lf = rng.randint(1, (math.ceil((n - 1) / 4) if ceil else (n - 1) // 4) + 1)
    outdeg = [0] * n
    parents = {v: set() for v in range(n)}
    edges = []
    for v in range(lf, n):
        cands = [u for u in range(v) if outdeg[u] < D]
        for p in rng.sample(cands, rng.randint(1, min(D, len(cands)))):
            outdeg[p] += 1
            parents[v].add(p)
            edges.append((p, v))
    q = n - 1 if q_last else rng.randint(3 * n // 4, n - 1)
    anc = ancestors(parents, q)
    indeg = {v: len(parents[v]) for v in anc}
    ready, order = [v for v in anc if not parents[v]], []
    while ready:
        v = ready.pop(rng.randrange(len(ready)))
        order.append(v)
        for c in anc:
            if v in parents[c]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
    rng.shuffle(edges)
    return stats(edges, parents, q, order)


def stats(edges, parents, q, order):
    kids = {}
    for a, b in edges:
        kids.setdefault(a, set()).add(b)
    return dict(
        edges=len(edges),
        answer=len(order),
        depth=bfs_depth(parents, q),
        q_has_child=float(bool(kids.get(q))),
        chained_answers=sum(order[j] in parents[order[j + 1]] for j in range(len(order) - 1)),
        same_child_edges=sum(edges[j][1] == edges[j + 1][1] for j in range(len(edges) - 1)),
        first_answer_fanout=len(kids.get(order[0], ())),
    )


@pytest.mark.parametrize(
    "name,cfg", [("brevo1", dict(N=20)), ("brevo2", dict(N=14, leaf_rounding="floor", query_pool="last"))]
)
def test_process_matches_a_naive_simulator(name, cfg):
    """Means of token-visible statistics (edges, answer size, depth, whether q has children, parent->child pairs
    adjacent in the answer (Kahn tie-breaking), adjacent edges sharing a child (edge shuffle), out-degree of the
    first answer vertex) agree with the naive simulator within 4.5 standard errors (3000 instances each)."""
    task = build_task(name, cfg)
    rng = random.Random(1234)
    n = task.N
    sim = [simulate(rng, n, ceil=task.leaf_rounding == "ceil", q_last=task.query_pool == "last") for _ in range(3000)]
    gen = []
    b = task.generate("val", np.arange(3000), np.zeros(3000, dtype=np.int64))
    for r in range(3000):
        p = parse(task, b.tokens[b.offsets[r] : b.offsets[r + 1]])
        gen.append(stats(p["edges"], p["parents"], p["q"], p["answer"]))
    for key in sim[0]:
        x = np.array([s[key] for s in sim], float)
        y = np.array([s[key] for s in gen], float)
        se = math.sqrt(x.var() / x.size + y.var() / y.size) + 1e-12
        assert abs(x.mean() - y.mean()) / se < 4.5, (key, x.mean(), y.mean())


def test_names_uniform():
    """Brevo1: a uniform subset of 1..N; Brevo2: non-final tokens uniform in 1..V, final ones in V+1..2V; the
    construction order does not depend on the names (leaves are not biased towards short, early-drawn names)."""
    t1 = build_task("brevo1", dict(N=12))
    toks = t1.generate("train", np.arange(3000), np.zeros(3000, dtype=np.int64)).tokens
    assert chi2(np.bincount(toks[toks <= 12], minlength=13)[1:], np.full(12, 1 / 12)) < 40
    t2 = build_task("brevo2", dict(N=30))
    V = 4
    name_toks = []
    for w in range(300):
        p = parse(t2, t2.instance("val", w).tokens)
        name_toks += [t for v in p["parents"] for t in v]  # each distinct vertex once (edges repeat names)
    allt = np.array(name_toks)
    assert chi2(np.bincount(allt[allt <= V], minlength=V + 1)[1:], np.full(V, 0.25)) < 25
    assert chi2(np.bincount(allt[allt > V] - V, minlength=V + 1)[1:], np.full(V, 0.25)) < 25
    # 4 one-token names among 84: an i.i.d. stream hits them early, so without a shuffle they would be leaves
    t3 = build_task("brevo2", dict(N=30, vocab_V=4, min_len=1, max_len=3))
    leaf, other = [], []
    for w in range(600):
        p = parse(t3, t3.instance("val", w).tokens)
        for v, ps in p["parents"].items():
            (other if ps else leaf).append(len(v) == 1)
    x, y = np.array(leaf, float), np.array(other, float)
    assert abs(x.mean() - y.mean()) / math.sqrt(x.var() / x.size + y.var() / y.size) < 4.5, (x.mean(), y.mean())


def test_release_settings_reproduce_measured_statistics():
    """Measured with the official generator at the release settings: Brevo1 N=110 train mean 183 tokens, loss fraction
    10.7%, n=N median 522 / depth mean 2.7; Brevo2 N=50 train mean 292, loss fraction 12.8%, n=N median 758."""
    rel = dict(leaf_rounding="floor", query_pool="last", answer_includes_query=True, vocab="official")
    for name, N, mean, frac, med in (("brevo1", 110, 183, 0.107, 522), ("brevo2", 50, 292, 0.128, 758)):
        t = build_task(name, dict(N=N, **rel))
        b = t.generate("train", np.arange(20000), np.zeros(20000, dtype=np.int64))
        assert abs(b.lengths.mean() / mean - 1) < 0.02
        assert abs(b.loss_mask.mean() - frac) < 0.003
        v = t.generate("test", np.arange(2000), np.zeros(2000, dtype=np.int64))
        assert abs(np.median(v.lengths) / med - 1) < 0.02
        if name == "brevo1":
            assert abs(v.meta["depth"].mean() - 2.7) < 0.1


def test_max_instance_len_exact_and_attained():
    assert build_task("brevo1", dict(N=110)).max_instance_len("train") == 2 * (4 * 110 - 10) + 110 + 4 == 974
    assert build_task("brevo1", dict(N=110, answer_includes_query=True)).max_instance_len("test") == 975
    assert (
        build_task("brevo2", dict(N=50, max_instance_tokens=None)).max_instance_len("val")
        == 4 + 4 * (2 * 190 + 50)
        == 1724
    )
    # default cap = context: the paper's 1536 window is accepted; longer draws are redrawn with the same n
    assert build_task("brevo2", dict(N=50)).max_instance_len("val") == 1536
    assert build_task("brevo1", dict(N=12)).max_instance_len("val") <= 256
    assert build_task("brevo2", dict(N=8)).max_instance_len("val") <= 256
    # N=5: Lf=1 (1/2), vertex 2 takes 2 parents (1/2), vertex 3 takes 3 (1/3), vertex 4 takes 4 (1/4), q = 4 (1/2):
    # 10 edges, 4 answers -> 2*10 + 5 + 4 = 29 tokens with probability 1/96
    t = build_task("brevo1", dict(N=5))
    L = t.generate("val", np.arange(3000), np.zeros(3000, dtype=np.int64)).lengths
    assert t.max_instance_len("val") == 29 == L.max() and (L == 29).sum() >= 10
    assert L.min() >= t.min_instance_len("val")
    t = build_task("brevo2", dict(N=3, vocab_V=2, min_len=2, max_len=2))  # 3 edges, 2 answers, all names 2 tokens
    L = t.generate("val", np.arange(400), np.zeros(400, dtype=np.int64)).lengths
    assert t.max_instance_len("val") == 4 + 2 * (2 * 3 + 3) == L.max()


def test_num_groups_and_depth_groups():
    t = build_task("brevo1", dict(N=110))
    assert t.num_groups == CAP + 1 and t.group_name == "depth" and t.chance == 0.0 and t.eval_mode == "generate"
    assert t.group_labels[CAP] == "8+"
    assert build_task("brevo1", dict(N=5)).num_groups == 5  # depth <= N - 1
    P = t.prompts("test", np.arange(400))
    np.testing.assert_array_equal(P.group, np.minimum(P.meta["depth"], CAP))
    assert P.group.min() >= 1 and P.group.max() < t.num_groups


# ---------------------------------------------------------------------------------------------- determinism
def test_splits_seeds_and_switches():
    t = build_task("brevo1", dict(N=12))
    a = {s: t.instance(s, (0, 0)).tokens for s in ("train", "val", "test")}
    assert not np.array_equal(a["val"], a["test"])
    assert not np.array_equal(t.instance("val", 0, seed=1).tokens, a["val"])
    # loss_on changes nothing but the mask
    t2 = build_task("brevo1", dict(N=12, loss_on="all"))
    np.testing.assert_array_equal(t2.instance("train", (7, 2)).tokens, t.instance("train", (7, 2)).tokens)
    # answer_includes_query: the same graph and order, q appended
    t3 = build_task("brevo1", dict(N=12, answer_includes_query=True))
    for w in range(20):
        x, y = t.instance("val", w).tokens, t3.instance("val", w).tokens
        q = parse(t, x)["q"]
        np.testing.assert_array_equal(np.concatenate([x[:-1], list(q), x[-1:]]), y)
    # generative switches change the stream
    t4 = build_task("brevo1", dict(N=12, query_pool="last"))
    assert any(not np.array_equal(t4.instance("val", w).tokens, t.instance("val", w).tokens) for w in range(5))


def test_same_instance_in_a_fresh_process_with_another_hash_seed():
    code = (
        "from canonlm.data.tasks import build_task;"
        "t=build_task('brevo2', dict(N=8));"
        "print(t.instance('train', (123, 4)).tokens.tolist())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": s, "PATH": ""},
        ).stdout
        for s in ("1", "2")
    }
    here = str(build_task("brevo2", dict(N=8)).instance("train", (123, 4)).tokens.tolist())
    assert outs == {here + "\n"}


# ---------------------------------------------------------------------------------------------- validator
def random_topo(parents, verts, rng):
    """A random topological order of ``verts`` (closed under parents) by the test's own Kahn loop."""
    left, out = set(verts), []
    while left:
        ready = sorted(v for v in left if not (parents[v] & left))
        v = ready[rng.randrange(len(ready))]
        out.append(v)
        left.remove(v)
    return out


def flat(names):
    return [t for nm in names for t in nm]


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("brevo1", dict(N=14)),
        ("brevo2", dict(N=10)),
        ("brevo1", dict(N=14, answer_includes_query=True, vocab="official")),
        ("brevo2", dict(N=10, answer_includes_query=True, vocab="official")),
    ],
)
def test_validator_accepts_all_topological_orders_and_rejects_corruptions(name, cfg):
    task = build_task(name, cfg)
    ids = ids_of(task)
    eos = ids["eos"]
    rng = random.Random(7)
    incl = task.answer_includes_query
    alt_differs = swapped = 0
    for w in range(30):
        inst = task.instance("test", w)
        p = parse(task, inst.tokens)
        prompt = inst.tokens[: p["ans_pos"] + 1]
        par, q, ans = p["parents"], p["q"], p["answer"]
        assert task.check_answer(prompt, inst.tokens[p["ans_pos"] + 1 :])
        assert task.check_answer(inst, inst.tokens[p["ans_pos"] + 1 :])  # a whole instance works as the prompt
        anc = ancestors(par, q)
        for _ in range(3):
            alt = random_topo(par, anc, rng) + ([q] if incl else [])
            alt_differs += alt != ans
            assert task.answer_verdict(prompt, flat(alt) + [eos]) == (True, "ok")

        def verdict(names, tail=(eos,)):
            return task.answer_verdict(prompt, flat(names) + list(tail))

        assert verdict(ans, ()) == (False, "no_eos")
        assert verdict(ans[:-1], ()) == (False, "no_eos")
        assert verdict(ans, (eos, eos)) == (False, "invalid")
        assert verdict(ans[:-1]) == (False, "missing")
        assert verdict(ans[1:]) == (False, "missing")
        assert verdict(ans + [ans[0]]) == (False, "duplicate")
        if not incl:
            assert verdict(ans + [q]) == (False, "extra")
        else:
            assert verdict([q] + ans[:-1]) == (False, "order")
        outside = [v for v in par if v not in anc and v != q]
        if outside:
            assert verdict(ans + [outside[0]]) == (False, "extra")
        # a well-formed name that is not a vertex of the graph (brevo1 at n = N: only invisible isolated leaves)
        names = (
            [(t,) for t in range(1, task.N + 1)]
            if name == "brevo1"
            else [(a, b) for a in range(1, 5) for b in range(5, 9)]
        )
        unused = next((nm for nm in names if nm not in par), None)
        if unused is not None:
            assert verdict(ans[:1] + [unused] + ans[1:]) == (False, "extra")
        # a parent swapped after its child
        pairs = [(i, j) for i, a in enumerate(ans) for j, b in enumerate(ans) if a in par[b]]
        swapped += bool(pairs)
        if pairs:  # (none when every ancestor is a leaf and q is not appended)
            i, j = pairs[0]
            sw = list(ans)
            sw[i], sw[j] = sw[j], sw[i]
            assert verdict(sw) == (False, "order")
        # invalid tokens: pad, a special, an unterminated Brevo2 name
        body = flat(ans)
        for bad in ([0], [ids["bos"]], [ids["query"]]):
            assert task.answer_verdict(prompt, body[:1] + bad + body[1:] + [eos])[0] is False
        if name == "brevo2":
            assert task.answer_verdict(prompt, body + [1, eos]) == (False, "invalid")
            assert task.answer_verdict(prompt, body + [1, 2, 3, 4, 5, eos]) == (False, "invalid")  # 5 tokens
    assert alt_differs > 10 and swapped > 10  # alternative orders really were different; swaps were tested


def test_validator_rejects_malformed_prompts():
    task = build_task("brevo1", dict(N=12))
    with pytest.raises(ValueError):
        task.check_answer([5, 6], [16])
    with pytest.raises(ValueError):
        task.check_answer([13, 1, 2, 3, 14, 3, 15], [16])  # odd number of edge names


# ---------------------------------------------------------------------------------------------- evaluate
def oracle_forward(task, fulls, answer_fn=None):
    """Fake model: recognises the prompt (prefix up to the first <ans>) and puts all mass on the next token of
    ``answer_fn(full)`` (default: the instance's own continuation)."""
    ans = ids_of(task)["ans"]
    table = {}
    for f in fulls:
        f = [int(x) for x in f]
        p = f.index(ans)
        cont = answer_fn(f, p) if answer_fn else f[p + 1 :]
        table[tuple(f[: p + 1])] = f[: p + 1] + cont

    def forward(x):
        B, T = x.shape
        out = torch.full((B, T, task.vocab_size), -10.0)
        for b in range(B):
            row = x[b].tolist()
            p = row.index(ans)
            seq = table[tuple(row[: p + 1])]
            for t in range(T):
                if t + 1 < len(seq):
                    out[b, t, seq[t + 1]] = 10.0
        return out

    return forward


@pytest.mark.parametrize(
    "name,cfg,count",
    [
        ("brevo1", dict(N=12, eval_num_samples=64), 40),
        ("brevo2", dict(N=8, vocab="official", answer_includes_query=True), 12),
        ("brevo2", dict(N=8, answer_includes_query=True), 24),
    ],
)
def test_evaluate_oracle_uniform_and_garbage(name, cfg, count):
    """(official vocabulary: 10000 logits per position, so fewer prompts keep the fake models cheap)"""
    task = build_task(name, cfg)
    idx = np.arange(count)
    P = task.prompts("test", idx)
    assert P.max_new_tokens == (task.N + 2) * task.max_len + 1 and P.stop_ids == (ids_of(task)["eos"],)
    assert P.temperature == 0.0 and len(P.prompts) == count
    fulls = [task.instance("test", int(w)).tokens for w in idx]
    for r, f in enumerate(fulls):  # prompt = the instance up to and including <ans>
        np.testing.assert_array_equal(P.prompts[r], f[: len(P.prompts[r])])
        assert P.prompts[r][-1] == ids_of(task)["ans"]
    # rows of one batch stop at different steps: batch 16 must give exactly what one prompt at a time gives
    lm = LanguageModel(oracle_forward(task, fulls), task.vocab_size, batch_size=16)
    res = task.evaluate(lm, "test", idx)
    one = task.evaluate(LanguageModel(oracle_forward(task, fulls), task.vocab_size, batch_size=1), "test", idx)
    np.testing.assert_array_equal(res["correct"], one["correct"])
    assert res["correct"].dtype == bool and res["correct"].all() and res["set_correct"].mean() == 1.0
    depths = np.array([bfs_depth(*[parse(task, f)[k] for k in ("parents", "q")]) for f in fulls])
    np.testing.assert_array_equal(res["group"], np.minimum(depths, CAP))
    assert res["group"].dtype == np.int64

    V = task.vocab_size  # (cheap logits: one vector per row, expanded over positions)
    uniform = LanguageModel(lambda x: torch.zeros(1, 1, V).expand(*x.shape, V), V, batch_size=16)
    assert not task.evaluate(uniform, "test", idx)["correct"].any()
    assert task.eval_samples("test") == cfg.get("eval_num_samples", 1000)
    if task.vocab == "official":
        return  # (each generation step costs ~10 ms at 10000 ids; the rest is vocabulary-independent)
    g = torch.Generator().manual_seed(0)
    garbage = LanguageModel(lambda x: torch.randn(x.shape[0], 1, V, generator=g).expand(*x.shape, V), V, batch_size=1)
    assert task.evaluate(garbage, "test", idx)["correct"].mean() < 0.05

    # right set, reversed order (still ending with <eos>): wrong, but the set diagnostic is 1
    eos = ids_of(task)["eos"]

    def reverse(f, p):
        names = parse(task, f)["answer"]
        return flat(names[::-1]) + [eos]

    rev = task.evaluate(LanguageModel(oracle_forward(task, fulls, reverse), task.vocab_size, batch_size=1), "test", idx)
    chained = np.array(
        [any(a in r["parents"][b] for a in r["answer"] for b in r["answer"]) for r in (parse(task, f) for f in fulls)]
    )  # reversal breaks the order iff a pair is chained
    assert chained.sum() > count // 4
    np.testing.assert_array_equal(rev["correct"], ~chained)
    assert rev["set_correct"].mean() == 1.0


# ---------------------------------------------------------------------------------------------- configs
def test_yaml_presets_compose(tmp_path):
    from conftest import compose

    from canonlm.data.tasks.brevo import KEYS

    for preset, N, ctx in (("brevo1", 70, 1024), ("brevo2", 30, 1536), ("brevo1_cpu", 12, 256), ("brevo2_cpu", 8, 256)):
        cfg = compose([f"task={preset}"], output_dir=tmp_path)
        node = dict(cfg.task)
        assert set(node) == set(KEYS)
        t = build_task(node["name"], node)
        assert (t.N, t.context) == (N, ctx)
        assert all(t.max_instance_len(s) <= t.context for s in ("train", "val", "test"))
        if preset.endswith("_cpu"):
            assert t.eval_num_samples == 64
    assert (t.V, t.min_len, t.max_len, t.leaf_rounding, t.query_pool, t.answer_includes_query) == (
        4,
        2,
        4,
        "ceil",
        "last_quarter",
        False,
    )


BAD = [
    ("brevo1", dict(N=2), "task.N"),
    ("brevo1", dict(N="12"), "task.N"),
    ("brevo1", dict(vocab_V=4), "task.vocab_V"),
    ("brevo1", dict(min_len=2, max_len=2), "task.min_len"),
    ("brevo1", dict(max_len=2), "task.max_len"),
    ("brevo2", dict(vocab_V=0), "task.vocab_V"),
    ("brevo2", dict(min_len=3, max_len=2), "task.min_len"),
    ("brevo2", dict(vocab_V=2, min_len=2, max_len=2, N=30), "task.vocab_V"),  # 4 names < 30
    ("brevo2", dict(vocab_V=4, max_len=12), "task.max_len"),  # > 2**20 names
    ("brevo1", dict(max_degree=0), "task.max_degree"),
    ("brevo1", dict(leaf_rounding="round"), "task.leaf_rounding"),
    ("brevo1", dict(query_pool="first"), "task.query_pool"),
    ("brevo1", dict(answer_includes_query="yes"), "task.answer_includes_query"),
    ("brevo1", dict(loss_on="answer"), "task.loss_on"),
    ("brevo1", dict(vocab="gpt2"), "task.vocab"),
    ("brevo1", dict(context=0), "task.context"),
    ("brevo1", dict(tail="keep"), "task.tail"),
    ("brevo1", dict(seed=-1), "task.seed"),
    ("brevo1", dict(eval_num_samples=0), "task.eval_num_samples"),
    ("brevo1", dict(depth=3), "task.depth"),
    ("brevo1", dict(name="brevo2"), "task.name"),
    ("brevo1", dict(N=9997, vocab="official"), "task.N"),
]


@pytest.mark.parametrize("name,cfg,key", BAD)
def test_config_errors_name_key_value_and_allowed(name, cfg, key):
    with pytest.raises(ConfigError) as e:
        build_task(name, cfg)
    assert e.value.key == key
    msg = str(e.value)
    assert key in msg and "allowed" in msg and repr(e.value.value) in msg


def test_accepts_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create(dict(name="brevo2", N=8, vocab_V=4, min_len=2, max_len=4, query_pool="last"))
    t = build_task("brevo2", node)
    parse_and_check(t, t.instance("test", 1), "test")


def test_length_cap_redraws_only_overlong_instances():
    free = build_task("brevo2", dict(N=50, max_instance_tokens=None))
    capped = build_task("brevo2", dict(N=50, max_instance_tokens=700))
    w = np.arange(1500)
    a = free.generate("test", w, np.zeros_like(w))
    b = capped.generate("test", w, np.zeros_like(w))
    La, Lb = a.lengths, b.lengths
    assert Lb.max() <= 700 and (La > 700).sum() > 50  # the cap bites on many instances ...
    keep = La <= 700
    np.testing.assert_array_equal(La[keep], Lb[keep])  # ... and leaves the others untouched
    assert (b.meta["n"] == 50).all()
    for r in np.nonzero(~keep)[0][:20]:  # redrawn instances are valid Brevo instances of the same n
        inst = capped.instance("test", (int(r), 0))
        assert capped.check_answer(inst.tokens, inst.tokens[inst.meta["prompt_len"] :])
    with pytest.raises(ConfigError, match="max_instance_tokens"):
        build_task("brevo1", dict(max_instance_tokens=0))


def test_length_cap_guard():
    # the paper's window is fine; a window that would redraw a large share of n = N graphs is refused up front
    assert build_task("brevo1", dict(N=110)).max_instance_len("val") == 974
    with pytest.raises(ConfigError, match="task.context") as e:
        build_task("brevo1", dict(N=110, context=512))
    assert "would be redrawn" in str(e.value)
    with pytest.raises(ConfigError, match="task.max_instance_tokens"):
        build_task("brevo1", dict(N=70, max_instance_tokens=100))  # below the shortest n = N instance (108)
    with pytest.raises(ValueError, match="split"):
        build_task("brevo1", dict(N=8)).estimate_lengths("bogus", np.zeros(1, np.int64), np.zeros(1, np.int64))
