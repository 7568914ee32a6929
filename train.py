"""Train (and evaluate) a model on a task: ``python train.py [group=option ...] [key=value ...]``.

Examples:
    python train.py                                            # tiny Llama + Canon-ABCD on scaled-down Depo1 (CPU)
    python train.py arch=llama canon=ABCD pos=nope task=depo1 model.size=12L768D
    python train.py experiment=depo1_N375 canon=ABCD pos=rope  # a paper preset (GPU)
    python train.py -m canon=none,ABCD pos=rope,nope           # a sweep (Hydra multirun)
Config tree: conf/ (see README). Bad input stops the run before anything is built or written, with one line on
stderr, ``canonlm: error: invalid config: <key>=<value>; allowed: <what is allowed>``, and exit code 2: a key
canonlm does not read (with the key that was meant; ``callbacks`` and ``logger`` are the extension points), a bad
value, an unknown group option or a malformed override (Hydra's own errors), an output folder that cannot be
written, a batch that cannot fit in memory. Every job of the command line (each job of a ``-m`` sweep) is composed
and checked as Hydra will run it before Hydra creates any directory (``canonlm.train.run.check_command_line``); the
job checks its config again when it runs (checkpoints, Lightning's own checks). A run stopped early with its
checkpoint saved exits with 0 (requeued itself on SLURM's warning signal), 143 (SIGTERM) or 3 (non-finite steps).
``--estimate`` prints the run's cost instead of running it (``python -m canonlm.estimate``, docs/estimate.md).
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from canonlm.config.resolvers import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig):
    from canonlm.errors import ConfigError, RunStopped
    from canonlm.train.run import main as run_main

    try:
        return run_main(cfg)
    except ConfigError as e:  # refused inside the job (checkpoints, Lightning's own checks): nothing was written
        print(f"canonlm: error: {e}", file=sys.stderr, flush=True)
        remove_untouched_sweep(cfg)
        sys.exit(2)
    except RunStopped as e:  # preempted (0: requeued, 143: SIGTERM) or non-finite steps (3); last.ckpt saved
        print(f"canonlm: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def remove_untouched_sweep(cfg: DictConfig) -> None:
    """In a multirun whose job was refused before writing anything: remove the sweep directory Hydra made for it
    when it holds nothing but Hydra's ``multirun.yaml`` (no job ran there), and its folders left empty up to
    ``paths.log_dir``, so a refused sweep leaves nothing behind either. A sweep with any other file is kept."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        sweep = Path(str(HydraConfig.get().sweep.dir)).resolve()
        stop = Path(str(cfg.paths.log_dir)).resolve().parent
    except Exception:  # noqa: BLE001 -- no sweep to tidy
        return
    if not sweep.is_dir() or {p.name for p in sweep.iterdir()} != {"multirun.yaml"}:
        return
    (sweep / "multirun.yaml").unlink()
    from canonlm.utils.io import remove_empty_dirs

    remove_empty_dirs(sweep, stop)


def check_first() -> None:
    """Compose and check every job of the command line before Hydra runs (and creates directories), as
    ``canonlm.train.run.check_command_line`` does, importing torch only after the checks that need none; a refusal
    is one line on stderr and exit code 2."""
    from canonlm.config.strict import check_light, compose_jobs, runs_jobs
    from canonlm.errors import ConfigError

    try:
        argv = sys.argv[1:]
        if not runs_jobs(argv):
            return
        jobs = compose_jobs(argv, Path(__file__).resolve().parent / "conf", "train")
        for job in jobs:  # before torch is imported: most mistakes are refused in about a second
            with job.active():
                check_light(job)
        from canonlm.train.run import check_jobs

        check_jobs(jobs)
    except ConfigError as e:
        print(f"canonlm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def estimate_instead() -> None:
    """``python train.py <overrides> --estimate [--world-size N] [--gpu NAME] [--mfu X]``: print the run's cost
    (parameters, FLOPs per token, tokens and steps, memory per GPU, GPU-hours; :mod:`canonlm.estimate`) and exit
    without training or writing anything (exit 2 with one line for a config that is refused or does not fit)."""
    argv = [a for a in sys.argv[1:] if a != "--estimate"]
    from canonlm.estimate import main as estimate

    sys.exit(estimate(argv))


if __name__ == "__main__":
    if "--estimate" in sys.argv[1:]:
        estimate_instead()
    check_first()
    main()
