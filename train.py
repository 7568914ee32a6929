"""Train (and evaluate) a model on a task: ``python train.py [group=option ...] [key=value ...]``.

Examples:
    python train.py                                            # tiny Llama + Canon-ABCD on scaled-down Depo1 (CPU)
    python train.py arch=llama canon=ABCD pos=nope task=depo1 model.size=12L768D
    python train.py experiment=depo1_N375 canon=ABCD pos=rope  # a paper preset (GPU)
    python train.py -m canon=none,ABCD pos=rope,nope           # a sweep (Hydra multirun)
Config tree: conf/ (see README). Bad values stop the run before anything is built or written, with one message
naming the key, the value and what is allowed (exit code 2). A run stopped early with its checkpoint saved exits
with 0 (requeued itself on SLURM's warning signal), 143 (SIGTERM) or 3 (non-finite steps).
"""

import sys

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
    except ConfigError as e:
        print(f"canonlm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RunStopped as e:  # preempted (0: requeued, 143: SIGTERM) or non-finite steps (3); last.ckpt saved
        print(f"canonlm: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
