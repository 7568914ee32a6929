"""Shared fixtures: config composition (lightning-hydra-template style), temp run dirs, offline wandb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED = ROOT.parent / "shared" / "data" / "physicslm4"

os.environ.setdefault("WANDB_MODE", "disabled")


def compose(overrides: list[str] | None = None, output_dir: str | os.PathLike | None = None):
    """Compose conf/train.yaml with overrides (as `python train.py <overrides>` would) and return the DictConfig.

    Hydra-runtime interpolations (paths) are replaced by `output_dir` (default: a throwaway folder name).
    """
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from canonlm.train.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hcompose(config_name="train", overrides=list(overrides or []), return_hydra_config=False)
    with open_dict(cfg):
        cfg.paths.root_dir = str(ROOT)
        cfg.paths.log_dir = str(Path(output_dir or "/tmp/canonlm-test") / "logs")
        cfg.paths.output_dir = str(output_dir or "/tmp/canonlm-test/run")
        cfg.run_name = "test"
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture
def compose_cfg():
    return compose
