"""Submit one long training run to SLURM with save-and-requeue (lingua's stool idea, written for canonlm).

    python slurm/launch.py --name depo1_canon --nodes 1 --gpus-per-node 8 --time 2-00:00:00 \\
        --partition learn -- experiment=depo1_N375 canon=ABCD pos=nope
    python slurm/launch.py --name tiny --gpus-per-node 0 --tasks-per-node 2 --mem 4G -- model.size=2L64D

What it does: checks every flag, renders ``<log_dir>/slurm/<name>/submit.sbatch`` and submits it with
``sbatch --parsable`` (prints the job id); ``--dry-run`` prints the script and submits nothing. The job runs, from
the repository root, ``srun <python> train.py <overrides> run_name=<name> ckpt_path=auto trainer.num_nodes=..
trainer.accelerator=.. trainer.devices=.. callbacks.preemption.signal_name=SIG<sig> paths.log_dir=<log_dir>``:
the run dir is fixed by the name, so a requeued job resumes from ``last.ckpt``.

GPUs or CPUs (``--gpus-per-node``):
  * ``N > 0`` (default 8): one task per GPU (``--ntasks-per-node=N --gpus-per-node=N``; Lightning requires as
    many tasks per node as devices), ``trainer.accelerator=gpu trainer.devices=N``;
  * ``0``: a CPU job, no GPU line at all. ``--tasks-per-node T`` ranks per node (default 1) that train one model
    over gloo (``strategy=ddp`` or ``fsdp2`` among the overrides), ``trainer.accelerator=cpu trainer.devices=T``.

Save and requeue (canonlm.train.callbacks.Preemption):
  * ``--signal SIG@SECONDS`` (default ``USR2@120``) renders ``#SBATCH --signal=SIG@SECONDS``: Slurm sends SIG to
    every job step (the python ranks; not the batch shell, sbatch(1)) SECONDS before the time limit (Slurm may
    send it up to 60 s earlier). Training gets ``callbacks.preemption.signal_name=SIG<SIG>``: all ranks save
    ``checkpoints/last.ckpt`` at the next step boundary, rank 0 runs ``scontrol requeue $SLURM_JOB_ID``, and the
    job exits without testing. The same job id runs again (``--requeue``) and resumes;
  * a job cancelled for a requeue or a preemption gets SIGTERM and ``KillWait`` seconds (slurm.conf, 30 by
    default) before SIGKILL: training saves at the next step boundary and exits;
  * both job output files (``slurm-<jobid>.out`` / ``.err`` in the folder) are appended to across restarts
    (``--open-mode=append``); ``SLURM_RESTART_COUNT`` in the job's environment counts the restarts.

Names are never reused by accident: a name whose folder exists is refused unless ``--resume`` is given (the new
script is then ``submit.2.sbatch``, ``submit.3.sbatch``, ...; nothing is overwritten). When ``sbatch`` fails, its
error is printed and everything this invocation created is removed (never what existed before), so the same
command can be run again. For grids of short runs use Hydra's submitit launcher instead:
``python train.py -m hydra/launcher=slurm ...`` (conf/hydra/launcher/slurm.yaml, slurm_cpu.yaml; docs/slurm.md).

Nothing is injected into the batch script: every value written into it is checked as a whole before anything is
written (``--partition``, ``--account``, ``--qos``: letters, digits, ``_ - .``; ``--name``: also ``+``; ``--mem``,
``--time``, ``--signal`` and the integers in sbatch's grammar; ``--log-dir`` and ``--python``: letters, digits,
spaces and ``/ _ . - + @ :``, no space at the end; overrides: no control characters, and none of the keys the
launcher sets itself -- ``run_name``, ``ckpt_path``, ``paths.log_dir``, ``trainer.num_nodes`` / ``accelerator`` /
``devices``, ``callbacks.preemption.signal_name`` --, which the job would silently replace). The output paths are
double-quoted in ``#SBATCH --output="..."`` (sbatch's own parser groups quoted characters; ``%`` would start a
file name pattern, hence refused), and the ``cd`` and ``srun`` lines are shell-quoted (``shlex.quote``).

Exit codes: 0 submitted (or printed); 2 a bad flag or an existing name (the message names the flag, the value and
what is allowed); otherwise sbatch's exit code.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Signals the warning may use: the names sbatch's --signal knows (Slurm's sig_name2num) that the Preemption
# callback can catch and that mean nothing else to the job (TERM, KILL, STOP, CONT and the tty signals do).
SIGNALS = ("USR1", "USR2", "HUP", "ALRM", "URG")
MEM_RE = re.compile(r"[1-9][0-9]*[KMGT]?")
TIME_RE = re.compile(r"\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?|\d+(:\d{1,2}(:\d{1,2})?)?|UNLIMITED|INFINITE")
# Every value written into the batch script matches one of these as a whole (re.fullmatch: a trailing newline
# never passes, as it would with `$`). SLURM names (partition, account, QOS): letters, digits, _ - . . Paths (log dir,
# interpreter): letters, digits, spaces and / _ . - + @ : , so that each can be written as it is into
# `#SBATCH --output="..."` (sbatch's own parser: inside double quotes only `"` and `\` are special, `%` starts a
# file name pattern such as %j, a newline ends the line) and into the override `paths.log_dir=...` (Hydra's
# unquoted value: no quotes, brackets, commas, `$`, `#`, `=`; leading and trailing spaces stripped).
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
PATH_RE = re.compile(r"[A-Za-z0-9/_.+@:-]([A-Za-z0-9 /_.+@:-]*[A-Za-z0-9/_.+@:-])?")
NAME_ALLOWED = "a SLURM name: letters, digits and _ - ."
PATH_ALLOWED = (
    "a path of letters, digits, spaces and / _ . - + @ : (no space at either end; it is written into "
    "#SBATCH --output and the paths.log_dir override)"
)


class UsageError(Exception):
    """A flag value launch.py refuses; the message names the flag, the value and what is allowed."""

    def __init__(self, flag: str, value, allowed: str):
        super().__init__(f"{flag}={value!r}; allowed: {allowed}")


def parse_signal(value: str) -> tuple[str, int]:
    """``"USR2@120"`` -> ``("USR2", 120)``: a signal from :data:`SIGNALS` (``SIG`` prefix optional, any case) and
    whole seconds 1..65535 before the time limit (sbatch's ``--signal`` takes 0..65535; 0 would leave no time).
    Raises :class:`UsageError` naming ``--signal``."""
    allowed = f"SIG@SECONDS with SIG one of {', '.join(SIGNALS)} and SECONDS an integer 1..65535, e.g. USR2@120"
    m = re.fullmatch(r"(?:SIG)?([A-Za-z0-9]+)@(\d+)", value.strip(), flags=re.IGNORECASE)
    if not m or m.group(1).upper() not in SIGNALS or not 1 <= int(m.group(2)) <= 65535:
        raise UsageError("--signal", value, allowed)
    return m.group(1).upper(), int(m.group(2))


def default_python() -> str:
    """The interpreter the job runs: this one when it can import canonlm (the launcher runs in the project's
    environment), else ``<repo>/.venv/bin/python`` (``scripts/setup.sh`` makes it). Not resolved through
    symlinks: a venv's ``bin/python`` is a symlink and only that path selects the venv."""
    if importlib.util.find_spec("canonlm") is not None:
        return os.path.abspath(sys.executable)
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else os.path.abspath(sys.executable)


def check(args: argparse.Namespace) -> None:
    """Validate the flags (before anything is written): every value that goes into the batch script has its
    grammar (integers; ``--mem``, ``--time``, ``--signal`` as sbatch takes them; ``--name``, ``--partition``,
    ``--account``, ``--qos`` as SLURM names; ``--log-dir`` and ``--python`` as :data:`PATH_RE` paths); raises
    :class:`UsageError` naming the first bad flag, its value and what is allowed. Fills ``args.signal_name``,
    ``args.signal_s`` and the default of ``args.tasks_per_node``; makes ``args.log_dir`` absolute (the job runs
    from the repository root, the launcher from anywhere)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", args.name or ""):
        raise UsageError("--name", args.name, "letters, digits and _ . + - (it names the job and the run dir)")
    if args.nodes < 1:
        raise UsageError("--nodes", args.nodes, "an integer >= 1")
    if args.gpus_per_node < 0:
        raise UsageError("--gpus-per-node", args.gpus_per_node, "an integer >= 0 (0: a CPU job)")
    if args.tasks_per_node is None:
        args.tasks_per_node = args.gpus_per_node or 1
    if args.tasks_per_node < 1:
        raise UsageError("--tasks-per-node", args.tasks_per_node, "an integer >= 1")
    if args.gpus_per_node and args.tasks_per_node != args.gpus_per_node:
        raise UsageError(
            "--tasks-per-node",
            args.tasks_per_node,
            f"{args.gpus_per_node} (= --gpus-per-node: one task per GPU, as Lightning requires), or "
            f"--gpus-per-node 0 for a CPU job",
        )
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise UsageError("--cpus-per-task", args.cpus_per_task, "an integer >= 1 (or leave it out: SLURM's default)")
    if args.mem is not None and not MEM_RE.fullmatch(args.mem):
        raise UsageError(
            "--mem",
            args.mem,
            "memory per node as sbatch takes it: a positive integer with an "
            "optional unit K, M, G or T (megabytes without one), e.g. 4G",
        )
    if not TIME_RE.fullmatch(args.time):
        raise UsageError(
            "--time",
            args.time,
            "a SLURM time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 1-00:00:00",
        )
    args.signal_name, args.signal_s = parse_signal(args.signal)
    for flag in ("partition", "account", "qos"):
        value = getattr(args, flag)
        if value is not None and not NAME_RE.fullmatch(value):
            raise UsageError(f"--{flag}", value, NAME_ALLOWED)
    args.log_dir = os.path.abspath(args.log_dir)  # checked as written: the working folder becomes part of it
    for flag in ("log_dir", "python"):
        if not PATH_RE.fullmatch(getattr(args, flag)):
            raise UsageError(f"--{flag.replace('_', '-')}", getattr(args, flag), PATH_ALLOWED)


# keys the launcher sets itself (run_overrides); a user override of one would be silently replaced in the job
SET_BY_LAUNCHER = {
    "run_name": "--name",
    "ckpt_path": "auto: the job resumes its own run; to continue a run at another size resubmit its --name with "
    "--resume and new --tasks-per-node / --gpus-per-node; to start from another run's weights pass "
    "init_from=<checkpoint>",
    "paths.log_dir": "--log-dir",
    "trainer.num_nodes": "--nodes",
    "trainer.accelerator": "--gpus-per-node (0: cpu)",
    "trainer.devices": "--gpus-per-node / --tasks-per-node",
    "callbacks.preemption.signal_name": "--signal",
}


def check_overrides(overrides: list[str]) -> None:
    """The training overrides go into the script's ``srun`` line shell-quoted (``shlex.quote``), so any character
    is safe there but a control character (a newline would split the script's ``srun`` line; no Hydra override
    has one); a key the launcher sets itself (:data:`SET_BY_LAUNCHER`: ``run_name``, ``ckpt_path``, ...) would be
    replaced in the job, so it is refused too. Raises :class:`UsageError` naming the first such override."""
    for o in overrides:
        if any(ord(c) < 32 or ord(c) == 127 for c in o):
            raise UsageError("override", o, "a Hydra override without control characters (newline, tab, ...)")
        key, _, val = o.partition("=")
        key = key.lstrip("+~")
        if key in SET_BY_LAUNCHER:
            raise UsageError("override", o, f"no {key}: the launcher sets it ({SET_BY_LAUNCHER[key]})")
        if key in ("callbacks", "callbacks.preemption") and (o.startswith("~") or val in ("none", "null", "~")):
            raise UsageError(
                "override",
                o,
                "the preemption callback kept: the job saves and requeues itself through "
                "it (callbacks.preemption.signal_name is set by --signal)",
            )


def run_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The command-line overrides of ``train.py`` in the job: the user's, then the launcher's (later ones win)."""
    accel, devices = ("gpu", args.gpus_per_node) if args.gpus_per_node else ("cpu", args.tasks_per_node)
    return [
        *overrides,
        f"run_name={args.name}",
        "ckpt_path=auto",
        f"trainer.num_nodes={args.nodes}",
        f"trainer.accelerator={accel}",
        f"trainer.devices={devices}",
        f"callbacks.preemption.signal_name=SIG{args.signal_name}",
        f"paths.log_dir={args.log_dir}",
    ]


def render(args: argparse.Namespace, overrides: list[str]) -> str:
    """The sbatch script text for these arguments (depends on ``args`` and ``overrides`` only). Runs :func:`check`
    first (idempotent; raises :class:`UsageError`). Lines: job name, nodes, ``--ntasks-per-node``,
    ``--gpus-per-node`` (GPU jobs only), ``--cpus-per-task`` and ``--mem`` (only when given), ``--time``,
    ``--signal``, ``--requeue``, ``--open-mode=append``, output files, partition/account/qos (when given); then
    ``cd <repo root>`` and ``srun [--cpus-per-task=N] <python> train.py <overrides>`` (since Slurm 22.05 srun
    does not inherit ``--cpus-per-task`` from sbatch, so it is repeated)."""
    check(args)
    check_overrides(overrides)
    out = Path(args.log_dir) / "slurm" / args.name
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={args.name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.tasks_per_node}",
    ]
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    if args.mem is not None:
        lines.append(f"#SBATCH --mem={args.mem}")
    lines += [
        f"#SBATCH --time={args.time}",
        f"#SBATCH --signal={args.signal_name}@{args.signal_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f'#SBATCH --output="{out}/slurm-%j.out"',
        f'#SBATCH --error="{out}/slurm-%j.err"',
    ]
    lines += [
        f"#SBATCH --{k}={v}"
        for k, v in (("partition", args.partition), ("account", args.account), ("qos", args.qos))
        if v
    ]
    srun = ["srun"] + ([f"--cpus-per-task={args.cpus_per_task}"] if args.cpus_per_task is not None else [])
    cmd = [*srun, args.python, "train.py", *run_overrides(args, overrides)]
    lines += [
        "",
        'echo "[launch] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST $(date -Is)"',
        "export WANDB_MODE=${WANDB_MODE:-offline}",
        f"cd {shlex.quote(str(ROOT))}",
        " ".join(shlex.quote(c) for c in cmd),
        "",
    ]
    return "\n".join(lines)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` at ``--`` into launcher flags and training overrides; parse the flags (not checked yet)."""
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    else:
        overrides = []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="run name = job name = run dir name (stable across requeues)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, one task each; 0: a CPU job")
    ap.add_argument(
        "--tasks-per-node",
        type=int,
        default=None,
        help="ranks per node (default: --gpus-per-node, or 1 for a CPU job; CPU jobs only may differ)",
    )
    ap.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per rank (default: left to SLURM)")
    ap.add_argument("--mem", default=None, help="memory per node, e.g. 64G (default: left to SLURM)")
    ap.add_argument("--time", default="1-00:00:00", help="time limit of each run of the job (default 1 day)")
    ap.add_argument(
        "--signal",
        default="USR2@120",
        help="warning signal and seconds before the time limit: save, requeue (default USR2@120)",
    )
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--qos")
    ap.add_argument("--log-dir", default=str(ROOT / "logs"), help="paths.log_dir of the run (default <repo>/logs)")
    ap.add_argument(
        "--python",
        default=None,
        help="interpreter of the job (default: this one if it has canonlm, else <repo>/.venv/bin/python)",
    )
    ap.add_argument("--resume", action="store_true", help="allow an existing name (the job resumes its run)")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    args = ap.parse_args(argv)
    if args.python is None:
        args.python = default_python()
    return args, overrides


def _new_script_path(out: Path) -> Path:
    path = out / "submit.sbatch"
    k = 2
    while path.exists():
        path, k = out / f"submit.{k}.sbatch", k + 1
    return path


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        check(args)
        check_overrides(overrides)
    except UsageError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2
    script = render(args, overrides)
    if args.dry_run:
        print(script)
        return 0
    out = Path(args.log_dir) / "slurm" / args.name
    if out.exists() and not args.resume:
        print(
            f"launch: error: --name={args.name!r}: {out} exists; pass --resume to continue that run or choose "
            f"another --name",
            file=sys.stderr,
        )
        return 2
    if shutil.which("sbatch") is None:
        print("launch: error: sbatch not found on PATH (is this a SLURM login node?)", file=sys.stderr)
        return 2
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # topmost new folder
    out.mkdir(parents=True, exist_ok=True)
    path = _new_script_path(out)
    path.write_text(script)
    r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        print(
            f"launch: error: sbatch failed (exit {r.returncode}); nothing is left behind:\n"
            f"{(r.stderr or r.stdout).strip()}",
            file=sys.stderr,
        )
        return r.returncode
    job = r.stdout.strip().split(";")[0]
    print(job)
    print(f"launch: submitted job {job} ({args.name}): script {path}, output {out}/slurm-{job}.out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
