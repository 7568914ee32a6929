"""The machine the self-check runs on: the versions table of the report, and whether each fast backend can run here
(its library installed, importable, and accepted by the op's backend resolution)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from canonlm.errors import ConfigError
from canonlm.selfcheck.numerics import dtype_name
from canonlm.selfcheck.verdict import FAIL, SKIP, Skip, short

NO_CUDA = "no CUDA"
NO_CUDA_MESSAGE = "no CUDA device: GPU kernels and GPU training cannot be checked here"
ROOT = Path(__file__).resolve().parents[3]  # the checkout (train.py, conf/) for an editable install

#: Distributions whose versions the report lists (first installed name wins for each row).
LIBRARIES = (("lightning", ("lightning",)), ("triton", ("triton", "pytorch-triton")),
             ("fla-core", ("fla-core", "flash-linear-attention")), ("flash-attn", ("flash-attn",)),
             ("causal-conv1d", ("causal-conv1d",)), ("mamba-ssm", ("mamba-ssm",)))

_FLA = ("fla-core", "flash-linear-attention")
#: Fast backend -> (required distributions, each a tuple of alternative names; modules its import needs).
FAST_LIBS = {
    ("canon", "dao"): ((("causal-conv1d",),), ("causal_conv1d",)),
    ("canon", "fla"): ((_FLA,), ("fla.modules",)),
    ("attention", "flash"): ((("flash-attn",),), ("flash_attn",)),
    ("gla", "fla"): ((_FLA,), ("fla.ops.gla",)),
    ("gdn", "fla"): ((_FLA,), ("fla.ops.gated_delta_rule",)),
    ("ssd", "mamba_ssm"): ((("mamba-ssm",),), ("mamba_ssm.ops.triton.ssd_combined",)),
    ("ssd", "split"): ((("mamba-ssm",), ("causal-conv1d",)), ("mamba_ssm.ops.triton.ssd_combined", "causal_conv1d")),
}


def dist_version(names) -> Optional[str]:
    """Version of the first installed distribution among ``names`` (``"fla-core"``...), or None."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> list[tuple[str, str]]:
    """``[(component, version or "not installed")]``: Python, torch, CUDA, GPUs, canonlm and the optional kernels."""
    import torch

    rows = [("python", platform.python_version()), ("platform", platform.platform()), ("torch", torch.__version__),
            ("CUDA (torch build)", str(torch.version.cuda) if torch.version.cuda else "none (CPU build)")]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"))
        cudnn = torch.backends.cudnn.version()
        rows.append(("cuDNN", str(cudnn) if cudnn else "none"))
    else:
        rows.append(("GPU", "none visible (torch.cuda.is_available() is False)"))
    rows.append(("canonlm", f"{dist_version(['canonlm']) or 'not installed'} (git {_git_rev()})"))
    for label, names in LIBRARIES:
        rows.append((label, dist_version(names) or "not installed"))
    return rows


def _git_rev() -> str:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return "unknown"
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        rev = p.stdout.strip() or "unknown"
        d = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
        return rev + ("+modified" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve(op: str, name: str, device, dtype) -> str:
    """``canonlm.ops.<op>.resolve_backend(name, device, dtype)``: the backend ``name`` of ``op`` becomes there."""
    mod = importlib.import_module(f"canonlm.ops.{op}")
    return mod.resolve_backend(name, device, dtype)


def fast_unavailable(op: str, fast: str, device, dtype) -> Optional[tuple[str, str]]:
    """None when backend ``fast`` of ``op`` can run on (device, dtype); else ``(SKIP | FAIL, reason)``: SKIP when its
    library is not installed or refuses this dtype, FAIL when it is installed but its import fails (a broken
    build, e.g. compiled against another torch)."""
    dists, modules = FAST_LIBS[(op, fast)]
    missing = [alts[0] for alts in dists if dist_version(alts) is None]
    if missing:
        return SKIP, f"{', '.join(missing)} not installed"
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 -- ImportError, OSError (undefined symbol), Triton driver errors
            return FAIL, f"installed but `import {module}` fails: {type(e).__name__}: {short(str(e), 200)}"
    try:
        resolve(op, "mamba_ssm" if fast == "split" else fast, device, dtype)
    except ConfigError as e:
        return SKIP, f"{fast} refuses {device}/{dtype_name(dtype)}: {short(e.allowed, 200)}"
    return None


def preload() -> list[str]:
    """Import every fast library's modules (:data:`FAST_LIBS`) that import here, so that a worker's start-up, not
    its first line, pays for them (fla imports every kernel module, several seconds). Errors are ignored: the lines
    report them. Returns the modules imported."""
    done = []
    for _, modules in FAST_LIBS.values():
        for module in modules:
            try:
                importlib.import_module(module)
                done.append(module)
            except Exception:  # noqa: BLE001 -- missing or broken: the kernel lines say which and why
                continue
    return done


def need_cuda(device: str) -> None:
    """Skip (``no CUDA``) a check meant for a CUDA ``device`` when CUDA is not available."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise Skip(NO_CUDA)
