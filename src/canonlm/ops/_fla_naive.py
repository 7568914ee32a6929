"""Load fla's pure-PyTorch ``naive.py`` reference modules as *test oracles and benchmark baselines* only.

fla-core's ``fla/ops/__init__.py`` imports every Triton kernel, so ``import fla.ops.gla.naive`` fails on a machine
without triton. The ``naive.py`` files themselves need only torch (and einops), so they
are loaded here by file path from the installed ``fla`` package, without importing ``fla.ops``. Nothing in canonlm's
model code calls them; they are the second, external oracle beside canonlm's own plain loops
(``canonlm.ops.<op>.naive``).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def load_fla_naive(op: str) -> Optional[ModuleType]:
    """``fla/ops/<op>/naive.py`` as a module (e.g. ``op="gla"``, ``"gated_delta_rule"``, ``"simple_gla"``), or None
    when fla-core is not installed or the file is missing/unloadable (callers skip). Cached per ``op``."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / op / "naive.py"
    if not path.is_file():
        return None
    mspec = importlib.util.spec_from_file_location(f"_canonlm_fla_naive_{op}", path)
    mod = importlib.util.module_from_spec(mspec)
    try:
        mspec.loader.exec_module(mod)
    except Exception:  # noqa: BLE001 -- an fla release whose naive.py imports more than torch/einops
        return None
    return mod


def fla_version() -> Optional[str]:
    """Installed fla-core version string, or None."""
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:  # noqa: BLE001 -- fla-core absent or its metadata unreadable: no version
        return None
