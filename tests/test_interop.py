"""Hugging Face interop (canonlm.hf, python -m canonlm.export): logits of canonlm against the official PhysicsLM4
``LlamaCanonForCausalLM`` (run with transformers 4.51.3 in a subprocess) and against transformers' own
``LlamaForCausalLM`` (the venv's transformers, in process), both directions, plus refused inputs.

Needs the official release's huggingface/ files at ../shared/data/physicslm4/huggingface (relative to the repo root)
and transformers 4.51.3 side-installed in .cache/hf451 (``bash scripts/setup.sh dev`` does it, or by hand:
``.venv/bin/python -m pip install --no-deps --target .cache/hf451 transformers==4.51.3 "tokenizers>=0.21,<0.22"
"huggingface_hub<1.0"``). One subprocess builds / loads every official model (a JSON job list).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.export import main as export_main
from canonlm.hf import (InteropError, checkpoint_dict, export_model, import_hf, load_canonlm_checkpoint,
                        load_init_weights, read_hf_dir)

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL = ROOT.parent / "shared" / "data" / "physicslm4" / "huggingface"
HF451 = ROOT / ".cache" / "hf451"
OFFICIAL_FILES = ("configuration_llama_canon.py", "modeling_llama_canon.py", "canon_helper.py")
TOL = 1e-5

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(not all((OFFICIAL / f).is_file() for f in OFFICIAL_FILES),
                       reason=f"the official release's huggingface/ files are not at {OFFICIAL}"),
    pytest.mark.skipif(not (HF451 / "transformers" / "__init__.py").is_file(),
                       reason="transformers 4.51.3 is not side-installed in .cache/hf451: run `bash scripts/setup.sh "
                              "dev`, or .venv/bin/python -m pip install --no-deps --target .cache/hf451 "
                              "transformers==4.51.3 'tokenizers>=0.21,<0.22' 'huggingface_hub<1.0'"),
]

BASE = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6)
# official LlamaCanonConfig kwargs (on top of BASE): Canon subsets, kernels 2-4, residual, activation, GQA, QK-norm,
# partial RoPE, both rope versions, tying, activations, sharded safetensors
OFFICIAL_CASES = {
    "ABCD_k4_hf": dict(canon_set="ABCD", canon_kernel=4),
    "AC_k2_nores_act_gqa_lingua": dict(canon_set="AC", canon_kernel=2, canon_residual=False, canon_activation=True,
                                       num_key_value_heads=2, rope_version="lingua"),
    "BD_k3_qknorm_rope8_theta500": dict(canon_set="BD", canon_kernel=3, qk_norm=True, rope_dim=8, rope_theta=500.0),
    "ABCD_qknorm_rope4_lingua_mqa_relu2_tied": dict(canon_set="ABCD", qk_norm=True, rope_dim=4, rope_version="lingua",
                                                    num_key_value_heads=1, hidden_act="relu2",
                                                    tie_word_embeddings=True),
    "nocanon_qknorm_gelu_sharded": dict(qk_norm=True, hidden_act="gelu", _shard=True),
    "B_k3_nores_rope12_lingua_gqa_sharded": dict(canon_set="B", canon_kernel=3, canon_residual=False, rope_dim=12,
                                                 rope_version="lingua", num_key_value_heads=2, _shard=True),
    "nocanon_lingua_full": dict(rope_version="lingua"),
}
# canonlm configs exported to the official format: (model, canon, pos)
_M = dict(arch="llama", vocab_size=53, n_layers=2, d_model=64, n_heads=4, d_ff=80, max_seq_len=64)
EXPORT_CASES = {
    "ABCD_k4_half": (dict(_M), dict(set="ABCD", kernel=4), dict(type="rope")),
    "AC_k3_nores_act_gqa_interleaved_partial25": (dict(_M, n_kv_heads=2), dict(set="AC", kernel=3, residual=False,
                                                                               activation=True),
                                                  dict(type="partial_rope", fraction=0.25, pairing="interleaved")),
    "nocanon_qkwhole_partial50_theta500": (dict(_M, qk_norm="whole"), dict(set=""),
                                           dict(type="partial_rope", fraction=0.5, theta=500.0)),
    "B_k2_interleaved_tied_mqa_relu2": (dict(_M, n_kv_heads=1, tie_embeddings=True, mlp_act="relu2"),
                                        dict(set="B", kernel=2), dict(type="rope", pairing="interleaved")),
    "CD_k4_qkwhole_interleaved_partial75": (dict(_M, qk_norm="whole"), dict(set="CD"),
                                            dict(type="partial_rope", fraction=0.75, pairing="interleaved")),
}
NATIVE_CASES = {
    "gqa_theta500": (dict(_M, n_kv_heads=2), dict(type="rope", theta=500.0)),
    "interleaved_tied_gelu": (dict(_M, tie_embeddings=True, mlp_act="gelu"), dict(type="rope", pairing="interleaved")),
}

WORKER = textwrap.dedent(r'''
    import json, os, shutil, sys, torch
    from safetensors.torch import load_file, save_file
    import transformers
    assert transformers.__version__ == "4.51.3", transformers.__version__
    from transformers import AutoConfig, AutoModelForCausalLM
    from configuration_llama_canon import LlamaCanonConfig
    from modeling_llama_canon import LlamaCanonForCausalLM
    out = {}
    for job in json.load(open(sys.argv[1])):
        ids = torch.tensor(job["ids"])
        if job["op"] == "build":
            kw = dict(job["kwargs"]); shard = kw.pop("_shard", False)
            torch.manual_seed(job["seed"])
            m = LlamaCanonForCausalLM(LlamaCanonConfig(**kw)).eval()
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if "norm" in n:
                        p.add_(0.3 * torch.randn_like(p))
                    elif "canon" in n:
                        p.mul_(2.0)
            m.save_pretrained(job["dir"], safe_serialization=True, **({"max_shard_size": "40KB"} if shard else {}))
            info = {"files": sorted(os.listdir(job["dir"]))}
        else:  # load an exported directory through config.json's auto_map (the .py files were placed beside it)
            cfg = AutoConfig.from_pretrained(job["dir"], trust_remote_code=True)
            m = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True).eval()
            sd = load_file(os.path.join(job["dir"], "model.safetensors"))
            missing, unexpected = m.load_state_dict(sd, strict=False)
            allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
            assert set(missing) <= allowed and not unexpected, (missing, unexpected)
            if cfg.tie_word_embeddings:
                assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
            info = {"config_class": type(cfg).__name__, "model_class": type(m).__name__,
                    "rope_version": cfg.rope_version, "rope_dim": cfg.rope_dim, "canon_set": cfg.canon_set}
        with torch.no_grad():
            logits = m(ids).logits.float()
        save_file({"logits": logits.contiguous()}, job["logits"])
        out[job["name"]] = info
    json.dump(out, open(sys.argv[2], "w"))
''')


def _ids(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 23), generator=g).tolist()


def _canonlm_model(model: dict, canon: dict, pos: dict, seed: int) -> CanonLM:
    cfg = build_model_config(model, canon, pos)
    torch.manual_seed(seed)
    m = CanonLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains and Canon taps
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            elif "canon" in n:
                p.mul_(2.0)
    return m


def _save_ckpt(m: CanonLM, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint_dict(m.cfg, m.state_dict(), {}), path)
    return path


def _logits(m: torch.nn.Module, ids: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return m(torch.tensor(ids)).float()


def _read_logits(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["logits"]


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """Export every EXPORT_CASES model, then one subprocess (transformers 4.51.3 first on PYTHONPATH) builds every
    OFFICIAL_CASES model (random weights, safetensors) and loads every export; logits on the same ids."""
    tmp = tmp_path_factory.mktemp("interop")
    jobs, exported = [], {}
    for i, (name, kw) in enumerate(OFFICIAL_CASES.items()):
        jobs.append(dict(op="build", name=name, kwargs=dict(BASE, **kw), seed=100 + i, dir=str(tmp / f"off_{name}"),
                         ids=_ids(BASE["vocab_size"], i), logits=str(tmp / f"off_{name}.safetensors")))
    for i, (name, (model, canon, pos)) in enumerate(EXPORT_CASES.items()):
        m = _canonlm_model(model, canon, pos, seed=200 + i)
        src = _save_ckpt(m, tmp / f"run_{name}" / "checkpoints" / "last.ckpt")
        out = tmp / f"exp_{name}"
        info = export_model(src.parent.parent if i % 2 else src, out)  # run dir and checkpoint file forms
        assert info["format"] == "official", info
        assert not any((out / f).exists() for f in OFFICIAL_FILES)  # the exporter never ships the official files
        for f in OFFICIAL_FILES:
            shutil.copy(OFFICIAL / f, out / f)
        ids = _ids(m.cfg.vocab_size, 50 + i)
        exported[name] = (_logits(m, ids), json.loads((out / "config.json").read_text()))
        jobs.append(dict(op="load", name=name, dir=str(out), ids=ids, logits=str(tmp / f"exp_{name}.safetensors")))
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "worker.py").write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HF451), str(OFFICIAL)]), HF_HOME=str(tmp / "hf_home"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(tmp / "worker.py"), str(tmp / "jobs.json"), str(tmp / "result.json")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, json.loads((tmp / "result.json").read_text()), exported


@pytest.mark.parametrize("name", list(OFFICIAL_CASES))
def test_official_to_canonlm_logits(official, name, tmp_path):
    tmp, info, _ = official
    d = tmp / f"off_{name}"
    if OFFICIAL_CASES[name].get("_shard"):
        assert "model.safetensors.index.json" in info[name]["files"]
    out = tmp_path / "imported.ckpt"
    assert export_main(["--from-hf", str(d), str(out)]) == 0
    model, meta = load_canonlm_checkpoint(out)
    assert meta["model"]["arch"] == "llama" and meta["task"]["context"] == BASE["max_position_embeddings"]
    i = list(OFFICIAL_CASES).index(name)
    ref = _read_logits(tmp / f"off_{name}.safetensors")
    got = _logits(model, _ids(BASE["vocab_size"], i))
    diff = (got - ref).abs().max().item()
    print(f"official->canonlm {name}: max|dlogit| = {diff:.2e}")
    assert diff <= TOL, diff
    kw = OFFICIAL_CASES[name]
    cfg = model.cfg
    assert set(cfg.canon.set) == set(kw.get("canon_set", ""))
    assert cfg.pos.pairing == ("interleaved" if kw.get("rope_version") == "lingua" else "half")
    assert cfg.rope_dim == kw.get("rope_dim", 16) and cfg.qk_norm == ("whole" if kw.get("qk_norm") else "none")
    # and the same directory straight into a fresh model (training's init_from)
    fresh = CanonLM(cfg).eval()
    load_init_weights(d, fresh)
    assert (_logits(fresh, _ids(BASE["vocab_size"], i)) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_canonlm_to_official_logits(official, name):
    tmp, info, exported = official
    ours, hcfg = exported[name]
    assert info[name]["model_class"] == "LlamaCanonForCausalLM" and info[name]["config_class"] == "LlamaCanonConfig"
    assert hcfg["model_type"] == "LlamaCanon" and "AutoModelForCausalLM" in hcfg["auto_map"]
    theirs = _read_logits(tmp / f"exp_{name}.safetensors")
    diff = (ours - theirs).abs().max().item()
    print(f"canonlm->official {name}: max|dlogit| = {diff:.2e}")
    assert diff <= TOL, diff


@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_canonlm_to_native_llama_logits(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, pos = NATIVE_CASES[name]
    m = _canonlm_model(model, {"set": ""}, pos, seed=7)
    out = tmp_path / "hf"
    info = export_model(_save_ckpt(m, tmp_path / "m.ckpt"), out)
    assert info["format"] == "native" and info["class"] == "LlamaForCausalLM"
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == m.cfg.pos.theta
    ids = _ids(m.cfg.vocab_size, 3)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.float()
    diff = (_logits(m, ids) - theirs).abs().max().item()
    print(f"canonlm->LlamaForCausalLM {name} (transformers {transformers.__version__}): max|dlogit| = {diff:.2e}")
    assert diff <= TOL, diff
    # and back: the native directory imports into canonlm with the same logits
    back = tmp_path / "back_run"
    import_hf(out, back)
    m2, _ = load_canonlm_checkpoint(back)
    assert (_logits(m2, ids) - theirs).abs().max().item() <= TOL


def test_native_llama_to_canonlm_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=47, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 2000.0})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "native")
    ids = _ids(47, 11)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.float()
    import_hf(tmp_path / "native", tmp_path / "n.ckpt")
    m, _ = load_canonlm_checkpoint(tmp_path / "n.ckpt")
    assert m.cfg.pos.theta == 2000.0 and m.cfg.kv_heads == 2
    assert (_logits(m, ids) - ref).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------------------ refused inputs
def _tiny_hf_dir(tmp_path: Path) -> Path:
    m = _canonlm_model(dict(_M), {"set": "AC"}, {"type": "rope"}, seed=1)
    d = tmp_path / "hf"
    export_model(_save_ckpt(m, tmp_path / "src.ckpt"), d)
    return d


def test_linear_model_export_refused(tmp_path, capsys):
    cfg = build_model_config(dict(arch="gla", vocab_size=32, n_layers=1, d_model=64), {"set": "AbCD"}, {})
    src = tmp_path / "gla.ckpt"
    torch.save(checkpoint_dict(cfg, CanonLM(cfg).state_dict(), {}), src)
    assert export_main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.arch='gla' cannot be exported" in err and "Mamba2" in err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gla.ckpt"]


def test_export_into_nonempty_dir_refused(tmp_path, capsys):
    m = _canonlm_model(dict(_M), {"set": ""}, {"type": "rope"}, seed=1)
    src = _save_ckpt(m, tmp_path / "m.ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert export_main([str(src), str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(src), str(empty)]) == 0 and (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("edit, needle", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"rope_version": "neox"}, "rope_version='neox'"),
    ({"head_dim": 32}, "head_dim=32"),
])
def test_unmappable_config_refused(tmp_path, capsys, edit, needle):
    d = _tiny_hf_dir(tmp_path)
    c = json.loads((d / "config.json").read_text())
    c.update(edit)
    (d / "config.json").write_text(json.dumps(c))
    out = tmp_path / "x.ckpt"
    assert export_main(["--from-hf", str(d), str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "cannot be imported" in err, err
    assert not out.exists() and not any(p.name.startswith(".x.ckpt") for p in tmp_path.iterdir())


def test_missing_and_mismatched_tensor_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    d = _tiny_hf_dir(tmp_path)
    cfg, sd = read_hf_dir(d)
    gone = "model.layers.1.canonC.weight"
    save_file({k: v for k, v in sd.items() if k != gone}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert export_main(["--from-hf", str(d), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "missing 1 tensor(s): " + gone in err, err
    sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:32]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert export_main(["--from-hf", str(d), str(tmp_path / "run")]) == 2
    assert "k_proj.weight has shape (32, 64), expected (64, 64)" in capsys.readouterr().err
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    assert export_main(["--from-hf", str(d), str(tmp_path / "run")]) == 2
    assert "safetensors only" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_init_from_mismatch_refused(tmp_path):
    d = _tiny_hf_dir(tmp_path)
    other = CanonLM(build_model_config(dict(_M), {"set": "AC", "residual": False}, {"type": "rope"}))
    with pytest.raises(InteropError, match="canon.residual"):
        load_init_weights(d, other)
    with pytest.raises(InteropError, match="d_model"):
        load_init_weights(d, CanonLM(build_model_config(dict(_M, d_model=32, n_heads=2), {"set": "AC"}, {})))
