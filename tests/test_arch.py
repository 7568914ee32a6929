"""LlamaCanon end to end: architecture matrix, dtypes, parameter counts re-derived by hand, init, loss.

Sources: paper §4 (Canon placements and widths), Result 2 (≈ 0.5 % overhead), official
`huggingface/modeling_llama_canon.py` (block, init), lingua (z-loss).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from canonlm.arch import Canon, ConfigError, LlamaCanon, build_model_config, lm_loss

V = 40


def tiny(canon="ABCD", pos="rope", qk_norm="none", **model):
    pos_cfg = {"type": pos, "fraction": 0.25} if pos == "partial_rope" else {"type": pos}
    return build_model_config(
        {"size": "2L64D", "qk_norm": qk_norm, **model}, canon={"set": canon}, pos=pos_cfg, vocab_size=V, max_seq_len=32
    )


# ------------------------------------------------------------------------------------------ architecture matrix

CANON_SETS = ["".join(c) for r in range(5) for c in itertools.combinations("ABCD", r)]  # all 16 subsets


# every pos x QK-norm x Canon subset (3 x 3 x 16 tiny models)
MATRIX = [
    (p, q, c) for p in ("rope", "partial_rope", "nope") for q in ("none", "whole", "per_head") for c in CANON_SETS
]


@pytest.mark.parametrize("pos,qk_norm,canon", MATRIX)
def test_forward_backward_matrix(pos, qk_norm, canon):
    torch.manual_seed(0)
    model = LlamaCanon(tiny(canon, pos, qk_norm))
    ids = torch.randint(0, V, (2, 12))
    logits = model(ids)
    assert logits.shape == (2, 12, V) and logits.dtype == torch.float32 and not logits._is_view()
    out = lm_loss(logits, torch.randint(0, V, (2, 12)), torch.ones(2, 12, dtype=torch.bool))
    out["loss_sum"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        # RMSNorm gains get zero grad at init only if nothing flows; every weight should receive signal
        assert p.grad.abs().sum() > 0, name
    n_canon = sum(isinstance(m, Canon) for m in model.modules())
    assert n_canon == 2 * len(canon)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=1),
        dict(mlp="standard", mlp_act="relu2"),
        dict(mlp="standard", mlp_act="gelu"),
        dict(mlp_act="relu2"),
        dict(tie_embeddings=True),
        dict(init="lingua"),
    ],
)
def test_variants_forward_backward(kw):
    torch.manual_seed(0)
    model = LlamaCanon(tiny("ABCD", "partial_rope", "whole", **kw))
    logits = model(torch.randint(0, V, (2, 10)))
    logits.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_canon_widths_follow_spec_table():
    """Paper §4: A, C = d; B = (H + 2 H_kv)·d_head; D = 2·d_ff (gated) or d_ff (standard MLP = 4d)."""
    cfg = build_model_config({"size": "2L128D", "n_kv_heads": 2}, canon={"set": "ABCD"}, vocab_size=V)
    blk = LlamaCanon(cfg).blocks[0]
    H, Hkv, dh = 4, 2, 32
    assert (blk.canon_a.channels, blk.canon_c.channels) == (128, 128)
    assert blk.attn.canon_b.channels == (H + 2 * Hkv) * dh
    assert blk.mlp.canon_d.channels == 2 * cfg.ffn_dim
    std = LlamaCanon(build_model_config({"size": "2L128D", "mlp": "standard"}, canon={"set": "D"}, vocab_size=V))
    assert std.blocks[0].mlp.canon_d.channels == 4 * 128


def test_bf16_autocast_forward_backward():
    torch.manual_seed(0)
    model = LlamaCanon(tiny("ABCD", "partial_rope", "whole"))
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        ref = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        out = lm_loss(logits, ids, torch.ones_like(ids, dtype=torch.bool))
    assert logits.dtype == torch.bfloat16 and out["loss_sum"].dtype == torch.float32
    torch.testing.assert_close(logits.float(), ref, rtol=0.05, atol=0.05)
    out["loss_sum"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_reference_ops_match_auto():
    torch.manual_seed(0)
    cfg_auto = tiny("ABCD", "rope", "whole", n_kv_heads=1)
    cfg_ref = tiny("ABCD", "rope", "whole", n_kv_heads=1, ops="reference")
    a, r = LlamaCanon(cfg_auto), LlamaCanon(cfg_ref)
    r.load_state_dict(a.state_dict())
    assert r.backends == {"canon": "reference", "attention": "reference"}
    assert a.backends["attention"] == "sdpa"
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), r(ids), rtol=1e-5, atol=1e-5)
    # pinning one op
    p = LlamaCanon(tiny("AB", kernels={"attention": "reference"}))
    assert p.backends["attention"] == "reference"


def test_fused_ops_need_a_fast_canon_kernel():
    from canonlm.ops import canon as canon_ops

    cfg = tiny("AB", ops="fused")
    model = LlamaCanon(cfg)  # never refused at construction: the request is decided where the model is placed
    if canon_ops.available_backends("cpu", torch.float32)["cpu"] is None:  # native CPU kernel builds here
        assert model.backends == {"canon": "cpu", "attention": "sdpa"} and not model.pending
        assert model.place("cpu", torch.float32) == {"canon": "cpu", "attention": "sdpa"}
    else:
        assert "canon" in model.pending
        with pytest.raises(ConfigError) as e:
            model.place("cpu", torch.float32)
        assert e.value.key == "model.ops"


def test_place_sets_every_module():
    model = LlamaCanon(tiny("ABCD"))
    model.cfg.ops = "reference"
    got = model.place("cpu", torch.float32)
    assert got == {"canon": "reference", "attention": "reference"}
    assert all(m.backend == "reference" for m in model.modules() if isinstance(m, Canon))
    assert all(b.attn.backend == "reference" for b in model.blocks)


def test_activation_checkpointing_same_grads():
    torch.manual_seed(0)
    model = LlamaCanon(tiny("ABCD", "partial_rope", "whole"))
    ids = torch.randint(0, V, (2, 12))
    model(ids).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing(True)
    model(ids).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7)


def test_seq_len_limit_and_bad_input():
    model = LlamaCanon(tiny())
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(33, dtype=torch.long))


# ------------------------------------------------------------------------------------------ parameter counts


def expected_params(L, d, H, Hkv, d_ff, Vocab, canon="", K=4, mlp="gated", qk_norm="none", tied=False):
    """Re-derived by hand (paper §4): embedding + head + L·(attn + mlp + 2 norms + Canon) + final norm."""
    dh = d // H
    attn = d * (H + 2 * Hkv) * dh + H * dh * d
    mlp_p = (3 if mlp == "gated" else 2) * d * d_ff
    qk = {"none": 0, "whole": (H + Hkv) * dh, "per_head": 2 * dh}[qk_norm]
    widths = {"A": d, "B": (H + 2 * Hkv) * dh, "C": d, "D": (2 if mlp == "gated" else 1) * d_ff}
    canon_p = sum(K * widths[c] for c in canon)
    return Vocab * d * (1 if tied else 2) + L * (attn + mlp_p + 2 * d + qk + canon_p) + d


def meta_model(size, canon="", **kw):
    vocab = kw.pop("vocab", 32000)
    cfg = build_model_config({"size": size, **kw}, canon={"set": canon}, vocab_size=vocab)
    with torch.device("meta"):
        return LlamaCanon(cfg)


def test_param_count_12L768D_canon_abcd():
    base, full = meta_model("12L768D"), meta_model("12L768D", "ABCD")
    # 12·4·(2·768 + 2304 + 2·2048) = 380,928 extra weights
    assert full.num_params() - base.num_params() == 380_928 == 12 * 4 * (2 * 768 + 2304 + 2 * 2048)
    d, L, d_ff, Vocab = 768, 12, 2048, 32000
    assert base.num_params() == Vocab * d * 2 + L * (4 * d * d + 3 * d * d_ff + 2 * d) + d
    assert full.num_params() == expected_params(12, 768, 12, 12, 2048, Vocab, "ABCD")
    # paper §3: non-embedding ≈ 12·d²·L = 85M
    assert abs(base.num_params(non_embedding=True) / (12 * d * d * L) - 1) < 0.001
    # "≈ 0.45 %" overhead (paper Result 2: about 0.5 %)
    assert 0.0044 < 380_928 / base.num_params(non_embedding=True) < 0.0046


# d_ff for the gated MLP: 8d/3 rounded up to a multiple of 256 (lingua): 512 -> 1536, 256 -> 768.
@pytest.mark.parametrize(
    "size,kw,canon,exp",
    [
        ("8L512D", {}, "AC", dict(L=8, d=512, H=8, Hkv=8, d_ff=1536)),
        (
            "12L512D",
            {"n_kv_heads": 2, "qk_norm": "whole"},
            "ABCD",
            dict(L=12, d=512, H=8, Hkv=2, d_ff=1536, qk_norm="whole"),
        ),
        ("8L768D", {"mlp": "standard"}, "BD", dict(L=8, d=768, H=12, Hkv=12, d_ff=3072, mlp="standard")),
        (
            "4L256D",
            {"qk_norm": "per_head", "tie_embeddings": True},
            "ABD",
            dict(L=4, d=256, H=4, Hkv=4, d_ff=768, qk_norm="per_head", tied=True),
        ),
    ],
)
def test_param_counts_match_formula(size, kw, canon, exp):
    model = meta_model(size, canon, **kw)
    assert model.num_params() == expected_params(Vocab=32000, canon=canon, **exp)


def test_lingua_1b_canon_overhead():
    """The official 1B recipe (24L, d 2048, d_ff 5632) Canon-ABCD adds 86,016 per layer (2.06 M total)."""
    kw = dict(d_ff=5632, n_heads=32)
    delta = meta_model("24L2048D", "ABCD", **kw).num_params() - meta_model("24L2048D", "", **kw).num_params()
    assert delta == 24 * 86_016


def test_flops_per_token():
    """CanonLM.flops_per_token is canonlm.arch.flops' training total; for Llama it equals PaLM's 6·N + 12·L·d·T with
    N the parameters that take part in products (no embedding lookup, no norm gains; Canon counts 2·K·C forward)."""
    from canonlm.arch import flops

    model = meta_model("12L768D", "ABCD", vocab=1000)
    assert model.flops_per_token(2048) == flops.flops_per_token(model.cfg, 2048)["total"]
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    N = model.num_params() - 1000 * 768 - norms
    assert model.flops_per_token(2048) == 6 * N + 12 * 12 * 768 * 2048


# ------------------------------------------------------------------------------------------ init


def test_hf_normal_and_norm_init():
    torch.manual_seed(0)
    model = LlamaCanon(
        build_model_config({"size": "2L128D", "qk_norm": "whole", "init_std": 0.05}, canon={"set": "B"}, vocab_size=512)
    )
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif "canon" not in name:
            assert abs(p.std().item() - 0.05) < 0.004 and abs(p.mean().item()) < 0.005, name


def test_lingua_init():
    torch.manual_seed(0)
    cfg = build_model_config({"size": "2L256D", "init": "lingua"}, canon={"set": "ABCD"}, vocab_size=512)
    model = LlamaCanon(cfg)
    d, d_ff = 256, cfg.ffn_dim
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "canon" in name:
            continue
        sigma = d_ff**-0.5 if name.endswith("mlp.w2.weight") else d**-0.5
        assert p.abs().max() <= 3 * sigma + 1e-7, name
        # std of N(0, σ²) truncated at ±3σ: σ·sqrt(1 - 6φ(3)/(Φ(3)-Φ(-3)))
        phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
        Z = math.erf(3 / math.sqrt(2))
        assert abs(p.std().item() / (sigma * math.sqrt(1 - 6 * phi3 / Z)) - 1) < 0.05, name
    w = model.blocks[0].canon_a.weight
    assert w.abs().max() <= 0.5 and w.abs().max() > 0.45  # Canon keeps its own init under lingua too


def test_rope_buffers_rebuilt_after_meta():
    cfg = tiny("A", "partial_rope")
    ref = LlamaCanon(cfg)
    with torch.device("meta"):
        m = LlamaCanon(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    assert torch.equal(m.rope_cos, ref.rope_cos) and torch.equal(m.rope_sin, ref.rope_sin)
    assert "rope_cos" not in m.state_dict()


# ------------------------------------------------------------------------------------------ loss


def loss_oracle(logits, targets, mask, z_loss, coef):
    """Per-token loop in float64: nll = log Σ exp(l) - l[target]."""
    B, T, _ = logits.shape
    loss = nll_s = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            row = logits[b, t].double()
            lse = math.log(sum(math.exp(v) for v in row.tolist()))
            nll = lse - row[targets[b, t]].item()
            extra = {"none": 0.0, "lingua": coef * nll * nll, "palm": coef * lse * lse}[z_loss]
            loss += nll + extra
            nll_s += nll
    return loss, nll_s


@pytest.mark.parametrize("z_loss", ["none", "lingua", "palm"])
def test_lm_loss_matches_oracle(z_loss):
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    targets = torch.randint(0, 11, (2, 6))
    mask = torch.rand(2, 6) > 0.4
    targets[~mask] = -7  # garbage at unmasked positions must be ignored
    out = lm_loss(logits, targets, mask, z_loss=z_loss, z_coef=0.01)
    loss, nll = loss_oracle(logits, targets, mask, z_loss, 0.01)
    for k in ("loss_sum", "nll_sum", "n_tokens"):
        assert out[k].dim() == 0 and out[k].dtype == torch.float32
    assert out["n_tokens"].item() == mask.sum().item()
    assert abs(out["loss_sum"].item() - loss) < 1e-4 and abs(out["nll_sum"].item() - nll) < 1e-4


def test_lm_loss_bf16_logits_in_fp32_and_grad():
    torch.manual_seed(0)
    logits = (torch.randn(1, 5, 7) * 2).bfloat16().requires_grad_()
    t = torch.randint(0, 7, (1, 5))
    out = lm_loss(logits, t, None, z_loss="palm")
    loss, _ = loss_oracle(logits.detach().float(), t, torch.ones(1, 5, dtype=torch.bool), "palm", 1e-4)
    assert out["loss_sum"].dtype == torch.float32 and abs(out["loss_sum"].item() - loss) < 1e-4
    out["loss_sum"].backward()
    ref = torch.autograd.grad(
        F.cross_entropy(logits.float().view(-1, 7), t.view(-1), reduction="sum")
        + 1e-4 * torch.logsumexp(logits.float(), -1).square().sum(),
        logits,
    )[0]
    torch.testing.assert_close(logits.grad.float(), ref.float(), rtol=1e-2, atol=1e-3)


def test_lm_loss_bad_mode():
    with pytest.raises(ConfigError) as e:
        lm_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), None, z_loss="square")
    assert e.value.key == "loss.z_loss"
    with pytest.raises(ValueError, match="mask"):
        lm_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))


# ------------------------------------------------------------------------------------------ compile


@pytest.mark.slow
def test_block_compile_keeps_keys_and_values():
    torch.manual_seed(0)
    model = LlamaCanon(build_model_config({"size": "1L64D"}, canon={"set": "ABCD"}, vocab_size=V, max_seq_len=16))
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        ref = model(ids)
    keys = list(model.state_dict())
    for blk in model.blocks:
        blk.compile()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref, rtol=1e-5, atol=1e-5)
    assert list(model.state_dict()) == keys
