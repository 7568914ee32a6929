"""lm-evaluation-harness on canonlm models: ``lm_eval`` with ``--model hf`` on an export (``pretrained=<dir>,
trust_remote_code=True``) and ``canonlm.eval.harness`` on the run itself, with local task YAMLs over a synthetic task
(Depo, GLA + Canon-AbCD, the task's word-level tokenizer) and a text sample (Llama + Canon, a prepared BPE).

Oracles: canonlm's own numbers -- the log-likelihood of each target summed from ``CanonLM``'s log-softmax in float64
(within 1e-4) and greedy continuations from ``canonlm.generate.generate_ids`` (equal, once lm-eval's end and
stop-sequence rules, re-derived in ``_lm_eval_text``, are applied to them) -- and the two lm-eval paths must agree with
each other response for response, at batch size 2 (two prompts of one length share a batch) and 1. The harness
decodes greedy requests on canonlm's decode cache (its speed path): the tests assert that every generation went that
way, and that sampling or logits processors go to transformers' ``generate``. The speed itself is measured against
``lm_eval`` by ``bench/harness_speed.py``.
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
        docs = [
            {"context": "<bos> p3.e1 e2 p4.e5 <query_1> p3.e1 <ans>", "target": " e2"},
            {"context": "<bos> p5.e6 e7 p8.e1 <query_1> p5.e6 <ans>", "target": " e7"},
            {"context": "<bos> p1.e2 e3 <query_1> p1.e2 <ans>", "target": " e3 e4"},
            {"context": "<bos> p2.e6", "target": " e1"},
        ]

        def encode(text):
            return [names.index(w) for w in text.replace(".", " ").split()]
    else:
        from test_export_ready import _prepared

        tk, _, data = _prepared(tmp_path)
        task = {"name": "text", "data_dir": str(data)}
        vocab = tk.get_vocab_size() + 4
        model_cfg = dict(arch="llama", n_heads=2, vocab_size=vocab, n_layers=2, d_model=64, max_seq_len=128)
        canon = {"set": "ABCD"}
        docs = [
            {"context": "the cat sat on", "target": " the mat"},
            {"context": "a dog sat on", "target": " the mat"},
            {"context": "a dog ate", "target": " the bone"},
            {"context": "the", "target": " cat"},
        ]

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


STOP_TOKENS = 8


def _stop_text(m, encode, tok, docs) -> str:
    """cl_stop's stop sequence: the text of a token the first document's greedy continuation emits after its first
    token (a word the tokenizer encodes), so that document stops mid-generation and the others at other steps."""
    greedy = generate_ids(m, [torch.tensor(encode(docs[0]["context"])).numpy()], STOP_TOKENS)[0].tolist()
    for t in greedy[1:]:
        text = tok.decode([t], skip_special_tokens=True).strip()
        if text:
            return text
    raise AssertionError(f"no stop text in {greedy}")


def _gen_task(d, f, name: str, kwargs: str) -> None:
    (d / f"{name}.yaml").write_text(
        TASK_YAML.format(
            name=name,
            docs=f,
            kind="generate_until",
            extra=f"generation_kwargs:\n{kwargs}metric_list:\n  - metric: exact_match\n",
        )
    )


def _tasks(tmp_path, docs, stop: str | None = None):
    """Task YAMLs over ``docs``: cl_ll, cl_gen, cl_sample, cl_penalty, and cl_stop (until ``stop``) when given."""
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "ll.yaml").write_text(
        TASK_YAML.format(name="cl_ll", docs=f, kind="loglikelihood", extra="metric_list:\n  - metric: acc\n")
    )
    _gen_task(d, f, "cl_gen", f"  until: []\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n")
    if stop is not None:
        _gen_task(d, f, "cl_stop", f'  until: ["{stop}"]\n  max_gen_toks: {STOP_TOKENS}\n  do_sample: false\n')
    _gen_task(d, f, "cl_sample", "  until: []\n  max_gen_toks: 2\n  do_sample: true\n  temperature: 1.0\n")
    _gen_task(d, f, "cl_penalty", "  until: []\n  max_gen_toks: 2\n  do_sample: false\n  repetition_penalty: 1.3\n")
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    stop = _stop_text(m, encode, tok, docs)
    tasks = _tasks(tmp_path, docs, stop)
    from lm_eval.tasks import TaskManager
    from transformers import GenerationConfig

    from canonlm.eval.harness import evaluate, harness_lm_class, harness_model, task_manager

    tm = TaskManager(include_path=str(tasks), include_defaults=False)  # local tasks: lm-eval's ~15k need no index
    model, htok = harness_model(run, "cpu")

    def on_export(names, batch_size):
        return _by_doc(
            lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={export},trust_remote_code=True,dtype=float32",
                tasks=names,
                task_manager=tm,
                batch_size=batch_size,
                log_samples=True,
                device="cpu",
            )
        )

    def on_run(names, batch_size):
        lm = harness_lm_class()(pretrained=model, tokenizer=htok, batch_size=batch_size, device="cpu")
        res = _by_doc(evaluate(run, names, include_path=str(tasks), log_samples=True, lm=lm))
        # every generation took the decode-cache path
        assert (lm.cached_rows, lm.hf_generate_calls) == (len(docs) * len(set(names) - {"cl_ll"}), 0)
        return res

    names = ["cl_ll", "cl_gen", "cl_stop"]
    # the two longest prompts have one length: lm-eval batches them together, and they share one decode cache
    assert (
        len(encode(docs[0]["context"]))
        == len(encode(docs[1]["context"]))
        > max(len(encode(d["context"])) for d in docs[2:])
    )
    a, b = on_export(names, 2), on_run(names, 2)
    assert a == b and len(a) == 3 * len(docs)  # response for response (log-likelihood bits included)
    # local tasks are looked up without lm-eval's own index
    assert set(task_manager(names, str(tasks)).all_tasks) == {"cl_ll", "cl_gen", "cl_stop", "cl_sample", "cl_penalty"}
    # one request per batch: each generation ends by its own rule, which _lm_eval_text re-derives
    a1, b1 = on_export(names[1:], 1), on_run(names[1:], 1)
    assert a1 == b1 and len(a1) == 2 * len(docs)
    eos = GenerationConfig.from_pretrained(export).eos_token_id
    eos = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    diffs = []
    for d in docs:
        c, y = encode(d["context"]), encode(d["context"] + d["target"])[len(encode(d["context"])) :]
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([c + y])).double(), -1)[0]
        ours = sum(lp[len(c) - 1 + i, t].item() for i, t in enumerate(y))
        ll, _ = a[("cl_ll", d["context"])]
        diffs.append(abs(ll - ours))
        assert abs(ll - ours) <= 1e-4, (kind, d, ll, ours)
        greedy = generate_ids(m, [torch.tensor(c).numpy()], STOP_TOKENS)[0].tolist()
        for task, want in (
            ("cl_gen", _lm_eval_text(greedy[:GEN_TOKENS], [], tok, eos)),
            ("cl_stop", _lm_eval_text(greedy, [stop], tok, eos)),
        ):
            assert a1[(task, d["context"])] == want, (kind, task, d, a1[(task, d["context"])], want, greedy)
    print(f"{kind}: max |log-likelihood - canonlm's| = {max(diffs):.1e} over {len(docs)} docs; generations equal; {a}")


def _lm_eval_text(greedy: list[int], until: list[str], tok, eos: set[int]) -> str:
    """What lm-eval returns for a greedy continuation ``greedy`` generated alone (batch size 1), re-derived from its
    rules (lm-eval 0.4: ``models/utils.py`` ``handle_stop_sequences`` / ``postprocess_generated_text``,
    ``models/utils_hf.py`` ``MultiTokenEOSCriteria``; transformers' ``EosTokenCriteria``): the stop sequences are
    ``until`` plus the tokenizer's EOS text; generation ends after a token of the model's ``generation_config``
    ``eos`` or once the text of its last len(encode(stop)) + 2 tokens (special tokens kept) holds a stop sequence;
    the new tokens are decoded without special tokens and cut before the first occurrence of each stop sequence."""
    stops = list(until)
    if tok.eos_token_id is not None and tok.decode([tok.eos_token_id]) not in stops:
        stops.append(tok.decode([tok.eos_token_id]))
    out: list[int] = []
    for t in greedy:
        out.append(t)
        if t in eos or any(s in tok.decode(out[-(len(tok.encode(s, add_special_tokens=False)) + 2) :]) for s in stops):
            break
    text = tok.decode(out, skip_special_tokens=True)
    for s in stops:
        text = text.split(s)[0] if s else text
    return text


def test_harness_leaves_sampling_and_logits_processors_to_transformers(tmp_path, monkeypatch):
    """Requests the decode-cache path does not reproduce (sampling; a repetition penalty; a model whose
    generation_config sets a logits processor) run through transformers' ``generate``, greedy ones through the decode
    cache (the counters of the harness's ``HFLM``: rows decoded on the cache, ``generate`` calls left to
    transformers)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _, run, _, docs, _ = _setup("depo", tmp_path)
    tasks = _tasks(tmp_path, docs)
    from canonlm.eval.harness import evaluate, harness_lm_class, harness_model

    model, tok = harness_model(run, "cpu")
    lm = harness_lm_class()(pretrained=model, tokenizer=tok, batch_size=8, device="cpu")
    evaluate(run, ["cl_sample", "cl_penalty"], include_path=str(tasks), lm=lm)
    assert (lm.cached_rows, lm.hf_generate_calls) == (0, 2)
    evaluate(run, ["cl_gen"], include_path=str(tasks), lm=lm)
    assert (lm.cached_rows, lm.hf_generate_calls) == (len(docs), 2)
    model.generation_config.no_repeat_ngram_size = 1
    evaluate(run, ["cl_gen"], include_path=str(tasks), lm=lm)
    assert (lm.cached_rows, lm.hf_generate_calls) == (len(docs), 3)


def test_harness_cli_refuses_bad_input(tmp_path, capsys):
    from canonlm.eval.harness import main

    assert main([str(tmp_path / "nope"), "--tasks", "x"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "o.json").write_text("{}")
    assert main([str(tmp_path), "--tasks", "x", "--out", str(tmp_path / "o.json")]) == 2
    assert "exists; nothing is overwritten" in capsys.readouterr().err
    for device, says in (
        ("gpu0", "--device='gpu0'; allowed: auto | cpu | cuda | cuda:N"),
        ("cuda:64", "--device='cuda:64': this machine has"),
    ):
        assert main([str(tmp_path), "--tasks", "x", "--device", device]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == ["o.json"]
