"""The machine the self-check runs on: the versions table of the report, and whether each fast backend can run here
(its library installed, loaded by canonlm's own probe, and accepted by the op's backend resolution). A library that
is not installed, or installed without its compiled CUDA op, makes its lines SKIP with the reason; one that is
installed but does not load otherwise makes them FAIL (:func:`classify_import_failure`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import re
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
LIBRARIES = (
    ("lightning", ("lightning",)),
    ("triton", ("triton", "pytorch-triton")),
    ("fla-core", ("fla-core", "flash-linear-attention")),
    ("flash-attn", ("flash-attn",)),
    ("causal-conv1d", ("causal-conv1d",)),
    ("mamba-ssm", ("mamba-ssm",)),
)

_FLA = ("fla-core", "flash-linear-attention")

#: The compiled CUDA extension module(s) each optional distribution's Python code imports, read from their sources:
#: causal-conv1d 1.6.2.post1 ``causal_conv1d/cpp_functions.py`` line 5 ``import causal_conv1d_cuda`` (reached from
#: the package ``__init__`` through ``causal_conv1d_interface.py``); mamba-ssm 2.3.1
#: ``mamba_ssm/ops/selective_scan_interface.py`` line 20 ``import selective_scan_cuda`` (reached from the package
#: ``__init__``); flash-attn 2.x ``flash_attn/flash_attn_interface.py`` line 15 ``import flash_attn_2_cuda as
#: flash_attn_gpu``. fla-core has none (Triton only). A ``ModuleNotFoundError`` naming one of these, with no such
#: module on the path, is an install built without its CUDA op (``*_SKIP_CUDA_BUILD=TRUE``, as
#: ``scripts/wheelhouse.sh`` and ``scripts/setup.sh`` build them where no nvcc or prebuilt wheel is at hand).
CUDA_EXTENSIONS = {
    "causal-conv1d": ("causal_conv1d_cuda",),
    "mamba-ssm": ("selective_scan_cuda",),
    "flash-attn": ("flash_attn_2_cuda",),
}
#: The variable that makes each distribution's ``setup.py`` compile its CUDA op with nvcc instead of downloading a
#: prebuilt wheel (docs/gpu.md, "No prebuilt wheel: compiling").
FORCE_BUILD = {
    "causal-conv1d": "CAUSAL_CONV1D_FORCE_BUILD",
    "mamba-ssm": "MAMBA_FORCE_BUILD",
    "flash-attn": "FLASH_ATTENTION_FORCE_BUILD",
}
#: ``ModuleNotFoundError``'s own message (``No module named 'x'``), as the ops' probes keep it: ``<type>: <message>``.
_NOT_FOUND = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z0-9_.]+)'")


def _probe_dao():
    from canonlm.ops.canon import _cuda

    return _cuda.dao_functions()[1]


def _probe_fla_conv():
    from canonlm.ops.canon import _cuda

    return _cuda.fla_functions()[1]


def _probe_flash():
    from canonlm.ops.attention import flash_available

    if flash_available():
        return None
    try:  # canonlm's probe answers a bool: import again only to say why (the same import, already failed once)
        from flash_attn import flash_attn_func  # noqa: F401 -- imported to check that flash-attn loads
    except Exception as e:  # noqa: BLE001 -- ImportError, OSError (undefined symbol), RuntimeError
        return e
    return "flash_attn imports now, but canonlm.ops.attention.flash_available() found it unavailable"


def _probe_gla():
    from canonlm.ops.gla import _fla

    return _fla.fla_functions()[1]


def _probe_gdn():
    from canonlm.ops.gdn import _fla

    return _fla.functions()[1]


def _probe_ssd():
    from canonlm.ops.ssd import _mamba

    return _mamba.chunk_scan_function()[1]


#: Fast backend -> ``((required distributions as alternative names, canonlm probe), ...)``. Each probe is the loader
#: the op itself uses (``canonlm.ops.canon._cuda.dao_functions`` / ``fla_functions``,
#: ``canonlm.ops.attention.flash_available``, ``canonlm.ops.gla._fla.fla_functions``,
#: ``canonlm.ops.gdn._fla.functions``, ``canonlm.ops.ssd._mamba.chunk_scan_function``) and returns None when it
#: loads, else its error (the probe's ``"<Error>: <message>"`` or the exception). ``split``: the SSD kernels and
#: causal-conv1d's C++ op, which ``mamba_split_conv1d_scan_combined`` calls for its conv.
FAST_PROBES = {
    ("canon", "dao"): ((("causal-conv1d",), _probe_dao),),
    ("canon", "fla"): ((_FLA, _probe_fla_conv),),
    ("attention", "flash"): ((("flash-attn",), _probe_flash),),
    ("gla", "fla"): ((_FLA, _probe_gla),),
    ("gdn", "fla"): ((_FLA, _probe_gdn),),
    ("ssd", "mamba_ssm"): ((("mamba-ssm",), _probe_ssd),),
    ("ssd", "split"): ((("mamba-ssm",), _probe_ssd), (("causal-conv1d",), _probe_dao)),
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

    rows = [
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("CUDA (torch build)", str(torch.version.cuda) if torch.version.cuda else "none (CPU build)"),
    ]
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
        p = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        rev = p.stdout.strip() or "unknown"
        d = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return rev + ("+modified" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve(op: str, name: str, device, dtype) -> str:
    """``canonlm.ops.<op>.resolve_backend(name, device, dtype)``: the backend ``name`` of ``op`` becomes there."""
    mod = importlib.import_module(f"canonlm.ops.{op}")
    return mod.resolve_backend(name, device, dtype)


def missing_cuda_op(error) -> Optional[tuple[str, str]]:
    """``(distribution, extension module)`` when ``error`` says an installed distribution lacks its compiled CUDA op,
    else None.

    ``error`` is what an import probe kept: the exception, or its ``"<Error>: <message>"`` string
    (:func:`canonlm.ops._dispatch.probe`). It qualifies only when it is, as a whole, Python's ``ModuleNotFoundError:
    No module named '<ext>'`` (a message with more in it -- an error chained from another, a wrapper's sentence -- is
    something else), ``<ext>`` is one of :data:`CUDA_EXTENSIONS`, its distribution is installed
    (``importlib.metadata``), and no module of that name is on the path now (``importlib.util.find_spec``: a module
    that exists but fails to load raises ``ImportError`` / ``OSError``, never this)."""
    if isinstance(error, BaseException):
        name = error.name if type(error) is ModuleNotFoundError else None
    else:
        m = _NOT_FOUND.fullmatch(" ".join(str(error).split()))
        name = m.group(1) if m else None
    if not name:
        return None
    dist = next((d for d, exts in CUDA_EXTENSIONS.items() if name in exts), None)
    if dist is None or dist_version([dist]) is None:
        return None
    try:
        if importlib.util.find_spec(name) is not None:
            return None
    except (ImportError, ValueError):  # a sys.modules entry without a spec: not a plain absent module
        return None
    return dist, name


def cuda_op_hint(dist: str, ext: str) -> str:
    """The one-line SKIP reason of a distribution installed without its CUDA op: what is missing and how to get it
    (docs/gpu.md: the prebuilt wheel through ``scripts/setup.sh cuda``, or an nvcc build)."""
    version = dist_version([dist])
    pin = f"=={version}" if version else ""
    return (
        f"{dist} installed without its CUDA op ({ext}): install its CUDA build for this torch (`bash "
        f"scripts/setup.sh cuda` where GitHub is reachable, or with nvcc `{FORCE_BUILD[dist]}=TRUE pip install "
        f"--no-build-isolation --no-cache-dir --no-deps {dist}{pin}`; docs/gpu.md)"
    )


def classify_import_failure(dist: str, error) -> tuple[str, str]:
    """Verdict of a fast library whose import probe failed although ``dist`` is installed.

    Returns:
        ``(SKIP, reason)`` when :func:`missing_cuda_op` recognises an install without its compiled CUDA op (the
        reason from :func:`cuda_op_hint`: which module, how to get it); ``(FAIL, reason)`` for anything else -- an
        extension that exists but does not load (``ImportError`` / ``OSError`` "undefined symbol": built against
        another torch), a missing Python dependency, an error raised inside the package.
    """
    found = missing_cuda_op(error)
    if found is not None:
        return SKIP, cuda_op_hint(*found)
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return FAIL, f"{dist} is installed but does not load: {short(text, 240)}"


def fast_unavailable(op: str, fast: str, device, dtype) -> Optional[tuple[str, str]]:
    """None when backend ``fast`` of ``op`` can run on (device, dtype); else ``(SKIP | FAIL, reason)``.

    Availability is canonlm's own (:data:`FAST_PROBES`: the loaders the ops call, then the op's
    ``resolve_backend``), never a direct import of a library module, so that the self-check sees what the ops see
    (mamba-ssm's Triton SSD kernels load without its package ``__init__``, :mod:`canonlm.ops.ssd._mamba`).
    SKIP: a required distribution is not installed; one is installed without its compiled CUDA op
    (:func:`classify_import_failure`; e.g. the fused ``split`` without causal-conv1d's C++ op while the SSD kernels
    run); the op refuses this device / dtype. FAIL: a distribution is installed but its probe fails otherwise (a
    broken build, e.g. an extension compiled against another torch)."""
    entries = FAST_PROBES[(op, fast)]
    missing = [alts[0] for alts, _ in entries if dist_version(alts) is None]
    if missing:
        return SKIP, f"{', '.join(dict.fromkeys(missing))} not installed"
    for alts, probe_fn in entries:
        error = probe_fn()
        if error is not None:
            dist = next(d for d in alts if dist_version([d]) is not None)
            return classify_import_failure(dist, error)
    try:
        resolve(op, "mamba_ssm" if fast == "split" else fast, device, dtype)
    except ConfigError as e:
        return SKIP, f"{fast} refuses {device}/{dtype_name(dtype)}: {short(e.allowed, 200)}"
    return None


def preload() -> list[str]:
    """Run every fast backend's probe (:data:`FAST_PROBES`), so that a worker's start-up, not its first line, pays
    for the libraries' imports (fla imports every kernel module, several seconds). Failures are ignored here: the
    lines report them. Returns the ``op/backend`` names whose probes loaded."""
    done = []
    for (op, fast), entries in FAST_PROBES.items():
        try:
            if all(probe_fn() is None for _, probe_fn in entries):
                done.append(f"{op}/{fast}")
        except Exception:  # noqa: BLE001 -- a probe is not expected to raise; a line reports whatever does
            continue
    return done


def need_cuda(device: str) -> None:
    """Skip (``no CUDA``) a check meant for a CUDA ``device`` when CUDA is not available."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise Skip(NO_CUDA)
