"""Checkpoints and runs that survive faults: kills mid-save, damaged or foreign checkpoints, SIGTERM, non-finite
steps, refused configs that must leave nothing behind, unwritable or full run directories, long evaluations that
must show progress. Each test drives the real ``train.py`` / ``run`` and checks files, exit codes and messages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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
    "callbacks.progress.force=lines",
]
ENV = {**os.environ, "WANDB_MODE": "disabled"}


def _cmd(args: list[str], cwd: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *TINY, *args, f"paths.log_dir={cwd}/logs"]


def _train(args: list[str], cwd: Path, ok: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    p = subprocess.run(_cmd(args, cwd), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _run_dir(tmp: Path, name: str) -> Path:
    return tmp / "logs" / "train" / "runs" / name


# ------------------------------------------------------------------------------------------------ refused configs
@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=-1", "optim.lr=-1"),  # refused after the task and model were built
        ("canon.set=ABE", "canon.set='ABE'"),  # refused while building the model config
        ("max_nonfinite_steps=0", "max_nonfinite_steps=0"),
        ("callbacks.checkpoint.keep_last=0", None),  # refused by the checkpoint callback (after the checks)
    ],
)
def test_refused_config_writes_nothing_and_answers_in_seconds(override, needle, tmp_path):
    t0 = time.perf_counter()
    p = _train(["run_name=bad", override], tmp_path, ok=False, timeout=120)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("canonlm: error: invalid config:"), p.stderr[-3000:]
    if needle:
        assert needle in err[0]
        assert elapsed < 20, f"config error took {elapsed:.1f} s"  # measured ~2 s: Lightning is not imported yet
    assert _files(tmp_path) == [], _files(tmp_path)


def test_refused_config_leaves_an_existing_run_untouched(tmp_path):
    _train(["run_name=r", "trainer.max_steps=5", "test=false"], tmp_path)
    run = _run_dir(tmp_path, "r")
    before = {f: (run / f).read_bytes() for f in _files(run) if (run / f).is_file()}
    p = _train(["run_name=r", "trainer.max_steps=10", "ckpt_path=auto", "optim.lr=0"], tmp_path, ok=False)
    assert p.returncode == 2 and "optim.lr=0" in p.stderr
    after = {f: (run / f).read_bytes() for f in _files(run) if (run / f).is_file()}
    assert after == before


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 20-step run with checkpoints at steps 10 and 20 and last.ckpt (copied by each test that damages it)."""
    tmp = tmp_path_factory.mktemp("trained")
    _train(
        [
            "run_name=base",
            "trainer.max_steps=20",
            "callbacks.checkpoint.every_n_train_steps=10",
            "test=false",
            "trainer.val_check_interval=20",
        ],
        tmp,
    )
    return _run_dir(tmp, "base")


def _copy_run(trained: Path, tmp: Path, name: str = "base") -> Path:
    dst = _run_dir(tmp, name)
    shutil.copytree(trained, dst)
    return dst


def _prepare(tmp: Path, overrides: list[str], name: str = "base"):
    """``prepare_run`` (every check before Lightning) on the config train.py would compose for this run dir."""
    from canonlm.train.run import prepare_run

    cfg = compose([*TINY, *overrides, "logger=none"], output_dir=_run_dir(tmp, name))
    return prepare_run(cfg)


def test_auto_skips_an_empty_last_ckpt_and_says_which_it_resumes(trained, tmp_path, caplog):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    with caplog.at_level("INFO", logger="canonlm"):
        _, _, ck = _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30"])
    assert ck == str(run / "checkpoints" / "step0000020.ckpt")
    assert "last.ckpt: is empty" in caplog.text and "resuming from" in caplog.text and "(step 20)" in caplog.text


def test_auto_resumes_the_newest_step_when_last_is_missing(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "last.ckpt").unlink()
    _, _, ck = _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30"])
    assert ck.endswith("step0000020.ckpt")
    # ... and a fresh start beside them is refused (never a silent fresh run)
    from canonlm.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        _prepare(tmp_path, ["trainer.max_steps=30"])


def test_auto_with_only_unreadable_checkpoints_is_one_clear_error(trained, tmp_path):
    from canonlm.train.checkpoint import CheckpointError

    run = _copy_run(trained, tmp_path)
    for p in (run / "checkpoints").iterdir():
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 3])  # truncated mid-file
    with pytest.raises(CheckpointError, match="none can be read") as e:
        _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30"])
    assert "truncated or damaged" in str(e.value) and "step0000010.ckpt" in str(e.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("canon=none", "model.canon.set: checkpoint 'ABCD', config ''"),
        ("arch=gla", "model.arch: checkpoint 'llama', config 'gla'"),
        ("model.size=2L128D", "model.d_model: checkpoint 64, config 128"),
        ("task.N=9", "task.N: checkpoint 8, config 9"),
    ],
)
def test_foreign_checkpoint_is_refused_naming_file_and_mismatch(trained, tmp_path, override, needle):
    from canonlm.train.checkpoint import CheckpointError

    run = _copy_run(trained, tmp_path)
    extra = ["canon=AbCD"] if override == "arch=gla" else []
    with pytest.raises(CheckpointError) as e:
        _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30", override, *extra])
    assert str(run / "checkpoints" / "last.ckpt") in str(e.value) and needle in str(e.value)


def test_checkpoint_without_metadata_is_checked_by_weight_shapes(trained, tmp_path):
    """A checkpoint written before canonlm stored its configs: the weight names and shapes still catch a change."""
    from canonlm.train.checkpoint import CheckpointError

    run = _copy_run(trained, tmp_path)
    for p in (run / "checkpoints").iterdir():
        ck = torch.load(p, weights_only=True)
        del ck["canonlm"]
        torch.save(ck, p)
    _, _, ck = _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30"])  # same model: accepted
    assert ck.endswith("last.ckpt")
    with pytest.raises(CheckpointError, match=r"weight blocks\.0\.canon_a\.weight not in the model"):
        _prepare(tmp_path, ["ckpt_path=auto", "trainer.max_steps=30", "canon=BCD"])


def test_explicit_truncated_checkpoint_is_one_message_through_train_py(trained, tmp_path):
    bad = tmp_path / "bad.ckpt"
    data = (trained / "checkpoints" / "last.ckpt").read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    p = _train(["run_name=x", f"ckpt_path={bad}", "trainer.max_steps=30"], tmp_path, ok=False)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert err[0].startswith(f"canonlm: error: checkpoint {bad}: cannot be read") and "Traceback" not in p.stderr


def test_checkpoints_load_without_unpickling_code(trained):
    ck = torch.load(trained / "checkpoints" / "last.ckpt", weights_only=True)  # raises if any pickled object
    assert ck["global_step"] == 20 and ck["canonlm"]["model"]["canon"]["set"] == "ABCD"
    assert ck["canonlm"]["task"]["N"] == 8 and ck["canonlm"]["attempts"] == 1


def test_stale_temp_files_are_removed_at_start_and_interrupted_swap_restored(trained, tmp_path):
    from canonlm.train.checkpoint import remove_stale_temps

    run = _copy_run(trained, tmp_path)
    ck = run / "checkpoints"
    dead = 2**22 + 12345  # above the default pid_max: no such process
    (ck / f".last.ckpt.tmp-{dead}").write_bytes(b"x" * 1000)  # killed mid-save (file)
    (ck / f".step0000030.ckpt.tmp-{dead}").mkdir()  # killed mid-save (FSDP2 directory)
    (ck / f".step0000030.ckpt.tmp-{dead}" / "__0_0.distcp").write_bytes(b"y")
    live = ck / f".step0000040.ckpt.tmp-{os.getppid()}"  # a save in progress: kept
    live.write_bytes(b"z")
    os.replace(ck / "step0000010.ckpt", ck / f".step0000010.ckpt.old-{dead}")  # swap interrupted between renames
    done = remove_stale_temps(ck)
    assert sorted(p.name for p in ck.iterdir()) == sorted(
        ["last.ckpt", "step0000010.ckpt", "step0000020.ckpt", live.name]
    )
    assert len(done) == 3 and any("restored" in d for d in done)
    # and train.py does it by itself at start
    (ck / f".last.ckpt.tmp-{dead}").write_bytes(b"x")
    live.unlink()
    _train(
        [
            "run_name=base",
            "ckpt_path=auto",
            "trainer.max_steps=25",
            "test=false",
            "callbacks.checkpoint.every_n_train_steps=10",
        ],
        tmp_path,
    )
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]


def test_keep_last_keeps_the_newest_step_checkpoints(tmp_path):
    _train(
        [
            "run_name=k",
            "trainer.max_steps=20",
            "callbacks.checkpoint.every_n_train_steps=5",
            "callbacks.checkpoint.keep_last=2",
            "test=false",
            "trainer.val_check_interval=20",
        ],
        tmp_path,
    )
    assert sorted(p.name for p in (_run_dir(tmp_path, "k") / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step0000015.ckpt",
        "step0000020.ckpt",
    ]


# ------------------------------------------------------------------------------------------------ run directory
def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    run = _run_dir(tmp_path, "ro")
    run.mkdir(parents=True)
    (run / "checkpoints").write_text("a file where the checkpoint folder should be\n")
    p = _train(["run_name=ro", "trainer.max_steps=5"], tmp_path, ok=False)
    assert p.returncode == 2 and "paths.output_dir" in p.stderr and "a folder this user can write" in p.stderr
    assert "step" not in p.stdout


def test_run_dir_check_against_the_file_system(tmp_path):
    """``check_run_dir``'s free-space test against statvfs."""
    from canonlm.errors import ConfigError
    from canonlm.train.checkpoint import check_run_dir

    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    check_run_dir(tmp_path / "ok", need_bytes=1)
    with pytest.raises(ConfigError, match="room for one checkpoint"):
        check_run_dir(tmp_path / "ok", need_bytes=free + 2**30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run the check as another user)")
def test_run_dir_check_refuses_a_folder_the_user_cannot_write(tmp_path):
    """A non-root user cannot write a root-owned 0755 folder: the kernel's permission rules, not a mock."""
    import pwd

    from canonlm.errors import ConfigError
    from canonlm.train.checkpoint import check_run_dir

    nobody = pwd.getpwnam("nobody")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody and run the check against the real kernel's permission rules
        os.close(r)
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            check_run_dir(locked, 1)
            os.write(w, b"ok")
        except ConfigError as e:
            os.write(w, str(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    assert "a folder this user can write (PermissionError" in msg, msg


# ------------------------------------------------------------------------------------------------ SIGTERM, NaN
@pytest.mark.slow
def test_sigterm_saves_at_a_step_boundary_and_resume_equals_uninterrupted(tmp_path):
    from canonlm.train.metrics_file import read_metrics

    args = ["trainer.max_steps=60", "trainer.val_check_interval=30", "callbacks.checkpoint.every_n_train_steps=25"]
    log = tmp_path / "s.out"
    # the uninterrupted reference run "c" trains meanwhile, in its own process and run directory
    ref = subprocess.Popen(
        _cmd([*args, "run_name=c"], tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _cmd([*args, "run_name=s"], tmp_path), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=ENV
        )
        deadline = time.time() + 240
        while "[step 30/" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    saved = [ln for ln in text.splitlines() if ln.startswith("[preemption] saved")]
    assert saved and "stopping (SIGTERM)" in saved[0], text[-3000:]
    step = int(saved[0].split(" at step ")[1].split(";")[0])
    run = _run_dir(tmp_path, "s")
    assert 30 <= step < 60 and step % 25, step  # saved at the signal's step, not at a periodic checkpoint
    ck = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ck["global_step"] == step
    prior = ck["canonlm"]["train_time_s"]  # the first attempt's training time, saved with the signal's checkpoint
    assert prior > 0
    assert not (run / "results.json").exists() and "[test" not in text and f"[val @ step {step}]" not in text
    _train([*args, "run_name=s", "ckpt_path=auto"], tmp_path)
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-5000:]
    a, b = (json.loads((_run_dir(tmp_path, n) / "results.json").read_text()) for n in ("s", "c"))
    assert a["steps"] == b["steps"] == 60 and a["attempts"] == 2 and b["attempts"] == 1
    assert a["test"]["loss"] == b["test"]["loss"]  # bit-identical: same data, same state
    assert a["train_time_s"] > round(prior, 1)  # both attempts counted (the resumed one trained 60 - step steps)
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] >= 55


def test_nonfinite_steps_are_skipped_then_stop_the_run_with_a_checkpoint(tmp_path):
    """lr=1e25: the first update blows the weights up, every later loss is non-finite. Those steps must leave the
    parameters and AdamW's state untouched (its step counter counts real updates only), and the 4th in a row stops
    the run with exit code 3 and a finite last.ckpt."""
    p = _train(
        [
            "run_name=n",
            "optim.lr=1e25",
            "sched.warmup_steps=0",
            "trainer.max_steps=50",
            "max_nonfinite_steps=4",
            "trainer.log_every_n_steps=1",
        ],
        tmp_path,
        ok=False,
    )
    assert p.returncode == 3, p.stderr[-3000:]
    msg = [ln for ln in p.stderr.splitlines() if ln.startswith("canonlm:")]
    assert len(msg) == 1 and "4 optimizer steps in a row" in msg[0] and "max_nonfinite_steps=4" in msg[0]
    ck = torch.load(_run_dir(tmp_path, "n") / "checkpoints" / "last.ckpt", weights_only=True)
    assert ck["global_step"] == 5 and ck["canonlm"]["nonfinite_steps"] == 4
    assert {int(s["step"]) for s in ck["optimizer_states"][0]["state"].values()} == {1}
    assert all(torch.isfinite(v).all() for v in ck["state_dict"].values() if v.is_floating_point())
    rows = [json.loads(ln) for ln in (_run_dir(tmp_path, "n") / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("train/nonfinite_steps", 0) for r in rows) == 4
    assert not (_run_dir(tmp_path, "n") / "results.json").exists()


# ------------------------------------------------------------------------------------------------ progress
def test_long_evaluation_prints_progress_lines(tmp_path):
    p = _train(
        [
            "run_name=p",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "data.test_windows=64",
            "callbacks.progress.eval_every_s=0",
        ],
        tmp_path,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[test] batch")]
    assert lines and lines[-1].startswith("[test] batch 8/8 100%"), p.stdout[-2000:]  # 64 windows / batch 8
    assert any(ln.startswith("[val] batch 2/2") for ln in p.stdout.splitlines())
