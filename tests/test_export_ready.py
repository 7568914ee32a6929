"""Exports ready for the ecosystem: a tokenizer transformers loads, token ids, generation_config.json, a model card,
the text tokenizer's recorded checksum enforced, and no temporaries left by a killed export.

Oracles: transformers' own ``AutoTokenizer`` / ``GenerationConfig`` / ``pipeline`` reading the export, the task's
token names (id = index) and the ``tokenizers`` library's encoding of the prepared tokenizer file.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.export import main as export_main
from canonlm.hf import checkpoint_dict
from canonlm.hf.io import remove_stale_temporaries

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop


def _ckpt(tmp_path, task: dict, vocab: int, canon: str = "AC", name: str = "m.ckpt"):
    cfg = build_model_config(
        dict(arch="llama", vocab_size=vocab, n_layers=1, d_model=32, n_heads=2, max_seq_len=64),
        {"set": canon},
        {"type": "rope"},
    )
    torch.manual_seed(0)
    ck = checkpoint_dict(cfg, CanonLM(cfg).state_dict(), {})
    ck["canonlm"]["task"] = task
    path = tmp_path / "run" / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ck, path)
    return path


def test_synthetic_task_export_has_tokenizer_ids_config_and_card(tmp_path, capsys):
    task = OmegaConf.to_container(compose(["task=depo1_cpu"]).task, resolve=True)
    from canonlm.data.tasks import build_task

    t = build_task(task["name"], task)
    names = t.token_names()
    src = _ckpt(tmp_path, task, t.vocab_size)
    (tmp_path / "run" / "results.json").write_text(
        json.dumps({"steps": 7, "train_time_s": 1.5, "test": {"loss": 1.25, "acc": 0.5}})
    )
    out = tmp_path / "export"
    assert export_main([str(src), str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokenizer"] and info["pad_token_id"] == 0 and info["bos_token_id"] == t.bos_id
    capsys.readouterr()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # transformers 5.x reads config.json (remote code) first and asks its question (docs/huggingface.md); 4.x never
    asked = "Do you wish to run the custom code" in capsys.readouterr().out
    assert asked == (int(transformers.__version__.split(".")[0]) >= 5)
    assert len(tok) == t.vocab_size  # nothing added past the embedding
    text = "<bos> p3.e1 e2 p4.e5 <query_1> p3.e1 <ans>"
    want = [names.index(w) for w in text.replace(".", " ").split()]
    assert tok(text, add_special_tokens=False)["input_ids"] == want
    assert (tok.pad_token, tok.bos_token) == ("<pad>", "<bos>") and tok.pad_token_id == 0
    hcfg = json.loads((out / "config.json").read_text())
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert hcfg["pad_token_id"] == gen.pad_token_id == 0 and hcfg["bos_token_id"] == gen.bos_token_id == t.bos_id
    assert gen.do_sample is False and hcfg["eos_token_id"] is None and gen.eos_token_id is None  # Depo has no EOS
    # no max_length: it would make every generate(max_new_tokens=...) warn (the context is checked by the model)
    assert "max_length" not in json.loads((out / "generation_config.json").read_text())
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and "depo1" in card
    assert "pip install torch transformers" in card and "pip install canonlm" not in card  # the bundle: no canonlm
    assert "`wqkv`, `wo`, `w13`, `w2`" in card and "no end id" in card  # LoRA names, generation
    assert "| test/loss | 1.25 |" in card and "Steps: 7" in card
    # the card's tokenizer snippet loads the same tokenizer without the question
    snippet = card.split("## Tokenizer")[1].split("```python\n")[1].split("```")[0]
    ns: dict = {}
    exec(snippet.replace("<this folder>", str(out)), ns)
    assert "Do you wish" not in capsys.readouterr().out
    assert ns["tok"](text, add_special_tokens=False)["input_ids"] == want and ns["tok"].model_max_length == 64
    # the one-line pipeline of the ecosystem: tokenizer + model from the folder
    pipe = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True)
    prompt = "<bos> p3.e1 e2"
    text_out = pipe(prompt, max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text_out.startswith(prompt), text_out
    from canonlm.generate import generate_ids
    from canonlm.hf import load_canonlm_checkpoint

    model, _ = load_canonlm_checkpoint(src)
    greedy = generate_ids(model, [torch.tensor([names.index(w) for w in ("<bos>", "p3", "e1", "e2")]).numpy()], 3)[0]
    assert tok(text_out[len(prompt) :], add_special_tokens=False)["input_ids"] == greedy.tolist()


def _prepared(tmp_path):
    """A prepared-data folder whose meta.json records a BPE tokenizer (path, sha256, eos) as prepare does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from canonlm.data.text import tokenizer_sha256

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(
        ["the cat sat on the mat", "a dog ate the bone"] * 20,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tk.save(str(path))
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "meta.json").write_text(
        json.dumps({"tokenizer": {"path": str(path), "sha256": tokenizer_sha256(path), "eos_token": "<|endoftext|>"}})
    )
    return tk, path, data


def test_text_export_carries_the_prepared_tokenizer_and_checks_its_checksum(tmp_path, capsys):
    tk, path, data = _prepared(tmp_path)
    V = tk.get_vocab_size() + 4
    src = _ckpt(tmp_path, {"name": "text", "data_dir": str(data)}, V, canon="")
    assert export_main([str(src), str(tmp_path / "e1")]) == 0
    info = json.loads(capsys.readouterr().out)
    eos = tk.token_to_id("<|endoftext|>")
    assert info["eos_token_id"] == eos and info["pad_token_id"] == eos
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "e1")
    assert len(tok) == tk.get_vocab_size() and tok.eos_token == "<|endoftext|>"  # nothing added
    assert tok("the cat sat", add_special_tokens=False)["input_ids"] == tk.encode("the cat sat").ids
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "e1").eos_token_id == eos
    # changed since prepare: one message, nothing written
    path.write_text(path.read_text().replace('"cat"', '"cat"', 1) + " ")
    assert export_main([str(src), str(tmp_path / "e2")]) == 2
    err = capsys.readouterr().err
    assert "changed since prepare" in err and len(err.strip().splitlines()) == 1, err
    path.unlink()
    assert export_main([str(src), str(tmp_path / "e2")]) == 2
    assert "no longer exists" in capsys.readouterr().err
    assert not (tmp_path / "e2").exists()


def test_temporaries_of_a_killed_export_are_removed_at_the_next_start(tmp_path, capsys):
    task = OmegaConf.to_container(compose(["task=depo1_cpu"]).task, resolve=True)
    from canonlm.data.tasks import build_task

    src = _ckpt(tmp_path, task, build_task(task["name"], task).vocab_size)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited
    stale = tmp_path / f".out.tmp-{dead_pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    live = tmp_path / f".out.tmp-{1}"  # pid 1 is alive: another export at work, left alone
    live.mkdir()
    assert export_main([str(src), str(tmp_path / "out")]) == 0
    assert not stale.exists() and live.exists() and (tmp_path / "out" / "config.json").is_file()
    assert remove_stale_temporaries(tmp_path / "out") == []


def test_capo_export_carries_its_bpe_renumbered_to_the_compact_ids(tmp_path, capsys):
    """Oracle: the task's own encoder (``CapoTask.encode``: the BPE's ids mapped to compact ids) and decoder on
    rendered biographies, and canonlm's greedy decoding of the same ids."""
    task = OmegaConf.to_container(compose(["task=capo_cpu"]).task, resolve=True)
    task["cache_dir"] = str(tmp_path / "cache")
    from canonlm.data.tasks import build_task

    t = build_task("capo", task)
    V = t.vocab_size
    src = _ckpt(tmp_path, task, V)
    out = tmp_path / "export"
    assert export_main([str(src), str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["pad_token_id"], info["eos_token_id"]) == (0, t.eos_id)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<pad>", 0, "<|endoftext|>", t.eos_id)
    texts = [t.biography_text(split, r, p) for split in ("train", "val") for r in range(2) for p in range(15)]
    for text in texts:
        want = t.encode(text).tolist()
        assert tok(text, add_special_tokens=False)["input_ids"] == want, text
        assert tok.decode(want) == t.decode(want) == text
    both = t.encode(texts[0]).tolist() + [t.eos_id] + t.encode(texts[1]).tolist()
    assert tok(texts[0] + "<|endoftext|>" + texts[1], add_special_tokens=False)["input_ids"] == both
    assert tok(texts[2])["input_ids"] == t.encode(texts[2]).tolist()  # the default call adds nothing either
    outside = tok("Zyxqwv 12345 @@", add_special_tokens=False)["input_ids"]
    assert max(outside) >= V  # never in a biography: past the embedding
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.pad_token_id, gen.eos_token_id) == (0, t.eos_id)
    assert "compact ids" in (out / "README.md").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompt = tok(texts[0][:40], return_tensors="pt", add_special_tokens=False)["input_ids"]
    hf_out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]
    from canonlm.generate import generate_ids
    from canonlm.hf import load_canonlm_checkpoint

    ours, _ = load_canonlm_checkpoint(src)
    assert hf_out.tolist() == generate_ids(ours, [prompt[0].numpy()], 6)[0].tolist()
    with pytest.raises(ValueError, match="never trained on"):  # one clear error, not an IndexError
        model(torch.tensor([outside]))


def test_capo_export_stops_when_the_task_tokenizer_changed_or_is_gone(tmp_path, capsys):
    task = OmegaConf.to_container(compose(["task=capo_cpu"]).task, resolve=True)
    task["cache_dir"] = str(tmp_path / "cache")
    from canonlm.data.tasks import build_task

    V = build_task("capo", task).vocab_size
    src = _ckpt(tmp_path, task, V + 3, name="other_vocab.ckpt")  # trained under another tokenizer
    assert export_main([str(src), str(tmp_path / "e1")]) == 2
    err = capsys.readouterr().err
    assert "changed since training" in err and len(err.strip().splitlines()) == 1, err
    gone = dict(task, tokenizer=str(tmp_path / "moved" / "tokenizer.json"))
    src = _ckpt(tmp_path, gone, V, name="gone.ckpt")
    assert export_main([str(src), str(tmp_path / "e2")]) == 2
    err = capsys.readouterr().err
    assert "cannot be rebuilt" in err and "task.tokenizer" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()
