"""Submit one long training run to SLURM with save-and-requeue (lingua's stool idea, written for canonlm).

    python slurm/launch.py --name depo1_canon --nodes 1 --gpus-per-node 8 --time 2-00:00:00 \
        --partition learn -- experiment=depo1_N375 canon=ABCD pos=nope

What it does: renders ``<log_dir>/slurm/<name>/submit.sbatch`` (one task per GPU, ``--signal=USR2@120``,
``--requeue``, ``--open-mode=append``), and runs ``sbatch`` on it (``--dry-run``: print it and stop). The job runs
``srun python train.py <overrides> run_name=<name> ckpt_path=auto trainer.num_nodes=.. trainer.devices=..``:
the run dir is fixed by the name, so a requeued job (after preemption or timeout, see
canonlm.train.callbacks.Preemption) resumes from ``last.ckpt``. For grids of short runs use Hydra's submitit
launcher instead: ``python train.py -m hydra/launcher=slurm ...`` (conf/hydra/launcher/slurm.yaml).
Refuses to reuse a name whose folder exists unless --resume is given (nothing is overwritten).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={gpus}
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}/slurm-%j.out
#SBATCH --error={out}/slurm-%j.err
{extra}
export WANDB_MODE=${{WANDB_MODE:-offline}}
cd {root}
srun {python} train.py {overrides}
"""


def render(args: argparse.Namespace, overrides: list[str]) -> str:
    """The sbatch script text for these arguments (pure function; tested by tests/test_slurm.py)."""
    out = Path(args.log_dir) / "slurm" / args.name
    extra = "\n".join(f"#SBATCH --{k}={v}" for k, v in
                      (("partition", args.partition), ("account", args.account), ("qos", args.qos)) if v)
    ov = [*overrides, f"run_name={args.name}", "ckpt_path=auto", f"trainer.num_nodes={args.nodes}",
          f"trainer.devices={args.gpus_per_node}", f"paths.log_dir={args.log_dir}"]
    return TEMPLATE.format(name=args.name, nodes=args.nodes, gpus=args.gpus_per_node, cpus=args.cpus_per_task,
                           time=args.time, out=out, extra=extra, root=ROOT, python=args.python,
                           overrides=" ".join(shlex.quote(o) for o in ov))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    else:
        overrides = []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="run name = job name = run dir name (stable across requeues)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cpus-per-task", type=int, default=8)
    ap.add_argument("--time", default="1-00:00:00")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--qos")
    ap.add_argument("--log-dir", default=str(ROOT / "logs"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--resume", action="store_true", help="allow an existing name (the job resumes its run)")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    return ap.parse_args(argv), overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    script = render(args, overrides)
    if args.dry_run:
        print(script)
        return 0
    out = Path(args.log_dir) / "slurm" / args.name
    if out.exists() and not args.resume:
        print(f"launch: error: {out} exists; pass --resume to continue that run or choose another --name",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    path = out / "submit.sbatch"
    path.write_text(script)
    return subprocess.run(["sbatch", str(path)]).returncode


if __name__ == "__main__":
    sys.exit(main())
