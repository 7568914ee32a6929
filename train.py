"""Train (and evaluate) a model on a task: ``python train.py [group=option ...] [key=value ...]``.

Examples:
    python train.py                                            # tiny Llama + Canon-ABCD on scaled-down Depo1 (CPU)
    python train.py arch=llama canon=ABCD pos=nope task=depo1 model.size=12L768D
    python train.py experiment=depo1_N375 canon=ABCD pos=rope  # a paper preset (GPU)
    python train.py -m canon=none,ABCD pos=rope,nope           # a sweep (Hydra multirun)
Config tree: conf/ (see README). Bad values stop the run before anything is built, with one message naming the
key, the value and what is allowed.
"""

import sys

import hydra
from omegaconf import DictConfig

from canonlm.train.resolvers import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig):
    from canonlm.arch.config import ConfigError
    from canonlm.train.run import main as run_main

    try:
        return run_main(cfg)
    except ConfigError as e:
        print(f"canonlm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
