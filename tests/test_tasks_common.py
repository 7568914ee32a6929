"""Properties every task shares (paper §3, App. A; issue 3 items 5, 7): streams identical for any DataLoader
worker count, disjoint split namespaces, the batch contract, bad input rejected before training with the key named,
and a few real training steps of each task through `train.py`."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import ROOT, compose

PRESETS = ["depo1_cpu", "brevo1_cpu", "brevo2_cpu", "capo_cpu", "mano_cpu", "lano_cpu", "fullcopy_cpu"]


def _task(preset, **over):
    from canonlm.config.build import build_configs

    cfg = compose([f"task={preset}", *[f"task.{k}={v}" for k, v in over.items()]])
    task, _ = build_configs(cfg)
    return task, cfg


def _stream(task, split, workers, batch=2, steps=None, start=0):
    from canonlm.data.stream import SyntheticStream

    kw = dict(
        window=int(task.context),
        batch_size=batch,
        seed=int(task.seed),
        start_step=start,
        num_steps=steps,
        tail=getattr(task, "tail", "drop"),
    )
    ds = task.make_stream(split, **kw) if hasattr(task, "make_stream") else SyntheticStream(task, split, **kw)
    return DataLoader(ds, batch_size=None, num_workers=workers)


def _take(loader, n):
    return list(itertools.islice(iter(loader), n))


@pytest.mark.parametrize("preset", PRESETS)
def test_stream_contract_workers_and_splits(preset):
    task, _ = _task(preset)
    a = _take(_stream(task, "train", 0), 3)
    b = _take(_stream(task, "train", 2), 3)
    T = int(task.context)
    for x, y in zip(a, b):
        assert set(x) >= {"tokens", "loss_mask", "answer_id", "group"}
        assert x["tokens"].shape == (2, T) and x["tokens"].dtype == torch.int64
        assert x["loss_mask"].dtype == torch.bool and not x["loss_mask"][:, 0].any()
        assert int(x["tokens"].min()) >= 0 and int(x["tokens"].max()) < task.vocab_size
        for k in ("tokens", "loss_mask", "answer_id", "group"):
            assert torch.equal(x[k], y[k]), (preset, k)
    # resume: a stream started at step 2 yields the third batch of the original
    c = _take(_stream(task, "train", 0, start=2), 1)[0]
    assert torch.equal(c["tokens"], a[2]["tokens"])
    # split namespaces are disjoint: the first windows differ
    firsts = {s: _take(_stream(task, s, 0, steps=1), 1)[0]["tokens"] for s in ("train", "val", "test")}
    assert not torch.equal(firsts["train"], firsts["val"]) and not torch.equal(firsts["val"], firsts["test"])


BAD = [
    ("brevo1_cpu", ["task.N=2"], "task.N"),
    ("mano_cpu", ["task.L=0"], "task.L"),
    ("depo1_cpu", ["task.K=0"], "task.K"),
    ("brevo1_cpu", ["+task.bogus=1"], "task.bogus"),
    ("mano_cpu", ["task.context=8"], "task.context"),
    ("lano_cpu", ["task.context=4"], "task.context"),
]


@pytest.mark.parametrize("preset, over, key", BAD)
def test_bad_task_input_is_one_config_error(preset, over, key):
    from canonlm.errors import ConfigError
    from canonlm.config.build import build_configs

    with pytest.raises(ConfigError) as e:
        build_configs(compose([f"task={preset}", *over]))
    assert key in str(e.value)


def test_lano_bad_grammar_files(tmp_path):
    from canonlm.errors import ConfigError
    from canonlm.config.build import build_configs

    bad_json = tmp_path / "g.json"
    bad_json.write_text("{not json")
    wrong = tmp_path / "w.json"
    wrong.write_text(json.dumps({"depth": 2, "all": [[{"children": [[7]]}]]}))
    for path in (bad_json, wrong, tmp_path / "missing.json"):
        with pytest.raises(ConfigError) as e:
            build_configs(compose(["task=lano_cpu", f"task.grammar_file={path}"]))
        assert "task.grammar_file" in str(e.value)


def test_bad_input_through_train_py_writes_nothing(tmp_path):
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "task=mano_cpu", "task.L=0", f"paths.log_dir={tmp_path}/logs"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 2 and "task.L" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.ckpt"))


TRAIN = [
    "model.size=2L64D",
    "data.batch_size=4",
    "data.val_windows=4",
    "data.test_windows=4",
    "data.gen_eval.samples=4",
    "data.gen_eval.batch_size=4",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "callbacks=none",
]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_task_trains_through_train_py(preset, tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            f"task={preset}",
            *TRAIN,
            f"run_name={preset}",
            f"paths.log_dir={tmp_path}/logs",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**__import__("os").environ, "WANDB_MODE": "disabled"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "logs" / "train" / "runs" / preset / "results.json").read_text())
    assert res["steps"] == 4
    test = res["test"]
    assert test["loss"] == test["loss"] and test["loss"] > 0  # finite, not NaN
    task, _ = _task(preset)
    # the closing table says how to read it: the chance level (re-derived here), the scale of bits and KL, the
    # paper's numbers
    closing = p.stdout[p.stdout.rindex(f"{task.name}: ") :]
    want_chance = {
        "depo1": lambda: f"chance ~{100 / task.N:.1f} %",
        "brevo1": lambda: "chance ~0 % (a guessed list",
        "brevo2": lambda: "chance ~0 % (a guessed list",
        "mano": lambda: f"chance ~{100 / task.mod:.1f} %",
        "lano": lambda: "chance ~0 % (a guessed string",
        "fullcopy": lambda: "chance ~0 % (a guessed copy is right with probability 1/n!)",
    }
    want_chance = want_chance[task.name]() if task.name in want_chance else None
    assert want_chance is None or want_chance in closing.splitlines()[0], closing
    assert ("read against: paper Fig." in closing) or task.name == "capo"
    if preset.startswith("capo"):
        assert "Part 3.3 Def. 4.3" in closing and "scale: a model uniform over the vocabulary" in closing
    if preset.startswith("lano"):
        assert "kl = KL(p* || model) in nats per position" in closing and "kl_uniform" in closing
    if preset.startswith("brevo"):
        assert "set_correct = the fraction of answers that name the right set" in closing
    if getattr(task, "eval_mode", "teacher_forced") == "generate":
        gen = test["generate"]
        assert gen["samples"] == 4 == sum(row["samples"] for row in gen["by_group"].values())
        assert all(0 < int(g) < task.num_groups for g in gen["by_group"])
        correct = sum(row["acc"] * row["samples"] for row in gen["by_group"].values())
        assert gen["acc"] == pytest.approx(correct / 4)
        if preset.startswith("lano"):
            assert gen["kl"] == gen["kl"] and gen["kl"] >= 0  # measured (not NaN) on the first kl_samples prompts
        if preset.startswith("brevo"):
            assert 0.0 <= gen["set_correct"] <= 1.0 and gen["set_correct"] >= gen["acc"]
    else:
        assert test["overall"]["answers"] > 0
        assert test["overall"]["answers"] == sum(row["answers"] for row in test["by_group"].values())
    if preset.startswith("capo"):
        m = test["task_metrics"]
        assert res["model"]["tie_embeddings"]  # the task's model override reached the model (paper App. C)
        assert m["bits_per_param"] == pytest.approx(m["bits"] / m["params_counted"])
        assert m["bits_per_param"] < m["bits_per_param_max"]
        # every person of the population is scored exactly once at test (Part 3.3 Def. 4.3)
        assert test["by_group"]["1"]["answers"] == task.N
