"""Full-copy task (paper Fig. 5): instances are parsed back with ids from the documented layout; the first half
must be a permutation of 1..n and the copy must equal it; loss / answer masks, uniformity, determinism, packing and
config errors are checked."""

from __future__ import annotations

import math

import numpy as np
import pytest

from canonlm.data import ConfigError
from canonlm.data.packing import pack_windows
from canonlm.data.tasks import build_task


def parse_and_check(task, inst):
    """Layout (module docstring): <bos> = n+1, <query> = n+2, content 1..n; loss and the scored answer = the copy."""
    n = task.n_tokens
    toks = [int(x) for x in inst.tokens]
    assert len(toks) == 2 * n + 2
    assert toks[0] == n + 1 and toks[n + 1] == n + 2
    first, copy = toks[1 : n + 1], toks[n + 2 :]
    assert sorted(first) == list(range(1, n + 1)), "first half must be a permutation of 1..n"
    assert copy == first
    exp_loss = np.zeros(2 * n + 2, bool)
    exp_loss[n + 2 :] = True
    np.testing.assert_array_equal(inst.loss_mask, exp_loss)
    np.testing.assert_array_equal(inst.answer_id, np.where(exp_loss, 0, -1))
    np.testing.assert_array_equal(inst.group, exp_loss.astype(int))
    return first


@pytest.mark.parametrize("n", [2, 3, 32, 500])
@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_instances_are_permutations_copied(n, split):
    task = build_task("fullcopy", dict(n_tokens=n, context=2 * n + 2))
    for w in range(6):
        parse_and_check(task, task.instance(split, (w, w % 3)))
    assert task.max_instance_len(split) == task.min_instance_len(split) == 2 * n + 2


def test_permutations_are_uniform():
    """n = 3: all 6 orders equally likely (chi-square, df 5); n = 20: position of token 1 uniform, and
    P(x_1 < x_2) = 1/2."""
    t3 = build_task("fullcopy", dict(n_tokens=3))
    b = t3.generate("train", np.arange(6000), np.zeros(6000, dtype=np.int64))
    rows = b.tokens.reshape(-1, 8)[:, 1:4]
    codes = rows[:, 0] * 100 + rows[:, 1] * 10 + rows[:, 2]
    _, counts = np.unique(codes, return_counts=True)
    assert counts.size == 6
    exp = 1000.0
    assert ((counts - exp) ** 2 / exp).sum() < 25
    t20 = build_task("fullcopy", dict(n_tokens=20))
    b = t20.generate("val", np.arange(4000), np.full(4000, 2, dtype=np.int64))
    first = b.tokens.reshape(-1, 42)[:, 1:21]
    pos1 = np.argmax(first == 1, axis=1)
    c = np.bincount(pos1, minlength=20)
    assert ((c - 200.0) ** 2 / 200.0).sum() < 50  # df 19
    less = (first[:, 0] < first[:, 1]).mean()
    assert abs(less - 0.5) < 4.5 * 0.5 / math.sqrt(4000)


def test_batched_generation_equals_single_instances_and_splits_differ():
    task = build_task("fullcopy", dict(n_tokens=10))
    w = np.array([5, 0, 5, 9, 2**40])
    i = np.array([1, 0, 0, 7, 3])
    b = task.generate("test", w, i)
    for r in range(len(w)):
        one = task.instance("test", (int(w[r]), int(i[r])))
        np.testing.assert_array_equal(b.tokens[b.offsets[r] : b.offsets[r + 1]], one.tokens)
    a = {s: task.generate(s, np.arange(30), np.zeros(30, dtype=np.int64)).tokens for s in ("train", "val", "test")}
    assert not np.array_equal(a["train"], a["val"]) and not np.array_equal(a["val"], a["test"])
    assert not np.array_equal(
        task.generate("train", np.arange(30), np.zeros(30, dtype=np.int64), seed=3).tokens, a["train"]
    )
    np.testing.assert_array_equal(task.estimate_lengths("train", w, i), np.full(5, 22.0))


def test_packing_scores_the_copy_as_one_answer():
    """fullcopy_cpu sizes: 66-token instances in 128-token windows; the second instance is cut inside its copy
    (its copy starts at 66 + 34 = 100): its copy tokens are loss targets but not scored."""
    task = build_task("fullcopy", dict(n_tokens=32, context=128))
    out = pack_windows(task, "train", np.arange(3), 128, seed=0)
    for r in range(3):
        toks, loss, aid, grp = (out[k][r] for k in ("tokens", "loss_mask", "answer_id", "group"))
        first = parse_and_check(task, task.instance("train", (r, 0)))
        np.testing.assert_array_equal(toks[:66], [33] + first + [34] + first)
        exp_loss = np.zeros(128, bool)
        exp_loss[34:66] = True
        exp_loss[100:] = True
        np.testing.assert_array_equal(loss, exp_loss)
        np.testing.assert_array_equal(aid, np.where(np.arange(128) < 66, np.where(exp_loss, 0, -1), -1))
        np.testing.assert_array_equal(grp, (aid == 0).astype(int))


def test_vocab_token_names_decode_and_chance():
    t = build_task("fullcopy", dict(n_tokens=4, context=10))
    assert t.vocab_size == 7 and t.bos_id == 5 and t.query_id == 6 and t.pad_id == 0
    assert t.token_names() == ["<pad>", "1", "2", "3", "4", "<bos>", "<query>"]
    assert t.decode([5, 3, 1, 2, 4, 6, 3, 1, 2, 4, 9]) == "<bos> 3 1 2 4 <query> 3 1 2 4 <unk_9>"
    assert t.num_groups == 2 and t.group_name == "copy"
    assert t.chance is None and t.token_chance == pytest.approx(0.25)
    d = build_task("fullcopy", {})
    assert d.n_tokens == 500 and d.context == 1024 and d.max_instance_len("train") == 1002
    txt = d.decode(d.instance("val", 1).tokens)
    assert txt.isprintable() and txt.startswith("<bos> ")
    assert all(s.isprintable() for s in d.token_names())


BAD = [
    (dict(n_tokens=1), "task.n_tokens"),
    (dict(n_tokens="500"), "task.n_tokens"),
    (dict(n_tokens=2**21), "task.n_tokens"),
    (dict(vocab="official"), "task.vocab"),
    (dict(vocab="bpe"), "task.vocab"),
    (dict(tail="keep"), "task.tail"),
    (dict(context=0), "task.context"),
    (dict(seed=-2), "task.seed"),
    (dict(loss_on="all"), "task.loss_on"),
    (dict(name="copy"), "task.name"),
]


@pytest.mark.parametrize("cfg,key", BAD)
def test_config_errors_name_key_value_and_allowed(cfg, key):
    with pytest.raises(ConfigError) as e:
        build_task("fullcopy", cfg)
    assert e.value.key == key
    msg = str(e.value)
    assert key in msg and "allowed" in msg and repr(e.value.value) in msg


def test_official_vocab_rejected_with_reason():
    with pytest.raises(ConfigError, match="no full-copy generator"):
        build_task("fullcopy", dict(vocab="official"))
