"""canonlm.data.lm.LanguageModel: batched generation and log-probabilities against naive one-sequence loops, and the
sampling law against the softmax it should draw from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from canonlm.arch.config import build_model_config
from canonlm.arch.model import LlamaCanon
from canonlm.data.lm import LanguageModel


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = build_model_config(
        {"arch": "llama", "size": "2L64D", "ops": "reference"},
        {"set": "ABCD"},
        {"type": "rope"},
        vocab_size=11,
        max_seq_len=64,
    )
    m = LlamaCanon(cfg).eval()
    return m


def naive_greedy(model, prompt, max_new, stops):
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([seq]))[0, -1]
            t = int(logits.argmax())
            out.append(t)
            seq.append(t)
            if t in stops:
                break
    return out


def test_greedy_matches_one_prompt_at_a_time(tiny_model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 11, size=int(n)) for n in (3, 9, 1, 14, 6, 6, 2)]
    for bs in (1, 3, 16):
        lm = LanguageModel(tiny_model, vocab_size=11, batch_size=bs)
        got = lm.generate(prompts, max_new_tokens=7, stop_ids=(3, 5))
        for p, g in zip(prompts, got):
            assert g.tolist() == naive_greedy(tiny_model, p.tolist(), 7, {3, 5})


def test_max_len_caps_generation(tiny_model):
    lm = LanguageModel(tiny_model, vocab_size=11, batch_size=4, max_len=10)
    out = lm.generate([np.arange(1, 9)], max_new_tokens=20)
    assert len(out[0]) == 2
    with pytest.raises(ValueError, match="max_len"):
        lm.generate([np.arange(1, 11)], max_new_tokens=2)


def test_sync_keeps_ranks_in_lockstep(tiny_model):
    """With ``sync`` (FSDP), a rank whose rows are done keeps running dummy passes while another rank is active."""
    calls = []

    def fwd(x):
        calls.append(tuple(x.shape))
        return tiny_model(x)

    other_rank_active = iter([True] * 6 + [False] * 100)
    lm = LanguageModel(fwd, vocab_size=11, batch_size=4, sync=lambda local: local or next(other_rank_active))
    got = lm.generate([np.array([1, 2, 3])], max_new_tokens=2)
    assert len(got[0]) == 2
    assert len(calls) == 8 and calls[2:] == [(1, 1)] * 6  # 2 real steps, then dummies until the other rank stops
    assert got[0].tolist() == naive_greedy(tiny_model, [1, 2, 3], 2, set())


def test_logprobs_match_single_sequence_forward(tiny_model):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 11, size=int(n)) for n in (5, 12, 1, 8)]
    lm = LanguageModel(tiny_model, vocab_size=11, batch_size=3)
    got = lm.logprobs(seqs)
    with torch.no_grad():
        for s, g in zip(seqs, got):
            ref = torch.log_softmax(tiny_model(torch.tensor([s.tolist()]))[0].float(), -1).numpy()
            assert g.shape == (len(s), 11)
            np.testing.assert_allclose(g, ref, atol=1e-5)


def test_sampling_is_per_prompt_deterministic(tiny_model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 11, size=int(n)) for n in (4, 2, 7, 4, 9)]
    keys = np.arange(100, 105, dtype=np.uint64)
    a = LanguageModel(tiny_model, vocab_size=11, batch_size=1).generate(prompts, 6, temperature=1.0, keys=keys)
    b = LanguageModel(tiny_model, vocab_size=11, batch_size=5).generate(prompts, 6, temperature=1.0, keys=keys)
    perm = [3, 0, 4, 1, 2]
    c = LanguageModel(tiny_model, vocab_size=11, batch_size=2).generate(
        [prompts[i] for i in perm], 6, temperature=1.0, keys=keys[perm]
    )
    for i in range(5):
        assert a[i].tolist() == b[i].tolist()
        assert c[perm.index(i)].tolist() == a[i].tolist()


def test_sampling_follows_the_softmax():
    probs = np.array([0.0, 0.5, 0.3, 0.2])
    logits = torch.log(torch.tensor(probs, dtype=torch.float32).clamp_min(1e-30))

    def fwd(x):
        return logits.expand(x.shape[0], x.shape[1], 4)

    n = 20000
    lm = LanguageModel(fwd, vocab_size=4, batch_size=4096)
    out = lm.generate([np.array([1])] * n, max_new_tokens=1, temperature=1.0, keys=np.arange(n, dtype=np.uint64))
    freq = np.bincount([int(o[0]) for o in out], minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.015)
    # temperature 0.5 sharpens: p^2 renormalised
    out = lm.generate([np.array([1])] * n, max_new_tokens=1, temperature=0.5, keys=np.arange(n, dtype=np.uint64))
    freq = np.bincount([int(o[0]) for o in out], minlength=4) / n
    p2 = probs**2 / (probs**2).sum()
    np.testing.assert_allclose(freq, p2, atol=0.015)


def test_bad_arguments():
    lm = LanguageModel(lambda x: torch.zeros(*x.shape, 3), vocab_size=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate([np.array([1])], 0)
    with pytest.raises(ValueError, match="keys"):
        lm.generate([np.array([1])], 2, temperature=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        lm.generate([np.array([], dtype=np.int64)], 2)
    with pytest.raises(ValueError, match="batch_size"):
        LanguageModel(lambda x: x, vocab_size=3, batch_size=0)


def test_rows_stopping_at_different_steps():
    """A longer prompt that stops first must not break the shorter rows (regression)."""

    def fwd(x):
        out = torch.zeros(*x.shape, 5)
        out[..., 4] = 1.0
        out[x == 2, 3] = 5.0  # after a 2 the model says 3 (a stop id); otherwise 4
        return out

    lm = LanguageModel(fwd, vocab_size=5, batch_size=2)
    got = lm.generate([np.array([1, 1]), np.array([2, 2, 2, 2])], max_new_tokens=3, stop_ids=(3,))
    assert got[0].tolist() == [4, 4, 4] and got[1].tolist() == [3]
