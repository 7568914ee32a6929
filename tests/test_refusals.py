"""Every refusal of ``train.py``, as a user meets it (issue 26): exit code 2, exactly one line on stderr, nothing
written, within 10 s; and what makes the refusals hold as the config grows.

**The table** (:data:`TABLE`) holds every refusal: each of the issue's items 1-7 (``origin`` ``26.<item>``), and the
refusals that already held (``bad_input``: the rows of the former tests/test_bad_input.py table, each with its run
directory prepared as there; ``configs``: those of tests/test_configs.py). "One line" means: stderr is exactly one
line, ``canonlm: error: ...`` holding the row's ``needle`` (for a config value ``invalid config: <key>=<value>;
allowed: ...``, naming the key; a damaged checkpoint names the file), and nothing else (no warning, no traceback,
no usage text; what Hydra logs to stdout is not looked at). "Nothing written": every file below the row's working folder
(bytes included) is the same after the refusal as before, and without a prepared run there is no ``logs/`` at all.

How the rows run, and why (a fresh interpreter costs about 1 s for a refusal made before torch loads, 3-5 s after
it, 7 s after Lightning: imports, measured on 2 shared cores):

* the commands the issue gives for each of its items 1-7 (``+data.batchsize=4``, ``+lr=0.1``, ``train=no test=no``,
  ``compile=maybe``, ``seed=abc``, ``+optim.weightdecay=0.5``, the three unwritable folders, the huge batch,
  ``task=depo9``, ``arch=transformerx``, ``model.size=[2L64D``, ``canon.set=AAB``), plus an override of a missing key
  without ``+``, a refused sweep job (``-m``) and a refusal made inside Hydra's job (a missing checkpoint: the
  directory Hydra made is removed again), run exactly as a user runs them (``alone``):
  ``python train.py <overrides>`` in its own process and temporary working folder with the default output paths;
  the processes run side by side in a thread pool (one per CPU), and each one's wall time is asserted below 10 s
  (:func:`test_refused_as_a_user_runs_it`);
* every other row (the same stages again with other keys and values) runs the same ``train.py`` as ``__main__`` in
  one shared interpreter (:func:`test_refused_in_the_shared_process`; ``runpy``, the exit code from its
  ``SystemExit``, stderr captured), which pays the imports once and also shows that a row refused before Lightning
  is imported stays so. Running these ~65 rows in fresh interpreters too would cost minutes of CPU for no other
  property: the code path is the same ``train.py``.

The seconds of every row are printed (``pytest -rP``). The other tests check the definitions the refusals rest on:
every key of every ``conf/`` file is read (:func:`test_every_conf_key_is_read`), every boolean key takes booleans
only, Lightning's arguments as read from its source equal its signature, the linear mixers' fields change nothing
in a Llama, a task accepts exactly its ``KEYS``, Canon sets are recorded as they train, a sweep is checked job by
job, and the memory arithmetic against a real AdamW, the tensors autograd really saves and (faked) CUDA devices.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import ARCH_PRESETS, CONF, ROOT, compose

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
    "trainer.max_steps=20",
]
ENV = {**os.environ, "WANDB_MODE": "disabled"}
RUN = Path("logs") / "train" / "runs" / "bad"  # the run directory of run_name=bad under a row's folder
LIMIT_S = 10.0
HAS_GPU = torch.cuda.is_available()


@dataclass(frozen=True)
class Row:
    """One refusal. args: overrides (``{tmp}`` = the row's folder); needle: text of the one line after
    ``canonlm: error: `` (for a config value: ``invalid config: <key>=<value>...``); origin: ``26.<item>`` (issue
    26's "What fails" item), ``bad_input`` or ``configs`` (refusals that already held); setup: a :data:`SETUP` key
    preparing the folder; alone: run in its own interpreter as a user would; lightning: refused only after Lightning
    is imported; no_gpu: refused only on a machine without a GPU; first: options before the overrides (``-m``);
    read_only: ``{ro}`` is a read-only bind mount (run inside ``unshare -rm``); run_name: add ``run_name=bad``."""

    case: str
    args: tuple[str, ...]
    needle: str
    origin: str
    setup: str | None = None
    alone: bool = False
    lightning: bool = False
    no_gpu: bool = False
    first: tuple[str, ...] = ()
    read_only: bool = False
    run_name: bool = True


def R(case, args, needle, origin, **kw) -> Row:
    return Row(case, tuple(args), needle, origin, **kw)


MEM = "allowed: a run that fits in memory: training needs at least"
KEYS = "allowed: a key canonlm reads"
TABLE: list[Row] = [
    # ---- issue 26, item 1: unknown keys, at any depth, with the key that was meant
    R(
        "plus_batchsize",
        ["+data.batchsize=4"],
        f"data.batchsize=4; {KEYS} (data.batchsize is not one; did you mean data.batch_size?)",
        "26.1",
        alone=True,
    ),
    R("plus_lr", ["+lr=0.1"], f"lr=0.1; {KEYS} (lr is not one; did you mean optim.lr?)", "26.1", alone=True),
    R(
        "override_missing_key",
        ["data.batchsize=4"],
        f"data.batchsize=4; {KEYS} (data.batchsize is not one; did you mean data.batch_size?)",
        "26.1",
        alone=True,
    ),
    R(
        "plus_model_key",
        ["+model.n_layerz=3"],
        f"model.n_layerz=3; {KEYS} (model.n_layerz is not one; did you mean model.n_layers?)",
        "26.1",
    ),
    R("plus_task_key", ["+task.NN=3"], f"task.NN=3; {KEYS} (task.NN is not one; did you mean task.N?)", "26.1"),
    R(
        "plus_trainer_key",
        ["+trainer.max_stepz=5"],
        f"trainer.max_stepz=5; {KEYS} (trainer.max_stepz is not one; did you mean trainer.max_steps?)",
        "26.1",
    ),
    R(
        "unread_for_this_option",
        ["+strategy.find_unused_parameters=true"],
        f"strategy.find_unused_parameters=True; {KEYS} (strategy.find_unused_parameters is read only when "
        "strategy.name is ddp | ddp_spawn; here auto)",
        "26.1",
    ),
    R(
        "linear_field_on_llama",
        ["+model.ssm_state=16"],
        f"model.ssm_state=16; {KEYS} (model.ssm_state is read only "
        "by the linear mixers, model.arch gla | gdn | mamba2; here llama)",
        "26.1",
    ),
    # ---- item 2: booleans take booleans only
    R("train_no", ["train=no", "test=no"], "train='no'; allowed: true or false", "26.2", alone=True),
    R("compile_maybe", ["compile=maybe"], "compile='maybe'; allowed: true or false", "26.2", alone=True),
    R(
        "checkpointing_int",
        ["activation_checkpointing=1"],
        "activation_checkpointing=1; allowed: true or false",
        "26.2",
    ),
    R("trainer_bool", ["trainer.benchmark=yes"], "trainer.benchmark='yes'; allowed: true or false", "26.2"),
    R("optim_bool", ["optim.fused=maybe"], "optim.fused='maybe'; allowed: true or false", "26.2"),
    # ---- item 3: values checked before the run directory exists
    R("seed_text", ["seed=abc"], "seed='abc'; allowed: an integer in [0, 4294967295]", "26.3", alone=True),
    R("seed_range", ["seed=-1"], "seed=-1; allowed: an integer in [0, 4294967295]", "26.3"),
    R(
        "plus_weightdecay",
        ["+optim.weightdecay=0.5"],
        f"optim.weightdecay=0.5; {KEYS} (optim.weightdecay is not one; did you mean optim.weight_decay?)",
        "26.3",
        alone=True,
    ),
    R(
        "adamw_itself",
        ["+optim.foreach=true"],
        "optim.fused=True; allowed: a value AdamW accepts (`fused` and `foreach` cannot be `True` together.)",
        "26.3",
    ),
    R(
        "sched_key_unread",
        ["+sched.decay_fraction=0.3"],
        f"sched.decay_fraction=0.3; {KEYS} (sched.decay_fraction is read only when sched.name is wsd; here cosine)",
        "26.3",
    ),
    # ---- item 4: output folders that cannot be created or written
    R(
        "log_dir_proc",
        ["paths.log_dir=/proc/x"],
        "paths.log_dir='/proc/x'; allowed: a folder this user can create and write",
        "26.4",
        alone=True,
    ),
    R(
        "log_dir_file_parent",
        ["paths.log_dir={tmp}/notes.txt/logs"],
        "paths.log_dir='{tmp}/notes.txt/logs'; "
        "allowed: a folder this user can create and write ({tmp}/notes.txt is a file",
        "26.4",
        setup="file",
        alone=True,
    ),
    R(
        "log_dir_read_only",
        ["paths.log_dir={ro}/logs"],
        "paths.log_dir='{ro}/logs'; allowed: a folder this user can create and write",
        "26.4",
        alone=True,
        read_only=True,
    ),
    R(
        "run_dir_key",
        ["hydra.run.dir=/proc/y"],
        "hydra.run.dir='/proc/y'; allowed: a folder this user can create and write",
        "26.4",
    ),
    # ---- item 5: a batch that cannot fit in memory
    R("batch_memory", ["data.batch_size=100000000"], f"data.batch_size=100000000; {MEM}", "26.5", alone=True),
    # ---- item 6: Hydra's own errors (group options, grammar, sweeps), single runs and multiruns
    R("task_option", ["task=depo9"], "task='depo9'; allowed: brevo1 | brevo1_cpu", "26.6", alone=True, run_name=False),
    R(
        "arch_option",
        ["arch=transformerx"],
        "arch='transformerx'; allowed: gdn | gdn2 | gla | gla5 | llama",
        "26.6",
        alone=True,
    ),
    R(
        "grammar",
        ["model.size=[2L64D"],
        "model.size='[2L64D'; allowed: an override in Hydra's grammar",
        "26.6",
        alone=True,
    ),
    R(
        "sweep_without_m",
        ["canon=none,ABCD"],
        "canon='none,ABCD'; allowed: one value; to sweep over several, add --multirun",
        "26.6",
    ),
    R("multirun_job", ["canon=none,AAB"], "canon='AAB'; allowed: A | AB", "26.6", alone=True, first=("-m",)),
    R("multirun_job_value", ["train=true,no"], "train='no'; allowed: true or false", "26.6", first=("-m",)),
    R(
        "multirun_submitit",
        ["hydra/launcher=slurm_cpu", "+data.batchsize=4,8"],
        f"data.batchsize=4; {KEYS}",
        "26.6",
        first=("-m",),
    ),
    R(
        "multirun_in_job",
        ["trainer.max_epochs=-2", "canon=none,ABCD"],
        "trainer.max_epochs=-2; allowed: a value Lightning accepts",
        "26.6",
        first=("-m",),
        lightning=True,
    ),
    R(
        "interpolation",
        ["trainer.max_steps=${{oops}}"],
        "trainer.max_steps='${{oops}}'; allowed: a value whose "
        "interpolations resolve (Interpolation key 'oops' not found)",
        "26.6",
    ),
    R("option_after_overrides", ["canon=none", "--multirun"], "command line=", "26.6"),
    R("primary_config", [], "--config-name='nope'; allowed: a primary config", "26.6", first=("--config-name", "nope")),
    R(
        "callback_argument",
        ["+callbacks.checkpoint.every_n_train_stepz=5"],
        f"callbacks.checkpoint.every_n_train_stepz=5; {KEYS} (callbacks.checkpoint.every_n_train_stepz is not one; "
        "did you mean callbacks.checkpoint.every_n_train_steps?)",
        "26.1",
        lightning=True,
    ),
    # ---- item 7: repeated Canon letters
    R("canon_repeat", ["canon.set=AAB"], "canon.set='AAB'; allowed: each letter at most once", "26.7", alone=True),
    # ---- issue 33, item 4: a run directory outside paths.log_dir; pos keys the chosen type does not read
    R(
        "run_name_escape",
        ["run_name=../../../escape"],
        "run_name='../../../escape'; allowed: one folder name, no path separator and not . or ..",
        "33.4",
        alone=True,
        run_name=False,
    ),
    R("run_name_nested", ["run_name=a/b"], "run_name='a/b'; allowed: one folder name", "33.4", run_name=False),
    R(
        "pos_fraction_unread",
        ["pos.fraction=2"],
        f"pos.fraction=2; {KEYS} (pos.fraction is read only when pos.type is partial_rope; here rope)",
        "33.4",
        alone=True,
    ),
    R(
        "pos_theta_nope",
        ["pos=nope", "pos.theta=500000"],
        f"pos.theta=500000; {KEYS} (pos.theta is read only when pos.type is rope | partial_rope; here nope)",
        "33.4",
    ),
    R(
        "pos_fraction_linear",
        ["arch=gla", "pos=partial_rope", "pos.fraction=1.5"],
        "pos.fraction=1.5; allowed: a number in (0, 1]",
        "33.4",
    ),
    # ---- refusals that already held: tests/test_configs.py
    R("canon_option", ["canon=ABE"], "canon='ABE'; allowed: A | AB | ABC", "configs"),
    R("pos_option", ["pos=sinusoidal"], "pos='sinusoidal'; allowed: nope | partial_rope | rope", "configs"),
    R("model_heads", ["model.size=4L130D", "model.n_heads=4"], "model.n_heads=4", "configs"),
    R("pos_fraction_big", ["pos=partial_rope", "pos.fraction=1.5"], "pos.fraction=1.5", "configs"),
    R("pos_fraction_zero", ["pos=partial_rope", "pos.fraction=0"], "pos.fraction=0", "configs"),
    R("kernel_dao", ["kernels.canon=dao"], "model.kernels.canon='dao'", "configs", no_gpu=True),
    R("canon_residual", ["canon.residual=maybe"], "canon.residual='maybe'", "configs"),
    R("rope_odd_head", ["model.size=4L100D", "model.n_heads=4"], "model.n_heads=4", "configs"),
    R("z_coef", ["loss.z_coef=abc"], "loss.z_coef='abc'", "configs"),
    # ---- refusals that already held: the former tests/test_bad_input.py (config keys, task, model, schedule)
    R("lr", ["optim.lr=-1"], "optim.lr=-1", "bad_input"),
    R("betas", ["optim.betas=[0.9]"], "optim.betas=[0.9]", "bad_input"),
    R("z_loss", ["loss.z_loss=square"], "loss.z_loss='square'", "bad_input"),
    R("precision", ["trainer.precision=bf17"], "trainer.precision='bf17'", "bad_input"),
    R("strategy_name", ["strategy.name=zero3"], "strategy.name='zero3'", "bad_input"),
    R("max_steps", ["trainer.max_steps=0"], "trainer.max_steps=0", "bad_input"),
    R("max_steps_auto", ["trainer.max_steps=auto"], "trainer.max_steps='auto'", "bad_input"),
    R("num_workers", ["data.num_workers=-1"], "data.num_workers=-1", "bad_input"),
    R("gen_eval_key", ["+data.gen_eval.beams=4"], "data.gen_eval.beams=4", "bad_input"),
    R("keep_last", ["callbacks.checkpoint.keep_last=0"], "callbacks.checkpoint.keep_last=0", "bad_input"),
    R(
        "ckpt_every",
        ["callbacks.checkpoint.every_n_train_steps=null"],
        "callbacks.checkpoint.every_n_train_steps=None",
        "bad_input",
    ),
    R(
        "signal",
        ["callbacks.preemption.signal_name=SIGTERM"],
        "callbacks.preemption.signal_name='SIGTERM'",
        "bad_input",
    ),
    R("nonfinite", ["max_nonfinite_steps=0"], "max_nonfinite_steps=0", "bad_input"),
    R("sched", ["sched.name=step"], "sched.name='step'", "bad_input"),
    R("sched_warmup", ["sched.warmup_steps=abc"], "sched.warmup_steps='abc'", "bad_input"),
    R("sched_min_lr", ["sched.min_lr_ratio=abc"], "sched.min_lr_ratio='abc'", "bad_input"),
    R("sched_min_lr_range", ["sched.min_lr_ratio=1.5"], "sched.min_lr_ratio=1.5", "bad_input"),
    R("sched_decay", ["sched=wsd", "sched.decay_fraction=0"], "sched.decay_fraction=0", "bad_input"),
    R("canon_set", ["canon.set=ABE"], "canon.set='ABE'", "bad_input"),
    R("context", ["task.context=64"], "task.context=64", "bad_input"),
    R("kernel", ["kernels.attention=flash"], "model.kernels.attention='flash'", "bad_input", no_gpu=True),
    # ---- batch / accumulation arithmetic (devices x num_nodes given as integers: before Lightning)
    R("batch_split", ["data.batch_size=10", "trainer.accumulate_grad_batches=4"], "data.batch_size=10", "bad_input"),
    R(
        "batch_split_ddp",
        ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=9"],
        "data.batch_size=9",
        "bad_input",
    ),
    R("accumulate", ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0", "bad_input"),
    R("val_interval", ["trainer.val_check_interval=0"], "trainer.val_check_interval=0", "bad_input"),
    # ---- checkpoint choices (in the job, against its run directory)
    R("ckpt_missing", ["ckpt_path={tmp}/nowhere.ckpt"], "ckpt_path='{tmp}/nowhere.ckpt'", "bad_input", alone=True),
    R(
        "ckpt_damaged",
        ["ckpt_path={tmp}/damaged.ckpt"],
        "checkpoint {tmp}/damaged.ckpt: cannot be read",
        "bad_input",
        setup="damaged_file",
    ),
    R("fresh_beside_checkpoints", [], "run_name='bad'", "bad_input", setup="run_with_checkpoint"),
    R(
        "auto_all_damaged",
        ["ckpt_path=auto"],
        "checkpoints: holds checkpoints but none can be read",
        "bad_input",
        setup="run_with_checkpoint",
    ),
    R("init_missing", ["init_from={tmp}/nowhere"], "init_from='{tmp}/nowhere'", "bad_input"),
    R(
        "init_other_model",
        ["init_from={tmp}/other.ckpt"],
        "init_from='{tmp}/other.ckpt'",
        "bad_input",
        setup="other_model",
    ),
    # ---- the world size Lightning chooses (devices given as a string): checked once the Trainer exists
    R(
        "batch_split_lightning",
        ["trainer.accelerator=cpu", "trainer.devices='2'", "data.batch_size=9"],
        "data.batch_size=9",
        "bad_input",
        lightning=True,
    ),
    # ---- Trainer arguments: values by Lightning itself; names set by other groups
    R("trainer_own", ["+trainer.callbacks=null"], "trainer.callbacks=None", "bad_input"),
    R("trainer_value", ["trainer.max_epochs=-2"], "trainer.max_epochs=-2", "bad_input", lightning=True),
    R("accelerator_name", ["trainer.accelerator=abacus"], "trainer.accelerator='abacus'", "bad_input", lightning=True),
    # ---- strategy and device combinations
    R("gpu", ["trainer.accelerator=gpu"], "trainer.accelerator='gpu'", "bad_input", lightning=True, no_gpu=True),
    R(
        "ddp_gpu",
        ["strategy=ddp", "trainer.accelerator=gpu", "trainer.devices=2"],
        "trainer.accelerator='gpu'",
        "bad_input",
        lightning=True,
        no_gpu=True,
    ),
    R(
        "cpu_devices",
        ["trainer.accelerator=cpu", "trainer.devices=0"],
        "trainer.devices=0",
        "bad_input",
        lightning=True,
    ),
    # ---- the run directory (the last check: it probes checkpoints/ with a file)
    R("run_dir_unwritable", [], "paths.output_dir=", "bad_input", setup="checkpoints_is_a_file", lightning=True),
]


# ------------------------------------------------------------------------------------------------- row folders
def _damaged(where: Path) -> None:
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
    """The run directory exists and holds a file of the user's: a refusal leaves it exactly so."""
    (tmp / RUN).mkdir(parents=True)
    (tmp / RUN / "notes.txt").write_text("mine\n")


SETUP = {
    "notes": _notes,
    "file": lambda tmp: (tmp / "notes.txt").write_text("a file, not a folder\n"),
    "damaged_file": lambda tmp: (_notes(tmp), _damaged(tmp / "damaged.ckpt")),
    "run_with_checkpoint": lambda tmp: _damaged(tmp / RUN / "checkpoints" / "last.ckpt"),
    "checkpoints_is_a_file": lambda tmp: _damaged(tmp / RUN / "checkpoints"),
    "other_model": lambda tmp: (_notes(tmp), _other_model(tmp)),
}


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _overrides(row: Row, tmp: Path, ro: Path | None = None) -> list[str]:
    fill = {"tmp": tmp, "ro": ro}
    args = [a.format(**fill) for a in row.args]
    return [*row.first, *TINY, *args, *(["run_name=bad"] if row.run_name else [])]


def _runnable(row: Row) -> bool:
    return not (row.no_gpu and HAS_GPU)


@functools.lru_cache(maxsize=None)
def _read_only_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def _setup(row: Row) -> str | None:
    """The row's preparation: its own, else (an older row run in the shared process) a run directory holding a file
    of the user's, which a refusal must leave exactly so (nothing removed, nothing written)."""
    return row.setup or ("notes" if row.origin == "bad_input" and not row.alone else None)


def _prepare(row: Row, tmp: Path) -> dict[str, bytes | None]:
    if _setup(row):
        SETUP[_setup(row)](tmp)
    return _snapshot(tmp)


def _one(row: Row, tmp: Path) -> dict:
    """Run ``python train.py <overrides>`` for ``row`` in ``tmp`` (its own process), timed."""
    before = _prepare(row, tmp)
    cmd = [sys.executable, str(ROOT / "train.py")]
    if row.read_only:
        ro = tmp / "ro"
        ro.mkdir()
        before = _snapshot(tmp)
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
        cmd = ["unshare", "-rm", "sh", "-c", script, "sh", str(ro), *cmd, *_overrides(row, tmp, ro)]
    else:
        cmd = [*cmd, *_overrides(row, tmp)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp, env=ENV)
    return dict(
        code=p.returncode, stderr=p.stderr, stdout=p.stdout, seconds=time.perf_counter() - t0, before=before, tmp=tmp
    )


ALONE = [r for r in TABLE if r.alone]
SHARED = [r for r in TABLE if not r.alone]


@pytest.fixture(scope="module")
def alone_results(tmp_path_factory):
    """{case: result} of every ``alone`` row, each ``python train.py ...`` in its own process and folder, run side
    by side (one thread per CPU); the whole table's wall time is printed."""
    rows = [r for r in ALONE if _runnable(r) and (not r.read_only or _read_only_works())]
    folders = {r.case: tmp_path_factory.mktemp(r.case) for r in rows}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {r.case: pool.submit(_one, r, folders[r.case]) for r in rows}
        out = {case: f.result() for case, f in futures.items()}
    print(
        f"\n{len(rows)} refusals in their own processes: {time.perf_counter() - t0:.1f} s wall, "
        f"{sum(o['seconds'] for o in out.values()):.1f} s summed"
    )
    return out


def _check_line(row: Row, tmp: Path, stderr: str, code, before: dict, ro: Path | None = None) -> str:
    """rc 2, stderr exactly one ``canonlm: error: ...`` line holding the needle, nothing written."""
    lines = stderr.splitlines()
    assert code == 2, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    needle = row.needle.format(tmp=tmp, ro=ro)
    assert lines[0].startswith("canonlm: error: ") and needle in lines[0], (needle, lines[0])
    assert _snapshot(tmp) == before  # no .hydra/, checkpoints/, run log, csv/; a prepared run untouched
    if _setup(row) is None:
        assert not (tmp / "logs").exists()
    return lines[0]


@pytest.mark.parametrize("row", ALONE, ids=[r.case for r in ALONE])
def test_refused_as_a_user_runs_it(alone_results, row):
    if not _runnable(row):
        pytest.skip("refused only on a machine without a GPU")
    if row.read_only and not _read_only_works():
        pytest.skip("no private mount namespace here (unshare -rm) for a read-only bind mount")
    r = alone_results[row.case]
    ro = r["tmp"] / "ro" if row.read_only else None
    line = _check_line(row, r["tmp"], r["stderr"], r["code"], r["before"], ro)
    print(f"{row.case} [{row.origin}] rc={r['code']} {r['seconds']:.2f} s: {line}")
    assert r["seconds"] < LIMIT_S, f"{row.case}: {r['seconds']:.1f} s"


# One interpreter for the SHARED rows: argv[1] = a JSON list of {case, argv, cwd}, argv[2] = where to write
# {case: {code, stderr, seconds, lightning}}.
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


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory):
    """{case: (folder, files before, result)} of the SHARED rows, run in one interpreter (rows refused before
    Lightning first)."""
    rows, folders = [], {}
    for row in sorted(filter(_runnable, SHARED), key=lambda r: r.lightning):
        tmp = tmp_path_factory.mktemp(row.case)
        folders[row.case] = (tmp, _prepare(row, tmp))
        rows.append(dict(case=row.case, argv=[str(ROOT / "train.py"), *_overrides(row, tmp)], cwd=str(tmp)))
    work = tmp_path_factory.mktemp("driver")
    (work / "rows.json").write_text(json.dumps(rows))
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, str(work / "rows.json"), str(work / "results.json")],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=work,
        env=ENV,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    return {case: (*folders[case], results[case]) for case in folders}


@pytest.mark.parametrize("row", SHARED, ids=[r.case for r in SHARED])
def test_refused_in_the_shared_process(shared_results, row):
    if not _runnable(row):
        pytest.skip("refused only on a machine without a GPU")
    tmp, before, r = shared_results[row.case]
    line = _check_line(row, tmp, r["stderr"], r["code"], before)
    print(f"{row.case} [{row.origin}] rc={r['code']} {r['seconds']:.2f} s in the shared process: {line}")
    if not row.lightning:
        assert not r["lightning"], "refused only after Lightning was imported"


def test_the_table_holds_every_item_of_the_issue():
    """Items 1-7 of issue 26's "What fails" each have rows run as a user runs them, and every older refusal kept its
    row: the 15 of tests/test_configs.py's former list less its 6 duplicates (``configs``), and the 40 of the former
    tests/test_bad_input.py (``bad_input``; its ``+trainer.max_stepz=5`` is now the item-1 row ``plus_trainer_key``)."""
    items = {r.origin for r in TABLE if r.alone and r.origin.startswith("26.")}
    assert items == {f"26.{i}" for i in range(1, 8)}
    assert len({r.case for r in TABLE}) == len(TABLE)
    assert (
        len([r for r in TABLE if r.origin == "bad_input"]) == 39
        and len([r for r in TABLE if r.origin == "configs"]) == 9
    )


# ------------------------------------------------------------------------------------- what the refusals rest on
GROUPS = [
    "arch",
    "canon",
    "pos",
    "task",
    "optim",
    "sched",
    "trainer",
    "strategy",
    "logger",
    "callbacks",
    "debug",
    "paths",
]


def _shape(path: Path) -> tuple:
    """What a conf file declares, values aside: its defaults list, header and every (key, value type) it holds.
    Two files of one group with the same shape compose to the same keys of the same types."""
    import yaml

    text = path.read_text()
    raw = yaml.safe_load(text) or {}

    def flat(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from flat(v, f"{prefix}{k}.")
            elif k != "defaults" or prefix:
                yield f"{prefix}{k}", type(v).__name__

    header = [ln for ln in text.splitlines() if ln.startswith("# @package")]
    return str(raw.get("defaults")), tuple(header), tuple(sorted(flat(raw)))


def _options() -> list[list[str]]:
    """One override list per option of every config group and every experiment (the mini presets included), one per
    shape (:func:`_shape`: ``depo1_N225`` and ``depo1_N300`` differ in values only), and the combinations that
    bring keys of their own."""
    out, seen = [], set()
    files = [(g, p, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml")) if not p.stem.startswith("_")]
    files += [
        ("experiment", p, str(p.relative_to(CONF / "experiment").with_suffix("")))
        for p in sorted((CONF / "experiment").rglob("*.yaml"))
    ]
    for group, path, option in files:
        sig = (group, _shape(path))
        if sig not in seen:
            seen.add(sig)
            out.append([f"{group}={option}"])
    return out + [["strategy=ddp", "trainer=ddp_sim"]]


@pytest.fixture(scope="module")
def every_option():
    """{option: composed config} for every option of :func:`_options` (one Hydra initialisation)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    out = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for ov in _options():
            out[" ".join(ov)] = hcompose(config_name="train", overrides=ov)
    GlobalHydra.instance().clear()
    return out


def _source_names() -> set[str]:
    """Every string constant, attribute name, keyword and parameter name in src/canonlm, except in the two modules
    that declare the keys (config/rules.py, config/strict.py): what the code reads."""
    names: set[str] = set()
    for f in (ROOT / "src" / "canonlm").rglob("*.py"):
        if f.name in ("rules.py", "strict.py") and f.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def test_every_conf_key_is_read(every_option):
    """Every key of every conf/ file (each group option and experiment composed) is one canonlm reads
    (``check_keys`` refuses none), each entry of the extension points takes only arguments of its ``_target_``,
    and every declared plain key (a rule of TRAINING_RULES outside the nodes another class reads, and other than
    Hydra's own ``_partial_``) is named in the code that reads it; every rule's key occurs in some conf/ file or is
    optional."""
    import inspect

    from hydra._internal.utils import _locate
    from omegaconf import OmegaConf

    from canonlm.config.rules import TRAINING_RULES, Rule
    from canonlm.config.strict import check_keys, leaves

    seen: set[str] = set()
    for name, cfg in every_option.items():
        check_keys(cfg)
        raw = OmegaConf.to_container(cfg, resolve=False)
        seen |= {k for k, _ in leaves({k: v for k, v in raw.items() if k != "hydra"})}
        for point in ("callbacks", "logger"):
            for entry, node in (raw.get(point) or {}).items():
                if not isinstance(node, dict):
                    continue
                target = node["_target_"]
                params = inspect.signature(_locate(target)).parameters  # a class or a factory function
                if any(p.kind is p.VAR_KEYWORD for p in params.values()) and target.startswith("lightning"):
                    continue
                unknown = set(node) - {"_target_"} - set(params)
                assert not unknown, f"{name}: {point}.{entry} has {unknown}, not arguments of {target}"
    names = _source_names()
    for rule in TRAINING_RULES:
        if not isinstance(rule, Rule):
            continue
        parent, _, leaf = rule.key.rpartition(".")
        assert rule.optional or rule.key in seen, f"{rule.key}: a required rule no conf/ file sets"
        if leaf.startswith("_"):  # Hydra's own instantiate keys (optim._partial_)
            continue
        if rule.key.startswith(("callbacks.", "logger.", "trainer.", "optim.")):  # read by the class it configures
            target = next(
                OmegaConf.select(c, f"{parent}._target_")
                for c in every_option.values()
                if OmegaConf.select(c, f"{parent}._target_", default=None)
            )
            assert leaf in inspect.signature(_locate(target)).parameters, f"{rule.key}: not an argument of {target}"
        else:
            assert leaf in names, f"{rule.key}: declared but never read in src/canonlm"


def test_arguments_read_from_source_match_the_imported_classes():
    """``source_arguments`` (the strict check's reading of a class's arguments without importing it) against
    ``inspect.signature`` of the imported class: Lightning's Trainer, AdamW (re-exported by ``torch.optim``), SGD."""
    import inspect

    import lightning.pytorch as L

    from canonlm.config.strict import source_arguments, trainer_arguments

    assert list(trainer_arguments()) == [n for n in inspect.signature(L.Trainer.__init__).parameters if n != "self"]
    for cls in (torch.optim.AdamW, torch.optim.SGD):
        sig = inspect.signature(cls.__init__).parameters
        assert list(source_arguments(f"torch.optim.{cls.__name__}")) == [n for n in sig if n != "self"]
    assert source_arguments("canonlm.train.callbacks.StepCheckpoint") is None  # a function: inspected instead


def test_every_boolean_key_takes_booleans_only(every_option):
    """Every key that is a boolean in some conf/ file is refused with the text ``no`` (naming the key and "true or
    false"), by the checks train.py runs before Hydra: the keys, the declared rules, the optimizer, the model."""
    from omegaconf import OmegaConf, open_dict

    from canonlm.config.strict import leaves
    from canonlm.errors import ConfigError
    from canonlm.train.run import check_job

    where: dict[str, str] = {}
    for name, cfg in every_option.items():
        raw = OmegaConf.to_container(cfg, resolve=False)
        for key, value in leaves({k: v for k, v in raw.items() if k != "hydra"}):
            if isinstance(value, bool) and key not in where:
                where[key] = name
    assert {
        "train",
        "test",
        "compile",
        "activation_checkpointing",
        "optim.fused",
        "canon.residual",
        "model.tie_embeddings",
        "trainer.benchmark",
        "data.gen_eval.on_val",
    } <= set(where)
    for key, name in sorted(where.items()):
        cfg = every_option[name].copy()
        with open_dict(cfg):
            OmegaConf.update(cfg, key, "no")
            cfg.paths.output_dir = "/tmp/canonlm-unused"
            cfg.paths.root_dir = str(ROOT)
        try:
            check_job(cfg, device_checks=False)
        except ConfigError as err:
            e = err
        else:
            pytest.fail(f"{key}='no' ({name}) was accepted")
        assert e.key == key, (key, str(e))
        assert ("true" in e.allowed and "false" in e.allowed) or e.allowed.startswith("true ("), (key, str(e))


def test_linear_fields_change_nothing_in_a_llama():
    """The fields canonlm refuses for ``arch=llama`` (LINEAR_ONLY) are not read by a Llama: changed to another
    valid value, the model has the same parameters and computes the same logits."""
    from canonlm.arch.config import build_model_config
    from canonlm.arch.model import CanonLM
    from canonlm.config.strict import LINEAR_ONLY

    changed = {
        "expand_k": 1.0,
        "expand_v": 2.0,
        "gate_low_rank_dim": 8,
        "gate_logit_normalizer": 4.0,
        "output_gate_rank": 8,
        "key_head_dim": 16,
        "conv_kernel": 2,
        "no_conv_act": "none",
        "chunk_size": 16,
        "ssm_state": 8,
        "mamba_expand": 1,
        "n_groups": 2,
    }
    assert set(changed) == set(LINEAR_ONLY)
    x = torch.randint(0, 32, (2, 16))

    def logits(**kw):
        torch.manual_seed(0)
        cfg = build_model_config(
            {"size": "2L64D", "arch": "llama", **kw}, {"set": "ABCD"}, {"type": "rope"}, vocab_size=32, max_seq_len=64
        )
        m = CanonLM(cfg)
        with torch.no_grad():
            return {k: tuple(v.shape) for k, v in m.state_dict().items()}, m(x)

    shapes, base = logits()
    for field, value in changed.items():
        s, out = logits(**{field: value})
        assert s == shapes and torch.equal(out, base), field


def test_each_task_accepts_exactly_its_keys():
    """``task_keys`` (the strict check's list) against the task itself: every listed key is accepted with the
    task's own default, and a key outside the list is refused by the task (tests only the keys, not the values)."""
    from canonlm.config.strict import task_keys
    from canonlm.data.tasks import TASKS, build_task
    from canonlm.errors import ConfigError

    for name in TASKS:
        keys = task_keys(name)
        assert keys and "name" in keys and "context" in keys, name
        with pytest.raises(ConfigError) as e:
            build_task(name, {"name": name, "not_a_key": 1})
        assert e.value.key == "task.not_a_key"
    assert task_keys("depo9") is None


def test_canon_sets_are_recorded_as_they_train(tmp_path):
    """A repeated letter is refused; the release's spellings ``AbbCD`` / ``bb`` train and are recorded as ``AbCD`` /
    ``b`` (the config train.py saves is the model's), so identical models get one label."""
    from canonlm.arch.config import canon_set
    from canonlm.errors import ConfigError
    from canonlm.train.run import check_job

    import itertools

    from canonlm.arch.config import LINEAR_CANON_LETTERS
    from canonlm.config import resolvers
    from canonlm.config.rules import _canon_letters_once

    assert canon_set("AbbCD") == "AbCD" and canon_set("bb") == "b" and canon_set(None) == ""
    for bad in ("AAB", "ABCDA", "bbb"):
        with pytest.raises(ConfigError, match="each letter at most once"):
            canon_set(bad)
    # the rule train.py checks before torch loads accepts exactly the strings the model config accepts
    for n in range(5):
        for letters in itertools.product("AbBx", repeat=n):
            s = "".join(letters)
            try:
                canon_set(s)
                ok = True
            except ConfigError:
                ok = False
            assert _canon_letters_once(s) == ok, s
    assert resolvers.LINEAR_CANON_LETTERS == LINEAR_CANON_LETTERS  # restated there to register without torch
    cfg = compose(["arch=gla", "canon=AbbCD", *TINY], output_dir=tmp_path / "run")
    _, mcfg, _ = check_job(cfg, device_checks=False)
    assert cfg.canon.set == mcfg.canon.set == "AbCD"


def test_a_sweep_is_checked_job_by_job_before_hydra(tmp_path, monkeypatch):
    """``check_command_line`` composes every job of a sweep as Hydra's basic sweeper splits it (the preset's
    ``hydra.sweeper.params`` included) and with the submitit launcher too (no device check for jobs that run
    elsewhere); nothing is created."""
    from canonlm.train.run import check_command_line

    monkeypatch.chdir(tmp_path)
    assert check_command_line(["-m", *TINY, "canon=none,ABCD", "pos=rope,nope"], CONF) == 4
    assert check_command_line(["-m", "hydra/launcher=slurm_cpu", *TINY, "canon=none,ABCD"], CONF) == 2
    assert check_command_line(["experiment=mini/copy"], CONF) == 8  # hydra.mode: MULTIRUN in the preset
    assert check_command_line(["--cfg", "job"], CONF) == 0
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- memory arithmetic
MODELS = {
    "llama": ({"arch": "llama"}, "ABCD"),
    "gla": (ARCH_PRESETS["gla"], "AbCD"),
    "gdn": (ARCH_PRESETS["gdn"], "AbCD"),
    "mamba2": (ARCH_PRESETS["mamba2"], "AbCD"),
    "mamba2_nomlp": (ARCH_PRESETS["mamba2_nomlp"], "Ab"),
    "llama_tied_gqa": ({"arch": "llama", "tie_embeddings": True, "n_kv_heads": 1, "mlp": "standard"}, ""),
}


def _model(name: str):
    from canonlm.arch.config import build_model_config
    from canonlm.arch.model import CanonLM

    preset, canon = MODELS[name]
    cfg = build_model_config(
        {"size": "2L64D", **preset}, {"set": canon}, {"type": "rope"}, vocab_size=48, max_seq_len=64, ops="reference"
    )
    torch.manual_seed(0)
    return cfg, CanonLM(cfg)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_state_bytes_equal_a_real_adamw_step(name):
    """Parameters, gradients and AdamW state of :func:`training_memory` against the tensors a real AdamW step
    leaves (fp32)."""
    from canonlm.arch.loss import lm_loss
    from canonlm.arch.memory import training_memory

    cfg, model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    x = torch.randint(1, 48, (2, 16))
    lm_loss(model(x), x, None)["loss_sum"].backward()
    opt.step()
    est = training_memory(cfg, 2, 16)
    params = list(model.parameters())
    assert est.parameters == sum(p.nbytes for p in params)
    assert est.gradients == sum(p.grad.nbytes for p in params)
    assert est.optimizer == sum(t.nbytes for s in opt.state.values() for t in s.values() if t.dim() > 0)


@pytest.mark.parametrize("name", list(MODELS))
def test_activation_bytes_are_a_lower_bound_of_what_autograd_saves(name):
    """The activations of :func:`training_memory` are at most what autograd really keeps for the backward pass of
    one forward + loss (every tensor saved for backward, counted once per storage, parameters excluded; measured
    with ``torch.autograd.graph.saved_tensors_hooks``, pure-PyTorch reference ops), and not a vacuous bound: at
    least 1/3 of it for a Llama, 1/10 for the linear mixers (their chunked reference algorithms also keep per-chunk
    intermediates, which the bound leaves out)."""
    from canonlm.arch.loss import lm_loss
    from canonlm.arch.memory import training_memory

    cfg, model = _model(name)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.device.type != "meta":
            saved[st.data_ptr()] = st.nbytes()
        return t

    B, T = 4, 64
    x = torch.randint(1, 48, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), x, None)["loss_sum"]
    loss.backward()
    real = sum(saved.values())
    est = training_memory(cfg, B, T).activations
    print(f"{name}: estimate {est} B <= saved {real} B ({real / est:.2f}x)")
    assert est <= real <= (3 if cfg.arch == "llama" else 10) * est


def test_memory_numbers_of_the_refusal():
    """The refusal's arithmetic by hand for the tiny model of the table: 2 layers, d 64, 2 heads, gated MLP of 256
    (ffn_multiple_of 256), Depo vocabulary; fp32."""
    from canonlm.arch.memory import BATCH_BYTES_PER_TOKEN, training_memory
    from canonlm.config.build import build_configs

    _, cfg = build_configs(compose(TINY))
    d, f, V, L = 64, 256, cfg.vocab_size, 2
    # block input, Canon-A's input, q k v (twice: Canon-B), attention output, Canon-C's input, MLP input, w13 output
    # (twice: Canon-D); the default Canon set is ABCD; the final norm's input and the loss' fp32 log-softmax (V)
    per_token = L * (d + d + 2 * (d + 2 * d) + d + d + d + 2 * (2 * f)) + d + V
    est = training_memory(cfg, 100_000_000, 128)
    assert est.activations == 100_000_000 * 128 * per_token * 4
    assert est.batch == 100_000_000 * 128 * BATCH_BYTES_PER_TOKEN == 100_000_000 * 128 * 17
    assert est.optimizer == 2 * est.parameters == 2 * est.gradients
    ck = training_memory(cfg, 8, 128, activation_checkpointing=True)  # block inputs + one block recomputed
    block = (per_token - d - V) // L  # the recomputed block's input is the one the checkpoint holds: not twice
    assert ck.activations == 8 * 128 * (L * d + block - d + d + V) * 4 < training_memory(cfg, 8, 128).activations


def test_the_memory_check_on_cuda_uses_the_free_memory_of_the_device_it_trains_on(monkeypatch, tmp_path):
    """The CUDA branch of ``check_memory`` (no GPU here: ``torch.cuda``'s answers are faked with the signatures of
    torch 2.x ``torch.cuda.is_available`` / ``device_count`` / ``mem_get_info(device) -> (free, total)``): the paper's
    Depo1 N=375 preset (12L768D, 128 x 2048 tokens per step, bf16-mixed) fits eight 141 GiB devices; 64 times that
    batch on one device does not, and the refusal names ``data.batch_size``, the device it asked
    (``LOCAL_RANK`` = 3 -> cuda:3) and its free memory."""
    from omegaconf import open_dict

    from canonlm.config.build import build_configs
    from canonlm.errors import ConfigError
    from canonlm.train.run import check_memory

    asked = []

    def mem_get_info(device=None):
        asked.append(str(device))
        return 141 * 2**30, 143 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = compose(["experiment=depo1_N375", "trainer=gpu"], output_dir=tmp_path / "run")
    _, mcfg = build_configs(cfg)
    assert check_memory(cfg, mcfg, torch.device("cuda")) > 80_000_000  # fits: the parameter count is returned
    with open_dict(cfg):
        cfg.trainer.devices = 1
        cfg.data.batch_size = 128 * 64
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, mcfg, torch.device("cuda"))
    assert e.value.key == "data.batch_size" and "cuda:3 has 141.0 GiB free of 143.0 GiB" in e.value.allowed
    assert "micro-batch 8192 windows x 2048 tokens" in e.value.allowed and set(asked) == {"cuda:3"}
