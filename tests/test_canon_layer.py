"""Canon module (canonlm.arch.canon.Canon) against independent oracles (paper eq. 4.1; ``causal_conv1d_ref``)."""

from __future__ import annotations

import math

import pytest
import torch

from canonlm.arch import Canon, CanonConfig, LlamaCanon, build_model_config
from canonlm.ops.canon.naive import canon_loop


def loop_oracle(x, w, b=None, residual=True, activation=False):
    """The shared plain-loop oracle, in float64."""
    return canon_loop(x.double(), w.double(), None if b is None else b.double(), residual, activation)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "residual,activation,bias", [(True, False, False), (False, False, False), (True, True, True), (False, True, False)]
)
def test_canon_matches_loop_over_taps(K, residual, activation, bias):
    torch.manual_seed(K)
    cfg = CanonConfig(set="A", kernel=K, residual=residual, activation=activation, bias=bias)
    m = Canon(24, cfg, backend="auto")
    if bias:
        with torch.no_grad():
            m.bias.normal_()
    x = torch.randn(3, 11, 24)
    y = m(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(
        y.double(),
        loop_oracle(x, m.weight.detach(), m.bias.detach() if bias else None, residual, activation),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_canon_causality(backend):
    torch.manual_seed(0)
    m = Canon(16, CanonConfig(kernel=4), backend=backend)
    x = torch.randn(2, 12, 16)
    t = 5
    x2 = x.clone()
    x2[:, t] += torch.randn(2, 16)
    y, y2 = m(x), m(x2)
    torch.testing.assert_close(y[:, :t], y2[:, :t], rtol=0, atol=0)
    # the perturbation reaches exactly t .. t+K-1 (depthwise, kernel 4) and nothing later
    assert (y[:, t : t + 4] - y2[:, t : t + 4]).abs().amax(dim=(0, 2)).min() > 0
    torch.testing.assert_close(y[:, t + 4 :], y2[:, t + 4 :], rtol=0, atol=0)


@pytest.mark.parametrize("pos", ["rope", "nope"])
def test_model_causality(pos):
    torch.manual_seed(0)
    cfg = build_model_config({"size": "2L64D"}, canon={"set": "ABCD"}, pos={"type": pos}, vocab_size=32, max_seq_len=32)
    model = LlamaCanon(cfg).eval()
    ids = torch.randint(0, 32, (2, 20))
    t = 9
    ids2 = ids.clone()
    ids2[:, t] = (ids[:, t] + 1) % 32
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=(0, 2)).min() > 0  # every later position sees the change


def _canon_modules(model):
    return [m for m in model.modules() if isinstance(m, Canon)]


def test_default_init_is_uniform_and_survives_model_init():
    torch.manual_seed(0)
    cfg = build_model_config({"size": "2L128D"}, canon={"set": "ABCD"}, vocab_size=64)
    model = LlamaCanon(cfg)
    model.init_weights()
    w = torch.cat([m.weight.detach().flatten() for m in _canon_modules(model)])
    assert w.numel() == 2 * 4 * (2 * 128 + 3 * 128 + 2 * cfg.ffn_dim)
    # U(-1/sqrt(K), 1/sqrt(K)) = U(-0.5, 0.5) for K = 4: bounds, mean 0, std 1/sqrt(12)
    assert w.abs().max() <= 0.5 and w.min() < -0.49 and w.max() > 0.49
    assert abs(w.mean().item()) < 0.01
    assert abs(w.std().item() - 1 / math.sqrt(12)) < 0.005
    # each decile of U(-0.5, 0.5) holds ~10 % of the weights
    counts = torch.histc(w, bins=10, min=-0.5, max=0.5) / w.numel()
    assert (counts - 0.1).abs().max() < 0.01
    # everything else: hf_normal std 0.02
    for name, p in model.named_parameters():
        if p.dim() == 2 and "canon" not in name:
            assert abs(p.std().item() - 0.02) < 0.002, name


@pytest.mark.parametrize("K", [2, 3, 8])
def test_default_init_bound_depends_on_K(K):
    torch.manual_seed(0)
    w = Canon(4096, CanonConfig(kernel=K)).weight.detach()
    bound = 1 / math.sqrt(K)
    assert w.abs().max() <= bound and w.abs().max() > 0.98 * bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.01 * bound


def test_meta_build_then_init_weights_gives_default_canon_init():
    cfg = build_model_config({"size": "2L128D"}, canon={"set": "ABCD"}, vocab_size=64)
    with torch.device("meta"):
        model = LlamaCanon(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    w = torch.cat([m.weight.detach().flatten() for m in _canon_modules(model)])
    assert w.abs().max() <= 0.5 and abs(w.std().item() - 1 / math.sqrt(12)) < 0.005
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    assert torch.isfinite(model(torch.randint(0, 64, (1, 8)))).all()


def test_cst_canon_is_frozen():
    cfg = build_model_config({"size": "2L64D"}, canon={"set": "ABCD", "trainable": False, "bias": True}, vocab_size=32)
    model = LlamaCanon(cfg)
    canons = _canon_modules(model)
    assert len(canons) == 8
    for m in canons:
        assert not m.weight.requires_grad and not m.bias.requires_grad
    model(torch.randint(0, 32, (2, 10))).sum().backward()
    assert all(m.weight.grad is None for m in canons)
    assert model.blocks[0].attn.wqkv.weight.grad is not None


def test_identity_init_residual_doubles_input():
    x = torch.randn(2, 9, 12)
    m = Canon(12, CanonConfig(kernel=4, init="identity"))
    assert torch.equal(m.weight.detach(), torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(12, 4))
    torch.testing.assert_close(m(x), 2 * x)
    m_nores = Canon(12, CanonConfig(kernel=4, init="identity", residual=False))
    torch.testing.assert_close(m_nores(x), x)


def test_fixed_init_lag_weights():
    m = Canon(3, CanonConfig(kernel=4, init="fixed"))
    # current token (last tap) 1, then 0.4, 0.2, 0.1 going back in time (footnote 10)
    assert torch.allclose(m.weight.detach(), torch.tensor([0.1, 0.2, 0.4, 1.0]).expand(3, 4))
    m5 = Canon(2, CanonConfig(kernel=5, init="fixed"))
    assert torch.allclose(m5.weight.detach(), torch.tensor([0.0, 0.1, 0.2, 0.4, 1.0]).expand(2, 5))


def test_bias_zero_after_model_init():
    cfg = build_model_config({"size": "2L64D"}, canon={"set": "AC", "bias": True}, vocab_size=32)
    model = LlamaCanon(cfg)
    for m in _canon_modules(model):
        with torch.no_grad():
            m.bias.fill_(3.0)
    model.init_weights()
    assert all(torch.count_nonzero(m.bias) == 0 for m in _canon_modules(model))


def test_canon_rejects_wrong_width():
    with pytest.raises(ValueError, match="channels"):
        Canon(8, CanonConfig())(torch.randn(1, 4, 6))
