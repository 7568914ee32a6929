"""The offline install's two halves, on uv's lock: which locked files a target needs, and whether a wheelhouse has them.

The resolution is uv's: ``uv export`` walks uv.lock for the extras and groups asked for and writes one pinned line
per package with its environment markers. This script only evaluates those markers for a target and maps each pin
to the files uv.lock records for it. Python >= 3.10, the standard library and ``packaging`` (or pip's copy of it).

    wheelhouse.py build EXPORT LOCK --python-version X.Y[.Z] --platform TAG --have FILE --out DIR [--builder PY]
        (scripts/wheelhouse.sh, on a connected machine) the files of the pins whose markers hold on the target
        (CPython X.Y on the Linux wheel platform TAG) and that the target does not have at that version (--have: its
        ``pip list --format=freeze``), downloaded from uv.lock's URLs with their sha256 checked: the best wheel for
        the target's tags, else the sdist, built here into a wheel (``uv build``; mamba-ssm and causal-conv1d with
        their CUDA builds skipped, without isolation, by --builder, a Python with torch). Files already in DIR are
        kept. --also NAME==VERSION adds a locked package (uv itself, for the target). Writes DIR/pins.txt. Exit 2 naming what has neither a wheel for the target nor an sdist.
    wheelhouse.py check WHEELHOUSE EXPORT HAVE OUT EXTRAS
        (scripts/setup.sh --wheelhouse, on the target) the pins whose markers hold here and that are not installed at
        that version (HAVE: ``name==version`` lines), each checked against the wheels in WHEELHOUSE whose tags this
        interpreter supports. Writes them to OUT; exit 2 naming every missing one in one line, nothing else done.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import urllib.request

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags, sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare python3: pip's copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import compatible_tags, cpython_tags, sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import InvalidVersion, Version

#: sdists of the CUDA kernels: only their Python parts, built without isolation against --builder's torch
KERNEL_SDISTS = ("mamba-ssm", "causal-conv1d")
KERNEL_FLAGS = {
    "MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE",
    "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
}  # fmt: skip


def pins(export: str, env: dict | None) -> list[tuple[str, Version]]:
    """(canonical name, version) of each line of a ``uv export`` whose marker holds in ``env`` (None: here)."""
    out = []
    for line in open(export).read().splitlines():
        if not line.strip() or line.startswith(("#", "-")):
            continue
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(env):
            out.append((canonicalize_name(r.name), Version(next(iter(r.specifier)).version)))
    return out


def have(path: str) -> dict[str, Version]:
    """``name==version`` lines (``pip list --format=freeze``) as {canonical name: version}; other lines, and versions
    that are not PEP 440 (a distribution's ``1.1build1``: never a locked version), skipped. A name listed twice keeps
    its first version, the one Python imports."""
    out = {}
    for line in open(path).read().splitlines():
        n, sep, v = line.strip().partition("==")
        if sep:
            try:
                out.setdefault(canonicalize_name(n), Version(v))
            except InvalidVersion:
                continue
    return out


# --- the target's side ----------------------------------------------------------------------------------------------
def check(wh: str, export: str, have_file: str, out: str, extras: str) -> int:
    """The target's side (module docstring, ``check``): write to ``out`` the ``name==version`` pins of ``export`` that
    hold here and are not installed at that version (``have_file``), each with a wheel in ``wh`` this interpreter's
    tags accept. Returns 0, or 2 after one stderr line naming every missing pin (a wheel for another Python or
    platform named beside it); nothing is written then. ``extras`` only names the install in the messages."""
    here = set(sys_tags())
    ok, other = set(), {}
    for f in os.listdir(wh):
        if f.endswith(".whl"):
            n, v, _, tags = parse_wheel_filename(f)
            if tags & here:
                ok.add((n, v))
            else:
                other.setdefault((n, v), f)
    installed = have(have_file)
    need, missing, kept = [], [], 0
    for n, v in pins(export, None):
        if installed.get(n) == v:
            kept += 1
        elif (n, v) in ok:
            need.append(f"{n}=={v}")
        else:
            missing.append(f"{n}=={v}" + (f" (only {other[n, v]})" if (n, v) in other else ""))
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    tag = next(str(t) for t in sys_tags())
    if missing:
        what = f"canonlm[{extras}]" if extras else "canonlm"
        plat = next((t.platform for t in sys_tags() if t.platform.startswith("manylinux_")), "")
        opt = (f"--extras {extras} " if extras else "") + (f"--platform {plat} " if plat else "")
        print(
            f"[setup] ERROR: offline, the wheelhouse {wh} lacks: {', '.join(missing)} (locked for {what} on Python "
            f"{py}, {tag}); nothing was installed. Rebuild it on a connected machine: bash scripts/wheelhouse.sh "
            f"{opt}--python-version {py} --have <`pip list --format=freeze` of the Python .venv uses> --out DIR "
            "(docs/gpu_node.md)",
            file=sys.stderr,
        )
        return 2
    with open(out, "w") as f:
        f.write("".join(x + "\n" for x in need))
    print(
        f"[setup] wheelhouse check (Python {py}, {tag}): every locked requirement is met, {kept} already installed, "
        f"{len(need)} from {wh}"
    )
    return 0


# --- the connected side ---------------------------------------------------------------------------------------------
def target_tags(pyver: str, platform: str) -> list:
    """The tags a CPython ``pyver`` on ``platform`` (manylinux_2_Y_ARCH) installs, best first, as pip's --platform
    expands them: every older manylinux_2_y, and the legacy aliases manylinux2014 / 2010 / 1."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    plats = []
    for y in range(int(m[1]), 4, -1):
        plats.append(f"manylinux_2_{y}_{m[2]}")
        plats += {17: [f"manylinux2014_{m[2]}"], 12: [f"manylinux2010_{m[2]}"], 5: [f"manylinux1_{m[2]}"]}.get(y, [])
    v = tuple(int(x) for x in pyver.split(".")[:2])
    return list(cpython_tags(v, platforms=plats)) + list(compatible_tags(v, f"cp{v[0]}{v[1]}", plats))


def target_env(pyver: str, platform: str) -> dict:
    """The marker environment of CPython ``pyver`` on Linux ``platform``."""
    full = pyver if pyver.count(".") == 2 else pyver + ".0"
    arch = re.fullmatch(r"manylinux_2_\d+_(\w+)", platform)[1]
    return {
        **default_environment(),
        "python_version": ".".join(pyver.split(".")[:2]), "python_full_version": full, "implementation_version": full,
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": arch, "os_name": "posix",
    }  # fmt: skip


def locked_files(lock: str) -> dict[tuple[str, Version], dict]:
    """(name, version) -> {"wheels": [{url, hash}], "sdist": {url, hash} or None} from uv.lock."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            from pip._vendor import tomli as tomllib
    with open(lock, "rb") as f:
        data = tomllib.load(f)
    return {
        (canonicalize_name(p["name"]), Version(p["version"])): {"wheels": p.get("wheels", []), "sdist": p.get("sdist")}
        for p in data["package"]
        if "version" in p
    }


def fetch(url: str, sha: str, dest: str) -> None:
    """Download ``url`` to ``dest`` (written whole, then renamed) and check its sha256 against uv.lock's."""
    tmp = dest + ".part"
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                h.update(chunk)
                f.write(chunk)
        if sha and f"sha256:{h.hexdigest()}" != sha:
            raise SystemExit(f"[wheelhouse] ERROR: {url}: sha256 {h.hexdigest()} is not uv.lock's {sha}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build(export, lock, pyver, platform, have_file, out, builder, uv, also=()) -> int:
    """The connected side (module docstring, ``build``): into ``out`` the uv.lock file of each pin of ``export`` whose
    marker holds on CPython ``pyver`` / ``platform`` and that ``have_file`` lacks at that version, plus ``also``
    (``NAME==VERSION`` pins of uv.lock); sdists built by ``uv`` (kernels by ``builder``). Writes ``out/pins.txt``
    ("pypi: FILE" / "built: FILE" lines). Returns 0, or 2 naming what has neither a fitting wheel nor an sdist.
    Raises SystemExit on a sha256 mismatch, a failed build, or a built wheel the target cannot install."""
    tags = target_tags(pyver, platform)
    rank = {t: i for i, t in enumerate(tags)}
    files = locked_files(lock)
    skip = have(have_file) if have_file else {}
    os.makedirs(out, exist_ok=True)
    got, built, missing = [], [], []
    extra = [(canonicalize_name(a.split("==")[0]), Version(a.split("==")[1])) for a in also]
    for n, v in pins(export, target_env(pyver, platform)) + extra:
        if skip.get(n) == v:
            continue
        entry = files.get((n, v), {"wheels": [], "sdist": None})
        best = None
        for w in entry["wheels"]:
            name = w["url"].rsplit("/", 1)[-1]
            r = min((rank[t] for t in parse_wheel_filename(name)[3] if t in rank), default=None)
            if r is not None and (best is None or r < best[0]):
                best = (r, name, w)
        if best:
            dest = os.path.join(out, best[1])
            if not os.path.exists(dest):
                fetch(best[2]["url"], best[2].get("hash", ""), dest)
            got.append(best[1])
        elif entry["sdist"]:
            built.append(build_sdist(n, v, entry["sdist"], out, builder, uv, tags))
        else:
            missing.append(f"{n}=={v}")
    if missing:
        print(
            f"[wheelhouse] ERROR: no wheel for CPython {pyver} / {platform} and no sdist in uv.lock: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    with open(os.path.join(out, "pins.txt"), "w") as f:  # read by wheelhouse.sh for its record, then removed
        f.write("".join(f"pypi: {x}\n" for x in got) + "".join(f"built: {x}\n" for x in built))
    return 0


def build_sdist(n, v, sdist, out, builder, uv, tags) -> str:
    """Build the sdist of ``n`` ``v`` into a wheel in ``out`` (kept when one is already there); its file name."""
    have_one = [
        f
        for f in os.listdir(out)
        if f.endswith(".whl") and parse_wheel_filename(f)[:2] == (n, v) and parse_wheel_filename(f)[3] & set(tags)
    ]
    if have_one:
        return have_one[0]
    work = os.path.join(out, ".build")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, sdist["url"].rsplit("/", 1)[-1])
    fetch(sdist["url"], sdist.get("hash", ""), src)
    cmd = [uv, "build", "--quiet", "--wheel", "--out-dir", work, src]
    env = dict(os.environ)
    if n in KERNEL_SDISTS:  # their setup.py imports torch: built by --builder, without isolation, CUDA skipped
        cmd += ["--no-build-isolation", "--python", builder]
        env.update(KERNEL_FLAGS)
    print(f"[wheelhouse] building {n} {v} from its sdist", file=sys.stderr)
    if subprocess.run(cmd, env=env).returncode != 0:
        raise SystemExit(f"[wheelhouse] ERROR: could not build {n} {v} from {src} (uv build's error is above)")
    whl = next(f for f in os.listdir(work) if f.endswith(".whl") and parse_wheel_filename(f)[:2] == (n, v))
    if not parse_wheel_filename(whl)[3] & set(tags):
        raise SystemExit(
            f"[wheelhouse] ERROR: {n} {v}: none of uv.lock's wheels fits the target (another Python or a newer "
            f"manylinux), and its sdist built here gives {whl}, which the target cannot install"
        )
    os.replace(os.path.join(work, whl), os.path.join(out, whl))
    return whl


def main(argv: list[str]) -> int:
    """``check`` / ``build`` as the module docstring gives them; anything else prints it and returns 2."""
    if argv[:1] == ["check"] and len(argv) == 6:
        return check(*argv[1:])
    if argv[:1] == ["build"]:
        import argparse

        p = argparse.ArgumentParser(prog="wheelhouse.py build")
        p.add_argument("export")
        p.add_argument("lock")
        for a in ("--python-version", "--platform", "--out", "--uv"):
            p.add_argument(a, required=True)
        p.add_argument("--have", default="")
        p.add_argument("--builder", default=sys.executable)
        p.add_argument("--also", action="append", default=[], help="NAME==VERSION of uv.lock to add (uv itself)")
        a = p.parse_args(argv[1:])
        return build(a.export, a.lock, a.python_version, a.platform, a.have, a.out, a.builder, a.uv, a.also)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
