"""End to end on real text (issue 27, item 5): two real corpora that ship in installed packages
(``tests/fixtures/corpora/licenses``: Debian's common-licenses; ``readmes``: Python package READMEs; each folder's
SOURCE.md names the files) are prepared with ``python -m canonlm.data.prepare`` (2 workers, paragraphs, EOS), mixed
70/30 with ``task.sources``, trained with ``python train.py`` (Llama 2L64D + Canon-ABCD, CPU), killed with SIGKILL
after a checkpoint and resumed with ``ckpt_path=auto``, and evaluated with ``python -m canonlm.eval.harness`` on a
local lm-eval task built from held-out paragraphs. Every step runs as a user runs it: a subprocess of the command.

Oracles: the fixture files split into paragraphs by a naive scan (what prepare must have read); the tokenizer
(``tokenizers``) for token counts and for decoding the held-out split back to text; an uninterrupted run of the same
command (the resumed run must end with bit-identical weights, the same per-step losses and the same test loss);
canonlm's own ``CanonLM`` forward, in float64, on the trained checkpoint for lm-eval's perplexity and accuracy.
The commands, timings and losses are in docs/text_data.md ("End to end"); ``scripts/text_e2e.sh`` runs the same
commands with their timings.
"""

from __future__ import annotations

import json
import re
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.slow

CORPORA = ROOT / "tests" / "fixtures" / "corpora"
SOURCES = {"readmes": 0.7, "licenses": 0.3}  # source -> mixture weight
T, BATCH, STEPS, VAL_EVERY, CKPT_EVERY = 128, 8, 200, 50, 100
VOCAB = 1024
# one intra-op thread per process: CI runs two test workers on 2 cores (more threads only oversubscribe them)
ENV = {
    **os.environ,
    "WANDB_MODE": "disabled",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


def train_args(data: Path, logs: Path, run_name: str) -> list[str]:
    """train.py overrides of the end-to-end run (docs/text_data.md, "End to end")."""
    src = "{" + ", ".join(f"{n}: {{data_dir: {data / n}, weight: {w}}}" for n, w in SOURCES.items()) + "}"
    return [
        "task=text",
        "task.data_dir=null",
        f"task.sources={src}",
        f"task.context={T}",
        "arch=llama",
        "canon=ABCD",
        "model.size=2L64D",
        f"data.batch_size={BATCH}",
        "data.val_windows=32",
        "data.test_windows=32",
        f"trainer.max_steps={STEPS}",
        f"trainer.val_check_interval={VAL_EVERY}",
        "trainer.log_every_n_steps=10",
        f"callbacks.checkpoint.every_n_train_steps={CKPT_EVERY}",
        "callbacks.progress.force=lines",
        f"paths.log_dir={logs}",
        f"run_name={run_name}",
    ]


def paragraphs(folder: Path) -> list[str]:
    """The documents ``--text-unit paragraph`` must read, by a naive scan: maximal runs of lines that are not blank,
    joined by newlines, over the folder's files in sorted order."""
    docs = []
    for f in sorted(folder.iterdir()):
        run: list[str] = []
        for line in f.read_text(encoding="utf-8").splitlines() + [""]:
            if line.strip():
                run.append(line)
            elif run:
                docs.append("\n".join(run))
                run = []
    return docs


def train_tokenizer(files: list[Path], path: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE (``tokenizers``) with ``<pad>`` and ``</s>`` trained on ``files`` (decodes exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(f) for f in files],
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<pad>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(path))
    return path


def _py(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-5000:])
    return p


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Tokenizer, two prepared corpora, an uninterrupted run ``ref`` and a run ``kr`` killed (SIGKILL) 10 steps after
    its first step checkpoint, then resumed with ckpt_path=auto. Returns paths, the last step the killed run
    printed, its checkpoints and wall times."""
    root = tmp_path_factory.mktemp("e2e")
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    tok = train_tokenizer(
        [f for n in SOURCES for f in sorted((CORPORA / n / "text").iterdir())], root / "tokenizer.json"
    )
    secs["tokenizer"] = time.perf_counter() - t0
    data = root / "data"
    for name in SOURCES:
        t0 = time.perf_counter()
        _py(
            [
                "-m",
                "canonlm.data.prepare",
                "--input",
                str(CORPORA / name / "text"),
                "--tokenizer",
                str(tok),
                "--out",
                str(data / name),
                "--text-unit",
                "paragraph",
                "--append-eos",
                "--workers",
                "2",
                "--val-fraction",
                "0.1",
                "--test-fraction",
                "0.05",
            ],
            root,
        )
        secs[f"prepare {name}"] = time.perf_counter() - t0
    logs = root / "logs"
    train = [str(ROOT / "train.py")]
    # one after the other, one thread each (ENV): on 2 shared cores, two at once with torch's default 2 threads each
    # made this fixture take 445 s instead of 40 s
    t0 = time.perf_counter()
    ref = _py([*train, *train_args(data, logs, "ref")], root)
    secs["train (uninterrupted)"] = time.perf_counter() - t0
    killed_log = root / "kr.out"
    ckdir = logs / "train" / "runs" / "kr" / "checkpoints"
    t0 = time.perf_counter()
    with open(killed_log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *train, *train_args(data, logs, "kr")],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=root,
            env=ENV,
        )
        deadline = time.time() + 600
        # killed once a step checkpoint exists and the run has printed a later step, mid-way to the next checkpoint
        # (a kill in the instant between a checkpoint's save and Lightning's logging of that step's metrics loses
        # that one metrics row: the resumed attempt starts after it)
        while (
            proc.poll() is None
            and time.time() < deadline
            and not (list(ckdir.glob("step*.ckpt")) and f"[step {CKPT_EVERY + 10}/" in killed_log.read_text())
        ):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=60)
    secs["train until killed"] = time.perf_counter() - t0
    assert rc == -signal.SIGKILL, killed_log.read_text()[-3000:]  # killed, not finished
    saved = sorted(int(p.stem[4:]) for p in ckdir.glob("step*.ckpt"))
    assert saved and saved[-1] < STEPS
    text = killed_log.read_text()
    steps_before = [int(x.split("/")[0]) for x in text.split("[step ")[1:]]
    t0 = time.perf_counter()
    resumed = _py([*train, *train_args(data, logs, "kr"), "ckpt_path=auto"], root)
    secs["resume"] = time.perf_counter() - t0
    return dict(
        root=root,
        tok=tok,
        data=data,
        runs=logs / "train" / "runs",
        saved=saved,
        secs=secs,
        killed_at=max(steps_before, default=0),
        resumed_out=resumed.stdout + resumed.stderr,
        ref_out=ref.stdout + ref.stderr,
    )


def test_prepared_corpora_are_the_fixture_paragraphs(e2e):
    """Two workers read every paragraph of each fixture once: document and token counts equal the naive scan's
    (token ids from the tokenizer, plus one EOS each), and every held-out (test) document decodes to a fixture
    paragraph."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(e2e["tok"]))
    eos = tok.token_to_id("</s>")
    for name in SOURCES:
        docs = paragraphs(CORPORA / name / "text")
        meta = json.loads((e2e["data"] / name / "meta.json").read_text())
        assert meta["documents"] == len(docs) and meta["eos_id"] == eos and meta["append_eos"] is True
        assert meta["tokens"] == sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
        assert sum(s["documents"] for s in meta["splits"].values()) == len(docs)
        held = heldout(e2e["data"] / name, tok)
        assert len(held) == meta["splits"]["test"]["documents"] and set(held) <= set(docs)
        print(
            f"{name}: {len(docs)} paragraphs, {meta['tokens']} tokens; splits "
            + ", ".join(f"{s} {v['tokens']}" for s, v in meta["splits"].items())
        )


def heldout(data: Path, tok) -> list[str]:
    """The test split's documents as text: the shard's tokens cut at the index offsets (the documented layout:
    ``test_<k>.bin`` ids, ``test_<k>.idx.npy`` (document index, first offset)), EOS dropped, decoded."""
    meta = json.loads((data / "meta.json").read_text())
    out = []
    for sh in meta["splits"]["test"]["shards"]:
        ids = np.fromfile(data / sh["file"], dtype=meta["dtype"])
        starts = np.load(data / sh["index"])[:, 1].tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            assert ids[b - 1] == meta["eos_id"]
            out.append(tok.decode(ids[a : b - 1].tolist(), skip_special_tokens=False))
    return out


def _val(rows: list[dict], name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[f"val/{name}/loss"]) for r in rows if f"val/{name}/loss" in r]


def test_validation_loss_falls_for_each_source(e2e):
    from canonlm.train.metrics_file import read_metrics

    rows = read_metrics(e2e["runs"] / "ref" / "metrics.jsonl")
    res = json.loads((e2e["runs"] / "ref" / "results.json").read_text())
    assert res["steps"] == STEPS and res["tokens_seen"] == STEPS * BATCH * T
    for name, w in SOURCES.items():
        val = _val(rows, name)
        assert len(val) == STEPS // VAL_EVERY and all(math.isfinite(v) for _, v in val)
        assert val[-1][1] < val[0][1] - 0.5, (name, val)  # and by a clear margin (nats/token)
        assert res["sources"][name]["share"] == pytest.approx(w, abs=1e-3)
        print(
            f"val/{name}/loss "
            + " ".join(f"@{s + 1}:{v:.3f}" for s, v in val)
            + f"; test {res['test']['sources'][name]['loss']:.3f}"
        )
    # the closing summary prints each source's test loss (from results.json), and `metric` says what was measured
    for name in SOURCES:
        row = res["test"]["sources"][name]
        assert re.search(
            rf"^  {name} +{row['loss']:.4f} +{row['ppl']:.3f} +{row['tokens']:,}$", e2e["ref_out"], re.M
        ), e2e["ref_out"][-2000:]
    assert res["metric"].startswith("loss: mean cross-entropy in nats per token")  # not answer accuracy
    print("timings (s):", {k: round(v, 1) for k, v in e2e["secs"].items()})


def test_killed_run_resumes_exactly(e2e):
    """SIGKILL after the first step checkpoint, ckpt_path=auto: the resumed run ends with bit-identical weights and
    optimizer state, the same per-step train losses, per-source validation losses and test loss as the run that was
    never interrupted."""
    from canonlm.train.metrics_file import read_metrics

    runs = e2e["runs"]
    print(f"killed at step ~{e2e['killed_at']} (checkpoints {e2e['saved']})")
    line = [ln for ln in e2e["resumed_out"].splitlines() if "ckpt_path=auto: resuming from" in ln]
    assert line and line[0].endswith(f"(step {e2e['saved'][-1]})"), e2e["resumed_out"][-3000:]
    a, b = (json.loads((runs / n / "results.json").read_text()) for n in ("ref", "kr"))
    assert a["attempts"] == 1 and b["attempts"] == 2 and a["steps"] == b["steps"] == STEPS
    assert a["test"]["loss"] == b["test"]["loss"]
    assert a["test"]["sources"] == b["test"]["sources"] and a["sources"] == b["sources"]
    ca, cb = (torch.load(runs / n / "checkpoints" / "last.ckpt", weights_only=True) for n in ("ref", "kr"))
    assert ca["global_step"] == cb["global_step"] == STEPS
    assert ca["state_dict"].keys() == cb["state_dict"].keys()
    assert all(torch.equal(ca["state_dict"][k], cb["state_dict"][k]) for k in ca["state_dict"])
    oa, ob = ca["optimizer_states"][0]["state"], cb["optimizer_states"][0]["state"]
    assert oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
    ra, rb = read_metrics(runs / "ref" / "metrics.jsonl"), read_metrics(runs / "kr" / "metrics.jsonl")
    keys = lambda r: {k: v for k, v in r.items() if k.startswith(("train/", "val/", "test/"))}
    la, lb = ({r["step"]: keys(r) for r in rows if keys(r)} for rows in (ra, rb))
    assert la == lb and max(la) >= STEPS - 1


def _task_yaml(name: str, docs: Path) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\ntest_split: test\n"
        'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )


def eval_docs(paras: list[str], tok, limit: int = 16) -> list[dict[str, str]]:
    """Held-out paragraphs as LAMBADA-style last-word items: context = the paragraph up to its last space, target =
    the last space-separated word with its leading space; paragraphs of 16..T-8 tokens whose last word is a word
    (letters, optionally followed by punctuation) and whose context does not end in whitespace."""
    out = []
    for p in paras:
        ctx, _, last = p.rpartition(" ")
        if (
            16 <= len(tok.encode(p).ids) <= T - 8
            and ctx.strip()
            and ctx == ctx.rstrip()
            and last.rstrip(".,;:)").isalpha()
        ):
            out.append({"context": ctx, "target": " " + last})
        if len(out) == limit:
            break
    return out


def test_harness_on_heldout_paragraphs_matches_canonlm(e2e):
    """``python -m canonlm.eval.harness <run> --tasks e2e_readmes,e2e_licenses --include-path <dir>``: lm-eval's
    perplexity (exp of minus the mean log-likelihood of the last word) and accuracy (the last word is the greedy
    continuation) per source equal those recomputed from canonlm's ``CanonLM`` in float64 on the checkpoint's weights."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra (pip install -e .[eval])")
    from tokenizers import Tokenizer

    from canonlm.arch.model import CanonLM
    from canonlm.hf import read_canonlm

    root = e2e["root"]
    tok = Tokenizer.from_file(str(e2e["tok"]))
    tasks = root / "tasks"
    tasks.mkdir()
    docs = {}
    for name in SOURCES:
        docs[name] = eval_docs(heldout(e2e["data"] / name, tok), tok)
        assert len(docs[name]) >= 8, name
        f = root / f"heldout_{name}.jsonl"
        f.write_text("".join(json.dumps(d) + "\n" for d in docs[name]))
        (tasks / f"e2e_{name}.yaml").write_text(_task_yaml(f"e2e_{name}", f))
    run = e2e["runs"] / "kr"
    t0 = time.perf_counter()
    _py(
        [
            "-m",
            "canonlm.eval.harness",
            str(run),
            "--tasks",
            ",".join(f"e2e_{n}" for n in SOURCES),
            "--include-path",
            str(tasks),
            "--device",
            "cpu",
            "--out",
            str(root / "harness.json"),
        ],
        root,
    )
    secs = time.perf_counter() - t0
    res = json.loads((root / "harness.json").read_text())
    cfg, sd, _ = read_canonlm(run)
    model = CanonLM(cfg).eval()
    model.load_state_dict(sd)
    for name in SOURCES:
        lls, greedy = [], []
        for d in docs[name]:
            c = tok.encode(d["context"]).ids
            y = tok.encode(d["context"] + d["target"]).ids[len(c) :]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([c + y])).double(), -1)[0, len(c) - 1 : -1]
            lls.append(sum(lp[i, t].item() for i, t in enumerate(y)))
            greedy.append(float(lp.argmax(-1).tolist() == y))
        got = res[f"e2e_{name}"]
        ppl = math.exp(-sum(lls) / len(lls))
        assert math.isfinite(got["perplexity,none"])
        assert got["perplexity,none"] == pytest.approx(ppl, rel=1e-4), (name, got, ppl)
        assert got["acc,none"] == pytest.approx(sum(greedy) / len(greedy)), (name, got)
        print(
            f"harness e2e_{name}: {len(lls)} docs, perplexity {got['perplexity,none']:.6g} (canonlm {ppl:.6g}), "
            f"acc {got['acc,none']:.3f} (canonlm {sum(greedy) / len(greedy):.3f}); mean last-word log-likelihood "
            f"{sum(lls) / len(lls):.3f} nats"
        )
    print(f"harness: {secs:.1f} s")
