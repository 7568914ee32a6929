"""Analytic FLOPs per token (canonlm.arch.flops) against a count of the matrix products of one real forward pass.

For every architecture preset and several Canon settings, a tiny model runs one forward on the reference ops
(``ops=reference``) under ``torch.utils.flop_counter.FlopCounterMode``, which counts mm / addmm / bmm / baddbmm /
convolution / SDPA and nothing elementwise. The ``"reference"`` convention of :func:`flops_per_token` minus GDN's
triangular solve (a ``solve_triangular`` call the counter does not see) must equal that count exactly, for T a
multiple of the chunk, T not a multiple with a chunk that is not a power of two, and T shorter than the chunk. The
parts the counter cannot check on the model are tested on their own: the Canon conv's 2·K·C (also against the
shift-add backend the counter is blind to) and the solve's C(C-1) per right-hand side (an explicit forward
substitution). ``pytest tests/test_flops.py -s`` prints the comparison table (docs/mfu.md holds a copy).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from canonlm.arch import CanonLM, build_model_config
from canonlm.arch.flops import COMPONENTS, _gdn_scan, flops_per_token, mfu
from canonlm.arch.modules import GatedRMSNorm, RMSNorm
from canonlm.ops.canon import causal_conv1d_reference, causal_conv1d_torch
from conftest import ARCH_PRESETS

# The Hydra arch presets as plain dicts, plus a GQA / standard-MLP / tied-head Llama.
PRESETS = {**ARCH_PRESETS, "llama_gqa_std": dict(arch="llama", n_kv_heads=1, mlp="standard", tie_embeddings=True)}
LINEAR_CANONS = ("", "b", "AbCD", "AbBCD")
CASES = (
    [("llama", ""), ("llama", "ABCD"), ("llama_gqa_std", "ABCD")]
    + [(p, c) for p in ("gla", "gla5", "gdn", "gdn2", "mamba2") for c in LINEAR_CANONS]
    + [("mamba2_nomlp", c) for c in ("", "b", "Ab", "AbB")]
)
# (T, chunk): T a multiple of the chunk; T not a multiple and a chunk that is not a power of two (GLA pads it to 8);
# T shorter than the chunk (one chunk of T).
SHAPES = ((16, 8), (13, 6), (5, 8))
BATCH, VOCAB = 2, 32


def _cfg(preset: str, canon: str, size: str = "2L64D", vocab: int = VOCAB, **kw):
    model = dict(PRESETS[preset], size=size, **kw)
    return build_model_config(
        model, canon={"set": canon}, pos={"type": "rope"}, vocab_size=vocab, max_seq_len=64, ops="reference"
    )


def _model(cfg) -> CanonLM:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Canon-B in GLA warns
        return CanonLM(cfg)


_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _count(model: CanonLM, T: int, backward: bool = False, matmuls_only: bool = False) -> int:
    """FLOPs FlopCounterMode counts in one forward (or forward + backward) of a batch of BATCH x T tokens; with
    ``matmuls_only`` just the mm / addmm / bmm / baddbmm ones (its convolution_backward formula ignores ``groups``
    and counts a depthwise conv's weight gradient C times over)."""
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fc:
        if backward:
            model(ids).float().square().mean().backward()
        else:
            with torch.no_grad():
                model(ids)
    if matmuls_only:
        return sum(n for op, n in fc.get_flop_counts()["Global"].items() if op.__name__ in _MATMULS)
    return fc.get_total_flops()


@pytest.fixture(scope="module")
def table():
    rows: list[tuple] = []
    yield rows
    head = ("arch", "canon", "T", "C", "formula", "counted", "ratio", "dense", "matmul fwd+bwd / fwd")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r) + " |")
    print(
        "\n\nForward FLOPs per token: formula (convention='reference', without GDN's solve) vs FlopCounterMode "
        f"(batch {BATCH}, size 2L64D, vocab {VOCAB}, ops=reference); dense = the MFU convention\n" + "\n".join(lines)
    )


@pytest.mark.parametrize("preset,canon", CASES, ids=[f"{p}-{c or 'none'}" for p, c in CASES])
def test_reference_formula_equals_flop_counter(preset, canon, table):
    for T, C in SHAPES:
        cfg = _cfg(preset, canon, chunk_size=C)
        model = _model(cfg)
        counted = _count(model, T) / (BATCH * T)
        f = flops_per_token(cfg, T, convention="reference", training=False)
        formula = f["forward"] - f["scan_solve"]
        assert formula == pytest.approx(counted, rel=1e-12, abs=1e-9), (preset, canon, T, C, f)
        ratio_bwd = None
        if T == SHAPES[0][0] and (canon == "" or preset == "llama_gqa_std"):
            # fwd + bwd over fwd, matmuls only (the "3 x forward" training convention); one Canon setting per arch
            ratio_bwd = _count(model, T, backward=True, matmuls_only=True) / _count(model, T, matmuls_only=True)
        dense = flops_per_token(cfg, T, convention="dense", training=False)["forward"]
        table.append(
            (
                preset,
                canon or "none",
                T,
                C,
                f"{formula:,.1f}",
                f"{counted:,.1f}",
                f"{formula / counted:.6f}",
                f"{dense:,.1f}",
                "" if ratio_bwd is None else f"{ratio_bwd:.3f}",
            )
        )


def test_counter_sees_every_matmul_of_the_llama_reference():
    """Sanity of the harness: attention on the reference backend is 2 bmm of T x T x d_head per head."""
    cfg = _cfg("llama", "")
    f = flops_per_token(cfg, 16, convention="reference", training=False)
    assert f["attention"] == cfg.n_layers * 4 * cfg.d_model * 16
    assert f["scan_intra"] == f["scan_state"] == f["canon"] == f["short_conv"] == 0.0


# ------------------------------------------------------------------------------------------ the uncounted parts


@pytest.mark.parametrize("K,C", [(4, 48), (3, 7)])
def test_canon_conv_is_2KC_per_token(K, C):
    """One Canon layer costs 2·K·C FLOPs per token: the reference (F.conv1d, depthwise) is counted as exactly that;
    the shift-add backend does the same multiply-adds elementwise and the counter sees nothing -- so the formula
    does not depend on the backend (cfg.ops)."""
    B, T = 3, 11
    x, w = torch.randn(B, T, C), torch.randn(C, K)
    with FlopCounterMode(display=False) as fc:
        y_ref = causal_conv1d_reference(x, w)
    assert fc.get_total_flops() == 2 * K * C * B * T
    with FlopCounterMode(display=False) as fc:
        y_torch = causal_conv1d_torch(x, w)
    assert fc.get_total_flops() == 0
    torch.testing.assert_close(y_ref, y_torch)
    # naive count of the shift-add form: K multiplies and K - 1 adds per (token, channel), + the residual add
    assert (K + (K - 1) + 1) * C == 2 * K * C
    cfg_auto = _cfg("llama", "ABCD")
    cfg_auto.ops = "auto"
    assert flops_per_token(cfg_auto, 16) == flops_per_token(_cfg("llama", "ABCD"), 16)


@pytest.mark.parametrize("L,K,V", [(8, 2, 3), (13, 1, 2)])
def test_gdn_solve_is_L_Lminus1_per_rhs(L, K, V):
    """GDN's unit-lower-triangular solve (not seen by FlopCounterMode) costs L(L-1) FLOPs per right-hand-side column
    (right-hand side [βV | βΓK]: V + K columns per head): an explicit forward substitution, written as matmuls the
    counter does see, gives exactly that."""
    torch.manual_seed(0)
    R = K + V
    A = torch.randn(L, L, dtype=torch.float64).tril(-1) * 0.1
    b = torch.randn(L, R, dtype=torch.float64)
    with FlopCounterMode(display=False) as fc:
        rows = [b[0:1]]
        for i in range(1, L):
            rows.append(b[i : i + 1] - A[i : i + 1, :i] @ torch.cat(rows, 0))
        x = torch.cat(rows, 0)
    assert fc.get_total_flops() == L * (L - 1) * R
    torch.testing.assert_close(x, torch.linalg.solve_triangular(A, b, upper=False, unitriangular=True))
    H = 3
    assert _gdn_scan(L, L, H, K, V, "dense")[2] == H * fc.get_total_flops()


# ------------------------------------------------------------------------------------------ conventions


@pytest.mark.parametrize("preset", list(PRESETS))
def test_dense_vs_reference_vs_causal(preset):
    """T a multiple of a power-of-two chunk: the dense and reference conventions agree on everything but GLA's
    intra-chunk scores (the reference builds only the strict lower triangle with matmuls, C(C-4)·K instead of
    2·C²·K per chunk); causal = dense x (T+1)/2T for attention and x (C+1)/2C for the intra-chunk terms, the rest
    unchanged."""
    T, C = 64, 16
    linear = PRESETS[preset]["arch"] != "llama"
    canon = ("Ab" if preset == "mamba2_nomlp" else "AbCD") if linear else "ABCD"
    cfg = _cfg(preset, canon)
    dense = flops_per_token(cfg, T, chunk_size=C, training=False)
    ref = flops_per_token(cfg, T, chunk_size=C, training=False, convention="reference")
    causal = flops_per_token(cfg, T, chunk_size=C, training=False, convention="causal")
    for k in COMPONENTS:
        if not (k == "scan_intra" and cfg.arch == "gla"):
            assert dense[k] == pytest.approx(ref[k], rel=1e-12), k
        if k == "attention":
            assert causal[k] == pytest.approx(dense[k] * (T + 1) / (2 * T), rel=1e-12)
        elif k == "scan_intra":
            assert causal[k] == pytest.approx(dense[k] * (C + 1) / (2 * C), rel=1e-12)
        else:
            assert causal[k] == dense[k], k
    assert (dense["attention"] > 0) != linear and (dense["scan_intra"] > 0) == linear
    if cfg.arch == "gla":
        H, K = cfg.n_heads, cfg.head_k_dim
        per_chunk = H * (2 * C * C * K - C * (C - 4) * K)
        assert dense["scan_intra"] - ref["scan_intra"] == pytest.approx(cfg.n_layers * (T // C) * per_chunk / T)


def test_training_total_is_three_forwards_and_bad_args():
    cfg = _cfg("gdn", "AbCD")
    f = flops_per_token(cfg, 32)
    assert f["total"] == 3 * f["forward"] == 3 * flops_per_token(cfg, 32, training=False)["total"]
    assert f["forward"] == pytest.approx(math.fsum(f[k] for k in COMPONENTS)) and f["embedding"] == 0.0
    assert mfu(1e5, f["total"], 312e12, 2) == pytest.approx(1e5 * f["total"] / 624e12)
    for kw in (dict(seq_len=0), dict(seq_len=8, chunk_size=0), dict(seq_len=8, convention="half")):
        with pytest.raises(ValueError):
            flops_per_token(cfg, **kw)


def test_llama_dense_is_palm_formula():
    """For Llama the dense convention is PaLM's 6·N + 12·L·d·T, with N = the parameters that take part in a product
    (no embedding table, no norm gains; the LM head counts, tied or not)."""
    for canon, kw in (("", {}), ("ABCD", dict(tie_embeddings=True, n_kv_heads=4))):
        cfg = _cfg("llama", canon, size="12L768D", vocab=1000, **kw)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = CanonLM(cfg)
        norms = sum(m.weight.numel() for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm)))
        n = model.num_params() - model.tok_emb.weight.numel() - norms
        if cfg.tie_embeddings:
            n += model.lm_head.weight.numel()
        else:
            assert model.lm_head.weight.numel() == 1000 * 768
        if cfg.n_kv_heads:  # GQA: attention still runs over all 12 query heads
            assert flops_per_token(cfg, 2048)["attention"] == 12 * 4 * 768 * 2048
        assert flops_per_token(cfg, 2048)["total"] == 6 * n + 12 * 12 * 768 * 2048


def test_paper_scale_table():
    """The paper's 12L768D at T = 2048, chunk 64 (the fla kernels' chunk): the formula of the old
    ``6N + 12·L·d·T`` / ``6N + 12·L·H·d_k·d_v`` kind vs the per-architecture formula (training FLOPs per token)."""
    rows = []
    for preset in PRESETS:
        linear = PRESETS[preset]["arch"] != "llama"
        canon = ("Ab" if preset == "mamba2_nomlp" else "AbCD") if linear else "ABCD"
        cfg = _cfg(preset, canon, size="12L768D", vocab=32000)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = CanonLM(cfg)
        n = (
            model.num_params()
            - model.tok_emb.weight.numel()
            + (model.lm_head.weight.numel() if cfg.tie_embeddings else 0)
        )
        T = 2048
        if cfg.arch == "llama":
            old = 6 * n + 12 * cfg.n_layers * cfg.d_model * T
        else:
            old = 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim
        f = flops_per_token(cfg, T, chunk_size=64)
        c = flops_per_token(cfg, T, chunk_size=64, convention="causal")
        seq = 3 * (f["attention"] + f["scan_intra"] + f["scan_state"] + f["scan_solve"])
        rows.append(
            (
                preset,
                canon,
                cfg.n_layers,
                f"{old / 1e9:.3f}",
                f"{f['total'] / 1e9:.3f}",
                f"{c['total'] / 1e9:.3f}",
                f"{f['total'] / old:.3f}",
                f"{seq / f['total']:.1%}",
            )
        )
        assert f["total"] > 0
    head = ("arch", "canon", "layers", "old GFLOPs/tok", "dense", "causal", "dense/old", "sequence-mixing share")
    print(
        "\n\nTraining FLOPs per token, 12L768D, vocab 32000, T = 2048, chunk 64\n"
        + "\n".join(
            ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
        )
    )
