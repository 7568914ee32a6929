"""Every canonlm model in one line: ``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)``.

``python -m canonlm.export`` writes a plain Llama as transformers' own ``LlamaForCausalLM`` and every other model
(Llama with Canon, partial RoPE, QK-norm, NoPE, Canon biases; GLA, GDN, Mamba2 with and without Canon) as
``config.json`` + ``model.safetensors`` + canonlm's modeling code, bundled (``configuration_canonlm.py``,
``modeling_canonlm.py`` and the ``canonlm_*.py`` modules they import). The oracle is transformers itself (the venv's,
as ``dev`` installs it): it reads ``auto_map``, imports the bundled files from its own module cache and loads the
weights with its own loader; the logits must equal canonlm's with the backends the bundle resolves on the CPU (Canon
``torch``: exactly) and with canonlm's defaults (its native CPU Canon kernel: <= 1e-5), and transformers' greedy
``generate`` must produce the same tokens as ``canonlm.generate.generate_ids`` (canonlm's decode cache).
tests/test_hf_clients.py covers LoRA, generation, the standard model features and the load without canonlm.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from conftest import ARCH_PRESETS, perturb_

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.export import main as export_main
from canonlm.generate import generate_ids
from canonlm.hf import checkpoint_dict

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop
TOL = 1e-5

_SMALL = dict(vocab_size=47, n_layers=2, d_model=64, max_seq_len=64)
# name: (model, canon, pos, expected export format)
CASES = {
    "llama_ABCD_partial_qkwhole_gqa": (
        dict(arch="llama", n_heads=4, n_kv_heads=2, d_ff=96, qk_norm="whole"),
        dict(set="ABCD"),
        dict(type="partial_rope", fraction=0.5),
        "canonlm",
    ),
    "llama_AC_k2_nores_act_bias_nope": (
        dict(arch="llama", n_heads=4, d_ff=80),
        dict(set="AC", kernel=2, residual=False, activation=True, bias=True),
        dict(type="nope"),
        "canonlm",
    ),
    "llama_B_perhead_qknorm_interleaved": (
        dict(arch="llama", n_heads=2, qk_norm="per_head"),
        dict(set="B"),
        dict(type="rope", pairing="interleaved"),
        "canonlm",
    ),
    "gla_AbCD": (dict(ARCH_PRESETS["gla"], n_heads=2), dict(set="AbCD"), {}, "canonlm"),
    "gdn_nocanon": (dict(ARCH_PRESETS["gdn"], n_heads=2), dict(set=""), {}, "canonlm"),
    "gdn_AbCD_tied": (dict(ARCH_PRESETS["gdn"], n_heads=2, tie_embeddings=True), dict(set="AbCD"), {}, "canonlm"),
    "mamba2_AbCD": (dict(ARCH_PRESETS["mamba2"], n_heads=2), dict(set="AbCD"), {}, "canonlm"),
    "mamba2_nomlp_nocanon": (dict(ARCH_PRESETS["mamba2_nomlp"], n_heads=2), dict(set=""), {}, "canonlm"),
    "llama_plain": (dict(arch="llama", n_heads=4), dict(set=""), dict(type="rope"), "native"),
}


def _model(name: str) -> CanonLM:
    model, canon, pos, _ = CASES[name]
    cfg = build_model_config(dict(_SMALL, **model), canon, pos)
    torch.manual_seed(sum(map(ord, name)))
    m = CanonLM(cfg).eval()
    perturb_(m)  # non-trivial norm gains and Canon taps
    return m


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_with_auto_model_and_matches(name, tmp_path, capsys):
    m = _model(name)
    src = tmp_path / "m.ckpt"
    torch.save(checkpoint_dict(m.cfg, m.state_dict(), {}), src)
    out = tmp_path / "export"
    assert export_main([str(src), str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == CASES[name][3], info
    if info["format"] == "canonlm":
        assert {"configuration_canonlm.py", "modeling_canonlm.py", "model.safetensors"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == ("CanonLMForCausalLM" if info["format"] == "canonlm" else "LlamaForCausalLM")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 21), generator=g)
    same = CanonLM(dataclasses.replace(m.cfg, kernels={"canon": "torch"})).eval()  # what the bundle runs on a CPU
    same.load_state_dict(m.state_dict())
    with torch.no_grad():
        ours, theirs, exact = m(ids).float(), hf(ids).logits.float(), same(ids).float()
    diff = (ours - theirs).abs().max().item()
    print(
        f"{name}: AutoModelForCausalLM {type(hf).__name__}, max|dlogit| = {diff:.2e} (canonlm's defaults), "
        f"{(exact - theirs).abs().max().item():.2e} (the same backends)"
    )
    assert diff <= TOL, diff
    if info["format"] == "canonlm":
        assert torch.equal(theirs, exact)
    # greedy generate through transformers' GenerationMixin == canonlm's cached decoding
    prompts = [ids[0, :7].numpy(), ids[1, :7].numpy()]
    want = np.stack(generate_ids(m, prompts, 9))
    with torch.no_grad():
        x = torch.as_tensor(np.stack(prompts))
        got = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=9, do_sample=False, pad_token_id=m.cfg.vocab_size - 1
        )[:, 7:].numpy()
    assert (got == want).all(), (got, want)


def test_left_padding_runs_each_row_from_position_0(tmp_path, capsys):
    """Batched generation pads on the left: each left-padded row must give the logits of its tokens alone."""
    m = _model("gla_AbCD")
    src = tmp_path / "m.ckpt"
    torch.save(checkpoint_dict(m.cfg, m.state_dict(), {}), src)
    assert export_main([str(src), str(tmp_path / "e")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "e", trust_remote_code=True).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 8]])
    with torch.no_grad():
        out = hf(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])).logits
        alone = m(ids[:1, 2:])
        assert torch.allclose(out[0, 2:], alone[0], atol=TOL, rtol=0) and bool((out[0, :2] == 0).all())
        assert torch.allclose(out[1], m(ids[1:])[0], atol=TOL, rtol=0)
        right = hf(ids[1:], attention_mask=torch.tensor([[1, 1, 1, 0, 0]])).logits
        assert torch.allclose(right[0, :3], m(ids[1:, :3])[0], atol=TOL, rtol=0)
        with pytest.raises(ValueError, match="gap"):
            hf(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
