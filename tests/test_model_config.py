"""Every bad model input gives one ConfigError naming the key, the value and what is allowed."""

from __future__ import annotations

import pytest
import torch

from canonlm.arch import ConfigError, LlamaCanon, build_model_config, parse_size


def build(model=None, canon=None, pos=None, **kw):
    return build_model_config({"size": "2L64D", **(model or {})}, canon=canon, pos=pos, vocab_size=16, **kw)


def expect(key, value, fn, *args, **kwargs):
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    assert e.value.key == key and e.value.value == value
    msg = str(e.value)
    assert key in msg and repr(value) in msg and "allowed" in msg
    return e.value


@pytest.mark.parametrize("letters", ["E", "ABE", "b", "Ab", "abcd"])
def test_unknown_canon_letter(letters):
    err = expect("canon.set", letters, build, canon={"set": letters})
    assert "ABCD" in err.allowed
    if letters == "b":
        assert "linear models" in err.allowed


def test_canon_set_repeated_letters_are_refused_and_the_release_bb_is_normalised():
    # a repeated letter would train "ABD" under the label "AABDD" (issue: identical models, two report cells)
    err = expect("canon.set", "AABDD", build, canon={"set": "AABDD"})
    assert "repeated: A, D" in err.allowed
    # the release's spelling of the mixer's own conv: 'AbbCD' is Canon-AbCD (one b), on a linear model
    cfg = build({"arch": "gla", "n_heads": 2}, canon={"set": "AbbCD"})
    assert cfg.canon.set == "AbCD" and cfg.canon.letters == frozenset("AbCD")


def test_heads_must_divide_d_model():
    expect("model.n_heads", 3, build, {"d_model": 64, "n_heads": 3})
    expect("model.n_kv_heads", 3, build, {"n_kv_heads": 3})


@pytest.mark.parametrize("fraction", [0, 0.0, 1.5, -0.25])
def test_partial_rope_fraction_out_of_range(fraction):
    expect("pos.fraction", fraction, build, pos={"type": "partial_rope", "fraction": fraction})


def test_partial_rope_odd_width():
    # head_dim 32 * 0.1 = 3.2 -> 3 rotated channels: odd
    expect("pos.fraction", 0.1, build, pos={"type": "partial_rope", "fraction": 0.1})


@pytest.mark.parametrize("size", ["12L768", "huge", "L768D", "12l768d"])
def test_unknown_size(size):
    expect("model.size", size, parse_size, size)
    expect("model.size", size, build_model_config, {"size": size})


def test_unknown_keys():
    expect("model.hidden_size", 768, build, {"hidden_size": 768})
    expect("canon.kernel_size", 4, build, canon={"kernel_size": 4})
    expect("pos.rope_theta", 1e4, build, pos={"rope_theta": 1e4})


@pytest.mark.parametrize(
    "model,key,value",
    [
        ({"qk_norm": "true"}, "model.qk_norm", "true"),
        ({"mlp": "moe"}, "model.mlp", "moe"),
        ({"mlp_act": "tanh"}, "model.mlp_act", "tanh"),
        ({"init": "xavier"}, "model.init", "xavier"),
        ({"ops": "fast"}, "model.ops", "fast"),
        ({"kernels": {"mlp": "fused"}}, "model.kernels", "mlp"),
        ({"arch": "rwkv"}, "model.arch", "rwkv"),
    ],
)
def test_bad_choices(model, key, value):
    expect(key, value, build, model)


def test_bad_pos_choices():
    expect("pos.type", "alibi_x", build, pos={"type": "alibi_x"})
    expect("pos.pairing", "neox", build, pos={"pairing": "neox"})
    expect("canon.init", "zeros", build, canon={"init": "zeros"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_flash_requested_on_cpu_fails_at_placement():
    """A pinned kernel is resolved where the model runs: construction on the CPU (before a move to the GPU) holds
    the request; placing it on the CPU is the ConfigError (and so is a forward before any placement)."""
    cfg = build({"kernels": {"attention": "flash"}})
    model = LlamaCanon(cfg)
    assert "attention" in model.pending
    err = expect("model.kernels.attention", "flash", model.place, "cpu", torch.bfloat16)
    assert "sdpa" in err.allowed
    expect("model.kernels.attention", "flash", model, torch.zeros(1, 4, dtype=torch.long))


def test_unknown_attention_backend_fails_at_construction():
    cfg = build({"kernels": {"attention": "xformers"}})
    expect("model.kernels.attention", "xformers", LlamaCanon, cfg)


def test_unknown_canon_backend_fails_at_construction():
    cfg = build({"kernels": {"canon": "no_such_kernel"}}, canon={"set": "A"})
    expect("model.kernels.canon", "no_such_kernel", LlamaCanon, cfg)
