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


#: the uv the tests give setup.sh (the one installed with this venv's dev extra), so no test downloads one
UV = str(Path(sys.executable).parent / "uv")
VPY = ".venv/bin/python"


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for s in ("setup.sh", "_uv.sh", "wheelhouse.py"):
        shutil.copy(ROOT / "scripts" / s, repo / "scripts" / s)
    for f in ("pyproject.toml", "uv.lock"):  # the extras it checks names against; the lock it syncs from
        shutil.copy(ROOT / f, repo / f)
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
    """Run the copied setup.sh with this venv's uv and no pip configuration (so the CPU torch comes from its index,
    not from a find-links folder of this machine). gpu True/False: a fake nvidia-smi that lists a GPU / fails (no
    GPU) is first on PATH."""
    drop = (
        "PYTHONDONTWRITEBYTECODE",
        "TORCH_SPEC",
        "TORCH_CUDA",
        "TORCH_CUDA_INDEX",
        "TORCH_CPU_INDEX",
        "SETUP_DRY_RUN",
        "PYTHON",
        "PIP_FIND_LINKS",
    )
    full = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("UV_")}
    full.update(PYTHON=sys.executable, UV=UV, PIP_CONFIG_FILE=os.devnull)
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


def _torch_installs(cmds: list[str]) -> list[str]:
    """The torch installs of a plan, without the uv prefix: 'torch==X [--index URL | --find-links DIR]'."""
    pre = f"{UV} pip install --python {VPY} "
    return [c[len(pre) :] for c in cmds if c.startswith(pre) and re.match(r"torch[=<>]", c[len(pre) :])]


def _syncs(cmds: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """Each `uv sync` of a plan as (environment variables set before it, its arguments after `sync`)."""
    out = []
    for c in cmds:
        head, sep, tail = c.partition(f"{UV} sync ")
        if sep:
            out.append((dict(re.findall(r"(\w+)=(\w+)", head)), tail.split()))
    return out


def _cuda_pins() -> dict[str, str]:
    extra = re.search(r"^cuda = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', extra))
    return {p: pins[p] for p in ("flash-attn", "causal-conv1d", "mamba-ssm")}


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_lock_matches_pyproject_and_builds_the_kernels_as_their_setup_needs(tmp_path):
    """uv.lock is current (`uv lock --check`), the kernels' sdists build without isolation, and the `build` group
    holds what their setup.py import (BUILD_TOOLS) and canonlm's build requirements."""
    res = subprocess.run([UV, "lock", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # ... and the same check fails on a pyproject.toml that asks for something the lock lacks (what .ci/run runs)
    other = tmp_path / "p"
    other.mkdir()
    shutil.copy(ROOT / "uv.lock", other / "uv.lock")
    text = (ROOT / "pyproject.toml").read_text().replace('"einops>=0.8",', '"einops>=0.8",\n  "iniconfig>=2",', 1)
    (other / "pyproject.toml").write_text(text)
    res = subprocess.run([UV, "lock", "--check"], cwd=other, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "needs to be updated" in res.stderr, res.stderr
    cfg = _pyproject()
    assert set(cfg["tool"]["uv"]["no-build-isolation-package"]) == set(_cuda_pins())
    build = {re.split(r"[<>=!~ ]", r)[0] for r in cfg["dependency-groups"]["build"]}
    assert build == BUILD_TOOLS
    assert set(cfg["build-system"]["requires"]) <= set(cfg["dependency-groups"]["build"]) | {"wheel"}


def test_gpu_plan_pins_a_torch_every_kernel_wheel_exists_for(tmp_path):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, "slurm,cuda", gpu=True))
    assert not (repo / ".venv").exists()  # a dry run changes nothing
    assert cmds[0] == f"{UV} venv --quiet --python {sys.executable} .venv"
    (torch,) = _torch_installs(cmds)
    version, label, index = re.fullmatch(r"torch==([\d.]+)\+(cu\d+) --index (\S+)", torch).groups()
    torch_mm = ".".join(version.split(".")[:2])
    assert label.startswith("cu12") and index.endswith("/" + label)  # a CUDA 12 build, from its own index
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    pins = _cuda_pins()
    for pkg, ver in pins.items():
        assert (pkg, ver) in PUBLISHED, f"pyproject pins {pkg}=={ver}, whose wheel matrix this test does not know"
        torches, pythons = PUBLISHED[pkg, ver]
        assert torch_mm in torches, f"{pkg} {ver} publishes no wheel for torch {torch_mm}"
        assert py in pythons
    (env1, first), (env2, second) = _syncs(cmds)
    for args in (first, second):  # from the lock, never torch or its triton; the extras asked for
        assert args[:4] == ["--locked", "--inexact", "--no-install-package", "torch"]
        assert "--extra slurm --extra cuda" in " ".join(args) and "--no-install-package triton" in " ".join(args)
        assert "--group build" in " ".join(args)
    # first everything but the kernels (the build group among it), then the kernels against that torch
    assert {first[i + 1] for i, a in enumerate(first) if a == "--no-install-package"} == {"torch", "triton", *pins}
    assert env1 == {} and "--no-cache" in second
    assert env2 == {
        "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
        "MAMBA_SKIP_CUDA_BUILD": "TRUE",
    }
    k = max(i for i, c in enumerate(cmds) if " sync " in c)
    checks = [re.fullmatch(r"\.venv/bin/python -c 'import ([\w.]+)'.*", c) for c in cmds[k + 1 :]]
    assert [m.group(1) for m in checks if m] == list(EXTENSIONS)
    assert cmds.index(next(c for c in cmds if " torch==" in c)) < k < len(cmds) - len(EXTENSIONS)
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
    torch_cmds = _torch_installs(cmds)
    if replaced:  # stale kernel builds for the old torch go before the pinned torch comes
        u = _index(cmds, r" pip uninstall ")
        assert cmds[u].startswith(f"{UV} pip uninstall --python {VPY} ")
        assert set(cmds[u].split()[5:]) == set(_cuda_pins())
        assert torch_cmds == ["torch==2.8.0+cu128 --index https://download.pytorch.org/whl/cu128"]
        assert u < next(i for i, c in enumerate(cmds) if " torch==" in c)
    else:
        assert torch_cmds == [] and "already installed" in res.stdout
        assert not any("uninstall" in c for c in cmds)
        assert ("may not exist" in res.stderr) == (not installed[0].startswith("2.8."))
    assert [a for _, a in _syncs(cmds)][-1][-3:] == ["--group", "build", "--no-cache"]


def test_torch_spec_on_gpu_is_installed_with_a_warning(tmp_path):
    repo = _repo(tmp_path)
    res = _setup(repo, "cuda", gpu=True, TORCH_SPEC="torch==2.9.1")
    cmds = _plan(res)
    assert _torch_installs(cmds) == ["torch==2.9.1"]
    assert "TORCH_SPEC=torch==2.9.1" in res.stderr and "may not match" in res.stderr
    assert len(_syncs(cmds)) == 2 and any("import flash_attn" in c for c in cmds)


def test_cuda_extra_without_a_visible_gpu_still_gets_the_cuda_torch(tmp_path):
    repo = _repo(tmp_path)  # e.g. a cluster's login node
    res = _setup(repo, "cuda", gpu=False, TORCH_CUDA="cu126")
    cmds = _plan(res)
    assert "no CUDA GPU visible" in res.stdout
    assert _torch_installs(cmds) == ["torch==2.8.0+cu126 --index https://download.pytorch.org/whl/cu126"]


def test_gpu_without_cuda_extra_gets_the_cuda_torch_but_no_kernels(tmp_path):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, "slurm", gpu=True))
    assert _torch_installs(cmds) == ["torch==2.8.0+cu128 --index https://download.pytorch.org/whl/cu128"]
    assert cmds[-1] == f"{UV} sync --locked --inexact --no-install-package torch --extra slurm"
    assert not any("import " in c or "SKIP_CUDA_BUILD" in c for c in cmds)


@pytest.mark.parametrize("extras", ["dev,interp", ""])
def test_cpu_plan(tmp_path, extras):
    repo = _repo(tmp_path)
    cmds = _plan(_setup(repo, *([extras] if extras else []), gpu=False))
    assert cmds[:2] == [
        f"{UV} venv --quiet --python {sys.executable} .venv",
        f"{UV} pip install --python {VPY} torch==2.13.0+cpu --index https://download.pytorch.org/whl/cpu",
    ]
    assert not any("import " in c or "uninstall" in c or "cu12" in c for c in cmds)
    syncs = _syncs(cmds)
    if not extras:
        assert cmds[2:] == [f"{UV} sync --locked --inexact --no-install-package torch"]
        return
    assert len(cmds) == 4 and len(syncs) == 2
    (env1, first), (env2, second) = syncs
    assert env1 == {} and first == [
        "--locked", "--inexact", "--no-install-package", "torch", "--extra", "dev", "--extra", "interp",
        "--group", "build", "--no-install-package", "flash-attn", "--no-install-package", "causal-conv1d",
        "--no-install-package", "mamba-ssm",
    ]  # fmt: skip
    assert env2 == {
        "MAMBA_SKIP_CUDA_BUILD": "TRUE",
        "MAMBA_FORCE_BUILD": "TRUE",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
        "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
    }
    assert second == first[:10]  # the same sync, now building the kernels' Python parts


def test_cpu_torch_from_a_find_links_folder_of_pips_configuration(tmp_path):
    """uv does not read pip's configuration: a find-links folder named there (here PIP_FIND_LINKS) that holds the
    CPU torch wheel is used instead of PyTorch's index (a machine with a local wheel mirror and no route to it)."""
    repo = _repo(tmp_path)
    links = tmp_path / "links"
    links.mkdir()
    (links / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    res = _setup(repo, gpu=False, PIP_FIND_LINKS=f"/nowhere {links}")
    assert _torch_installs(_plan(res)) == [f"torch==2.13.0+cpu --find-links {links}"]
    assert f"from pip's find-links folder {links}" in res.stdout


def test_a_venv_with_torch_is_synced_without_installing_torch(tmp_path):
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=("2.13.0+cpu", None))
    cmds = _plan(_setup(repo, "dev", gpu=False))
    assert cmds == [f"{UV} sync --locked --inexact --no-install-package torch --extra dev"]  # no venv, no torch


@pytest.mark.parametrize(
    "extras, gpu, env, names",
    [
        ("dev,interp,cuda", False, {}, ["'interp'", "triton==3.9.0", "dev,cuda"]),
        ("dev,interp", True, {}, ["'interp'", "CPU test tier", "without a GPU"]),
        ("cuda", True, {"TORCH_CUDA": "cu130"}, ["TORCH_CUDA='cu130'", "cu126, cu128, cu129"]),
        ("--cuda", True, {}, ["'--cuda'", "--check-kernels"]),
        ("dev,interp", False, {"FAKE_PY": "3.10"}, ["'interp' needs Python >= 3.11", "PYTHON=python3.11"]),
        ("dev", False, {"FAKE_UNAME": "Darwin"}, ["uv.lock covers Linux only", "pip install -e"]),
    ],
)
def test_bad_requests_are_refused_before_any_work(tmp_path, extras, gpu, env, names):
    repo = _repo(tmp_path)
    bindir = tmp_path / "fakes"
    bindir.mkdir()
    if "FAKE_PY" in env:  # a python3 that is 3.10: what setup.sh asks it is its version
        py = bindir / "python3.10"
        py.write_text(f"#!/bin/sh\necho {env.pop('FAKE_PY')}\n")
        py.chmod(0o755)
        env["PYTHON"] = str(py)
    if "FAKE_UNAME" in env:
        u = bindir / "uname"
        u.write_text(f"#!/bin/sh\necho {env.pop('FAKE_UNAME')}\n")
        u.chmod(0o755)
        env["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"
    res = _setup(repo, extras, gpu=gpu, **env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "+ " not in res.stdout and "[setup]" not in res.stdout  # nothing planned, not even the venv
    for name in names:
        assert name in res.stderr, res.stderr


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
    assert "uv pip uninstall --python .venv/bin/python flash-attn causal-conv1d mamba-ssm" in res.stderr
    assert "docs/gpu.md" in res.stderr


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
    torch_cmds = _torch_installs(cmds)
    if sys_site and venv:
        pyv = f"{sys.version_info[0]}.{sys.version_info[1]}"
        assert cmds[:2] == [
            f"{UV} venv --quiet --python {py} .venv",
            f"write .venv/lib/python{pyv}/site-packages/_base_python.pth: {_site_packages()}",
        ]
        assert torch_cmds == [] and f"has torch {base[0]}" in res.stdout and "is itself a venv" in res.stdout
    elif sys_site:
        assert cmds[0] == f"{UV} venv --quiet --python {py} --system-site-packages .venv"
        assert torch_cmds == [] and f"has torch {base[0]}" in res.stdout and "--system-site-packages" in res.stdout
    else:
        assert cmds[0] == f"{UV} venv --quiet --python {py} .venv"
        assert len(torch_cmds) == 1
    assert all(f"--extra {e}" in " ".join(a for _, args in _syncs(cmds) for a in args) for e in extras.split(","))


def test_an_existing_venv_without_torch_does_not_take_the_base_torch(tmp_path):
    repo = _repo(tmp_path)
    _fake_venv(repo)  # .venv exists and imports no torch:
    (repo / "fake_site" / "torch").mkdir()  # this interpreter's torch is hidden
    (repo / "fake_site" / "torch" / "__init__.py").write_text("raise ImportError('no torch in this venv')\n")
    py = _base_python(tmp_path, ("2.11.0+cu130", "13.0"))
    cmds = _plan(_setup(repo, "dev", gpu=True, PYTHON=str(py)))
    assert not any(" venv " in c for c in cmds)
    assert _torch_installs(cmds) == ["torch==2.8.0+cu128 --index https://download.pytorch.org/whl/cu128"]


# --- offline: --wheelhouse DIR -------------------------------------------------------------------------------------


def _locked() -> dict[str, list[str]]:
    """canonical name -> the versions uv.lock holds (the oracle for what a machine needs offline)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    out: dict[str, list[str]] = {}
    for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        out.setdefault(p["name"], []).append(p.get("version", ""))
    return out


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
    """The installs of an offline plan: each reads the wheelhouse only, none fetches torch or a kernel."""
    pips = [c for c in cmds if " pip " in c]
    pre = f"{UV} pip install --python {VPY} --offline --no-index --find-links {wh} --no-deps "
    assert pips and all(c.startswith(pre) for c in pips), cmds
    assert not any("--index " in c or "torch" in c.split() or "flash-attn" in c or " sync " in c for c in cmds)
    return [c[len(pre) :] for c in pips]


def test_wheelhouse_plan_keeps_the_venv_torch_and_reads_the_wheelhouse_only(tmp_path):
    """.venv with a CUDA torch and (through this interpreter) every locked package of .[dev] at its locked version:
    nothing is needed from the (empty) wheelhouse but canonlm itself."""
    repo = _repo(tmp_path)
    _fake_venv(repo, torch=("2.11.0+cu130", "13.0"))  # plus everything this venv has installed
    wh = tmp_path / "wh"
    wh.mkdir()
    res = _setup(repo, "--wheelhouse", str(wh), "dev", gpu=True)
    assert _offline_cmds(_plan(res), wh) == ["--no-build-isolation -e ."]
    assert "keeping torch 2.11.0+cu130 (CUDA 13.0) (in .venv)" in res.stdout
    assert re.search(rf"every locked requirement is met, \d+ already installed, 0 from {wh}$", res.stdout, re.M)
    assert "hf451" not in res.stdout.replace("not side-installed", "")


def test_wheelhouse_plan_with_the_base_interpreter_torch(tmp_path):
    repo = _repo(tmp_path)
    py = _base_python(tmp_path, ("2.11.0+cu130", "13.0"))  # the device image's python3
    wh = tmp_path / "wh"
    wh.mkdir()
    res = _setup(repo, "--wheelhouse", str(wh), "dev", gpu=True, PYTHON=str(py))
    cmds = _plan(res)
    assert cmds[0] == f"{UV} venv --quiet --python {py} .venv" and cmds[1].startswith("write .venv/lib/python")
    assert _offline_cmds(cmds, wh) == ["--no-build-isolation -e ."]


def test_wheelhouse_missing_packages_are_named_before_anything_is_written(tmp_path):
    """A fresh venv (no .venv, a CPU torch in python3: no --system-site-packages) has nothing installed: every locked
    package it needs must come from the wheelhouse. One line names each missing one at its locked version, and a
    wheel there for another Python; exit 2, no plan, no .venv. Locked versions read from uv.lock itself."""
    repo = _repo(tmp_path)
    wh = tmp_path / "wh"
    wh.mkdir()
    lock = _locked()
    (hydra,) = lock["hydra-core"]
    (omegaconf,) = lock["omegaconf"]
    (antlr,) = lock["antlr4-python3-runtime"]
    (einops,) = lock["einops"]
    pyyaml = lock["pyyaml"][0]
    _wheel(wh, "hydra-core", hydra)
    _wheel(wh, "omegaconf", omegaconf)
    _wheel(wh, "PyYAML", pyyaml, tag="cp39-cp39-manylinux_2_17_x86_64")  # for another Python
    _wheel(wh, "einops", einops)
    res = _setup(repo, "--wheelhouse", str(wh), gpu=False, PYTHON=str(_base_python(tmp_path, ("2.13.0+cpu", None))))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "+ " not in res.stdout and not (repo / ".venv").exists()
    (line,) = [x for x in res.stderr.splitlines() if "lacks" in x]  # one line
    named = re.search(r"lacks: (.*?) \(locked for ", line)[1]
    assert f"antlr4-python3-runtime=={antlr}" in named and "lightning==" in named and "fla-core==0.6.0" in named
    assert f"pyyaml=={pyyaml} (only PyYAML-{pyyaml}-cp39-cp39-manylinux_2_17_x86_64.whl)" in named
    for name in ("hydra-core", "omegaconf", "einops", "torch", "triton"):  # present, or never from a wheelhouse
        assert f"{name}==" not in named, name
    assert "bash scripts/wheelhouse.sh" in line and "--have" in line


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


def test_a_package_list_with_distribution_versions_is_read_without_them(tmp_path):
    """A system python3's package list may hold versions that are not PEP 440 (Debian's ``1.1build1``): they are
    skipped (never a locked version), and a name listed twice keeps its first version, the one Python imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wheelhouse_logic", ROOT / "scripts" / "wheelhouse.py")
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    f = tmp_path / "have.txt"
    f.write_text("distro-info==1.1build1\nPyYAML==6.0.4\npyyaml==5.4\n# a comment\n-e file:///x\n")
    assert {n: str(v) for n, v in w.have(str(f)).items()} == {"pyyaml": "6.0.4"}
