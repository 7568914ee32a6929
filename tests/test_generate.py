"""``python -m canonlm.generate``: decode-cache generation from a run directory.

Run directories are built in-process (composed config + a seeded random-init model saved in Lightning's checkpoint
layout, as ``train.py`` leaves them), so the whole file runs in a few seconds. The oracle for greedy decoding is an
argmax loop over full forward passes of the same model (no cache)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, compose

TINY = ["task=depo1_cpu", "model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128"]
ARCHS = {
    "llama": [],
    "gla": ["arch=gla", "canon=AbCD"],
    "gdn": ["arch=gdn", "canon=AbCD"],
    "mamba2": ["arch=mamba2", "canon=AbCD"],
}
PROMPTS = ["<bos> p3.e1 e2 p4.e5 <query_1> p3.e1 <ans>", "<bos> e4", "<bos> e2 e6 p1.e3 e2 <query_2>"]


def _make_run(run: Path, overrides: list[str], seed: int = 0) -> Path:
    from omegaconf import OmegaConf

    from canonlm.arch.model import CanonLM
    from canonlm.config.build import build_configs

    cfg = compose([*TINY, *overrides], output_dir=run)
    _, mcfg = build_configs(cfg)
    torch.manual_seed(seed)
    model = CanonLM(mcfg)
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 3},
        run / "checkpoints" / "last.ckpt",
    )
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return {a: _make_run(root / a, o) for a, o in ARCHS.items()}


def _greedy_full_forward(model, prompt: np.ndarray, n: int) -> list[int]:
    """The oracle: n steps of argmax over a full forward pass of the whole sequence (no cache)."""
    seq = [int(t) for t in prompt]
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_full_forward_argmax(runs, arch):
    """Greedy decode-cache generation (mixed prompt lengths, 2 per batch) == argmax loop over full forwards, and
    the decode cache really is used (one-token forwards with a cache)."""
    from canonlm.generate import load_generator

    g = load_generator(runs[arch], device="cpu")
    assert g.codec.kind == "names" and g.max_len == 128 and g.info["arch"] == arch
    ids = [g.codec.encode(p) for p in PROMPTS]
    calls = []
    h = g.model.register_forward_pre_hook(lambda m, args: calls.append((args[0].shape[1], len(args) > 1)))
    try:
        out = g.generate(ids, 8, batch_size=2)
    finally:
        h.remove()
    assert all(c for _, c in calls) and sum(t == 1 for t, _ in calls) >= 7  # prefill + one-token cached steps
    for p, o in zip(ids, out, strict=True):
        assert o.dtype == np.int64 and o.shape == (8,)
        assert o.tolist() == _greedy_full_forward(g.model, p, 8)


def test_trained_run_from_train_py(tmp_path):
    """A run directory as ``train.py`` writes it (5 steps in a subprocess): greedy CLI output == the full-forward
    argmax loop of the loaded model."""
    from canonlm.eval.load import load_model
    from canonlm.generate import run

    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        "data.batch_size=8",
        "data.val_windows=8",
        "trainer.max_steps=5",
        "trainer.val_check_interval=5",
        "test=false",
        "logger=none",
        "run_name=g",
        f"paths.log_dir={tmp_path}/logs",
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**__import__("os").environ, "WANDB_MODE": "disabled"},
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rd = tmp_path / "logs" / "train" / "runs" / "g"
    recs = run([str(rd), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--max-new-tokens", "8"], out=io.StringIO())
    model = load_model(rd, device="cpu").model
    assert len(recs) == 2
    for r in recs:
        assert r["continuation_ids"] == _greedy_full_forward(model, np.array(r["prompt_ids"]), 8)


def test_sampling_seed_batch_and_top_k(runs):
    from canonlm.generate import load_generator

    g = load_generator(runs["gla"], device="cpu")
    ids = [g.codec.encode(p) for p in PROMPTS]
    a = g.generate(ids, 10, temperature=1.0, seed=3, batch_size=3)
    b = g.generate(ids, 10, temperature=1.0, seed=3, batch_size=1)  # same noise whatever the batch
    c = g.generate(ids, 10, temperature=1.0, seed=4, batch_size=3)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    greedy = g.generate(ids, 10)
    assert [x.tolist() for x in a] != [x.tolist() for x in greedy]  # an untrained model's softmax is wide
    top1 = g.generate(ids, 10, temperature=1.5, top_k=1, seed=3)
    assert [x.tolist() for x in top1] == [x.tolist() for x in greedy]
    top3 = g.generate(ids, 10, temperature=2.0, top_k=3, seed=5)
    with torch.no_grad():  # every sampled token is among the 3 largest logits of a full forward at its position
        for p, o in zip(ids, top3, strict=True):
            assert len(o) == 10
            logits = g.model(torch.tensor([np.concatenate([p, o]).tolist()]))[0, len(p) - 1 : -1]
            top = torch.topk(logits, 3, dim=-1).indices
            assert all(int(t) in top[j].tolist() for j, t in enumerate(o))


def test_top_k_mask():
    from canonlm.generate import top_k_mask

    x = torch.tensor([[0.5, 3.0, 1.0, 2.0], [4.0, 1.0, 1.0, 0.0]])
    y = top_k_mask(x, 2)
    assert torch.isinf(y).sum() == 3 and y[0, 1] == 3.0 and y[0, 3] == 2.0
    assert y[1].tolist()[:3] == [4.0, 1.0, 1.0]  # ties with the k-th value are kept
    assert top_k_mask(x, None) is x and top_k_mask(x, 4) is x


def test_cli_text_json_ids_and_prompt_file(runs, tmp_path):
    from canonlm.data.tasks import build_task
    from canonlm.eval.load import load_model
    from canonlm.generate import run

    buf = io.StringIO()
    recs = run(
        [
            str(runs["llama"]),
            "--prompt",
            PROMPTS[0],
            "--prompt",
            PROMPTS[1],
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
        ],
        out=buf,
    )
    lines = buf.getvalue().splitlines()
    task = build_task("depo1", load_model(runs["llama"], device="cpu").task_cfg)
    assert len(lines) == 2 and all(len(r["continuation_ids"]) == 6 for r in recs)
    for line, p, r in zip(lines, PROMPTS, recs):
        assert line == f"{p} -> {task.decode(r['continuation_ids'])}"
        assert r["prompt_ids"] == [
            int(t) for t in np.asarray([task.token_names().index(w) for w in p.replace(".", " ").split()])
        ]
    # the checkpoint file loads the same model; --json prints one list; --prompt-file adds one prompt per line
    f = tmp_path / "prompts.txt"
    f.write_text(PROMPTS[1] + "\n\n" + PROMPTS[2] + "\n")
    buf = io.StringIO()
    recs2 = run(
        [
            str(runs["llama"] / "checkpoints" / "last.ckpt"),
            "--prompt",
            PROMPTS[0],
            "--prompt-file",
            str(f),
            "--max-new-tokens",
            "6",
            "--json",
        ],
        out=buf,
    )
    assert json.loads(buf.getvalue()) == recs2 and [r["prompt"] for r in recs2] == [PROMPTS[0], *PROMPTS[1:]]
    assert recs2[:2] == recs
    # --ids: prompts and output as token ids (same tokens)
    buf = io.StringIO()
    ids_prompt = " ".join(map(str, recs[0]["prompt_ids"]))
    recs3 = run([str(runs["llama"]), "--prompt", ids_prompt, "--ids", "--max-new-tokens", "6"], out=buf)
    assert buf.getvalue() == f"{ids_prompt} -> {' '.join(map(str, recs[0]['continuation_ids']))}\n"
    assert recs3[0]["continuation_ids"] == recs[0]["continuation_ids"]


def test_default_max_new_tokens_fits_the_context(runs):
    from canonlm.generate import run

    long = "<bos> " + " ".join(["e1"] * 110)  # 111 tokens: 17 left in the 128-token context
    recs = run([str(runs["mamba2"]), "--prompt", long], out=io.StringIO())
    assert len(recs[0]["continuation_ids"]) == 17


@pytest.mark.parametrize(
    "args, flag, words",
    [
        (["--prompt", "<bos> zz"], "--prompt='<bos> zz'", ["token 'zz' is not in the vocabulary", "<bos>", "--ids"]),
        (["--prompt", "3 19", "--ids"], "--prompt='3 19'", ["token id 19 is outside the vocabulary", "[0, 19)"]),
        (["--prompt", "<bos>", "--max-new-tokens", "128"], "--max-new-tokens=128", ["[1, 127]", "context 128"]),
        (["--prompt", "<bos>", "--max-new-tokens", "0"], "--max-new-tokens=0", ["an integer >= 1"]),
        (["--prompt", "<bos>", "--temperature", "-0.5"], "--temperature=-0.5", ["a number >= 0"]),
        (["--prompt", "<bos>", "--top-k", "-1"], "--top-k=-1", ["an integer >= 0"]),
        (["--prompt", "<bos> " + "e1 " * 130], "--prompt=", ["shorter than the model's context of 128"]),
        (["--prompt", "  "], "--prompt='  '", ["a non-empty prompt"]),
        ([], "--prompt: none given", ["at least one prompt"]),
        (
            ["--prompt", "<bos>", "--prompt-file", "/nonexistent/p.txt"],
            "--prompt-file='/nonexistent/p.txt'",
            ["No such file"],
        ),
        (["--prompt", "<bos>", "--device", "tpu"], "--device='tpu'", ["auto | cpu | cuda"]),
    ],
)
def test_bad_input_is_one_message_exit_2(runs, capsys, args, flag, words):
    from canonlm.generate import main

    assert main([str(runs["llama"]), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"canonlm.generate: error: {flag}") and "allowed: " in err[0]
    assert all(w in err[0] for w in words), err[0]


def test_bad_paths(tmp_path, capsys):
    from canonlm.generate import main

    assert main([str(tmp_path / "nope"), "--prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert "PATH=" in err and "no such file or directory" in err and "allowed: a run directory" in err
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    assert main([str(exported), "--prompt", "1"]) == 2  # config.json without weights
    try:
        import canonlm.hf  # noqa: F401 -- imported to check whether the hf extra is installed
    except ImportError:
        assert "exported directories need canonlm.hf" in capsys.readouterr().err
    else:
        err = capsys.readouterr().err
        assert "an exported directory that canonlm.hf reads" in err and "model.safetensors" in err
    (tmp_path / "notarun").mkdir()
    assert main([str(tmp_path / "notarun"), "--prompt", "1"]) == 2
    assert "no .hydra/config.yaml" in capsys.readouterr().err


def test_exported_and_imported_dirs(runs, tmp_path):
    """With canonlm.hf: an exported Hugging Face directory and a checkpoint imported back from it (no .hydra/)
    generate the run's greedy tokens. The export carries a tokenizer over the task's vocabulary, so the run's text
    prompt works there; the imported checkpoint records no task vocabulary, so its prompts are token ids."""
    hf = pytest.importorskip("canonlm.hf")
    from canonlm.generate import GenerateError, load_generator, run

    hf.export_model(runs["llama"], tmp_path / "exported")
    hf.import_hf(tmp_path / "exported", tmp_path / "imported.ckpt")
    ref = run([str(runs["llama"]), "--prompt", PROMPTS[0], "--max-new-tokens", "6"], out=io.StringIO())[0]
    ids = " ".join(map(str, ref["prompt_ids"]))
    g = load_generator(tmp_path / "exported", device="cpu")
    assert g.codec.kind == "tokenizer" and g.max_len == 128
    rec = run([str(tmp_path / "exported"), "--prompt", PROMPTS[0], "--max-new-tokens", "6"], out=io.StringIO())[0]
    assert rec["prompt_ids"] == ref["prompt_ids"] and rec["continuation_ids"] == ref["continuation_ids"]
    g = load_generator(tmp_path / "imported.ckpt", device="cpu")
    assert g.codec.kind == "ids" and g.max_len == 128
    rec = run([str(tmp_path / "imported.ckpt"), "--prompt", ids, "--max-new-tokens", "6"], out=io.StringIO())[0]
    assert rec["continuation_ids"] == ref["continuation_ids"]
    with pytest.raises(GenerateError, match="not an integer.*prompts are token ids because"):
        run([str(tmp_path / "imported.ckpt"), "--prompt", PROMPTS[0]], out=io.StringIO())


def test_codecs_tokenizer_and_ids_fallback():
    """A task with a tokenizer (``encode``; Capo's <|endoftext|> splits the text) and a task that cannot be rebuilt
    (ids, with the reason shown when a text prompt is given)."""
    from canonlm.generate import GenerateError, _tokenizer_codec, make_codec

    class Fake:
        name, eos_id = "capo", 9
        vocab = {"He": 3, " was": 4, " born": 5}

        def encode(self, text):
            return np.array([self.vocab[w] for w in text.replace(" ", "\0 ").split("\0") if w], dtype=np.int64)

        def decode(self, ids):
            inv = {v: k for k, v in self.vocab.items()}
            return "".join(inv.get(int(t), "<|endoftext|>") for t in ids)

    c = _tokenizer_codec(Fake(), 10)
    assert c.encode("He was<|endoftext|>He born").tolist() == [3, 4, 9, 3, 5]
    assert c.decode([3, 4, 9]) == "He was<|endoftext|>"
    with pytest.raises(GenerateError, match="not in the compact vocabulary"):
        c.encode("He ran")
    ids = make_codec({"name": "no_such_task"}, 7)
    assert ids.kind == "ids" and "could not be loaded" in ids.note
    assert ids.encode("1 2, 6").tolist() == [1, 2, 6] and ids.decode(np.array([4, 5])) == "4 5"
    with pytest.raises(GenerateError, match="not an integer"):
        ids.encode("1 x")


def test_module_cli_subprocess(runs):
    """``python -m canonlm.generate`` as a user runs it: lines on stdout, exit 0; a bad flag: one line, exit 2."""
    cmd = [
        sys.executable,
        "-m",
        "canonlm.generate",
        str(runs["gdn"]),
        "--prompt",
        PROMPTS[1],
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-k",
        "5",
        "--seed",
        "1",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(PROMPTS[1] + " -> ") and len(out[0].split(" -> ")[1].split()) >= 1
    p2 = subprocess.run(cmd[:-6] + ["--temperature", "-1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p2.returncode == 2 and p2.stderr.strip() == (
        "canonlm.generate: error: --temperature=-1.0 is not allowed; allowed: a number >= 0 (0 = greedy)"
    )
