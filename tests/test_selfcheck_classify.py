"""The self-check tells an optional kernel library installed without its compiled CUDA op (SKIP, with the module and
how to get it) from a broken one (FAIL), on real imports.

Each test builds, in ``tmp_path``, the installs a GPU node can have -- packages laid out as the real ones import
their extensions (causal-conv1d 1.6.2.post1: ``__init__`` -> ``causal_conv1d_interface`` -> ``cpp_functions``
line 5 ``import causal_conv1d_cuda``; mamba-ssm 2.3.1: ``__init__`` -> ``ops/selective_scan_interface.py`` line 20
``import selective_scan_cuda``, its Triton SSD kernels in ``ops/triton/ssd_combined.py`` guarding their causal-conv1d
import; flash-attn 2.x: ``flash_attn_interface.py`` line 15 ``import flash_attn_2_cuda``), each with a
``.dist-info`` so that ``importlib.metadata`` sees it installed -- and puts it first on ``PYTHONPATH`` of a fresh
interpreter, which runs the self-check's own probe (``canonlm.selfcheck.environment.fast_unavailable``, and the
kernel lines through ``run_check``) with canonlm's CUDA-device check answering "usable" (no GPU here), so the
verdicts are the ones a GPU node would get. Broken installs are real failures of the loader: a shared object with
an undefined C++ symbol (as an extension built against another torch; compiled here with the C compiler), a file
that is not an ELF object, a Python error raised inside the package, a missing Python dependency.

Nothing here touches the real virtualenv. Where a real CUDA build of one of these extensions is installed, the
"without its CUDA op" cases cannot be made (the extension would import from site-packages) and are skipped.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
REAL_EXT = [
    m
    for m in ("causal_conv1d_cuda", "selective_scan_cuda", "flash_attn_2_cuda")
    if importlib.util.find_spec(m) is not None
]
no_real_ext = pytest.mark.skipif(bool(REAL_EXT), reason=f"a real CUDA build is installed ({', '.join(REAL_EXT)})")

DISTS = {
    "causal_conv1d": ("causal-conv1d", "1.6.2.post1"),
    "mamba_ssm": ("mamba-ssm", "2.3.1"),
    "flash_attn": ("flash-attn", "2.8.3"),
}
PACKAGES = {
    "causal_conv1d": {
        "__init__.py": '__version__ = "1.6.2.post1"\n'
        "from causal_conv1d.causal_conv1d_interface import causal_conv1d_fn, causal_conv1d_update\n",
        "causal_conv1d_interface.py": "from causal_conv1d.cpp_functions import causal_conv1d_fwd_function\n"
        "def causal_conv1d_fn(*a, **k): raise NotImplementedError\n"
        "def causal_conv1d_update(*a, **k): raise NotImplementedError\n",
        "cpp_functions.py": "import causal_conv1d_cuda\n"
        "def causal_conv1d_fwd_function(*a): return causal_conv1d_cuda.causal_conv1d_fwd(*a)\n"
        "def causal_conv1d_bwd_function(*a): return causal_conv1d_cuda.causal_conv1d_bwd(*a)\n"
        "def causal_conv1d_update_function(*a):\n"
        "    return causal_conv1d_cuda.causal_conv1d_update(*a)\n",
    },
    "mamba_ssm": {
        "__init__.py": '__version__ = "2.3.1"\nfrom mamba_ssm.ops.selective_scan_interface import selective_scan_fn\n',
        "ops/__init__.py": "",
        "ops/selective_scan_interface.py": "import selective_scan_cuda\n"
        "def selective_scan_fn(*a, **k): raise NotImplementedError\n",
        "ops/triton/__init__.py": "",
        "ops/triton/ssd_combined.py": textwrap.dedent("""\
            try:
                from causal_conv1d.cpp_functions import causal_conv1d_fwd_function, causal_conv1d_bwd_function
            except ImportError:
                causal_conv1d_fwd_function = causal_conv1d_bwd_function = None
            def ensure_stride(x): return x
            def mamba_chunk_scan_combined(*a, **k): raise NotImplementedError("stand-in: never called here")
            def mamba_split_conv1d_scan_combined(*a, **k): raise NotImplementedError("stand-in: never called here")
            """),
        "ops/triton/selective_state_update.py": "def selective_state_update(*a, **k): raise NotImplementedError\n",
    },
    "flash_attn": {
        "__init__.py": '__version__ = "2.8.3"\n'
        "from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n",
        "flash_attn_interface.py": "import flash_attn_2_cuda as flash_attn_gpu\n"
        "def flash_attn_func(*a, **k): raise NotImplementedError\n"
        "def flash_attn_varlen_func(*a, **k): raise NotImplementedError\n",
    },
}

PROBE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from canonlm.ops import canon, gdn, gla, ssd
from canonlm.ops.ssd import _mamba
for mod in (canon, gla, gdn, ssd):
    mod.cuda_reason = lambda device: None          # resolve as on a CUDA node (there is no GPU here)
from canonlm.selfcheck import environment as env, kernels
from canonlm.selfcheck.verdict import run_check
out = {f"{op}/{fast}": env.fast_unavailable(op, fast, "cuda", torch.bfloat16)
       for op, fast in (("canon", "dao"), ("attention", "flash"), ("ssd", "mamba_ssm"), ("ssd", "split"))}
lines = {"kernel canon/dao": lambda: kernels.check_canon_kernel("dao", "bf16", "fwd+bwd", "cpu"),
         "kernel split": lambda: kernels.check_ssd_split_kernel("bf16", "cpu")}
for name, fn in lines.items():
    r = run_check(name, fn)
    out[name] = [r.status, r.detail]
out["ssd loader skips the package __init__"] = hasattr(_mamba, "import_triton_module")
print("RESULT " + json.dumps(out))
"""


def _site(tmp_path: Path, packages=("causal_conv1d", "mamba_ssm", "flash_attn"), files: dict | None = None) -> Path:
    """A site directory with the given fake packages (and their dist-info), plus ``files`` {relative path: text or
    bytes} (extension modules, changed package files)."""
    site = tmp_path / "site"
    for pkg in packages:
        for rel, text in PACKAGES[pkg].items():
            p = site / pkg / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        dist, version = DISTS[pkg]
        info = site / f"{pkg}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    for rel, data in (files or {}).items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return site


def _probe(site: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env, cwd=site)
    out = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and out, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(out[-1][len("RESULT ") :])


def _hint(dist: str, ext: str, var: str, version: str) -> str:
    return (
        f"{dist} installed without its CUDA op ({ext}): install its CUDA build for this torch (`bash "
        f"scripts/setup.sh cuda` where GitHub is reachable, or with nvcc `{var}=TRUE pip install "
        f"--no-build-isolation --no-cache-dir --no-deps {dist}=={version}`; docs/gpu.md)"
    )


CONV_HINT = _hint("causal-conv1d", "causal_conv1d_cuda", "CAUSAL_CONV1D_FORCE_BUILD", "1.6.2.post1")
MAMBA_HINT = _hint("mamba-ssm", "selective_scan_cuda", "MAMBA_FORCE_BUILD", "2.3.1")
FLASH_HINT = _hint("flash-attn", "flash_attn_2_cuda", "FLASH_ATTENTION_FORCE_BUILD", "2.8.3")


@no_real_ext
def test_installed_without_cuda_ops_is_skip_with_the_reason(tmp_path):
    """The wheelhouse node: the three packages' Python files, none of their compiled extensions. Dao's Canon kernel,
    flash-attn and the fused split (it needs causal-conv1d's op) SKIP, naming the module and how to get it; the SSD
    kernels run, since canonlm loads mamba-ssm's Triton modules without the package ``__init__`` that needs
    ``selective_scan_cuda``. No line FAILs."""
    got = _probe(_site(tmp_path))
    assert got["canon/dao"] == ["SKIP", CONV_HINT]
    assert got["attention/flash"] == ["SKIP", FLASH_HINT]
    assert got["kernel canon/dao"] == ["SKIP", CONV_HINT]
    if got["ssd loader skips the package __init__"]:
        assert got["ssd/mamba_ssm"] is None  # runnable: the SSD lines run
        assert got["ssd/split"] == ["SKIP", CONV_HINT]  # only the conv's op is missing
        assert got["kernel split"] == ["SKIP", CONV_HINT]
    else:  # a canonlm whose SSD loader imports the package: the missing Mamba-1 op stops it (still a SKIP)
        assert got["ssd/mamba_ssm"] == got["ssd/split"] == ["SKIP", MAMBA_HINT]


def _undefined_symbol_so(tmp_path: Path, module: str) -> bytes:
    """A real extension module for ``module`` that the loader refuses with "undefined symbol" (it calls a C++ symbol
    of c10 that nothing provides, as an extension built against another torch does)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a shared object")
    src = tmp_path / f"{module}.c"
    sym = "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
    src.write_text(f"extern void {sym}(void);\nvoid *PyInit_{module}(void) {{ {sym}(); return 0; }}\n")
    so = tmp_path / f"{module}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True, capture_output=True)
    return so.read_bytes()


def test_an_extension_built_against_another_torch_is_fail(tmp_path):
    """causal-conv1d whose ``causal_conv1d_cuda`` exists but does not load (undefined symbol): the Dao line and the
    split line FAIL, saying why; flash-attn's extension likewise."""
    files = {
        f"causal_conv1d_cuda{SUFFIX}": _undefined_symbol_so(tmp_path, "causal_conv1d_cuda"),
        f"flash_attn_2_cuda{SUFFIX}": _undefined_symbol_so(tmp_path, "flash_attn_2_cuda"),
    }
    got = _probe(_site(tmp_path, files=files))
    for key, dist in (("canon/dao", "causal-conv1d"), ("attention/flash", "flash-attn")):
        status, reason = got[key]
        assert status == "FAIL" and reason.startswith(f"{dist} is installed but does not load: ImportError: "), got
        assert "undefined symbol: _ZN3c105Error" in reason, reason
    status, detail = got["kernel canon/dao"]
    assert status == "FAIL" and detail == got["canon/dao"][1]
    if got["ssd loader skips the package __init__"]:
        assert got["ssd/split"] == got["canon/dao"] and got["kernel split"][0] == "FAIL"


@pytest.mark.parametrize(
    "case, files, want",
    [
        ("not an ELF object", {f"causal_conv1d_cuda{SUFFIX}": b"\x00not an ELF shared object\n"}, "ImportError: "),
        (
            "a Python error in the extension",
            {"causal_conv1d_cuda.py": "import torch\ntorch._C._canonlm_no_such()\n"},
            "AttributeError: ",
        ),
        (
            "a missing Python dependency",
            {"causal_conv1d/__init__.py": '__version__ = "1.6.2.post1"\nimport canonlm_no_such_dependency\n'},
            "ModuleNotFoundError: No module named 'canonlm_no_such_dependency'",
        ),
    ],
)
def test_other_load_failures_are_fail(tmp_path, case, files, want):
    got = _probe(_site(tmp_path, packages=("causal_conv1d",), files=files))
    status, reason = got["canon/dao"]
    assert status == "FAIL" and reason.startswith("causal-conv1d is installed but does not load: " + want), (case, got)
    assert got["kernel canon/dao"] == ["FAIL", reason]
