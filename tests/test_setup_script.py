"""scripts/setup.sh: its install plan on faked GPU / CPU machines, and its CUDA-kernel import check run for real.

The GPU branch cannot run here (no GPU, no network to GitHub). Each plan test copies the script into an empty
directory (so it plans a fresh ``.venv`` there, or finds a fake one), puts a fake ``nvidia-smi`` first on PATH and runs
it with ``SETUP_DRY_RUN=1``, which prints every command that would change the venv as ``+ <command>`` and runs none.

Oracle for the CUDA torch pin: the prebuilt-wheel matrix of each kernel package at the version pyproject's ``cuda``
extra pins, restated in :data:`PUBLISHED` from upstream. Their ``setup.py`` (``get_wheel_url``) downloads
``{pkg}-{ver}+cu{cuda_major}torch{major.minor}cxx11abi{TRUE|FALSE}-{cp}-{cp}-linux_x86_64.whl`` from the release
``v{ver}``; the matrix is the set of (torch, CPython) their release workflow built for CUDA 12 and the C++11 ABI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup.sh"

PY3_10_13 = {"3.10", "3.11", "3.12", "3.13"}
#: (package, version) -> (torch major.minor, CPython versions) with a cu12 / cxx11abiTRUE / linux_x86_64 wheel.
PUBLISHED = {
    # Dao-AILab/flash-attention v2.8.3 .github/workflows/publish.yml: torch 2.4.0 2.5.1 2.6.0 2.7.1 2.8.0, CUDA 12.9.1,
    # python 3.9-3.13, cxx11_abi FALSE and TRUE.
    ("flash-attn", "2.8.3"): ({"2.4", "2.5", "2.6", "2.7", "2.8"}, PY3_10_13 | {"3.9"}),
    # Dao-AILab/causal-conv1d release v1.6.2.post1 assets (the matrix of its publish.yaml since v1.6.1.post1): torch
    # 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 with CUDA 12.9.1, python 3.10-3.13, cxx11_abi TRUE (FALSE only for torch 2.6).
    ("causal-conv1d", "1.6.2.post1"): ({"2.6", "2.7", "2.8", "2.9", "2.10"}, PY3_10_13),
    # state-spaces/mamba v2.3.1 .github/workflows/publish.yaml: the same matrix.
    ("mamba-ssm", "2.3.1"): ({"2.6", "2.7", "2.8", "2.9", "2.10"}, PY3_10_13),
}
EXTENSIONS = {"flash_attn": "flash_attn_2_cuda", "causal_conv1d": "causal_conv1d_cuda",
              "mamba_ssm": "selective_scan_cuda", "fla.ops.gla": "fla's Triton kernels"}
BUILD_TOOLS = {"setuptools", "wheel", "packaging", "ninja", "psutil"}


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "setup.sh")
    return repo


def _fake_venv(repo: Path, torch: tuple[str, str | None] | None = None, dists: dict[str, str] | None = None):
    """``repo/.venv/bin/python``: this interpreter with a directory first on its path that holds a fake ``torch``
    (``__version__``, ``version.cuda``, ``_C._GLIBCXX_USE_CXX11_ABI``) and fake installed distributions."""
    site = repo / "fake_site"
    site.mkdir()
    if torch:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(
            f"__version__ = {torch[0]!r}\nclass version:\n    cuda = {torch[1]!r}\n"
            "class _C:\n    _GLIBCXX_USE_CXX11_ABI = True\n")
    for name, ver in (dists or {}).items():
        info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    py = repo / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)


def _setup(repo: Path, *args: str, gpu: bool | None, dry: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run the copied setup.sh. gpu True/False: a fake nvidia-smi that lists a GPU / fails (no GPU) is first on PATH."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("TORCH_SPEC", "TORCH_CUDA", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX", "SETUP_DRY_RUN", "PYTHON")}
    full["PYTHON"] = sys.executable
    if dry:
        full["SETUP_DRY_RUN"] = "1"
    if gpu is not None:
        bindir = repo.parent / "bin"
        bindir.mkdir(exist_ok=True)
        smi = bindir / "nvidia-smi"
        smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n' if gpu else
                       '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n')
        smi.chmod(0o755)
        full["PATH"] = f"{bindir}{os.pathsep}{full['PATH']}"
    full.update(env)
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], env=full, capture_output=True,
                          text=True, timeout=120)


def _plan(res: subprocess.CompletedProcess) -> list[str]:
    assert res.returncode == 0, res.stdout + res.stderr
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]


def _index(cmds: list[str], pattern: str) -> int:
    hits = [i for i, c in enumerate(cmds) if re.search(pattern, c)]
    assert len(hits) == 1, (pattern, cmds)
    return hits[0]


def _cuda_pins() -> dict[str, str]:
    extra = re.search(r"^cuda = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', extra))
    return {p: pins[p] for p in ("flash-attn", "causal-conv1d", "mamba-ssm")}


def test_gpu_plan_pins_a_torch_every_kernel_wheel_exists_for(tmp_path):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, "slurm,cuda", gpu=True))
    assert not (repo / ".venv").exists()                                   # a dry run changes nothing
    assert cmds[0] == f"{sys.executable} -m venv .venv"
    t = _index(cmds, r"^pip install torch==")
    version, label, index = re.fullmatch(r"pip install torch==([\d.]+)\+(cu\d+) --index-url (\S+)", cmds[t]).groups()
    torch_mm = ".".join(version.split(".")[:2])
    assert label.startswith("cu12") and index.endswith("/" + label)          # a CUDA 12 build, from its own index
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    pins = _cuda_pins()
    for pkg, ver in pins.items():
        assert (pkg, ver) in PUBLISHED, f"pyproject pins {pkg}=={ver}, whose wheel matrix this test does not know"
        torches, pythons = PUBLISHED[pkg, ver]
        assert torch_mm in torches, f"{pkg} {ver} publishes no wheel for torch {torch_mm}"
        assert py in pythons
    tools = _index(cmds, r"^pip install setuptools ")
    assert set(cmds[tools].split()[2:]) == BUILD_TOOLS
    k = _index(cmds, r"pip install .*-e \.\[slurm,cuda\]")
    env = dict(re.findall(r"(\w+)=(\w+)", cmds[k].split(" pip ")[0]))
    assert env == {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
                   "MAMBA_SKIP_CUDA_BUILD": "TRUE"}
    assert "--no-build-isolation" in cmds[k].split() and "--no-cache-dir" in cmds[k].split()
    checks = [re.fullmatch(r"\.venv/bin/python -c 'import ([\w.]+)'.*", c) for c in cmds[k + 1:]]
    assert [m.group(1) for m in checks if m] == list(EXTENSIONS)
    assert t < tools < k < len(cmds) - len(EXTENSIONS)                      # torch, build tools, kernels, checks
    assert not any("uninstall" in c for c in cmds)


@pytest.mark.parametrize("installed, replaced", [(("2.8.0+cu128", "12.8"), False), (("2.8.1+cu126", "12.6"), False),
                                                 (("2.13.0+cpu", None), True), (("2.9.1+cu128", "12.8"), True)])
def test_gpu_plan_keeps_a_matching_torch_and_replaces_another(tmp_path, installed, replaced):
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=installed)
    res = _setup(repo, "cuda", gpu=True)
    cmds = _plan(res)
    torch_cmds = [c for c in cmds if c.startswith("pip install torch")]
    if replaced:                          # stale kernel builds for the old torch go before the pinned torch comes
        u = _index(cmds, r"^pip uninstall -y ")
        assert set(cmds[u].split()[3:]) == set(_cuda_pins())
        assert torch_cmds == ["pip install torch==2.8.0+cu128 --index-url https://download.pytorch.org/whl/cu128"]
        assert u < cmds.index(torch_cmds[0])
    else:
        assert torch_cmds == [] and "already installed" in res.stdout
        assert not any("uninstall" in c for c in cmds)
    assert any("--no-build-isolation" in c and "-e .[cuda]" in c for c in cmds)


def test_torch_spec_on_gpu_is_installed_with_a_warning(tmp_path):
    repo = _repo(tmp_path)
    res = _setup(repo, "cuda", gpu=True, TORCH_SPEC="torch==2.9.1")
    cmds = _plan(res)
    assert [c for c in cmds if c.startswith("pip install torch")] == ["pip install torch==2.9.1"]
    assert "TORCH_SPEC=torch==2.9.1" in res.stderr and "may not match" in res.stderr
    assert any("--no-build-isolation" in c for c in cmds) and any("import flash_attn" in c for c in cmds)


def test_cuda_extra_without_a_visible_gpu_still_gets_the_cuda_torch(tmp_path):
    repo = _repo(tmp_path)                                                 # e.g. a cluster's login node
    res = _setup(repo, "cuda", gpu=False, TORCH_CUDA="cu126")
    cmds = _plan(res)
    assert "no CUDA GPU visible" in res.stdout
    assert [c for c in cmds if c.startswith("pip install torch")] == [
        "pip install torch==2.8.0+cu126 --index-url https://download.pytorch.org/whl/cu126"]


def test_gpu_without_cuda_extra_gets_the_cuda_torch_but_no_kernels(tmp_path):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, "slurm", gpu=True))
    assert [c for c in cmds if c.startswith("pip install torch")] == [
        "pip install torch==2.8.0+cu128 --index-url https://download.pytorch.org/whl/cu128"]
    assert cmds[-1] == "pip install -e .[slurm]"
    assert not any("import " in c or "build-isolation" in c for c in cmds)


@pytest.mark.parametrize("extras, editable", [("dev,interp", "pip install -e .[dev,interp]"), ("", "pip install -e .")])
def test_cpu_plan(tmp_path, extras, editable):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, *([extras] if extras else []), gpu=False))
    assert cmds[:3] == [f"{sys.executable} -m venv .venv", "pip install torch==2.13.0+cpu", editable]
    assert not any("import " in c or "uninstall" in c or "cu12" in c for c in cmds)
    if not extras:
        assert len(cmds) == 3
        return
    assert set(cmds[3].split()[2:]) == BUILD_TOOLS
    env, _, pip = cmds[4].partition(" pip ")
    assert dict(re.findall(r"(\w+)=(\w+)", env)) == {
        "MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE"}
    assert pip.split() == ["install", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                           "mamba-ssm==2.3.1", "causal-conv1d==1.6.2.post1"]
    assert len(cmds) == 5


@pytest.mark.parametrize("mamba, skipped", [("2.3.1", True), ("2.3.0", False)])
def test_interp_step_skips_what_is_installed(tmp_path, mamba, skipped):
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=("2.13.0+cpu", None), dists={"mamba-ssm": mamba, "causal-conv1d": "1.6.2.post1"})
    res = _setup(repo, "dev,interp", gpu=False)
    cmds = _plan(res)
    assert cmds[0] == "pip install -e .[dev,interp]"                       # torch present: not reinstalled
    installs = [c for c in cmds if "mamba-ssm==2.3.1" in c]
    assert (installs == []) == skipped
    assert ("already installed" in res.stdout) == skipped


@pytest.mark.parametrize("extras, gpu, env, names", [
    ("dev,interp,cuda", False, {}, ["'interp'", "triton==3.9.0", "dev,cuda"]),
    ("dev,interp", True, {}, ["'interp'", "CPU test tier", "without a GPU"]),
    ("cuda", True, {"TORCH_CUDA": "cu130"}, ["TORCH_CUDA='cu130'", "cu126, cu128, cu129"]),
    ("--cuda", True, {}, ["'--cuda'", "--check-kernels"]),
])
def test_bad_requests_are_refused_before_any_work(tmp_path, extras, gpu, env, names):
    repo = _repo(tmp_path)
    res = _setup(repo, extras, gpu=gpu, **env)
    assert res.returncode == 2
    assert "+ " not in res.stdout and "[setup]" not in res.stdout          # nothing planned, not even the venv
    for name in names:
        assert name in res.stderr


def _independent_imports(mods) -> dict[str, str | None]:
    """For each module: None when ``import mod`` works in a fresh process of this interpreter, else the exception's
    line (the processes run side by side)."""
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for m in mods}
    out = {m: p.communicate(timeout=300)[1] for m, p in procs.items()}
    return {m: None if procs[m].returncode == 0 else out[m].strip().splitlines()[-1] for m in mods}


def test_import_check_names_each_kernel_that_does_not_load_here(tmp_path):
    repo = _repo(tmp_path)
    (repo / ".venv").symlink_to(sys.prefix)                                # this venv, for real
    res = _setup(repo, "--check-kernels", gpu=None, dry=False)
    errors = _independent_imports(EXTENSIONS)
    for mod in ("flash_attn", "causal_conv1d", "mamba_ssm"):              # no CUDA extension can load on this CPU
        assert errors[mod] is not None, f"{mod} imports here"
    assert res.returncode == 1
    for mod, ext in EXTENSIONS.items():
        if errors[mod] is None:
            assert f"import {mod} ({ext}): ok" in res.stdout
        else:
            assert f"  {ext} (import {mod}): {errors[mod]}\n" in res.stderr
    assert "pip uninstall -y flash-attn causal-conv1d mamba-ssm" in res.stderr and "docs/gpu.md" in res.stderr


def test_import_check_passes_when_every_kernel_imports_and_relays_the_import_error(tmp_path):
    repo = _repo(tmp_path)
    (repo / ".venv").symlink_to(sys.prefix)
    stubs = tmp_path / "stubs"
    for pkg in ("flash_attn", "causal_conv1d", "mamba_ssm", "fla", "fla/ops", "fla/ops/gla"):
        (stubs / pkg).mkdir(parents=True)
        (stubs / pkg / "__init__.py").write_text("")
    res = _setup(repo, "--check-kernels", gpu=None, dry=False, PYTHONPATH=str(stubs))
    assert res.returncode == 0, res.stderr
    assert all(f"import {mod} ({ext}): ok" in res.stdout for mod, ext in EXTENSIONS.items())

    symbol = "flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationESs"
    (stubs / "flash_attn" / "__init__.py").write_text(f"raise ImportError({symbol!r})")
    res = _setup(repo, "--check-kernels", gpu=None, dry=False, PYTHONPATH=str(stubs))
    assert res.returncode == 1
    assert f"  flash_attn_2_cuda (import flash_attn): ImportError: {symbol}\n" in res.stderr
    assert "causal_conv1d_cuda" not in res.stderr and "import causal_conv1d (causal_conv1d_cuda): ok" in res.stdout
