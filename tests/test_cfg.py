"""Lano grammars (paper App. A.5): JSON format, family generator, sampler, recogniser, exact next-symbol
law and KL. Oracles: brute-force enumeration of every rule combination of small grammars (string -> probability),
plain-loop structure checks, the paper's formulas and measured facts."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict

import numpy as np
import pytest

from canonlm.data.cfg import (
    PRESETS,
    Grammar,
    check,
    check_ragged,
    lano_kl,
    load_grammar,
    next_symbol_probs,
    preset_grammar,
    random_grammar,
    sample_sentences,
    save_grammar,
)
from canonlm.data.seeding import instance_keys
from canonlm.errors import ConfigError
from conftest import SHARED

LANO_DIR = SHARED / "lano"
OFFICIAL = ["cfg3b", "cfg3e1", "cfg3e2", "cfg3f", "cfg3g", "cfg3h", "cfg3i", "cfg3j", "cfg3k"]
needs_official = pytest.mark.skipif(not LANO_DIR.exists(), reason="official grammar files not available")


# ---------------------------------------------------------------------------------------------- oracles
def string_law(g: Grammar) -> dict:
    """Exact law of the sentences: expand every rule combination bottom-up (dict string-tuple -> probability)."""
    law = [{(a + 1,): 1.0} for a in range(g.num_terminals)]
    for lv in range(len(g.rules) - 1, -1, -1):
        new = []
        for sym in g.rules[lv]:
            d = defaultdict(float)
            for rule in sym:
                cur = {(): 1.0}
                for c in rule:
                    nxt = defaultdict(float)
                    for s1, p1 in cur.items():
                        for s2, p2 in law[c].items():
                            nxt[s1 + s2] += p1 * p2
                    cur = nxt
                for s, p in cur.items():
                    d[s] += p / len(sym)
            new.append(dict(d))
        law = new
    return law[0]


def keys_of(n, ns=11):
    return instance_keys(ns, np.arange(n), np.zeros(n, dtype=np.int64))


def small_grammars():
    """Small random grammars (len-1 rules included) whose languages can be enumerated."""
    out = [
        random_grammar(s, depth=3, num_sym=2, num_terminals=2, deg_min=1, deg_max=2, len_min=1, len_max=3)
        for s in range(3)
    ]
    out.append(random_grammar(7, depth=3, num_sym=[2, 2], num_terminals=3, deg_min=2, deg_max=2, len_min=1, len_max=2))
    out.append(random_grammar(5, depth=2, num_sym=3, num_terminals=2, deg_min=2, deg_max=3, len_min=2, len_max=3))
    return out


# ---------------------------------------------------------------------------------------------- grammar / JSON
def test_random_grammar_family_constraints_and_determinism():
    for name in ("cfg3f", "cfg3k", "cfg3e2", "cfg3b", "tiny"):
        fam = PRESETS[name]
        g = preset_grammar(name, seed=3)
        assert g.depth == fam["depth"]
        nts = [fam["num_sym"]] * (fam["depth"] - 1) if isinstance(fam["num_sym"], int) else fam["num_sym"]
        assert list(g.sizes) == [1] + list(nts) + [fam["num_terminals"]]
        for lv, syms in enumerate(g.rules):
            used = set()
            for sym in syms:
                assert fam["deg_min"] <= len(sym) <= fam["deg_max"]
                assert len(set(sym)) == len(sym), "duplicate rule"
                for r in sym:
                    assert fam["len_min"] <= len(r) <= fam["len_max"]
                    assert all(0 <= c < g.sizes[lv + 1] for c in r)
                    if fam.get("distinct_children"):
                        assert len(set(r)) == len(r)
                    used.update(r)
            assert used == set(range(g.sizes[lv + 1])), f"{name}: level {lv + 1} symbol unused"
        assert preset_grammar(name, seed=3).rules == g.rules
    assert preset_grammar("cfg3f", seed=0).rules != preset_grammar("cfg3f", seed=1).rules


def test_save_load_roundtrip(tmp_path):
    g = preset_grammar("cfg3k", seed=2)
    p = tmp_path / "g.json"
    save_grammar(g, p)
    d = json.loads(p.read_text())
    # the official layout (``Lano-cfg/configs/*.json``)
    assert d["depth"] == 7 and d["sizes"] == [1, 3, 3, 3, 3, 3, 3, 3] and d["eos_token"] == 4
    assert [n["children"] for n in d["all"][-1]] == [None] * 3
    assert [n["id"] for n in d["all"][-1]] == [1, 2, 3]
    assert d["idx"] == [[n["id"] for n in lv] for lv in d["all"]]
    h = load_grammar(p)
    assert h.rules == g.rules and h.ids == g.ids and h.names == g.names
    assert not list(tmp_path.glob("*.tmp"))


@needs_official
def test_official_files_load_and_resave_identically(tmp_path):
    for name in OFFICIAL:
        src = json.loads((LANO_DIR / f"{name}.json").read_text())
        g = load_grammar(LANO_DIR / f"{name}.json")
        assert g.depth == src["depth"] and list(g.sizes) == src["sizes"]
        # rules exactly as in the file
        for lv, nodes in enumerate(src["all"][:-1]):
            assert [list(map(list, s)) for s in g.rules[lv]] == [n["children"] for n in nodes]
        save_grammar(g, tmp_path / f"{name}.json")
        out = json.loads((tmp_path / f"{name}.json").read_text())
        for k, v in src.items():
            assert out[k] == v, (name, k)
    # rule totals of the official grammar files
    assert [load_grammar(LANO_DIR / f"{n}.json").num_rules for n in ("cfg3f", "cfg3j", "cfg3k")] == [54, 57, 68]


def _valid_dict():
    return preset_grammar("tiny", seed=0).to_dict()


def _bad_variants():
    out = []

    def mod(fn, label):
        d = _valid_dict()
        fn(d)
        out.append((label, d))

    mod(lambda d: d.pop("all"), "no all")
    mod(lambda d: d["all"][0].append(dict(d["all"][0][0], id=999)), "two roots")
    mod(lambda d: d["all"][1][0]["children"][0].append(7), "child out of range")
    mod(lambda d: d["all"][1][0]["children"][0].__setitem__(0, -1), "negative child")
    mod(lambda d: d["all"][-1][0].__setitem__("children", [[0]]), "terminal with children")
    mod(lambda d: d["all"][2][1].__setitem__("children", None), "non-terminal without rules")
    mod(lambda d: d["all"][2][1].__setitem__("children", [[]]), "empty rule")
    mod(lambda d: d["all"][2][1].__setitem__("children", [["a"]]), "non-int child")
    mod(lambda d: d["all"][2][1].__setitem__("id", d["all"][2][0]["id"]), "duplicate id")
    mod(lambda d: d["all"][-1][0].__setitem__("id", 9), "terminal id")
    mod(lambda d: d["all"][1][0].__setitem__("id", 2), "non-terminal uses a terminal id")
    mod(lambda d: d.__setitem__("depth", 5), "header depth")
    mod(lambda d: d.__setitem__("sizes", [1, 3, 3, 3, 4]), "header sizes")
    mod(lambda d: d.__setitem__("len_max", 2), "rule longer than len_max")
    mod(lambda d: d.__setitem__("deg_min", 4), "fewer rules than deg_min")
    mod(lambda d: d.__setitem__("eos_token", 9), "eos token")
    mod(lambda d: d["all"][1][0].__setitem__("depth", 3), "node depth")
    mod(lambda d: d.__setitem__("all", [d["all"][0]]), "single level")
    return out


def test_invalid_grammar_files_raise_config_error(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(_valid_dict()))
    load_grammar(p)  # the unmodified file is valid
    cases = [("missing", tmp_path / "missing.json")]
    (tmp_path / "bad.json").write_text("{not json")
    cases.append(("bad json", tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    cases.append(("not an object", tmp_path / "list.json"))
    for i, (label, d) in enumerate(_bad_variants()):
        f = tmp_path / f"v{i}.json"
        f.write_text(json.dumps(d))
        cases.append((label, f))
    for label, f in cases:
        with pytest.raises(ConfigError) as e:
            load_grammar(f)
        assert e.value.key == "task.grammar_file" and str(f) in str(e.value), label


def test_lengths_match_enumeration():
    for g in small_grammars():
        law = string_law(g)
        lens = [len(s) for s in law]
        assert g.sentence_min_len == min(lens) and g.sentence_max_len == max(lens)
        dist = np.zeros(g.sentence_max_len + 1)
        for s, p in law.items():
            dist[len(s)] += p
        np.testing.assert_allclose(g.length_distribution(), dist, atol=1e-14)


# ---------------------------------------------------------------------------------------------- sampler
def test_sampler_matches_exact_law_and_is_counter_based():
    g = random_grammar(4, depth=2, num_sym=2, num_terminals=2, deg_min=2, deg_max=3, len_min=1, len_max=3)
    law = string_law(g)
    N = 40_000
    tok, off, att = sample_sentences(g, keys_of(N))
    assert att.sum() == 0
    emp = defaultdict(float)
    for r in range(N):
        emp[tuple(tok[off[r] : off[r + 1]].tolist())] += 1 / N
    assert set(emp) <= set(law)
    tv = 0.5 * sum(abs(emp.get(s, 0.0) - p) for s, p in law.items())
    assert tv < 0.03 + 0.5 * math.sqrt(len(law) / N), tv
    # instance r depends only on its key
    t2, o2, _ = sample_sentences(g, keys_of(N)[[5, 17]])
    assert np.array_equal(t2[o2[1] : o2[2]], tok[off[17] : off[18]])
    # <bos> prefix layout
    t3, o3, _ = sample_sentences(g, keys_of(3), prefix_bos=True)
    for r in range(3):
        assert t3[o3[r]] == g.bos_id and np.array_equal(t3[o3[r] + 1 : o3[r + 1]], tok[off[r] : off[r + 1]])


def test_sampler_cap_rejects_only_long_sentences():
    g = preset_grammar("tiny", seed=1)
    keys = keys_of(3000)
    tok, off, att = sample_sentences(g, keys)
    L = np.diff(off)
    cap = int(np.median(L))
    tc, oc, ac = sample_sentences(g, keys, max_len=cap)
    Lc = np.diff(oc)
    assert Lc.max() <= cap
    short = L <= cap
    assert (ac[short] == 0).all() and (ac[~short] >= 1).all()
    for r in np.nonzero(short)[0][:200]:
        assert np.array_equal(tok[off[r] : off[r + 1]], tc[oc[r] : oc[r + 1]])
    with pytest.raises(ValueError):
        sample_sentences(g, keys, max_len=g.sentence_min_len - 1)


# ---------------------------------------------------------------------------------------------- recogniser
def test_recogniser_exhaustive_against_enumerated_language():
    for g in small_grammars():
        lang = set(string_law(g))
        T = g.num_terminals
        bound = 12 if T == 2 else 8
        strings = [s for n in range(0, bound + 1) for s in itertools.product(range(1, T + 1), repeat=n)]
        got = check(g, [list(s) for s in strings])
        want = np.array([s in lang for s in strings])
        assert np.array_equal(got, want), g
        # every member (also the long ones) is accepted
        assert check(g, [list(s) for s in lang]).all()


def test_recogniser_mutations_small_grammars_follow_membership():
    for g in small_grammars():
        lang = set(string_law(g))
        tok, off, _ = sample_sentences(g, keys_of(60, ns=3))
        rng_words = instance_keys(99, np.arange(60), np.ones(60, dtype=np.int64))
        muts = []
        for r in range(60):
            s = tok[off[r] : off[r + 1]].tolist()
            w = int(rng_words[r])
            p = w % len(s)
            a = 1 + (w >> 20) % g.num_terminals
            muts += [s[:p] + [1 + s[p] % g.num_terminals] + s[p + 1 :], s[:p] + [a] + s[p:], s[:p] + s[p + 1 :]]
        got = check(g, muts)
        want = np.array([tuple(m) in lang for m in muts])
        assert np.array_equal(got, want)
        assert check(g, [tok[off[r] : off[r + 1]] for r in range(60)]).all()


def _mutation_acceptance(g, n=100):
    tok, off, _ = sample_sentences(g, keys_of(n, ns=5), max_len=511)
    sents = [tok[off[r] : off[r + 1]] for r in range(n)]
    assert check(g, sents).all()
    assert check_ragged(g, tok, off).all()  # ragged form
    flipped, inserted, deleted = [], [], []
    for r, s in enumerate(sents):
        p = (r * 7919) % len(s)
        f = s.copy()
        f[p] = 1 + f[p] % 3
        flipped.append(f)
        inserted.append(np.insert(s, p, 1 + r % 3))
        deleted.append(np.delete(s, p))
    return sents, [float(check(g, m).mean()) for m in (flipped, inserted, deleted)]


def test_recogniser_big_grammar_and_bad_tokens():
    # generated grammars of one family differ in local ambiguity (seed 2 of cfg3f is close to the official file)
    g = preset_grammar("cfg3f", seed=2)
    sents, acc = _mutation_acceptance(g)
    assert max(acc) < 0.3, acc
    s = sents[0]
    assert not check(g, [np.zeros(0, np.int64), np.concatenate([s, [g.bos_id]]), np.where(s == 1, 0, s)]).any()


@needs_official
def test_official_grammars_sampled_accepted_mutations_rejected():
    for name in ("cfg3f", "cfg3j", "cfg3k"):
        _, acc = _mutation_acceptance(load_grammar(LANO_DIR / f"{name}.json"), n=60)
        assert max(acc) < 0.3, (name, acc)


@needs_official
def test_official_cfg3f_sentence_lengths_match_spec():
    # measured on the official cfg3f: min / median / mean / max = 114 / 249 / 251 / 482 tokens
    g = load_grammar(LANO_DIR / "cfg3f.json")
    tok, off, att = sample_sentences(g, keys_of(20000, ns=21))
    L = np.diff(off)
    assert att.sum() == 0 and check_ragged(g, tok, off[:201]).all()
    assert 235 <= np.median(L) <= 263 and 240 <= L.mean() <= 262
    assert 64 <= L.min() <= 140 and 400 <= L.max() <= 729
    law = g.length_distribution()
    assert abs(float((law * np.arange(law.size)).sum()) - 251) < 3


# ---------------------------------------------------------------------------------------------- exact next-symbol law
def test_next_symbol_law_matches_enumeration():
    for g in small_grammars()[:4]:
        law = string_law(g)
        pref = defaultdict(float)
        for s, p in law.items():
            for t in range(len(s) + 1):
                pref[s[:t]] += p
        T = g.num_terminals
        items = sorted(law.items(), key=lambda kv: -kv[1])[:150]
        for method in ("scaled", "log"):
            for s, _ in items:
                P = next_symbol_probs(g, list(s), method=method)
                assert P.shape == (len(s) + 1, T + 1)
                for t in range(len(s) + 1):
                    z = pref[s[:t]]
                    want = [law.get(s[:t], 0.0) / z] + [pref.get(s[:t] + (c,), 0.0) / z for c in range(1, T + 1)]
                    np.testing.assert_allclose(P[t], want, rtol=0, atol=1e-12)
        # an impossible prefix gives NaN rows from there on
        bad = next(s for n in range(1, 9) for s in itertools.product(range(1, T + 1), repeat=n) if s not in pref)
        P = next_symbol_probs(g, list(bad))
        assert np.isnan(P[-1]).all() and not np.isnan(P[0]).any()


def test_next_symbol_law_big_grammars_consistent():
    g = preset_grammar("cfg3k", seed=0)
    tok, off, _ = sample_sentences(g, keys_of(3, ns=8), max_len=1535)
    for r in range(3):
        s = tok[off[r] : off[r + 1]]
        P = next_symbol_probs(g, s)
        np.testing.assert_allclose(P.sum(1), 1.0, atol=1e-12)
        assert (P[np.arange(len(s)), s] > 0).all() and P[-1, 0] > 0 and (P[:-1, 0] >= 0).all()
        np.testing.assert_allclose(next_symbol_probs(g, s, method="log"), P, atol=1e-10)
    # the first row is the law of the first token: compare with sampled frequencies
    tok, off, _ = sample_sentences(g, keys_of(20000, ns=9))
    first = np.bincount(tok[off[:-1]], minlength=4)[1:] / 20000
    np.testing.assert_allclose(P[0, 1:], first, atol=0.015)
    with pytest.raises(ValueError):
        next_symbol_probs(g, [1, 2, 4])


def test_next_symbol_law_falls_back_to_log_space():
    g = small_grammars()[0]
    s = max(string_law(g), key=len)
    want = next_symbol_probs(g, list(s), method="log")
    object.__setattr__(g, "_alpha_cache", 700.0)  # a per-token scale that overflows float64 at once
    with pytest.raises(ValueError):
        next_symbol_probs(g, list(s), method="scaled")
    np.testing.assert_allclose(next_symbol_probs(g, list(s)), want, atol=1e-13)


# ---------------------------------------------------------------------------------------------- KL
def test_lano_kl_formulas():
    eps = 1e-5
    p = np.array([[1.0, 0.0]])
    lp = np.log(np.array([[0.1, 0.3, 0.6]]))  # ids 0 (other), 1, 2
    ids = [2, 1]
    ren = lano_kl(p, lp, ids, "renormalize")
    assert ren == pytest.approx(
        math.log((1 + eps) / (1 + 2 * eps)) - math.log((2 / 3 + eps) / (1 + 2 * eps)), rel=1e-12
    )
    raw = lano_kl(p, lp, ids, "raw")
    assert raw == pytest.approx(
        math.log((1 + eps) / (1 + 2 * eps)) - math.log((0.6 + eps) / (0.9 + 2 * eps)), rel=1e-12
    )
    ps = np.array([1 + eps, eps]) / (1 + 2 * eps)
    qs = np.array([2 / 3 + eps, 1 / 3 + eps]) / (1 + 2 * eps)
    assert lano_kl(p, lp, ids, weight="smoothed") == pytest.approx(float((ps * np.log(ps / qs)).sum()), rel=1e-12)
    # identical laws: zero; mean over positions
    pst = np.array([[0.2, 0.8], [0.5, 0.5]])
    # ids: 0 = another token, 1 -> column 1, 2 -> column 0
    same = np.log(np.concatenate([np.full((2, 1), 1e-30), pst[:, ::-1]], axis=1))
    assert abs(lano_kl(pst, same, ids)) < 1e-12
    two = np.log(np.array([[0.0 + 1e-300, 0.5, 0.5], [1e-300, 0.9, 0.1]]))
    k0 = lano_kl(pst[:1], two[:1], ids)
    k1 = lano_kl(pst[1:], two[1:], ids)
    assert lano_kl(pst, two, ids) == pytest.approx((k0 + k1) / 2, rel=1e-12)
    with pytest.raises(ValueError):
        lano_kl(p, lp, ids, "bogus")
