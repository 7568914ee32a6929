"""Mano generator (paper App. A.4): instances are parsed back from their tokens with ids derived
from the documented layouts, the prefix expression is re-evaluated with a naive recursive evaluator mod 23 and
compared with the answer token; distributions are compared with the paper's; every config error is checked."""

from __future__ import annotations

import math

import numpy as np
import pytest

from canonlm.data import ConfigError
from canonlm.data.packing import pack_windows
from canonlm.data.seeding import instance_keys, stable_hash64, words
from canonlm.data.tasks import build_task

OPS = ("add", "sub", "mul", "div")


# ---------------------------------------------------------------------------------------------- oracle
def id_map(task) -> dict[int, tuple]:
    """id -> (kind, value, synonym) re-derived from the module docstring layouts (not from the code).

    kinds: ("operand", v), ("op", name), ("bos", None), ("len", l), ("ans", l or None)."""
    L, mod, ka = task.L, task.mod, task.knowledge_augment
    ops = [o for o in OPS if o in task.ops]
    n_ops = len(ops)
    m: dict[int, tuple] = {}
    syns = (0, 1) if ka else (0,)
    if task.vocab == "official":  # the release's ids
        for v in range(mod):
            m[5000 + v] = ("operand", v, 0)
        for s in syns:
            for o in ops:
                m[OPS.index(o) + 1 + 4 * s] = ("op", o, s)
            m[9999 - s] = ("bos", None, s)
            for l in range(1, L + 1):
                m[10 * l + s] = ("len", l, s)
                m[10 * l + 4 + s] = ("ans", l, s)
        return m
    for v in range(mod):
        m[1 + v] = ("operand", v, 0)
    if not ka:
        for k, o in enumerate(ops):
            m[mod + 1 + k] = ("op", o, 0)
        m[mod + n_ops + 1] = ("bos", None, 0)
        m[mod + n_ops + 2] = ("ans", None, 0)
        for l in range(1, L + 1):
            m[mod + n_ops + 2 + l] = ("len", l, 0)
        return m
    for s in (0, 1):
        for k, o in enumerate(ops):
            m[mod + 1 + s * n_ops + k] = ("op", o, s)
    B = mod + 2 * n_ops + 1
    for s in (0, 1):
        m[B + s] = ("bos", None, s)
        for l in range(1, L + 1):
            m[B + 2 + 2 * (l - 1) + s] = ("len", l, s)
            m[B + 2 + 2 * L + 2 * (l - 1) + s] = ("ans", l, s)
    return m


def parse_prefix(toks, p, m):
    """Naive recursive prefix parser: returns (tree, next position). tree = ("leaf", v) | (op, left, right)."""
    kind, val, _ = m[toks[p]]
    if kind == "operand":
        return ("leaf", val), p + 1
    assert kind == "op", f"expected an operand or operator at {p}, got {kind}"
    left, p = parse_prefix(toks, p + 1, m)
    right, p = parse_prefix(toks, p, m)
    return (val, left, right), p


def n_operators(tree) -> int:
    return 0 if tree[0] == "leaf" else 1 + n_operators(tree[1]) + n_operators(tree[2])


def evaluate(tree, mod):
    """Naive recursive evaluator mod ``mod``; division by brute-force search of the inverse (zero divisor fails)."""
    if tree[0] == "leaf":
        return tree[1]
    a, b = evaluate(tree[1], mod), evaluate(tree[2], mod)
    op = tree[0]
    if op == "add":
        return (a + b) % mod
    if op == "sub":
        return (a - b) % mod
    if op == "mul":
        return (a * b) % mod
    assert b != 0, "zero divisor in a generated expression"
    inv = [x for x in range(1, mod) if (b * x) % mod == 1]
    assert len(inv) == 1
    return (a * inv[0]) % mod


def parse_and_check(task, inst, split):
    """Parse an instance, check the layout, the answer (naive evaluation), loss mask, answer ids and groups."""
    m = id_map(task)
    toks = [int(x) for x in inst.tokens]
    assert 0 not in toks and all(t in m for t in toks), "unknown ids"
    syn = [m[t][2] for t in toks]
    assert m[toks[0]][0] == "bos"
    kind, l, _ = m[toks[1]]
    assert kind == "len"
    tree, p = parse_prefix(toks, 2, m)
    assert n_operators(tree) == l, "length token must count the operators"
    assert p == 2 * l + 3
    kind, al, _ = m[toks[p]]
    assert kind == "ans"
    if task.knowledge_augment or task.vocab == "official":
        assert al == l, "answer marker must be length-specific"
    kind, ans, _ = m[toks[p + 1]]
    assert kind == "operand"
    assert len(toks) == p + 2 == 2 * l + 5
    assert ans == evaluate(tree, task.mod)
    if split == "train":
        assert 1 <= l <= task.L
    else:
        assert l == task.L
    n = len(toks)
    exp_loss = np.ones(n, bool)
    if task.loss_on == "answers":
        exp_loss[:] = False
        exp_loss[-2:] = True
    np.testing.assert_array_equal(inst.loss_mask, exp_loss)
    exp_aid = np.full(n, -1)
    exp_aid[-1] = 0
    exp_grp = np.zeros(n, int)
    exp_grp[-1] = l
    np.testing.assert_array_equal(inst.answer_id, exp_aid)
    np.testing.assert_array_equal(inst.group, exp_grp)
    assert inst.meta["ell"] == l and inst.meta["value"] == ans
    if not task.knowledge_augment:
        assert set(syn) == {0}
    return dict(l=l, tree=tree, ans=ans, syn=syn, toks=toks)


def chi2(counts, probs) -> float:
    counts = np.asarray(counts, float)
    exp = counts.sum() * np.asarray(probs, float)
    return float(((counts - exp) ** 2 / exp).sum())


def trees(task, split, n):
    b = task.generate(split, np.arange(n), np.zeros(n, dtype=np.int64))
    m = id_map(task)
    out = []
    for r in range(n):
        toks = b.tokens[b.offsets[r] : b.offsets[r + 1]].tolist()
        out.append(parse_prefix(toks, 2, m)[0])
    return b, out


CONFIGS = [
    dict(L=4),
    dict(L=10),
    dict(L=1),
    dict(L=6, knowledge_augment=True),
    dict(L=5, vocab="official"),
    dict(L=7, vocab="official", knowledge_augment=True, ops=["add", "sub", "mul", "div"]),
    dict(L=6, ops=["div", "mul"], mod=7),
    dict(L=3, ops=["sub"], loss_on="answers"),
    dict(L=70, knowledge_augment=True),  # synonym bits from a second 64-bit word (instances of 145 tokens)
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_instances_parse_and_answers_rederived(cfg, split):
    task = build_task("mano", cfg)
    for w in range(15):
        for i in (0, 5):
            inst = task.instance(split, (w, i))
            parse_and_check(task, inst, split)
            assert len(inst) <= task.max_instance_len(split)
            assert len(inst) >= task.min_instance_len(split)


def test_batched_generation_equals_single_instances_whatever_the_batch():
    task = build_task("mano", dict(L=8, ops=["add", "sub", "mul", "div"], knowledge_augment=True))
    w = np.array([5, 0, 5, 9, 2**40, 3])
    i = np.array([1, 0, 0, 7, 3, 100])
    for split in ("train", "test"):
        b = task.generate(split, w, i)
        b2 = task.generate(split, w[::-1], i[::-1])
        for r in range(len(w)):
            one = task.instance(split, (int(w[r]), int(i[r])))
            s, e = b.offsets[r], b.offsets[r + 1]
            np.testing.assert_array_equal(b.tokens[s:e], one.tokens)
            r2 = len(w) - 1 - r
            np.testing.assert_array_equal(b2.tokens[b2.offsets[r2] : b2.offsets[r2 + 1]], one.tokens)
            assert b.meta["value"][r] == one.meta["value"]


def test_estimate_lengths_are_exact_and_length_formula():
    task = build_task("mano", dict(L=13))
    w, i = np.arange(500), np.arange(500) % 7
    b = task.generate("train", w, i)
    np.testing.assert_array_equal(task.estimate_lengths("train", w, i), b.lengths)
    np.testing.assert_array_equal(b.lengths, 2 * b.meta["ell"] + 5)
    assert task.max_instance_len("train") == task.max_instance_len("test") == 31
    assert task.min_instance_len("train") == 7 and task.min_instance_len("val") == 31
    # mean training length 2 * (L+1)/2 + 5 = L + 6 (paper App. A.4: 16/19/22 for L = 10/13/16)
    assert abs(b.lengths.mean() - 19) < 0.6


# ---------------------------------------------------------------------------------------------- distributions
def test_ell_uniform_in_train_and_L_in_eval():
    task = build_task("mano", dict(L=6))
    ell = task.generate("train", np.arange(12000), np.zeros(12000, dtype=np.int64)).meta["ell"]
    counts = np.bincount(ell, minlength=7)
    assert counts[0] == 0
    assert chi2(counts[1:], np.full(6, 1 / 6)) < 25  # df 5
    for split in ("val", "test"):
        assert set(task.generate(split, np.arange(300), np.zeros(300, dtype=np.int64)).meta["ell"]) == {6}


def test_tree_structure_operator_split_and_leaf_distributions():
    """At l = L (val): root operator uniform over ops (1/3 each), root left size l1 uniform on 0..L-1 (paper
    App. A.4), leaves uniform on 0..22, every operator uniform."""
    L = 5
    task = build_task("mano", dict(L=L))
    _, ts = trees(task, "val", 6000)
    root_ops = [t[0] for t in ts]
    assert chi2([root_ops.count(o) for o in ("add", "sub", "mul")], [1 / 3] * 3) < 20
    left = np.array([n_operators(t[1]) for t in ts])
    assert chi2(np.bincount(left, minlength=L), np.full(L, 1 / L)) < 25
    leaves, ops = [], []

    def walk(t):
        if t[0] == "leaf":
            leaves.append(t[1])
        else:
            ops.append(t[0])
            walk(t[1])
            walk(t[2])

    for t in ts[:2000]:
        walk(t)
    assert chi2(np.bincount(leaves, minlength=23), np.full(23, 1 / 23)) < 60  # df 22
    assert chi2([ops.count(o) for o in ("add", "sub", "mul")], [1 / 3] * 3) < 20
    # second level: for a root with left size l1 = 2, that child's left size is uniform on {0, 1}
    sub = [n_operators(t[1][1]) for t in ts if n_operators(t[1]) == 2]
    assert abs(np.mean(sub) - 0.5) < 4.5 * 0.5 / math.sqrt(len(sub))


def test_answer_values_spread_over_all_residues():
    task = build_task("mano", dict(L=10))
    v = task.generate("test", np.arange(5000), np.zeros(5000, dtype=np.int64)).meta["value"]
    c = np.bincount(v, minlength=23)
    assert c.shape[0] == 23 and c.min() > 0
    assert c.max() / c.sum() < 0.2  # mostly near uniform (products make 0 a bit likelier)


def test_knowledge_augment_synonyms_are_coin_flips_with_same_semantics():
    plain = build_task("mano", dict(L=6))
    ka = build_task("mano", dict(L=6, knowledge_augment=True))
    m_plain, m_ka = id_map(plain), id_map(ka)
    n = 3000
    a = plain.generate("train", np.arange(n), np.zeros(n, dtype=np.int64))
    b = ka.generate("train", np.arange(n), np.zeros(n, dtype=np.int64))
    np.testing.assert_array_equal(a.offsets, b.offsets)
    by_kind: dict[str, list[int]] = {"bos": [], "len": [], "ans": [], "op": []}
    for r in range(n):
        ta = a.tokens[a.offsets[r] : a.offsets[r + 1]].tolist()
        tb = b.tokens[b.offsets[r] : b.offsets[r + 1]].tolist()
        for x, y in zip(ta, tb):
            ka_kind, ka_val, s = m_ka[y]
            p_kind, p_val, _ = m_plain[x]
            assert ka_kind == p_kind
            if ka_kind != "ans":  # the plain <ans> is not length-specific
                assert ka_val == p_val, "synonyms must carry the same meaning as the plain stream's tokens"
            if ka_kind in by_kind:
                by_kind[ka_kind].append(s)
    for kind, s in by_kind.items():
        s = np.asarray(s)
        z = (s.mean() - 0.5) / (0.5 / math.sqrt(s.size))
        assert abs(z) < 4.5, (kind, s.mean())
    # every synonym id of the layout occurs
    assert set(np.unique(b.tokens)) >= {t for t, (k, v, s) in m_ka.items() if k in ("bos", "op")}


def test_official_ids_relabel_the_compact_stream():
    for ka in (False, True):
        c = build_task("mano", dict(L=5, knowledge_augment=ka, ops=["add", "sub", "mul", "div"]))
        o = build_task("mano", dict(L=5, knowledge_augment=ka, ops=["add", "sub", "mul", "div"], vocab="official"))
        assert o.vocab_size == 10000
        mc, mo = id_map(c), id_map(o)
        x = c.generate("train", np.arange(200), np.ones(200, dtype=np.int64))
        y = o.generate("train", np.arange(200), np.ones(200, dtype=np.int64))
        np.testing.assert_array_equal(x.offsets, y.offsets)
        ell = np.repeat(x.meta["ell"], x.lengths)
        for t, u, l in zip(x.tokens.tolist(), y.tokens.tolist(), ell.tolist()):
            kc, vc, sc = mc[t]
            ko, vo, so = mo[u]
            assert (kc, sc) == (ko, so)
            assert vc == vo or (kc == "ans" and vc is None and vo == l)
    # a few literal ids of the official `mano.py`
    o = build_task("mano", dict(L=16, vocab="official", knowledge_augment=True, ops=["add", "sub", "mul", "div"]))
    names = o.token_names()
    assert (names[9999], names[9998], names[160], names[161], names[164], names[165]) == (
        "<bos>",
        "<bos'>",
        "<len_16>",
        "<len_16'>",
        "<ans_16>",
        "<ans_16'>",
    )
    assert (names[1], names[5], names[2], names[6], names[3], names[7], names[4], names[8]) == (
        "+",
        "+'",
        "-",
        "-'",
        "*",
        "*'",
        "/",
        "/'",
    )
    assert names[5000] == "0" and names[5022] == "22"
    plain = build_task("mano", dict(L=16, vocab="official"))
    toks = plain.generate("test", np.arange(50), np.zeros(50, dtype=np.int64)).tokens
    assert set(np.unique(toks)) <= {1, 2, 3, 9999, 160, 164} | set(range(5000, 5023))


def test_div_mode_uses_modular_inverse_and_never_a_zero_divisor():
    task = build_task("mano", dict(L=8, ops=["add", "sub", "mul", "div"]))
    b, ts = trees(task, "train", 4000)
    ops, divisors = [], []

    def walk(t):
        if t[0] != "leaf":
            ops.append(t[0])
            if t[0] == "div":
                divisors.append(evaluate(t[2], 23))
            walk(t[1])
            walk(t[2])

    for t, ans in zip(ts, b.meta["value"].tolist()):
        walk(t)
        assert evaluate(t, 23) == ans  # the oracle asserts every divisor is non-zero
    assert 0 not in divisors
    assert chi2([ops.count(o) for o in OPS], [1 / 4] * 4) < 25  # accepted expressions: div slightly rarer
    assert b.meta["attempts"].max() > 1, "some expressions must have been redrawn"
    # l stays uniform although long expressions are redrawn more often
    assert chi2(np.bincount(b.meta["ell"], minlength=9)[1:], np.full(8, 1 / 8)) < 30


# ---------------------------------------------------------------------------------------------- documented scheme
def naive_generate(task, split, w, i, seed=0):
    """Pure-Python re-derivation of one instance from the documented counter scheme (module docstring):
    returns (l, prefix list of ("op", name) | ("leaf", v), synonym bits of the sequence positions, attempts)."""
    gen = dict(L=task.L, ops=list(task.ops), mod=task.mod)
    ns = stable_hash64("canonlm.data", "mano", gen, split, seed)
    key = instance_keys(ns, np.array([w]), np.array([i]))
    wd = lambda p, j: int(words(key, p, np.array([j]))[0])
    l = 1 + wd(0, 0) % task.L if split == "train" else task.L
    n_ops = len(task.ops)
    att = 0
    while True:
        stack, prefix = [l], []
        for p in range(2 * l + 1):
            s = stack.pop()
            x = wd(2 + att, p)
            if s > 0:
                l1 = (x // n_ops) % s
                prefix.append(("op", task.ops[x % n_ops]))
                stack += [s - 1 - l1, l1]
            else:
                prefix.append(("leaf", x % task.mod))
        tree, _ = _tree_from(prefix, 0)
        try:
            evaluate(tree, task.mod)
            break
        except AssertionError:
            att += 1
    bits = [(wd(1, t // 64) >> (t % 64)) & 1 for t in range(2 * l + 5)]
    return l, prefix, bits, att + 1


def _tree_from(prefix, p):
    kind, v = prefix[p]
    if kind == "leaf":
        return ("leaf", v), p + 1
    left, p = _tree_from(prefix, p + 1)
    right, p = _tree_from(prefix, p)
    return (v, left, right), p


@pytest.mark.parametrize("cfg", [dict(L=6, knowledge_augment=True), dict(L=9, ops=["add", "sub", "mul", "div"], mod=5)])
def test_numba_kernel_follows_the_documented_counter_scheme(cfg):
    task = build_task("mano", cfg)
    m = id_map(task)
    seen_retry = False
    for split in ("train", "test"):
        for w in range(40):
            inst = task.instance(split, (w, 3))
            l, prefix, bits, att = naive_generate(task, split, w, 3)
            seen_retry |= att > 1
            toks = inst.tokens.tolist()
            assert inst.meta["ell"] == l and inst.meta["attempts"] == att
            got = [("op", m[t][1]) if m[t][0] == "op" else ("leaf", m[t][1]) for t in toks[2 : 2 * l + 3]]
            assert got == prefix
            if task.knowledge_augment:
                sb = [m[t][2] for t in toks]
                for t in [0, 1, 2 * l + 3] + [2 + p for p, x in enumerate(prefix) if x[0] == "op"]:
                    assert sb[t] == bits[t]
    if "div" in task.ops:
        assert seen_retry  # mod 5: zero divisors are frequent


# ---------------------------------------------------------------------------------------------- vocab, packing
def test_vocab_layout_token_names_and_decode():
    t = build_task("mano", dict(L=4))
    names = t.token_names()
    assert len(names) == t.vocab_size == 23 + 3 + 4 + 3
    assert names[0] == "<pad>" and t.pad_id == 0 and names[1] == "0" and names[23] == "22"
    assert names[24:27] == ["+", "-", "*"] and names[27] == "<bos>" and names[28] == "<ans>"
    assert names[29:33] == ["<len_1>", "<len_2>", "<len_3>", "<len_4>"]
    assert t.bos_id == 27 and t.ans_id == 28 and t.len_id(2) == 30 and t.operand_id(5) == 6 and t.op_id("mul") == 26
    assert t.num_groups == 5 and t.group_name == "l" and t.chance == pytest.approx(1 / 23)
    assert t.decode([27, 30, 24, 5, 26, 6, 7, 28, 12]) == "<bos> <len_2> + 4 * 5 6 <ans> 11"
    assert t.decode([99]) == "<unk_99>"
    ka = build_task("mano", dict(L=4, knowledge_augment=True, ops=["add", "sub", "mul", "div"]))
    assert ka.vocab_size == 23 + 2 * 4 + 4 * 4 + 3 and ka.ans_id is None
    for task in (t, ka, build_task("mano", dict(L=3, vocab="official", knowledge_augment=True))):
        nm = task.token_names()
        assert len(nm) == task.vocab_size and all(isinstance(s, str) and s.isprintable() and s for s in nm)
        txt = task.decode(task.instance("train", 4).tokens)
        assert txt.isprintable() and txt.startswith("<bos")
    with pytest.raises(ValueError, match="l=5"):
        t.len_id(5)
    with pytest.raises(ValueError, match="div"):
        t.op_id("div")


def test_packed_windows_score_the_answer_token_with_group_l():
    task = build_task("mano", dict(L=6, context=128))
    out = pack_windows(task, "val", np.arange(4), 128, seed=0)
    m = id_map(task)
    for r in range(4):
        toks = out["tokens"][r].tolist()
        aid, grp, loss = out["answer_id"][r], out["group"][r], out["loss_mask"][r]
        assert not loss[0] and loss[1:].all()  # loss on every token (paper); packing never targets position 0
        scored = np.flatnonzero(aid >= 0)
        n_complete = len(toks) // 17  # val instances: 2*6+5 = 17 tokens
        assert len(scored) == n_complete
        for q, pos in enumerate(scored):
            assert aid[pos] == q and grp[pos] == 6
            assert m[toks[pos - 1]][0] == "ans" and m[toks[pos]][0] == "operand"
            inst = toks[pos - 16 : pos + 1]
            tree, _ = parse_prefix(inst, 2, m)
            assert evaluate(tree, 23) == m[toks[pos]][1]
        assert (grp[aid < 0] == 0).all()
    tr = pack_windows(task, "train", np.arange(3), 128, seed=0)
    g = tr["group"][tr["answer_id"] >= 0]
    assert g.min() >= 1 and g.max() <= 6


def test_splits_seeds_and_switches():
    t = build_task("mano", dict(L=5))
    a = {s: t.generate(s, np.arange(20), np.zeros(20, dtype=np.int64)).tokens for s in ("train", "val", "test")}
    assert not np.array_equal(a["val"], a["test"])
    assert not np.array_equal(
        t.generate("train", np.arange(20), np.zeros(20, dtype=np.int64), seed=1).tokens, a["train"]
    )
    # loss_on and the op order in the config do not change the problems; L and mod do
    same = build_task("mano", dict(L=5, loss_on="answers", ops=["mul", "add", "sub"]))
    np.testing.assert_array_equal(
        same.generate("train", np.arange(20), np.zeros(20, dtype=np.int64)).tokens, a["train"]
    )
    assert same.cfg["ops"] == ["add", "sub", "mul"]
    for other in (dict(L=6), dict(L=5, mod=29)):
        o = build_task("mano", other)
        assert not np.array_equal(
            o.generate("val", np.arange(20), np.zeros(20, dtype=np.int64)).tokens[:40], a["val"][:40]
        )


def test_accepts_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create(dict(name="mano", L=4, ops=["add", "div"], mod=11, context=64))
    t = build_task("mano", node)
    assert t.ops == ("add", "div")
    parse_and_check(t, t.instance("test", 2), "test")


# ---------------------------------------------------------------------------------------------- config errors
BAD = [
    (dict(L=0), "task.L"),
    (dict(L=-3), "task.L"),
    (dict(L="10"), "task.L"),
    (dict(L=True), "task.L"),
    (dict(mod=1), "task.mod"),
    (dict(mod=22, ops=["add", "div"]), "task.mod"),
    (dict(ops=[]), "task.ops"),
    (dict(ops="add"), "task.ops"),
    (dict(ops=["add", "pow"]), "task.ops"),
    (dict(ops=["add", "add"]), "task.ops"),
    (dict(knowledge_augment="yes"), "task.knowledge_augment"),
    (dict(loss_on="answer"), "task.loss_on"),
    (dict(vocab="gpt2"), "task.vocab"),
    (dict(tail="keep"), "task.tail"),
    (dict(context=0), "task.context"),
    (dict(seed=-1), "task.seed"),
    (dict(depth=3), "task.depth"),
    (dict(name="depo1"), "task.name"),
    (dict(vocab="official", L=500), "task.L"),  # 10*500 = 5000 = operand 0
    (dict(vocab="official", L=1000, mod=5), "task.L"),  # 10*1000 >= 10000
    (dict(vocab="official", mod=4999, knowledge_augment=True), "task.mod"),  # operand 9998 = <bos'>
    (dict(vocab="official", mod=5000), "task.mod"),  # operand 9999 = <bos>
    (dict(ops=["add", "sub", "mul", "div"], L=5000), "task.L"),  # e^54 expected redraws
]


@pytest.mark.parametrize("cfg,key", BAD)
def test_config_errors_name_key_value_and_allowed(cfg, key):
    with pytest.raises(ConfigError) as e:
        build_task("mano", cfg)
    assert e.value.key == key
    msg = str(e.value)
    assert key in msg and "allowed" in msg and repr(e.value.value) in msg


def test_largest_official_L_and_large_compact_L_are_accepted():
    assert build_task("mano", dict(vocab="official", L=499)).vocab_size == 10000
    assert build_task("mano", dict(vocab="official", mod=4999)).operand_id(4998) == 9998  # <bos'> unused
    assert build_task("mano", dict(L=600)).vocab_size == 23 + 3 + 600 + 3
