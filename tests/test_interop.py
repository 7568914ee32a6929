"""Hugging Face interop (canonlm.hf, python -m canonlm.export): logits of canonlm against the official PhysicsLM4
``LlamaCanonForCausalLM`` (run with transformers 4.51.3 in a subprocess) and against transformers' own
``LlamaForCausalLM`` (the venv's transformers, in process), both directions, plus refused inputs.

The official classes are also the oracle of the lingua layout the released checkpoints ship in
(``<dir>/default/params.json`` + ``consolidated.pth``): models with random weights are saved in it and loaded by the
official ``LlamaCanonForCausalLM.from_pretrained`` itself and by canonlm (lingua in); canonlm's ``--format
official`` exports are loaded by ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` with the
release's files placed beside them (official out). The tests that need neither those files nor the side-installed
transformers run everywhere.

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

from conftest import perturb_

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.export import main as export_main
from canonlm.hf import (
    InteropError,
    checkpoint_dict,
    export_model,
    import_hf,
    load_canonlm_checkpoint,
    load_init_weights,
    read_hf_dir,
)

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL = ROOT.parent / "shared" / "data" / "physicslm4" / "huggingface"
HF451 = ROOT / ".cache" / "hf451"
OFFICIAL_FILES = ("configuration_llama_canon.py", "modeling_llama_canon.py", "canon_helper.py")
TOL = 1e-5

pytestmark = pytest.mark.interop
# the tests that run the official classes (the `official` fixture) need the release files and transformers 4.51.3
needs_official = [
    pytest.mark.skipif(
        not all((OFFICIAL / f).is_file() for f in OFFICIAL_FILES),
        reason=f"the official release's huggingface/ files are not at {OFFICIAL}",
    ),
    pytest.mark.skipif(
        not (HF451 / "transformers" / "__init__.py").is_file(),
        reason="transformers 4.51.3 is not side-installed in .cache/hf451: run `bash scripts/setup.sh "
        "dev`, or .venv/bin/python -m pip install --no-deps --target .cache/hf451 "
        "transformers==4.51.3 'tokenizers>=0.21,<0.22' 'huggingface_hub<1.0'",
    ),
]


def official_test(fn):
    for mark in needs_official:
        fn = mark(fn)
    return fn


BASE = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
# official LlamaCanonConfig kwargs (on top of BASE): Canon subsets, kernels 2-4, residual, activation, GQA, QK-norm,
# partial RoPE, both rope versions, tying, activations, sharded safetensors
OFFICIAL_CASES = {
    "ABCD_k4_hf": dict(canon_set="ABCD", canon_kernel=4),
    "AC_k2_nores_act_gqa_lingua": dict(
        canon_set="AC",
        canon_kernel=2,
        canon_residual=False,
        canon_activation=True,
        num_key_value_heads=2,
        rope_version="lingua",
    ),
    "BD_k3_qknorm_rope8_theta500": dict(canon_set="BD", canon_kernel=3, qk_norm=True, rope_dim=8, rope_theta=500.0),
    "ABCD_qknorm_rope4_lingua_mqa_relu2_tied": dict(
        canon_set="ABCD",
        qk_norm=True,
        rope_dim=4,
        rope_version="lingua",
        num_key_value_heads=1,
        hidden_act="relu2",
        tie_word_embeddings=True,
    ),
    "nocanon_qknorm_gelu_sharded": dict(qk_norm=True, hidden_act="gelu", _shard=True),
    "B_k3_nores_rope12_lingua_gqa_sharded": dict(
        canon_set="B",
        canon_kernel=3,
        canon_residual=False,
        rope_dim=12,
        rope_version="lingua",
        num_key_value_heads=2,
        _shard=True,
    ),
    "nocanon_lingua_full": dict(rope_version="lingua"),
}
# canonlm configs exported to the official format: (model, canon, pos)
_M = dict(arch="llama", vocab_size=53, n_layers=2, d_model=64, n_heads=4, d_ff=80, max_seq_len=64)
EXPORT_CASES = {
    "ABCD_k4_half": (dict(_M), dict(set="ABCD", kernel=4), dict(type="rope")),
    "AC_k3_nores_act_gqa_interleaved_partial25": (
        dict(_M, n_kv_heads=2),
        dict(set="AC", kernel=3, residual=False, activation=True),
        dict(type="partial_rope", fraction=0.25, pairing="interleaved"),
    ),
    "nocanon_qkwhole_partial50_theta500": (
        dict(_M, qk_norm="whole"),
        dict(set=""),
        dict(type="partial_rope", fraction=0.5, theta=500.0),
    ),
    "B_k2_interleaved_tied_mqa_relu2": (
        dict(_M, n_kv_heads=1, tie_embeddings=True, mlp_act="relu2"),
        dict(set="B", kernel=2),
        dict(type="rope", pairing="interleaved"),
    ),
    "CD_k4_qkwhole_interleaved_partial75": (
        dict(_M, qk_norm="whole"),
        dict(set="CD"),
        dict(type="partial_rope", fraction=0.75, pairing="interleaved"),
    ),
}
# lingua params.json "model" sections of released-style checkpoints (+ "_freqs": a lingua rope buffer the loaders
# skip): Canon subsets, n_kv_heads absent / null / set, hidden_dim null (the 256-multiple rule) or set, QK-norm,
# partial RoPE, rope_dim = head_dim (full)
_L = dict(dim=64, n_layers=2, n_heads=4, vocab_size=59, norm_eps=1e-5, rope_theta=10000.0)
LINGUA_CASES = {
    "ABCD_hiddennull": dict(_L, hidden_dim=None, canon_set="ABCD"),
    "AC_gqa_qknorm_rope8_theta500": dict(
        _L, hidden_dim=96, canon_set="AC", n_kv_heads=2, qk_norm=True, rope_dim=8, rope_theta=500.0
    ),
    "plain_kvnull_rope16": dict(_L, hidden_dim=80, n_kv_heads=None, rope_dim=16, _freqs=True),
    "BD_mqa_qknorm_rope4": dict(_L, hidden_dim=72, canon_set="BD", n_kv_heads=1, qk_norm=True, rope_dim=4, _freqs=True),
}
# canonlm models exported with --format official (the lingua layout; kernel 4, residual, no activation, SiLU)
LINGUA_EXPORT_CASES = {
    "ABCD_half_qkwhole_partial50_gqa": (
        dict(_M, n_kv_heads=2, qk_norm="whole"),
        dict(set="ABCD"),
        dict(type="partial_rope", fraction=0.5),
    ),
    "nocanon_half_tied": (dict(_M, tie_embeddings=True), dict(set=""), dict(type="rope")),
    "B_interleaved_qkwhole_mqa": (
        dict(_M, n_kv_heads=1, qk_norm="whole"),
        dict(set="B"),
        dict(type="rope", pairing="interleaved", theta=500.0),
    ),
}
NATIVE_CASES = {
    "gqa_theta500": (dict(_M, n_kv_heads=2), dict(type="rope", theta=500.0)),
    "interleaved_tied_gelu": (dict(_M, tie_embeddings=True, mlp_act="gelu"), dict(type="rope", pairing="interleaved")),
}

WORKER = textwrap.dedent(r"""
    import json, os, shutil, sys, torch
    from safetensors.torch import load_file, save_file
    import transformers
    assert transformers.__version__ == "4.51.3", transformers.__version__
    from transformers import AutoConfig, AutoModelForCausalLM
    from configuration_llama_canon import LlamaCanonConfig
    from modeling_llama_canon import LlamaCanonForCausalLM
    sys.path.insert(0, sys.argv[3])  # tests/: conftest.perturb_ (non-trivial norm gains and Canon taps)
    from conftest import perturb_ as perturb
    out = {}
    for job in json.load(open(sys.argv[1])):
        ids = torch.tensor(job["ids"])
        if job["op"] == "build":
            kw = dict(job["kwargs"]); shard = kw.pop("_shard", False)
            torch.manual_seed(job["seed"])
            m = LlamaCanonForCausalLM(LlamaCanonConfig(**kw)).eval()
            perturb(m)
            m.save_pretrained(job["dir"], safe_serialization=True, **({"max_shard_size": "40KB"} if shard else {}))
            info = {"files": sorted(os.listdir(job["dir"]))}
        elif job["op"] == "lingua":  # a released-style checkpoint: lingua layout, loaded by the official loader
            p = job["params"]; mp = dict(p["model"]); freqs = mp.pop("_freqs", False); p = dict(p, model=mp)
            hidden = mp["hidden_dim"] or 256 * ((mp["dim"] * 8 + 3 * 256 - 1) // (3 * 256))
            torch.manual_seed(job["seed"])
            m = LlamaCanonForCausalLM(LlamaCanonConfig(
                vocab_size=mp["vocab_size"], hidden_size=mp["dim"], intermediate_size=hidden,
                num_hidden_layers=mp["n_layers"], num_attention_heads=mp["n_heads"],
                num_key_value_heads=mp.get("n_kv_heads"), qk_norm=mp.get("qk_norm", False),
                rope_dim=mp.get("rope_dim"), canon_set=mp.get("canon_set", ""), rope_theta=mp["rope_theta"],
                rms_norm_eps=mp["norm_eps"], max_position_embeddings=p["data"]["seq_len"], rope_version="lingua"))
            perturb(m)
            ren = [("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                   ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                   ("self_attn.", "attention."), ("mlp.gate_proj", "feed_forward.w1"),
                   ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
                   ("mlp.", "feed_forward."), ("post_attention_layernorm", "ffn_norm"),
                   ("input_layernorm", "attention_norm")]
            top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                   "lm_head.weight": "output.weight"}
            lsd = {}
            for k, v in m.state_dict().items():
                if k in top:
                    lsd[top[k]] = v.clone()
                    continue
                k2 = k.removeprefix("model.")
                for a, b in ren:
                    if a in k2:
                        k2 = k2.replace(a, b)
                        break
                lsd[k2] = v.clone()
            if freqs:
                lsd["rope_embeddings.freqs_cis"] = torch.randn(64, 8, 2)
            os.makedirs(os.path.join(job["dir"], "default"))
            json.dump(p, open(os.path.join(job["dir"], "default", "params.json"), "w"))
            torch.save({"model": lsd}, os.path.join(job["dir"], "default", "consolidated.pth"))
            m = LlamaCanonForCausalLM.from_pretrained(job["dir"]).eval()
            info = {"files": sorted(os.listdir(os.path.join(job["dir"], "default"))),
                    "intermediate_size": m.config.intermediate_size, "rope_version": m.config.rope_version}
        elif job["op"] == "load_lingua":  # canonlm's --format official export, the one line a user types
            m = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True).eval()
            info = {"model_class": type(m).__name__, "rope_version": m.config.rope_version}
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
""")


def _ids(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 23), generator=g).tolist()


def _canonlm_model(model: dict, canon: dict, pos: dict, seed: int) -> CanonLM:
    cfg = build_model_config(model, canon, pos)
    torch.manual_seed(seed)
    m = CanonLM(cfg).eval()
    perturb_(m)  # non-trivial norm gains and Canon taps
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
        jobs.append(
            dict(
                op="build",
                name=name,
                kwargs=dict(BASE, **kw),
                seed=100 + i,
                dir=str(tmp / f"off_{name}"),
                ids=_ids(BASE["vocab_size"], i),
                logits=str(tmp / f"off_{name}.safetensors"),
            )
        )
    for i, (name, (model, canon, pos)) in enumerate(EXPORT_CASES.items()):
        m = _canonlm_model(model, canon, pos, seed=200 + i)
        src = _save_ckpt(m, tmp / f"run_{name}" / "checkpoints" / "last.ckpt")
        out = tmp / f"exp_{name}"
        info = export_model(src.parent.parent if i % 2 else src, out, fmt="llamacanon")  # run dir and ckpt forms
        assert info["format"] == "llamacanon", info
        assert not any((out / f).exists() for f in OFFICIAL_FILES)  # the exporter never ships the official files
        for f in OFFICIAL_FILES:
            shutil.copy(OFFICIAL / f, out / f)
        ids = _ids(m.cfg.vocab_size, 50 + i)
        exported[name] = (_logits(m, ids), json.loads((out / "config.json").read_text()))
        jobs.append(dict(op="load", name=name, dir=str(out), ids=ids, logits=str(tmp / f"exp_{name}.safetensors")))
    for i, (name, params) in enumerate(LINGUA_CASES.items()):
        jobs.append(
            dict(
                op="lingua",
                name=f"lingua_{name}",
                params={"name": name, "model": params, "data": {"seq_len": 64}},
                seed=300 + i,
                dir=str(tmp / f"lingua_{name}"),
                ids=_ids(params["vocab_size"], 70 + i),
                logits=str(tmp / f"lingua_{name}.safetensors"),
            )
        )
    for i, (name, (model, canon, pos)) in enumerate(LINGUA_EXPORT_CASES.items()):
        m = _canonlm_model(model, canon, pos, seed=400 + i)
        out = tmp / f"lexp_{name}"
        info = export_model(_save_ckpt(m, tmp / f"lrun_{name}.ckpt"), out, fmt="official")
        assert info["format"] == "official" and not any((out / f).exists() for f in OFFICIAL_FILES), info
        for f in OFFICIAL_FILES:
            shutil.copy(OFFICIAL / f, out / f)
        ids = _ids(m.cfg.vocab_size, 90 + i)
        exported[f"lingua_{name}"] = (_logits(m, ids), json.loads((out / "default" / "params.json").read_text()))
        jobs.append(
            dict(
                op="load_lingua",
                name=f"lexp_{name}",
                dir=str(out),
                ids=ids,
                logits=str(tmp / f"lexp_{name}.safetensors"),
            )
        )
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "worker.py").write_text(WORKER)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HF451), str(OFFICIAL)]),
        HF_HOME=str(tmp / "hf_home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    r = subprocess.run(
        [
            sys.executable,
            str(tmp / "worker.py"),
            str(tmp / "jobs.json"),
            str(tmp / "result.json"),
            str(Path(__file__).resolve().parent),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, json.loads((tmp / "result.json").read_text()), exported


@official_test
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


@official_test
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


@official_test
@pytest.mark.parametrize("name", sorted(LINGUA_CASES))
def test_lingua_checkpoint_to_canonlm_logits(official, name, tmp_path):
    """A released-style checkpoint (lingua layout) imported by ``--from-hf``: logits equal to the official
    loader's; ``init_from`` reads the folder directly too."""
    tmp, info, _ = official
    d, params = tmp / f"lingua_{name}", LINGUA_CASES[name]
    assert info[f"lingua_{name}"]["files"] == ["consolidated.pth", "params.json"]
    assert info[f"lingua_{name}"]["rope_version"] == "lingua"
    out = tmp_path / "imported.ckpt"
    args = ["--from-hf", str(d), str(out)] + (["--variant", "default"] if name.startswith("AC") else [])
    assert export_main(args) == 0
    model, meta = load_canonlm_checkpoint(out)
    assert meta["task"]["layout"] == "lingua" and meta["task"]["variant"] == "default"
    cfg = model.cfg
    assert cfg.pos.pairing == "interleaved" and set(cfg.canon.set) == set(params.get("canon_set", ""))
    assert cfg.ffn_dim == info[f"lingua_{name}"]["intermediate_size"]  # incl. the hidden_dim=null rule
    assert cfg.kv_heads == (params.get("n_kv_heads") or params["n_heads"])
    i = list(LINGUA_CASES).index(name)
    ids = _ids(params["vocab_size"], 70 + i)
    ref = _read_logits(tmp / f"lingua_{name}.safetensors")
    diff = (_logits(model, ids) - ref).abs().max().item()
    print(f"lingua->canonlm {name}: max|dlogit| = {diff:.2e}")
    assert diff <= TOL, diff
    fresh = CanonLM(cfg).eval()
    load_init_weights(d, fresh)
    assert (_logits(fresh, ids) - ref).abs().max().item() <= TOL


@official_test
@pytest.mark.parametrize("name", list(LINGUA_EXPORT_CASES))
def test_canonlm_to_lingua_layout_logits(official, name):
    """``--format official``: AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) with the release's
    files beside the export (its config.json's auto_map -> the official from_pretrained -> default/params.json)."""
    tmp, info, exported = official
    ours, params = exported[f"lingua_{name}"]
    assert info[f"lexp_{name}"]["model_class"] == "LlamaCanonForCausalLM"
    assert info[f"lexp_{name}"]["rope_version"] == "lingua"
    theirs = _read_logits(tmp / f"lexp_{name}.safetensors")
    diff = (ours - theirs).abs().max().item()
    print(f"canonlm->lingua layout {name}: max|dlogit| = {diff:.2e}")
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
    cfg = transformers.LlamaConfig(
        vocab_size=47,
        hidden_size=64,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 2000.0},
    )
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
    export_model(_save_ckpt(m, tmp_path / "src.ckpt"), d, fmt="llamacanon")
    return d


def test_linear_model_official_formats_refused(tmp_path, capsys):
    """GLA exports in canonlm's own format (tests/test_hf_remote.py); the official layouts cannot hold it."""
    cfg = build_model_config(dict(arch="gla", vocab_size=32, n_layers=1, d_model=64), {"set": "AbCD"}, {})
    src = tmp_path / "gla.ckpt"
    torch.save(checkpoint_dict(cfg, CanonLM(cfg).state_dict(), {}), src)
    for fmt in ("official", "llamacanon"):
        assert export_main(["--format", fmt, str(src), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "model.arch='gla' cannot be exported" in err and "Mamba2" in err, err
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


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"rope_version": "neox"}, "rope_version='neox'"),
        ({"head_dim": 32}, "head_dim=32"),
    ],
)
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


# ------------------------------------------------------------------------------------------------ lingua layout, refused
def _lingua_dir(tmp_path: Path, canon: dict | None = None) -> Path:
    m = _canonlm_model(dict(_M), canon or {"set": "AC"}, {"type": "rope"}, seed=2)
    d = tmp_path / "released"
    assert export_main(["--format", "official", str(_save_ckpt(m, tmp_path / "src.ckpt")), str(d)]) == 0
    return d


def test_lingua_export_refuses_what_the_official_loader_ignores(tmp_path, capsys):
    for canon, needle in (
        ({"set": "AC", "kernel": 2}, "canon.kernel=2"),
        ({"set": "B", "residual": False}, "canon.residual=False"),
        ({"set": "D", "activation": True}, "canon.activation=True"),
    ):
        m = _canonlm_model(dict(_M), canon, {"type": "rope"}, seed=3)
        src = _save_ckpt(m, tmp_path / "k.ckpt")
        assert export_main(["--format", "official", str(src), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "from_pretrained ignores" in err and "default format" in err, err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    m = _canonlm_model(dict(_M, mlp_act="relu2"), {"set": ""}, {"type": "rope"}, seed=3)
    assert export_main(["--format", "official", str(_save_ckpt(m, tmp_path / "r.ckpt")), str(tmp_path / "out")]) == 2
    assert "model.mlp_act='relu2'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({"canon_kernel": 3}, "model.canon_kernel=3 differs from 4"),
        ({"canon_residual": False}, "model.canon_residual=False differs from True"),
        ({"norm_eps": None}, "model.norm_eps=None; a number is required"),
        ({"hidden_dim": "drop"}, "model.hidden_dim is missing"),
        ({"n_heads": 0}, "model.n_heads=0; a positive integer is required"),
        ({"rope_dim": 3}, "rope_dim=3 cannot be imported"),
    ],
)
def test_lingua_params_refused(tmp_path, capsys, edit, needle):
    d = _lingua_dir(tmp_path)
    p = d / "default" / "params.json"
    params = json.loads(p.read_text())
    for k, v in edit.items():
        if v == "drop":
            del params["model"][k]
        else:
            params["model"][k] = v
    p.write_text(json.dumps(params))
    assert export_main(["--from-hf", str(d), str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.ckpt").exists()


def test_lingua_weights_refused_and_variants_named(tmp_path, capsys):
    d = _lingua_dir(tmp_path)
    assert export_main(["--from-hf", str(d), "--variant", "final", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "no final/params.json" in err and "variants here: default" in err, err
    w = d / "default" / "consolidated.pth"
    sd = torch.load(w, weights_only=True)["model"]
    torch.save(sd, w)  # a bare state dict instead of {"model": ...}
    assert export_main(["--from-hf", str(d), str(tmp_path / "x.ckpt")]) == 2
    assert "expected {'model': state_dict}" in capsys.readouterr().err
    torch.save({"model": {k: v for k, v in sd.items() if k != "layers.1.canonC.weight"}}, w)
    assert export_main(["--from-hf", str(d), str(tmp_path / "x.ckpt")]) == 2
    assert "missing 1 tensor(s): model.layers.1.canonC.weight" in capsys.readouterr().err
    torch.save({"model": sd, "extra": InteropError("not a tensor")}, w)  # needs full unpickling
    assert export_main(["--from-hf", str(d), str(tmp_path / "x.ckpt")]) == 2
    assert "torch.load(weights_only=True)" in capsys.readouterr().err
    assert not (tmp_path / "x.ckpt").exists()


def test_lingua_skipped_keys_are_reported(tmp_path, capsys):
    d = _lingua_dir(tmp_path)
    capsys.readouterr()
    w = d / "default" / "consolidated.pth"
    state = torch.load(w, weights_only=True)
    state["model"]["rope_embeddings.freqs_cis"] = torch.zeros(64, 8, 2)
    torch.save(state, w)
    assert export_main(["--from-hf", str(d), str(tmp_path / "run")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "lingua" and info["skipped"] == ["rope_embeddings.freqs_cis"], info
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
