"""Capo / bioS(N) (Part 4.1 App. A.3; Part 3.3).

Oracles: the asset files read directly; a text parser that splits a biography into sentences and matches each one
against the template pools with the person's facts (from the population record); the tokenizer itself
(``tokenizer.encode`` of the whole text, ``tokenizer.decode`` of spans); naive name counting in the concatenated
stream; the bits formula of Part 3.3 Def. 4.3 computed by hand."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from canonlm.data import ConfigError
from canonlm.data.tasks import build_task

ASSETS = Path(__file__).resolve().parents[1] / "src" / "canonlm" / "data" / "tasks" / "capo_assets"
OFFICIAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "physicslm4" / "capo_fields"
ATTRS = ("birth_date", "birth_city", "university", "major", "employer", "work_city")
GROUP_ATTR = {2: "birth_date", 3: "birth_city", 4: "university", 5: "major", 6: "employer"}


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("capo_cache"))


@pytest.fixture(scope="session")
def small(cache):
    """Tiny BPE (512), 200 people, context 256."""
    return dict(N=200, context=256, bpe_vocab_size=512, bpe_train_bios=2000, cache_dir=cache, exposures=3)


@pytest.fixture(scope="session")
def task(small):
    return build_task("capo", small)


def lines(name):
    return [ln for ln in (ASSETS / name).read_text().split("\n") if ln]


TEMPLATES = {a: v for a, v in json.loads((ASSETS / "templates.json").read_text()).items() if a in ATTRS}


# ---------------------------------------------------------------------------------------------- oracle parser
def parse_bio(text, pools):
    """Split a biography into sentences; match each against every template of every attribute.

    Returns (subject of sentence 1, [(attribute, template index, value, subject)] in sentence order). Values never
    contain '.', templates end with '.' and have no other '.', so sentences are the pieces between '. '."""
    assert text.endswith(".")
    sents = [s + "." for s in text[:-1].split(". ")]
    assert len(sents) == 6, text
    out = []
    for s in sents:
        hits = []
        for a, pool in pools.items():
            for ti, t in enumerate(pool):
                pre, suf = t.split("{V}")
                assert pre.startswith("{S}")
                body = pre[3:]
                j = s.find(body)
                if j <= 0 or not s.endswith(suf) or len(s) - len(suf) <= j + len(body):
                    continue
                subj, val = s[:j], s[j + len(body) : len(s) - len(suf)]
                hits.append((a, ti, val, subj))
        # the template whose fixed text is longest is the one used (shorter ones may match as substrings)
        assert hits, s
        best = max(hits, key=lambda h: len(pools[h[0]][h[1]]))
        out.append(best)
    return out[0][3], out


def check_bio_text(text, rec, pools, n_templates=50):
    subj, sents = parse_bio(text, pools)
    assert subj == rec["name"]
    assert sorted(a for a, *_ in sents) == sorted(ATTRS)
    for k, (a, ti, val, s) in enumerate(sents):
        assert val == rec[a], (a, val, rec[a])
        assert ti < n_templates
        if k:
            assert s == rec["pronoun"]
    return [a for a, *_ in sents], [ti for _, ti, *_ in sents]


# ---------------------------------------------------------------------------------------------- assets
def test_assets_sizes_values_and_templates():
    sizes = dict(first_names=400, middle_names=400, last_names=1000, birth_cities=200, universities=300, majors=100)
    for name, n in sizes.items():
        got = lines(f"{name}.txt")
        assert len(got) == n == len(set(got)), name
        for v in got:  # letters, single spaces, internal '-', ' & ', ', ' only; no trailing punctuation
            assert v == v.strip() and "  " not in v and v[0].isalnum() and v[-1].isalnum(), v
            assert all(c.isalnum() or c in " -&," for c in v) and "." not in v, v
    emp = [ln.split("\t") for ln in lines("employers.tsv")]
    assert len(emp) == 263 and all(len(r) == 2 for r in emp) and len({r[0] for r in emp}) == 263
    for t in ATTRS:
        pool = TEMPLATES[t]
        assert len(pool) >= 50 and len(set(pool)) == len(pool)
        for s in pool:
            assert s.startswith("{S} ") and s.count("{S}") == 1 and s.count("{V}") == 1 and s.endswith(".")
            assert s.count(".") == 1, s  # only the final full stop (the parser relies on it)
            words = set(s.lower().replace(".", " ").replace(",", " ").split())
            assert not words & {"he", "she", "his", "her", "him", "hers", "himself", "herself"}, s


def test_template_prefixes_are_prefix_free(cache):
    """No template's fixed text before the value is (word by word) equal to or a prefix of another's, across all
    attributes: after the prefix the next token is certainly that attribute's value (clean value losses)."""
    import re

    pre = [(t, re.findall(r"\w+|[^\w\s]+", t[3 : t.index(" {V}")])) for a in ATTRS for t in TEMPLATES[a]]
    # stronger than word prefixes: the last word may not even be the start of the other's word ("in" / "into"),
    # so that no subword tokenizer can make one prefix's tokens a prefix of another's
    bad = [
        (t, u)
        for t, p in pre
        for u, q in pre
        if t != u and len(q) >= len(p) and q[: len(p) - 1] == p[:-1] and q[len(p) - 1].startswith(p[-1])
    ]
    assert not bad
    # the same at the token level, for the test tokenizer and the default-size one
    for vocab, bios in ((512, 2000), (4096, 20000)):
        t = build_task("capo", dict(N=50, context=256, bpe_vocab_size=vocab, bpe_train_bios=bios, cache_dir=cache))
        assert t.template_prefix_conflicts() == []
        seqs = [tuple(t.tokenizer.encode(p[3 : p.index(" {V}")]).ids) for a in ATTRS for p in TEMPLATES[a]]
        assert not [(x, y) for x in seqs for y in seqs if x is not y and y[: len(x)] == x]


def test_sizes_match_official_lists_and_nothing_is_copied():
    if not OFFICIAL.is_dir():
        pytest.skip("official Capo lists not available")
    off = {p.name: [ln.strip() for ln in p.read_text().splitlines() if ln.strip()] for p in OFFICIAL.glob("*.txt")}
    pairs = dict(
        first_name="first_names",
        middle_name="middle_names",
        last_name="last_names",
        city="birth_cities",
        university="universities",
        field="majors",
    )
    for o, mine in pairs.items():
        assert len(lines(f"{mine}.txt")) == len(off[f"{o}.txt"]), o
    assert len(lines("employers.tsv")) == len(off["company.txt"])
    official = set()
    for ln in set().union(*map(set, off.values())):  # whole lines and each part of "Employer; HQ city" lines
        official.add(ln.lower())
        official.update(part.strip().lower() for part in ln.split(";"))
    ours = set()
    for p in ASSETS.glob("*.t*"):
        for ln in lines(p.name):
            ours.add(ln.lower())
            ours.update(part.strip().lower() for part in ln.split("\t"))
    assert not ours & official


# ---------------------------------------------------------------------------------------------- population
def test_population_unique_deterministic_and_prefix_stable(small):
    a = build_task("capo", {**small, "N": 3000})
    names = [a.person_record(i)["name"] for i in range(3000)]
    assert len(set(names)) == 3000
    b = build_task("capo", {**small, "N": 3000})
    assert all(b.person_record(i) == a.person_record(i) for i in range(0, 3000, 97))
    c = build_task("capo", {**small, "N": 1000})  # the population of a smaller N is a prefix
    assert all(c.person_record(i) == a.person_record(i) for i in range(0, 1000, 37))
    d = build_task("capo", {**small, "N": 3000, "seed": 1})
    assert sum(d.person_record(i)["name"] != names[i] for i in range(100)) >= 99
    first = set(lines("first_names.txt"))
    last = set(lines("last_names.txt"))
    for n in names[:200]:
        f, _m, l = n.split(" ")
        assert f in first and l in last


def chi2_ok(counts, n_cells):
    counts = np.asarray(counts, dtype=np.float64)
    exp = counts.sum() / n_cells
    chi2 = ((counts - exp) ** 2 / exp).sum()
    df = n_cells - 1
    return abs(chi2 - df) < 6 * math.sqrt(2 * df)


def test_attributes_uniform_and_independent(small):
    N = 20000
    t = build_task("capo", {**small, "N": N})
    recs = [t.person_record(i) for i in range(N)]
    months = collections.Counter(r["birth_date"].split(" ")[0] for r in recs)
    days = collections.Counter(int(r["birth_date"].split(" ")[1].rstrip(",")) for r in recs)
    years = collections.Counter(int(r["birth_date"].split(", ")[1]) for r in recs)
    assert len(months) == 12 and chi2_ok(list(months.values()), 12)
    assert set(days) == set(range(1, 29)) and chi2_ok(list(days.values()), 28)
    assert min(years) >= 1900 and max(years) <= 2099 and chi2_ok([years.get(y, 0) for y in range(1900, 2100)], 200)
    for key, n in (("birth_city", 200), ("university", 300), ("major", 100), ("employer", 263)):
        c = collections.Counter(r[key] for r in recs)
        assert len(c) == n and chi2_ok(list(c.values()), n), key
    g = sum(r["gender"] == "female" for r in recs)
    assert abs(g - N / 2) < 5 * math.sqrt(N / 4)
    # independence: gender vs month contingency (2 x 12) roughly uniform in every cell
    cells = collections.Counter((r["gender"], r["birth_date"].split(" ")[0]) for r in recs)
    assert chi2_ok(list(cells.values()), 24)
    hq = dict(ln.split("\t") for ln in lines("employers.tsv"))
    assert all(r["work_city"] == hq[r["employer"]] for r in recs[:500])
    par = build_task("capo", {**small, "gender": "id_parity"})
    assert [par.person_record(i)["pronoun"] for i in range(6)] == ["He", "She"] * 3


# ---------------------------------------------------------------------------------------------- rendering
def test_renderings_parse_to_the_facts_and_change_across_passes(task):
    orders, tmpls = set(), set()
    for person in range(0, 200, 13):
        rec = task.person_record(person)
        texts = [task.biography_text("train", p, person) for p in range(6)]
        assert len(set(texts)) == 6  # fresh template choice / order every exposure
        for text in texts:
            o, tm = check_bio_text(text, rec, TEMPLATES)
            orders.add(tuple(o))
            tmpls.update(zip(o, tm))
        # evaluation renderings are other fresh renderings of the same facts
        check_bio_text(task.biography_text("test", 0, person), rec, TEMPLATES)
        assert task.biography_text("test", 0, person) not in texts
    assert len(orders) > 50  # permuted sentence orders
    fixed = build_task("capo", {**task.cfg, "permute_sentences": False, "templates_per_attribute": 7})
    assert {a: len(v) for a, v in fixed.templates.items()} == {a: 7 for a in ATTRS}
    assert all(fixed.templates[a] == TEMPLATES[a][:7] for a in ATTRS)
    used = collections.defaultdict(set)
    for person in range(0, 200, 7):
        for p in range(4):
            o, tm = check_bio_text(
                fixed.biography_text("train", p, person), fixed.person_record(person), TEMPLATES, n_templates=7
            )
            assert o == list(ATTRS)
            for a, t in zip(o, tm):
                used[a].add(t)
    assert all(used[a] == set(range(7)) for a in ATTRS)  # the whole configured pool is used


def test_fragment_ids_equal_whole_text_encoding(task):
    n = 3000
    k = np.arange(n)
    b = task.render("train", k // 200, k % 200)
    tok = task.tokenizer
    c2o = task.compact_to_orig
    for r in range(n):
        ids = b["tokens"][b["offsets"][r] : b["offsets"][r + 1]]
        assert ids[-1] == task.eos_id and (ids[:-1] != task.eos_id).all()
        text = task.biography_text("train", int(k[r] // 200), int(k[r] % 200))
        assert c2o[ids[:-1]].tolist() == tok.encode(text, add_special_tokens=False).ids
    # a stretch of the stream = encoding the texts joined by the special <|endoftext|> token
    seg = task.stream_segment(0, 3000)
    eos_orig = tok.token_to_id("<|endoftext|>")
    bios = [task.biography_text("train", int(p), int(q)) for p, q in zip(seg["passes"], seg["people"])]
    want = tok.encode("<|endoftext|>".join(bios) + "<|endoftext|>", add_special_tokens=False).ids[:3000]
    got = np.where(seg["tokens"] == task.eos_id, eos_orig, c2o[seg["tokens"]])
    assert got.tolist() == want


def test_spans_decode_to_the_facts(task):
    tok = task.tokenizer
    c2o = task.compact_to_orig
    n = 400
    k = np.arange(n) + 777
    batch = task.generate("train", k // 200, k % 200)
    aid, grp = batch.token_answers()
    for r in range(n):
        lo, hi = batch.offsets[r], batch.offsets[r + 1]
        person = int(batch.meta["person"][r])
        rec = task.person_record(person)
        toks = batch.tokens[lo:hi]
        spans = collections.defaultdict(list)
        for t in range(hi - lo):
            if aid[lo + t] >= 0:
                spans[int(aid[lo + t])].append(t)
        assert len(spans) == 7
        seen = set()
        for pos in spans.values():
            assert pos == list(range(pos[0], pos[-1] + 1))  # contiguous
            g = int(grp[lo + pos[0]])
            seen.add(g)
            text = tok.decode(c2o[toks[pos]].tolist())
            if g == 1:
                assert pos[0] == 0 and text == rec["name"]
            elif g == 7:
                assert text == " " + rec["pronoun"] and len(pos) == 1
                # the first token of the biography that is the whole word " He" / " She" (not the start of a
                # longer word such as " Hemming": the next token starts a new word)
                dec = [tok.decode([int(c2o[x])]) if x != task.eos_id else "<EOS>" for x in toks]
                first = next(t for t in range(hi - lo - 1) if dec[t] in (" He", " She") and dec[t + 1][0] == " ")
                assert first == pos[0]
            else:
                assert text == " " + rec[GROUP_ATTR[g]], (g, text)
        assert seen == set(range(1, 8))
        assert (batch.loss_mask[lo:hi]).all()


def name_at(task, flat, s):
    """The full name (first three words) of the biography starting at stream position s."""
    piece = flat[s : s + 48]
    piece = piece[: np.flatnonzero(piece == task.eos_id)[0]] if (piece == task.eos_id).any() else piece
    return " ".join(task.tokenizer.decode(task.compact_to_orig[piece].tolist()).split(" ")[:3])


def test_training_windows_are_the_stream_and_answers_decode(task):
    T, W = 256, 30
    out = task.train_windows(np.arange(W), T)
    flat = out["tokens"].reshape(-1)
    assert np.array_equal(flat, task.stream_segment(0, W * T)["tokens"])  # consecutive windows = the stream
    assert (out["loss_mask"][:, 0] == False).all() and out["loss_mask"][:, 1:].all()
    by_name = {task.person_record(i)["name"]: task.person_record(i) for i in range(task.N)}
    eos = np.flatnonzero(flat == task.eos_id)
    starts = np.concatenate([[0], eos + 1])
    tok, c2o = task.tokenizer, task.compact_to_orig
    for w in range(W):
        aid, grp = out["answer_id"][w], out["group"][w]
        if (aid >= 0).any():
            assert sorted(set(aid[aid >= 0].tolist())) == list(range(aid.max() + 1))  # dense per window
        first_pos = {}
        for a in range(aid.max() + 1):
            pos = np.flatnonzero(aid == a)
            assert pos[0] >= 1 and pos.tolist() == list(range(pos[0], pos[-1] + 1))
            g = int(grp[pos[0]])
            gpos = w * T + pos
            b = int(np.searchsorted(starts, gpos[0], side="right")) - 1
            rec = by_name[name_at(task, flat, starts[b])]
            text = tok.decode(c2o[flat[gpos]].tolist())
            want = rec["name"] if g == 1 else " " + rec["pronoun"] if g == 7 else " " + rec[GROUP_ATTR[g]]
            assert text == want
            first_pos[a] = gpos[0]
        # a biography lying completely in [1, T) of the window has all its 7 answers scored; one starting at
        # position 0 cannot have its name scored (position 0 is never predicted); one starting in the previous
        # window has at most 6 (its name is there)
        for b in range(len(starts) - 1):
            lo, hi = starts[b], starts[b + 1]  # biography + its <EOS>
            n = sum(lo <= p < hi for p in first_pos.values())
            if w * T + 1 <= lo and hi <= (w + 1) * T:
                assert n == 7
            elif lo <= w * T < hi:
                assert n <= 6


# ---------------------------------------------------------------------------------------------- schedule / stream
def count_names(task, flat):
    """Occurrences of every person's name as the start of a biography in a concatenated stream."""
    tok, c2o = task.tokenizer, task.compact_to_orig
    eos = np.flatnonzero(flat == task.eos_id)
    starts = np.concatenate([[0], eos + 1])
    names = {task.person_record(i)["name"]: i for i in range(task.N)}
    cnt = collections.Counter()
    order = []
    for s in starts:
        piece = flat[s : s + 48]
        piece = piece[: np.flatnonzero(piece == task.eos_id)[0]] if (piece == task.eos_id).any() else piece
        text = tok.decode(c2o[piece].tolist())
        name = " ".join(text.split(" ")[:3])
        if name in names:
            cnt[names[name]] += 1
            order.append(names[name])
    return cnt, order


def test_exposure_schedule_sees_every_person_exposures_times(small):
    t = build_task("capo", {**small, "N": 40, "exposures": 3})
    B, T = 3, 256
    steps = t.steps_for_exposures(B)
    stream = t.make_stream("train", window=T, batch_size=B, seed=t.seed)
    flat = np.concatenate([stream.batch(s)["tokens"].reshape(-1).numpy() for s in range(steps)])
    total = t.exposure_tokens()
    assert steps * B * T >= total > (steps - 1) * B * T  # minimal number of steps
    cnt, order = count_names(t, flat)
    # every person seen 3 times (passes 0-2); the overflow of the last step (< B*T tokens, pass 3) adds one more
    # exposure to the first people of pass 3 (and the stream's first biography is at position 0)
    assert set(cnt) == set(range(40))
    assert all(3 <= c <= 4 for c in cnt.values())
    extra = [p for p, c in cnt.items() if c == 4]
    assert len(extra) <= (steps * B * T - total) // t.min_bio_len() + 1
    assert order[:40] != order[40:80] and sorted(order[:40]) == list(range(40))  # each pass is a fresh permutation
    assert sorted(order[40:80]) == list(range(40)) and sorted(order[80:120]) == list(range(40))
    assert set(order[120:]) == set(extra)


def test_random_offset_windows(small):
    t = build_task("capo", {**small, "window": "random_offset"})
    T = 256
    starts = t.window_starts(np.arange(50), T)
    off = starts - np.arange(50) * T
    assert off.min() >= 0 and off.max() < T and len(set(off.tolist())) > 30
    out = t.train_windows(np.arange(5), T)
    seg = t.stream_segment(0, 6 * T)
    for w in range(5):
        assert out["tokens"][w].tolist() == seg["tokens"][starts[w] : starts[w] + T].tolist()


def batches(ds, n, workers=0):
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return [b for _, b in zip(range(n), loader)]


def test_stream_determinism_workers_world_size_and_resume(task):
    T = 256
    one = batches(task.make_stream("train", window=T, batch_size=4, seed=0), 6)
    two = batches(task.make_stream("train", window=T, batch_size=4, seed=0), 6, workers=2)
    for a, b in zip(one, two):
        for k in ("tokens", "loss_mask", "answer_id", "group"):
            assert torch.equal(a[k], b[k]), k
    ranks = [
        batches(task.make_stream("train", window=T, batch_size=2, seed=0, rank=r, world_size=2), 6) for r in range(2)
    ]
    for s in range(6):
        assert torch.equal(torch.cat([ranks[0][s]["tokens"], ranks[1][s]["tokens"]]), one[s]["tokens"])
    ds = task.make_stream("train", window=T, batch_size=4, seed=0)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert state == {"step": 3}
    fresh = task.make_stream("train", window=T, batch_size=4, seed=0)
    fresh.load_state_dict(state)
    nxt = next(iter(fresh))
    assert torch.equal(nxt["tokens"], one[3]["tokens"]) and torch.equal(nxt["answer_id"], one[3]["answer_id"])
    other = batches(task.make_stream("train", window=T, batch_size=4, seed=1), 1)[0]
    assert not torch.equal(other["tokens"], one[0]["tokens"])
    # a fresh task object (another process would build the same) gives the same stream
    again = build_task("capo", task.cfg)
    assert torch.equal(again.make_stream("train", window=T, batch_size=4, seed=0).batch(5)["tokens"], one[5]["tokens"])
    import pickle  # DataLoader workers started with "spawn" get a pickled copy

    clone = pickle.loads(pickle.dumps(task))
    assert torch.equal(clone.make_stream("train", window=T, batch_size=4, seed=0).batch(2)["tokens"], one[2]["tokens"])
    assert clone.decode(one[0]["tokens"][0]) == task.decode(one[0]["tokens"][0])
    with pytest.raises(ConfigError, match="task.context"):
        task.make_stream("train", window=64, batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="task.tail"):
        task.make_stream("train", window=T, batch_size=4, seed=0, tail="nope")


def test_eval_windows_cover_every_person_once(task):
    T = 256
    for split, people in (("test", task.N), ("val", task.val_people)):
        n = task.eval_windows(split, T)
        ds = task.make_stream(split, window=T, batch_size=8, seed=0, num_steps=-(-n // 8) + 1)
        got = list(ds)
        assert len(got) == len(ds)
        toks = torch.cat([b["tokens"] for b in got]).numpy()
        aid = torch.cat([b["answer_id"] for b in got]).numpy()
        grp = torch.cat([b["group"] for b in got]).numpy()
        lm = torch.cat([b["loss_mask"] for b in got]).numpy()
        assert (toks[n:] == 0).all() and not lm[n:].any() and (aid[n:] == -1).all()  # past the end: pad
        assert (toks[:n, 0] == task.eos_id).all()
        names = collections.Counter()
        per_group = collections.Counter()
        by_name = {task.person_record(i)["name"]: task.person_record(i) for i in range(task.N)}
        tok, c2o = task.tokenizer, task.compact_to_orig
        for w in range(n):
            rec = None
            for a in range(aid[w].max() + 1):
                pos = np.flatnonzero(aid[w] == a)
                g = int(grp[w][pos[0]])
                per_group[g] += 1
                text = tok.decode(c2o[toks[w][pos]].tolist())
                if g == 1:
                    names[text] += 1
                    rec = by_name[text]
                    assert toks[w][pos[0] - 1] == task.eos_id
                else:
                    assert text == (" " + rec["pronoun"] if g == 7 else " " + rec[GROUP_ATTR[g]])
        assert len(names) == people and set(names.values()) == {1}
        assert all(per_group[g] == people for g in range(1, 8))
    val = {task.person_record(int(i))["name"] for i in task.eval_people("val")}
    assert len(val) == task.val_people


# ---------------------------------------------------------------------------------------------- metrics
def test_bits_formula_by_hand(task):
    N = task.N
    N0 = 400 * 400 * 1000
    S0 = 2 * (12 * 28 * 200) * 200 * 300 * 100 * 263
    assert task.N0 == N0 and task.S0 == S0
    assert abs(math.log2(S0) - 47.6) < 0.05  # Part 3.3 Def. 4.3: log2 S0 ≈ 47.6 bits per person
    d = 128
    info = dict(num_params=1_000_000, d_model=d, tie_embeddings=True)
    P = 1_000_000 - d  # the pad row never occurs; every other compact id does

    def table(p1, pg):
        by = {1: dict(answers=N, nll_sum=p1 * N)}
        by.update({g: dict(answers=N, nll_sum=pg[g - 2] * N) for g in range(2, 8)})
        return {"by_group": by}

    perfect = task.finalize_metrics("test", table(math.log(N), [0.0] * 6), info)
    rmax = (N * math.log2(N0 / N) + N * math.log2(S0)) / P
    assert perfect["params_counted"] == P
    assert perfect["bits_per_param"] == pytest.approx(rmax, rel=1e-12)
    assert perfect["bits_per_param_max"] == pytest.approx(rmax, rel=1e-12)
    # knowing nothing: uniform over all names and all attribute tuples (split over the groups) -> 0 bits
    logs = [math.log(12 * 28 * 200), math.log(200), math.log(300), math.log(100), math.log(263), math.log(2)]
    none = task.finalize_metrics("test", table(math.log(N0), logs), info)
    assert abs(none["bits"]) < 1e-6 * N * 60
    # a hand example: p1 = 10 nats, every attribute 1 nat (p2 = 6 nats), untied embeddings count pad twice
    ex = task.finalize_metrics("test", table(10.0, [1.0] * 6), dict(info, tie_embeddings=False))
    want = N * (math.log2(N0) - 10 / math.log(2)) + N * (math.log2(S0) - 6 / math.log(2))
    assert ex["bits"] == pytest.approx(want, rel=1e-12)
    assert ex["bits_per_param"] == pytest.approx(want / (1_000_000 - 2 * d), rel=1e-12)
    assert ex["p1_name_nats"] == 10.0 and ex["p2_value_nats"] == pytest.approx(6.0)
    # string group keys (as logged tables have) work too
    str_table = {"by_group": {str(g): v for g, v in table(10.0, [1.0] * 6)["by_group"].items()}}
    assert task.finalize_metrics("test", str_table, info)["bits"] == pytest.approx(want)
    # a model with a larger vocabulary: the extra rows are unused
    big = task.finalize_metrics("test", table(10.0, [1.0] * 6), dict(info, vocab_size=task.vocab_size + 10))
    assert big["params_counted"] == 1_000_000 - 11 * d
    # the untrained scale: a model uniform over its V ids pays ln V per answer token (p_g = tokens_g / answers_g ln V)
    V = task.vocab_size + 10
    tok = {1: 3, 2: 4, 3: 2, 4: 3, 5: 2, 6: 2, 7: 1}
    counted = {"by_group": {g: dict(row, tokens=tok[g] * N) for g, row in table(10.0, [1.0] * 6)["by_group"].items()}}
    m = task.finalize_metrics("test", counted, dict(info, vocab_size=V))
    p1u, p2u = 3 * math.log(V), sum(tok[g] for g in range(2, 8)) * math.log(V)
    assert m["bits_uniform"] == pytest.approx(
        N * (math.log2(N0) - p1u / math.log(2)) + N * (math.log2(S0) - p2u / math.log(2)), rel=1e-12
    )
    assert m["bits_uniform"] < 0 and "bits_uniform" not in big  # no token counts, no scale
    lines = task.explain_metrics(m)
    assert "Part 3.3 Def. 4.3" in lines[0] and "0 = a uniform guess among the valid answers" in lines[0]
    assert "nothing is proven stored yet" not in lines[0]  # bits > 0 here (p1 = 10 nats < ln N0)
    assert "nothing is proven stored yet" in task.explain_metrics(dict(m, bits=-5.0))[0]
    assert f"{m['bits_uniform']:.6g}" in lines[1] and f"{m['bits_total_max']:.6g}" in lines[1]
    assert task.model_overrides() == {"tie_embeddings": True}
    assert task.num_groups == 8 and task.group_labels[1] == "name" and task.group_labels[7] == "gender"


def test_test_split_table_from_score_answers_feeds_the_bits(task):
    """The per-group table built with canonlm.data.metrics.score_answers over the whole test split has one answer
    per person and group; an oracle that is certain of every token but the name's first (uniform over the N
    names: ln N nats) and the gender (ln 2) gives p1 = ln N, p2 = ln 2 (hand-computed bits)."""
    from canonlm.data.metrics import score_answers

    T = 256
    n = task.eval_windows("test", T)
    b = {k: torch.from_numpy(v) for k, v in task.eval_batch_windows("test", np.arange(n), T).items()}
    aid, grp = b["answer_id"], b["group"]
    nll = torch.zeros(b["tokens"].shape, dtype=torch.float64)
    start = (aid >= 0) & torch.cat([torch.ones(n, 1, dtype=torch.bool), aid[:, 1:] != aid[:, :-1]], 1)
    nll[start & (grp == 1)] = math.log(task.N)
    nll[grp == 7] = math.log(2)
    out = score_answers(b["tokens"], b, task.num_groups, nll=nll)
    assert out["answers_total"].tolist() == [0] + [task.N] * 7
    assert out["answers_correct"].tolist() == [0] + [task.N] * 7
    table = {
        "by_group": {
            g: {"answers": int(out["answers_total"][g]), "nll_sum": float(out["nll_sum"][g])} for g in range(1, 8)
        }
    }
    m = task.finalize_metrics("test", table, dict(num_params=10**6, d_model=64, tie_embeddings=True))
    assert m["p1_name_nats"] == pytest.approx(math.log(task.N)) and m["p2_value_nats"] == pytest.approx(math.log(2))
    want = task.N * math.log2(task.N0 / task.N) + task.N * (math.log2(task.S0) - 1)
    assert m["bits"] == pytest.approx(want)


# ---------------------------------------------------------------------------------------------- config / tokenizer
@pytest.mark.parametrize(
    "key,value",
    [
        ("N", 0),
        ("N", 1.5),
        ("N", 10**9),
        ("exposures", 0),
        ("templates_per_attribute", 0),
        ("templates_per_attribute", 51),
        ("birth_years", [2000, 1999]),
        ("birth_years", [1900]),
        ("birth_years", "1900-2099"),
        ("gender", "other"),
        ("permute_sentences", "yes"),
        ("window", "random"),
        ("context", 0),
        ("context", 64),
        ("tail", "keep"),
        ("seed", -1),
        ("bpe_vocab_size", 100),
        ("bpe_train_bios", 0),
        ("val_people", 0),
        ("val_people", 201),
        ("eval_renderings_per_person", 0),
        ("tokenizer", "/nonexistent/tokenizer.json"),
        ("tokenizer", 5),
        ("cache_dir", 3),
        ("bogus", 1),
    ],
)
def test_config_errors_name_the_key(small, key, value):
    with pytest.raises(ConfigError) as e:
        build_task("capo", {**small, key: value})
    assert e.value.key == f"task.{key}"
    assert repr(value) in str(e.value) and "allowed" in str(e.value)


def test_wrong_name(small):
    with pytest.raises(ConfigError, match="task.name"):
        build_task("capo", {**small, "name": "depo1"})


def test_tokenizer_cache_and_local_paths(task, small, tmp_path):
    path = task.tokenizer_path
    assert path.is_file() and path.parent.parent == Path(small["cache_dir"]) and path.name.startswith("bpe-")
    mtime = path.stat().st_mtime_ns
    again = build_task("capo", small)
    assert again.tokenizer_path == path and path.stat().st_mtime_ns == mtime  # loaded, not retrained
    # the same training is deterministic
    from canonlm.data.tasks.capo import train_bpe

    texts = task.bpe_training_texts()[:300]
    assert train_bpe(texts, 300).to_str() == train_bpe(texts, 300).to_str()
    # a local tokenizer.json file and a directory holding one
    f = tmp_path / "tok.json"
    f.write_text(path.read_text())
    d = tmp_path / "hfdir"
    d.mkdir()
    (d / "tokenizer.json").write_text(path.read_text())
    g = tmp_path / "gpt2style"  # GPT-2's layout: vocab.json + merges.txt
    g.mkdir()
    task.tokenizer.model.save(str(g))
    assert (g / "vocab.json").is_file() and (g / "merges.txt").is_file()
    for p in (str(f), str(d), str(g)):
        t = build_task("capo", {**small, "tokenizer": p})
        assert t.vocab_size == task.vocab_size
        assert np.array_equal(
            t.render("train", 0, np.arange(20))["tokens"], task.render("train", 0, np.arange(20))["tokens"]
        )
    # a tokenizer whose pre-tokenization differs (whitespace words) breaks the fragment rule -> ConfigError
    import tokenizers

    sp = tokenizers.Tokenizer(tokenizers.models.BPE())  # SentencePiece-style: "▁" prepended to every piece
    sp.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="always")
    sp.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=400))
    bad = tmp_path / "metaspace.json"
    sp.save(str(bad))
    with pytest.raises(ConfigError, match="task.tokenizer"):
        build_task("capo", {**small, "tokenizer": str(bad)})


def test_protocol_generate_instance_and_lengths(task):
    w = np.array([0, 0, 2, 5])
    i = np.array([0, 199, 3, 17])
    b = task.generate("train", w, i)
    assert len(b) == 4 and b.ans_offsets.tolist() == [0, 7, 14, 21, 28]
    assert np.array_equal(task.estimate_lengths("train", w, i), b.lengths.astype(float))
    for r in range(4):
        inst = task.instance("train", (int(w[r]), int(i[r])))
        assert np.array_equal(inst.tokens, b.tokens[b.offsets[r] : b.offsets[r + 1]])
        assert task.decode(inst.tokens) == inst.meta["text"] + "<|endoftext|>"
        assert len(inst) <= task.max_instance_len("train") and len(inst) >= task.min_instance_len("train")
    # instance k of the split sequence = (pass k // N, position k % N); stream order of pass 1
    inst = task.instance("train", 200 + 5)
    assert inst.meta["person"] == int(task.generate("train", [1], [5]).meta["person"][0])
    assert task.token_names()[0] == "<pad>" and task.token_names()[task.eos_id] == "<EOS>"
    assert len(task.token_names()) == task.vocab_size
    lens = task.render("train", 0, np.arange(200))["offsets"]
    assert np.diff(lens).max() <= task.max_bio_len()
    with pytest.raises(ValueError):
        task.generate("train", [0], [200])
    with pytest.raises(ValueError):
        task.generate("nope", [0], [0])
