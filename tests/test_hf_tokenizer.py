"""The tokenizer an export carries (:mod:`canonlm.hf.tokenizer`), loaded by plain ``AutoTokenizer.from_pretrained``
in transformers 5.x (the venv's) and 4.51.3 (side-installed in .cache/hf451, put first on PYTHONPATH), each in a
subprocess with stdin closed: no trust-remote-code question (a question would print its prompt and read EOF), no
warning, the class both versions know, ``model_max_length`` = the model's context, and pad / BOS / EOS ids.

Oracles, per task (every synthetic task, Capo's BPE and the ``text`` task's prepared tokenizer):

* the task's own printed text and ids: ``python -m canonlm.data.preview``'s :func:`~canonlm.data.preview.preview`
  (``task.decode`` of the instances the generator made, packed windows for ``text``) -- encoding the printed text
  gives the generator's ids back, and decoding gives the text back (Depo's ``p3.e8``, not ``p3 e8``);
* what ``python -m canonlm.generate`` prints for generated ids: its codec (:func:`canonlm.generate.make_codec`) on
  random id sequences over the task's vocabulary (unfinished names, specials and pad included); with
  ``skip_special_tokens=True`` (what lm-evaluation-harness decodes with), the codec on the ids without the special
  ones (a text run: its recorded tokenizer's own ``decode(..., skip_special_tokens=True)``);
* the task's attributes: pad = id 0, BOS / EOS = the task's ``bos_id`` / ``eos_id`` or none (a text run: the
  prepared data's EOS, and the EOS as pad since its tokenizer has no pad token) in the ids for config.json; the
  tokenizer of a task without EOS names its pad as ``eos_token`` (lm-evaluation-harness decodes it as a stop string
  in every ``generate_until``).

transformers 4.51.3 reads ``tokenizer_config.json``'s class and never ``config.json``; the 4.51.3 worker also loads
every tokenizer from a folder whose ``config.json`` needs remote code (``auto_map`` of an unknown ``model_type``, as
the ``canonlm`` export format writes), which must change nothing. transformers 5.x always reads ``config.json``
through ``AutoConfig`` first, so the tokenizer files are checked there on their own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from canonlm.data.preview import load_task_config, preview
from canonlm.data.tasks import build_task
from canonlm.generate import make_codec
from canonlm.hf.tokenizer import export_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1]
HF451 = ROOT / ".cache" / "hf451"
MAX_SEQ_LEN = 512  # the model's context handed to the export (every printed text below is shorter)
# (case, task config, overrides): every synthetic task (compact and official vocabularies, with and without EOS),
# Capo's BPE; the text task is added by the fixture (prepared data)
CASES = [
    ("depo1", "depo1_cpu", {}),
    ("depo1_eos", "depo1_cpu", {"eos": True}),
    ("depo1_official", "depo1_cpu", {"vocab": "official"}),
    ("depo2", "depo2", {}),
    ("brevo1", "brevo1_cpu", {}),
    ("brevo2", "brevo2_cpu", {}),
    ("brevo2_official", "brevo2_cpu", {"vocab": "official"}),
    ("mano", "mano_cpu", {}),
    ("lano", "lano_cpu", {}),
    ("fullcopy", "fullcopy_cpu", {}),
    ("capo", "capo_cpu", {}),
]
# a config.json as the `canonlm` export format writes it: remote code for a model type transformers does not know
REMOTE_CONFIG = {
    "model_type": "canonlm",
    "architectures": ["CanonLMForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_canonlm.CanonLMConfig",
        "AutoModelForCausalLM": "modeling_canonlm.CanonLMForCausalLM",
    },
}

WORKER = textwrap.dedent(r"""
    import json, logging, sys, warnings
    import transformers
    from transformers import AutoTokenizer

    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("transformers").addHandler(Keep(level=logging.WARNING))
    out = {"version": transformers.__version__, "cases": {}}
    for case in json.load(open(sys.argv[1])):
        records.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = AutoTokenizer.from_pretrained(case["dir"])
        r = {"class": type(tok).__name__, "warnings": records + [str(w.message) for w in caught],
             "model_max_length": tok.model_max_length, "len": len(tok),
             **{k: getattr(tok, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id")}}
        r["enc"] = [tok(t, add_special_tokens=False)["input_ids"] for t in case["texts"]]
        r["enc_default"] = [tok(t)["input_ids"] for t in case["texts"]]
        r["roundtrip"] = [tok.decode(tok(t, add_special_tokens=False)["input_ids"]) for t in case["texts"]]
        r["dec"] = [tok.decode(ids) for ids in case["ids"]]
        r["dec_skip"] = [tok.decode(ids, skip_special_tokens=True) for ids in case["ids"]]
        r["eot"] = tok.decode(tok.eos_token_id, skip_special_tokens=False)  # as lm-eval's generate_until does
        out["cases"][case["dir"]] = r
    json.dump(out, open(sys.argv[2], "w"))
""")


def _printed(task, name: str) -> tuple[list[str], list[list[int]]]:
    """The task's printed text and its ids: preview's instances (train and test), packed windows for ``text``."""
    if name == "text":
        items = preview(task, 3, "train", packed=True)
    else:
        items = preview(task, 3, "train") + preview(task, 2, "test")
    return [it["text"] for it in items], [it["record"]["tokens"] for it in items]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case's tokenizer written by :func:`export_tokenizer` + :func:`save_tokenizer` into ``tok/<case>`` (alone)
    and ``remote/<case>`` (beside a remote-code config.json), with its oracle: the task's printed texts and ids,
    random ids with canonlm.generate's printing of them, the expected special ids."""
    from test_text import prepare_fixture  # the text task's fixture corpus, prepared by canonlm.data.prepare

    root = tmp_path_factory.mktemp("hf_tok")
    cfgs = [
        (
            case,
            load_task_config(conf, dict(over, **({"cache_dir": str(root / "capo_cache")} if case == "capo" else {}))),
        )
        for case, conf, over in CASES
    ]
    data_dir = prepare_fixture(root / "text")
    cfgs.append(("text", {"name": "text", "data_dir": str(data_dir), "context": 32}))
    # the same BPE as a transformers tokenizer directory (saved by the venv's transformers: 5.x names its class
    # TokenizersBackend, which 4.x does not know), prepared from that directory
    hf_dir = root / "text_hf" / "tokenizer"
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(root / "text" / "tokenizer.json"), eos_token="</s>"
    ).save_pretrained(hf_dir)
    cfgs.append(
        ("text_hf", {"name": "text", "context": 32, "data_dir": str(prepare_fixture(root / "text_hf", hf_dir))})
    )
    rng = np.random.default_rng(0)
    out = {}
    for case, cfg in cfgs:
        task = build_task(cfg["name"], cfg)
        V = int(task.vocab_size)
        tok, ids, note = export_tokenizer(cfg, V, MAX_SEQ_LEN)
        assert tok is not None, (case, note)
        d = root / "tok" / case
        d.mkdir(parents=True)
        assert sorted(save_tokenizer(tok, d)) == sorted(p.name for p in d.iterdir())
        r = root / "remote" / case
        shutil.copytree(d, r)
        (r / "config.json").write_text(json.dumps(REMOTE_CONFIG))
        texts, text_ids = _printed(task, cfg["name"])
        if cfg["name"] == "text":
            text_ids = [task.tokenizer().encode(t) for t in texts]
        names = task.token_names()
        pool = np.array([i for i, n in enumerate(names) if not str(n).startswith("<unused")])
        rand = [rng.choice(pool, size=int(n)).tolist() for n in (1, 2, 5, 16, 16, 16, 40, 40)]
        codec = make_codec(cfg, V)  # what python -m canonlm.generate prints
        eos = getattr(task, "eos_id", None)
        # config.json / generation_config.json: the task's ids (no EOS where the task has none)
        want_ids = {
            "pad_token_id": eos if cfg["name"] == "text" else 0,
            "eos_token_id": eos,
            "bos_token_id": getattr(task, "bos_id", None),
            "unk_token_id": None,
        }
        # the tokenizer: the same, but a task without EOS names its pad as eos_token (lm-eval's stop string)
        want = dict(want_ids, eos_token_id=eos if eos is not None else want_ids["pad_token_id"])
        special = {v for v in want.values() if v is not None}
        out[case] = dict(
            dirs=(str(d), str(r)),
            texts=texts,
            text_ids=text_ids,
            ids=rand,
            want=want,
            V=V,
            codec=codec,
            want_ids=want_ids,
            eot=codec.decode([want["eos_token_id"]]),
            printed=[codec.decode(x) for x in rand],
            ids_returned=ids,
            name=cfg["name"],
            printed_skip=[
                task.tokenizer().decode(x, skip_special_tokens=True)
                if cfg["name"] == "text"
                else codec.decode([t for t in x if t not in special])
                for x in rand
            ],
        )
    return out


def _load_all(exported, tmp_path, hf451: bool) -> dict:
    """Run WORKER (one process, stdin closed) on every case folder: 4.51.3 on both trees, 5.x on ``tok/``."""
    jobs = [
        {"dir": c["dirs"][k], "texts": c["texts"], "ids": c["ids"]}
        for c in exported.values()
        for k in ((0, 1) if hf451 else (0,))
    ]
    tag = "hf451" if hf451 else "hf5"
    (tmp_path / f"{tag}.json").write_text(json.dumps(jobs))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    if hf451:
        env["PYTHONPATH"] = str(HF451)
    p = subprocess.run(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / f"{tag}.json"), str(tmp_path / f"{tag}_out.json")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # a trust-remote-code question prints its prompt to stdout; a warning (model type, class) goes to stderr
    assert p.stdout == "", p.stdout[-2000:]
    assert "remote code" not in p.stderr and "model of type" not in p.stderr, p.stderr[-2000:]
    return json.loads((tmp_path / f"{tag}_out.json").read_text())


def _check(exported, result: dict, version_prefix: str, trees: tuple[int, ...]) -> None:
    assert result["version"].startswith(version_prefix), result["version"]
    for case, c in exported.items():
        for k in trees:
            r = result["cases"][c["dirs"][k]]
            where = f"{case} ({'beside a remote-code config.json' if k else 'tokenizer files'}, {result['version']})"
            assert r["warnings"] == [], (where, r["warnings"])
            assert r["class"] in ("PreTrainedTokenizerFast", "TokenizersBackend"), (where, r["class"])
            assert r["model_max_length"] == MAX_SEQ_LEN, where
            assert {k2: r[k2] for k2 in c["want"]} == c["want"], (where, r)
            assert c["ids_returned"] == c["want_ids"], where
            assert r["eot"] == c["eot"], where  # lm-eval's stop string: decode(eos_token_id) works
            if c["name"] != "capo":  # (Capo's BPE keeps its never-used tokens, numbered past the embedding)
                assert r["len"] <= c["V"], where  # nothing past the model's embedding
            assert r["roundtrip"] == c["texts"], where  # decode(encode(printed)) == printed
            assert r["dec"] == c["printed"], where  # == what canonlm.generate prints
            assert r["dec_skip"] == c["printed_skip"], where  # lm-eval's decode: specials dropped
            # the generator's ids (a text window starts mid-word: the run's own encoder, TextTokenizer); nothing added
            assert r["enc"] == c["text_ids"] == r["enc_default"], where


def test_synthetic_tasks_capo_and_text_tokenizers_load_and_print_as_the_task_in_transformers_5(exported, tmp_path):
    _check(exported, _load_all(exported, tmp_path, hf451=False), "5.", (0,))


@pytest.mark.skipif(
    not (HF451 / "transformers" / "__init__.py").is_file(),
    reason="transformers 4.51.3 is not side-installed in .cache/hf451: run `bash scripts/setup.sh dev`",
)
def test_synthetic_tasks_capo_and_text_tokenizers_load_and_print_as_the_task_in_transformers_4_51(exported, tmp_path):
    _check(exported, _load_all(exported, tmp_path, hf451=True), "4.51.3", (0, 1))


def test_depo_names_print_joined_and_tasks_without_eos_have_none(exported):
    """The two failures of issue 26 spelled out: Depo's names decode as ``p3.e8`` (an lm-eval ``generate_until``
    answer compares this string), and a task without an EOS exports no EOS id for config.json (pad id 0 is not an
    end token) while its tokenizer's ``eos_token`` (lm-eval's stop string) is the pad."""
    tok = transformers.AutoTokenizer.from_pretrained(exported["depo1"]["dirs"][0])
    cfg = load_task_config("depo1_cpu")
    names = build_task(cfg["name"], cfg).token_names()
    ids = [names.index(w) for w in ("<bos>", "p3", "e8", "e2", "<query_1>", "p3", "e8", "<ans>", "p3")]
    assert tok.decode(ids) == "<bos> p3.e8 e2 <query_1> p3.e8 <ans> p3?"
    assert tok.decode(ids[1:3], skip_special_tokens=True) == "p3.e8"
    assert exported["depo1"]["ids_returned"]["eos_token_id"] is None and tok.pad_token_id == 0
    assert (tok.eos_token, tok.eos_token_id) == ("<pad>", 0)
    eos_task = build_task(cfg["name"], dict(cfg, eos=True))
    assert exported["depo1_eos"]["ids_returned"]["eos_token_id"] == eos_task.eos_id not in (None, 0)
