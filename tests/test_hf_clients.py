"""A ``canonlm``-format export behaves like any Hugging Face causal LM: LoRA (peft), generation, the standard model
features (gradient checkpointing, hidden states, ``inputs_embeds``, ``resize_token_embeddings``), and it runs with torch
and transformers only -- canonlm not installed -- in transformers 5.x and 4.51.

Oracles, independent of the code under test:

* transformers' own ``LlamaForCausalLM``: a plain Llama exported twice, as ``LlamaForCausalLM`` (native) and in the
  ``canonlm`` format, must give the same hidden states, ``inputs_embeds`` logits, losses (also transformers'
  ``num_items_in_batch`` form) and resized embeddings;
* canonlm's ``CanonLM`` with the same weights: block inputs recorded by forward hooks (hidden states), its logits with
  the backends the export resolves on the CPU (Canon ``torch``: equal exactly) and with its own defaults (its native
  CPU Canon kernel: within 1e-5), its cached greedy decoding (``canonlm.generate.generate_ids``);
* peft itself: LoRA layers it wraps, their gradients, ``merge_and_unload``; a block's forward hook counts (a
  checkpointed block runs again in the backward);
* transformers' ``dynamic_module_utils`` (``get_imports``, ``get_relative_imports``) on the bundled files, and a fresh
  virtual environment holding torch, transformers and peft only, where ``import canonlm`` fails.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ARCH_PRESETS, compose, perturb_

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.generate import generate_ids
from canonlm.hf import InteropError, checkpoint_dict, export_model, hf_to_canonlm
from canonlm.hf.card import lora_targets

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft comes with the `eval` extra (lm-evaluation-harness)")
pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1]
HF451 = ROOT / ".cache" / "hf451"
TOL = 1e-5
_SMALL = dict(vocab_size=47, n_layers=2, d_model=64, max_seq_len=64)
# every architecture; Llama with and without the Canon sites whose absence lets the forward use weight slices
CASES = {
    "llama_none_partial": (dict(arch="llama", n_heads=4), dict(set=""), dict(type="partial_rope", fraction=0.5)),
    "llama_AC_gqa": (dict(arch="llama", n_heads=4, n_kv_heads=2), dict(set="AC"), dict(type="rope")),
    "llama_ABCD_qknorm": (dict(arch="llama", n_heads=4, qk_norm="whole"), dict(set="ABCD"), dict(type="rope")),
    "gla_AbCD": (dict(ARCH_PRESETS["gla"], n_heads=2), dict(set="AbCD"), {}),
    "gdn_none_tied": (dict(ARCH_PRESETS["gdn"], n_heads=2, tie_embeddings=True), dict(set=""), {}),
    "mamba2_AbCD": (dict(ARCH_PRESETS["mamba2"], n_heads=2), dict(set="AbCD"), {}),
    "mamba2_nomlp_b": (dict(ARCH_PRESETS["mamba2_nomlp"], n_heads=2), dict(set="b"), {}),
}


def _model(model: dict, canon: dict, pos: dict, seed: int = 0, **over) -> CanonLM:
    cfg = build_model_config(dict(_SMALL, **model, **over), canon, pos)
    torch.manual_seed(seed)
    m = CanonLM(cfg).eval()
    perturb_(m)  # non-trivial norm gains and Canon taps
    return m


def _same_backends(m: CanonLM) -> CanonLM:
    """``m`` with the backends an export resolves on the CPU (its bundle has no native Canon kernel: ``torch``)."""
    o = CanonLM(dataclasses.replace(m.cfg, kernels={"canon": "torch"})).eval()
    o.load_state_dict(m.state_dict())
    return o


def _export(m: CanonLM, out: Path, task: dict | None = None, fmt: str = "auto", expect: str = "canonlm") -> Path:
    ck = checkpoint_dict(m.cfg, m.state_dict(), {})
    if task is not None:
        ck["canonlm"]["task"] = task
    src = out.parent / f"{out.name}_run" / "checkpoints" / "last.ckpt"
    src.parent.mkdir(parents=True)
    torch.save(ck, src)
    info = export_model(src.parent.parent, out, fmt=fmt)
    assert info["format"] == expect, info
    return out


def _load(d: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()


def _ids(V: int, shape=(2, 20), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``{case: (CanonLM, export dir)}`` for every case of :data:`CASES`, exported once."""
    tmp = tmp_path_factory.mktemp("clients")
    out = {}
    for i, (name, (model, canon, pos)) in enumerate(CASES.items()):
        m = _model(model, canon, pos, seed=i)
        out[name] = (m, _export(m, tmp / name))
    return out


# ============================================================================================ LoRA
@pytest.mark.parametrize("name", list(CASES))
def test_lora_on_the_documented_names_acts_trains_and_merges(exports, name):
    m, d = exports[name]
    names = lora_targets(m.cfg)
    card = (d / "README.md").read_text()
    assert all(f"`{n}`" in card for n in names) and "all-linear" in card, card
    linear = {n for n, mod in _load(d).named_modules() if isinstance(mod, torch.nn.Linear) and "lm_head" not in n}
    ids = _ids(m.cfg.vocab_size)
    for targets in (names, "all-linear"):
        hf = _load(d)
        with torch.no_grad():
            base = hf(ids).logits
        torch.manual_seed(0)  # init_lora_weights=False: B is random too, so the adapter changes the output at once
        pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        wrapped = {
            n.removeprefix("base_model.model.")
            for n, mod in pm.named_modules()
            if isinstance(mod, peft.tuners.lora.LoraLayer)
        }
        assert wrapped == linear, (targets, sorted(wrapped ^ linear))  # every Linear of every block, not lm_head
        with torch.no_grad():
            adapted = pm(input_ids=ids).logits
        change = (adapted - base).abs().max().item()
        pm.train()
        pm(input_ids=ids, labels=ids).loss.backward()
        lora = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
        assert len(lora) == 2 * len(linear)  # lora_A and lora_B of each
        without = [n for n, p in lora if p.grad is None or not bool(p.grad.abs().max() > 0)]
        pm.eval()
        with torch.no_grad():
            gen = pm.generate(input_ids=ids[:, :5], max_new_tokens=4, pad_token_id=0)
            merged_model = pm.merge_and_unload()
            merged = merged_model(ids).logits
            assert torch.equal(merged_model.generate(ids[:, :5], max_new_tokens=4, pad_token_id=0), gen)
        dmerge = (merged - adapted).abs().max().item()
        print(
            f"{name} {targets}: max|adapted - base| {change:.3f}, LoRA tensors without gradient {len(without)}/"
            f"{len(lora)}, max|merged - adapted| {dmerge:.1e}"
        )
        assert change > 0.05 and not without and dmerge <= TOL, (change, without, dmerge)


def test_lora_on_mamba2_out_proj_leaves_the_fused_kernel(monkeypatch):
    """On CUDA with mamba-ssm, Mamba2's conv + scan + norm + out-proj run in one kernel that reads ``out_proj.weight``
    itself: a LoRA layer on ``out_proj`` must send the mixer to the unfused path. The kernel cannot run here; it is
    replaced by canonlm's documented composition of the same arguments (``split_conv1d_scan_reference``), and the
    fused path is declared available (``use_fused_split``)."""
    from canonlm.ops import ssd as ssd_ops

    calls = []

    def fused(*a, **k):
        calls.append(1)
        return ssd_ops.split_conv1d_scan_reference(*a, **k)

    monkeypatch.setattr(ssd_ops, "use_fused_split", lambda *a, **k: True)
    monkeypatch.setattr(ssd_ops, "split_conv1d_scan_combined", fused)
    model, canon, pos = CASES["mamba2_AbCD"]
    m = _model(model, canon, pos)
    ids = _ids(m.cfg.vocab_size)
    with torch.no_grad():
        plain = m(ids)
    assert len(calls) == m.cfg.n_layers  # the fused path ran, once per block
    torch.manual_seed(0)
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["out_proj"], init_lora_weights=False))
    with torch.no_grad():
        adapted = pm(ids)
    assert len(calls) == m.cfg.n_layers and (adapted - plain).abs().max().item() > 0.05
    with torch.no_grad():
        merged = pm.merge_and_unload()(ids)  # plain Linears again: fused, merged weight
    assert len(calls) == 2 * m.cfg.n_layers and (merged - adapted).abs().max().item() <= TOL


# ============================================================================================ standard features
def _grads(model, ids, **kw) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(ids, labels=ids, **kw).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_checkpointing_recomputes_blocks_with_the_same_gradients(exports, name):
    m, d = exports[name]
    hf = _load(d).train()
    runs = []
    block = hf.model.blocks[0]
    forward = block.forward
    # the block's own forward, counted (torch's checkpoint recomputes it without running module hooks)
    block.forward = lambda *a, **k: runs.append(1) or forward(*a, **k)
    ids = _ids(m.cfg.vocab_size)
    plain = _grads(hf, ids)
    assert len(runs) == 1 and not hf.gradient_checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renamed it activation_checkpointing_enable
        hf.gradient_checkpointing_enable()
    assert hf.gradient_checkpointing
    ckpt = _grads(hf, ids)
    assert len(runs) == 3  # forward, then again in the backward
    assert plain.keys() == ckpt.keys() and len(plain) == sum(1 for p in hf.parameters() if p.requires_grad)
    diff = max((plain[k] - ckpt[k]).abs().max().item() for k in plain)
    assert diff <= 1e-6, diff
    hf.eval()
    with torch.no_grad():
        hf(ids)
    assert len(runs) == 4  # evaluation: no checkpointing
    hf.gradient_checkpointing_disable()
    hf.train()
    _grads(hf, ids)
    assert len(runs) == 5 and not hf.gradient_checkpointing
    print(f"{name}: gradient checkpointing, max |grad difference| {diff:.1e}")


@pytest.mark.parametrize("name", list(CASES))
def test_hidden_states_inputs_embeds_and_padding(exports, name):
    m, d = exports[name]
    hf = _load(d)
    ids = _ids(m.cfg.vocab_size)
    oracle = _same_backends(m)
    seen, last = [], []
    hooks = [b.register_forward_pre_hook(lambda mod, args: seen.append(args[0])) for b in oracle.blocks]
    hooks.append(oracle.blocks[-1].register_forward_hook(lambda mod, args, out: last.append(out)))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        want = oracle(ids)
        normed = oracle.norm(last[0])
    for h in hooks:
        h.remove()
    hs = out.hidden_states
    assert torch.equal(out.logits, want)  # the same code: exactly
    assert len(hs) == m.cfg.n_layers + 1
    assert torch.equal(hs[0], oracle.tok_emb(ids))
    assert all(torch.equal(a, b) for a, b in zip(hs[:-1], seen))  # the input of every block
    assert torch.equal(hs[-1], normed) and torch.equal(hf.get_output_embeddings()(hs[-1]), out.logits)
    with torch.no_grad():
        assert hf(ids).hidden_states is None
        emb = hf.get_input_embeddings()(ids)
        assert torch.equal(hf(inputs_embeds=emb).logits, out.logits)
        loss, logits, hidden = hf(ids, labels=ids, output_hidden_states=True, return_dict=False)
        assert torch.equal(logits, out.logits) and len(hidden) == len(hs)
        for bad in (dict(input_ids=ids, inputs_embeds=emb), {}):
            with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
                hf(**bad)
        # a left-padded row: its tokens alone (positions from 0), its hidden states too
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        padded = hf(ids, attention_mask=mask, output_hidden_states=True)
        alone = hf(ids[:1, 6:], output_hidden_states=True)
        assert torch.equal(padded.logits[0, 6:], alone.logits[0]) and bool((padded.logits[0, :6] == 0).all())
        assert all(torch.equal(p[0, 6:], a[0]) for p, a in zip(padded.hidden_states, alone.hidden_states))
        # the unpadded row runs alone too (batch 1): exactly that; against the batch-of-2 logits up to rounding (a
        # batch of 1 may take other BLAS / reduction blockings than a batch of 2: not bit-invariant on every CPU)
        assert torch.equal(padded.logits[1], hf(ids[1:2]).logits[0])
        torch.testing.assert_close(padded.logits[1], out.logits[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(hf(inputs_embeds=emb, attention_mask=mask).logits, padded.logits)


@pytest.mark.parametrize("name", list(CASES))
def test_resize_token_embeddings_keeps_rows_and_updates_both_configs(exports, name, tmp_path):
    m, d = exports[name]
    V = m.cfg.vocab_size
    ids = _ids(V)
    for new in (V + 5, V - 3):
        hf = _load(d)
        with torch.no_grad():
            before = hf(ids.clamp(max=min(V, new) - 1)).logits
        old_emb, old_head = hf.model.tok_emb.weight.detach().clone(), hf.model.lm_head.weight.detach().clone()
        hf.resize_token_embeddings(new, mean_resizing=False)
        keep = min(V, new)
        assert hf.model.tok_emb.weight.shape == (new, m.cfg.d_model) and hf.model.lm_head.weight.shape[0] == new
        assert torch.equal(hf.model.tok_emb.weight[:keep], old_emb[:keep])
        assert torch.equal(hf.model.lm_head.weight[:keep], old_head[:keep])
        assert (hf.model.lm_head.weight is hf.model.tok_emb.weight) == m.cfg.tie_embeddings
        assert hf.config.vocab_size == hf.config.canonlm["vocab_size"] == hf.model.cfg.vocab_size == new
        with torch.no_grad():
            after = hf(ids.clamp(max=keep - 1)).logits
        assert after.shape[-1] == new and torch.equal(after[..., :keep], before[..., :keep])
        with pytest.raises(ValueError, match=f"ids 0..{new - 1}"):
            hf(torch.full((1, 3), new))
        hf.save_pretrained(tmp_path / f"re{new}")
        again = _load(tmp_path / f"re{new}")
        assert json.loads((tmp_path / f"re{new}" / "config.json").read_text())["canonlm"]["vocab_size"] == new
        cfg2, sd2, _ = hf_to_canonlm(tmp_path / f"re{new}")  # and canonlm reads it back
        back = CanonLM(dataclasses.replace(cfg2, kernels={"canon": "torch"})).eval()
        back.load_state_dict(sd2)
        with torch.no_grad():
            assert torch.equal(again(ids.clamp(max=keep - 1)).logits, after)
            assert torch.equal(back(ids.clamp(max=keep - 1)), after)


def test_plain_llama_features_match_transformers_llama(tmp_path):
    """The same plain Llama as transformers' ``LlamaForCausalLM`` (native export) and in the canonlm format: hidden
    states, ``inputs_embeds``, the loss (transformers' mean, and its ``num_items_in_batch`` sum), gradient
    checkpointing and ``resize_token_embeddings`` agree."""
    m = _model(dict(arch="llama", n_heads=4), dict(set=""), dict(type="rope"))
    native = _load(_export(m, tmp_path / "native", expect="native"))
    ours = _load(_export(m, tmp_path / "ours", fmt="canonlm"))
    assert type(native).__name__ == "LlamaForCausalLM" and type(ours).__name__ == "CanonLMForCausalLM"
    ids = _ids(m.cfg.vocab_size)
    labels = ids.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        a = native(ids, output_hidden_states=True, labels=labels)
        b = ours(ids, output_hidden_states=True, labels=labels)
        assert len(a.hidden_states) == len(b.hidden_states) == m.cfg.n_layers + 1
        for x, y in zip(a.hidden_states, b.hidden_states):
            assert (x - y).abs().max().item() <= TOL
        assert (a.logits - b.logits).abs().max().item() <= TOL and abs(a.loss.item() - b.loss.item()) <= TOL
        emb = native.get_input_embeddings()(ids)
        assert (native(inputs_embeds=emb).logits - ours(inputs_embeds=emb).logits).abs().max().item() <= TOL
        n = torch.tensor(57)
        la = native(ids, labels=labels, num_items_in_batch=n).loss
        lb = ours(ids, labels=labels, num_items_in_batch=n).loss
        assert abs(la.item() - lb.item()) <= TOL and abs(lb.item() - b.loss.item() * 32 / 57) <= TOL
        for kw in (dict(input_ids=ids, inputs_embeds=emb), {}):
            msgs = []
            for model in (native, ours):
                with pytest.raises(ValueError) as e:
                    model(**kw)
                msgs.append(str(e.value))
            assert msgs[0] == msgs[1], msgs
    for model in (native, ours):
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    ga, gb = _grads(native, ids), _grads(ours, ids)
    ga = {k.replace("model.embed_tokens", "model.tok_emb"): v for k, v in ga.items()}
    assert (ga["model.tok_emb.weight"] - gb["model.tok_emb.weight"]).abs().max().item() <= TOL
    assert (ga["lm_head.weight"] - gb["model.lm_head.weight"]).abs().max().item() <= TOL
    for model in (native, ours):
        model.eval().resize_token_embeddings(m.cfg.vocab_size + 4, mean_resizing=False)
    assert native.config.vocab_size == ours.config.vocab_size == ours.config.canonlm["vocab_size"]
    V = m.cfg.vocab_size
    assert torch.equal(native.get_input_embeddings().weight[:V], ours.get_input_embeddings().weight[:V])
    assert torch.equal(native.get_output_embeddings().weight[:V], ours.get_output_embeddings().weight[:V])


# ============================================================================================ generation
def _depo(tmp_path, arch: str, seed: int = 0, **over):
    """A Depo run (a task without an end token) of ``arch``, exported: ``(CanonLM, export dir, task)``."""
    task = OmegaConf.to_container(compose(["task=depo1_cpu"]).task, resolve=True)
    from canonlm.data.tasks import build_task

    t = build_task(task["name"], task)
    model = dict(arch="llama", n_heads=4) if arch == "llama" else dict(ARCH_PRESETS[arch], n_heads=2)
    m = _model(
        model,
        dict(set="AbCD" if arch != "llama" else "ABCD"),
        dict(type="rope") if arch == "llama" else {},
        seed=seed,
        vocab_size=t.vocab_size,
        **over,
    )
    return m, t, task


def _greedy_with_pad(m: CanonLM, prompts: list[np.ndarray], n: int) -> np.ndarray:
    """canonlm's greedy continuation after tilting the LM head so that the pad id 0 wins where the most frequent
    generated token would: the output then holds id 0 (a pad, not an end token) between other tokens."""
    first = np.stack(generate_ids(m, prompts, n))
    vals, counts = np.unique(first[first != 0], return_counts=True)
    k = int(vals[np.argmax(counts)])
    with torch.no_grad():
        m.lm_head.weight[0] = m.lm_head.weight[k] * 1.05
    return np.stack(generate_ids(m, prompts, n))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("arch", ["llama", "gla"])
def test_generate_equals_canonlm_over_long_outputs_through_pad_ids(arch, tmp_path):
    m, t, task = _depo(tmp_path, arch)
    names = t.token_names()
    prompt = np.array([names.index(w) for w in "<bos> p3 e1 e2 p4 e5".split()])
    prompts = [prompt, np.concatenate([prompt[:1], prompt[3:], prompt[1:3]])]
    N = 40
    want = _greedy_with_pad(m, prompts, N)
    assert (want == 0).any() and (want != 0).any(), want
    d = _export(m, tmp_path / "e", task=task)
    gen_cfg = json.loads((d / "generation_config.json").read_text())
    assert "max_length" not in gen_cfg and gen_cfg["pad_token_id"] == 0 and "eos_token_id" not in gen_cfg, gen_cfg
    assert json.loads((d / "config.json").read_text())["eos_token_id"] is None
    hf = _load(d)
    rec = _Records()
    logging.getLogger("transformers").addHandler(rec)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            x = torch.as_tensor(np.stack(prompts))
            got = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N)[:, x.shape[1] :].numpy()
            # left-padded rows of different lengths (what pipelines and lm-eval send)
            short = torch.as_tensor(prompts[0][:4])
            xp = torch.stack([torch.cat([torch.zeros(2, dtype=torch.long), short]), x[1]])
            mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
            got_pad = hf.generate(xp, attention_mask=mask, max_new_tokens=12)[:, 6:].numpy()
    finally:
        logging.getLogger("transformers").removeHandler(rec)
    assert got.shape == (2, N) and (got == want).all(), (got, want)
    assert (got_pad[0] == generate_ids(m, [prompts[0][:4]], 12)[0]).all() and (got_pad[1] == want[1, :12]).all()
    said = [str(w.message) for w in caught] + rec.messages
    assert not [s for s in said if "max_length" in s], said
    print(
        f"{arch}: HF greedy == canonlm.generate for {N} tokens per row ({int((want == 0).sum())} pad ids among "
        "them); no max_length warning"
    )


def test_generate_refuses_a_request_past_a_llama_context_before_generating(tmp_path):
    model, canon, pos = CASES["llama_AC_gqa"]
    llama = _model(model, canon, pos)
    gla = _model(*CASES["gla_AbCD"])
    hf_llama, hf_gla = _load(_export(llama, tmp_path / "llama")), _load(_export(gla, tmp_path / "gla"))
    runs = []
    hf_llama.model.register_forward_pre_hook(lambda *a, **k: runs.append(1))
    ids = _ids(47, (1, 60))
    with torch.no_grad():
        for kw in (dict(max_new_tokens=5), dict(max_length=70)):
            with pytest.raises(ValueError, match="past the model's context of 64") as e:
                hf_llama.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kw)
            assert "at most 4 new tokens" in str(e.value) and not runs
        with pytest.raises(ValueError, match="the prompt \\(65 tokens\\)"):
            hf_llama.generate(_ids(47, (1, 65)), max_new_tokens=1, pad_token_id=0)
        assert not runs
        out = hf_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=0)
        assert out.shape == (1, 64) and runs
        # left padding: the real tokens count (a left-padded row runs from position 0)
        mask = torch.ones_like(ids)
        mask[:, :10] = 0
        assert hf_llama.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0).shape == (1, 74)
        # no positional limit: a GLA generates past its training context
        assert hf_gla.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, pad_token_id=0).shape == (
            1,
            70,
        )


def test_generate_from_inputs_embeds(exports):
    for name in ("llama_AC_gqa", "mamba2_AbCD"):
        m, d = exports[name]
        hf = _load(d)
        prompt = _ids(m.cfg.vocab_size, (2, 6))
        want = np.stack(generate_ids(_same_backends(m), list(prompt.numpy()), 8))
        with torch.no_grad():
            got = hf.generate(inputs_embeds=hf.get_input_embeddings()(prompt), max_new_tokens=8, pad_token_id=0)
        assert (got.numpy()[:, -8:] == want).all(), (got, want)


# ============================================================================================ the bundle
def test_bundle_needs_torch_and_transformers_only_and_names_every_file(exports):
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    from canonlm.hf.remote import bundle

    d = exports["gla_AbCD"][1]
    files = sorted(p.name for p in d.glob("*.py"))
    assert files == sorted(bundle.bundle_sources())
    needed = set().union(*(get_imports(str(d / f)) for f in files))
    assert needed <= set(sys.stdlib_module_names) | {"torch", "transformers"}, sorted(needed)
    # transformers 4.51 copies only the files the modeling file imports itself: all of them
    assert {f"{r}.py" for r in get_relative_imports(str(d / "modeling_canonlm.py"))} == set(files) - {
        "modeling_canonlm.py"
    }
    import ast

    for f in files:
        tree = ast.parse((d / f).read_text())
        absolute = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "canonlm"
        ]
        absolute += [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "canonlm" for a in n.names)
        ]
        assert not absolute, (f, [ast.unparse(n) for n in absolute])
    assert "canonlm_ops_canon__native.py" in files and "REASON" in (d / "canonlm_ops_canon__native.py").read_text()


def test_native_stub_has_what_the_canon_op_reads():
    import ast

    from canonlm.hf.remote import native_stub

    src = (ROOT / "src" / "canonlm" / "ops" / "canon" / "__init__.py").read_text()
    used = {
        n.attr
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "_native"
    }
    assert used and all(hasattr(native_stub, a) for a in used), used - set(dir(native_stub))
    assert not native_stub.available() and not native_stub.SUPPORTED_DTYPES


def test_bundle_refuses_imports_it_cannot_rewrite_and_export_writes_nothing(tmp_path, monkeypatch):
    from canonlm.hf.remote import bundle

    for src, needle in (
        ("import canonlm.arch.config\n", "cannot be bundled"),
        ("x = 1; from canonlm.errors import ConfigError\n", "shares its line"),
        ("from canonlm.nothing_here import x\n", "not a canonlm module"),
    ):
        with pytest.raises(bundle.BundleError, match=needle):
            bundle._rewrite("canonlm.hf.remote.x", src, False, "x.py")
    src = "from ._fold import fold_residual\ndef f():\n    from canonlm.ops import gla as g\n    import flash_attn\n"
    text, deps = bundle._rewrite("canonlm.ops.canon._cuda", src, False, "c.py")
    assert deps == ["canonlm.ops.canon._fold", "canonlm.ops.gla"]
    assert "from .canonlm_ops_canon__fold import fold_residual" in text and "from . import canonlm_ops_gla as g" in text
    assert "    try:  # optional library" in text and "        import flash_attn" in text
    compile(text, "c.py", "exec")

    def broken():
        raise bundle.BundleError("modules a and b would share the file x.py")

    monkeypatch.setattr("canonlm.hf.io.bundle_sources", broken)
    m = _model(*CASES["gla_AbCD"])
    with pytest.raises(InteropError, match="cannot be bundled"):
        _export(m, tmp_path / "e")
    assert not (tmp_path / "e").exists()


# ============================================================================================ without canonlm
W = textwrap.dedent(r"""
    import json, os, sys, time, warnings
    t0 = time.time()
    import torch, transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_imports, get_relative_imports
    warnings.simplefilter("ignore")
    res = {"transformers": transformers.__version__, "torch": torch.__version__}
    try:
        import canonlm
        res["canonlm"] = canonlm.__file__
    except ImportError as e:
        res["canonlm"] = None
        res["canonlm_error"] = f"{type(e).__name__}: {e}"
    import peft
    res["peft"] = peft.__version__
    for job in json.load(open(sys.argv[1])):
        d, r = job["dir"], {}
        files = sorted(f for f in os.listdir(d) if f.endswith(".py"))
        r["needs"] = sorted(set().union(*(get_imports(os.path.join(d, f)) for f in files)))
        r["relative"] = sorted(get_relative_imports(os.path.join(d, "modeling_canonlm.py")))
        r["files"] = files
        ref = load_file(job["ref"])
        ids, prompt = ref["ids"], ref["prompt"]
        m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        r["class"], r["module"] = type(m).__name__, type(m).__module__
        with torch.no_grad():
            out = m(ids, output_hidden_states=True)
            r["dlogit_same_backends"] = (out.logits - ref["logits_same_backends"]).abs().max().item()
            r["dlogit_default"] = (out.logits - ref["logits_default"]).abs().max().item()
            r["hidden"] = len(out.hidden_states)
            r["hidden_last_normed"] = torch.equal(m.get_output_embeddings()(out.hidden_states[-1]), out.logits)
            r["embeds"] = torch.equal(m(inputs_embeds=m.get_input_embeddings()(ids)).logits, out.logits)
            gen = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=job["new"])
            r["generate_equal"] = gen[:, prompt.shape[1]:].tolist() == ref["greedy"].tolist()
        # gradient checkpointing: the same gradients, each block run again in the backward
        runs, block = [], m.model.blocks[0]
        forward = block.forward  # counted (torch's checkpoint recomputes it without running module hooks)
        block.forward = lambda *a, **k: runs.append(1) or forward(*a, **k)
        def grads():
            m.zero_grad(); m(ids, labels=ids).loss.backward()
            return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.train(); g0 = grads(); m.gradient_checkpointing_enable(); g1 = grads()
        r["gc_runs"] = len(runs)
        r["gc_grad_diff"] = max((g0[k] - g1[k]).abs().max().item() for k in g0) if g0.keys() == g1.keys() else None
        m.eval()
        # LoRA on the names the card documents, gradient checkpointing left on (the usual LoRA recipe)
        with torch.no_grad():
            base = m(ids).logits
        torch.manual_seed(0)
        pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=job["targets"], init_lora_weights=False))
        with torch.no_grad():
            adapted = pm(input_ids=ids).logits
        pm.train(); pm(input_ids=ids, labels=ids).loss.backward()
        lora = [p for p in pm.parameters() if p.requires_grad]
        r["lora_tensors"] = len(lora)
        r["lora_without_grad"] = sum(1 for p in lora if p.grad is None or not bool(p.grad.abs().max() > 0))
        r["lora_change"] = (adapted - base).abs().max().item()
        pm.eval()
        merged = pm.merge_and_unload()
        with torch.no_grad():
            r["merge_diff"] = (merged(ids).logits - adapted).abs().max().item()
        # resize
        V = merged.config.vocab_size
        old = merged.get_input_embeddings().weight.detach().clone()
        merged.resize_token_embeddings(V + 3, mean_resizing=False)
        r["resize"] = [V, merged.config.vocab_size, merged.config.canonlm["vocab_size"],
                       torch.equal(merged.get_input_embeddings().weight[:V], old)]
        r["tied"] = merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
        # save_pretrained writes the bundle again (transformers 4.x registers no remote-code class by itself)
        merged.save_pretrained(job["name"] + "_saved")
        again = AutoModelForCausalLM.from_pretrained(job["name"] + "_saved", trust_remote_code=True).eval()
        with torch.no_grad():
            r["reloaded"] = torch.equal(again(ids).logits, merged(ids).logits)
        r["saved_files"] = sorted(f for f in os.listdir(job["name"] + "_saved") if f.endswith(".py")) == files
        res[job["name"]] = r
    res["canonlm_loaded"] = sorted(k for k in sys.modules if k == "canonlm" or k.startswith("canonlm."))
    res["seconds"] = time.time() - t0
    json.dump(res, open(sys.argv[2], "w"))
""")


def _fresh_venv(dest: Path, version: str) -> Path:
    """A fresh venv with torch (tests/test_wheelhouse.py's hard links), transformers ``version`` (this venv's, or
    4.51.3 from .cache/hf451 with its tokenizers / huggingface_hub) and peft with their requirements: no canonlm."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from test_wheelhouse import _link_dist, _venv_with_torch

    _venv_with_torch(dest)
    site = next(dest.glob("lib/python*/site-packages"))
    provided = {}
    if version != transformers.__version__:
        for info in HF451.glob("*.dist-info"):
            dist = md.PathDistribution(info)
            provided[canonicalize_name(dist.metadata["Name"])] = dist
        assert provided["transformers"].version == version
    todo, seen = ["transformers", "peft"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = provided.get(name) or md.distribution(name)
        _link_dist(dist, site)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert "canonlm" not in seen
    return dest / "bin" / "python"


@pytest.fixture(scope="module")
def venv_jobs(tmp_path_factory):
    """One export of every architecture (a Depo run: its tokenizer and token ids), with canonlm's logits and greedy
    tokens on the same ids."""
    tmp = tmp_path_factory.mktemp("novenv")
    jobs = []
    for i, arch in enumerate(("llama", "gla", "gdn", "mamba2")):
        m, t, task = _depo(tmp, arch, seed=10 + i, **({"tie_embeddings": True} if arch == "gdn" else {}))
        d = _export(m, tmp / f"e_{arch}", task=task)
        ids, prompt = _ids(m.cfg.vocab_size, (2, 16), seed=i), _ids(m.cfg.vocab_size, (2, 5), seed=50 + i)
        with torch.no_grad():
            ref = {
                "ids": ids,
                "prompt": prompt,
                "logits_same_backends": _same_backends(m)(ids),
                "logits_default": m(ids),
                "greedy": torch.as_tensor(np.stack(generate_ids(m, list(prompt.numpy()), 24))),
            }
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ref.items()}, str(tmp / f"ref_{arch}.safetensors"))
        jobs.append(
            dict(name=arch, dir=str(d), ref=str(tmp / f"ref_{arch}.safetensors"), new=24, targets=lora_targets(m.cfg))
        )
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    return tmp, jobs


@pytest.mark.slow
@pytest.mark.parametrize("version", [transformers.__version__, "4.51.3"])
def test_export_runs_without_canonlm_installed(venv_jobs, version, tmp_path):
    if version == "4.51.3" and not (HF451 / "transformers" / "__init__.py").is_file() and not os.environ.get("CI"):
        pytest.skip("transformers 4.51.3 is not side-installed in .cache/hf451 (bash scripts/setup.sh dev)")
    tmp, jobs = venv_jobs
    t0 = time.time()
    py = _fresh_venv(tmp_path / "venv", version)
    built = time.time() - t0
    (tmp_path / "worker.py").write_text(W)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONNOUSERSITE": "1",
        "OMP_NUM_THREADS": "2",
    }
    r = subprocess.run(
        [str(py), str(tmp_path / "worker.py"), str(tmp / "jobs.json"), str(tmp_path / "out.json")],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["transformers"] == version and res["canonlm"] is None and res["canonlm_loaded"] == []
    assert "No module named 'canonlm'" in res["canonlm_error"]
    for job in jobs:
        got = res[job["name"]]
        print(
            f"transformers {version} / peft {res['peft']}, {job['name']}: {got['class']}, max|dlogit| "
            f"{got['dlogit_same_backends']:.1e} (canonlm, same backends) / {got['dlogit_default']:.1e} (canonlm "
            f"defaults), generate equal {got['generate_equal']}, LoRA change {got['lora_change']:.3f} merged "
            f"{got['merge_diff']:.1e}, GC grad diff {got['gc_grad_diff']:.1e}"
        )
        assert got["class"] == "CanonLMForCausalLM" and got["module"].startswith("transformers_modules.")
        assert set(got["needs"]) <= set(sys.stdlib_module_names) | {"torch", "transformers"}, got["needs"]
        assert {f"{f}.py" for f in got["relative"]} == set(got["files"]) - {"modeling_canonlm.py"}
        assert got["dlogit_same_backends"] == 0.0 and got["dlogit_default"] <= TOL
        assert got["hidden"] == 3 and got["hidden_last_normed"] and got["embeds"] and got["generate_equal"]
        assert got["gc_runs"] == 3 and got["gc_grad_diff"] is not None and got["gc_grad_diff"] <= 1e-6
        assert got["lora_tensors"] > 0 and got["lora_without_grad"] == 0 and got["lora_change"] > 0.05
        assert got["merge_diff"] <= TOL
        V = got["resize"][0]
        assert got["resize"] == [V, V + 3, V + 3, True], got["resize"]
        assert got["tied"] == (job["name"] == "gdn") and got["reloaded"] and got["saved_files"]
    print(f"transformers {version}: venv built in {built:.1f} s, worker {res['seconds']:.1f} s")
