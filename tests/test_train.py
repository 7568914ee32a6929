"""End-to-end training: a real `train.py` run in a subprocess, resume == continuous, overfit sanity, and the
distributed code paths (DDP and FSDP2 on 2 CPU processes over gloo)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose

TINY = [
    "task=depo1_cpu",
    "model.size=2L64D",
    "task.N=8",
    "task.K=4",
    "task.vocab_V=6",
    "task.context=128",
    "data.batch_size=8",
    "data.val_windows=16",
    "data.test_windows=32",
    "trainer.log_every_n_steps=5",
]


def _train(args: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"paths.log_dir={cwd}/logs"]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**__import__("os").environ, "WANDB_MODE": "disabled", **(env or {})},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _srun_on_path(tmp_path: Path) -> dict:
    """An environment whose PATH has an ``srun`` (outside any SLURM job), and proof that Lightning warns in it."""
    import os
    import warnings

    from lightning.fabric.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    old = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            SLURMEnvironment._validate_srun_used()
    finally:
        os.environ["PATH"] = old
    assert any("srun" in str(w.message) for w in caught)  # Lightning's hint, which train.py must not print
    return env


LIGHTNING_NOISE = ("The `srun` command is available", "exists and is not empty")


def test_train_py_end_to_end(tmp_path):
    env = _srun_on_path(tmp_path)
    p = _train(
        [
            *TINY,
            "run_name=e2e",
            "trainer.max_steps=30",
            "trainer.val_check_interval=15",
            "callbacks.checkpoint.every_n_train_steps=15",
        ],
        tmp_path,
        env=env,
    )
    assert not [n for n in LIGHTNING_NOISE if n in p.stdout + p.stderr], p.stderr[-3000:]
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
    perf = [r for r in rows if "perf/step_time_s" in r]
    assert perf and all(0.0 <= r["perf/data_wait_s"] <= r["perf/step_time_s"] for r in perf)
    assert all(r["perf/peak_mem_gb"] > 0.01 for r in perf)  # the process's peak RSS on the CPU
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "csv" / "version_0" / "metrics.csv").is_file()
    assert "accuracy by k" in p.stdout and "results:" in p.stdout
    # a second fresh run into the same dir is refused (nothing is overwritten) ...
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        "run_name=e2e",
        "trainer.max_steps=30",
        f"paths.log_dir={tmp_path}/logs",
    ]
    p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p2.returncode != 0 and "ckpt_path=auto" in p2.stderr
    # ... and ckpt_path=auto resumes it to a longer schedule
    p3 = _train(
        [
            *TINY,
            "run_name=e2e",
            "trainer.max_steps=40",
            "trainer.val_check_interval=20",
            "ckpt_path=auto",
            "test=false",
        ],
        tmp_path,
        env=env,
    )
    assert not [n for n in LIGHTNING_NOISE if n in p3.stdout + p3.stderr], p3.stderr[-3000:]  # canonlm resumes there
    steps = [r["step"] for r in _metrics(run) if "train/loss" in r]
    assert max(steps) >= 35
    # the resumed attempt logs to its own CSV file; the first attempt's is kept (Lightning's CSVLogger would delete it)
    first = (run / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert len(first) > 3 and (run / "csv" / "version_1" / "metrics.csv").is_file()


def _run_in_process(overrides, out):
    """``canonlm.train.run.run`` on the tiny config (no subprocess); returns its results dict."""
    from canonlm.train.run import run

    cfg = compose(
        [*TINY, *overrides, "logger=none", "callbacks=default", "callbacks.progress.force=lines"], output_dir=out
    )
    return run(cfg)


def test_resume_equals_continuous(tmp_path):
    """Train 16 steps straight vs 8 steps + resume from the step-8 checkpoint: same data, same final loss."""
    common = [
        "trainer.val_check_interval=8",
        "callbacks.checkpoint.every_n_train_steps=8",
        "test=false",
        "trainer.max_steps=16",
    ]
    a = _run_in_process(common, tmp_path / "a")
    _run_in_process([*common[:-1], "trainer.max_steps=8"], tmp_path / "b")
    ck = tmp_path / "b" / "checkpoints" / "last.ckpt"
    assert ck.exists()
    b2 = _run_in_process([*common, "ckpt_path=auto"], tmp_path / "b")
    assert b2["steps"] == a["steps"] == 16
    assert b2["val"]["loss"] == pytest.approx(a["val"]["loss"], rel=1e-5, abs=1e-6)
    assert b2["val"]["by_group"] == a["val"]["by_group"]


def test_overfit_one_batch(tmp_path):
    """debug=overfit repeats one batch: the training loss must collapse (a model/loss/optimizer sanity check)."""
    _train(
        [
            *TINY,
            "debug=overfit",
            "trainer.max_steps=120",
            "optim.lr=3e-3",
            "sched.warmup_steps=10",
            "run_name=of",
            "test=false",
            "trainer.val_check_interval=120",
        ],
        tmp_path,
    )
    rows = _metrics(tmp_path / "logs" / "debug" / "runs" / "of")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < 0.25 * losses[0], losses


def test_gradient_accumulation_matches_full_batch(tmp_path):
    """8 windows in one micro-batch vs 2 micro-batches of 4: the loss is normalised by the loss tokens of the whole
    optimizer step, so the trained models agree."""
    common = ["trainer.val_check_interval=4", "test=false", "trainer.max_steps=4"]
    a = _run_in_process(common, tmp_path / "a")
    b = _run_in_process([*common, "trainer.accumulate_grad_batches=2"], tmp_path / "b")
    assert b["steps"] == a["steps"] == 4
    assert b["val"]["loss"] == pytest.approx(a["val"]["loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_cpu_strategies_match_one_process(strategy, tmp_path):
    """The distributed path on 2 CPU processes (gloo) trains the same model as one process at the same global
    batch: each rank gets its own half of every step's windows (a mesh giving both ranks the same batch, as
    Lightning's "auto" mesh does, or a wrong cross-rank loss normalisation would change the result). FSDP2 runs
    with fp32 parameters and activation checkpointing here (inside each sharded block: recomputed in the backward
    after FSDP2 gathers the block's parameters; the same math, so the same result)."""
    args = [
        *TINY,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1",
        "data.val_windows=16",
        "data.test_windows=16",
    ]
    extra = ["strategy.param_dtype=fp32", "activation_checkpointing=true"] if strategy == "fsdp2" else ["seed=42"]
    _train(
        [
            *args,
            f"strategy={strategy}",
            *extra,
            "trainer=ddp_sim",
            "run_name=dist",
            "callbacks.checkpoint.every_n_train_steps=3",
        ],
        tmp_path,
        timeout=600,
    )
    _train([*args, "run_name=single"], tmp_path)
    runs = tmp_path / "logs" / "train" / "runs"
    dist, single = (json.loads((runs / n / "results.json").read_text()) for n in ("dist", "single"))
    assert dist["steps"] == single["steps"] == 6
    assert dist["test"]["loss"] == pytest.approx(single["test"]["loss"], rel=1e-4)
    assert {k: v["answers"] for k, v in dist["test"]["by_group"].items()} == {
        k: v["answers"] for k, v in single["test"]["by_group"].items()
    }
    ck = runs / "dist" / "checkpoints" / "last.ckpt"
    assert ck.exists()
    if strategy == "fsdp2":
        _fsdp2_checkpoint_folder_is_read_directly(ck, args, dist, tmp_path)


def _fsdp2_checkpoint_folder_is_read_directly(ck: Path, args: list[str], dist: dict, tmp_path: Path) -> None:
    """The FSDP2 run's last.ckpt is a torch.distributed.checkpoint folder. Read directly, with no consolidation step,
    by training's init_from on ONE process (testing it without training reproduces the 2-process run's test loss)
    and by the exporter (the exported tensors are the checkpoint's, gathered whole)."""
    from canonlm.config.rundir import is_distributed_checkpoint, read_distributed_checkpoint
    from canonlm.hf import export_model, hf_to_canonlm, read_canonlm

    assert ck.is_dir() and is_distributed_checkpoint(ck)
    _train([*args, "run_name=from_fsdp2", f"init_from={ck}", "train=false"], tmp_path)
    again = json.loads((tmp_path / "logs" / "train" / "runs" / "from_fsdp2" / "results.json").read_text())
    assert again["test"]["loss"] == pytest.approx(dist["test"]["loss"], rel=1e-5)
    cfg, sd, meta = read_canonlm(ck.parent.parent)
    assert meta["model"]["d_model"] == 64 and read_distributed_checkpoint(ck)["global_step"] == 6
    from canonlm.eval.load import load_model

    lm = load_model(ck.parent.parent, device="cpu")  # evaluation / generation's loader
    assert all(torch.equal(v.float(), sd[k]) for k, v in lm.model.state_dict().items())
    export_model(ck.parent.parent, tmp_path / "exported")
    _, back, _ = hf_to_canonlm(tmp_path / "exported")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, samples", [("ddp", 5), ("ddp", 1), ("fsdp2", 3)])
def test_generative_eval_on_two_processes(strategy, samples, tmp_path):
    """Brevo's generation-based evaluation on 2 CPU processes: DDP shards the prompts (uneven shards, and fewer
    prompts than ranks), FSDP2 runs every prompt on every rank in lockstep; neither hangs, and both report the
    same samples and groups as one process."""
    args = [
        "task=brevo1_cpu",
        "model.size=2L64D",
        "data.batch_size=4",
        "data.val_windows=4",
        "data.test_windows=4",
        f"data.gen_eval.samples={samples}",
        "data.gen_eval.batch_size=2",
        "data.gen_eval.on_val=false",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "callbacks=none",
    ]
    _train(
        [
            *args,
            f"strategy={strategy}",
            "trainer=ddp_sim",
            "run_name=dist",
            *(["strategy.param_dtype=fp32"] if strategy == "fsdp2" else []),
        ],
        tmp_path,
        timeout=600,
    )
    _train([*args, "run_name=single"], tmp_path)
    runs = tmp_path / "logs" / "train" / "runs"
    dist, single = (json.loads((runs / n / "results.json").read_text())["test"]["generate"] for n in ("dist", "single"))
    assert dist["samples"] == single["samples"] == samples
    assert {k: v["samples"] for k, v in dist["by_group"].items()} == {
        k: v["samples"] for k, v in single["by_group"].items()
    }
    assert dist["acc"] == pytest.approx(single["acc"]) and "set_correct" in dist


def test_init_from_loads_weights_only(tmp_path):
    """``init_from=<checkpoint>`` starts from those weights: testing the loaded model without training gives the
    source run's test loss exactly; a checkpoint of another model is refused before anything is written."""
    _train([*TINY, "run_name=src", "trainer.max_steps=10", "trainer.val_check_interval=10"], tmp_path)
    ck = tmp_path / "logs" / "train" / "runs" / "src" / "checkpoints" / "last.ckpt"
    _train([*TINY, "run_name=dst", f"init_from={ck}", "train=false"], tmp_path)
    runs = tmp_path / "logs" / "train" / "runs"
    src, dst = (json.loads((runs / n / "results.json").read_text()) for n in ("src", "dst"))
    assert dst["test"]["loss"] == src["test"]["loss"] and dst["steps"] == 0
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        "run_name=bad",
        f"init_from={ck}",
        "canon=AC",
        f"paths.log_dir={tmp_path}/logs",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "init_from=" in p.stderr and "canon.set" in p.stderr, p.stderr[-2000:]
    assert not (runs / "bad").exists()


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_at_other_world_sizes(tmp_path):
    """A run trained with strategy=fsdp2 on 2 ranks, checkpointed at step 4 (a torch.distributed.checkpoint folder),
    resumes on 1 rank and on 3 ranks: the model and AdamW state are resharded on load, the data stream is the same
    for any world size (each step's global batch of 6 windows is split 3/3, 6, or 2/2/2), and the losses of the last
    four steps (metrics.jsonl steps 4-7, counted from 0) continue those of the uninterrupted 2-rank run within float
    tolerance (only the reduction order of the cross-rank sums changes with the world size)."""
    from canonlm.train.metrics_file import read_metrics

    args = [
        *TINY,
        "data.batch_size=6",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=1",
        "data.val_windows=6",
        "data.test_windows=6",
        "strategy=fsdp2",
        "strategy.param_dtype=fp32",
        "trainer=ddp_sim",
        "callbacks.checkpoint.every_n_train_steps=4",
    ]
    runs = tmp_path / "logs" / "train" / "runs"
    _train([*args, "run_name=full"], tmp_path, timeout=600)
    ck = runs / "full" / "checkpoints" / "step0000004.ckpt"
    assert ck.is_dir() and (ck / ".metadata").is_file()
    full = {r["step"]: r for r in read_metrics(runs / "full" / "metrics.jsonl")}
    table = {}
    for devices in (1, 3):
        name = f"ws{devices}"
        _train([*args, f"run_name={name}", f"trainer.devices={devices}", f"ckpt_path={ck}"], tmp_path, timeout=600)
        rows = {r["step"]: r for r in read_metrics(runs / name / "metrics.jsonl")}
        res = json.loads((runs / name / "results.json").read_text())
        assert res["steps"] == 8 and min(s for s in rows if "train/loss" in rows[s]) == 4  # resumed at step 4
        got = [rows[s]["train/loss"] for s in range(4, 8)]
        want = [full[s]["train/loss"] for s in range(4, 8)]
        assert got == pytest.approx(want, rel=1e-6), (devices, got, want)
        table[devices] = (got, res["test"]["loss"])
    ref = json.loads((runs / "full" / "results.json").read_text())["test"]["loss"]
    print("world size 2 (uninterrupted):", [full[s]["train/loss"] for s in range(4, 8)], "test", ref)
    for devices, (got, test) in table.items():
        print(f"world size 2 -> {devices} at step 4:", got, "test", test)
        assert test == pytest.approx(ref, rel=1e-4)
