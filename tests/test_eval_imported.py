"""Evaluation of a model imported from Hugging Face (``python -m canonlm.export --from-hf``: a checkpoint that records
its model config, no ``.hydra/``): ``canonlm.eval.load.load_model`` and ``python -m canonlm.eval.reallife`` on it, and
greedy generation through ``LoadedModel.lm`` using the decode cache.

The Hugging Face directory is written by canonlm's own exporter from a random CanonLM saved in the training checkpoint
layout (no official classes, no transformers needed); the tokenizer is a tiny word-level ``tokenizers`` model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import perturb_

pytest.importorskip("safetensors")
hf = pytest.importorskip("canonlm.hf")

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.config.rundir import resolve_run
from canonlm.eval.load import load_model
from canonlm.export import main as export_main

DATA = Path(__file__).parent / "data"
V = 64
NAMES = (["Ada", "Bram", "Cleo", "Dov"], ["Kai", "Lux"], ["Moss", "Nye", "Orr"])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(original CanonLM, its training-layout .ckpt, the Hugging Face dir exported from it, the .ckpt imported back)."""
    d = tmp_path_factory.mktemp("imp")
    cfg = build_model_config(
        dict(arch="llama", vocab_size=V, n_layers=2, d_model=64, n_heads=4, d_ff=96, max_seq_len=64),
        dict(set="ABCD", kernel=4),
        dict(type="rope"),
    )
    torch.manual_seed(0)
    m = CanonLM(cfg).eval()
    perturb_(m)  # non-trivial norm gains and Canon taps
    src = d / "orig" / "model.ckpt"
    src.parent.mkdir()
    torch.save(hf.checkpoint_dict(m.cfg, m.state_dict(), {}), src)
    assert export_main([str(src), str(d / "hf")]) == 0
    assert export_main(["--from-hf", str(d / "hf"), str(d / "imported.ckpt")]) == 0
    return m, src, d / "hf", d / "imported.ckpt"


def test_load_imported_checkpoint_logits(imported):
    m, _, hf_dir, ck = imported
    lm = load_model(ck, device="cpu")
    assert lm.cfg is None and lm.task_cfg["name"] == "hf_import" and lm.trained_context == 64
    assert lm.model_cfg.max_seq_len == 64 and lm.ckpt == ck.resolve() and lm.run_dir == ck.parent.resolve()
    assert lm.describe()["task"] == "hf_import"
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = m(x), lm.model(x)
    assert (got - ref).abs().max().item() <= 1e-6
    assert load_model(ck, device="cpu", max_seq_len=200).model_cfg.max_seq_len == 200


def test_resolve_run_errors(imported, tmp_path):
    m, _, hf_dir, _ = imported
    (tmp_path / "neither").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.hydra/config\.yaml"):
        resolve_run(tmp_path / "neither")
    with pytest.raises(FileNotFoundError, match=r"no \.hydra/config\.yaml"):
        resolve_run(hf_dir)  # a Hugging Face directory is not a run
    bare = tmp_path / "bare.ckpt"  # weights without checkpoint["canonlm"]
    torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()}}, bare)
    with pytest.raises(FileNotFoundError, match="records no model config"):
        load_model(bare, device="cpu")


def test_greedy_generation_uses_the_decode_cache(imported, monkeypatch):
    m, src, _, ck = imported
    lm = load_model(ck, device="cpu", batch_size=3)
    calls = []
    orig = lm.model.new_cache
    monkeypatch.setattr(lm.model, "new_cache", lambda: calls.append(1) or orig())
    assert lm.lm.use_cache
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).numpy() for n in (3, 7, 5, 1)]
    out = lm.lm.generate(prompts, max_new_tokens=6)
    assert len(calls) == 2  # one cache per batch (4 prompts, batch size 3)
    for p, o in zip(prompts, out, strict=True):
        seq = torch.tensor(p).unsqueeze(0)
        want = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(m(seq)[0, -1].argmax())
                want.append(nxt)
                seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        assert o.tolist() == want
    # the training-layout checkpoint outside a run directory loads the same way
    assert load_model(src, device="cpu").task_cfg["name"] == "hf_import"


def _tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "was", "born", "in", "the", "same", "year", "as", ".", *NAMES[0], *NAMES[1], *NAMES[2]]
    words += sorted({w for w in (DATA / "corpus.txt").read_text().split() if w not in words})
    t = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words[:V])}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(str(path))
    return path


def test_reallife_cli_on_imported_model(imported, tmp_path, capsys):
    from canonlm.eval.reallife import main

    _, _, _, ck = imported
    names = tmp_path / "names"
    names.mkdir()
    for part, lst in zip(("first", "middle", "last"), NAMES):
        (names / f"{part}_names.txt").write_text("\n".join(lst))
    out = tmp_path / "mh.json"
    args = [
        "--run",
        str(ck),
        "--task",
        "multihop",
        "--background",
        str(DATA / "corpus.txt"),
        "--lengths",
        "0,40",
        "--num-prompts",
        "2",
        "--names-dir",
        str(names),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--quiet",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--tokenizer is required" in err and "imported from Hugging Face" in err and not out.exists()
    assert main([*args, "--tokenizer", str(_tokenizer(tmp_path / "tokenizer.json"))]) == 0
    assert "results:" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["model"]["task"] == "hf_import" and res["model"]["ckpt"] == str(ck.resolve())
    assert set(res["accuracy"]) == {"1-hop", "2-hop"} and len(res["samples"]) == 8
    assert all(isinstance(s["output"], str) for s in res["samples"])
    assert np.isfinite([res["accuracy"][h][L] for h in res["accuracy"] for L in res["accuracy"][h]]).all()
