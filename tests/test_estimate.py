"""``python -m canonlm.estimate``: the cost of a run before it starts (canonlm.estimate, canonlm.arch.memory).

Oracles: FLOPs against ``torch.utils.flop_counter.FlopCounterMode`` on tiny models (forward + backward counted, or
3 x the counted forward where the counter's convolution-backward formula over-counts depthwise convs); memory against
the peak torch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``) measures over a real CPU training step;
parameters against the paper's and the release's tables and the hand formula; the 1.3B printout against a hand
re-derivation of every number; each activation term (the fp32 residual stream under ``*-mixed``, the fp32
log-softmax, Canon-A / C, document masking's mask, index tensors and ``doc_ids``) against its hand formula written
here; the refusals against ``train.py``'s own checks. A prepared ``task=text`` corpus with the Llama-2 vocabulary
(32,000), or another one, is faked by writing its ``meta.json`` and three small shards (nothing is downloaded); the
real-life presets are also estimated with no corpus at all, from the vocabulary their tokenizer names.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from canonlm.arch import CanonLM, build_model_config
from canonlm.estimate import GPUS, main, training_flops
from conftest import ARCH_PRESETS, ROOT

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32000


def _prepared(d: Path, vocab: int) -> Path:
    """A prepared ``text`` directory (format canonlm-text-v1) in ``d`` with vocabulary ``vocab`` and 8,192 tokens per
    split."""
    meta = {
        "format": "canonlm-text-v1",
        "dtype": "uint16",
        "vocab_size": vocab,
        "eos_id": 2,
        "tokenizer": {},
        "splits": {},
    }
    for split in ("train", "val", "test"):
        np.zeros(8192, dtype=np.uint16).tofile(d / f"{split}_00000.bin")
        np.save(d / f"{split}_00000.idx.npy", np.zeros((1, 2), dtype=np.int64))
        meta["splits"][split] = {
            "tokens": 8192,
            "documents": 1,
            "shards": [{"file": f"{split}_00000.bin", "tokens": 8192, "documents": 1}],
        }
    (d / "meta.json").write_text(json.dumps(meta))
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A prepared ``text`` directory with the Llama-2 vocabulary, 32,000."""
    return _prepared(tmp_path_factory.mktemp("corpus"), VOCAB)


@pytest.fixture(scope="module")
def bpe4096(tmp_path_factory) -> Path:
    """A prepared ``text`` directory of another tokenizer: a 4,096-token BPE."""
    return _prepared(tmp_path_factory.mktemp("bpe4096"), 4096)


def paper(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The paper's Result-12 Llama (24L2048D, 32 heads, context 4096, global batch 48, 510,000 steps) under FSDP2;
    run logs (none are written) pointed into ``tmp_path``."""
    return [
        "arch=llama",
        "canon=none",
        "model.size=24L2048D",
        "model.n_heads=32",
        "task=text",
        f"task.data_dir={corpus}",
        "task.context=4096",
        "data.batch_size=48",
        "trainer.max_steps=510000",
        "strategy=fsdp2",
        f"paths.log_dir={tmp_path / 'logs'}",
        *extra,
    ]


def files_under(*dirs: Path) -> set[str]:
    return {str(p) for d in dirs for p in d.rglob("*")}


# ------------------------------------------------------------------------------------------------------- FLOPs


def _tiny(preset: str, canon: str, T: int, **kw):
    cfg = build_model_config(
        dict(ARCH_PRESETS[preset], **{"size": "2L64D", **kw}),
        canon={"set": canon},
        pos={"type": "rope"},
        vocab_size=32,
        max_seq_len=T,
        ops="reference",
    )
    torch.manual_seed(0)
    return cfg, CanonLM(cfg)


def _counted(model, T: int, backward: bool, B: int = 2) -> tuple[int, int]:
    """(all FLOPs, matmul FLOPs) FlopCounterMode counts for a forward (+ backward) of B x T tokens."""
    ids = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fc:
        if backward:
            model(ids).float().square().mean().backward()
        else:
            with torch.no_grad():
                model(ids)
    mm = sum(
        n
        for op, n in fc.get_flop_counts()["Global"].items()
        if op.__name__.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm")
    )
    return fc.get_total_flops(), mm


def test_training_flops_of_a_llama_equal_the_counted_forward_and_backward():
    """No Canon: every FLOP of the estimate is a product the counter sees, forward and backward (attention included:
    the ``3 x forward`` rule is exact for matmuls and SDPA)."""
    cfg, model = _tiny("llama", "", 32)
    counted, _ = _counted(model, 32, backward=True)
    assert training_flops(cfg)["total"] * 2 * 32 == counted


@pytest.mark.parametrize("preset,canon,T,chunk", [("llama", "ABCD", 32, None), ("mamba2", "AbCD", 32, 16)])
def test_training_flops_with_canon_are_three_counted_forwards(preset, canon, T, chunk):
    """With Canon (and Mamba2's short conv): 3 x the counted forward, exactly; the backward's matrix products are
    twice the forward's (counted), the convolutions' backward is left to the rule (the counter's
    ``convolution_backward`` formula ignores ``groups`` and over-counts a depthwise conv)."""
    cfg, model = _tiny(preset, canon, T, **({} if chunk is None else {"chunk_size": chunk}))
    fwd, fwd_mm = _counted(model, T, backward=False)
    _, both_mm = _counted(model, T, backward=True)
    assert training_flops(cfg)["total"] * 2 * T == 3 * fwd
    assert both_mm == 3 * fwd_mm


@pytest.mark.parametrize("preset", ["gla", "gdn"])
def test_training_flops_of_linear_models_against_the_counter(preset):
    """GLA / GDN with Canon-AbCD at fla's chunk of 64 (what the estimate uses), T = 2 chunks. GDN: the estimate's
    forward minus its triangular solve (a ``solve_triangular`` the counter does not see; its C(C-1) per column is
    checked by tests/test_flops.py against a forward substitution) equals the count exactly. GLA: the dense count is
    at least the counted one and within 2 % of it (the reference does its score blocks of size <= 2
    elementwise)."""
    T = 128
    cfg, model = _tiny(preset, "AbCD", T, chunk_size=64)
    fwd, _ = _counted(model, T, backward=False)
    f = training_flops(cfg)
    est = f["forward"] * 2 * T
    print(f"{preset}: estimate {est:.0f} vs counted {fwd} ({est / fwd - 1:+.2%}); solve {f['scan_solve'] * 2 * T}")
    if preset == "gdn":
        assert est - f["scan_solve"] * 2 * T == fwd
    else:
        assert fwd <= est <= 1.02 * fwd


# ------------------------------------------------------------------------------------------------------ memory


#: Document masking on a tiny Llama: sdpa pinned, one key/value head (grouped-query: the masked kernels take k and v
#: repeated to the query heads); 2 x 256 tokens make the shared (B, 1, T, T) mask a visible part of the bound.
DOC_GQA = {"doc": True, "kernels": {"attention": "sdpa"}, "n_kv_heads": 1}
#: bf16 autocast as ``trainer.precision=bf16-mixed`` runs it; Canon on its shift-and-add path (the reference's bf16
#: depthwise conv is slow on some CPUs: seconds instead of minutes, the same saved tensors counted).
BF16_MIXED = {"precision": "bf16-mixed", "kernels": {"canon": "torch"}}


@pytest.mark.parametrize(
    "preset,canon,B,T,extra",
    [
        ("llama", "ABCD", 4, 64, {}),
        ("llama", "", 1, 4, {}),
        ("gla", "AbCD", 4, 64, {}),
        ("mamba2", "AbCD", 1, 4, {}),
        ("llama", "ABCD", 2, 256, DOC_GQA),
        ("llama", "ABCD", 4, 64, BF16_MIXED),
        ("llama", "ABCD", 2, 256, {**DOC_GQA, "precision": "bf16-mixed"}),
    ],
    ids=[
        "llama-ABCD-activations",
        "llama-state",
        "gla-AbCD-activations",
        "mamba2-AbCD-state",
        "llama-ABCD-doc-mask-gqa",
        "llama-ABCD-bf16-mixed",
        "llama-ABCD-doc-mask-gqa-bf16-mixed",
    ],
)
def test_memory_is_a_lower_bound_of_the_measured_cpu_peak(preset, canon, B, T, extra):
    """``training_memory(...).total`` (what the estimate prints and train.py refuses with) is at most the peak that
    torch's ``MemTracker`` measures over a second real training step (forward, loss, backward, AdamW, zero_grad;
    on the CPU, reference ops; fp32, or under bf16 autocast as ``trainer.precision=bf16-mixed`` runs it, where the
    bound counts the fp32 residual stream), and not vacuous: at least 1/4 of it. Both regimes: activations larger
    than the gradients, and the other way round (a sum of the two would exceed the peak there: they do not
    coexist). With document masking (``doc_ids`` of several documents a row, tracked as batch data) the bound adds
    the shared mask, the index tensors and ``doc_ids``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from canonlm.arch.loss import lm_loss
    from canonlm.arch.memory import training_memory

    doc = extra.get("doc", False)
    precision = extra.get("precision", "32-true")
    cfg, model = _tiny(preset, canon, T, **{k: v for k, v in extra.items() if k not in ("doc", "precision")})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    x = torch.randint(1, 32, (B, T))
    starts = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < 0.05  # ~13 documents a row of 256
    doc_ids = starts.to(torch.int32).cumsum(1).to(torch.int32) if doc else None

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = lm_loss(model(x, doc_ids=doc_ids), x, None)["loss_sum"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mt = MemTracker()
    mt.track_external(model, opt, x, *([doc_ids] if doc else []))
    with mt:
        step()  # creates the AdamW state
        mt.reset_mod_stats()
        step()
    measured = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    est = training_memory(cfg, B, T, precision=precision, doc_mask=doc)
    assert (est.doc_masking is not None) == doc and (
        not doc or est.doc_masking.mask == B * T * T * (2 if precision == "bf16-mixed" else 4)
    )
    print(
        f"{preset}-{canon or 'none'} B={B} T={T} {extra}: estimate {est.total} B <= measured {measured} B "
        f"({measured / est.total:.2f}x); gradients {est.gradients}, activations {est.activations}"
    )
    assert est.total <= measured <= 4 * est.total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu)")
@pytest.mark.parametrize("preset,canon", [("llama", "ABCD"), ("llama", ""), ("gla", "AbCD"), ("mamba2", "AbCD")])
def test_memory_is_a_lower_bound_of_cuda_max_memory_allocated(preset, canon):
    """The same bound on a GPU: ``training_memory(...).total`` <= ``torch.cuda.max_memory_allocated()`` over a second
    real training step (fp32, reference ops: what the arithmetic counts) <= 4x it plus 64 MiB (cuBLAS workspaces and
    the allocator's rounding, which the estimate does not count). Not written to pass without a GPU: it runs only
    with ``-m gpu`` on CUDA and asserts the step ran there."""
    from canonlm.arch.loss import lm_loss
    from canonlm.arch.memory import training_memory

    B, T = 8, 512
    cfg, model = _tiny(preset, canon, T, size="4L256D")
    dev = torch.device("cuda")
    model = model.to(dev)
    model.place(dev, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    x = torch.randint(1, 32, (B, T), device=dev)

    def step():
        lm_loss(model(x), x, None)["loss_sum"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the AdamW state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated(dev)
    assert next(model.parameters()).is_cuda and measured > 0
    est = training_memory(cfg, B, T)
    print(
        f"{preset}-{canon or 'none'} B={B} T={T} on {torch.cuda.get_device_name(dev)}: estimate {est.total} B <= "
        f"max_memory_allocated {measured} B ({measured / est.total:.2f}x)"
    )
    assert est.total <= measured <= 4 * est.total + (64 << 20)


# -------------------------------------------------------------------------------------------------- parameters


def test_llama_parameters_against_the_paper_and_the_release(corpus, tmp_path, capsys):
    """24L2048D Llama, vocabulary 32,000, untied, SwiGLU d_ff 5632 (8d/3 rounded up to 256, lingua): the hand
    formula ``L(4d^2 + 3 d d_ff + 2d) + 2Vd + d``; the release's table (1.36B, 1.37B with Canon-ABCD) to its two
    decimals; the paper's "~1.35B" within 1.5 %."""
    L, d, ff = 24, 2048, 5632
    hand = L * (4 * d * d + 3 * d * ff + 2 * d) + 2 * VOCAB * d + d
    counts = {}
    for canon in ("none", "ABCD"):
        assert main([*paper(corpus, tmp_path, f"canon={canon}"), "--world-size", "8"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("parameters"))
        counts[canon] = int(line.split()[1].replace(",", ""))
    assert counts["none"] == hand
    assert (round(counts["none"] / 1e9, 2), round(counts["ABCD"] / 1e9, 2)) == (1.36, 1.37)
    assert abs(counts["none"] / 1.35e9 - 1) < 0.015


@pytest.mark.parametrize("arch,heads", [("gla", 4), ("gdn", 12), ("mamba2_mlp", 16)])
def test_linear_result12_parameters_are_the_papers_1_35b(arch, heads, corpus, tmp_path, capsys):
    """Result 12's linear models at 24L2048D (GLA 4 heads, GDN 12, Mamba2 with MLP 16; their presets' widths,
    Canon-AbCD): the paper's "~1.35B parameters" within 1.5 %."""
    args = [*paper(corpus, tmp_path, f"arch={arch}", "canon=AbCD", f"model.n_heads={heads}"), "--world-size", "8"]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("parameters"))
    n = int(line.split()[1].replace(",", ""))
    assert abs(n / 1.35e9 - 1) < 0.015, n


# ------------------------------------------------------------------------------- the 1.3B printout, by hand


def test_the_1_3b_llama_estimate_by_hand(corpus, tmp_path):
    """Every number of the paper's 1.3B Llama on 8 H100s under FSDP2 (bf16 param_dtype, fp32 state) re-derived from
    the formulas of docs/estimate.md (its hand-check table)."""
    from canonlm.config.strict import compose_jobs
    from canonlm.estimate import CONF, estimate_job, gpu_spec

    (job,) = compose_jobs(paper(corpus, tmp_path), CONF, "train")
    with job.active() as cfg:
        e = estimate_job(cfg, 8, gpu_spec("h100"), None, [])
    L, d, ff, V, T, H = 24, 2048, 5632, VOCAB, 4096, 32
    N = L * (4 * d * d + 3 * d * ff + 2 * d) + 2 * V * d + d
    fwd = 2 * (L * (4 * d * d + 3 * d * ff) + d * V) + L * 4 * H * (d // H) * T  # weight products + attention
    assert (e.n_params, e.flops["total"]) == (N, 3 * fwd)
    assert (e.steps, e.tokens, e.micro_batch) == (510_000, 510_000 * 48 * 4096, 48 // 8)
    m = e.memory
    shard = math.ceil(4 * N / 8)
    assert (m.parameters, m.gradients, m.optimizer) == (shard, shard, 2 * shard)
    root, block = 2 * V * d + d, 4 * d * d + 3 * d * ff + 2 * d
    assert m.gathered == 2 * (root + block)
    # bytes a token: every block's input (the residual stream: bf16, FSDP2's param_dtype), q k v, attention output,
    # MLP input, w13 output (bf16 compute); the final norm's input (bf16) and the loss' fp32 log-softmax (4 V)
    block = d + 3 * d + d + d + 2 * ff
    per_token = L * block * 2 + d * 2 + 4 * V
    assert m.activations == 6 * T * per_token and m.batch == 6 * T * 17
    assert m.total == shard * 3 + max(shard, m.activations) + m.batch + m.gathered
    # checkpointing: every block's input + one block recomputed (its input is the one the checkpoint holds)
    assert e.memory_ckpt.activations == 6 * T * ((L * d + block - d + d) * 2 + 4 * V)
    assert m.doc_masking is None and e.doc_mask is False
    assert e.mfu == 0.40 and "ASSUMED" in e.mfu_from
    assert e.gpu_seconds == pytest.approx(3 * fwd * 510_000 * 48 * 4096 / (989e12 * 0.40), rel=1e-12)
    assert e.gpu.memory == 81559 * 2**20 == GPUS["h100"][1] * 2**20


# ------------------------------------------------------------------ the activation terms and document masking


def _llama(canon: str = "ABCD", V: int = 32, **kw):
    """A tiny Llama config (2 layers, d 64, 2 heads of 32, SwiGLU d_ff 256) with Canon ``canon``, vocabulary V."""
    return build_model_config(
        {"arch": "llama", "size": "2L64D", **kw},
        canon={"set": canon},
        pos={"type": "rope"},
        vocab_size=V,
        max_seq_len=256,
    )


def test_the_activation_terms_by_hand():
    """Each activation term against its formula, on a tiny Llama (2 layers, d 64, d_ff 256, vocabulary 32) and GLA
    for B x T = 4 x 128 tokens (bytes a token): under ``bf16-mixed`` every block's input and the final norm's input
    are the fp32 residual stream (4 bytes; 2 under FSDP2's bf16 param_dtype and bf16-true), the rest of a block bf16
    (2 bytes), the loss' log-softmax fp32 (4 V whatever the compute dtype); Canon-A and Canon-C add d each per block
    (their inputs) for Llama and the linear mixers alike."""
    from canonlm.arch.memory import training_memory

    cfg = _llama()
    L, d, f, V, B, T = 2, 64, 256, 32, 4, 128
    assert (cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.kv_heads * cfg.head_dim) == (L, d, f, d)
    tok = B * T
    # Canon-A input, q k v before and after Canon-B, attention output, Canon-C input, MLP input, w13 out (twice: D)
    block = d + 2 * (3 * d) + d + d + d + 2 * (2 * f)
    mixed = training_memory(cfg, B, T, precision="bf16-mixed").activations
    assert mixed == tok * ((L + 1) * d * 4 + L * block * 2 + 4 * V)
    fsdp = training_memory(cfg, B, T, fsdp_param_dtype="bf16", n_params=0).activations
    assert mixed - fsdp == tok * (L + 1) * d * (4 - 2)
    assert training_memory(cfg, B, T, precision="bf16-true").activations == fsdp
    assert training_memory(cfg, B, T).activations == tok * (((L + 1) * d + L * block) * 4 + 4 * V)  # fp32
    # the log-softmax: 1000 more vocabulary entries are 4,000 more bytes a token under bf16 compute
    assert training_memory(_llama(V=V + 1000), B, T, precision="bf16-mixed").activations - mixed == tok * 4 * 1000
    # Canon-A and Canon-C: d each per block, in the compute dtype
    for prec, c in (("32-true", 4), ("bf16-mixed", 2)):
        without = training_memory(_llama("BD"), B, T, precision=prec).activations
        assert training_memory(cfg, B, T, precision=prec).activations - without == tok * L * 2 * d * c
    gla = [
        build_model_config(
            dict(ARCH_PRESETS["gla"], size="2L64D"), canon={"set": s}, pos={"type": "rope"}, vocab_size=V, max_seq_len=T
        )
        for s in ("AbCD", "bD")
    ]
    assert training_memory(gla[0], B, T).activations - training_memory(gla[1], B, T).activations == tok * L * 2 * d * 4


@pytest.mark.parametrize("kind", ["sdpa", "flash", "gqa", "gla", "mamba2"])
def test_the_document_masking_terms_by_hand(kind):
    """``doc_mask=True`` adds, for B x T = 3 x 256 tokens under bf16 compute: Llama with sdpa one (B, 1, T, T) bf16
    mask (B T^2 x 2 bytes, once for the 2 layers) and, with grouped-query attention (4 heads, 1 key/value head),
    k and v repeated to the 4 heads in every layer (one layer under checkpointing); flash no mask but
    ``cu_seqlens`` (int64, B + 1 entries at least); GLA ``cu_seqlens``, Mamba2 nothing more; always the position
    in document (int64) and document index (int32) of every token, and ``doc_ids`` (int32) in the batch."""
    from canonlm.arch.memory import training_memory

    B, T, L, d = 3, 256, 2, 64
    cfg = {
        "sdpa": lambda: _llama(),
        "flash": lambda: _llama(kernels={"attention": "flash"}),
        "gqa": lambda: _llama(n_heads=4, n_kv_heads=1),
        "gla": lambda: build_model_config(
            dict(ARCH_PRESETS["gla"], size="2L64D"),
            canon={"set": "AbCD"},
            pos={"type": "rope"},
            vocab_size=32,
            max_seq_len=T,
        ),
        "mamba2": lambda: build_model_config(
            dict(ARCH_PRESETS["mamba2"], size="2L64D"),
            canon={"set": "AbCD"},
            pos={"type": "rope"},
            vocab_size=32,
            max_seq_len=T,
        ),
    }[kind]()
    mask = B * T * T * 2 if kind in ("sdpa", "gqa") else 0
    per_layer_kv = B * T * 2 * (4 - 1) * (d // 4) * 2 if kind == "gqa" else 0
    cu = (B + 1) * 8 if kind in ("flash", "gla") else 0
    index = B * T * (8 + 4) + cu
    for ckpt, layers in ((False, L), (True, 1)):
        off = training_memory(cfg, B, T, precision="bf16-mixed", n_params=0, activation_checkpointing=ckpt)
        on = training_memory(
            cfg, B, T, precision="bf16-mixed", n_params=0, activation_checkpointing=ckpt, doc_mask=True
        )
        assert on.activations - off.activations == mask + layers * per_layer_kv + index
        assert on.batch - off.batch == B * T * 4
        assert off.doc_masking is None and on.doc_masking.mask == mask


def _preset_estimate(name: str, tmp_path: Path, *extra: str, world: int = 8):
    """:func:`canonlm.estimate.estimate_job` of ``experiment=reallife/<name>`` (no corpus named) on ``world``
    H100s."""
    from canonlm.config.strict import compose_jobs
    from canonlm.estimate import CONF, estimate_job, gpu_spec

    (job,) = compose_jobs([f"experiment=reallife/{name}", f"paths.log_dir={tmp_path / 'logs'}", *extra], CONF, "train")
    with job.active() as cfg:
        return estimate_job(cfg, world, gpu_spec("h100"), None, [])


def _row(out: str, name: str) -> str:
    return next(x.strip() for x in out.splitlines() if x.strip().startswith(name))


def test_document_masking_changes_the_llama_canon_1b_estimate_by_the_hand_formula(tmp_path, capsys):
    """``reallife/llama_canon_1b`` on 8 GPUs (micro-batch B = 6 windows of T = 4096, FSDP2 bf16) with and without
    ``task.doc_mask=true``: the activations differ by the one shared bf16 mask (B T^2 x 2 bytes) and the index
    tensors (12 bytes a token; sdpa needs no ``cu_seqlens``), with or without checkpointing, and the batch data by
    ``doc_ids`` (4 bytes a token); the unmasked activations equal the hand count (bf16 stream and compute, Canon-ABCD,
    fp32 log-softmax); the two printouts show different activation rows and say which masking cost was counted."""
    B, T, L, d, ff, V = 6, 4096, 24, 2048, 5632, VOCAB
    off, on = (
        _preset_estimate("llama_canon_1b", tmp_path),
        _preset_estimate("llama_canon_1b", tmp_path, "task.doc_mask=true"),
    )
    assert (off.micro_batch, off.context, off.doc_mask, on.doc_mask) == (B, T, False, True)
    # block input, Canon-A input, q k v before and after Canon-B, attention output, Canon-C input, MLP input, w13
    # output before and after Canon-D
    block = d + d + 2 * (3 * d) + d + d + d + 2 * (2 * ff)
    assert off.memory.activations == B * T * (L * block * 2 + d * 2 + 4 * V)
    for a, b in ((off.memory, on.memory), (off.memory_ckpt, on.memory_ckpt)):
        assert b.activations - a.activations == B * T * T * 2 + B * T * (8 + 4)
        assert b.batch - a.batch == B * T * 4
    args = ["experiment=reallife/llama_canon_1b", "--world-size", "8", f"paths.log_dir={tmp_path / 'logs'}"]
    assert main(args) == 0
    out_off = capsys.readouterr().out
    assert main([*args, "task.doc_mask=true"]) == 0
    out_on = capsys.readouterr().out
    assert _row(out_off, "activations").split() == ["activations", "52.5", "GiB", "7.2", "GiB"]
    assert _row(out_on, "activations").split() == ["activations", "52.7", "GiB", "7.4", "GiB"]
    assert "document masking off (task.doc_mask=false)" in out_off
    assert (
        "document masking (task.doc_mask=true), in the rows above: attention sdpa (requested: auto): one (6, 1, "
        "4096, 4096) mask of 2-byte elements shared by the 24 layers 192.0 MiB, index tensors 288.0 KiB; batch "
        "doc_ids 96.0 KiB"
    ) in out_on


# --------------------------------------------------------------- the vocabulary, before and with the corpus


def _llama_params(L: int, d: int, heads: int, kv: int, ff: int, V: int) -> int:
    """Untied Llama: attention 4d^2 less the grouped-query k / v rows, SwiGLU 3 d d_ff, two norms a block,
    embedding and head V d each, the final norm."""
    return L * (4 * d * d - 2 * d * d * (heads - kv) // heads + 3 * d * ff + 2 * d) + 2 * V * d + d


@pytest.mark.parametrize(
    "name,world,vocab,tokenizer,unset",
    [
        ("llama_1b", 8, 32_000, "Llama-2", "paths.corpora.slimpajama, paths.corpora.fineweb_edu are unset"),
        ("p42_llama_8b", 512, 128_256, "Llama-3", "paths.corpora.nemotron_cc_llama3 is unset"),
    ],
)
def test_a_preset_is_estimated_before_its_corpora_exist(name, world, vocab, tokenizer, unset, tmp_path, capsys):
    """No corpus named (``paths.corpora.*`` unset, as a fresh checkout has them): the estimate runs (exit 0) with
    the vocabulary of the tokenizer the preset names (Result 12: Llama-2's 32,000; the 8B Part 4.2 Llama: Llama-3's
    128,256), says so, and counts the parameters of that model (the hand formula)."""
    assert main([f"experiment=reallife/{name}", "--world-size", str(world), f"paths.log_dir={tmp_path / 'l'}"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "vocabulary") == (
        f"vocabulary       {vocab:,} (the {tokenizer} tokenizer, task.vocab_size; corpus not prepared yet: {unset})"
    )
    shape = {"llama_1b": (24, 2048, 32, 32, 5632), "p42_llama_8b": (32, 4096, 32, 8, 14336)}[name]
    assert int(_row(out, "parameters").split()[1].replace(",", "")) == _llama_params(*shape, vocab)
    assert f"vocabulary {vocab} (nothing is trained or written)" in out


def test_a_corpus_of_another_vocabulary_is_named_in_the_estimate(corpus, bpe4096, tmp_path, capsys):
    """``reallife/llama_1b`` pointed at a corpus of a 4,096-token BPE: the estimate is of the corpus' model (1.250B
    parameters by the hand formula, 695 GPU-h) and a line says that its vocabulary differs from the preset's,
    naming both; with the preset's own vocabulary (32,000) the line says they agree instead."""
    args = [
        "experiment=reallife/llama_1b",
        "experiment/reallife/data=slimpajama",
        "--world-size",
        "8",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    assert main([*args, f"paths.corpora.slimpajama={bpe4096}"]) == 0
    out = capsys.readouterr().out
    n = _llama_params(24, 2048, 32, 32, 5632, 4096)
    assert n == 1_250_002_944 and f"parameters       {n:,} (1.250 B;" in out
    assert _row(out, "GPU-hours").split()[1] == "695"
    assert _row(out, "VOCABULARY DIFFERS") == (
        f"VOCABULARY DIFFERS from the preset's: the corpus {bpe4096} has a vocabulary of 4,096 (its meta.json); "
        "task.vocab_size declares 32,000 (the Llama-2 tokenizer). The parameters, FLOPs, memory and GPU-hours below "
        "are for the corpus' 4,096; train.py refuses this run until task.vocab_size=4096 (or null) is given"
    )
    assert main([*args, f"paths.corpora.slimpajama={corpus}"]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" not in out and _row(out, "vocabulary") == (
        f"vocabulary       32,000 (the corpus' meta.json, {corpus / 'meta.json'}; the Llama-2 tokenizer's, as "
        "task.vocab_size declares)"
    )


def test_no_corpus_and_no_declared_vocabulary_is_refused(tmp_path, capsys):
    """``task=text`` with neither ``task.data_dir`` nor ``task.vocab_size``: nothing gives the vocabulary; one line
    names the unset key and both ways out. A misspelt ``task.vocab_size`` is refused as any unknown key."""
    base = [
        "arch=llama",
        "canon=none",
        "model.size=2L64D",
        "task=text",
        "data.batch_size=8",
        "trainer.max_steps=10",
        f"paths.log_dir={tmp_path / 'logs'}",
        "--world-size",
        "1",
    ]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "canonlm: error: invalid config: task.data_dir='???'; allowed: a directory written by "
            "`python -m canonlm.data.prepare`"
        )
        and "task.vocab_size" in err
        and err.count("\n") == 1
    )
    assert main([*base, "task.vocab_size=32000"]) == 0
    assert _row(capsys.readouterr().out, "vocabulary") == (
        "vocabulary       32,000 (task.vocab_size; corpus not prepared yet: task.data_dir is unset)"
    )
    assert main([*base, "task.vocab_sise=32000"]) == 2
    assert "did you mean task.vocab_size?" in capsys.readouterr().err


def test_train_py_refusal_counts_document_masking(corpus, tmp_path):
    """``train.py``'s memory check takes ``task.doc_mask`` from the config as the estimate does: a batch too large
    for this machine is refused with the document-masking part of the activations named (before the model's state:
    100,000,000 windows of 128 tokens, fp32: one (B, 1, 128, 128) mask of 4-byte elements + 12 bytes a token)."""
    import re

    from canonlm.config.strict import compose_jobs
    from canonlm.errors import ConfigError
    from canonlm.estimate import CONF
    from canonlm.train.run import check_job

    (job,) = compose_jobs(
        [
            "arch=llama",
            "canon=none",
            "model.size=2L64D",
            "task=text",
            f"task.data_dir={corpus}",
            "task.context=128",
            "task.doc_mask=true",
            "data.batch_size=100000000",
            "trainer.max_steps=10",
            f"paths.log_dir={tmp_path / 'logs'}",
        ],
        CONF,
        "train",
    )
    with job.active() as cfg, pytest.raises(ConfigError) as e:
        check_job(cfg)
    B, T = 100_000_000, 128
    masked = re.search(r"\(document masking ([0-9.]+) TiB of them\)", e.value.allowed)
    assert e.value.key == "data.batch_size" and masked, e.value.allowed
    assert float(masked.group(1)) == round((B * T * T * 4 + B * T * 12) / 2**40, 1)


def test_max_tokens_sets_the_steps_as_training_does(corpus, tmp_path, capsys):
    """``trainer.max_steps=null +data.max_tokens=1e11``: ceil(1e11 / (48 x 4096)) steps, as training resolves it."""
    args = paper(corpus, tmp_path, "trainer.max_steps=null", "+data.max_tokens=1e11")
    assert main([*args, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"{math.ceil(1e11 / (48 * 4096)):,} steps (data.max_tokens=1e+11)" in out


def test_a_measured_mfu_is_used_and_named(corpus, tmp_path, capsys):
    """A ``bench/gpu_step.py`` result of the same shape on the same GPU replaces the assumed MFU."""
    bench = tmp_path / "gpu_step.jsonl"
    bench.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"record": "header", "device_name": "NVIDIA H100 80GB HBM3"},
                {
                    "record": "variant",
                    "name": "llama-none-eager",
                    "shape": "1.3B",
                    "model": "llama",
                    "canon": "none",
                    "seq_len": 4096,
                    "status": "ok",
                    "mfu": 0.31,
                },
                {
                    "record": "variant",
                    "name": "llama-none-other-shape",
                    "shape": "12L768D",
                    "model": "llama",
                    "canon": "none",
                    "seq_len": 2048,
                    "status": "ok",
                    "mfu": 0.6,
                },
            )
        )
        + "\n"
    )
    assert main([*paper(corpus, tmp_path), "--world-size", "8", "--bench", str(bench)]) == 0
    out = capsys.readouterr().out
    assert "MFU 0.31 (measured: " in out and "llama-none-eager" in out


# ---------------------------------------------------------------------------------------- refusals, no writes


def test_a_successful_estimate_writes_nothing(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path, corpus, REPO / "logs")  # a logs/ the estimate made would show up in after
    assert main([*paper(corpus, tmp_path), "--world-size", "24", "--gpu", "h100"]) == 0
    after = files_under(tmp_path, corpus, REPO / "logs")
    assert after == before
    assert "wall time" in capsys.readouterr().out


def test_an_estimate_over_the_gpus_memory_is_refused_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    """48 windows of 4096 tokens on one H100: the activations alone are 231.2 GiB. Exit 2, one line on stderr
    naming data.batch_size and the numbers, nothing on stdout, nothing written; the line says that activation
    checkpointing would fit (196,608 tokens x ((24 x 2048 + one block without its input 21,504 + 2048) x 2 B bf16 +
    4 x 32,000 B fp32 log-softmax) = 50.1 GiB of activations (more than the 5.1 GiB of fp32 gradients), + 15.2 GiB
    of fp32 parameters and AdamW state + 0.3 GiB FSDP2 all-gathered root and block + 3.2 MiB batch = 65.7 GiB)."""
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path, corpus)
    assert main([*paper(corpus, tmp_path), "--world-size", "1", "--gpu", "h100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        "canonlm: error: invalid config: data.batch_size=48; allowed: a run that fits in memory: "
        "training needs at least "
    )
    assert "fsdp2 over 1 GPU) and one NVIDIA H100 80GB HBM3 (81559 MiB) has 79.6 GiB" in err
    assert err.rstrip().endswith("with activation_checkpointing=true it needs 65.7 GiB, which fits")
    assert files_under(tmp_path, corpus) == before


def test_a_batch_that_does_not_split_over_the_gpus_is_refused(corpus, tmp_path, capsys):
    """The paper's 48 windows per step cannot be split over 32 GPUs (``canonlm.config.rules.micro_batch``)."""
    assert main([*paper(corpus, tmp_path), "--world-size", "32"]) == 2
    assert capsys.readouterr().err == (
        "canonlm: error: invalid config: data.batch_size=48; allowed: a positive "
        "multiple of world_size x accumulate_grad_batches = 32 x 1\n"
    )


def test_a_misspelt_key_is_refused_as_train_py_refuses_it(corpus, tmp_path, capsys):
    """The same one line as ``python train.py`` (its pre-Hydra check, ``check_command_line``)."""
    from canonlm.errors import ConfigError
    from canonlm.train.run import check_command_line

    args = [*paper(corpus, tmp_path), "data.batchsize=4"]
    with pytest.raises(ConfigError) as e:
        check_command_line(args, REPO / "conf")
    assert main([*args, "--world-size", "8"]) == 2
    assert capsys.readouterr().err == f"canonlm: error: {e.value}\n"


@pytest.mark.parametrize(
    "opt,value,allowed",
    [
        ("--gpu", "h1000", "h100 | h200 | a100 or a memory size in GiB"),
        ("--mfu", "1.5", "a number in (0, 1]"),
        ("--world-size", "0", "a positive integer"),
    ],
)
def test_bad_options_are_refused(opt, value, allowed, corpus, tmp_path, capsys):
    assert main([*paper(corpus, tmp_path), opt, value]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"canonlm: error: invalid config: {opt}={value!r}; allowed: {allowed}") and err.count("\n") == 1
    )


def test_the_command_runs_as_a_module(corpus, tmp_path):
    """``python -m canonlm.estimate`` (a subprocess: the real exit code and streams)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "canonlm.estimate", *paper(corpus, tmp_path), "--world-size", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=120,
    )
    assert (r.returncode, r.stdout, r.stderr.count("\n")) == (2, "", 1), r.stderr
    # the same through train.py --estimate, on the 8 GPUs it fits: the estimate printed, nothing run or written
    before = sorted(p.name for p in tmp_path.iterdir())
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *paper(corpus, tmp_path), "--estimate", "--world-size", "8"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("estimate: llama 24L2048D") and "1,364,297,728" in r.stdout, (
        r.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ------------------------------------------------------------------------- the lm-eval preset (eval/harness.py)


def test_the_reallife_task_preset_names_lm_evals_own_tasks():
    """``--tasks reallife`` expands to the paper's Result-12 list, every name a task of the installed lm-eval (its
    ``TaskManager`` index of the task folder; nothing is downloaded), one per benchmark the paper lists."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks", reason="lm-evaluation-harness is the `eval` extra")
    from canonlm.eval.harness import TASK_PRESETS, expand_tasks

    names = expand_tasks("reallife")
    assert names == list(TASK_PRESETS["reallife"])
    root = Path(lm_eval_tasks.__file__).parent  # index only the benchmarks' folders (the whole index takes ~15 s)
    folders = [
        str(root / f)
        for f in ("piqa", "hellaswag", "winogrande", "arc", "siqa", "super_glue/boolq", "wikitext", "lambada")
    ]
    assert set(names) <= set(lm_eval_tasks.TaskManager(include_path=folders, include_defaults=False).all_tasks)
    assert names == [
        "piqa",
        "hellaswag",
        "winogrande",
        "arc_easy",
        "arc_challenge",
        "social_iqa",
        "boolq",
        "wikitext",
        "lambada_openai",
    ]  # PIQA, HellaSwag, WinoGrande, ARC-e/c, SIQA, BoolQ, WikiText,
    # LAMBADA: the paper's list, in its order
    assert expand_tasks("boolq,reallife,,mmlu") == ["boolq", *[n for n in names if n != "boolq"], "mmlu"]


def test_lightning_precision_aliases_count_like_what_they_alias():
    """``trainer.precision`` short names (``"bf16"``, ``"16"``, ``"32"``, ``"64"``) are counted as the modes Lightning
    turns them into (oracle: Lightning's own alias table): ``bf16`` is ``bf16-mixed``, whose weights stay fp32."""
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR_ALIAS_CONVERSION as aliases

    from canonlm.arch.memory import dtype_bytes

    assert aliases["bf16"] == "bf16-mixed" and aliases["16"] == "16-mixed"
    for short, full in aliases.items():
        assert dtype_bytes(short) == dtype_bytes(full), (short, full)
    assert dtype_bytes("bf16-mixed") == (4, 2) and dtype_bytes("bf16-true") == (2, 2)
