"""Hydra multirun through the real command line (``python train.py -m ...``, basic launcher): the default paths
resolve before any job exists, every job writes its own results, a re-run of a sweep in a fixed directory skips
finished jobs and resumes unfinished ones by itself, and the report reads the sweep."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT

TINY = [
    "task=depo1_cpu",
    "model.size=2L64D",
    "task.N=8",
    "task.K=4",
    "task.vocab_V=6",
    "task.context=128",
    "data.batch_size=8",
    "data.val_windows=16",
    "data.test_windows=16",
    "trainer.log_every_n_steps=5",
    "trainer.val_check_interval=5",
    "callbacks.checkpoint.every_n_train_steps=5",
    "callbacks.progress.force=lines",
]
ENV = {**os.environ, "WANDB_MODE": "disabled"}


def _multirun(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=ENV,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def _jobs(sweep: Path) -> dict[tuple[str, str], dict]:
    """{(canon.set, pos.type): results} of every job dir below ``sweep`` (from each job's own saved config)."""
    import yaml

    out = {}
    for res in sorted(sweep.rglob("results.json")):
        cfg = yaml.safe_load((res.parent / ".hydra" / "config.yaml").read_text())
        out[(cfg["canon"]["set"], cfg["pos"]["type"])] = json.loads(res.read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["repo_root", "elsewhere"])
def test_two_by_two_sweep_from_the_command_line(where, tmp_path):
    """The README's sweep shape (canon x pos) with the default paths: four jobs, four results, under
    ``<cwd>/logs/<task_name>/multiruns/<time>/<job>``; before the fix every multirun died resolving
    ``hydra.sweep.dir``."""
    task_name = f"pytest_multirun_{uuid.uuid4().hex[:8]}"
    cwd = ROOT if where == "repo_root" else tmp_path
    base = cwd / "logs" / task_name
    logs_existed = (cwd / "logs").exists()
    try:
        p = _multirun(["canon=none,ABCD", "pos=rope,nope", "trainer.max_steps=5", f"task_name={task_name}"], cwd)
        sweeps = list((base / "multiruns").iterdir())
        assert len(sweeps) == 1, sweeps
        jobs = _jobs(sweeps[0])
        assert set(jobs) == {("", "rope"), ("", "nope"), ("ABCD", "rope"), ("ABCD", "nope")}
        assert all(
            r["steps"] == 5 and r["model"]["canon"] == k[0] and r["model"]["pos"] == k[1] for k, r in jobs.items()
        )
        assert sorted(d.name for d in sweeps[0].iterdir() if d.is_dir()) == ["0", "1", "2", "3"]
        assert "Launching 4 jobs locally" in p.stdout + p.stderr
        # the sweep ends with its tables and the report command (canonlm.train.sweep_callbacks.ReportCommand)
        # one table that compares what was swept: Canon sets as rows, positions as columns (--rows/--cols auto)
        table = p.stdout.split("== report of", 1)[1]
        assert table.count("canon.set \\ pos.type |") == 1 and "canon.set=" not in table
        assert p.stdout.strip().splitlines()[-1] == (
            "report (tables, heat maps, learning curves): python -m canonlm.train.report "
            f"{sweeps[0]} --rows auto --cols auto --out {sweeps[0] / 'report'}"
        )
        r = subprocess.run(
            [sys.executable, "-m", "canonlm.train.report", str(sweeps[0])],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=ENV,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert "canon.set=none" in r.stdout and "canon.set=ABCD" in r.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)  # only what this test created
        if not logs_existed and (cwd / "logs").is_dir() and not any((cwd / "logs").iterdir()):
            (cwd / "logs").rmdir()


@pytest.mark.slow
def test_rerun_of_a_fixed_sweep_dir_resumes_unfinished_and_skips_finished_jobs(tmp_path):
    """A sweep job resumes by itself (no ``ckpt_path=auto`` or run name needed): this is what a submitit requeue
    or a re-run of the same sweep does. Finished jobs are not trained again."""
    sweep = tmp_path / "sweep"
    common = ["canon=none,ABCD", f"hydra.sweep.dir={sweep}"]
    _multirun([*common, "trainer.max_steps=5", "test=false"], tmp_path)
    first = _jobs(sweep)
    assert {k: r["steps"] for k, r in first.items()} == {("", "rope"): 5, ("ABCD", "rope"): 5}
    # longer schedule: each job continues from its own step-5 checkpoint in its own directory
    _multirun([*common, "trainer.max_steps=10"], tmp_path)
    second = _jobs(sweep)
    assert {k: (r["steps"], r["attempts"]) for k, r in second.items()} == {
        ("", "rope"): (10, 2),
        ("ABCD", "rope"): (10, 2),
    }
    stamps = {p: p.stat().st_mtime_ns for p in sweep.rglob("results.json")}
    # the same command again: both jobs are finished, nothing is trained or rewritten
    p = _multirun([*common, "trainer.max_steps=10"], tmp_path)
    assert "already finished" in p.stdout + p.stderr
    assert {p: p.stat().st_mtime_ns for p in sweep.rglob("results.json")} == stamps
