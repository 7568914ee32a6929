"""slurm/launch.py and the submitit launcher, on paper (the rendered sbatch script) and on a real one-node SLURM
cluster started on this machine by scripts/local_slurm.py (tests marked ``slurm``; skipped with the script's
reason where SLURM cannot be installed or started, e.g. not root).

The jobs train the tiny Depo1 model of tests/test_train.py for 60 steps (checkpoints every 10) and are checked
against an independent oracle: the same run in one local process with the same global batch. Two ranks that saw
the same windows, a resume from the wrong step or a lost optimizer state would all change the final test loss.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _slurm_cluster import (
    EXIT_UNAVAILABLE,
    ClusterHandle,
    cluster_dir,
    job_info,
    job_report,
    local_slurm,
    wait_job_end,
    wait_until,
)
from conftest import ROOT, compose

LAUNCH = ROOT / "slurm" / "launch.py"
TINY = [
    "task=depo1_cpu",
    "model.size=2L64D",
    "task.N=8",
    "task.K=4",
    "task.vocab_V=6",
    "task.context=128",
    "data.batch_size=6",
    "data.val_windows=12",
    "data.test_windows=24",
    "trainer.log_every_n_steps=5",
]  # batches split over 1, 2, 3 ranks
MAX_STEPS = 60
RUN = [
    *TINY,
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.val_check_interval=30",
    "callbacks.checkpoint.every_n_train_steps=10",
]
CPU2 = ["--gpus-per-node", "0", "--tasks-per-node", "2", "--cpus-per-task", "1", "--mem", "3G", "--time", "15"]
JOB_TIMEOUT = 600  # seconds; a job here takes ~30-60 s on 2 cores (most of it imports), a requeue adds ~15 s


def _launch():
    spec = importlib.util.spec_from_file_location("launch", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _render(argv):
    launch = _launch()
    args, ov = launch.parse(argv)
    launch.check(args)
    return launch.render(args, ov), args, ov, launch


# ---------------------------------------------------------------------------------------------------------------
# The sbatch script (no cluster needed)
# ---------------------------------------------------------------------------------------------------------------


def test_render_gpu_job_one_task_per_gpu(tmp_path):
    s, *_ = _render(
        [
            "--name",
            "r1",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--partition",
            "p",
            "--log-dir",
            str(tmp_path),
            "--",
            "experiment=depo1_N375",
            "canon=ABCD",
        ]
    )
    lines = s.splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --partition=p",
        f"cd {ROOT}",
    ):
        assert line in lines, line
    assert not any(ln.startswith(("#SBATCH --cpus-per-task", "#SBATCH --mem")) for ln in lines)  # SLURM's defaults
    cmd = [ln for ln in lines if ln.startswith("srun ")][0].split()
    assert cmd[1] == sys.executable and cmd[2] == "train.py"  # this interpreter has canonlm: the job uses it
    for tok in (
        "experiment=depo1_N375",
        "canon=ABCD",
        "run_name=r1",
        "ckpt_path=auto",
        "trainer.num_nodes=2",
        "trainer.accelerator=gpu",
        "trainer.devices=4",
        "callbacks.preemption.signal_name=SIGUSR2",
        f"paths.log_dir={tmp_path}",
    ):
        assert tok in cmd, tok


def test_render_cpu_job(tmp_path):
    """--gpus-per-node 0 is a CPU job: no GPU line, --tasks-per-node ranks, trainer.accelerator=cpu; --mem and
    --cpus-per-task (repeated on srun, which does not inherit it in Slurm 22.05) only when given."""
    s, *_ = _render(
        [
            "--name",
            "c1",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--cpus-per-task",
            "1",
            "--mem",
            "4G",
            "--signal",
            "SIGusr1@60",
            "--log-dir",
            str(tmp_path),
            "--",
            "strategy=ddp",
        ]
    )
    lines = s.splitlines()
    for line in (
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --mem=4G",
        "#SBATCH --signal=USR1@60",
    ):
        assert line in lines, line
    assert not any("gpus" in ln for ln in lines)
    cmd = [ln for ln in lines if ln.startswith("srun ")][0].split()
    assert cmd[1] == "--cpus-per-task=1"
    for tok in (
        "strategy=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "callbacks.preemption.signal_name=SIGUSR1",
    ):
        assert tok in cmd, tok
    s1, *_ = _render(["--name", "c2", "--gpus-per-node", "0", "--log-dir", str(tmp_path)])
    assert "#SBATCH --ntasks-per-node=1" in s1.splitlines() and "trainer.devices=1" in s1


def test_job_overrides_compose_and_build_the_preemption_callback(tmp_path):
    """The overrides the launcher adds are real config keys, and the signal it passes is one the Preemption
    callback accepts (a typo here would only show on the cluster, after the job started)."""
    from hydra.utils import instantiate

    _, args, ov, launch = _render(
        [
            "--name",
            "c1",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--signal",
            "USR1@60",
            "--log-dir",
            str(tmp_path),
            "--",
            *TINY,
        ]
    )
    cfg = compose([o for o in launch.run_overrides(args, ov) if not o.startswith("paths.")], output_dir=tmp_path)
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2 and cfg.ckpt_path == "auto"
    cb = instantiate(cfg.callbacks.preemption)
    assert cb.signal_name == "SIGUSR1"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--signal", "TERM@60"], "--signal"),
        (["--signal", "USR1"], "--signal"),
        (["--signal", "USR1@0"], "--signal"),
        (["--signal", "USR1@70000"], "--signal"),
        (["--mem", "4GB"], "--mem"),
        (["--gpus-per-node", "4", "--tasks-per-node", "2"], "--tasks-per-node"),
        (["--gpus-per-node", "-1"], "--gpus-per-node"),
        (["--cpus-per-task", "0"], "--cpus-per-task"),
        (["--time", "2 days"], "--time"),
    ],
)
def test_bad_flag_is_refused_before_anything_is_written(argv, flag, tmp_path, capsys):
    launch = _launch()
    assert launch.main(["--name", "r1", "--log-dir", str(tmp_path / "logs"), *argv]) == 2
    err = capsys.readouterr().err
    assert f"{flag}=" in err and "allowed:" in err, err
    assert not (tmp_path / "logs").exists()


# Values that must never reach the batch script: a newline (a new script line), a new #SBATCH directive, spaces and
# shell metacharacters. Each is tried alone and after a valid value of the flag.
INJECTIONS = ["a\nb", "x\n#SBATCH --wrap=id", "a b", "a;id", "$(id)", "`id`", "a&id", "a|id", "a'b", 'a"b', "a\\b"]
VALID = {
    "--name": "r1",
    "--partition": "debug",
    "--account": "acct",
    "--qos": "normal",
    "--mem": "4G",
    "--time": "10",
    "--signal": "USR1@60",
    "--log-dir": "logs",
    "--python": "/usr/bin/python3",
}
# Paths may hold inner spaces (quoted wherever they are written); they refuse what sbatch's --output or Hydra's
# paths.log_dir cannot carry: % (sbatch's file name patterns), #, a space at the end.
PATH_ONLY = ["a%jb", "a#b", "logs "]


def _injection_cases():
    for flag, valid in VALID.items():
        is_path = flag in ("--log-dir", "--python")
        for bad in INJECTIONS + (PATH_ONLY if is_path else []):
            if is_path and bad == "a b":
                continue  # an inner space is allowed in a path (test_paths_and_overrides_reach_the_job_unchanged)
            yield pytest.param(flag, bad, id=f"{flag}={bad!r}")
            yield pytest.param(flag, valid + bad, id=f"{flag}={valid + bad!r}")


@pytest.mark.parametrize("flag, value", list(_injection_cases()))
def test_injection_is_refused_before_anything_is_written(flag, value, tmp_path, monkeypatch, capsys):
    """One message naming the flag, its value and what is allowed (exit code 2); no folder, no script."""
    monkeypatch.chdir(tmp_path)  # a relative --log-dir lands here
    argv = {**VALID, flag: value}
    argv = [tok for k, v in argv.items() for tok in (k, v)] + ["--gpus-per-node", "0"]
    assert _launch().main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"launch: error: {flag}=") and "; allowed: " in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override", ["a=b\nc", "x=1\n#SBATCH --wrap=id", "x=\tb", "x=\rb"])
def test_override_with_a_control_character_is_refused(override, tmp_path, capsys):
    assert (
        _launch().main(["--name", "r1", "--log-dir", str(tmp_path / "logs"), "--", "model.size=2L64D", override]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("launch: error: override=") and "allowed: " in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override",
    [
        "ckpt_path=/runs/a/checkpoints/step0000010.ckpt",
        "run_name=other",
        "paths.log_dir=/elsewhere",
        "trainer.devices=3",
        "+trainer.num_nodes=2",
        "trainer.accelerator=gpu",
        "callbacks.preemption.signal_name=SIGUSR1",
        "callbacks=none",
        "callbacks.preemption=null",
        "~callbacks.preemption",
    ],
)
def test_override_of_a_key_the_launcher_sets_is_refused(override, tmp_path, capsys):
    """The job's srun line ends with the launcher's own run_name, ckpt_path=auto, paths.log_dir, trainer.* and
    signal overrides, which win over the user's: a user value for one of those keys would be silently replaced
    (ckpt_path=<another run's checkpoint> would train from scratch), so it is refused, naming the key and the flag
    or route that sets it."""
    assert (
        _launch().main(
            [
                "--name",
                "r1",
                "--gpus-per-node",
                "0",
                "--log-dir",
                str(tmp_path / "logs"),
                "--",
                "model.size=2L64D",
                override,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    key = override.split("=")[0].lstrip("+~")
    assert len(err.splitlines()) == 1 and err.startswith(f"launch: error: override={override!r}"), err
    assert f"no {key}: the launcher sets it" in err or "the preemption callback kept" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node", "--tasks-per-node", "--cpus-per-task"])
def test_integer_flags_take_integers_only(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _launch().main(["--name", "r1", "--log-dir", str(tmp_path / "logs"), flag, "1;id"])
    assert e.value.code == 2 and f"argument {flag}: invalid int value: '1;id'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_paths_and_overrides_reach_the_job_unchanged(tmp_path):
    """A log dir with spaces and overrides full of shell metacharacters: the rendered script passes `bash -n`, and
    bash running it hands srun exactly the launcher's words (srun replaced by a function that writes its argv),
    runs nothing else; Hydra's override parser reads paths.log_dir back as the folder; the #SBATCH output lines
    double-quote the path (sbatch groups quoted characters, spaces included: test_log_dir_with_a_space_on_the_cluster
    shows it on the real sbatch)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    log_dir = tmp_path / "my logs" / "a  b"
    odd = ["+note=$(touch pwned)", "+n2=`touch pwned`;touch pwned&|", "+n3='x y'", '+n4="q"', "+n5=a\\b"]
    s, args, ov, launch = _render(["--name", "r1", "--gpus-per-node", "0", "--log-dir", str(log_dir), "--", *odd])
    script, argv_file = tmp_path / "job.sbatch", tmp_path / "argv"
    script.write_text(s)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    r = subprocess.run(
        ["bash", "-c", 'srun() { printf "%s\\0" "$@" > "$ARGV_OUT"; }; export -f srun; bash "$1"', "-", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "ARGV_OUT": str(argv_file)},
    )
    assert r.returncode == 0, r.stderr
    argv = argv_file.read_text().split("\0")[:-1]
    assert argv[: 2 + len(odd)] == [args.python, "train.py", *odd], argv
    assert argv[-1] == f"paths.log_dir={log_dir}", argv
    assert OverridesParser.create().parse_override(argv[-1]).value() == str(log_dir)
    assert not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()
    lines = s.splitlines()
    for ext, opt in (("out", "output"), ("err", "error")):
        assert f'#SBATCH --{opt}="{log_dir}/slurm/r1/slurm-%j.{ext}"' in lines, s


def test_existing_name_is_not_reused(tmp_path, capsys):
    launch = _launch()
    (tmp_path / "slurm" / "r1").mkdir(parents=True)
    assert launch.main(["--name", "r1", "--log-dir", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# The one-node cluster
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster():
    """The cluster of scripts/local_slurm.py (``$CANONLM_SLURM_DIR``, default /run/canonlm-slurm): used when it is
    up, else started (installing SLURM when missing, as root) and stopped at the end. ``SLURM_CONF`` points at
    its config for the session, so sbatch, scontrol and the jobs (sbatch exports the environment) find it."""
    up = local_slurm("status", timeout=60)
    started = False
    if up.returncode != 0:
        r = local_slurm("start")
        if r.returncode == EXIT_UNAVAILABLE:
            pytest.skip(f"SLURM unavailable: {(r.stderr or r.stdout).strip()}")
        assert r.returncode == 0, f"scripts/local_slurm.py start failed:\n{r.stdout}\n{r.stderr}"
        started = True
    conf = cluster_dir() / "etc" / "slurm.conf"
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(conf))
    mp.setenv("WANDB_MODE", "disabled")
    yield ClusterHandle(cluster_dir(), conf, started)
    mp.undo()
    if started:
        local_slurm("stop", timeout=120)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The 60-step run in one local process (same global batch, same seed): its results.json."""
    d = tmp_path_factory.mktemp("oracle")
    cmd = [sys.executable, str(ROOT / "train.py"), *RUN, "run_name=oracle", f"paths.log_dir={d}/logs"]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=d, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads((d / "logs" / "train" / "runs" / "oracle" / "results.json").read_text())


class Submitted:
    """A job submitted by slurm/launch.py: id, run dir, output files."""

    def __init__(self, job: str, name: str, log_dir: Path):
        self.job, self.name = job, name
        self.out = log_dir / "slurm" / name
        self.run = log_dir / "train" / "runs" / name
        self.files = (self.out / f"slurm-{job}.out", self.out / f"slurm-{job}.err", self.run / "train.log")

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.files[:2] if p.exists())

    def report(self) -> str:
        return job_report(self.job, *self.files)

    def results(self) -> dict:
        path = self.run / "results.json"
        assert path.exists(), f"no {path}\n{self.report()}"
        return json.loads(path.read_text())

    def wait_first_checkpoint(self) -> None:
        ck = self.run / "checkpoints" / "step0000010.ckpt"
        wait_until(ck.exists, JOB_TIMEOUT, f"{ck}", self.job, self.files)


def _submit(name: str, log_dir: Path, flags: list[str], overrides: list[str]) -> Submitted:
    cmd = [sys.executable, str(LAUNCH), "--name", name, "--log-dir", str(log_dir), *flags, "--", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"launch.py failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    job = r.stdout.strip().splitlines()[-1]
    assert job.isdigit(), r.stdout
    return Submitted(job, name, log_dir)


def _assert_matches_oracle(res: dict, oracle: dict, report: str) -> None:
    assert res["steps"] == oracle["steps"] == MAX_STEPS, report
    assert res["test"]["loss"] == pytest.approx(oracle["test"]["loss"], rel=1e-4), report
    assert {k: v["answers"] for k, v in res["test"]["by_group"].items()} == {
        k: v["answers"] for k, v in oracle["test"]["by_group"].items()
    }, report


def _assert_metrics_end_at_max_steps(sub: Submitted) -> None:
    from canonlm.train.metrics_file import read_metrics

    rows = read_metrics(sub.run / "metrics.jsonl")
    train_steps = [r["step"] for r in rows if "train/loss" in r]
    assert rows and rows[-1]["step"] == MAX_STEPS and max(train_steps) == MAX_STEPS - 1, (
        f"metrics.jsonl ends at step {rows[-1]['step'] if rows else None} (train rows up to "
        f"{max(train_steps, default=None)}), expected {MAX_STEPS}\n{sub.report()}"
    )


@pytest.mark.slurm
def test_failed_sbatch_leaves_nothing_behind(slurm_cluster, tmp_path):
    """sbatch refuses an unknown partition: its error is printed, the folders this invocation made are removed
    (so the same command is not then refused as "exists"), and a folder that existed before is kept."""
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        str(LAUNCH),
        "--name",
        "bad",
        "--log-dir",
        str(logs),
        "--gpus-per-node",
        "0",
        "--partition",
        "no_such_partition",
        "--",
        *TINY,
    ]
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "sbatch failed" in r.stderr and "exists" not in r.stderr, r.stderr
        assert "partition" in r.stderr.lower(), r.stderr  # sbatch's own message
        assert not logs.exists(), list(logs.rglob("*"))
    mine = logs / "slurm" / "bad" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("user data")
    i = cmd.index("--")
    r = subprocess.run([*cmd[:i], "--resume", *cmd[i:]], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "sbatch failed" in r.stderr, r.stderr
    assert sorted(p.name for p in mine.parent.iterdir()) == ["notes.txt"] and mine.read_text() == "user data"


@pytest.mark.slurm
@pytest.mark.slow
def test_log_dir_with_a_space_on_the_cluster(slurm_cluster, tmp_path):
    """sbatch reads the double-quoted ``#SBATCH --output`` path whole, space included, and train.py gets the same
    folder as paths.log_dir: the job's output file and its run directory land under ``my logs``, nothing under
    ``my`` (where an unquoted path would have been cut)."""
    logs = tmp_path / "my logs"
    sub = _submit(
        "spaced",
        logs,
        ["--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "2G", "--time", "10"],
        [*TINY, "trainer.max_steps=10", "trainer.val_check_interval=10", "callbacks.checkpoint.every_n_train_steps=10"],
    )
    info = wait_job_end(sub.job, JOB_TIMEOUT, sub.files)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", sub.report()
    assert f"[launch] job {sub.job} restart 0 " in sub.files[0].read_text(), sub.report()
    assert sub.results()["steps"] == 10, sub.report()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my logs"]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_rank_cpu_job_matches_one_process(strategy, slurm_cluster, oracle, tmp_path):
    """launch.py submits a 2-rank CPU job (2 tasks x 1 CPU) run through srun; Lightning takes ranks and world size
    from SLURM (SLURM_PROCID / SLURM_NTASKS: one process per task, none spawned), the ranks train one model over
    gloo, each on its own half of every global batch: the final test loss equals the one-process oracle.

    FSDP2, a preempted run resubmitted at another size: the run directory as it stood at step 10 (checkpoint
    ``step0000010.ckpt``, a torch.distributed.checkpoint folder, and the metrics up to then) is copied twice and
    each copy is resubmitted by name with ``--resume`` (the job's ``ckpt_path=auto`` finds the checkpoint), once
    with 1 rank and once with 3, side by side (the test cluster declares 4 CPUs on this 2-core machine). The model
    and AdamW state are resharded on load and every step's global batch of 6 windows is the same for any world size
    (split 3/3, 6 or 2/2/2), so both continue the 2-rank job's training losses (logged every 5 steps from step 10
    to 59) within float tolerance and end at the oracle."""
    import shutil

    from canonlm.train.metrics_file import read_metrics

    extra = ["strategy.param_dtype=fp32"] if strategy == "fsdp2" else []
    sub = _submit(f"two_{strategy}", tmp_path / "logs", CPU2, [*RUN, f"strategy={strategy}", *extra])
    info = wait_job_end(sub.job, JOB_TIMEOUT, sub.files)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", sub.report()
    res = sub.results()
    assert res["world_size"] == 2, sub.report()
    log = sub.log()
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log, sub.report()  # rank 1 is srun's second task, not a spawned child
    _assert_matches_oracle(res, oracle, sub.report())
    if strategy != "fsdp2":
        return
    ck = sub.run / "checkpoints" / "step0000010.ckpt"
    assert ck.is_dir() and (ck / ".metadata").is_file(), sub.report()
    full = {r["step"]: r["train/loss"] for r in read_metrics(sub.run / "metrics.jsonl") if "train/loss" in r}
    cpus = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=60).stdout.split()
    assert cpus and int(cpus[0]) >= 4, (
        f"the test cluster declares {cpus} CPUs; the 1- and 3-rank jobs need 4 "
        "(scripts/local_slurm.py stop, then start: it declares --cpus 4 by default)"
    )
    jobs = {}
    for n in (1, 3):
        name = f"resume_fsdp2_ws{n}"
        run = sub.run.parent / name  # the run as it stood when the step-10 checkpoint was written
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck, run / "checkpoints" / ck.name)
        (run / "metrics.jsonl").write_text(
            "".join(
                ln for ln in (sub.run / "metrics.jsonl").read_text().splitlines(True) if json.loads(ln)["step"] < 10
            )
        )
        jobs[n] = _submit(
            name,
            tmp_path / "logs",
            ["--resume", *CPU2[:2], "--tasks-per-node", str(n), *CPU2[4:]],
            [*RUN, "strategy=fsdp2", *extra],
        )
    table = [("2 (uninterrupted)", 0, MAX_STEPS, full[MAX_STEPS - 1], res["test"]["loss"])]
    for n, job in jobs.items():
        info = wait_job_end(job.job, JOB_TIMEOUT, job.files)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.report()
        res_n = job.results()
        assert res_n["world_size"] == n, job.report()
        if n == 3:
            assert "GLOBAL_RANK: 2, MEMBER: 3/3" in job.log(), job.report()
        assert "ckpt_path=auto: resuming from" in job.files[2].read_text(), job.report()
        rows = {
            r["step"]: r["train/loss"]
            for r in read_metrics(job.run / "metrics.jsonl")
            if "train/loss" in r and r["step"] >= 10
        }
        assert max(rows) == MAX_STEPS - 1 and len(rows) == 10, job.report()  # steps 14, 19, ..., 59
        steps = sorted(rows)
        assert [rows[s] for s in steps] == pytest.approx([full[s] for s in steps], rel=1e-6), job.report()
        _assert_matches_oracle(res_n, oracle, job.report())
        table.append((f"2 -> {n} at step 10", 10, res_n["steps"], rows[MAX_STEPS - 1], res_n["test"]["loss"]))
    print("\nworld size | from step | steps | last train loss | test loss")
    for row in table:
        print(" | ".join(str(v) for v in row))


@pytest.mark.slurm
@pytest.mark.slow
def test_requeued_job_resumes_to_the_same_result(slurm_cluster, oracle, tmp_path):
    """`scontrol requeue` mid-run (after the step-10 checkpoint): SLURM sends SIGTERM, training saves last.ckpt at
    the next step boundary and exits; the job runs again under the same id (Restarts=1, after BeginTime) with
    ckpt_path=auto in the same run directory, and ends exactly where an uninterrupted run ends."""
    sub = _submit("requeue", tmp_path / "logs", CPU2, [*RUN, "strategy=ddp"])
    sub.wait_first_checkpoint()
    r = subprocess.run(["scontrol", "requeue", sub.job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"scontrol requeue: {r.stderr}\n{sub.report()}"
    info = wait_job_end(sub.job, JOB_TIMEOUT, sub.files)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, sub.report()
    log = sub.log()
    assert f"[launch] job {sub.job} restart 1 " in log, sub.report()
    saved = re.search(r"\[preemption\] saved (\S+) at step (\d+)", log)
    assert saved and 10 <= int(saved.group(2)) < MAX_STEPS, f"no SIGTERM save mid-run\n{sub.report()}"
    res = sub.results()
    assert res["attempts"] >= 2, sub.report()
    _assert_matches_oracle(res, oracle, sub.report())
    _assert_metrics_end_at_max_steps(sub)


@pytest.mark.slurm
@pytest.mark.slow
def test_warning_signal_saves_and_requeues(slurm_cluster, oracle, tmp_path):
    """The launcher's --signal (USR1 here) reaches the ranks (`scancel --signal` signals the job steps, as
    `#SBATCH --signal` does at the time limit): all ranks save at the next step boundary, rank 0 requeues the job
    itself, and the restarted job resumes to the uninterrupted result."""
    sub = _submit("warn", tmp_path / "logs", [*CPU2, "--signal", "USR1@60"], [*RUN, "strategy=ddp"])
    script = (sub.out / "submit.sbatch").read_text()
    assert "#SBATCH --signal=USR1@60" in script and "callbacks.preemption.signal_name=SIGUSR1" in script
    sub.wait_first_checkpoint()
    r = subprocess.run(["scancel", "--signal=USR1", sub.job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"scancel: {r.stderr}\n{sub.report()}"
    info = wait_job_end(sub.job, JOB_TIMEOUT, sub.files)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, sub.report()
    log = sub.log()
    saved = re.search(r"\[preemption\] saved (\S+) at step (\d+); requeued job (\d+)", log)
    assert saved and saved.group(3) == sub.job and 10 <= int(saved.group(2)) < MAX_STEPS, sub.report()
    assert f"[launch] job {sub.job} restart 1 " in log, sub.report()
    _assert_matches_oracle(sub.results(), oracle, sub.report())
    _assert_metrics_end_at_max_steps(sub)


@pytest.mark.slurm
@pytest.mark.slow
def test_hydra_submitit_sweep_on_cpu_node(slurm_cluster, oracle, tmp_path):
    """`train.py -m hydra/launcher=slurm_cpu canon=ABCD,none`: submitit submits a 2-job array and blocks until both
    jobs end; each cell writes results.json and the report reads the sweep. Cell 0 is requeued mid-run
    (`scontrol requeue <array job>_0`): it restarts in its own directory of the sweep, resumes (ckpt_path is auto
    inside a multirun job) and ends with the one-process oracle's result; the launcher still returns."""
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        "hydra/launcher=slurm_cpu",
        "canon=ABCD,none",
        *RUN,
        "hydra.launcher.timeout_min=15",
        f"paths.log_dir={logs}",
    ]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    multiruns = logs / "train" / "multiruns"

    def report():
        sweeps = sorted(multiruns.glob("*")) if multiruns.exists() else []
        return job_report(
            None,
            out,
            err,
            *(s / ".submitit" / "*" / "*.out" for s in sweeps),
            *(s / ".submitit" / "*" / "*.err" for s in sweeps),
        )

    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=tmp_path, stdin=subprocess.DEVNULL)
        try:
            ck = wait_until(
                lambda: next(iter(multiruns.glob("*/0/checkpoints/step0000010.ckpt")), None)
                if multiruns.exists()
                else None,
                JOB_TIMEOUT,
                "cell 0's step-10 checkpoint",
                files=(out, err),
            )
            sweep = ck.parents[2]
            array = wait_until(
                lambda: next(iter(sorted(p.name for p in (sweep / ".submitit").glob("*_0"))), None),
                30,
                "submitit's folder of cell 0",
                files=(out, err),
            )
            r = subprocess.run(["scontrol", "requeue", array], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"scontrol requeue {array}: {r.stderr}\n{report()}"
            rc = proc.wait(timeout=JOB_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 0, report()
    cells = [sweep / n / "results.json" for n in ("0", "1")]
    assert all(c.exists() for c in cells), report()
    res = [json.loads(c.read_text()) for c in cells]
    assert res[0]["model"]["canon"] == "ABCD" and res[1]["model"]["canon"] != "ABCD", report()  # job 1: canon=none
    info = job_info(array)
    assert int(info.get("Restarts", 0)) >= 1 and res[0]["attempts"] >= 2, f"{info}\n{report()}"
    _assert_matches_oracle(res[0], oracle, report())
    r = subprocess.run(
        [sys.executable, "-m", "canonlm.train.report", str(sweep), "--rows", "canon.set"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "none" in r.stdout and "ABCD" in r.stdout, r.stdout


@pytest.mark.slurm
def test_prepare_array_tasks_give_the_single_process_corpus(slurm_cluster, tmp_path):
    """`sbatch --array=0-2` of docs/text_data.md's script (``srun <this interpreter> -m canonlm.data.prepare ...
    --num-tasks 3``, no --task-index: each task takes ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN``) over the two
    fixture corpora: every array task COMPLETES with exit code 0, each reports its own task index, exactly one
    finalizes (the others leave the corpus to the last one), no ``.prepare/`` is left, and every file (meta.json
    without its creation time, every shard and index) is byte-identical to a one-process ``prepare`` of the same
    inputs in this process (the oracle of tests/test_prepare_parallel.py)."""
    import shlex

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from canonlm.data.prepare import main as prepare_main
    from test_prepare_parallel import COMMON, FILES, inputs, tree

    tok = Tokenizer(models.BPE())  # as test_prepare_parallel.tok_path: byte-level BPE, vocab 512, with </s>
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(f) for f in FILES],
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<pad>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    args = [*inputs(), "--tokenizer", str(tmp_path / "tokenizer.json"), *(a for a in COMMON if a != "--quiet")]

    out, logs = tmp_path / "arr", tmp_path / "slurm"
    logs.mkdir()
    script = tmp_path / "prepare.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=prepare --nodes=1 --ntasks=1 --cpus-per-task=1 --mem=1G --time=5\n"
        f"#SBATCH --output={logs}/%A_%a.out --error={logs}/%A_%a.err\n"
        f"srun {shlex.join([sys.executable, '-m', 'canonlm.data.prepare', *args, '--out', str(out)])} "
        "--num-tasks 3\n"
    )
    r = subprocess.run(
        ["sbatch", "--parsable", "--array=0-2", f"--chdir={tmp_path}", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"sbatch failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    job = r.stdout.strip().split(";")[0]
    assert job.isdigit(), r.stdout

    # the oracle, while the array runs
    assert prepare_main([*args, "--quiet", "--out", str(tmp_path / "one")]) == 0
    ref = tree(tmp_path / "one")

    files = (logs / f"{job}_*.out", logs / f"{job}_*.err")
    outs = {}
    for k in range(3):
        info = wait_job_end(f"{job}_{k}", 120, files)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job_report(f"{job}_{k}", *files)
        outs[k] = (logs / f"{job}_{k}.out").read_text() + (logs / f"{job}_{k}.err").read_text()
        assert f"[prepare] task {k}/3: " in outs[k], job_report(f"{job}_{k}", *files)
    wrote = [k for k, o in outs.items() if f"wrote {out}:" in o]
    waited = [k for k, o in outs.items() if "waits for the other tasks" in o]
    assert len(wrote) == 1 and sorted(wrote + waited) == [0, 1, 2], job_report(job, *files)
    assert (out / "meta.json").is_file() and not (out / ".prepare").exists(), sorted(map(str, out.rglob("*")))
    got = tree(out)
    assert sorted(got) == sorted(ref) and any(n.endswith(".idx.npy") for n in ref), (sorted(got), sorted(ref))
    assert [n for n in ref if got[n] != ref[n]] == []
