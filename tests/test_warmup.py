"""``python -m canonlm.warmup``: the run's config composed as train.py composes it, the run's own code for two steps
plus one validation and one test batch, everything compiled into the kernel cache, and a second process that finds
it there (inductor's FX graph cache and AOTAutograd cache hit counters of torch 2.13, and the cache's files: none new,
none rewritten). With ``compile=true`` on CPU, inductor's cache is exercised for real (C++ kernels built by the system
compiler); Triton kernels need a GPU (or the interpreter, which compiles nothing) and are not part of this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canonlm import warmup

ROOT = Path(__file__).resolve().parents[1]
VARS = ("CANONLM_KERNEL_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CANONLM_WARMUP_DIR")
TINY = ["model.size=1L32D", "canon=none", "compile=true", "data.batch_size=4"]


def _run(args: list[str], tmp: Path, module: str = "canonlm.warmup", timeout: int = 600):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(TMPDIR=str(tmp), WANDB_MODE="disabled")
    tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", module, *args] if module else [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))


@pytest.mark.parametrize("override", ["model.size=banana", "data.batch_size=0"])
def test_refused_value_same_error_as_train_py(tmp_path, override):
    """A value canonlm refuses: the same one line and exit code 2 as train.py, and no temporary directory left."""
    w = _run([override], tmp_path / "t")
    t = _run([override, f"paths.log_dir={tmp_path / 'logs'}"], tmp_path / "t2", module="")
    assert (w.returncode, t.returncode) == (2, 2), (w.stderr, t.stderr)
    line = [ln for ln in w.stderr.splitlines() if ln.startswith("canonlm: error:")]
    assert line == [ln for ln in t.stderr.splitlines() if ln.startswith("canonlm: error:")] and len(line) == 1
    assert override.split("=")[0] in line[0]
    assert list((tmp_path / "t").iterdir()) == []  # no temporary run directory left


def test_misspelt_key_is_one_line_and_exit_2(tmp_path):
    r = _run(["model.sizee=2L64D"], tmp_path / "t")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("canonlm: error:") and "model.sizee" in r.stderr
    r = _run(["--bogus"], tmp_path / "t")
    assert r.returncode == 2 and "--bogus" in r.stderr


def test_sigterm_removes_the_temporary_run_directory(tmp_path):
    """``timeout`` (SIGTERM) in the middle of a warmup: exit 143 and no temporary run directory left behind."""
    import signal
    import time

    tmp = tmp_path / "t"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(TMPDIR=str(tmp), WANDB_MODE="disabled")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "canonlm.warmup",
            "model.size=1L32D",
            "canon=none",
            f"paths.kernel_cache={tmp_path / 'kc'}",
        ],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not any(d.name.startswith("canonlm-warmup-") for d in tmp.iterdir()) and p.poll() is None:
            assert time.time() < deadline, "warmup made no temporary run directory"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 143
    finally:
        if p.poll() is None:
            p.kill()
    assert [d.name for d in tmp.iterdir() if d.name.startswith("canonlm-warmup-")] == []


def test_warmup_changes_only_the_run_control_keys(tmp_path, compose_cfg):
    """warmup_config: two steps, one validation and one test batch, one batch of generation prompts, no loggers or
    callbacks but its clock, no checkpoint / init weights, a temporary run directory; the rest of the composed config
    (model, task, data shapes, precision, strategy, compile, kernels) is untouched."""
    from omegaconf import OmegaConf

    over = ["task=brevo1", "model.size=2L64D", "compile=true", "+trainer.limit_test_batches=0"]
    base = OmegaConf.to_container(compose_cfg(over), resolve=False)
    cfg = warmup.compose(over)
    assert OmegaConf.to_container(cfg, resolve=False)["model"] == base["model"]
    warmup.warmup_config(cfg, tmp_path)
    got = OmegaConf.to_container(cfg, resolve=False)
    assert got["trainer"]["max_steps"] == 2 and got["trainer"]["val_check_interval"] == 2
    assert got["trainer"]["limit_val_batches"] == 1 and got["trainer"]["limit_test_batches"] == 0  # 0 stays 0
    assert got["data"]["gen_eval"]["samples"] == base["data"]["gen_eval"]["batch_size"]
    assert got["logger"] is None and list(got["callbacks"]) == ["warmup_clock"]
    assert got["ckpt_path"] is None and got["paths"]["output_dir"] == str(tmp_path / "run")
    changed = {"trainer", "data", "logger", "callbacks", "ckpt_path", "init_from", "run_name", "paths"}
    assert {k: v for k, v in got.items() if k not in changed} == {k: v for k, v in base.items() if k not in changed}
    for k in ("precision", "devices", "accelerator", "accumulate_grad_batches", "gradient_clip_val"):
        assert got["trainer"][k] == base["trainer"][k]
    assert {k: v for k, v in got["data"].items() if k != "gen_eval"} == {
        k: v for k, v in base["data"].items() if k != "gen_eval"
    }


def test_sweep_overrides_become_one_job_each(monkeypatch):
    seen = {}
    monkeypatch.setattr(warmup, "sweep", lambda jobs, json_path: seen.setdefault("jobs", jobs) and 0)
    assert warmup.main(["-m", "arch=llama,gla", "canon=AbCD", "model.size=2L64D,4L128D"]) == 0
    assert seen["jobs"] == [
        [f"arch={a}", "canon=AbCD", f"model.size={s}"] for a in ("llama", "gla") for s in ("2L64D", "4L128D")
    ]


def test_generation_task_decodes_one_batch_of_prompts(tmp_path):
    """Brevo (scored by generation): validation and test each decode one batch of prompts
    (``data.gen_eval.batch_size``), so decoding's kernels are compiled too; the summary says how many."""
    out = tmp_path / "s.json"
    r = _run(
        [
            "task=brevo1_cpu",
            "model.size=1L32D",
            "canon=none",
            "data.gen_eval.batch_size=8",
            f"paths.kernel_cache={tmp_path / 'kc'}",
            "--json",
            str(out),
        ],
        tmp_path / "t",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["generation_prompts"] == {"val": 8, "test": 8}
    assert s["first_step_s"] > 0 and s["validation_s"] is not None and "8 prompts decoded" in r.stdout


@pytest.mark.slow
def test_second_warmup_hits_the_kernel_cache(tmp_path):
    """Cold, then warm, each a fresh process, ``compile=true`` on CPU: the first fills inductor's caches in the kernel
    cache (``paths.kernel_cache``), the second loads every graph from there (hits, no misses, no file new or
    rewritten) and reaches its first optimizer step with much less compile work. Both remove their run directory."""
    kc = tmp_path / "kc"
    runs = []
    for i in range(2):
        out = tmp_path / f"summary{i}.json"
        r = _run([*TINY, f"paths.kernel_cache={kc}", "--json", str(out)], tmp_path / f"t{i}")
        assert r.returncode == 0, r.stderr[-4000:]
        assert "first optimizer step" in r.stdout and "results:" not in r.stdout
        # the temporary run directory is gone (on CPU, inductor keeps precompiled C++ headers in
        # $TMPDIR/torchinductor_<user>/precompiled_headers, a path torch fixes at import: not part of the kernel cache)
        assert [p.name for p in (tmp_path / f"t{i}").iterdir() if not p.name.startswith("torchinductor_")] == []
        runs.append(json.loads(out.read_text()))
    cold, warm = runs
    assert cold["kernel_cache"] == warm["kernel_cache"] == str(kc)
    assert cold["cache_dirs"]["inductor"] == str(kc / "inductor")
    assert cold["counters"]["fxgraph_cache_miss"] > 0 and cold["cache"]["inductor"]["new"] > 0
    assert warm["counters"]["fxgraph_cache_miss"] == 0 and warm["counters"]["fxgraph_cache_hit"] > 0
    assert warm["counters"]["autograd_cache_miss"] == 0 and warm["counters"]["autograd_cache_hit"] > 0
    assert warm["cache"]["inductor"]["new"] == 0 and warm["cache"]["inductor"]["rewritten"] == 0
    for s in runs:
        assert s["first_step_s"] > s["first_step_itself_s"] > 0 and s["validation_s"] is not None and s["test_s"]
    assert warm["first_step_itself_s"] < cold["first_step_itself_s"]
