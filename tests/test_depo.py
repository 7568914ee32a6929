"""Depo generator (paper App. A.1): instances are parsed back from their tokens and re-solved with naive loops;
distributions are compared with the paper's formulas; every config error is checked."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from canonlm.data import ConfigError
from canonlm.data.tasks import TASKS, build_task

TINY = dict(N=16, K=4, vocab_V=8, context=256)


# ---------------------------------------------------------------------------------------------- oracle parser
def ids_of(task):
    """Token ids re-derived from the layout in the module docstring, not from the code."""
    V, K = task.V, task.K
    if task.vocab == "official":
        return dict(bos=9999, ans=9500, q={9000 + k: k for k in range(1, K + 1)}, eos=9998)
    return dict(bos=2 * V + 1, ans=2 * V + 2, q={2 * V + 2 + k: k for k in range(1, K + 1)}, eos=2 * V + K + 3)


def read_name(toks, p, task):
    """Read one name starting at p: tokens in 1..V then one final token in V+1..2V. Returns (name tuple, new p)."""
    V = task.V
    start = p
    while 1 <= toks[p] <= V:
        p += 1
    assert V + 1 <= toks[p] <= 2 * V, f"name at {start} not closed by a final token: {toks[start : p + 1]}"
    name = tuple(toks[start : p + 1])
    assert task.min_len <= len(name) <= task.max_len, name
    return name, p + 1


def parse_and_check(task, inst, split):
    """Parse an instance's tokens back, check every structural rule and re-solve every query with a naive walk."""
    ids = ids_of(task)
    toks = [int(x) for x in inst.tokens]
    lm, aid, grp = inst.loss_mask, inst.answer_id, inst.group
    assert toks[0] == ids["bos"]
    p, names = 1, []
    while toks[p] not in ids["q"]:
        name, p = read_name(toks, p, task)
        names.append(name)
    assert len(names) % 2 == 0
    n = len(names) // 2
    src, dst = names[0::2], names[1::2]
    assert len(set(src)) == n, "sources must be distinct"
    assert set(dst) == set(src), "targets must be the same node set"
    succ = dict(zip(src, dst))
    # one n-cycle: walking n steps from any node visits every node once and returns
    start, seen, x = src[0], set(), src[0]
    for _ in range(n):
        seen.add(x)
        x = succ[x]
    assert x == start and len(seen) == n
    if split == "train":
        assert 3 <= n <= task.N
    else:
        assert n == task.N
    assert inst.meta["n"] == n
    t = min(task.n_queries, n)
    expect_loss = np.zeros(len(toks), bool)
    expect_aid = np.full(len(toks), -1)
    expect_grp = np.zeros(len(toks), int)
    qs, ks = [], []
    for j in range(t):
        k = ids["q"][toks[p]]
        q, p = read_name(toks, p + 1, task)
        assert toks[p] == ids["ans"]
        expect_loss[p] = True
        a0 = p + 1
        a, p = read_name(toks, a0, task)
        x = q
        for _ in range(k):  # naive k-hop walk
            x = succ[x]
        assert a == x, f"query {j}: {k} hops from {q} should reach {x}, got {a}"
        expect_loss[a0:p] = True
        expect_aid[a0:p] = j
        expect_grp[a0:p] = k
        qs.append(q)
        ks.append(k)
    assert len(set(qs)) == t and set(qs) <= set(src), "query sources must be distinct nodes"
    if task.eos:
        assert toks[p] == ids["eos"]
        expect_loss[p] = True
        p += 1
    assert p == len(toks), "trailing tokens"
    assert 0 not in toks
    if task.loss_on == "all":
        expect_loss[:] = True
    np.testing.assert_array_equal(lm, expect_loss)
    np.testing.assert_array_equal(aid, expect_aid)
    np.testing.assert_array_equal(grp, expect_grp)
    assert list(inst.meta["k"]) == ks
    assert len(toks) <= task.max_instance_len(split)
    return dict(n=n, ks=ks, names=src, succ=succ, qs=qs, edges=list(zip(src, dst)))


CONFIGS = [
    ("depo1", TINY),
    ("depo1", dict(N=40, K=8, vocab_V=50)),
    ("depo2", dict(N=20, K=16, vocab_V=4)),
    ("depo2", dict(N=12, K=5, vocab_V=3, eval_k_mode="fixed", eval_k=[5, 2])),
    ("depo1", dict(N=10, K=3, vocab_V=8, min_len=5, max_len=6)),  # 2.9e5 names: per-call token table path
    ("depo1", dict(TINY, vocab="official", eos=True)),
    ("depo1", dict(TINY, loss_on="all", n_queries=3)),
    ("depo1", dict(N=5, K=30, vocab_V=2, min_len=1, max_len=2)),  # k far beyond n (wrap-around); 6 names only
]


@pytest.mark.parametrize("name,cfg", CONFIGS)
@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_instances_parse_and_answers_rederived(name, cfg, split):
    task = build_task(name, cfg)
    for w in range(12):
        for i in (0, 3):
            parse_and_check(task, task.instance(split, (w, i)), split)


def test_batched_generation_equals_single_instances():
    task = build_task("depo1", dict(N=30, K=4, vocab_V=6))
    w = np.array([5, 0, 5, 9, 2**40])
    i = np.array([1, 0, 0, 7, 3])
    b = task.generate("val", w, i)
    aid, _ = b.token_answers()
    for r in range(len(w)):
        one = task.instance("val", (int(w[r]), int(i[r])))
        s, e = b.offsets[r], b.offsets[r + 1]
        np.testing.assert_array_equal(b.tokens[s:e], one.tokens)
        np.testing.assert_array_equal(b.loss_mask[s:e], one.loss_mask)
        np.testing.assert_array_equal(aid[s:e], one.answer_id)


def test_official_vocab_is_the_compact_stream_relabelled():
    a = build_task("depo1", TINY)
    b = build_task("depo1", dict(TINY, vocab="official"))
    assert b.vocab_size == 10000 and a.vocab_size == 2 * 8 + 4 + 3
    x, y = a.instance("train", (3, 1)).tokens, b.instance("train", (3, 1)).tokens
    relabel = {2 * 8 + 1: 9999, 2 * 8 + 2: 9500, **{2 * 8 + 2 + k: 9000 + k for k in range(1, 5)}}
    np.testing.assert_array_equal([relabel.get(int(t), int(t)) for t in x], y)
    assert b.token_names()[9999] == "<bos>" and b.token_names()[9003] == "<query_3>"


def test_vocab_layout_and_decode():
    t = build_task("depo1", dict(TINY, eos=True))
    names = t.token_names()
    assert len(names) == t.vocab_size == 2 * 8 + 4 + 4
    assert names[0] == "<pad>" and t.pad_id == 0
    assert t.bos_id == 17 and t.ans_id == 18 and t.query_id(1) == 19 and t.query_id(4) == 22 and t.eos_id == 23
    assert t.num_groups == 5 and t.group_name == "k"
    assert t.decode([17, 3, 12, 9, 22, 9, 18, 3, 12, 0]) == "<bos> p3.e4 e1 <query_4> e1 <ans> p3.e4 <pad>"
    with pytest.raises(ValueError, match="k=5"):
        t.query_id(5)


# ---------------------------------------------------------------------------------------------- distributions
def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = counts.sum() * probs
    return float(((counts - exp) ** 2 / exp).sum())


def test_size_distribution_matches_paper():
    """P(n) ∝ 1/(n + sqrt N) on 3..N (paper App. A.1): chi-square over 40k draws (df = 13; p ~ 1e-4 at 41)."""
    task = build_task("depo1", TINY)
    b = task.generate("train", np.arange(40000), np.zeros(40000, dtype=np.int64))
    counts = np.bincount(b.meta["n"], minlength=17)[3:]
    n = np.arange(3, 17)
    probs = 1 / (n + math.sqrt(16))
    probs /= probs.sum()
    assert chi2(counts, probs) < 41
    assert b.meta["n"].min() >= 3 and b.meta["n"].max() <= 16


def test_depth_distributions():
    task = build_task("depo1", dict(TINY, K=6))
    ks = task.generate("train", np.arange(3000), np.zeros(3000, dtype=np.int64)).meta["k"]
    counts = np.bincount(ks, minlength=7)[1:]
    assert chi2(counts, np.full(6, 1 / 6)) < 30  # uniform on 1..K
    ev = task.generate("test", np.arange(600), np.zeros(600, dtype=np.int64)).meta["k"]
    assert set(np.unique(ev)) == {1, 2, 4, 6}  # {1, 2, 4, ..} ∪ {K}
    assert chi2(np.bincount(ev)[[1, 2, 4, 6]], np.full(4, 1 / 4)) < 25
    fixed = build_task("depo1", dict(TINY, eval_k_mode="fixed", eval_k=[3]))
    assert set(fixed.generate("val", np.arange(50), np.zeros(50, dtype=np.int64)).meta["k"]) == {3}
    assert set(fixed.generate("train", np.arange(300), np.zeros(300, dtype=np.int64)).meta["k"]) == {1, 2, 3, 4}


def test_name_tokens_uniform_and_lengths():
    """Prefix tokens uniform in 1..V, final tokens uniform in V+1..2V (paper App. A.1)."""
    task = build_task("depo2", dict(N=20, K=4, vocab_V=4))
    toks = np.concatenate([task.instance("val", w).tokens for w in range(40)])
    V = 4
    prefix = np.bincount(toks[(toks >= 1) & (toks <= V)], minlength=V + 1)[1:]
    final = np.bincount(toks[(toks > V) & (toks <= 2 * V)] - V, minlength=V + 1)[1:]
    assert chi2(prefix, np.full(V, 1 / V)) < 25 and chi2(final, np.full(V, 1 / V)) < 25


def test_cycle_edge_order_and_queries_are_uniform_shuffles():
    """The cycle, the edge listing and the query order must be uniform given the name set (paper
    App. A.1), independent of how the names were drawn. With 4 one-token and 16 two-token names (a one-token name is 4x
    likelier per draw, so it tends to be drawn early) and n = 6, compare per-instance statistics with their exact
    expectations under uniform shuffles: short->short successor pairs a(a-1)/(n-1) for a short names; chained
    consecutive edges (dst_j == src_{j+1}) (n-1)/(n-1) * 1/(n-1) * (n-1) = 1; first query short a/n; successive
    queries chained 1/(n-1)."""
    task = build_task("depo1", dict(N=6, K=2, vocab_V=4, n_queries=6))
    d = {"short_pairs": [], "chained_edges": [], "first_q_short": [], "chained_q": []}
    n = 6
    for w in range(1200):
        r = parse_and_check(task, task.instance("test", w), "test")
        short = {x for x in r["names"] if len(x) == 1}
        a = len(short)
        d["short_pairs"].append(sum(x in short and r["succ"][x] in short for x in r["names"]) - a * (a - 1) / (n - 1))
        src = [e[0] for e in r["edges"]]
        dst = [e[1] for e in r["edges"]]
        d["chained_edges"].append(sum(dst[j] == src[j + 1] for j in range(n - 1)) - 1.0)
        d["first_q_short"].append((r["qs"][0] in short) - a / n)
        d["chained_q"].append((r["succ"][r["qs"][0]] == r["qs"][1]) - 1 / (n - 1))
    for name, v in d.items():
        v = np.asarray(v, float)
        z = v.mean() / (v.std() / math.sqrt(len(v)))
        assert abs(z) < 4.5, (name, v.mean(), z)


def test_distinct_names_by_rejection_exhaust_small_name_space():
    """6 possible names (V=2, lengths 1..2) and n = N = 6: every instance must use all six, distinct."""
    task = build_task("depo1", dict(N=6, K=2, vocab_V=2, min_len=1, max_len=2))
    for w in range(20):
        r = parse_and_check(task, task.instance("val", w), "val")
        assert len(set(r["names"])) == 6


def test_max_instance_len_formula():
    t = build_task("depo1", dict(N=375))
    # 1 + 2 * (375 two-token names) * 2 + 10 * (2 + 2 * 2)
    assert t.max_instance_len("test") == 1 + 2 * 375 * 2 + 10 * 6 == 1561
    # only 25 two-token and 5 one-token names: n = N = 30 uses all of them
    assert build_task("depo1", dict(N=30, vocab_V=5)).max_instance_len("val") == 1 + 2 * (25 * 2 + 5) + 60
    assert build_task("depo1", dict(N=30, vocab_V=5, eos=True)).max_instance_len("train") == 172


# ---------------------------------------------------------------------------------------------- determinism
def test_splits_seeds_and_params_give_different_data_and_eval_params_leave_train_alone():
    t = build_task("depo1", TINY)
    a = {s: t.instance(s, (0, 0)).tokens for s in ("train", "val", "test")}
    assert not np.array_equal(a["val"], a["test"])
    assert not np.array_equal(t.instance("train", 0, seed=1).tokens, a["train"])
    t2 = build_task("depo1", dict(TINY, eval_k_mode="fixed", eval_k=[2]))
    np.testing.assert_array_equal(t2.instance("train", (7, 2)).tokens, t.instance("train", (7, 2)).tokens)
    t3 = build_task("depo1", dict(TINY, loss_on="all"))  # loss switch: same tokens
    np.testing.assert_array_equal(t3.instance("train", (7, 2)).tokens, t.instance("train", (7, 2)).tokens)
    t4 = build_task("depo1", dict(TINY, K=3))
    assert not np.array_equal(t4.instance("train", (7, 2)).tokens, t.instance("train", (7, 2)).tokens)


def test_same_instance_in_a_fresh_process_with_another_hash_seed():
    code = (
        "from canonlm.data.tasks import build_task;"
        "t=build_task('depo1', dict(N=16, K=4, vocab_V=8, context=256));"
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
    here = str(build_task("depo1", TINY).instance("train", (123, 4)).tokens.tolist())
    assert outs == {here + "\n"}


def test_data_package_imports_no_arch_train_or_lightning():
    code = (
        "import sys, canonlm.data, canonlm.data.tasks, canonlm.data.packing, canonlm.data.stream, "
        "canonlm.data.metrics, canonlm.data.tasks.depo;"
        "bad=[m for m in sys.modules if m.startswith(('canonlm.arch', 'canonlm.train', 'lightning', "
        "'pytorch_lightning'))];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------- config errors
BAD = [
    (dict(N=2), "task.N"),
    (dict(N="16"), "task.N"),
    (dict(K=0), "task.K"),
    (dict(vocab_V=0), "task.vocab_V"),
    (dict(vocab_V=3, min_len=1, max_len=2, N=13), "task.vocab_V"),  # 3 + 9 = 12 names < 13
    (dict(min_len=3, max_len=2), "task.min_len"),
    (dict(vocab_V=50, max_len=8), "task.max_len"),  # 50**8 > 2**40
    (dict(n_queries=0), "task.n_queries"),
    (dict(eos="no"), "task.eos"),
    (dict(loss_on="answer"), "task.loss_on"),
    (dict(vocab="gpt2"), "task.vocab"),
    (dict(tail="keep"), "task.tail"),
    (dict(eval_k_mode="all"), "task.eval_k_mode"),
    (dict(eval_k_mode="fixed"), "task.eval_k"),
    (dict(eval_k_mode="fixed", eval_k=[9]), "task.eval_k"),
    (dict(eval_k=[2]), "task.eval_k"),
    (dict(context=0), "task.context"),
    (dict(seed=-1), "task.seed"),
    (dict(hops=3), "task.hops"),
    (dict(name="depo2"), "task.name"),
    (dict(vocab="official", K=600), "task.K"),
    (dict(vocab="official", vocab_V=4500, max_len=1, N=5), "task.vocab_V"),
]


@pytest.mark.parametrize("cfg,key", BAD)
def test_config_errors_name_key_value_and_allowed(cfg, key):
    with pytest.raises(ConfigError) as e:
        build_task("depo1", cfg)
    assert e.value.key == key
    msg = str(e.value)
    assert key in msg and "allowed" in msg and repr(e.value.value) in msg


def test_unknown_task_name():
    assert {"depo1", "depo2", "brevo1", "brevo2", "capo", "mano", "lano", "fullcopy", "text"} == set(TASKS)
    with pytest.raises(ConfigError, match="task.name"):
        build_task("depo3", {})
    from canonlm.data.tasks.depo import DepoTask

    with pytest.raises(ConfigError, match="task.name"):
        DepoTask("brevo1", {})


def test_accepts_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create(dict(name="depo1", **TINY, eval_k_mode="fixed", eval_k=[1, 4]))
    t = build_task("depo1", node)
    assert t.eval_k == [1, 4]
    parse_and_check(t, t.instance("test", 1), "test")
