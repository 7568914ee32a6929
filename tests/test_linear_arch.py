"""GLA / GDN / Mamba2 with Canon layers (paper App. C): configs, parameter counts, each mixer against a plain
loop written from the papers' formulas, inits, decode caches (token by token == one full forward, for every
architecture and Canon setting), cached generation == uncached generation, bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from canonlm.arch import CanonLM, ConfigError, build_model_config
from canonlm.data.lm import LanguageModel
from canonlm.ops.canon.naive import canon_loop
from canonlm.ops.gdn.naive import gdn_loop
from canonlm.ops.gla.naive import gla_loop
from canonlm.ops.ssd.naive import ssd_loop

from conftest import ARCH_PRESETS as PRESETS


def build(preset, canon="", size="2L64D", vocab=32, dtype=torch.float64, **kw):
    model = dict(PRESETS[preset], size=size, **kw)
    cfg = build_model_config(
        model, canon={"set": canon}, pos={"type": "rope"}, vocab_size=vocab, max_seq_len=256, ops="reference"
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = CanonLM(cfg)
    return m.to(dtype)


# ------------------------------------------------------------------------------------------------ parameter counts


def expected_params(preset, L, d, V, canon="", K=4, r_gate=16):
    """Independent count from paper §4 and App. C (per-layer pieces written out one by one)."""
    p = dict(PRESETS[preset])
    arch = p["arch"]
    per_layer = d  # attn_norm
    has_mlp = p.get("mlp", "gated") != "none"
    if arch == "gla" or arch == "gdn":
        Kd, Vd = int(p["expand_k"] * d), int(p["expand_v"] * d)
        H = 4 if preset == "gla" else (max(4, d // 128) if preset == "gdn" else max(1, Kd // 128))
        per_layer += d * Kd * 2 + d * Vd + Vd * d  # q, k, v, o
        if p.get("output_gate_rank", 0):
            per_layer += d * r_gate + r_gate * Vd + Vd  # low-rank output gate (+ bias)
        else:
            per_layer += d * Vd  # full-rank output gate
        per_layer += Vd // H  # per-head output norm gain
        if arch == "gla":
            per_layer += d * 16 + 16 * Kd + Kd  # low-rank forget gate (+ bias)
        else:
            per_layer += 2 * d * H + 2 * H  # a_proj, b_proj, A_log, dt_bias
        if "b" in canon:
            per_layer += 4 * (2 * Kd + Vd)  # three short convs, no bias
        if "B" in canon:
            per_layer += K * (2 * Kd + Vd)
    else:  # mamba2
        H, N, di = 16, 64, 2 * d
        per_layer += d * (2 * di + 2 * N + H) + di * d + di + 3 * H  # in_proj, out_proj, gated norm, dt_bias/A_log/D
        if "b" in canon:
            per_layer += 4 * (di + 2 * N) + (di + 2 * N)  # conv1d weight + bias
        if "B" in canon:
            per_layer += K * (2 * di + 2 * N + H)
    if "A" in canon:
        per_layer += K * d
    if has_mlp:
        I = 2 * d if p.get("ffn_ratio") else 256 * math.ceil(8 * d / 3 / 256)
        per_layer += d + 3 * d * I  # mlp_norm + gated MLP
        per_layer += K * d * ("C" in canon) + K * 2 * I * ("D" in canon)
    return L * per_layer + 2 * V * d + d


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "llama"])
@pytest.mark.parametrize("canon", ["", "b", "AbCD", "ABCD"])
@pytest.mark.parametrize("size", ["2L64D", "12L768D"])
def test_param_counts_match_spec(preset, canon, size):
    if preset == "mamba2_nomlp":
        canon = canon.replace("C", "").replace("D", "")
    L, d = (2, 64) if size == "2L64D" else (12, 768)
    if preset == "mamba2_nomlp":
        L *= 2  # 2ℓ layers (paper App. C)
    model = dict(PRESETS[preset], size=size)
    cfg = build_model_config(model, canon={"set": canon}, vocab_size=50)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = CanonLM(cfg)
    assert len(m.blocks) == L
    assert m.num_params() == expected_params(preset, L, d, 50, canon)


def test_mixer_sizes_follow_the_papers_d2_budgets():
    """Paper App. C, Part 4.2: GLA mixer ≈ 4d², GLA5 / GDN / GDN2 / Mamba2 mixers ≈ 6d², MLP 2d ≈ 6d² (d = 768)."""
    d = 768
    for preset, mixer_d2, mlp_d2 in [("gla", 4, 8), ("gla5", 6, 6), ("gdn", 6, 6), ("gdn2", 6, 6), ("mamba2", 6, 6)]:
        cfg = build_model_config(dict(PRESETS[preset], size="1L768D"), canon={"set": ""}, vocab_size=8)
        with torch.device("meta"):
            m = CanonLM(cfg)
        blk = m.blocks[0]
        n_mixer = sum(p.numel() for p in blk.attn.parameters())
        n_mlp = sum(p.numel() for p in blk.mlp.parameters())
        assert abs(n_mixer / d**2 - mixer_d2) < 0.25, (preset, n_mixer / d**2)
        assert abs(n_mlp / d**2 - mlp_d2) < 0.3, (preset, n_mlp / d**2)


def test_head_rules_and_widths():
    c = build_model_config(dict(PRESETS["gdn"], size="12L768D"), vocab_size=8)
    assert (c.n_heads, c.head_k_dim, c.head_v_dim) == (6, 96, 192)
    c = build_model_config(dict(PRESETS["gdn"], size="8L512D"), vocab_size=8)
    assert (c.n_heads, c.head_k_dim, c.head_v_dim) == (4, 96, 192)
    c = build_model_config(dict(PRESETS["gla"], size="12L768D"), vocab_size=8)
    assert (c.n_heads, c.head_k_dim, c.head_v_dim) == (4, 96, 192)
    c = build_model_config(dict(PRESETS["mamba2"], size="12L768D"), vocab_size=8)
    assert (c.n_heads, c.head_v_dim, c.ssm_state, c.n_layers) == (16, 96, 64, 12)  # head_dim 2d/16
    c = build_model_config(dict(PRESETS["mamba2_nomlp"], size="8L512D"), vocab_size=8)
    assert c.n_layers == 16 and c.ffn_dim == 0
    c = build_model_config(dict(PRESETS["gdn2"], size="12L768D"), vocab_size=8)
    assert (c.n_heads, c.head_k_dim, c.head_v_dim) == (6, 128, 256)
    c = build_model_config(dict(PRESETS["gla5"], size="24L2048D"), vocab_size=8)
    assert (c.n_heads, c.head_k_dim, c.head_v_dim) == (16, 128, 256)  # the official 1B GLA5 recipe


# ------------------------------------------------------------------------------------------------ mixer oracles


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _lin(x, mod):
    """Apply a Linear or a 2-layer low-rank Sequential by explicit matmuls."""
    if isinstance(mod, torch.nn.Sequential):
        return _lin(_lin(x, mod[0]), mod[1])
    y = x @ mod.weight.T
    return y + mod.bias if mod.bias is not None else y


def _qkv(m, x, canon_cfg):
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    if m.canon_b is not None:
        qkv = canon_loop(torch.cat([q, k, v], -1), m.canon_b.weight, residual=True)
        q, k, v = qkv.split([m.key_dim, m.key_dim, m.value_dim], -1)
    if m.conv_q is not None:
        q, k, v = (
            canon_loop(t, c.weight, residual=False, activation=True)
            for t, c in ((q, m.conv_q), (k, m.conv_k), (v, m.conv_v))
        )
    else:
        q, k, v = q * torch.sigmoid(q), k * torch.sigmoid(k), v * torch.sigmoid(v)
    return q, k, v


def gla_oracle(m, x, eps):
    """GLA mixer around the per-token loop ``gla_loop`` (Yang et al. 2024)."""
    B, T, _ = x.shape
    H = m.n_heads
    q, k, v = _qkv(m, x, None)
    gk = F.logsigmoid(_lin(x, m.gk_proj)) / m.normalizer
    o, _ = gla_loop(*(t.view(B, T, H, -1) for t in (q, k, v, gk)))
    g = _lin(x, m.g_proj).view(B, T, H, -1)
    o = _rms(o, m.g_norm.weight, eps) * g * torch.sigmoid(g)
    return o.flatten(2) @ m.o_proj.weight.T


def gdn_oracle(m, x, eps):
    """GDN mixer around the per-token loop of the delta rule ``gdn_loop`` (Yang et al. 2025)."""
    B, T, _ = x.shape
    H = m.n_heads
    q, k, v = _qkv(m, x, None)
    beta = torch.sigmoid(x @ m.b_proj.weight.T)
    g = -m.A_log.exp() * F.softplus(x @ m.a_proj.weight.T + m.dt_bias)
    o, _ = gdn_loop(*(t.view(B, T, H, -1) for t in (q, k, v)), g, beta, use_qk_l2norm=True)
    gate = _lin(x, m.g_proj).view(B, T, H, -1)
    o = _rms(o, m.o_norm.weight, eps) * gate * torch.sigmoid(gate)
    return o.flatten(2) @ m.o_proj.weight.T


def mamba2_oracle(m, x, eps):
    """Mamba2 mixer by a per-token loop (Dao & Gu 2024): in_proj, [Canon-B], conv1d+SiLU or identity,
    SSD recurrence (``ssd_loop``) with softplus(dt + dt_bias), D skip, RMSNorm(y · silu(z)), out_proj."""
    B, T, _ = x.shape
    H, P, G, N, di = m.n_heads, m.head_dim, m.n_groups, m.ssm_state, m.d_inner
    zx = x @ m.in_proj.weight.T
    if m.canon_b is not None:
        zx = canon_loop(zx, m.canon_b.weight, residual=True)
    z, xbc, dt = zx.split([di, di + 2 * G * N, H], -1)
    if m.conv1d is not None:
        xbc = canon_loop(xbc, m.conv1d.weight, m.conv1d.bias, residual=False, activation=True)
    xs, Bm, Cm = xbc.split([di, G * N, G * N], -1)
    xs, Bm, Cm = xs.view(B, T, H, P), Bm.view(B, T, G, N), Cm.view(B, T, G, N)
    y, _ = ssd_loop(xs, dt, -m.A_log.exp(), Bm, Cm, m.D, m.dt_bias)  # softplus(dt + dt_bias), D skip
    y = y.reshape(B, T, di)
    y = y * z * torch.sigmoid(z)
    y = _rms(y.view(B, T, G, -1), m.norm.weight.view(G, -1), eps).reshape(B, T, di)
    return y @ m.out_proj.weight.T


ORACLES = {
    "gla": gla_oracle,
    "gla5": gla_oracle,
    "gdn": gdn_oracle,
    "gdn2": gdn_oracle,
    "mamba2": mamba2_oracle,
    "mamba2_nomlp": mamba2_oracle,
}


@pytest.mark.parametrize("preset", list(ORACLES))
@pytest.mark.parametrize("canon", ["", "b", "B", "Bb"])
def test_mixer_matches_loop_oracle(preset, canon):
    model = build(preset, canon=canon, chunk_size=8)
    m = model.blocks[0].attn
    with torch.no_grad():  # non-trivial decay / bias parameters
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.manual_seed(1)
    x = torch.randn(2, 21, model.cfg.d_model, dtype=torch.float64)
    got = m(x, None, None)
    want = ORACLES[preset](m, x, model.cfg.norm_eps)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_block_wiring_canon_a_c_d():
    """Block = x + mixer(CanonA(norm(x))); x + MLP(CanonD, CanonC(norm(x))) (paper §4)."""
    model = build("gla", canon="AbCD")
    blk = model.blocks[0]
    torch.manual_seed(2)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    eps = model.cfg.norm_eps
    h = canon_loop(_rms(x, blk.attn_norm.weight, eps), blk.canon_a.weight)
    x1 = x + blk.attn(h, None, None)
    h = canon_loop(_rms(x1, blk.mlp_norm.weight, eps), blk.canon_c.weight)
    u = canon_loop(h @ blk.mlp.w13.weight.T, blk.mlp.canon_d.weight)
    gte, up = u.chunk(2, -1)
    want = x1 + (F.silu(gte) * up) @ blk.mlp.w2.weight.T
    torch.testing.assert_close(blk(x, None, None), want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ inits


def test_linear_inits():
    torch.manual_seed(0)
    m = build("gla", canon="AbCD", size="2L256D", dtype=torch.float32)
    blk = m.blocks[0]
    assert abs(blk.attn.q_proj.weight.std().item() - 0.02) < 2e-3
    assert abs(blk.attn.conv_q.weight.std().item() - 0.02) < 3e-3  # fla-style 0.02 for the short convs (b)
    w = blk.canon_a.weight  # Canon: PyTorch default U(-1/2, 1/2)
    assert w.abs().max() <= 0.5 and w.std().item() > 0.25
    assert blk.attn.gk_proj[1].bias.abs().max() == 0
    m5 = build("gla5", canon="AbCD", size="2L256D", dtype=torch.float32)
    lr = m5.blocks[0].attn.g_proj[0].weight  # split init σ = √0.02 / 16^¼
    assert abs(lr.std().item() - math.sqrt(0.02) / 2) < 5e-3
    mm = build("mamba2", canon="AbCD", size="2L256D", dtype=torch.float32)
    mix = mm.blocks[0].attn
    assert abs(mm.tok_emb.weight.std().item() - 0.1) < 5e-3  # embedding N(0, 0.1)
    bound = 1 / math.sqrt(256)  # kaiming-uniform(a=√5) of a Linear
    assert mix.in_proj.weight.abs().max() <= bound and mix.in_proj.weight.std().item() > 0.8 * bound / math.sqrt(3)
    assert mix.conv1d.bias.abs().max() == 0
    A = mix.A_log.exp()
    assert ((A >= 1) & (A <= 16)).all() and torch.equal(mix.D, torch.ones_like(mix.D))
    dt = F.softplus(mix.dt_bias)
    assert ((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all()
    g = build("gdn", canon="b", size="2L256D", dtype=torch.float32).blocks[0].attn
    assert ((g.A_log.exp() >= 0) & (g.A_log.exp() <= 16)).all()


# ------------------------------------------------------------------------------------------------ decode caches


def decode_in_pieces(model, ids):
    """(full forward logits, logits of prefill 7 -> 3 single tokens -> a 5-token chunk -> single tokens, the cache)
    for ids (B, 23)."""
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts, t = [model(ids[:, :7], cache)], 7
        for n in (1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1):
            parts.append(model(ids[:, t : t + n], cache))
            t += n
    assert t == ids.shape[1]
    return full, torch.cat(parts, 1), cache


DECODE_CASES = [
    ("llama", "", {}),
    ("llama", "ABCD", {}),
    ("llama", "AC", {"qk_norm": "whole"}),
    ("llama", "ABCD", {"n_kv_heads": 1}),
    ("gla", "", {}),
    ("gla", "b", {}),
    ("gla", "AbCD", {}),
    ("gla", "ABCD", {}),
    ("gla5", "AbCD", {}),
    ("gdn", "", {}),
    ("gdn", "b", {}),
    ("gdn", "AbCD", {}),
    ("gdn", "AbBCD", {}),
    ("gdn2", "AbCD", {}),
    ("mamba2", "", {}),
    ("mamba2", "b", {}),
    ("mamba2", "AbCD", {}),
    ("mamba2", "ABCD", {}),
    ("mamba2_nomlp", "Ab", {}),
    ("mamba2_nomlp", "B", {}),
]


@pytest.mark.parametrize("preset, canon, kw", DECODE_CASES)
def test_decode_equals_full_forward(preset, canon, kw):
    """Prefill 7 tokens, decode 1 token at a time, then a 5-token chunk, then single tokens again: the logits equal
    one forward pass over the whole sequence."""
    model = build(preset, canon=canon, chunk_size=4, **kw).eval()
    torch.manual_seed(3)
    ids = torch.randint(0, 32, (3, 23))
    full, pieces, cache = decode_in_pieces(model, ids)
    assert cache.seen == 23
    torch.testing.assert_close(pieces, full, rtol=1e-9, atol=1e-9)


def test_cache_select_drops_rows():
    model = build("gdn", canon="AbCD").eval()
    ids = torch.randint(0, 32, (4, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        model(ids[:, :8], cache)
        cache.select(torch.tensor([3, 1]))
        step = model(ids[[3, 1], 8:9], cache)
    torch.testing.assert_close(step[:, 0], full[[3, 1], 8], rtol=1e-9, atol=1e-9)
    assert cache.batch_size == 2


@pytest.mark.parametrize("preset, canon", [("llama", "ABCD"), ("gla", "AbCD"), ("mamba2", "AbCD")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_recomputed(preset, canon, temperature):
    """LanguageModel decodes with the model's caches (ragged prompts, stop tokens, rows finishing at different
    steps); the tokens equal those of the cache-free path that re-runs every prefix."""
    model = build(preset, canon=canon, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32, size=n) for n in (3, 9, 5, 1, 12, 7)]
    keys = np.arange(6, dtype=np.uint64) * 977 + 5
    kw = dict(vocab_size=32, batch_size=4, max_len=256)
    cached = LanguageModel(model, **kw)
    plain = LanguageModel(model, use_cache=False, **kw)
    assert cached.use_cache and not plain.use_cache
    a = cached.generate(prompts, 10, stop_ids=[5, 17], temperature=temperature, keys=keys)
    b = plain.generate(prompts, 10, stop_ids=[5, 17], temperature=temperature, keys=keys)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert any(len(x) < 10 for x in a) or temperature == 0.0


def test_use_cache_true_needs_a_cache():
    with pytest.raises(ValueError, match="use_cache"):
        LanguageModel(lambda t: torch.zeros(*t.shape, 4), vocab_size=4, use_cache=True)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "model, canon, key",
    [
        (dict(arch="llama", size="2L64D"), "AbCD", "canon.set"),
        (dict(arch="gla", size="2L64D"), "AbCE", "canon.set"),
        (dict(arch="mamba2", mlp="none", size="2L64D"), "AbCD", "canon.set"),
        (dict(arch="gla", size="2L64D", n_heads=5), "", "model.expand_k"),
        (dict(arch="gdn", size="2L64D", expand_v=0.3, n_heads=4), "", "model.expand_v"),
        (dict(arch="mamba2", size="2L64D", n_heads=7), "", "model.n_heads"),
        (dict(arch="mamba2", size="2L64D", n_groups=3), "", "model.n_groups"),
        (dict(arch="gla", size="2L64D", chunk_size=0), "", "model.chunk_size"),
        (dict(arch="gdn", size="2L64D", chunk_size=-4), "", "model.chunk_size"),
        (dict(arch="mamba2", size="2L64D", ssm_state=0), "", "model.ssm_state"),
        (dict(arch="gla", size="2L64D", qk_norm="whole"), "", "model.qk_norm"),
        (dict(arch="gla", size="2L64D", mlp="none"), "", "model.mlp"),
        (dict(arch="rwkv", size="2L64D"), "", "model.arch"),
        (dict(arch="gla", size="2L64D", no_conv_act="gelu"), "", "model.no_conv_act"),
    ],
)
def test_bad_linear_config_is_one_clear_error(model, canon, key):
    with pytest.raises(ConfigError) as e:
        build_model_config(model, canon={"set": canon}, vocab_size=8)
    assert e.value.key == key and "allowed" in str(e.value)


@pytest.mark.parametrize("op, arch", [("gla", "gla"), ("gdn", "gdn"), ("ssd", "mamba2")])
def test_fused_request_without_library_fails_early(op, arch):
    """A fast path requested where it cannot run (CPU, no library) is a ConfigError when the model is placed there
    (CanonLM.place; training and evaluation place before the first step), and at a forward before placement --
    not at construction, which may precede the move to a GPU."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    for kw, key in (
        ({"kernels": {op: "fla" if op != "ssd" else "mamba_ssm"}}, f"model.kernels.{op}"),
        ({"ops": "fused"}, "model.ops"),
    ):
        cfg = build_model_config(dict(PRESETS[arch], size="2L64D"), canon={"set": "b"}, vocab_size=8, **kw)
        model = CanonLM(cfg)
        assert op in model.pending
        for call in (lambda: model.place("cpu", torch.float32), lambda: model(ids)):
            with pytest.raises(ConfigError) as e:
                call()
            assert e.value.key == key


def test_gla_canon_b_warns_once_but_builds():
    import canonlm.arch.mixers.gla as gla_mod

    gla_mod._warned_b = False
    cfg = build_model_config(dict(PRESETS["gla"], size="2L64D"), canon={"set": "ABCD"}, vocab_size=8)
    with pytest.warns(UserWarning, match="Canon-B in GLA"):
        CanonLM(cfg)


def test_official_canon_strings():
    """'AbbCD' == 'AbCD' and 'bb' == 'b' (set semantics, as the official ``'b' in canon_set``)."""
    a = build_model_config(dict(PRESETS["gdn"], size="2L64D"), canon={"set": "AbbCD"}, vocab_size=8)
    assert a.canon.set == "AbCD"
    assert build_model_config(dict(PRESETS["gdn"], size="2L64D"), canon={"set": "bb"}, vocab_size=8).canon.set == "b"


def test_bf16_autocast_forward_backward_linear():
    for preset in ("gla", "gdn", "mamba2"):
        model = build(preset, canon="AbCD", dtype=torch.float32)
        ids = torch.randint(0, 32, (2, 40))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------ through train.py


def _train_py(args, tmp_path, name):
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"run_name={name}", f"paths.log_dir={tmp_path}/logs"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads((tmp_path / "logs" / "train" / "runs" / name / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, canon",
    [("gla", "none"), ("gla", "AbCD"), ("gdn", "none"), ("gdn", "AbCD"), ("mamba2", "none"), ("mamba2", "AbCD")],
)
def test_linear_archs_train_on_depo1(arch, canon, tmp_path):
    """The issue's command, `python train.py arch=<gla|gdn|mamba2> canon=<none|AbCD> task=depo1`, on the paper's
    Depo1 config (context 2048) with a tiny model and 3 steps: builds, trains, validates and tests on CPU."""
    res = _train_py(
        [
            f"arch={arch}",
            f"canon={canon}",
            "task=depo1",
            "model.size=2L64D",
            "data.batch_size=2",
            "data.val_windows=2",
            "data.test_windows=2",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "callbacks=none",
        ],
        tmp_path,
        f"{arch}_{canon}",
    )
    assert res["steps"] == 3 and res["model"]["arch"] == ("mamba2" if arch == "mamba2" else arch)
    assert res["model"]["canon"] == ("" if canon == "none" else canon) and res["model"]["pos"] == "none"
    assert math.isfinite(res["test"]["loss"]) and res["test"]["overall"]["answers"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch, canon", [("gla5", "AbCD"), ("gdn2", "b"), ("mamba2_nomlp", "Ab")])
def test_linear_generation_eval_through_train_py(arch, canon, tmp_path):
    """Brevo's generation-based evaluation on a linear model: greedy decoding through the decode caches."""
    res = _train_py(
        [
            f"arch={arch}",
            f"canon={canon}",
            "task=brevo1_cpu",
            "model.size=2L64D",
            "data.batch_size=4",
            "data.val_windows=4",
            "data.test_windows=4",
            "data.gen_eval.samples=4",
            "data.gen_eval.batch_size=3",
            "data.gen_eval.on_val=false",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "callbacks=none",
        ],
        tmp_path,
        f"{arch}_{canon}",
    )
    gen = res["test"]["generate"]
    assert gen["samples"] == 4 and 0.0 <= gen["acc"] <= 1.0


def test_init_weights_after_fsdp2_sharding(tmp_path):
    """Meta build -> fully_shard (FSDP2, gloo, 1 process) -> to_empty -> init_weights: the GDN / Mamba2 decay
    parameters are drawn on DTensors too (as the official GDN2 / Mamba2 do after FSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for preset in ("gdn", "mamba2"):
            cfg = build_model_config(dict(PRESETS[preset], size="2L64D"), canon={"set": "AbCD"}, vocab_size=16)
            with torch.device("meta"):
                m = CanonLM(cfg)
            for blk in m.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(m, mesh=mesh)
            m.to_empty(device="cpu")
            m.init_weights()
            mix = m.blocks[0].attn
            dt = F.softplus(mix.dt_bias.full_tensor())
            A = mix.A_log.full_tensor().exp()
            assert ((dt >= 0.999e-4) & (dt <= 0.1001)).all() and torch.isfinite(A).all() and (A <= 16).all()
            ids = torch.randint(0, 16, (2, 8))
            assert torch.isfinite(m(ids)).all()
    finally:
        dist.destroy_process_group()


def test_fla_gdn_head_dim_limit(monkeypatch):
    """fla's chunked delta-rule kernels take key head dims <= 256: an explicit fla request with d_k = 512 is a
    ConfigError naming the limit; auto falls back to the reference with a warning (the kernel is faked present)."""
    from canonlm.arch import model as model_mod

    monkeypatch.setattr(model_mod.gdn_ops, "resolve_backend", lambda name, device, dtype: "fla")
    cfg = build_model_config(
        dict(PRESETS["gdn"], size="1L512D", n_heads=1, expand_k=1.0, expand_v=1.0),
        canon={"set": "b"},
        vocab_size=8,
        kernels={"gdn": "fla"},
    )
    assert cfg.head_k_dim == 512
    with pytest.raises(ConfigError, match="256") as e:
        model_mod.resolve_backends(cfg, "cpu", torch.bfloat16)
    assert e.value.key == "model.kernels.gdn"
    cfg.kernels = {}
    with pytest.warns(RuntimeWarning, match="256"):
        assert model_mod.resolve_backends(cfg, "cpu", torch.bfloat16)["gdn"] == "reference"
    cfg.n_heads = 2  # d_k = 256 is accepted
    assert model_mod.resolve_backends(cfg, "cpu", torch.bfloat16)["gdn"] == "fla"


def test_gdn_op_falls_back_for_head_dims_fla_refuses(monkeypatch):
    """The op itself owns fla's d_k <= 256 limit: with the fla backend selected (faked here), K = 300 runs the
    reference under ``auto`` (same result as the reference) and is a ValueError when fla is pinned."""
    from canonlm.ops import gdn as gdn_ops

    monkeypatch.setattr(gdn_ops, "_select", lambda backend, device, dtype: "fla")
    monkeypatch.setattr(gdn_ops._fla, "forward", lambda *a, **k: pytest.fail("fla called with K > 256"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 5, 1, 300, generator=g), torch.randn(1, 5, 1, 300, generator=g)
    v, gg = torch.randn(1, 5, 1, 4, generator=g), -torch.rand(1, 5, 1, generator=g)
    beta = torch.rand(1, 5, 1, generator=g)
    got, _ = gdn_ops.chunk_gated_delta_rule(q, k, v, gg, beta, backend="auto")
    want, _ = gdn_ops.chunk_gated_delta_rule_reference(q, k, v, gg, beta)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="256"):
        gdn_ops.chunk_gated_delta_rule(q, k, v, gg, beta, backend="fla")
    assert gdn_ops.fla_shape_reason(256) is None and "256" in gdn_ops.fla_shape_reason(257)
