"""Real-life evaluations: multi-hop birth-year prompts (paper App. B), Babilong prompts and scorer (paper Fig. 23),
model loading and the ``python -m canonlm.eval.reallife`` command line.

Oracles: prompts are parsed back with regular expressions and the queried person's year re-derived from the parsed
facts; background lengths re-counted with the tokenizer; Babilong scorer cases derived by hand from the rules; a fake
"oracle" language model that emits the right (or a wrong) answer checks the evaluation wiring end to end; the loaded
model's logits are compared with the model that was saved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from canonlm.data import ConfigError
from canonlm.data.lm import LanguageModel
from canonlm.data.reallife import babilong as bl
from canonlm.data.reallife.multihop import (
    MultiHopBuilder,
    evaluate_multihop,
    extract_year,
    load_capo_names,
    score_multihop,
    split_sentences,
)

from conftest import ROOT, compose

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "corpus.txt"
BABI = DATA / "babilong"
INSTRUCTION = (
    "You will be asked questions about people's birth years, and the birth year descriptions are hidden in "
    "some random text. Some people's birth years are directly given, while others are given in the form "
    "that `name1' was born in the same year as `name2'.\n\n"
)  # multihop-birthyear.py, verbatim
NAMES = (["Ada", "Bram", "Cleo", "Dov"], ["Kai", "Lux"], ["Moss", "Nye", "Orr"])  # 24 full names
NAME = r"[A-Z][a-z]+ [A-Z][a-z]+ [A-Z][a-z]+"
FACT = re.compile(rf"({NAME}) was born in the year of (\d{{4}})\.")
EQUIV = re.compile(rf"({NAME}) was born in the same year as ({NAME})\.")
QUEST = re.compile(rf"\n\nAnswer me: ({NAME}) was born in the year of $")


class WS:
    """Whitespace tokenizer with a growing vocabulary (ids 0 = pad, 1 = eos)."""

    def __init__(self):
        self.inv = ["<pad>", "<eos>"]
        self.ids = {t: i for i, t in enumerate(self.inv)}

    def id(self, w: str) -> int:
        if w not in self.ids:
            self.ids[w] = len(self.inv)
            self.inv.append(w)
        return self.ids[w]

    def encode(self, text: str) -> list[int]:
        return [self.id(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(self.inv[i] for i in ids if i > 1)


@pytest.fixture(scope="module")
def ws():
    return WS()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is much faster than two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def builder(tok, **kw) -> MultiHopBuilder:
    return MultiHopBuilder(tok, CORPUS, names=NAMES, **kw)


# ---------------------------------------------------------------------------------------------- sentences
def test_regex_sentence_splitter():
    text = (
        'Dr. Smith met J. R. Tolkien in the U.S. Army. He said "Hello." Then 3.5 kg of salt\narrived!  '
        "Why? (Because it rained.) The end\n\nNew paragraph without a stop"
    )
    assert split_sentences(text, newline="space") == [
        "Dr. Smith met J. R. Tolkien in the U.S. Army.",
        'He said "Hello."',
        "Then 3.5 kg of salt arrived!",
        "Why?",
        "(Because it rained.)",
        "The end",
        "New paragraph without a stop",
    ]
    # default: a single line break ends a sentence
    assert split_sentences(text) == [
        "Dr. Smith met J. R. Tolkien in the U.S. Army.",
        'He said "Hello."',
        "Then 3.5 kg of salt",
        "arrived!",
        "Why?",
        "(Because it rained.)",
        "The end",
        "New paragraph without a stop",
    ]


DUMP = (
    "Old Harbour\nOld Harbour is a small port town. It was founded in 1702.\nHistory\n"
    "The first pier was built of oak.  Trade grew quickly\r\nGeography\nThe town lies on a bay.\n"
)


def test_single_newlines_end_sentences_in_dumps(tmp_path, ws):
    """Regression: a heading without a full stop used to be glued to the next sentence."""
    assert split_sentences(DUMP) == [  # derived by hand: every line break is a boundary
        "Old Harbour",
        "Old Harbour is a small port town.",
        "It was founded in 1702.",
        "History",
        "The first pier was built of oak.",
        "Trade grew quickly",
        "Geography",
        "The town lies on a bay.",
    ]
    assert split_sentences(DUMP, newline="space") == [  # the old behaviour, kept as a switch
        "Old Harbour Old Harbour is a small port town.",
        "It was founded in 1702.",
        "History The first pier was built of oak.",
        "Trade grew quickly Geography The town lies on a bay.",
    ]
    with pytest.raises(ConfigError) as e:
        split_sentences(DUMP, newline="join")
    assert e.value.key == "multihop.newline"
    f = tmp_path / "dump.txt"
    f.write_text(DUMP)
    lines = [ln for ln in DUMP.replace("\r\n", "\n").split("\n") if ln.strip()]
    b = MultiHopBuilder(ws, f, names=NAMES)
    # no background sentence spans two lines of the file: each one lies inside a single line
    assert all(any(sent in " ".join(ln.split()) for ln in lines) for sent in b.sentences)
    assert "History" in b.sentences and b.settings()["newline"] == "boundary"
    assert MultiHopBuilder(ws, f, names=NAMES, newline="space").sentences == split_sentences(DUMP, newline="space")
    with pytest.raises(ConfigError) as e:
        MultiHopBuilder(ws, f, names=NAMES, newline="lines")
    assert e.value.key == "multihop.newline"


# ---------------------------------------------------------------------------------------------- multihop prompts
def parse(p) -> dict:
    """Facts, equivalences and question re-read from the prompt text alone."""
    text = p.text
    m = QUEST.search(text)
    assert m, repr(text[-80:])
    body = text[: m.start()]
    return dict(facts=FACT.findall(body), equiv=EQUIV.findall(body), name=m.group(1), body=body)


@pytest.mark.parametrize("hop", [1, 2])
@pytest.mark.parametrize("L", [0, 40, 150])
def test_prompt_format_and_answer_rederived(ws, hop, L):
    b = builder(ws)
    for i in range(6):
        p = b.build(hop, L, i)
        f = parse(p)
        assert p.text.endswith(" was born in the year of ")  # trailing space kept (multihop-birthyear.py)
        years = [int(y) for _, y in f["facts"]]
        names1 = [n for n, _ in f["facts"]]
        assert len(f["facts"]) == (5 if hop == 1 else 3)
        assert len(set(years)) == len(years) and all(1950 <= y <= 2009 for y in years)
        if hop == 1:
            assert not p.text.startswith(INSTRUCTION) and f["body"].endswith(" ")
            assert not f["equiv"]
            assert f["name"] == names1[0]  # query: first = the first-mentioned person
            want = dict(f["facts"])[f["name"]]
        else:
            assert p.text.startswith(INSTRUCTION + "<context>") and f["body"].endswith("</context>")
            assert len(f["equiv"]) == 3
            names2 = [a for a, _ in f["equiv"]]
            partners = [c for _, c in f["equiv"]]
            assert sorted(partners) == sorted(names1)  # bijection onto group 1
            assert not set(names2) & set(names1)
            assert f["name"] == names2[0]
            want = dict(f["facts"])[dict(f["equiv"])[f["name"]]]
            # group order: every fact precedes every equivalence
            last_fact = max(f["body"].index(s) for s in p.statements[:3])
            assert last_fact < min(f["body"].index(s) for s in p.statements[3:])
        assert p.target == int(want)
        assert len(set(names1 + [a for a, _ in f["equiv"]])) == len(names1) + len(f["equiv"])
        # statements in their order, background sentences in corpus order, joined by single spaces
        pos = [f["body"].index(s) for s in p.statements]
        assert pos == sorted(pos)
        s0, k = p.background
        pieces = [*p.statements, *b.sentences[s0 : s0 + k]]
        assert sum(len(x) for x in pieces) + len(pieces) - 1 == len(
            f["body"].removeprefix(INSTRUCTION + "<context>").removesuffix("</context>").rstrip(" ")
        )
        bpos = [f["body"].index(s) for s in b.sentences[s0 : s0 + k]]
        assert bpos == sorted(bpos)
        assert p.ids == ws.encode(p.text)


@pytest.mark.parametrize("mode", ["per_sentence", "joined"])
def test_background_length_within_one_sentence_of_L(ws, mode):
    b = builder(ws, length_count=mode)
    for L in (0, 25, 120, 400):
        for i in range(5):
            p = b.build(1, L, i)
            s0, k = p.background
            sents = b.sentences[s0 : s0 + k]
            count = sum(len(ws.encode(s)) for s in sents) if mode == "per_sentence" else len(ws.encode(" ".join(sents)))
            assert p.background_tokens == count and not p.shortfall
            assert count < L or L == 0 and count == 0
            nxt = b.sentences[s0 + k]  # ensure_full_background: the corpus did not end first
            more = count + len(ws.encode(nxt)) if mode == "per_sentence" else len(ws.encode(" ".join([*sents, nxt])))
            assert more >= L  # the next sentence would reach L: count in [L - one sentence, L)


def test_shortfall_switch(ws):
    total = sum(len(ws.encode(s)) for s in builder(ws).sentences)
    L = total // 2
    full = builder(ws)
    short = builder(ws, ensure_full_background=False)
    ps = [full.build(1, L, i) for i in range(20)]
    assert not any(p.shortfall for p in ps) and all(p.background_tokens >= L - 60 for p in ps)
    qs = [short.build(1, L, i) for i in range(20)]
    assert any(q.shortfall for q in qs)
    for q in qs:
        if q.shortfall:  # release behaviour: everything to the end of the corpus, fewer than L tokens
            assert sum(q.background) == len(short.sentences) and q.background_tokens < L
    with pytest.raises(ValueError, match="background"):
        builder(ws).build(1, 10 * total, 0)


def test_prompts_are_pure_functions_and_query_random(ws):
    a = builder(ws)
    b = builder(ws)
    p = a.build(2, 100, 7)
    for i in (3, 9, 7):
        b.build(2, 100, i)
    q = b.build(2, 100, 7)
    assert p.text == q.text and p.target == q.target
    assert a.build(2, 100, 8).text != p.text
    assert builder(ws, seed=1).build(2, 100, 7).text != p.text
    # the same people across L (only the background changes)
    r = a.build(2, 40, 7)
    assert (r.names1, r.years, r.names2, r.perm) == (p.names1, p.years, p.names2, p.perm)
    rnd = builder(ws, query="random")
    firsts = 0
    for i in range(40):
        x = rnd.build(2, 0, i)
        f = parse(x)
        assert x.target == int(dict(f["facts"])[dict(f["equiv"])[f["name"]]])
        firsts += f["name"] == f["equiv"][0][0]
    assert 3 <= firsts <= 30  # ~1/3 of the time the first one


def test_builder_config_errors_and_hf_tokenizer(ws, tmp_path):
    for kw, key in (
        (dict(length_count="chars"), "multihop.length_count"),
        (dict(query="last"), "multihop.query"),
        (dict(ensure_full_background="yes"), "multihop.ensure_full_background"),
    ):
        with pytest.raises(ConfigError) as e:
            builder(ws, **kw)
        assert e.value.key == key
    with pytest.raises(FileNotFoundError):
        MultiHopBuilder(ws, tmp_path / "missing.txt", names=NAMES)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(CORPUS.read_text().split())))}}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    p = builder(t).build(1, 50, 0)
    assert p.ids == t.encode(p.text, add_special_tokens=False).ids
    assert p.background_tokens == sum(
        len(t.encode(s).ids) for s in builder(t).sentences[p.background[0] : sum(p.background)]
    )


def test_name_lists(tmp_path):
    for part, names in zip(("first", "middle", "last"), NAMES):
        (tmp_path / f"{part}_names.txt").write_text("\n".join(names) + "\n")
    assert load_capo_names(tmp_path) == tuple(list(n) for n in NAMES)
    with pytest.raises(FileNotFoundError, match="first_names"):
        load_capo_names(tmp_path / "nowhere")
    assets = ROOT / "src" / "canonlm" / "data" / "tasks" / "capo_assets"
    if not (assets / "first_names.txt").is_file():
        pytest.skip("Capo name lists not present yet")
    first, middle, last = load_capo_names()
    assert (len(first), len(middle), len(last)) == (400, 400, 1000)


@pytest.mark.timeout(30)
def test_duplicate_names_are_collapsed_and_too_few_distinct_is_an_error(ws, tmp_path):
    """Regression: the guard counted list lengths, so lists with repeats could make name sampling loop forever."""
    dup = (["Ada", "Ada", "Ada", "Ada"], ["Kai", "Kai", "Kai"], ["Moss", "Moss", "Nye", " Nye "])  # 1*1*2 distinct
    assert 4 * 3 * 4 >= 6  # the old length-based guard let this through
    with pytest.raises(ValueError, match=r"2 distinct full names.*needs \(6\)"):
        MultiHopBuilder(ws, CORPUS, names=dup)
    # repeats do not change the prompts: same as the lists without them (first occurrences, in order)
    rep = (["Ada", "Bram", "Ada", "Cleo", "Dov", "Bram"], ["Kai", "Lux", "Kai"], ["Moss", "Nye", "Moss", "Orr"])
    clean = tuple(list(dict.fromkeys(x)) for x in rep)
    assert clean == tuple(list(x) for x in NAMES)
    a, c = MultiHopBuilder(ws, CORPUS, names=rep), MultiHopBuilder(ws, CORPUS, names=clean)
    for i in range(4):
        pa, pc = a.build(2, 30, i), c.build(2, 30, i)
        assert pa.text == pc.text and pa.target == pc.target
        people = pa.names1 + pa.names2
        assert len(set(people)) == 6
        assert all(n.split()[0] in clean[0] and n.split()[1] in clean[1] and n.split()[2] in clean[2] for n in people)
    # the file loader de-duplicates too
    for part, lst in zip(("first", "middle", "last"), rep):
        (tmp_path / f"{part}_names.txt").write_text("\n".join(lst) + "\n\n")
    assert load_capo_names(tmp_path) == clean
    # names containing spaces can coincide as full names: still a clean error, not an endless loop
    spaced = (["Ann", "Ann Marie", "Bo"], ["Marie Lee", "Lee"], ["Orr"])  # 6 triples, only 5 distinct strings
    assert len({f"{a} {b} {c}" for a in spaced[0] for b in spaced[1] for c in spaced[2]}) == 5
    b = MultiHopBuilder(ws, CORPUS, names=spaced)
    assert len(set(b.build(1, 0, 0).names1)) == 5  # 1-hop needs 5: fine
    with pytest.raises(ValueError, match="distinct full names"):
        b.build(2, 0, 0)  # 2-hop needs 6


def test_year_scorer():
    assert extract_year(" 1987.") == 1987 and score_multihop(" 1987.", 1987)
    assert extract_year("1987 or 1990") == 1987
    assert extract_year("in 19876 and 2001") == 2001  # a 5-digit run is not a year
    assert extract_year("about 87") is None and not score_multihop("about 87", 1987)
    assert not score_multihop(" 1988", 1987)
    assert extract_year("x2003y") == 2003


# ---------------------------------------------------------------------------------------------- oracle LM
def oracle_lm(answers: dict[tuple, list[int]], V: int, eos: int = 1) -> LanguageModel:
    """Logits that continue every known prompt with its answer ids, then EOS."""
    known = sorted(answers.items(), key=lambda kv: -len(kv[0]))

    def forward(x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        out = torch.zeros(B, T, V)
        for b in range(B):
            row = x[b].tolist()
            for p, ans in known:
                n = len(p)
                if n <= T and tuple(row[:n]) == p:
                    for t in range(n - 1, T):
                        j = t - n + 1
                        out[b, t, ans[j] if j < len(ans) else eos] = 10.0
                    break
        return out

    return LanguageModel(forward, vocab_size=V, batch_size=4)


def test_evaluate_multihop_with_oracle(ws):
    b = builder(ws)
    hops, lengths, n = (1, 2), (0, 60), 4
    right, wrong = {}, {}
    for hop in hops:
        for L in lengths:
            for p in b.build_many(hop, L, n):
                right[tuple(p.ids)] = [ws.id(str(p.target)), ws.id(".")]
                wrong[tuple(p.ids)] = [ws.id(str(p.target + 1))]
    V = len(ws.inv) + 1
    res = evaluate_multihop(oracle_lm(right, V), b, ws.decode, hops=hops, lengths=lengths, num_prompts=n, stop_ids=(1,))
    assert res["accuracy"] == {"1-hop": {"0": 1.0, "60": 1.0}, "2-hop": {"0": 1.0, "60": 1.0}}
    assert res["counts"]["2-hop"]["60"] == [4, 4] and len(res["samples"]) == 16
    assert all(s["output"] == f"{s['target']} ." for s in res["samples"])
    res = evaluate_multihop(oracle_lm(wrong, V), b, ws.decode, hops=hops, lengths=lengths, num_prompts=n)
    assert all(v == 0.0 for h in res["accuracy"].values() for v in h.values())


# ---------------------------------------------------------------------------------------------- babilong
def test_babilong_loader_layouts(tmp_path):
    s = bl.load_babilong(BABI, "qa1", "0k")
    assert [x.target for x in s] == ["office", "hallway", "garden"] and s[1].question == "Where is Daniel?"
    assert [x.target for x in bl.load_babilong(BABI, "qa1", 1000)] == ["kitchen", "bedroom"]  # JSON lines
    assert len(bl.load_babilong(BABI, "qa1", "0k", limit=2)) == 2
    (tmp_path / "2k").mkdir()
    (tmp_path / "2k" / "qa5.jsonl").write_text(json.dumps(dict(input="c", question="q?", target="Fred")) + "\n")
    assert bl.load_babilong(tmp_path, "qa5", "2K")[0].target == "Fred"
    with pytest.raises(FileNotFoundError, match="qa2"):
        bl.load_babilong(tmp_path, "qa2", "0k")
    with pytest.raises(ValueError):
        bl.load_babilong(BABI, "qa9", "0k")
    assert [bl.length_name(x) for x in (0, 1000, "4k", "4K", "0.5k", 8000)] == ["0k", "1k", "4k", "4k", "0.5k", "8k"]


def test_babilong_prompt_template():
    s = bl.load_babilong(BABI, "qa2", "0k")[0]
    p = bl.PROMPTS["qa2"]
    want = (
        p["instruction"] + "\n\n" + p["examples"] + "\n\n" + "<context>\n" + s.input + "\n</context>\n\n"
        "Question: " + s.question + "\nAnswer:"
    )
    assert bl.build_prompt(s) == want and want.endswith("Answer:")
    bare = bl.build_prompt(s, use_instruction=False, use_examples=False)
    assert bare == "<context>\n" + s.input + "\n</context>\n\nQuestion: " + s.question + "\nAnswer:"
    block = re.compile(r"<context>\n[^\n]+\n</context>\n\nQuestion: [^\n]+\nAnswer: [^\n]+")
    for qa, pr in bl.PROMPTS.items():
        assert pr["post_prompt"] == ""
        blocks = pr["examples"].split("\n\n<context>")
        assert len(blocks) >= 2 and all(block.fullmatch(b if k == 0 else "<context>" + b) for k, b in enumerate(blocks))
        assert "Reply with" in pr["instruction"]  # the answer format lives in the instruction (Babilong/prompts.py)
        # the example answers follow the scorer's rule: exactly one task label beyond those in the question
        if qa != "qa5":
            for b in block.findall(pr["examples"]):
                q = re.search(r"Question: (.*)\n", b).group(1)
                ans = b.rsplit("Answer: ", 1)[1]
                left = {r for r in bl.ROOMS if r in ans.lower()} - {r for r in bl.ROOMS if r in q.lower()}
                assert len(left) == 1, b
                assert bl.score_babilong(ans, left.pop(), q, bl.ROOMS)


CASES = [  # (output, target, question, qa, expected)
    ("The milk is in the office.", "office", "Where is the milk?", "qa2", True),
    (" kitchen", "kitchen", "Where is Mary?", "qa1", True),
    ("Kitchen or office.", "office", "Where is Mary?", "qa1", False),  # two labels
    (
        "Before the garden, the football was in the hallway.",
        "hallway",
        "Where was the football before the garden?",
        "qa3",
        True,
    ),  # garden is in the question
    (
        "Before the garden the football was in the garden.",
        "garden",
        "Where was the football before the garden?",
        "qa3",
        False,
    ),  # the only label is the question's
    ("office. The kitchen.", "kitchen", "Where is John?", "qa1", False),  # first sentence only
    ("office. The kitchen.", "office", "Where is John?", "qa1", True),
    ("hallway <context> bedroom", "hallway", "Where is John?", "qa1", True),
    ("<example> hallway", "hallway", "Where is John?", "qa1", False),
    ("bedroom\nQuestion: where is the kitchen", "bedroom", "Where is Bill?", "qa1", False),  # no cut (verbatim)
    ("bedroom\nQuestion: where is Bill", "bedroom", "Where is Bill?", "qa1", True),  # no other label follows
    ("bill", "Bill", "Who received the milk?", "qa5", True),  # case-insensitive
    ("Bill gave it to Fred", "Fred", "Who did Bill give the milk to?", "qa5", True),
    ("apple and milk", "apple", "What did Fred give to Bill?", "qa5", False),
    ("the garage", "garage", "Where is Mary?", "qa1", False),  # target must be a task label
    ("", "office", "Where is Mary?", "qa1", False),
]


@pytest.mark.parametrize("output,target,question,qa,expected", CASES)
def test_babilong_scorer(output, target, question, qa, expected):
    assert bl.score_babilong(output, target, question, bl.TASK_LABELS[qa]) is expected


def test_babilong_scorer_verbatim_question_cut():
    out = "bedroom\nQuestion: where is the kitchen"
    assert bl.score_babilong(out, "bedroom", "Where is Bill?", bl.ROOMS, question_cut="any_case")
    # the reference code looks for "Question" in the lower-cased text, which never matches
    assert not bl.score_babilong(out, "bedroom", "Where is Bill?", bl.ROOMS, question_cut="verbatim")
    with pytest.raises(ValueError, match="question_cut"):
        bl.score_babilong(out, "bedroom", "Where is Bill?", bl.ROOMS, question_cut="lower")


def compare_answers_oracle(output: str, target: str, question: str, labels) -> bool:
    """compare_answers re-derived from its description: lower-case, first '.'-sentence, cut at <context>/<example>,
    then at "Question" -- looked up in the lower-cased text, so never found; labels of the question removed."""
    out = output.lower()
    out = out[: out.find(".")] if "." in out else out
    for tag in ("<context>", "<example>", "Question"):
        if tag in out:
            out = out[: out.find(tag)]
    found = {x.lower() for x in labels if x.lower() in out} - {
        x.lower() for x in labels if x.lower() in question.lower()
    }
    return found == {target.lower()}


def test_babilong_scorer_default_is_compare_answers():
    """Regression: the default used to be the lenient any_case cut; it is now compare_answers' verbatim behaviour."""
    outputs = [
        "bedroom\nQuestion: where is the kitchen",
        "kitchen\nquestion: is it the office",
        "Office. Kitchen",
        "the garden <example> office",
        "hallway question hallway",
        "Mary\nQuestion: who has the milk",
    ]
    for out in outputs:
        for target, question, labels in (
            ("bedroom", "Where is Bill?", bl.ROOMS),
            ("kitchen", "Where is the milk?", bl.ROOMS),
            ("Mary", "Who gave the apple?", bl.TASK_LABELS["qa5"]),
        ):
            want = compare_answers_oracle(out, target, question, labels)
            assert bl.score_babilong(out, target, question, labels) is want, (out, target)
    assert bl.preprocess_output("Kitchen\nQuestion: x") == "kitchen\nquestion: x"
    assert bl.preprocess_output("Kitchen\nQuestion: x", "any_case") == "kitchen\n"


def write_prompt_file(path: Path, qas=bl.TASKS) -> dict:
    """A user prompt set (own texts, Babilong-like layout) written as JSON; returns it."""
    p = {
        qa: dict(
            instruction=f"Custom instruction for {qa}: answer with one word.",
            examples=f"<example>\nSample context {qa}.\nQuestion: sample?\nAnswer: sample\n</example>",
            post_prompt="Think before answering.\n\n",
        )
        for qa in qas
    }
    path.write_text(json.dumps(p, indent=1))
    return p


def test_babilong_user_prompts_file(tmp_path):
    import hashlib

    f = tmp_path / "prompts.json"
    mine = write_prompt_file(f)
    prompts, digest = bl.load_prompts(f)
    assert prompts == mine and digest == hashlib.sha256(f.read_bytes()).hexdigest()
    s = bl.load_babilong(BABI, "qa3", "0k")[0]
    p = mine["qa3"]
    want = (
        p["instruction"]
        + "\n\n"
        + p["examples"]
        + "\n\n"
        + p["post_prompt"]
        + "<context>\n"
        + s.input
        + "\n</context>\n\nQuestion: "
        + s.question
        + "\nAnswer:"
    )  # Babilong/prompts.py's template, stripped
    assert bl.build_prompt(s, prompts=prompts) == want
    # a subset of tasks, and extra Babilong tasks (qa6..) are fine
    sub = tmp_path / "sub.json"
    sub.write_text(json.dumps({"qa1": mine["qa1"], "qa7": {"instruction": "x"}}))
    assert set(bl.load_prompts(sub, ["qa1"])[0]) == {"qa1"}
    bad = {  # file content -> words the error must contain
        "[1, 2]": "JSON list",
        '{\n "qa1": {"instruction": "i",\n}': ":3: invalid JSON",
        json.dumps({"qa1": mine["qa1"]}): "no prompt for qa2",
        json.dumps({**mine, "qa2": {"instruction": "i", "examples": "e"}}): "missing post_prompt",
        json.dumps({**mine, "qa2": {**mine["qa2"], "postprompt": ""}}): "unknown 'postprompt'",
        json.dumps({**mine, "qa4": {**mine["qa4"], "examples": ["a", "b"]}}): "qa4.examples must be a string",
        json.dumps({**mine, "qa5": "just text"}): "qa5 must be an object",
        json.dumps({**mine, "task1": mine["qa1"]}): "unknown key(s) 'task1'",
    }
    for k, (content, words) in enumerate(bad.items()):
        g = tmp_path / f"bad{k}.json"
        g.write_text(content)
        with pytest.raises(ValueError) as e:
            bl.load_prompts(g)
        assert str(g) in str(e.value) and words in str(e.value), (content, str(e.value))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        bl.load_prompts(tmp_path / "nope.json")


def test_find_babilong_file_does_not_depend_on_the_hash_seed(tmp_path):
    """Regression: the length spellings were iterated as a set, so the file picked depended on PYTHONHASHSEED."""
    for name in ("1k", "1K"):
        (tmp_path / "qa1").mkdir(exist_ok=True)
        (tmp_path / "qa1" / f"{name}.json").write_text("[]")
    code = (
        "import sys; from canonlm.data.reallife.babilong import find_babilong_file as f; "
        "print(f(sys.argv[1], 'qa1', 1000).name)"
    )
    got = set()
    for seed in range(8):  # with a set, both orders occur among these seeds (e.g. 6 and 7 on CPython 3.11)
        p = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        assert p.returncode == 0, p.stderr
        got.add(p.stdout.strip())
    assert got == {"1k.json"}  # the canonical spelling comes first, documented order


def test_evaluate_babilong_with_oracle(ws):
    answers = {}
    for qa in bl.TASKS:
        for s in bl.load_babilong(BABI, qa, "0k"):
            answers[tuple(ws.encode(bl.build_prompt(s)))] = [ws.id(f"{s.target}.")]
    lm = oracle_lm(answers, len(ws.inv) + 1)
    res = bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, qas=bl.TASKS, lengths=["0k"], num_prompts=10)
    assert res["accuracy"] == {qa: {"0k": 1.0} for qa in bl.TASKS}
    assert res["counts"]["qa1"]["0k"] == [3, 3]
    with pytest.raises(FileNotFoundError):
        bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, qas=["qa2"], lengths=["4k"])


def test_evaluate_babilong_default_cut_and_user_prompts(ws, tmp_path):
    """The oracle model answers only prompts built (by the test) from the user's file, with a trailing question that
    names another room: correct only under the lenient any_case cut, wrong under the default compare_answers cut."""
    mine = write_prompt_file(tmp_path / "p.json", qas=("qa1",))
    prompts, _ = bl.load_prompts(tmp_path / "p.json", ["qa1"])
    answers = {}
    p = mine["qa1"]
    for s in bl.load_babilong(BABI, "qa1", "0k"):
        text = (
            p["instruction"]
            + "\n\n"
            + p["examples"]
            + "\n\n"
            + p["post_prompt"]
            + "<context>\n"
            + s.input
            + "\n</context>\n\nQuestion: "
            + s.question
            + "\nAnswer:"
        )
        other = next(r for r in bl.ROOMS if r != s.target)
        answers[tuple(ws.encode(text))] = [ws.id(s.target), ws.id("Question:"), ws.id(other)]
    lm = oracle_lm(answers, len(ws.inv) + 1)
    kw = dict(qas=["qa1"], lengths=["0k"], num_prompts=10)
    assert bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, prompts=prompts, **kw)["accuracy"] == {
        "qa1": {"0k": 0.0}
    }
    assert bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, prompts=prompts, question_cut="any_case", **kw)[
        "accuracy"
    ] == {"qa1": {"0k": 1.0}}
    # canonlm's own prompts are not the ones the model knows: nothing right even with any_case
    assert bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, question_cut="any_case", **kw)["accuracy"] == {
        "qa1": {"0k": 0.0}
    }
    with pytest.raises(ValueError, match="no prompt for qa2"):
        bl.evaluate_babilong(lm, ws.encode, ws.decode, BABI, prompts=prompts, qas=["qa1", "qa2"], lengths=["0k"])


# ---------------------------------------------------------------------------------------------- tokenizer adapters
def test_as_encoder_decides_the_calling_convention_once():
    """Regression: as_encoder retried on any TypeError, swallowing genuine tokenizer errors and calling twice."""
    from canonlm.data.reallife import as_decoder, as_encoder

    class WithFlag:
        def __init__(self):
            self.calls = []

        def encode(self, text, add_special_tokens=True):
            self.calls.append((text, add_special_tokens))
            if text == "boom":
                raise TypeError("genuine tokenizer bug")
            return [len(w) for w in text.split()] + ([99] if add_special_tokens else [])

    t = WithFlag()
    enc = as_encoder(t)
    assert enc("ab cde") == [2, 3] and t.calls == [("ab cde", False)]
    with pytest.raises(TypeError, match="genuine tokenizer bug"):
        enc("boom")
    assert t.calls == [("ab cde", False), ("boom", False)]  # one call, no silent retry without the flag

    class NoFlag:
        def __init__(self):
            self.calls = 0

        def encode(self, text):
            self.calls += 1
            return [len(w) for w in text.split()]

    n = NoFlag()
    enc = as_encoder(n)
    assert [enc(x) for x in ("a bb", "ccc")] == [[1, 2], [3]] and n.calls == 2

    calls = []

    def opaque(text, **kw):  # a signature inspect cannot read -> one probe at construction
        calls.append(kw)
        if kw:
            raise TypeError("no keywords accepted")
        return [7] * len(text)

    opaque.__signature__ = "unreadable"
    enc = as_encoder(type("T", (), {"encode": staticmethod(opaque)})())
    assert calls == [{"add_special_tokens": False}]  # the single probe
    assert enc("xyz") == [7, 7, 7] and enc("q") == [7] and calls[1:] == [{}, {}]

    # a real tokenizers.Tokenizer whose post-processor adds BOS: the adapter must not add it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "the": 2, "lamp": 3, "is": 4, "lit": 5}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.add_special_tokens(["<s>"])
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    text = "the lamp is lit"
    assert as_encoder(tk)(text) == [vocab[w] for w in text.split()] != tk.encode(text).ids
    assert as_decoder(tk)([1, 2, 3]) == "the lamp"  # special <s> skipped

    class Dec:
        def decode(self, ids):
            if ids == [0]:
                raise TypeError("bad id")
            return "-".join(map(str, ids))

    d = as_decoder(Dec())
    assert d(np.array([3, 4])) == "3-4"
    with pytest.raises(TypeError, match="bad id"):
        d([0])


# ---------------------------------------------------------------------------------------------- eval CLI
@pytest.fixture(scope="module")
def text_env(tmp_path_factory):
    """A tokenizer, a prepared corpus and tiny name lists."""
    from test_text import train_bpe

    from canonlm.data.prepare import main as prepare_main

    d = tmp_path_factory.mktemp("env")
    tok = train_bpe(d / "tokenizer.json")
    assert (
        prepare_main(
            [
                "--input",
                str(CORPUS),
                "--tokenizer",
                str(tok),
                "--out",
                str(d / "prep"),
                "--append-eos",
                "--val-fraction",
                "0.15",
                "--test-fraction",
                "0.15",
                "--quiet",
            ]
        )
        == 0
    )
    names = d / "names"
    names.mkdir()
    for part, lst in zip(("first", "middle", "last"), NAMES):
        (names / f"{part}_names.txt").write_text("\n".join(lst))
    return dict(root=d, tok=tok, prep=d / "prep", names=names)


def make_run(env, run_dir: Path):
    """A run directory as train.py leaves it: .hydra/config.yaml + checkpoints/last.ckpt (Lightning layout)."""
    from omegaconf import OmegaConf

    from canonlm.arch.model import LlamaCanon
    from canonlm.config.build import build_configs

    cfg = compose(
        ["task=text", f"task.data_dir={env['prep']}", "task.context=64", "model.size=2L64D"], output_dir=run_dir
    )
    _, mcfg = build_configs(cfg)
    torch.manual_seed(0)
    model = LlamaCanon(mcfg)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    (run_dir / "checkpoints").mkdir()
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 2},
        run_dir / "checkpoints" / "last.ckpt",
    )
    return model


def test_load_model_round_trip(text_env, tmp_path):
    from canonlm.config.rundir import run_tokenizer
    from canonlm.eval.load import load_model

    model = make_run(text_env, tmp_path / "run")
    lm = load_model(tmp_path / "run", device="cpu", max_seq_len=300)
    assert lm.step == 2 and lm.trained_context == 64 and lm.model_cfg.max_seq_len == 300
    x = torch.randint(0, lm.model_cfg.vocab_size, (2, 50))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(lm.model(x), model(x))
    assert lm.lm.logprobs([x[0].numpy()])[0].shape == (50, lm.model_cfg.vocab_size)
    assert run_tokenizer(lm.task_cfg)[0] == str(Path(text_env["tok"]).resolve())
    lm2 = load_model(tmp_path / "run" / "checkpoints" / "last.ckpt", device="cpu")
    assert lm2.run_dir == lm.run_dir and lm2.model_cfg.max_seq_len == 64
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")


def test_reallife_cli_multihop_and_babilong(text_env, tmp_path, capsys):
    from canonlm.eval.reallife import main

    make_run(text_env, tmp_path / "run")
    out = tmp_path / "mh.json"
    args = [
        "--run",
        str(tmp_path / "run"),
        "--task",
        "multihop",
        "--background",
        str(CORPUS),
        "--lengths",
        "0,90",
        "--num-prompts",
        "3",
        "--names-dir",
        str(text_env["names"]),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "1-hop" in printed and "2-hop" in printed and "results:" in printed
    res = json.loads(out.read_text())
    assert set(res["accuracy"]) == {"1-hop", "2-hop"} and set(res["accuracy"]["1-hop"]) == {"0", "90"}
    assert all(res["counts"][h][L][1] == 3 for h in res["counts"] for L in res["counts"][h])
    assert len(res["samples"]) == 12 and res["model"]["step"] == 2
    assert res["settings"]["query"] == "first" and res["tokenizer"]["kind"] == "tokenizers"
    assert res["settings"]["newline"] == "boundary"
    for s in res["samples"]:
        assert s["correct"] == (extract_year(s["output"]) == s["target"])
    assert main(args) == 2 and "--force" in capsys.readouterr().err  # never overwrite silently
    assert main([*args, "--force"]) == 0
    out2 = tmp_path / "bl.json"
    assert (
        main(
            [
                "--run",
                str(tmp_path / "run"),
                "--task",
                "babilong",
                "--babilong-dir",
                str(BABI),
                "--lengths",
                "0k",
                "--qa",
                "qa1,qa5",
                "--num-prompts",
                "2",
                "--out",
                str(out2),
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    res = json.loads(out2.read_text())
    assert res["counts"] == {
        "qa1": {"0k": [res["counts"]["qa1"]["0k"][0], 2]},
        "qa5": {"0k": [res["counts"]["qa5"]["0k"][0], 2]},
    }
    assert res["settings"]["question_cut"] == "verbatim"  # compare_answers by default
    assert res["settings"]["prompts"] == {"source": "canonlm", "file": None, "sha256": None}
    for s in res["samples"]:
        q = bl.load_babilong(BABI, s["qa"], "0k")[s["index"]].question
        assert s["correct"] == compare_answers_oracle(s["output"], s["target"], q, bl.TASK_LABELS[s["qa"]])
    # own prompt file: recorded with its sha256; the prompts get longer by the extra texts
    import hashlib

    pf = tmp_path / "prompts.json"
    write_prompt_file(pf, qas=("qa1", "qa5"))
    out3 = tmp_path / "bl3.json"
    bargs = [
        "--run",
        str(tmp_path / "run"),
        "--task",
        "babilong",
        "--babilong-dir",
        str(BABI),
        "--lengths",
        "0k",
        "--qa",
        "qa1,qa5",
        "--num-prompts",
        "2",
        "--device",
        "cpu",
        "--quiet",
    ]
    assert main([*bargs, "--prompts", str(pf), "--question-cut", "any_case", "--out", str(out3)]) == 0
    res3 = json.loads(out3.read_text())
    assert res3["settings"]["prompts"] == {
        "source": "file",
        "file": str(pf.resolve()),
        "sha256": hashlib.sha256(pf.read_bytes()).hexdigest(),
    }
    assert res3["settings"]["question_cut"] == "any_case"
    pf.write_text(json.dumps({"qa1": {"instruction": "only this"}}))
    assert main([*bargs, "--prompts", str(pf), "--out", str(tmp_path / "bl4.json")]) == 2
    err = capsys.readouterr().err
    assert str(pf) in err and "qa1" in err and not (tmp_path / "bl4.json").exists()
    assert main(["--run", str(tmp_path / "run"), "--task", "multihop", "--out", str(tmp_path / "x.json")]) == 2
    assert "--background" in capsys.readouterr().err


def test_reallife_main_docstring_documents_exit_codes(capsys):
    from canonlm.eval.reallife import main

    doc = main.__doc__ or ""
    assert re.search(r"\b0 = ", doc) and re.search(r"\b2 = ", doc), doc
    assert main(["--run", "/nonexistent/run", "--task", "babilong"]) == 2  # a user error -> 2, one line
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("canonlm.eval.reallife: error: ")
    with pytest.raises(SystemExit) as e:
        main(["--task", "babilong"])  # missing --run: argparse, status 2
    assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.slow
def test_train_text_two_steps_then_eval(text_env, tmp_path):
    """train.py task=text for 2 steps in a subprocess, then the eval CLI on its run directory."""
    import inspect

    from canonlm.train import datamodule

    if "make_stream" not in inspect.getsource(datamodule):
        pytest.skip("the trainer's data module does not call task.make_stream yet (lead: wire TextStream)")
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "task=text",
        f"task.data_dir={text_env['prep']}",
        "task.context=64",
        "model.size=2L64D",
        "data.batch_size=4",
        "data.val_windows=4",
        "data.test_windows=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.log_every_n_steps=1",
        "run_name=txt",
        f"paths.log_dir={tmp_path}/logs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    run = tmp_path / "logs" / "train" / "runs" / "txt"
    res = json.loads((run / "results.json").read_text())
    assert res["steps"] == 2 and np.isfinite(res["val"]["loss"])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "canonlm.eval.reallife",
            "--run",
            str(run),
            "--task",
            "multihop",
            "--background",
            str(CORPUS),
            "--lengths",
            "0,50",
            "--num-prompts",
            "2",
            "--names-dir",
            str(text_env["names"]),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((run / "reallife_multihop.json").read_text())
    assert out["model"]["step"] == 2 and out["counts"]["1-hop"]["50"][1] == 2
