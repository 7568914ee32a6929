"""Bad input never writes: every way ``train.py`` refuses a run answers with exit code 2 and one line
``canonlm: error: ...`` naming the key, before ``.hydra/``, ``checkpoints/`` or the run log exist.

One table over the refusals, on a tiny model. Each row is one run of the real ``train.py`` (its own argv, working
folder and run directory). The rows are independent, so they share one Python process that runs ``train.py`` as
``python train.py`` would (``runpy`` as ``__main__``, the exit code from its ``SystemExit``) and pays for the torch
and Lightning imports once; the rows refused before Lightning run first, and each asserts Lightning was still not
imported after it. The oracle for "nothing written" is the file system: every file and its bytes under a row's
folder are the same after the refusal as before it. Each row's run directory already exists and holds a file of
the user's (or the checkpoints its row needs), so nothing in it may be removed and any write shows. One row also
runs alone in a fresh interpreter into a run directory that does not exist yet: the one Hydra makes for the job is
removed again. The seconds each refusal took are printed (``pytest -rP``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose

TINY = ["model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128", "data.batch_size=8",
        "data.val_windows=16", "data.test_windows=32", "trainer.max_steps=20"]
ENV = {**os.environ, "WANDB_MODE": "disabled"}
RUN = Path("logs") / "train" / "runs" / "bad"  # the run directory of run_name=bad under the test's folder


def _damaged(tmp: Path, where: Path) -> None:
    """A checkpoint file that cannot be read (the first bytes of a zip archive, then garbage)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(b"PK\x03\x04" + b"\x00garbage" * 64)


def _other_model(tmp: Path) -> None:
    """``other.ckpt``: a readable canonlm checkpoint of the same size without Canon layers (``canon=none``)."""
    from canonlm.arch.model import CanonLM
    from canonlm.config.build import build_configs
    from canonlm.hf.io import checkpoint_dict

    _, mcfg = build_configs(compose([*TINY, "canon=none"], output_dir=tmp / "unused"))
    torch.save(checkpoint_dict(mcfg, CanonLM(mcfg).state_dict(), {}), tmp / "other.ckpt")


def _notes(tmp: Path) -> None:
    """The run directory exists and holds a file of the user's: a refusal must leave it exactly so (the directory
    is not one Hydra made empty for this job, so nothing may be removed from it, and every write shows)."""
    (tmp / RUN).mkdir(parents=True)
    (tmp / RUN / "notes.txt").write_text("mine\n")


SETUP = {
    "damaged_file": lambda tmp: (_notes(tmp), _damaged(tmp, tmp / "damaged.ckpt")),
    "run_with_checkpoint": lambda tmp: _damaged(tmp, tmp / RUN / "checkpoints" / "last.ckpt"),
    "checkpoints_is_a_file": lambda tmp: _damaged(tmp, tmp / RUN / "checkpoints"),
    "other_model": lambda tmp: (_notes(tmp), _other_model(tmp)),
}

# (case, overrides ({tmp} = the row's folder), text of the one error line (naming the key), setup, refused after
# Lightning is imported, needs a machine without a GPU)
CASES = [
    # ---- config keys: the declared rules (canonlm.config.rules), the task, the model, the schedule
    ("lr", ["optim.lr=-1"], "optim.lr=-1", None, False, False),
    ("betas", ["optim.betas=[0.9]"], "optim.betas=[0.9]", None, False, False),
    ("z_loss", ["loss.z_loss=square"], "loss.z_loss='square'", None, False, False),
    ("precision", ["trainer.precision=bf17"], "trainer.precision='bf17'", None, False, False),
    ("strategy_name", ["strategy.name=zero3"], "strategy.name='zero3'", None, False, False),
    ("max_steps", ["trainer.max_steps=0"], "trainer.max_steps=0", None, False, False),
    ("max_steps_auto", ["trainer.max_steps=auto"], "trainer.max_steps='auto'", None, False, False),
    ("num_workers", ["data.num_workers=-1"], "data.num_workers=-1", None, False, False),
    ("gen_eval_key", ["+data.gen_eval.beams=4"], "data.gen_eval.beams=4", None, False, False),
    ("keep_last", ["callbacks.checkpoint.keep_last=0"], "callbacks.checkpoint.keep_last=0", None, False, False),
    ("ckpt_every", ["callbacks.checkpoint.every_n_train_steps=null"],
     "callbacks.checkpoint.every_n_train_steps=None", None, False, False),
    ("signal", ["callbacks.preemption.signal_name=SIGTERM"], "callbacks.preemption.signal_name='SIGTERM'", None,
     False, False),
    ("nonfinite", ["max_nonfinite_steps=0"], "max_nonfinite_steps=0", None, False, False),
    ("sched", ["sched.name=step"], "sched.name='step'", None, False, False),
    ("sched_warmup", ["sched.warmup_steps=abc"], "sched.warmup_steps='abc'", None, False, False),
    ("sched_min_lr", ["sched.min_lr_ratio=abc"], "sched.min_lr_ratio='abc'", None, False, False),
    ("sched_min_lr_range", ["sched.min_lr_ratio=1.5"], "sched.min_lr_ratio=1.5", None, False, False),
    ("sched_decay", ["sched=wsd", "sched.decay_fraction=0"], "sched.decay_fraction=0", None, False, False),
    ("canon_set", ["canon.set=ABE"], "canon.set='ABE'", None, False, False),
    ("context", ["task.context=64"], "task.context=64", None, False, False),
    ("kernel", ["kernels.attention=flash"], "model.kernels.attention='flash'", None, False, True),
    # ---- batch / accumulation arithmetic (devices x num_nodes given as integers: before Lightning)
    ("batch_split", ["data.batch_size=10", "trainer.accumulate_grad_batches=4"], "data.batch_size=10", None, False,
     False),
    ("batch_split_ddp", ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=9"],
     "data.batch_size=9", None, False, False),
    ("accumulate", ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0", None, False, False),
    ("val_interval", ["trainer.val_check_interval=0"], "trainer.val_check_interval=0", None, False, False),
    # ---- checkpoint choices
    ("ckpt_missing", ["ckpt_path={tmp}/nowhere.ckpt"], "ckpt_path='{tmp}/nowhere.ckpt'", None, False, False),
    ("ckpt_damaged", ["ckpt_path={tmp}/damaged.ckpt"], "checkpoint {tmp}/damaged.ckpt: cannot be read",
     "damaged_file", False, False),
    ("fresh_beside_checkpoints", [], "run_name='bad'", "run_with_checkpoint", False, False),
    ("auto_all_damaged", ["ckpt_path=auto"], "checkpoints: holds checkpoints but none can be read",
     "run_with_checkpoint", False, False),
    ("init_missing", ["init_from={tmp}/nowhere"], "init_from='{tmp}/nowhere'", None, False, False),
    ("init_other_model", ["init_from={tmp}/other.ckpt"], "init_from='{tmp}/other.ckpt'", "other_model", False,
     False),
    # ---- the world size Lightning chooses (devices given as a string): checked once the Trainer exists
    ("batch_split_lightning", ["trainer.accelerator=cpu", "trainer.devices='2'", "data.batch_size=9"],
     "data.batch_size=9", None, True, False),
    # ---- Trainer arguments: names against Trainer.__init__, values by Lightning itself
    ("trainer_name", ["+trainer.max_stepz=5"], "trainer.max_stepz=5", None, True, False),
    ("trainer_own", ["+trainer.callbacks=null"], "trainer.callbacks=None", None, True, False),
    ("trainer_value", ["trainer.max_epochs=-2"], "trainer.max_epochs=-2", None, True, False),
    ("accelerator_name", ["trainer.accelerator=abacus"], "trainer.accelerator='abacus'", None, True, False),
    # ---- strategy and device combinations
    ("gpu", ["trainer.accelerator=gpu"], "trainer.accelerator='gpu'", None, True, True),
    ("ddp_gpu", ["strategy=ddp", "trainer.accelerator=gpu", "trainer.devices=2"], "trainer.accelerator='gpu'", None,
     True, True),
    ("cpu_devices", ["trainer.accelerator=cpu", "trainer.devices=0"], "trainer.devices=0", None, True, False),
    # ---- the run directory (the last check: it probes checkpoints/ with a file)
    ("run_dir_unwritable", [], "paths.output_dir=", "checkpoints_is_a_file", True, False),
]
ALONE = "batch_split_lightning"  # also run in a fresh interpreter, exactly as a user would

# Runs train.py once per row in this one process: argv[1] = a JSON list of {case, argv, cwd}, argv[2] = where to
# write {case: {code, stderr, seconds, lightning}}.
DRIVER = """
import contextlib, io, json, os, runpy, sys, time, traceback
rows, dest, results = json.load(open(sys.argv[1])), sys.argv[2], {}
for row in rows:
    os.chdir(row["cwd"])
    sys.argv = list(row["argv"])
    err, out = io.StringIO(), io.StringIO()
    t0, code = time.perf_counter(), None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            runpy.run_path(row["argv"][0], run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = "crashed"
    results[row["case"]] = dict(code=code, stderr=err.getvalue(), seconds=time.perf_counter() - t0,
                                lightning="lightning" in sys.modules)
json.dump(results, open(dest, "w"))
"""


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _argv(overrides: list[str], tmp: Path) -> list[str]:
    return [str(ROOT / "train.py"), *TINY, *[o.format(tmp=tmp) for o in overrides], "run_name=bad",
            f"paths.log_dir={tmp}/logs"]


def _runnable(case: tuple) -> bool:
    return not (case[5] and torch.cuda.is_available())


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """{case: (its folder, the files before, the driver's result)} for every row of CASES this machine runs."""
    rows, folders = [], {}
    for case, overrides, _, setup, _, _ in sorted(filter(_runnable, CASES), key=lambda c: c[4]):  # Lightning last
        tmp = tmp_path_factory.mktemp(case)
        if setup:
            SETUP[setup](tmp)
        else:
            _notes(tmp)
        folders[case] = (tmp, _snapshot(tmp))
        rows.append(dict(case=case, argv=_argv(overrides, tmp), cwd=str(tmp)))
    work = tmp_path_factory.mktemp("driver")
    (work / "rows.json").write_text(json.dumps(rows))
    p = subprocess.run([sys.executable, "-c", DRIVER, str(work / "rows.json"), str(work / "results.json")],
                       capture_output=True, text=True, timeout=1800, cwd=work, env=ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    return {case: (*folders[case], results[case]) for case in folders}


def _check(needle: str, tmp: Path, before: dict, code, stderr: str) -> None:
    errors = [ln for ln in stderr.splitlines() if ln.startswith("canonlm: error:")]
    assert code == 2, stderr[-3000:]
    assert len(errors) == 1 and needle.format(tmp=tmp) in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert _snapshot(tmp) == before  # no .hydra/, checkpoints/, train.log, csv/ ...; an existing run untouched


@pytest.mark.parametrize("case, overrides, needle, setup, lightning, no_gpu", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_is_written(refusals, case, overrides, needle, setup, lightning,
                                                         no_gpu):
    if case not in refusals:
        pytest.skip("refused only on a machine without a GPU")
    tmp, before, r = refusals[case]
    print(f"{case}: refused in {r['seconds']:.2f} s ({'after importing Lightning' if lightning else 'before Lightning'}"
          ", in the shared process)")
    _check(needle, tmp, before, r["code"], r["stderr"])
    if not lightning:
        assert not r["lightning"], "refused only after Lightning was imported"


def test_a_refusal_in_a_fresh_interpreter(tmp_path):
    """The row ``ALONE`` as a user runs it: ``python train.py ...`` in its own process (imports included), into a
    run directory that does not exist yet: the one Hydra makes for the job is removed again."""
    case, overrides, needle, setup, _, _ = next(c for c in CASES if c[0] == ALONE)
    before = _snapshot(tmp_path)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *_argv(overrides, tmp_path)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=ENV)
    print(f"{case}: refused in {time.perf_counter() - t0:.1f} s (a fresh interpreter, imports included)")
    _check(needle, tmp_path, before, p.returncode, p.stderr)
    assert not (tmp_path / RUN).exists() and not (tmp_path / "logs").exists()
