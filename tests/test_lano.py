"""Lano task (paper App. A.5): config validation, instance layout, packing, determinism, official grammar files
through the task, and generative evaluation with an oracle model (logits = log of the exact next-symbol law) and a
uniform one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from canonlm.data.cfg import check, load_grammar, next_symbol_probs, save_grammar
from canonlm.data.lm import LanguageModel
from canonlm.data.packing import pack_windows
from canonlm.data.tasks import build_task
from canonlm.errors import ConfigError
from conftest import SHARED, compose

LANO_DIR = SHARED / "lano"
CPU = dict(grammar="tiny", context=256, eval_num_samples=32, kl_samples=8)


def cpu_task(**over):
    return build_task("lano", {**CPU, **over})


def longest(g):
    """Longest sentence by a naive recursion over the rules (independent of Grammar.max_len)."""
    memo = {}

    def mx(lv, a):
        if lv == g.depth:
            return 1
        if (lv, a) not in memo:
            memo[lv, a] = max(sum(mx(lv + 1, c) for c in r) for r in g.rules[lv][a])
        return memo[lv, a]

    return mx(0, 0)


# ---------------------------------------------------------------------------------------------- config
def test_cpu_preset_composes_and_is_small():
    cfg = compose(["task=lano_cpu"])
    t = build_task("lano", dict(cfg.task))
    assert t.grammar_label == "tiny" and t.context == 256 and t.eval_samples("test") == 32 and t.kl_samples == 8
    assert t.vocab_size == 5 and t.bos_id == 4 and t.chance == 0.0 and t.num_groups == 2
    assert t.max_instance_len("train") == 1 + longest(t.grammar) <= 101
    assert t.rejected_mass == 0.0
    paper = build_task("lano", dict(compose(["task=lano"]).task))
    assert paper.grammar_label == "cfg3f" and paper.context == 512 and paper.eval_samples("val") == 500
    # the cfg3f family's longest sentence exceeds the 512 window: capped at 511 by rejection (not in the paper)
    assert longest(paper.grammar) > 511 and paper.max_instance_len("train") == 512
    assert 0 < paper.rejected_mass < 1e-3


@pytest.mark.parametrize(
    "over, key",
    [
        (dict(bogus=1), "task.bogus"),
        (dict(grammar="cfg9z"), "task.grammar"),
        (dict(grammar=dict(depth=3)), "task.grammar"),
        (dict(grammar_seed=-1), "task.grammar_seed"),
        (dict(context=4), "task.context"),
        (dict(context=50, max_sentence_len=None), "task.context"),
        (dict(max_sentence_len=3), "task.max_sentence_len"),
        (dict(max_sentence_len="big"), "task.max_sentence_len"),
        (dict(tail="keep"), "task.tail"),
        (dict(kl_restrict="softmax"), "task.kl_restrict"),
        (dict(kl_samples=-1), "task.kl_samples"),
        (dict(eval_num_samples=1.5), "task.eval_num_samples"),
        (dict(eval_temperature=-1.0), "task.eval_temperature"),
        (dict(grammar_file=3), "task.grammar_file"),
        (dict(grammar_file="/nonexistent/cfg.json"), "task.grammar_file"),
    ],
)
def test_bad_config_is_config_error(over, key):
    with pytest.raises(ConfigError) as e:
        cpu_task(**over)
    assert e.value.key == key


def test_family_mapping_and_grammar_file(tmp_path):
    fam = dict(depth=3, num_sym=2, num_terminals=2, deg_min=2, deg_max=2, len_min=2, len_max=2)
    t = cpu_task(grammar=fam, grammar_seed=4)
    assert t.vocab_size == 4 and list(t.grammar.sizes) == [1, 2, 2, 2] and t.max_len == 8
    p = tmp_path / "g.json"
    save_grammar(t.grammar, p)
    u = cpu_task(grammar_file=str(p))
    assert u.grammar.rules == t.grammar.rules
    # same grammar + seed -> same stream
    assert np.array_equal(t.generate("train", [0, 1], [0, 0]).tokens, u.generate("train", [0, 1], [0, 0]).tokens)
    bad = tmp_path / "bad.json"
    d = json.loads(p.read_text())
    d["all"][1][0]["children"] = [[5]]
    bad.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        cpu_task(grammar_file=str(bad))
    assert e.value.key == "task.grammar_file"


# ---------------------------------------------------------------------------------------------- generation
def test_instances_layout_derivable_and_deterministic():
    t = cpu_task()
    w = np.repeat(np.arange(20), 3)
    i = np.tile(np.arange(3), 20)
    b = t.generate("train", w, i)
    assert len(b) == 60 and b.loss_mask.all() and b.ans_len.size == 0 and b.ans_offsets.tolist() == [0] * 61
    sents = []
    for r in range(60):
        x = b.tokens[b.offsets[r] : b.offsets[r + 1]]
        assert x[0] == t.bos_id and ((x[1:] >= 1) & (x[1:] <= 3)).all()
        assert t.min_instance_len("train") <= len(x) <= t.max_instance_len("train")
        assert b.meta["length"][r] == len(x) - 1
        sents.append(x[1:])
    assert check(t.grammar, sents).all()
    # instance (w, i) does not depend on the rest of the call; instance() agrees
    one = t.instance("train", (int(w[17]), int(i[17])))
    assert np.array_equal(one.tokens, b.tokens[b.offsets[17] : b.offsets[18]])
    assert (one.answer_id == -1).all() and one.loss_mask.all()
    # split namespaces differ; seeds differ
    assert not np.array_equal(t.generate("val", w, i).tokens, b.tokens)
    assert not np.array_equal(t.generate("train", w, i, seed=1).tokens, b.tokens)
    assert t.decode([4, 1, 2, 3, 0]) == "<bos> 1 2 3 <pad>"


def test_packed_windows_are_bos_separated_sentences():
    t = cpu_task()
    out = pack_windows(t, "train", np.arange(4), t.context, seed=0)
    for row in out["tokens"]:
        assert row[0] == t.bos_id
        cuts = np.nonzero(row == t.bos_id)[0].tolist() + [len(row)]
        complete = [row[a + 1 : b] for a, b in zip(cuts[:-2], cuts[1:-1])]
        assert len(complete) >= 2 and check(t.grammar, complete).all()
    assert out["loss_mask"][:, 1:].all() and not out["loss_mask"][:, 0].any()


@pytest.mark.skipif(not LANO_DIR.exists(), reason="official grammar files not available")
def test_official_grammar_through_the_task():
    t = build_task("lano", dict(grammar="cfg3f", grammar_file=str(LANO_DIR / "cfg3f.json"), context=512))
    g = load_grammar(LANO_DIR / "cfg3f.json")
    assert t.grammar.rules == g.rules and t.max_len == 511 and 1e-7 < t.rejected_mass < 1e-5
    b = t.generate("test", np.arange(50), np.zeros(50, dtype=np.int64))
    assert check(g, [b.tokens[b.offsets[r] + 1 : b.offsets[r + 1]] for r in range(50)]).all()
    for name, ctx in (("cfg3j", 1536), ("cfg3k", 1536)):
        u = build_task("lano", dict(grammar=name, grammar_file=str(LANO_DIR / f"{name}.json"), context=ctx))
        assert u.max_len == min(1535, longest(u.grammar)) and u.rejected_mass < 1e-40


# ---------------------------------------------------------------------------------------------- evaluation
def oracle_forward(grammar, vocab_size):
    """Logits = log p*(next | current sentence prefix) from the exact DP; uniform where the prefix is not a valid
    run of terminals after a <bos>."""
    T = grammar.num_terminals
    bos = T + 1

    def fwd(x: torch.Tensor) -> torch.Tensor:
        xs = x.cpu().numpy()
        B, L = xs.shape
        out = np.zeros((B, L, vocab_size), dtype=np.float64)
        for b in range(B):
            for j in np.nonzero(xs[b] == bos)[0]:
                k = j + 1
                while k < L and 1 <= xs[b, k] <= T:
                    k += 1
                P = next_symbol_probs(grammar, xs[b, j + 1 : k])
                if np.isnan(P).any():
                    continue
                row = np.full((P.shape[0], vocab_size), -1e30)
                with np.errstate(divide="ignore"):
                    row[:, bos] = np.log(P[:, 0])
                    row[:, 1 : T + 1] = np.log(P[:, 1:])
                out[b, j : j + P.shape[0]] = np.maximum(row, -1e30)
        return torch.from_numpy(out)

    return fwd


def test_evaluate_oracle_is_perfect_and_uniform_fails():
    t = cpu_task()
    idx = np.arange(16)
    lm = LanguageModel(oracle_forward(t.grammar, t.vocab_size), vocab_size=t.vocab_size, batch_size=16)
    res = t.evaluate(lm, "val", idx)
    assert set(res) == {"correct", "group", "kl", "kl_uniform"}
    assert res["correct"].all() and (res["group"] == 1).all()
    kl = res["kl"]
    assert np.isnan(kl[8:]).all() and (np.abs(kl[:8]) < 1e-5).all()
    # per-sample determinism: a sub-batch gives the same answers
    sub = t.evaluate(lm, "val", idx[[3, 9]])
    assert sub["correct"].all() and abs(sub["kl"][0] - kl[3]) < 1e-9 and np.isnan(sub["kl"][1])

    uni = LanguageModel(lambda x: torch.zeros(*x.shape, t.vocab_size), vocab_size=t.vocab_size, batch_size=16)
    ru = t.evaluate(uni, "val", idx)
    assert ru["correct"].mean() <= 0.1 and (ru["kl"][:8] > 0.05).all()
    # kl_uniform is the KL a model with flat logits scores (the untrained scale), whatever model is evaluated
    np.testing.assert_allclose(ru["kl_uniform"][:8], ru["kl"][:8], rtol=1e-9)
    np.testing.assert_allclose(res["kl_uniform"][:8], ru["kl"][:8], rtol=1e-9)
    assert np.isnan(ru["kl_uniform"][8:]).all()
    line = t.explain_metrics({"kl": 0.01, "kl_uniform": float(np.mean(ru["kl"][:8]))})[0]
    assert "nats per position" in line and f"{np.mean(ru['kl'][:8]):.4g}" in line and "first 8 sentences" in line


def test_score_generations_rules():
    t = cpu_task()
    s = t.sentences("test", [0])[0]
    bos = t.bos_id
    gens = [
        np.concatenate([s, [bos]]),
        s,
        np.array([bos]),
        np.concatenate([s[:-1], [bos]]),
        np.concatenate([s, [0, bos]]),
        np.zeros(0, np.int64),
    ]
    want = [True, False, False, bool(check(t.grammar, [s[:-1]])[0]), False, False]
    assert t.score_generations(gens).tolist() == want
    pr = t.prompts("test", [5, 6])
    assert pr.max_new_tokens == t.max_len + 1 and pr.stop_ids == (bos,) and pr.temperature == 1.0
    assert [p.tolist() for p in pr.prompts] == [[bos], [bos]]
    assert pr.keys[1] == t.prompts("test", [6]).keys[0] and pr.keys[0] != pr.keys[1]


def test_auto_cap_refuses_a_window_that_drops_real_mass():
    """max_sentence_len: auto may only drop a negligible tail of the length law (the paper's windows
    hold its sentences); a too-short window is a ConfigError naming the context needed."""
    from canonlm.errors import ConfigError

    with pytest.raises(ConfigError, match="task.context") as e:
        build_task("lano", dict(grammar="cfg3j", context=512))
    need = int(str(e.value).split("an integer >= ")[1].split()[0])
    t = build_task("lano", dict(grammar="cfg3j", context=need))
    assert t.rejected_mass <= 1e-4
    # an explicit cap is the user's decision (>= 1 % kept)
    t = build_task("lano", dict(grammar="cfg3j", context=512, max_sentence_len=511))
    assert 0.5 < t.rejected_mass < 0.99


def test_grammar_preset_must_match_the_file():
    from canonlm.errors import ConfigError

    if not (LANO_DIR / "cfg3k.json").exists():
        pytest.skip("official grammar files not available")
    with pytest.raises(ConfigError, match="task.grammar") as e:
        build_task("lano", dict(grammar="cfg3f", grammar_file=str(LANO_DIR / "cfg3k.json"), context=1536))
    assert "cfg3k" in str(e.value)
