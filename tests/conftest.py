"""Shared fixtures: config composition (lightning-hydra-template style), temp run dirs, offline wandb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED = ROOT.parent / "shared" / "data" / "physicslm4"

os.environ.setdefault("WANDB_MODE", "disabled")

# Hydra arch presets as plain dicts (the same keys as conf/arch/*.yaml; test_configs checks the YAMLs compose).
ARCH_PRESETS = {
    "llama": dict(arch="llama"),
    "gla": dict(arch="gla", expand_k=0.5, expand_v=1.0),
    "gla5": dict(
        arch="gla",
        expand_k=1.0,
        expand_v=2.0,
        output_gate_rank=16,
        ffn_ratio=2.0,
        init="linear_0.02_split",
        key_head_dim=128,
    ),
    "gdn": dict(arch="gdn", expand_k=0.75, expand_v=1.5, ffn_ratio=2.0),
    "gdn2": dict(
        arch="gdn",
        expand_k=1.0,
        expand_v=2.0,
        output_gate_rank=16,
        ffn_ratio=2.0,
        init="linear_0.02_split",
        key_head_dim=128,
    ),
    "mamba2": dict(arch="mamba2", ffn_ratio=2.0, init="mamba2_default", norm_eps=1e-5),
    "mamba2_nomlp": dict(arch="mamba2", mlp="none", n_layers_factor=2, init="mamba2_default", norm_eps=1e-5),
}


def perturb_(model) -> None:
    """In place, without autograd: norm gains += 0.3 N(0, 1) and Canon taps x 2, so that a conversion that drops or
    mixes up a norm gain or a Canon layer changes the logits (default init: gains 1, small taps)."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            elif "canon" in n:
                p.mul_(2.0)


def compose(overrides: list[str] | None = None, output_dir: str | os.PathLike | None = None):
    """Compose conf/train.yaml with overrides (as `python train.py <overrides>` would) and return the DictConfig.

    Hydra-runtime interpolations (paths) are replaced by `output_dir` (default: a throwaway folder name).
    """
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from canonlm.config.resolvers import register_resolvers

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


@pytest.fixture(autouse=True)
def _grad_mode_is_left_on():
    """Every test leaves autograd as it found it (on): a test that ends with grad mode off would make later tests in
    its worker process fail far from the cause ("element 0 of tensors does not require grad"). The culprit fails
    here, by name, and the mode is restored for the tests after it."""
    yield
    import torch

    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("this test left torch's grad mode off (torch.set_grad_enabled(False) or inference mode)")


@pytest.fixture(scope="session", autouse=True)
def _session_kernel_cache(tmp_path_factory):
    """The kernel cache of the test session (``CANONLM_KERNEL_CACHE``, which in-process runs and every subprocess
    inherit): Triton's and inductor's caches of the tests go to a directory of this session, not to the user's
    ``~/.cache/canonlm/kernels`` (tests of the cache itself set their own)."""
    d = tmp_path_factory.mktemp("kernel-cache")
    old = os.environ.get("CANONLM_KERNEL_CACHE")
    os.environ["CANONLM_KERNEL_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("CANONLM_KERNEL_CACHE", None)
    else:
        os.environ["CANONLM_KERNEL_CACHE"] = old


@pytest.fixture
def compose_cfg():
    return compose


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads these marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs): keep together what must not be split or
    repeated across workers. Tests on the one-node SLURM cluster share one group (one cluster, started once); tests
    that use an expensive module- or session-scoped fixture of this folder (a trained run, the interpreter tier's
    results) share their module's group, so that fixture is built once, not once per worker."""
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        for name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name) if info else None
            if not defs or defs[-1].scope not in ("module", "session"):
                continue
            src = getattr(defs[-1].func, "__code__", None)
            if src and Path(src.co_filename).resolve().parent == tests_dir:
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
                break
