#!/usr/bin/env bash
# Build a wheelhouse: the folder of wheels from which `bash scripts/setup.sh --wheelhouse DIR` installs canonlm on a
# machine without network (a cluster's compute node, an air-gapped GPU node). Run it here, on a connected machine.
#
#   bash scripts/wheelhouse.sh [--extras LIST] [--python-version X.Y[.Z]] [--platform TAG] [--have FILE] [--out DIR]
#
#   --extras LIST          canonlm's extras to cover, e.g. dev or dev,slurm (default: none). Not cuda / interp: offline,
#                          setup.sh installs neither (docs/gpu_node.md)
#   --python-version V     the target's Python (default: that of the Python running this script)
#   --platform TAG         the target's wheel platform, manylinux_2_Y_ARCH (default manylinux_2_28_<this machine's
#                          arch>: glibc >= 2.28); every older manylinux tag is accepted too, as on the target itself
#   --have FILE            the target's `python3 -m pip list --format=freeze`: what it already has at the locked version
#                          is left out (a wheelhouse carried to a node stays small)
#   --out DIR              where the wheels go (default: ./wheelhouse); wheels already there are kept, never replaced
#   PYTHON=...             the Python that builds mamba-ssm's and causal-conv1d's Python parts (default .venv/bin/python,
#                          else python3); it needs torch, setuptools, wheel and packaging
#
# What goes in: exactly uv.lock's files for the target. `uv export` lists the locked packages of canonlm's
# dependencies, the extras and the `build` and `node` groups (the kernels' Python parts, canonlm's build requirements),
# never torch or triton (they come with the target's torch); scripts/wheelhouse.py evaluates their markers for the
# target and downloads, with uv.lock's sha256, the best wheel for the target's tags, or builds the sdist here into a
# pure-Python wheel (`uv build`); uv's own wheel for the target too, which setup.sh installs first, offline. A
# wheelhouse.txt in DIR records the target and the files. Exit 2 on bad input or when something has no file for the
# target, naming it.
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
  { [ -f "$have" ] && [ -r "$have" ]; } || die "--have '$have': no such readable file (the target's \`python3 -m pip list --format=freeze\`)"
  have=$(cd "$(dirname "$have")" && pwd)/$(basename "$have")
  bad=$(grep -nvE '^[[:space:]]*(#.*)?$|^[A-Za-z0-9][A-Za-z0-9._-]*==[^[:space:];]+[[:space:]]*$' "$have" | head -n 1 || true)
  [ -z "$bad" ] || die "--have $have line ${bad%%:*}: '${bad#*:}' is not 'name==version' (write the file with
\`python3 -m pip list --format=freeze\` on the target)"
fi
PY=${PYTHON:-}
if [[ $PY == */* ]]; then PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY"); fi     # from the caller's directory
cd "$(dirname "$0")/.."
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi; fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null || die "PYTHON='$PY' is not a Python >= 3.10"
if [ -z "$pyver" ]; then pyver=$("$PY" -c 'import platform; print(platform.python_version())'); fi
[[ $pyver =~ ^3\.[0-9]+(\.[0-9]+)?$ ]] || die "--python-version '$pyver' (allowed: X.Y or X.Y.Z, e.g. 3.12 or 3.12.3)"
if [ -z "$platform" ]; then platform=manylinux_2_28_$(uname -m); fi
[[ $platform =~ ^manylinux_2_[0-9]+_(x86_64|aarch64)$ ]] \
  || die "--platform '$platform' (allowed: a manylinux wheel platform tag such as manylinux_2_28_x86_64 or manylinux_2_17_aarch64)"
known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/s/^\([A-Za-z0-9_-]\+\) *=.*/\1/p' pyproject.toml | tr '\n' ' ')
IFS=, read -r -a asked <<<"$extras"
groups=()
for e in ${asked[@]+"${asked[@]}"}; do
  [[ " $known" == *" $e "* ]] || die "--extras '$extras': unknown extra '$e' (pyproject.toml defines: ${known% })"
  case "$e" in cuda|interp)
    die "--extras '$extras': '$e' cannot go into a wheelhouse (setup.sh installs neither offline: 'cuda' is flash-attn and
the CUDA builds that download from GitHub, 'interp' pins triton, which comes with torch). The kernels' Python parts
(fla-core, mamba-ssm and causal-conv1d without their CUDA ops) are always in the wheelhouse." ;;
  esac
  groups+=(--extra "$e")
done

. scripts/_uv.sh
find_uv || die "no uv (neither \$UV, nor uv 0.13+ on PATH, nor could pip install uv==$UV_PIN)"
T=$(mktemp -d "${TMPDIR:-/tmp}/canonlm-wheelhouse.XXXXXX")
trap 'rm -rf "$T" "$out/.build" "$out/pins.txt"' EXIT
node_export "$T/locked.txt" --locked ${groups[@]+"${groups[@]}"} || die "uv export from uv.lock failed (its error is above)"
mkdir -p "$out"
# the files, and uv's own wheel for the target (setup.sh installs it from here before anything else)
"$PY" scripts/wheelhouse.py build "$T/locked.txt" uv.lock --python-version "$pyver" --platform "$platform" \
  ${have:+--have "$have"} --out "$out" --builder "$PY" --uv "$UV" --also "uv==$UV_PIN" || exit 2
{
  echo "# canonlm wheelhouse, $(date -u +%Y-%m-%dT%H:%M:%SZ): bash scripts/wheelhouse.sh${extras:+ --extras $extras}" \
       "--python-version $pyver --platform $platform${have:+ --have $have}; uv.lock $(sha256sum uv.lock | cut -c1-12)"
  echo "# install there: bash scripts/setup.sh --wheelhouse <this folder>${extras:+ $extras}"
  cat "$out/pins.txt"
} >"$out/wheelhouse.txt"
rm -rf "$out/pins.txt" "$out/.build"
echo "[wheelhouse] $(grep -c '^[a-z]*: ' "$out/wheelhouse.txt") files for CPython $pyver / $platform" \
     "($(grep -c '^built: ' "$out/wheelhouse.txt") built here); $out holds $(du -sh "$out" | cut -f1)"
