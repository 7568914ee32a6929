"""scripts/wheelhouse.sh and ``scripts/setup.sh --wheelhouse``, for real: a wheelhouse of uv.lock's files built from
the package index, then installed from with ``--no-index`` into a fresh venv that already has torch, with no network.

The fresh venv is made as a GPU node's would be, cheaply: ``python -m venv --without-pip``, then the installed files
of this venv's pip and torch (and of torch's own requirements) are hard-linked into it, file by file from their
RECORD. The wheelhouse is built for that venv with ``--have`` = its ``pip list --format=freeze``, and setup.sh runs
under ``unshare -rn`` (no network namespace) where the kernel lets it, else with every proxy pointed at a closed port,
with an empty user cache, so that uv itself comes from the wheelhouse too.

The three tests that build or install are marked ``slow`` (the wheelhouse builds need the package index); the
refusals of bad input run in a fraction of a second, before anything is fetched.

Oracles: uv.lock itself (every wheel is a locked version), ``uv pip check`` in the installed venv, the venv's
``uv pip list`` before and after (torch kept, nothing installed on a refused run), and the wheels' own METADATA
(Requires-Python, Requires-Dist markers evaluated by ``packaging`` for an explicit target environment).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
NEVER = re.compile(r"^(torch|triton|nvidia-.*)$")
NO_DEPS = {"mamba-ssm": "2.3.1", "causal-conv1d": "1.6.2.post1"}  # their Python parts: torch / triton are the node's
UV = str(Path(sys.executable).parent / "uv")


def _env(**extra: str) -> dict[str, str]:
    """This environment without what would steer the scripts elsewhere (a venv's PYTHON, a bytecode switch that makes
    setup.sh compile the whole venv)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHON", "SETUP_DRY_RUN", "PYTHONDONTWRITEBYTECODE", "TORCH_SPEC", "VIRTUAL_ENV")
    }
    env.update(extra)
    return env


def _run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _can_download(tmp: Path) -> None:
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/iniconfig/", timeout=60).read(1)
    except OSError as e:
        pytest.skip(f"the package index cannot be reached from here: {e}")


def _repo(tmp: Path) -> Path:
    """A copy of the project as setup.sh installs it (scripts, pyproject, README, src), without this checkout's
    .venv."""
    repo = tmp / "repo"
    (repo / "scripts").mkdir(parents=True)
    for s in ("setup.sh", "_uv.sh", "wheelhouse.sh", "wheelhouse.py", "gpu_check.sh", "gpu_check.py"):
        shutil.copy(ROOT / "scripts" / s, repo / "scripts" / s)
    for f in ("pyproject.toml", "uv.lock", "README.md"):
        shutil.copy(ROOT / f, repo / f)
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return repo


def _closure(names) -> list:
    """The installed distributions ``names`` and everything they require here, extras included (markers for this
    Python)."""
    todo, seen, out = [(n, ()) for n in names], set(), {}
    while todo:
        name, extras = todo.pop()
        name = canonicalize_name(name)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = md.distribution(name)
        out[name] = dist
        for r in map(Requirement, dist.requires or []):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((r.name, tuple(sorted(r.extras))))
    return list(out.values())


def _venv_with_torch(dest: Path) -> None:
    """A fresh venv at ``dest`` holding this venv's torch (with torch's requirements), hard-linked file by file from
    their RECORD (copied where a hard link cannot be made). Nothing of this venv is written to: uv replaces files by
    unlinking, never in place."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next(dest.glob("lib/python*/site-packages"))
    for dist in _closure(["torch"]):
        _link_dist(dist, site)


def _link_dist(dist, site: Path) -> None:
    """Hard-link (else copy) the installed files of ``dist`` into ``site``, skipping console scripts (paths outside
    site-packages) and files already there."""
    base = Path(dist.locate_file(""))
    for f in dist.files or []:
        src, dst = base / f, site / f
        if str(f).startswith("..") or not src.is_file() or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def _freeze(py: Path) -> dict[str, str]:
    """What the venv of ``py`` has installed (``uv pip list``, editable installs too), canonical name -> version."""
    import json

    res = _run([UV, "pip", "list", "--python", str(py), "--format", "json"], env=_env())
    assert res.returncode == 0, res.stderr
    return {canonicalize_name(d["name"]): d["version"] for d in json.loads(res.stdout)}


def _check(py: Path) -> set[str]:
    """The packages whose requirements are not met in the venv of ``py`` (``uv pip check``)."""
    res = _run([UV, "pip", "check", "--python", str(py)], env=_env())
    found = {canonicalize_name(m) for m in re.findall(r"The package `([^`]+)` requires", res.stdout + res.stderr)}
    assert (res.returncode == 0) == (not found), res.stdout + res.stderr  # a failure it could not read is no pass
    return found


def _offline(cmd: list[str]) -> list[str]:
    """``cmd`` with no network: in a new network namespace where that works, else as it is (proxies set by
    :func:`_offline_env` then catch any download)."""
    if shutil.which("unshare") and _run(["unshare", "-rn", "true"]).returncode == 0:
        return ["unshare", "-rn", *cmd]
    return cmd


def _offline_env(home: Path) -> dict[str, str]:
    """No PIP_FIND_LINKS of this machine; an index and proxies that lead nowhere; an empty user cache at ``home``
    (no uv installed earlier, no uv cache)."""
    dead = "http://127.0.0.1:9"
    home.mkdir(exist_ok=True)
    env = _env(
        XDG_CACHE_HOME=str(home),
        http_proxy=dead,
        https_proxy=dead,
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        ALL_PROXY=dead,
        PIP_INDEX_URL=dead + "/simple",
    )
    env.pop("PIP_FIND_LINKS", None)
    return env


def _locked() -> set[tuple[str, str]]:
    """(canonical name, version) of every package uv.lock holds."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return {
        (p["name"], p["version"]) for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"] if "version" in p
    }


def _wheels(wh: Path) -> dict[str, str]:
    """canonical name -> file name of each wheel in ``wh``."""
    return {canonicalize_name(parse_wheel_filename(f.name)[0]): f.name for f in wh.glob("*.whl")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project copy whose .venv has torch only, and a wheelhouse built for exactly that venv (``--have``)."""
    tmp = tmp_path_factory.mktemp("wheelhouse")
    _can_download(tmp)
    repo = _repo(tmp)
    _venv_with_torch(repo / ".venv")
    have = _freeze(repo / ".venv" / "bin" / "python")
    assert "torch" in have and "hydra-core" not in have
    (tmp / "have.txt").write_text("".join(f"{n}=={v}\n" for n, v in have.items()))
    wh = tmp / "wh"
    res = _run(
        ["bash", str(repo / "scripts" / "wheelhouse.sh"), "--have", str(tmp / "have.txt"), "--out", str(wh)],
        env=_env(PYTHON=sys.executable, UV=UV),
        cwd=tmp,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return repo, wh, have


@pytest.mark.slow
def test_wheelhouse_installs_offline_into_a_venv_that_has_torch(built, tmp_path):
    repo, wh, have = built
    vpy = repo / ".venv" / "bin" / "python"
    wheels = _wheels(wh)
    # what the wheelhouse holds: never torch & co, nothing the venv has at that version, the lock's versions only,
    # the kernels' Python parts and the sdists built here, and uv for the node
    assert not [n for n in wheels if NEVER.match(n)]
    versions = {n: str(parse_wheel_filename(f)[1]) for n, f in wheels.items()}
    assert not {(n, v) for n, v in versions.items()} & set(have.items()), "a wheel of something the target has"
    assert set(versions.items()) <= _locked()
    for name in ("hydra-core", "omegaconf", "antlr4-python3-runtime", "fla-core", "mamba-ssm", "causal-conv1d"):
        assert name in wheels, name
    for name in ("lightning", "numpy", "uv", "setuptools", "wheel"):
        assert name in wheels or name in have, name
    for name in ("antlr4-python3-runtime", "mamba-ssm", "causal-conv1d"):  # sdists on PyPI: built here
        assert wheels[name].endswith("-py3-none-any.whl")
    assert versions["mamba-ssm"] == NO_DEPS["mamba-ssm"] and versions["causal-conv1d"] == NO_DEPS["causal-conv1d"]
    assert "install there: bash scripts/setup.sh --wheelhouse" in (wh / "wheelhouse.txt").read_text()
    setup = ["bash", str(repo / "scripts" / "setup.sh"), "--wheelhouse"]

    # a wheelhouse that lacks one package: named in one line at its locked version, exit 2, nothing installed
    partial = tmp_path / "partial"
    shutil.copytree(wh, partial)
    (partial / wheels["antlr4-python3-runtime"]).unlink()
    res = _run(_offline([*setup, str(partial)]), env=_offline_env(tmp_path / "home1"))
    assert res.returncode == 2, res.stdout + res.stderr
    antlr = f"antlr4-python3-runtime=={versions['antlr4-python3-runtime']}"
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("[setup] ERROR")]
    assert f"lacks: {antlr} (locked for canonlm on Python" in line, res.stderr
    assert "Traceback" not in res.stderr
    assert _freeze(vpy) == have
    # gpu_check.sh's install phase (setup.sh, as on a node) reports it in its table and goes on
    check = [
        "bash",
        str(repo / "scripts" / "gpu_check.sh"),
        "--skip",
        "facts,restore,warmup,selfcheck,pytest,bench,pack",
    ]
    res = _run(
        _offline([*check, "--wheelhouse", str(partial), "--out", str(tmp_path / "o1")]),
        env=_offline_env(tmp_path / "home2"),
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(
        rf"^\| install \| FAIL \(exit 2\) \| \d+ \| \d+ \| missing: {re.escape(antlr)} \|$", res.stdout, re.M
    ), res.stdout[-1500:]

    # the whole wheelhouse: every install reads the wheelhouse only ...
    plan = _run([*setup, str(wh)], env=_env(SETUP_DRY_RUN="1", UV=UV))
    assert plan.returncode == 0, plan.stderr
    cmds = [c[2:] for c in plan.stdout.splitlines() if c.startswith("+ ")]
    assert len(cmds) == 2 and all(f" --offline --no-index --find-links {wh} --no-deps " in c for c in cmds), cmds
    # ... and it installs with no network at all (through gpu_check.sh's install phase, as on a node), uv from it too
    home = tmp_path / "home3"
    res = _run(_offline([*check, "--wheelhouse", str(wh), "--out", str(tmp_path / "o2")]), env=_offline_env(home))
    assert res.returncode == 0, res.stdout + res.stderr
    n_from_wh = len([n for n in wheels if n != "uv"])  # uv is for setup.sh itself
    assert re.search(
        rf"^\| install \| OK \| \d+ \| \d+ \| keeping torch {re.escape(have['torch'])} \(CUDA None\) "
        rf"\(in \.venv\); {n_from_wh} packages from the wheelhouse \|$",
        res.stdout,
        re.M,
    ), res.stdout[-3000:]
    assert (home / "canonlm" / f"uv-{versions['uv']}" / "bin" / "uv").exists()  # installed from the wheelhouse
    after = _freeze(vpy)
    assert after["torch"] == have["torch"]
    assert after["mamba-ssm"] == NO_DEPS["mamba-ssm"] and after["causal-conv1d"] == NO_DEPS["causal-conv1d"]
    assert after["fla-core"] == "0.6.0"
    res_import = _run(
        [str(vpy), "-c", "import canonlm, hydra, omegaconf, lightning; print(canonlm.__file__)"], env=_env()
    )
    assert res_import.returncode == 0, res_import.stderr
    assert Path(res_import.stdout.strip()).is_relative_to(repo / "src")  # the editable install of the copy
    # pip's own check: every requirement of every installed distribution met, but the kernels' torch-side ones
    assert _check(vpy) <= set(NO_DEPS)  # their wheels' own METADATA still names triton / transformers


def _python310() -> str | None:
    """A Python 3.10 that runs here (a pyenv shim may exist and refuse), or None."""
    pyenv = sorted(map(str, Path.home().glob(".pyenv/versions/3.10.*/bin/python3.10")))
    for cand in [shutil.which("python3.10"), *pyenv]:
        probe = "import sys, venv; assert sys.version_info[:2] == (3, 10)"
        if cand and _run([cand, "-c", probe], timeout=60).returncode == 0:
            return cand
    return None


@pytest.mark.slow
def test_wheelhouse_for_another_python_takes_its_wheels_and_markers(tmp_path):
    """Built here (this Python) for CPython 3.10 / manylinux_2_28 with a --have that lists everything this venv has
    except pytest, hydra-core, omegaconf, PyYAML and their own requirements: every wheel is a version uv.lock holds,
    installable on the target (its Requires-Python admits 3.10, its tags a cp310 manylinux_2_28-or-older platform),
    with pytest's requirements whose markers hold on 3.10 (tomli, exceptiongroup: ``python_version < "3.11"``), and
    it installs into a real Python 3.10 venv offline where one exists."""
    _can_download(tmp_path)
    left_out = {
        "pytest",
        "iniconfig",
        "pluggy",
        "hydra-core",
        "omegaconf",
        "antlr4-python3-runtime",
        "pyyaml",
        "tomli",
        "exceptiongroup",
    }
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()}
    assert {"fla-core", "mamba-ssm", "causal-conv1d", "torch"} <= set(have)
    (tmp_path / "have.txt").write_text("".join(f"{n}=={v}\n" for n, v in have.items() if n not in left_out))
    wh = tmp_path / "wh"
    res = _run(
        [
            "bash",
            str(ROOT / "scripts" / "wheelhouse.sh"),
            "--extras",
            "dev",
            "--python-version",
            "3.10",
            "--platform",
            "manylinux_2_28_x86_64",
            "--have",
            str(tmp_path / "have.txt"),
            "--out",
            str(wh),
        ],
        env=_env(PYTHON=sys.executable, UV=UV),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    wheels = _wheels(wh)
    assert {(n, str(parse_wheel_filename(f)[1])) for n, f in wheels.items()} <= _locked()
    # the oracle for pytest's requirements: its own METADATA, markers evaluated for a 3.10 Linux x86_64 target
    target = {
        **default_environment(),
        "python_version": "3.10",
        "python_full_version": "3.10.0",
        "implementation_version": "3.10.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }
    import zipfile
    from email.parser import Parser

    from packaging.specifiers import SpecifierSet

    def meta(name):
        with zipfile.ZipFile(wh / wheels[name]) as z:
            text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        return Parser().parsestr(text)

    reqs = [Requirement(r) for r in meta("pytest").get_all("Requires-Dist")]
    on_310 = {canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate({**target, "extra": ""})}
    assert {"tomli", "exceptiongroup"} <= on_310 and "colorama" not in on_310
    assert {"pytest", "hydra-core", "omegaconf", "antlr4-python3-runtime", "pyyaml", "tomli", "exceptiongroup"} <= set(
        wheels
    )
    for name in wheels:  # each installs on 3.10
        assert SpecifierSet(meta(name).get("Requires-Python") or "").contains("3.10.0"), wheels[name]
    assert wheels["antlr4-python3-runtime"].endswith("-py3-none-any.whl")
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    ok_platforms = {f"manylinux_2_{y}_x86_64" for y in range(5, 29)} | {f"{v}_x86_64" for v in legacy.values()}
    tags = parse_wheel_filename(wheels["pyyaml"])[3]
    assert any(t.interpreter == "cp310" and t.platform in ok_platforms for t in tags), wheels["pyyaml"]
    py310 = _python310()
    if py310 is None:  # the wheelhouse was checked above; no 3.10 to install into
        return
    venv = tmp_path / "v310"
    subprocess.run([py310, "-m", "venv", str(venv)], check=True)
    # every wheel installs on a real 3.10 (pip refuses a wheel whose tags it does not support); the fresh venv lacks
    # what --have listed, so without their requirements, and what imports without them is imported: PyYAML's C
    # extension (CSafeLoader exists only when it loaded), omegaconf on the wheel built here, tomli
    inst = _run(
        _offline(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                *map(str, sorted(wh.glob("*.whl"))),
            ]
        ),
        env=_offline_env(tmp_path / "home") | {"PIP_CONFIG_FILE": os.devnull},
    )
    assert inst.returncode == 0, inst.stdout + inst.stderr
    imp = _run([str(venv / "bin" / "python"), "-c", "import omegaconf, tomli, iniconfig; from yaml import CSafeLoader"])
    assert imp.returncode == 0, imp.stderr


@pytest.mark.slow
def test_base_python_that_is_a_venv_lends_its_torch_and_packages(tmp_path):
    """The device image's case, offline: python3 is itself a venv holding a CUDA torch (2.11.0+cu130) and canonlm's
    other requirements; .venv does not exist. setup.sh makes .venv see that venv's packages (a nested venv's
    --system-site-packages would not: it shows the interpreter the outer venv was made from) and installs canonlm
    from an empty wheelhouse, since everything is there. The outer venv here: this venv's files of canonlm's
    requirements hard-linked into a fresh venv, with a stand-in torch (a CUDA build cannot run here); nothing is
    imported from it but torch's version."""
    base = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base)], check=True)
    site = next(base.glob("lib/python*/site-packages"))
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    deps = [
        Requirement(r).name for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    keep = [d for d in deps if canonicalize_name(d) != "torch"]
    for dist in _closure(["setuptools", "wheel", "packaging", "ninja", "psutil", "fla-core", *NO_DEPS, *keep]):
        if canonicalize_name(dist.metadata["Name"]) != "torch":
            _link_dist(dist, site)
    (site / "torch").mkdir(exist_ok=True)
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.11.0+cu130'\nclass version:\n    cuda = '13.0'\n"
        "class _C:\n    _GLIBCXX_USE_CXX11_ABI = True\nclass cuda:\n    is_available = staticmethod(lambda: False)\n"
    )
    (site / "torch-2.11.0+cu130.dist-info").mkdir()
    (site / "torch-2.11.0+cu130.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n"
    )
    repo = _repo(tmp_path)
    wh = tmp_path / "empty-wheelhouse"
    wh.mkdir()
    res = _run(  # uv: this venv's (a node has it from its wheelhouse; this one is empty)
        _offline(["bash", str(repo / "scripts" / "setup.sh"), "--wheelhouse", str(wh)]),
        env=_offline_env(tmp_path / "home") | {"PYTHON": str(base / "bin" / "python"), "UV": UV},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "is itself a venv" in res.stdout and "keeping torch 2.11.0+cu130 (CUDA 13.0)" in res.stdout
    vpy = repo / ".venv" / "bin" / "python"
    assert "include-system-site-packages = false" in (repo / ".venv" / "pyvenv.cfg").read_text()
    probe = (
        "import importlib.metadata as md, torch, hydra, omegaconf, sys; print(torch.__version__); "
        "print(md.distribution('canonlm').locate_file('')); print(hydra.__file__)"
    )
    out = _run([str(vpy), "-c", probe], env=_env()).stdout.split()
    assert out[0] == "2.11.0+cu130"  # base's torch, seen through the .pth file
    assert Path(out[1]).resolve().is_relative_to((repo / ".venv").resolve())  # canonlm installed into .venv ...
    assert Path(out[2]).is_relative_to(site)  # ... hydra from base, not installed again
    assert _freeze(vpy).get("canonlm") is not None


@pytest.mark.parametrize(
    "args, names",
    [
        (["--extras", "devv"], ["--extras 'devv': unknown extra 'devv'", "dev", "slurm"]),
        (["--extras", "dev,cuda"], ["'cuda' cannot go into a wheelhouse"]),
        (["--extras", "interp"], ["'interp' cannot go into a wheelhouse"]),
        (["--python-version", "3"], ["--python-version '3' (allowed: X.Y or X.Y.Z"]),
        (["--platform", "win_amd64"], ["--platform 'win_amd64'", "manylinux_2_28_x86_64"]),
        (["--have", "nowhere.txt"], ["--have 'nowhere.txt': no such readable file"]),
        (["--have", "BAD"], ["line 2: 'torch 2.11' is not 'name==version'"]),
        (["--extras"], ["--extras needs a value"]),
        (["--wheelhouse", "x"], ["unknown argument '--wheelhouse'"]),
    ],
)
def test_bad_input_is_refused_before_anything_is_fetched_or_written(tmp_path, args, names):
    (tmp_path / "BAD").write_text("numpy==2.5.2\ntorch 2.11\n")
    args = [str(tmp_path / "BAD") if a == "BAD" else a for a in args]
    res = _run(
        ["bash", str(ROOT / "scripts" / "wheelhouse.sh"), "--out", str(tmp_path / "wh"), *args],
        env=_env(PYTHON=sys.executable, http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9"),
        cwd=tmp_path,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == "" and not (tmp_path / "wh").exists()
    for n in names:
        assert n in res.stderr, res.stderr
