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
EXTENSIONS = {
    "flash_attn": "flash_attn_2_cuda",
    "causal_conv1d": "causal_conv1d_cuda",
    "mamba_ssm": "selective_scan_cuda",
    "fla.ops.gla": "fla's Triton kernels",
}
BUILD_TOOLS = {"setuptools", "wheel", "packaging", "ninja", "psutil"}


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")  # the extras it checks names against
    return repo


def _fake_torch(site: Path, torch: tuple[str, str | None]) -> None:
    """A fake ``torch`` package in ``site``: ``__version__``, ``version.cuda`` and ``_C._GLIBCXX_USE_CXX11_ABI``."""
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = {torch[0]!r}\nclass version:\n    cuda = {torch[1]!r}\n"
        "class _C:\n    _GLIBCXX_USE_CXX11_ABI = True\n"
    )


def _fake_venv(repo: Path, torch: tuple[str, str | None] | None = None, dists: dict[str, str] | None = None):
    """``repo/.venv/bin/python``: this interpreter with a directory first on its path that holds a fake ``torch``
    (``__version__``, ``version.cuda``, ``_C._GLIBCXX_USE_CXX11_ABI``) and fake installed distributions."""
    site = repo / "fake_site"
    site.mkdir()
    if torch:
        _fake_torch(site, torch)
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
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCH_SPEC", "TORCH_CUDA", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX", "SETUP_DRY_RUN", "PYTHON")
    }
    full["PYTHON"] = sys.executable
    if dry:
        full["SETUP_DRY_RUN"] = "1"
    if gpu is not None:
        bindir = repo.parent / "bin"
        bindir.mkdir(exist_ok=True)
        smi = bindir / "nvidia-smi"
        smi.write_text(
            '#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'
            if gpu
            else '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n'
        )
        smi.chmod(0o755)
        full["PATH"] = f"{bindir}{os.pathsep}{full['PATH']}"
    full.update(env)
    return subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh"), *args], env=full, capture_output=True, text=True, timeout=120
    )


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
    assert not (repo / ".venv").exists()  # a dry run changes nothing
    assert cmds[0] == f"{sys.executable} -m venv .venv"
    t = _index(cmds, r"^pip install torch==")
    version, label, index = re.fullmatch(r"pip install torch==([\d.]+)\+(cu\d+) --index-url (\S+)", cmds[t]).groups()
    torch_mm = ".".join(version.split(".")[:2])
    assert label.startswith("cu12") and index.endswith("/" + label)  # a CUDA 12 build, from its own index
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
    assert env == {
        "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
        "MAMBA_SKIP_CUDA_BUILD": "TRUE",
    }
    assert "--no-build-isolation" in cmds[k].split() and "--no-cache-dir" in cmds[k].split()
    checks = [re.fullmatch(r"\.venv/bin/python -c 'import ([\w.]+)'.*", c) for c in cmds[k + 1 :]]
    assert [m.group(1) for m in checks if m] == list(EXTENSIONS)
    assert t < tools < k < len(cmds) - len(EXTENSIONS)  # torch, build tools, kernels, checks
    assert not any("uninstall" in c for c in cmds)


@pytest.mark.parametrize(
    "installed, replaced",
    [
        (("2.8.0+cu128", "12.8"), False),
        (("2.8.1+cu126", "12.6"), False),
        (("2.9.1+cu128", "12.8"), False),
        (("2.11.0+cu130", "13.0"), False),
        (("2.13.0+cpu", None), True),
        (("2.6.0+cu124", "12.4"), True),
    ],
)
def test_gpu_plan_keeps_a_cuda_torch_from_2_7_and_replaces_another(tmp_path, installed, replaced):
    """A CUDA build of torch >= 2.7 in .venv is kept (a cluster's or a container's torch); a CPU build or an older
    CUDA build is replaced by the pinned one. A kept torch that is not the kernels' 2.8 / CUDA 12 gets a warning."""
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=installed)
    res = _setup(repo, "cuda", gpu=True)
    cmds = _plan(res)
    torch_cmds = [c for c in cmds if c.startswith("pip install torch")]
    if replaced:  # stale kernel builds for the old torch go before the pinned torch comes
        u = _index(cmds, r"^pip uninstall -y ")
        assert set(cmds[u].split()[3:]) == set(_cuda_pins())
        assert torch_cmds == ["pip install torch==2.8.0+cu128 --index-url https://download.pytorch.org/whl/cu128"]
        assert u < cmds.index(torch_cmds[0])
    else:
        assert torch_cmds == [] and "already installed" in res.stdout
        assert not any("uninstall" in c for c in cmds)
        assert ("may not exist" in res.stderr) == (not installed[0].startswith("2.8."))
    assert any("--no-build-isolation" in c and "-e .[cuda]" in c for c in cmds)


def test_torch_spec_on_gpu_is_installed_with_a_warning(tmp_path):
    repo = _repo(tmp_path)
    res = _setup(repo, "cuda", gpu=True, TORCH_SPEC="torch==2.9.1")
    cmds = _plan(res)
    assert [c for c in cmds if c.startswith("pip install torch")] == ["pip install torch==2.9.1"]
    assert "TORCH_SPEC=torch==2.9.1" in res.stderr and "may not match" in res.stderr
    assert any("--no-build-isolation" in c for c in cmds) and any("import flash_attn" in c for c in cmds)


def test_cuda_extra_without_a_visible_gpu_still_gets_the_cuda_torch(tmp_path):
    repo = _repo(tmp_path)  # e.g. a cluster's login node
    res = _setup(repo, "cuda", gpu=False, TORCH_CUDA="cu126")
    cmds = _plan(res)
    assert "no CUDA GPU visible" in res.stdout
    assert [c for c in cmds if c.startswith("pip install torch")] == [
        "pip install torch==2.8.0+cu126 --index-url https://download.pytorch.org/whl/cu126"
    ]


def test_gpu_without_cuda_extra_gets_the_cuda_torch_but_no_kernels(tmp_path):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, "slurm", gpu=True))
    assert [c for c in cmds if c.startswith("pip install torch")] == [
        "pip install torch==2.8.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
    ]
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
        "MAMBA_SKIP_CUDA_BUILD": "TRUE",
        "MAMBA_FORCE_BUILD": "TRUE",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
        "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
    }
    assert pip.split() == [
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--no-cache-dir",
        "mamba-ssm==2.3.1",
        "causal-conv1d==1.6.2.post1",
    ]
    assert len(cmds) == 5


@pytest.mark.parametrize("mamba, skipped", [("2.3.1", True), ("2.3.0", False)])
def test_interp_step_skips_what_is_installed(tmp_path, mamba, skipped):
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=("2.13.0+cpu", None), dists={"mamba-ssm": mamba, "causal-conv1d": "1.6.2.post1"})
    res = _setup(repo, "dev,interp", gpu=False)
    cmds = _plan(res)
    assert cmds[0] == "pip install -e .[dev,interp]"  # torch present: not reinstalled
    installs = [c for c in cmds if "mamba-ssm==2.3.1" in c]
    assert (installs == []) == skipped
    assert ("already installed" in res.stdout) == skipped


@pytest.mark.parametrize(
    "extras, gpu, env, names",
    [
        ("dev,interp,cuda", False, {}, ["'interp'", "triton==3.9.0", "dev,cuda"]),
        ("dev,interp", True, {}, ["'interp'", "CPU test tier", "without a GPU"]),
        ("cuda", True, {"TORCH_CUDA": "cu130"}, ["TORCH_CUDA='cu130'", "cu126, cu128, cu129"]),
        ("--cuda", True, {}, ["'--cuda'", "--check-kernels"]),
    ],
)
def test_bad_requests_are_refused_before_any_work(tmp_path, extras, gpu, env, names):
    repo = _repo(tmp_path)
    res = _setup(repo, extras, gpu=gpu, **env)
    assert res.returncode == 2
    assert "+ " not in res.stdout and "[setup]" not in res.stdout  # nothing planned, not even the venv
    for name in names:
        assert name in res.stderr


def _independent_imports(mods) -> dict[str, str | None]:
    """For each module: None when ``import mod`` works in a fresh process of this interpreter, else the exception's
    line (the processes run side by side)."""
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-c", f"import {m}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for m in mods
    }
    out = {m: p.communicate(timeout=300)[1] for m, p in procs.items()}
    return {m: None if procs[m].returncode == 0 else out[m].strip().splitlines()[-1] for m in mods}


def test_import_check_names_each_kernel_that_does_not_load_here(tmp_path):
    repo = _repo(tmp_path)
    (repo / ".venv").symlink_to(sys.prefix)  # this venv, for real
    res = _setup(repo, "--check-kernels", gpu=None, dry=False)
    errors = _independent_imports(EXTENSIONS)
    for mod in ("flash_attn", "causal_conv1d", "mamba_ssm"):  # no CUDA extension can load on this CPU
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


# --- a torch that is already there: the base interpreter's CUDA torch (cluster module, container) -----------------

BASE_INTERPRETER = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"


def _base_python(tmp_path: Path, torch: tuple[str, str | None] | None, venv: bool = True) -> Path:
    """A stand-in for python3 whose ``import torch`` gives a fake torch of (version, cuda); everything else is this
    interpreter's (a venv, as the device image's python3 is), or with ``venv=False`` that of the interpreter this venv
    was made from (a plain installation)."""
    site = tmp_path / "base_site"
    site.mkdir()
    if torch:
        _fake_torch(site, torch)
    py = tmp_path / "python3"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable if venv else BASE_INTERPRETER}" "$@"\n')
    py.chmod(0o755)
    return py


def _site_packages() -> str:
    import site

    return " ".join(site.getsitepackages())


@pytest.mark.parametrize("venv", [True, False])
@pytest.mark.parametrize(
    "base, extras, gpu, sys_site",
    [
        (("2.11.0+cu130", "13.0"), "dev", True, True),  # the device image: torch in python3, CUDA 13
        (("2.7.1+cu126", "12.6"), "slurm", False, True),  # a login node with a CUDA torch module: kept too
        (("2.6.0+cu124", "12.4"), "dev", True, False),  # older than 2.7: a fresh venv gets the pinned torch
        (("2.13.0+cpu", None), "dev", True, False),  # a CPU build is no reason to share the interpreter
        (("2.11.0+cu130", "13.0"), "dev,interp", False, False),  # the CPU test tier pins its own triton / torch
    ],
)
def test_base_interpreter_cuda_torch_is_kept_and_stays_visible(tmp_path, base, extras, gpu, sys_site, venv):
    """python3 with a CUDA torch >= 2.7: .venv shares its packages -- with --system-site-packages for a plain
    installation; when python3 is itself a venv (the device image's /opt/torch/.venv), whose packages a nested
    venv's --system-site-packages would not show, with a .pth file naming python3's site-packages folders."""
    if not venv and not BASE_INTERPRETER.exists():
        pytest.skip(f"no base interpreter at {BASE_INTERPRETER}")
    repo = _repo(tmp_path)
    py = _base_python(tmp_path, base, venv)
    res = _setup(repo, extras, gpu=gpu, PYTHON=str(py))
    cmds = _plan(res)
    torch_cmds = [c for c in cmds if c.startswith("pip install torch")]
    if sys_site and venv:
        pyv = f"{sys.version_info[0]}.{sys.version_info[1]}"
        assert cmds[:2] == [
            f"{py} -m venv .venv",
            f"write .venv/lib/python{pyv}/site-packages/_base_python.pth: {_site_packages()}",
        ]
        assert torch_cmds == [] and f"has torch {base[0]}" in res.stdout and "is itself a venv" in res.stdout
    elif sys_site:
        assert cmds[0] == f"{py} -m venv --system-site-packages .venv"
        assert torch_cmds == [] and f"has torch {base[0]}" in res.stdout and "--system-site-packages" in res.stdout
    else:
        assert cmds[0] == f"{py} -m venv .venv"
        assert len(torch_cmds) == 1
    assert f"pip install -e .[{extras}]" in cmds


def test_an_existing_venv_without_torch_does_not_take_the_base_torch(tmp_path):
    repo = _repo(tmp_path)
    _fake_venv(repo)  # .venv exists and imports no torch:
    (repo / "fake_site" / "torch").mkdir()  # this interpreter's torch is hidden
    (repo / "fake_site" / "torch" / "__init__.py").write_text("raise ImportError('no torch in this venv')\n")
    py = _base_python(tmp_path, ("2.11.0+cu130", "13.0"))
    cmds = _plan(_setup(repo, "dev", gpu=True, PYTHON=str(py)))
    assert not any("venv" in c for c in cmds)
    assert [c for c in cmds if c.startswith("pip install torch")] == [
        "pip install torch==2.8.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
    ]


# --- offline: --wheelhouse DIR -------------------------------------------------------------------------------------


def _wheel(wh: Path, name: str, version: str, requires: list[str] = (), tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel file (METADATA, WHEEL, RECORD) of ``name`` ``version`` requiring ``requires``."""
    import zipfile

    dist = re.sub(r"[-.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    path = wh / f"{dist}-{version}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _offline_cmds(cmds: list[str], wh: Path) -> list[str]:
    pips = [c for c in cmds if c.startswith("pip ")]
    assert pips and all(c.startswith(f"pip install --no-index --find-links {wh} ") for c in pips), cmds
    assert not any("--index-url" in c or "torch" in c.split() or "flash-attn" in c for c in cmds)
    return pips


def test_wheelhouse_plan_keeps_the_venv_torch_and_reads_the_wheelhouse_only(tmp_path):
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=("2.11.0+cu130", "13.0"))  # plus everything this venv has installed
    wh = tmp_path / "wh"
    wh.mkdir()
    res = _setup(repo, "--wheelhouse", str(wh), "dev", gpu=True)
    pips = _offline_cmds(_plan(res), wh)
    assert pips[0].split()[-2:] == ["setuptools>=68", "wheel"]  # canonlm's build requirements, then canonlm
    assert pips[1].endswith("--prefer-binary --no-build-isolation -e .[dev] fla-core==0.6.0")
    assert "keeping torch 2.11.0+cu130 (CUDA 13.0) (in .venv)" in res.stdout
    assert "every requirement is met" in res.stdout and "0 from" in res.stdout
    assert "hf451" not in " ".join(pips)


def test_wheelhouse_plan_with_the_base_interpreter_torch(tmp_path):
    repo = _repo(tmp_path)
    py = _base_python(tmp_path, ("2.11.0+cu130", "13.0"))  # the device image's python3
    wh = tmp_path / "wh"
    wh.mkdir()
    res = _setup(repo, "--wheelhouse", str(wh), "dev", gpu=True, PYTHON=str(py))
    cmds = _plan(res)
    assert cmds[0] == f"{py} -m venv .venv" and cmds[1].startswith("write .venv/lib/python")  # python3 is a venv
    pips = _offline_cmds(cmds, wh)
    assert pips[-1].endswith("--only-binary=:all: --no-deps mamba-ssm==2.3.1 causal-conv1d==1.6.2.post1")
    assert len(pips) == 3


def test_wheelhouse_missing_packages_are_named_before_anything_is_written(tmp_path):
    """A fresh venv (no .venv, a CPU torch in python3: no --system-site-packages) has nothing installed: every
    requirement must come from the wheelhouse. The message names each missing one with what requires it, a wheel for
    another Python, and the torch hint; exit 2, no plan, no .venv."""
    repo = _repo(tmp_path)
    wh = tmp_path / "wh"
    wh.mkdir()
    _wheel(wh, "hydra-core", "1.3.2", ["omegaconf<2.4,>=2.2", "antlr4-python3-runtime==4.9.*", "packaging"])
    _wheel(wh, "omegaconf", "2.3.0", ["antlr4-python3-runtime==4.9.*", "PyYAML>=5.1.0"])
    _wheel(wh, "PyYAML", "6.0.2", tag="cp39-cp39-manylinux_2_17_x86_64")  # for another Python
    _wheel(wh, "einops", "0.8.1")
    res = _setup(repo, "--wheelhouse", str(wh), gpu=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "+ " not in res.stdout and not (repo / ".venv").exists()
    err = res.stderr
    assert re.search(r"^  antlr4-python3-runtime==4\.9\.\*\s+\(required by hydra-core 1\.3\.2\)$", err, re.M), err
    assert re.search(r"^  antlr4-python3-runtime==4\.9\.\*\s+\(required by omegaconf 2\.3\.0\)$", err, re.M), err
    assert re.search(
        r"^  pyyaml>=6\s+\(required by canonlm; the wheelhouse has only wheels for another Python or "
        r"platform: PyYAML-6\.0\.2-cp39-cp39-manylinux_2_17_x86_64\.whl\)$",
        err,
        re.M | re.I,
    ), err
    assert re.search(r"^  torch>=2\.5\s+\(required by canonlm\)$", err, re.M) and "torch is never put into" in err
    for name in ("hydra-core", "omegaconf", "einops"):  # present: not named as missing
        assert not re.search(rf"^  {name}[<>=!~ ]", err, re.M | re.I), name
    assert "bash scripts/wheelhouse.sh" in err and "--have" in err


@pytest.mark.parametrize(
    "args, names",
    [
        (["--wheelhouse", "WH", "dev,cuda"], ["'cuda' cannot be installed offline", "--wheelhouse DIR dev"]),
        (["--wheelhouse", "WH", "interp"], ["'interp' cannot be installed offline"]),
        (["--wheelhouse", "NOWHERE", "dev"], ["--wheelhouse 'NOWHERE': no such directory", "scripts/wheelhouse.sh"]),
        (["--wheelhouse"], ["--wheelhouse needs a directory"]),
        (["devv"], ["unknown extra 'devv'", "dev", "interp", "cuda"]),
        (["dev", "slurm"], ["two extras lists, 'dev' and 'slurm'"]),
    ],
)
def test_bad_offline_requests_are_refused_before_any_work(tmp_path, args, names):
    repo = _repo(tmp_path)
    (tmp_path / "WH").mkdir()
    args = [str(tmp_path / a) if a in ("WH", "NOWHERE") else a for a in args]
    res = _setup(repo, *args, gpu=True)
    assert res.returncode == 2
    assert "+ " not in res.stdout and "[setup]" not in res.stdout
    for name in names:
        assert name.replace("NOWHERE", str(tmp_path / "NOWHERE")) in res.stderr, res.stderr
