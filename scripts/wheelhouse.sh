#!/usr/bin/env bash
# Build a wheelhouse: a folder of wheels from which `bash scripts/setup.sh --wheelhouse DIR` installs canonlm on a
# machine without network (a cluster's compute node, an air-gapped GPU node). Run it here, on a connected machine.
#
#   bash scripts/wheelhouse.sh [--extras LIST] [--python-version X.Y[.Z]] [--platform TAG] [--have FILE] [--out DIR]
#
#   --extras LIST          canonlm's extras to cover, e.g. dev or dev,slurm (default: none). Not cuda / interp: offline,
#                          setup.sh installs neither (docs/gpu_node.md)
#   --python-version V     the target's Python (default: that of the Python running this script)
#   --platform TAG         the target's wheel platform (default manylinux_2_28_<this machine's arch>: glibc >= 2.28);
#                          every older manylinux tag is accepted too, as on the target itself
#   --have FILE            the target's `python3 -m pip list --format=freeze`: what it already has at a version that
#                          meets canonlm's requirements is left out (a wheelhouse carried to a node stays small)
#   --out DIR              where the wheels go (default: ./wheelhouse); wheels already there are kept, never replaced
#   PYTHON=...             the Python that builds the pure-Python wheels (default .venv/bin/python, else python3); it
#                          needs torch, setuptools, wheel and packaging to build mamba-ssm's and causal-conv1d's
#
# What goes in: canonlm's dependencies for the extras (pyproject.toml) and everything they require, canonlm's build
# requirements (setup.sh builds it offline without isolation), fla-core at the version the interp extra pins, and the
# pure-Python parts of mamba-ssm and causal-conv1d at the versions the cuda extra pins. Never torch, triton or
# nvidia-*: they come with the target's torch.
#
# How: the target's installed packages (--have; without it, a torch) are stood in for by metadata-only distributions,
# and pip's own resolver (`pip install --dry-run --report`, pip >= 23.3, fetched when the running one is older) decides
# what the target lacks, with the target's --python-version / --platform / --only-binary=:all:, and environment markers
# evaluated for the target (pip evaluates them for the running Python otherwise). What has no wheel (an sdist such as
# antlr4-python3-runtime) is built here into a pure-Python wheel first; mamba-ssm and causal-conv1d with
# MAMBA_SKIP_CUDA_BUILD / MAMBA_FORCE_BUILD / CAUSAL_CONV1D_SKIP_CUDA_BUILD / CAUSAL_CONV1D_FORCE_BUILD=TRUE,
# --no-build-isolation --no-deps (as setup.sh's interp step installs them). Then `pip download --no-deps` fetches
# exactly the resolved wheels. A wheelhouse.txt in DIR records the target and the list. Exit 2 on bad input or when
# something has no wheel for the target, naming it.
set -euo pipefail
die() { echo "[wheelhouse] ERROR: $*" >&2; exit 2; }
USAGE="usage: bash scripts/wheelhouse.sh [--extras LIST] [--python-version X.Y[.Z]] [--platform TAG] [--have FILE] [--out DIR]"

extras="" pyver="" platform="" have="" out="wheelhouse"
while [ $# -gt 0 ]; do
  case "$1" in
    --extras|--python-version|--platform|--have|--out)
      [ $# -ge 2 ] || die "$1 needs a value ($USAGE)"
      case "$1" in --extras) extras=$2 ;; --python-version) pyver=$2 ;; --platform) platform=$2 ;;
                   --have) have=$2 ;; --out) out=$2 ;; esac
      shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' ($USAGE)" ;;
  esac
  shift
done
[ -n "$out" ] || die "--out needs a directory"
[ ! -e "$out" ] || [ -d "$out" ] || die "--out '$out' exists and is not a directory"
case "$out" in /*) ;; *) out=$PWD/$out ;; esac             # created once every input has been checked
if [ -n "$have" ]; then
  [ -f "$have" ] && [ -r "$have" ] || die "--have '$have': no such readable file (the target's \`python3 -m pip list --format=freeze\`)"
  have=$(cd "$(dirname "$have")" && pwd)/$(basename "$have")
  bad=$(grep -nvE '^[[:space:]]*(#.*)?$|^[A-Za-z0-9][A-Za-z0-9._-]*==[^[:space:];]+[[:space:]]*$' "$have" | head -n 1 || true)
  [ -z "$bad" ] || die "--have $have line ${bad%%:*}: '${bad#*:}' is not 'name==version' (write the file with
\`python3 -m pip list --format=freeze\` on the target)"
fi
cd "$(dirname "$0")/.."
BPY=${PYTHON:-}
if [ -z "$BPY" ]; then if [ -x .venv/bin/python ]; then BPY=.venv/bin/python; else BPY=python3; fi; fi
if [[ $BPY == */* ]]; then BPY=$(cd "$(dirname "$BPY")" && pwd)/$(basename "$BPY"); fi     # absolute, not resolved
"$BPY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null || die "PYTHON='$BPY' is not a Python >= 3.10"
# pip, with one line of noise left out: a --find-links / --extra-index-url folder of the user's pip configuration
# that lacks a project's subfolder
pipq() { "$BPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if [ -z "$pyver" ]; then pyver=$("$BPY" -c 'import platform; print(platform.python_version())'); fi
[[ $pyver =~ ^3\.[0-9]+(\.[0-9]+)?$ ]] || die "--python-version '$pyver' (allowed: X.Y or X.Y.Z, e.g. 3.12 or 3.12.3)"
if [ -z "$platform" ]; then platform=manylinux_2_28_$(uname -m); fi
[[ $platform =~ ^(manylinux|musllinux|linux)_[A-Za-z0-9_]+$ ]] \
  || die "--platform '$platform' (allowed: a Linux wheel platform tag such as manylinux_2_28_x86_64 or manylinux_2_17_aarch64)"

# --- checks before any work -----------------------------------------------------------------------------------------
known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/s/^\([A-Za-z0-9_-]\+\) *=.*/\1/p' pyproject.toml | tr '\n' ' ')
IFS=, read -r -a asked <<<"$extras"
for e in "${asked[@]}"; do
  [[ " $known" == *" $e "* ]] || die "--extras '$extras': unknown extra '$e' (pyproject.toml defines: ${known% })"
  case "$e" in cuda|interp)
    die "--extras '$extras': '$e' cannot go into a wheelhouse (setup.sh installs neither offline: 'cuda' is flash-attn and
the CUDA builds that download from GitHub, 'interp' pins triton, which comes with torch). The kernels' Python parts
(fla-core, mamba-ssm and causal-conv1d without their CUDA ops) are always in the wheelhouse." ;;
  esac
done
T=$(mktemp -d "${TMPDIR:-/tmp}/canonlm-wheelhouse.XXXXXX")
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/local" "$T/fake" "$T/run"

# --- the helper: requirements, stand-ins for the target's packages, pip with the target's markers, reports ----------
cat >"$T/helper.py" <<'PYHELPER'
"""wheelhouse.sh's Python half (run with -S: it sees the standard library, the pip copy and the stand-ins only)."""
import json
import os
import re
import sys

NEVER = re.compile(r"^(torch|triton|nvidia-.*)$")      # they come with the target's torch
KERNELS = ("flash-attn", "mamba-ssm", "causal-conv1d")   # CUDA sdists: the last two as pure-Python wheels, below


def _packaging():
    try:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    except ImportError:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def _toml(path):
    try:
        import tomllib
    except ImportError:
        from pip._vendor import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def reqs(pyproject, extras, out_reqs, out_pins):
    """Write the requirement lines for the resolver, and the kernel pins (mamba-ssm, causal-conv1d) to build."""
    Requirement, canon = _packaging()
    proj = _toml(pyproject)
    opt = proj["project"]["optional-dependencies"]
    lines = list(proj["project"]["dependencies"])
    for e in [e for e in extras.split(",") if e]:
        lines += opt[e]
    lines += proj["build-system"]["requires"]
    pins = {canon(Requirement(r).name): r for r in opt["cuda"] + opt["interp"]}   # the interp extra's fla-core wins
    lines.append(pins["fla-core"])
    keep = []
    for line in lines:
        r = Requirement(line)
        name = canon(r.name)
        if NEVER.match(name) or name in KERNELS:
            continue
        r.extras = set() if name == "fla-core" else r.extras     # fla-core[cuda] only adds torch and triton
        keep.append(str(r))
    with open(out_reqs, "w") as f:
        f.write("\n".join(dict.fromkeys(keep)) + "\n")
    with open(out_pins, "w") as f:
        f.write(" ".join(pins[k] for k in ("mamba-ssm", "causal-conv1d")) + "\n")


def fake(have, site, torch_default, pins):
    """Metadata-only stand-ins for the target's distributions (``name==version`` lines), so that pip's resolver sees
    them as installed; a torch stands in when the list has none (never resolved, never downloaded). Prints how many,
    then the kernel pins (``pins``, space-separated) the target does not have."""
    Requirement, canon = _packaging()
    dists = {}
    if have:
        for n, line in enumerate(open(have), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
            if not m:
                sys.exit(f"[wheelhouse] ERROR: --have {have} line {n}: {line!r} is not 'name==version' (write it with "
                         "`python3 -m pip list --format=freeze` on the target)")
            dists[canon(m[1])] = (m[1], m[2])
    dists.setdefault("torch", ("torch", torch_default))
    for name, version in dists.values():
        d = os.path.join(site, f"{re.sub(r'[-.]+', '_', name)}-{version}.dist-info")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    print(len(dists) - (not have))
    todo = []
    for pin in pins.split():
        r = Requirement(pin)
        got = dists.get(canon(r.name))
        if not (have and got and r.specifier.contains(got[1], prereleases=True)):
            todo.append(pin)
    print(" ".join(todo))


def target_env(pyver, platform):
    """PEP 508 marker environment of the target (python_version, sys_platform, platform_machine, ...)."""
    full = pyver if pyver.count(".") == 2 else pyver + ".0"
    machine = re.sub(r"^(manylinux|musllinux|linux)(_\d+_\d+)?_", "", platform)
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
            "implementation_name": "cpython", "implementation_version": full,
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "platform_machine": machine, "platform_release": "", "platform_version": ""}


def platforms(platform):
    """The platform tags a target of ``platform`` accepts, newest first, as pip's own tag list for a machine of that
    glibc / musl does (packaging.tags: manylinux_2_Y down to 2_17, or 2_5 on x86_64 / i686, with the legacy aliases
    manylinux2014 / 2010 / 1; musllinux_1_Y down to 1_0). pip's --platform takes each literally, without this."""
    m = re.fullmatch(r"(manylinux|musllinux)_(\d+)_(\d+)_(\w+)", platform)
    if not m:
        print(platform)
        return
    kind, major, minor, arch = m[1], int(m[2]), int(m[3]), m[4]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    low = (5 if arch in ("x86_64", "i686") else 17) if kind == "manylinux" else 0
    for y in range(minor, low - 1, -1):
        print(f"{kind}_{major}_{y}_{arch}")
        if kind == "manylinux" and major == 2 and y in legacy:
            print(f"{legacy[y]}_{arch}")


def pip(pip_path, pyver, platform, *args):
    """Run pip from ``pip_path`` with environment markers evaluated for the target instead of this Python."""
    sys.path.insert(0, pip_path)
    from pip._vendor.packaging import markers

    host = markers.default_environment
    env = target_env(pyver, platform)
    markers.default_environment = lambda: {**host(), **env}
    from pip._internal.cli.main import main

    sys.exit(main(list(args)))


def _fake_dists(site):
    """canonical name -> (dist-info directory, name, version, enriched?) of the stand-ins in ``site``."""
    from email.parser import Parser

    _, canon = _packaging()
    out = {}
    for d in os.listdir(site):
        with open(os.path.join(site, d, "METADATA")) as f:
            m = Parser().parse(f)
        out[canon(m["Name"])] = (os.path.join(site, d), m["Name"], m["Version"], m.get("X-Wheelhouse-Enriched") == "yes")
    return out


def extras(report_path, reqs_path, site, pyver, platform):
    """Print ``name==version`` of each of the target's packages that something asks for with extras (e.g. lightning's
    ``fsspec[http]``) and whose stand-in does not carry its real requirements yet: an extra's requirements are read
    from the installed distribution's metadata, which a stand-in lacks until :func:`enrich` fills it in."""
    from email.parser import Parser

    Requirement, canon = _packaging()
    env = target_env(pyver, platform)
    fakes = _fake_dists(site)
    need = set()

    def visit(line, ctx):
        r = Requirement(line)
        if r.marker is not None and not any(r.marker.evaluate({**env, "extra": e}) for e in ("", *ctx)):
            return
        n = canon(r.name)
        if r.extras and n in fakes and not fakes[n][3] and not NEVER.match(n):
            need.add(n)

    for line in open(reqs_path):
        if line.strip():
            visit(line.strip(), ())
    for item in json.load(open(report_path))["install"]:
        for d in item["metadata"].get("requires_dist") or []:
            visit(d, tuple(item.get("requested_extras") or ()))
    for path, *_ in fakes.values():                            # the real requirements of stand-ins already filled in
        with open(os.path.join(path, "METADATA")) as f:
            for d in Parser().parse(f).get_all("Requires-Dist") or []:
                visit(d, ())
    for n in sorted(need):
        print(f"{fakes[n][1]}=={fakes[n][2]}")


def enrich(meta_dir, site, names):
    """Write each stand-in of ``names`` (``name==version``, space-separated) again, with the Requires-Dist and
    Provides-Extra that the reports in ``meta_dir`` (``pip install --dry-run --no-deps --report``) give for that
    release, and mark it filled in (also when no report has it: then warn)."""
    _, canon = _packaging()
    fakes = _fake_dists(site)
    got = {}
    for rep in os.listdir(meta_dir):
        for item in json.load(open(os.path.join(meta_dir, rep)))["install"]:
            m = item["metadata"]
            got[canon(m["name"])] = ([f"Provides-Extra: {e}" for e in m.get("provides_extra") or []]
                                     + [f"Requires-Dist: {d}" for d in m.get("requires_dist") or []])
    for spec in names.split():
        n = canon(spec.split("==")[0])
        path, name, version, _ = fakes[n]
        if n not in got:
            print(f"[wheelhouse] WARNING: the index has no metadata of {spec} (the target's): what its extras require "
                  "is not in the wheelhouse", file=sys.stderr)
        with open(os.path.join(path, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nX-Wheelhouse-Enriched: yes\n")
            f.writelines(line + "\n" for line in got.get(n, []))      # pip honours only extras it provides


def report(path, kind, local_dir):
    """From a ``pip install --dry-run --report`` file: ``sdists`` prints name==version of each sdist to build;
    ``wheels`` prints, per line, ``local <file>``, ``pin name==version`` or ``never name==version``."""
    r = json.load(open(path))
    _, canon = _packaging()
    for item in r["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        url = item["download_info"]["url"]
        if kind == "sdists":
            if not url.split("#")[0].endswith(".whl") and not NEVER.match(canon(name)):
                print(f"{name}=={version}")
        elif NEVER.match(canon(name)):
            print(f"never {name}=={version}")
        elif url.startswith("file://") and os.path.dirname(url[7:]) == local_dir:
            print(f"local {os.path.basename(url[7:])}")
        else:
            print(f"pin {name}=={version}")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "pip":
        pip(*rest)
    sys.path.insert(0, os.environ["WH_PIP"])
    {"reqs": reqs, "fake": fake, "report": report, "platforms": platforms, "extras": extras,
     "enrich": enrich}[cmd](*rest)
PYHELPER

# pip >= 23.3 runs a --dry-run resolution for another --python-version / --platform; an older one is replaced by a
# fetched pip wheel, run from the file (pip supports that).
pipv=$("$BPY" -c 'import pip; print(pip.__version__)' 2>/dev/null) || die "PYTHON='$BPY' has no pip"
if "$BPY" -c 'import sys, pip; v = tuple(int(x) for x in pip.__version__.split(".")[:2]); sys.exit(v < (23, 3))'; then
  # a copy of pip's own package directory: with -S nothing else of this Python's site-packages is visible
  mkdir -p "$T/pipdir"
  cp -r "$("$BPY" -c 'import os, pip; print(os.path.dirname(pip.__file__))')" "$T/pipdir/pip"
  WH_PIP=$T/pipdir
else
  echo "[wheelhouse] pip $pipv is older than 23.3: fetching a newer pip wheel to resolve with"
  pipq download -q --no-deps -d "$T/pipwhl" "pip>=23.3" || die "could not download pip>=23.3 (pip's error is above)"
  WH_PIP=$(ls "$T"/pipwhl/pip-*.whl)
  export WH_PIP
fi
export WH_PIP
H=("$BPY" -S "$T/helper.py")
plat_args=()
while read -r tag; do plat_args+=(--platform "$tag"); done < <("${H[@]}" platforms "$platform")
"${H[@]}" reqs pyproject.toml "$extras" "$T/reqs.txt" "$T/pins.txt"
read -r -a kernel_pins <"$T/pins.txt"
# mamba-ssm / causal-conv1d: skipped when the target has them at the pin, else built here (needs torch in $BPY)
{ read -r nhave; read -r -a to_build || true; } < <("${H[@]}" fake "$have" "$T/fake" 2.8.0 "${kernel_pins[*]}" || echo FAIL)
[ "$nhave" != FAIL ] || exit 2
if [ ${#to_build[@]} -gt 0 ]; then
  missing=$("$BPY" -c '
import importlib.util as u
print(" ".join(m for m in ("torch", "setuptools", "wheel", "packaging") if u.find_spec(m) is None))')
  [ -z "$missing" ] || die "PYTHON='$BPY' lacks $missing, which building the pure-Python wheels of ${to_build[*]} needs
(their setup.py imports torch; they are built without build isolation). Use a Python that has them, e.g. the .venv of
\`bash scripts/setup.sh dev,interp\`, or \`$BPY -m pip install setuptools wheel packaging\`."
fi

if [ -n "$have" ]; then has="$nhave packages ($have)"; else has="a torch (no --have)"; fi
echo "[wheelhouse] target: CPython $pyver, $platform; extras: ${extras:-none}; the target has: $has"
mkdir -p "$out" || die "--out '$out': cannot be created"
echo "[wheelhouse] into $out"

# --- 1. the pure-Python parts of mamba-ssm and causal-conv1d ----------------------------------------------------------
if [ ${#to_build[@]} -gt 0 ]; then
  echo "[wheelhouse] building ${to_build[*]} without their CUDA ops"
  # --no-cache-dir: pip's wheel cache could hold a CUDA build of the same sdist
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    pipq wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$T/local" "${to_build[@]}" \
    || die "could not build ${to_build[*]} (pip's error is above)"
fi
kernel_files=()
for f in "$T"/local/*.whl; do
  [ -e "$f" ] || continue
  case "$f" in *-none-any.whl) kernel_files+=("$(basename "$f")") ;;
    *) die "$(basename "$f") was built with a CUDA extension in it; its Python part alone was asked for" ;;
  esac
done

# --- 2. resolve for the target; sdists found on the way are built into pure-Python wheels ----------------------------
resolve() {  # resolve REPORT EXTRA_PIP_ARGS...: pip's resolver, markers for the target, the target's packages installed
  local rep=$1; shift
  if ! (cd "$T/run" && PYTHONPATH="$T/fake" "${H[@]}" pip "$WH_PIP" "$pyver" "$platform" install --dry-run -q \
        --report "$rep" --find-links "$T/local" "$@" -r "$T/reqs.txt" >"$T/pip.log" 2>&1); then
    grep -v "is ignored: it is neither a file nor a directory" "$T/pip.log" | tail -n 25 >&2
    return 1
  fi
}
target_pip=(--python-version "$pyver" --implementation cp "${plat_args[@]}" --only-binary=:all:)
for round in 1 2 3 4; do
  resolve "$T/host.json" --prefer-binary \
    || die "pip could not resolve canonlm's requirements (its error is above)"
  mapfile -t sdists < <("${H[@]}" report "$T/host.json" sdists "$T/local")
  if [ ${#sdists[@]} -gt 0 ]; then
    echo "[wheelhouse] building wheels of what is published as an sdist only: ${sdists[*]}"
    pipq wheel -q --no-deps -w "$T/local" "${sdists[@]}" || die "could not build ${sdists[*]} (pip's error is above)"
  fi
  for f in "$T"/local/*.whl; do                   # a platform wheel built here is no use to another target
    [ -e "$f" ] || continue
    case "$f" in *-none-any.whl) ;;
      *) echo "[wheelhouse] $(basename "$f") is not pure Python: left out (the target needs a published wheel)"; rm "$f" ;;
    esac
  done
  resolve "$T/target.json" "${target_pip[@]}" \
    || die "no wheel set for CPython $pyver / $platform meets canonlm's requirements (pip's error is above: a package
with no wheel for this target that is not an sdist either, or a version conflict with what --have lists)"
  # the target's packages asked for with extras: their stand-ins get their real requirements, then resolve again
  mapfile -t need < <("${H[@]}" extras "$T/target.json" "$T/reqs.txt" "$T/fake" "$pyver" "$platform")
  [ ${#need[@]} -gt 0 ] || break
  [ "$round" -lt 4 ] || die "the target's packages asked for with extras keep changing: ${need[*]}"
  echo "[wheelhouse] asked for with extras, so reading their requirements: ${need[*]} (the target has them)"
  rm -rf "$T/meta" && mkdir "$T/meta"
  for spec in "${need[@]}"; do           # one at a time: a release the index lacks (a local build) fails alone
    (cd "$T/run" && "${H[@]}" pip "$WH_PIP" "$pyver" "$platform" install --dry-run -q --ignore-installed --no-deps \
       --report "$T/meta/$spec.json" "${target_pip[@]}" "$spec" >"$T/pip.log" 2>&1) || true
  done
  "${H[@]}" enrich "$T/meta" "$T/fake" "${need[*]}"
done

# --- 3. fetch exactly what was resolved -------------------------------------------------------------------------------
pins=() locals=("${kernel_files[@]}")
while read -r kind what; do
  case "$kind" in
    never) echo "[wheelhouse] WARNING: the resolution wants $what, which never goes into a wheelhouse (it comes with the" \
                "target's torch); the target's torch does not meet some requirement" >&2 ;;
    local) locals+=("$what") ;;
    pin) pins+=("$what") ;;
  esac
done < <("${H[@]}" report "$T/target.json" wheels "$T/local")
for f in "${locals[@]}"; do
  if [ -e "$out/$f" ]; then echo "[wheelhouse] $f already there, kept"; else cp "$T/local/$f" "$out/$f"; fi
done
if [ ${#pins[@]} -gt 0 ]; then
  pipq download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp "${plat_args[@]}" \
    -d "$out" "${pins[@]}" \
    || die "pip could not download ${pins[*]} (its error is above)"
fi

# --- 4. the record ------------------------------------------------------------------------------------------------------
{
  echo "# canonlm wheelhouse, $(date -u +%Y-%m-%dT%H:%M:%SZ): bash scripts/wheelhouse.sh${extras:+ --extras $extras}" \
       "--python-version $pyver --platform $platform${have:+ --have $have}"
  echo "# target: CPython $pyver, $platform; the target has: $has"
  echo "# install there: bash scripts/setup.sh --wheelhouse <this folder>${extras:+ $extras}"
  printf '%s\n' "${locals[@]/#/built: }" "${pins[@]/#/pypi: }" | sed '/^[a-z]*: $/d'
} >"$out/wheelhouse.txt"
echo "[wheelhouse] $(( ${#locals[@]} + ${#pins[@]} )) wheels for this target (${#locals[@]} built here); $out holds" \
     "$(du -sh "$out" | cut -f1):"
(cd "$out" && ls -1 -- *.whl | sed 's/^/  /')
