"""End-to-end training: a real `train.py` run in a subprocess, resume == continuous, overfit sanity, and the
distributed code paths (DDP and FSDP2 on 2 CPU processes over gloo)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compose

TINY = ["model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128", "data.batch_size=8",
        "data.val_windows=16", "data.test_windows=32", "trainer.log_every_n_steps=5"]


def _train(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"paths.log_dir={cwd}/logs"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                       env={**__import__("os").environ, "WANDB_MODE": "disabled"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_py_end_to_end(tmp_path):
    p = _train([*TINY, "run_name=e2e", "trainer.max_steps=30", "trainer.val_check_interval=15",
                "callbacks.checkpoint.every_n_train_steps=15"], tmp_path)
    run = tmp_path / "logs" / "train" / "runs" / "e2e"
    res = json.loads((run / "results.json").read_text())
    assert res["steps"] == 30 and res["tokens_seen"] == 30 * 8 * 128
    by_k = res["test"]["by_group"]
    assert set(by_k) == {"1", "2", "4"}  # eval k drawn from powers of two up to K=4
    assert all(row["answers"] > 0 and 0.0 <= row["acc"] <= 1.0 for row in by_k.values())
    rows = _metrics(run)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert any("val/acc_k1" in r for r in rows) and any("perf/tokens_per_s" in r for r in rows)
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "csv" / "metrics.csv").is_file()
    assert "accuracy by k" in p.stdout and "results:" in p.stdout
    # a second fresh run into the same dir is refused (nothing is overwritten) ...
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "run_name=e2e", "trainer.max_steps=30",
           f"paths.log_dir={tmp_path}/logs"]
    p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p2.returncode != 0 and "ckpt_path=auto" in p2.stderr
    # ... and ckpt_path=auto resumes it to a longer schedule
    _train([*TINY, "run_name=e2e", "trainer.max_steps=40", "trainer.val_check_interval=20", "ckpt_path=auto",
            "test=false"], tmp_path)
    steps = [r["step"] for r in _metrics(run) if "train/loss" in r]
    assert max(steps) >= 35


def _final_weights(overrides, out):
    import torch

    from canonlm.train.run import run

    cfg = compose([*TINY, *overrides, "logger=none", "callbacks=default", "callbacks.progress.force=lines"],
                  output_dir=out)
    res = run(cfg)
    return res


def test_resume_equals_continuous(tmp_path):
    """Train 16 steps straight vs 8 steps + resume from the step-8 checkpoint: same data, same final loss."""
    import torch

    common = ["trainer.val_check_interval=8", "callbacks.checkpoint.every_n_train_steps=8", "test=false",
              "trainer.max_steps=16"]
    a = _final_weights(common, tmp_path / "a")
    b1 = _final_weights([*common[:-1], "trainer.max_steps=8"], tmp_path / "b")
    ck = tmp_path / "b" / "checkpoints" / "last.ckpt"
    assert ck.exists()
    b2 = _final_weights([*common, "ckpt_path=auto"], tmp_path / "b")
    assert b2["steps"] == a["steps"] == 16
    assert b2["val"]["loss"] == pytest.approx(a["val"]["loss"], rel=1e-5, abs=1e-6)
    assert b2["val"]["by_group"] == a["val"]["by_group"]


def test_overfit_one_batch(tmp_path):
    """debug=overfit repeats one batch: the training loss must collapse (a model/loss/optimizer sanity check)."""
    _train([*TINY, "debug=overfit", "trainer.max_steps=120", "optim.lr=3e-3", "sched.warmup_steps=10",
            "run_name=of", "test=false", "trainer.val_check_interval=120"], tmp_path)
    rows = _metrics(tmp_path / "logs" / "debug" / "runs" / "of")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < 0.25 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_cpu_strategies(strategy, tmp_path):
    """The distributed path on 2 CPU processes (gloo): both ranks train and the loss is finite; FSDP2 with
    explicit data_parallel_size (P1)."""
    _train([*TINY, f"strategy={strategy}", "trainer=ddp_sim", "trainer.max_steps=6", "trainer.val_check_interval=3",
            "trainer.log_every_n_steps=1", "run_name=dist", "callbacks.checkpoint.every_n_train_steps=3",
            "data.val_windows=8", "data.test_windows=8"], tmp_path, timeout=600)
    run = tmp_path / "logs" / "train" / "runs" / "dist"
    res = json.loads((run / "results.json").read_text())
    assert res["steps"] == 6
    losses = [r["train/loss"] for r in _metrics(run) if "train/loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert (run / "checkpoints" / "last.ckpt").exists()
