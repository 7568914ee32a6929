"""Packing, scoring and the deterministic stream (paper App. A).

Oracles: a naive Python packer built only from ``task.instance`` and the documented packing rules, a naive
per-answer scoring loop, and stream identities (worker count, world size, resume)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from canonlm.data import ConfigError
from canonlm.data.metrics import score_answers
from canonlm.data.packing import pack_window, pack_windows
from canonlm.data.stream import SyntheticStream
from canonlm.data.tasks import build_task

TINY = dict(N=16, K=4, vocab_V=8, context=256)


@pytest.fixture(scope="module")
def tiny():
    return build_task("depo1", TINY)


# ---------------------------------------------------------------------------------------------- naive packer
def naive_pack(task, split, w, T, seed, tail="drop", G=8):
    """Concatenate instances (row, 0), (row, 1), ... until the row is covered, cut, score and renumber with loops."""
    row, length, part = (w, T, 0) if tail == "drop" else (w // G, G * T, w % G)
    toks, loss, ans, grp, starts = [], [], [], [], []
    i = 0
    while len(toks) < length:
        inst = task.instance(split, (row, i), seed=seed)
        s = len(toks)
        ends = {int(j): int(np.nonzero(inst.answer_id == j)[0].max()) + 1 + s for j in set(inst.answer_id) if j >= 0}
        for t in range(len(inst)):
            toks.append(int(inst.tokens[t]))
            loss.append(bool(inst.loss_mask[t]))
            j = int(inst.answer_id[t])
            ans.append(None if j < 0 else (i, j, ends[j]))
            grp.append(int(inst.group[t]))
            starts.append(s)
        i += 1
    lo, hi = part * T, (part + 1) * T
    out_t, out_l, out_a, out_g = toks[lo:hi], loss[lo:hi], [], []
    dense = {}
    for p in range(lo, hi):
        a = ans[p]
        ok = a is not None and starts[p] >= lo and a[2] <= hi
        if ok:
            dense.setdefault(a[:2], len(dense))
        out_a.append(dense[a[:2]] if ok else -1)
        out_g.append(grp[p] if ok else 0)
    out_l[0] = False
    return dict(tokens=np.array(out_t), loss_mask=np.array(out_l), answer_id=np.array(out_a), group=np.array(out_g))


CASES = [
    ("depo1", TINY, "train", "drop", 256),
    ("depo1", TINY, "test", "drop", 300),
    ("depo1", TINY, "train", "carry", 256),
    ("depo2", dict(N=10, K=6, vocab_V=3), "val", "carry", 400),
    ("depo2", dict(N=10, K=6, vocab_V=3), "train", "drop", 400),
    ("depo1", dict(TINY, loss_on="all", eos=True), "train", "drop", 256),
]


@pytest.mark.parametrize("name,cfg,split,tail,T", CASES)
def test_pack_window_matches_naive_packer(name, cfg, split, tail, T):
    task = build_task(name, cfg)
    idx = [0, 1, 7, 8, 9, 23, 1000003]
    batch = pack_windows(task, split, idx, T, seed=3, tail=tail, carry_group=4)
    for r, w in enumerate(idx):
        want = naive_pack(task, split, w, T, 3, tail, G=4)
        one = pack_window(task, split, w, T, 3, tail=tail, carry_group=4)
        for k in ("tokens", "loss_mask", "answer_id", "group"):
            np.testing.assert_array_equal(one[k], want[k], err_msg=f"{k} w={w}")
            np.testing.assert_array_equal(batch[k][r], want[k], err_msg=f"{k} w={w} (batched)")
        assert one["tokens"].dtype == np.int64 and one["loss_mask"].dtype == bool
        assert one["answer_id"].dtype == np.int32 and one["group"].dtype == np.int32


def test_window_layout_rules(tiny):
    """Starts at <bos> with its first instance whole; answer tokens are loss targets with group k >= 1; <ans> is a
    loss target but unscored; answers cut by the window end keep their loss but are not scored."""
    T = 256
    cut_answers = 0
    out = pack_windows(tiny, "train", np.arange(150), T, seed=0)
    for w in range(150):
        tok, lm, aid, grp = (out[k][w] for k in ("tokens", "loss_mask", "answer_id", "group"))
        first = tiny.instance("train", (w, 0), seed=0).tokens
        assert tok[0] == tiny.bos_id and np.array_equal(tok[: len(first)], first)
        assert not lm[0] and (tok != 0).all()
        sc = aid >= 0
        assert (lm[sc]).all() and (grp[sc] >= 1).all() and (grp[~sc] == 0).all()
        assert not sc[tok == tiny.ans_id].any() and lm[tok == tiny.ans_id][1:].all()
        ids = aid[sc]
        assert (np.unique(ids) == np.arange(ids.max() + 1 if ids.size else 0)).all()  # dense ids
        # the last instance: if the window end falls inside one of its answers, that answer keeps its loss
        # targets but is not scored
        s0 = int(np.nonzero(tok == tiny.bos_id)[0][-1])
        last = tiny.instance("train", (w, int((tok == tiny.bos_id).sum()) - 1), seed=0)
        c = T - s0
        np.testing.assert_array_equal(tok[s0:], last.tokens[:c])
        if c < len(last) and last.answer_id[c - 1] >= 0 and last.answer_id[c] == last.answer_id[c - 1]:
            part = s0 + np.nonzero(last.answer_id[:c] == last.answer_id[c])[0]
            assert (aid[part] == -1).all() and lm[part].all()
            cut_answers += 1
    assert cut_answers > 0


def test_window_too_short_raises_with_instance_length(tiny):
    need = tiny.max_instance_len("train")
    with pytest.raises(ConfigError) as e:
        pack_window(tiny, "train", 0, need - 1, seed=0)
    assert e.value.key == "task.context" and str(need) in str(e.value)
    pack_window(tiny, "train", 0, need, seed=0)
    with pytest.raises(ConfigError, match="task.context"):
        SyntheticStream(tiny, "test", window=need - 1, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="task.tail"):
        pack_window(tiny, "train", 0, 256, seed=0, tail="wrap")
    with pytest.raises(ValueError, match="split"):
        pack_window(tiny, "dev", 0, 256, seed=0)


# ---------------------------------------------------------------------------------------------- scoring
def naive_score(pred, batch, G):
    out = {k: [0] * G for k in ("answers_correct", "answers_total", "tokens_correct", "tokens_total")}
    tok, aid, grp = batch["tokens"].tolist(), batch["answer_id"].tolist(), batch["group"].tolist()
    pred = pred.tolist()
    for b in range(len(tok)):
        answers = {}
        for t in range(1, len(tok[b])):
            if aid[b][t] >= 0:
                answers.setdefault(aid[b][t], []).append(t)
        for ts in answers.values():
            g = grp[b][ts[0]]
            right = [pred[b][t] == tok[b][t] for t in ts]
            out["tokens_total"][g] += len(ts)
            out["tokens_correct"][g] += sum(right)
            out["answers_total"][g] += 1
            out["answers_correct"][g] += all(right)
    return {k: torch.tensor(v) for k, v in out.items()}


@pytest.mark.parametrize("p_right", [0.0, 0.6, 0.95, 1.0])
def test_score_answers_matches_naive_loop(p_right):
    task = build_task("depo2", dict(N=10, K=6, vocab_V=3))
    gen = torch.Generator().manual_seed(int(p_right * 100))
    stream = SyntheticStream(task, "test", window=400, batch_size=6, seed=1, num_steps=1)
    batch = next(iter(stream))
    noise = torch.randint(1, task.vocab_size, batch["tokens"].shape, generator=gen)
    keep = torch.rand(batch["tokens"].shape, generator=gen) < p_right
    pred = torch.where(keep, batch["tokens"], noise)
    pred[:, 0] = -7  # ignored
    got = score_answers(pred, batch, task.num_groups)
    want = naive_score(pred, batch, task.num_groups)
    for k in want:
        assert got[k].dtype == torch.int64 and got[k].shape == (task.num_groups,)
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])
    if p_right == 1.0:
        assert torch.equal(got["answers_correct"], got["answers_total"]) and got["answers_total"].sum() > 0
    if p_right == 0.0:
        assert got["answers_correct"].sum() <= got["answers_total"].sum() // 2


def test_score_answers_hand_example_and_errors():
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5, 6]])
    aid = torch.tensor([[-1, 0, 0, -1, 1, 1, 1]], dtype=torch.int32)
    grp = torch.tensor([[0, 2, 2, 0, 1, 1, 1]], dtype=torch.int32)
    pred = torch.tensor([[0, 1, 2, 0, 4, 0, 6]])  # answer 0 right (k=2); answer 1 has one wrong token (k=1)
    got = score_answers(pred, dict(tokens=tokens, answer_id=aid, group=grp), 3)
    assert got["answers_correct"].tolist() == [0, 0, 1] and got["answers_total"].tolist() == [0, 1, 1]
    assert got["tokens_correct"].tolist() == [0, 2, 2] and got["tokens_total"].tolist() == [0, 3, 2]
    nll = torch.tensor([[9.0, 0.5, 0.25, 7.0, 1.0, 2.0, 4.0]])  # position 0 and unscored positions are ignored
    got = score_answers(pred, dict(tokens=tokens, answer_id=aid, group=grp), 3, nll=nll)
    assert got["nll_sum"].dtype == torch.float64 and got["nll_sum"].tolist() == [0.0, 7.0, 0.75]
    assert got["answers_total"].tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="nll"):
        score_answers(pred, dict(tokens=tokens, answer_id=aid, group=grp), 3, nll=nll[:, :3])
    with pytest.raises(ValueError, match="num_groups"):
        score_answers(pred, dict(tokens=tokens, answer_id=aid, group=grp), 2)
    with pytest.raises(ValueError, match="same"):
        score_answers(pred[:, :3], dict(tokens=tokens, answer_id=aid, group=grp), 3)


# ---------------------------------------------------------------------------------------------- stream
def collect(loader, n=None):
    it = iter(loader)
    return list(it if n is None else itertools.islice(it, n))


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def test_batches_have_contract_shapes_and_dtypes(tiny):
    b = next(iter(SyntheticStream(tiny, "train", window=256, batch_size=3, seed=0)))
    assert set(b) == {"tokens", "loss_mask", "answer_id", "group"}
    assert all(v.shape == (3, 256) for v in b.values())
    assert (b["tokens"].dtype, b["loss_mask"].dtype, b["answer_id"].dtype, b["group"].dtype) == (
        torch.int64,
        torch.bool,
        torch.int32,
        torch.int32,
    )
    # global step s, rank r: windows [s*B*W + r*B, ...)
    s = SyntheticStream(tiny, "train", window=256, batch_size=3, seed=0, rank=1, world_size=2)
    assert s.window_indices(5).tolist() == [33, 34, 35]
    np.testing.assert_array_equal(s.batch(5)["tokens"][1].numpy(), pack_window(tiny, "train", 34, 256, 0)["tokens"])


@pytest.mark.parametrize("tail", ["drop", "carry"])
def test_same_stream_for_0_1_2_workers(tiny, tail):
    def run(nw, finite):
        s = SyntheticStream(
            tiny, "train", window=256, batch_size=2, seed=5, start_step=3, num_steps=5 if finite else None, tail=tail
        )
        return collect(DataLoader(s, batch_size=None, num_workers=nw), None if finite else 5)

    ref = run(0, True)
    assert len(ref) == 5
    for nw in (1, 2):
        assert_same(run(nw, True), ref)
    assert_same(run(2, False), ref)


def test_world_size_1_equals_concatenated_rank_slices(tiny):
    one = collect(SyntheticStream(tiny, "val", window=256, batch_size=4, seed=0, num_steps=3))
    ranks = [
        collect(SyntheticStream(tiny, "val", window=256, batch_size=2, seed=0, rank=r, world_size=2, num_steps=3))
        for r in (0, 1)
    ]
    for s in range(3):
        for k in one[s]:
            assert torch.equal(one[s][k], torch.cat([ranks[0][s][k], ranks[1][s][k]]))
    # ranks never see the same windows
    assert not torch.equal(ranks[0][0]["tokens"], ranks[1][0]["tokens"])


def test_resume_from_state_dict_mid_stream(tiny):
    full = SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0)
    ref = collect(full, 7)
    part = SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0)
    it = iter(part)
    first = [next(it) for _ in range(3)]
    state = part.state_dict()
    assert state == {"step": 3}
    resumed = SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0)
    resumed.load_state_dict(state)
    assert_same(first + collect(resumed, 4), ref)
    assert_same(collect(SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0, start_step=3), 4), ref[3:])
    # resumed with 2 workers
    again = SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0)
    again.load_state_dict(state)
    assert_same(collect(DataLoader(again, batch_size=None, num_workers=2), 4), ref[3:])


def test_finite_streams_replay_and_splits_differ(tiny):
    val = SyntheticStream(tiny, "val", window=256, batch_size=2, seed=0, num_steps=3)
    assert len(val) == 3
    assert_same(collect(val), collect(val))
    b = {
        s: next(iter(SyntheticStream(tiny, s, window=256, batch_size=2, seed=0)))["tokens"]
        for s in ("train", "val", "test")
    }
    assert not torch.equal(b["train"], b["val"]) and not torch.equal(b["val"], b["test"])
    other = next(iter(SyntheticStream(tiny, "train", window=256, batch_size=2, seed=1)))["tokens"]
    assert not torch.equal(other, b["train"])
    with pytest.raises(TypeError):
        len(SyntheticStream(tiny, "train", window=256, batch_size=2, seed=0))


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=0),
        dict(rank=2, world_size=2),
        dict(world_size=0),
        dict(start_step=-1),
        dict(num_steps=-2),
        dict(seed=-1),
    ],
)
def test_stream_bad_arguments(tiny, kw):
    args = dict(window=256, batch_size=2, seed=0) | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        SyntheticStream(tiny, "train", **args)
