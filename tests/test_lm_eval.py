"""lm-evaluation-harness on canonlm models: ``lm_eval`` with ``--model hf`` on an export (``pretrained=<dir>,
trust_remote_code=True``) and ``canonlm.eval.harness`` on the run itself, with local task YAMLs over a synthetic task
(Depo, GLA + Canon-AbCD, the task's word-level tokenizer) and a text sample (Llama + Canon, a prepared BPE).

Oracles: canonlm's own numbers -- the log-likelihood of each target summed from ``CanonLM``'s log-softmax in float64
(within 1e-4) and greedy continuations from ``canonlm.generate.generate_ids`` (equal) -- and the two lm-eval paths
must agree with each other.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ARCH_PRESETS, compose, perturb_

from canonlm.arch.config import build_model_config
from canonlm.arch.model import CanonLM
from canonlm.generate import generate_ids
from canonlm.hf import checkpoint_dict, export_model

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra (pip install -e .[eval])")
pytestmark = pytest.mark.interop
GEN_TOKENS = 3

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
{extra}"""


def _setup(kind: str, tmp_path):
    """(model, run dir, export dir, docs, encode) for ``kind`` in {depo, text}."""
    if kind == "depo":
        task = OmegaConf.to_container(compose(["task=depo1_cpu"]).task, resolve=True)
        from canonlm.data.tasks import build_task

        names = build_task(task["name"], task).token_names()
        vocab = len(names)
        model_cfg = dict(ARCH_PRESETS["gla"], n_heads=2, vocab_size=vocab, n_layers=2, d_model=64, max_seq_len=128)
        canon = {"set": "AbCD"}
        docs = [{"context": "<bos> p3.e1 e2 p4.e5 <query_1> p3.e1 <ans>", "target": " e2"},
                {"context": "<bos> p1.e2 e3 <query_1> p1.e2 <ans>", "target": " e3 e4"},
                {"context": "<bos> p2.e6", "target": " e1"}]

        def encode(text):
            return [names.index(w) for w in text.replace(".", " ").split()]
    else:
        from test_export_ready import _prepared

        tk, _, data = _prepared(tmp_path)
        task = {"name": "text", "data_dir": str(data)}
        vocab = tk.get_vocab_size() + 4
        model_cfg = dict(arch="llama", n_heads=2, vocab_size=vocab, n_layers=2, d_model=64, max_seq_len=128)
        canon = {"set": "ABCD"}
        docs = [{"context": "the cat sat on", "target": " the mat"}, {"context": "a dog ate", "target": " the bone"},
                {"context": "the", "target": " cat"}]

        def encode(text):
            return tk.encode(text).ids
    cfg = build_model_config(model_cfg, canon, {"type": "rope"} if kind == "text" else {})
    torch.manual_seed(7)
    m = CanonLM(cfg).eval()
    perturb_(m)
    ck = checkpoint_dict(cfg, m.state_dict(), {})
    ck["canonlm"]["task"] = task
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save(ck, run / "checkpoints" / "last.ckpt")
    export_model(run, tmp_path / "export")
    return m, run, tmp_path / "export", docs, encode


def _tasks(tmp_path, docs):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "ll.yaml").write_text(TASK_YAML.format(name="cl_ll", docs=f, kind="loglikelihood",
                                                extra="metric_list:\n  - metric: acc\n"))
    (d / "gen.yaml").write_text(TASK_YAML.format(
        name="cl_gen", docs=f, kind="generate_until",
        extra=f"generation_kwargs:\n  until: []\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
              "metric_list:\n  - metric: exact_match\n"))
    return d


def _by_doc(res) -> dict:
    out = {}
    for task, samples in res["samples"].items():
        for s in samples:
            out[(task, s["doc"]["context"])] = s["filtered_resps"][0]
    return out


@pytest.mark.parametrize("kind", ["depo", "text"])
def test_lm_eval_on_export_and_on_run_match_canonlm(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    m, run, export, docs, encode = _setup(kind, tmp_path)
    tasks = _tasks(tmp_path, docs)
    from lm_eval.tasks import TaskManager

    from canonlm.eval.harness import evaluate

    via_export = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={export},trust_remote_code=True,dtype=float32", tasks=["cl_ll", "cl_gen"],
        task_manager=TaskManager(include_path=str(tasks)), batch_size=2, log_samples=True, device="cpu")
    via_run = evaluate(run, ["cl_ll", "cl_gen"], include_path=str(tasks), batch_size=2, log_samples=True)
    a, b = _by_doc(via_export), _by_doc(via_run)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    assert a.keys() == b.keys() and len(a) == 2 * len(docs)
    diffs = []
    for d in docs:
        c, y = encode(d["context"]), encode(d["context"] + d["target"])[len(encode(d["context"])):]
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([c + y])).double(), -1)[0]
        ours = sum(lp[len(c) - 1 + i, t].item() for i, t in enumerate(y))
        for res in (a, b):
            ll, _ = res[("cl_ll", d["context"])]
            diffs.append(abs(ll - ours))
            assert abs(ll - ours) <= 1e-4, (kind, d, ll, ours)
        greedy = generate_ids(m, [torch.tensor(c).numpy()], GEN_TOKENS)[0].tolist()
        if tok.eos_token_id in greedy:                       # generation stops at the end token
            greedy = greedy[:greedy.index(tok.eos_token_id)]
        want = tok.decode(greedy, skip_special_tokens=True)   # lm-eval decodes the new tokens the same way
        for res in (a, b):
            assert res[("cl_gen", d["context"])] == want, (kind, d, res[("cl_gen", d["context"])], want)
    print(f"{kind}: max |log-likelihood - canonlm's| = {max(diffs):.1e} over {len(docs)} docs x 2 paths; "
          f"generations equal; {a}")


def test_harness_cli_refuses_bad_input(tmp_path, capsys):
    from canonlm.eval.harness import main

    assert main([str(tmp_path / "nope"), "--tasks", "x"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "o.json").write_text("{}")
    assert main([str(tmp_path), "--tasks", "x", "--out", str(tmp_path / "o.json")]) == 2
    assert "exists; nothing is overwritten" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["o.json"]
