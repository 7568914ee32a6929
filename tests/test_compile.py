"""The compile path (``compile=true``): blocks compiled in torchtitan's order -- activation checkpointing inside each
block, then ``torch.compile`` per block (``CanonLM.compile_blocks``) -- take any sequence length, and the graph breaks
of every architecture are counted.

Counting: ``torch._dynamo.utils.counters["graph_break"]`` (one entry per break, with its reason) after a forward and
backward; ``counters["stats"]["unique_graphs"]`` for the graphs compiled. Breaks are a property of dynamo's tracing,
so the cheap ``eager`` / ``aot_eager`` backends count them as inductor would meet them (inductor itself runs in
tests/test_canon_speed.py). The oracle of the values: the same model run eagerly.

The breaks counted here, on the CPU paths (reference GLA / GDN / SSD, native or torch Canon), per block:

| architecture | without document masking | with document masking (``doc_ids``) |
|---|---|---|
| llama (Canon-ABCD) | 0 | 0 |
| gla, gdn (Canon-AbCD) | 0 | 1: the varlen reference reads ``cu_seqlens_cpu`` on the host (``Tensor.item``) |
| mamba2 (Canon-AbCD) | 0 | 1: the SSD reference with ``seq_idx`` builds ``cu_seqlens`` (``nonzero``, a dynamic shape) |

A break inside the checkpointed body makes dynamo run that block eagerly (a checkpoint region is one graph or none).
On a GPU the linear mixers call fla's ``chunk_gla`` / ``chunk_gated_delta_rule``, which fla-core 0.6.0 wraps in
``torch.compiler.disable`` (one more break per GLA / GDN block; not countable here).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from canonlm.arch import CanonLM, build_model_config
from conftest import ARCH_PRESETS, perturb_

#: graph breaks per block, (without, with) document masking, on the CPU paths (module docstring)
BREAKS = {"llama": (0, 0), "gla": (0, 1), "gdn": (0, 1), "mamba2": (0, 1)}


def _model(arch: str, layers: int = 1) -> CanonLM:
    canon = "ABCD" if arch == "llama" else "AbCD"
    cfg = build_model_config(
        dict(ARCH_PRESETS[arch], size=f"{layers}L64D"),
        canon={"set": canon},
        pos={"type": "rope"},
        vocab_size=32,
        max_seq_len=64,
        chunk_size=8,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = CanonLM(cfg)
    perturb_(m)
    m.place("cpu", torch.float32, compiled=True)
    return m


def _doc_ids(T: int) -> torch.Tensor:
    """Two rows of T tokens in three documents each (a 1-token document when T is small)."""
    t = torch.arange(T)
    return ((t >= T // 3).long() + (t >= T // 2).long()).expand(2, T).contiguous()


def _run(model: CanonLM, ids: torch.Tensor, doc_ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(ids, doc_ids=doc_ids)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "doc_mask"])
def test_checkpointed_compiled_llama_takes_any_length_without_a_break(docs):
    """Llama Canon-ABCD (Canon on the compile-friendly torch path), activation checkpointing inside the compiled
    blocks, ``fullgraph=True`` (a graph break raises): lengths 16, 24, 32, 40 in one process -- the second length
    recompiles once with dynamic sizes (is_causal stays a Python bool: before, ``S == T`` became a SymBool and SDPA
    raised ``TypeError``), the later ones reuse it -- and every logit and gradient equals the eager model's."""
    eager, compiled = _model("llama", 2), _model("llama", 2)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        m.set_activation_checkpointing(True)
    assert all(b.checkpointed for b in compiled.blocks)
    compiled.compile_blocks(backend="aot_eager", fullgraph=True)
    for T in (16, 24, 32, 40):
        ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
        d = _doc_ids(T) if docs else None
        (lo, go), (lc, gc) = _run(eager, ids, d), _run(compiled, ids, d)
        torch.testing.assert_close(lc, lo, rtol=1e-5, atol=1e-5)
        assert go.keys() == gc.keys() and len(go) > 10
        for n in go:
            torch.testing.assert_close(gc[n], go[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # per block: one graph at the first length, one dynamic-shape graph after; no recompile for 32 or 40
    assert counters["stats"]["unique_graphs"] <= 2 * len(compiled.blocks), dict(counters["stats"])


@pytest.mark.parametrize("arch", list(BREAKS))
@pytest.mark.parametrize("docs", [False, True], ids=["plain", "doc_mask"])
def test_graph_breaks_per_architecture(arch, docs):
    """The graph breaks of one checkpointed, compiled block of each architecture (the table of the module docstring),
    with the values of the eager model."""
    model = _model(arch)
    ref = _model(arch)
    ref.load_state_dict(model.state_dict())
    model.set_activation_checkpointing(True)
    model.compile_blocks(backend="eager")
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    d = _doc_ids(16) if docs else None
    (lc, gc), (lo, go) = _run(model, ids, d), _run(ref, ids, d)
    torch.testing.assert_close(lc, lo, rtol=1e-5, atol=1e-5)
    for n in go:
        torch.testing.assert_close(gc[n], go[n], rtol=1e-4, atol=1e-5)
    breaks = sum(counters["graph_break"].values())
    assert breaks == BREAKS[arch][docs] * len(model.blocks), dict(counters["graph_break"])


def test_checkpointing_is_inside_the_compiled_block():
    """torchtitan's order: the compiled callable is the block whose forward holds the checkpoint (so the compiler
    traces the recompute), not a checkpoint wrapped around a compiled block; the model's forward calls the blocks
    directly."""
    model = _model("llama", 2)
    model.set_activation_checkpointing(True)
    calls = []
    orig = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(fn)
        return orig(fn, *args, **kwargs)

    import canonlm.arch.model as M

    M.checkpoint, saved = spy, M.checkpoint
    try:
        model(torch.randint(0, 32, (2, 8))).sum().backward()
    finally:
        M.checkpoint = saved
    assert [getattr(f, "__func__", None) for f in calls] == [M.Block._body] * 2
    with torch.no_grad():  # no gradients: nothing to recompute, no checkpoint
        calls.clear()
        M.checkpoint = spy
        try:
            model(torch.randint(0, 32, (2, 8)))
        finally:
            M.checkpoint = saved
        assert calls == []
