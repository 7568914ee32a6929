#!/usr/bin/env bash
# Create ./.venv and install canonlm into it (editable).
#   bash scripts/setup.sh [EXTRAS]                      EXTRAS e.g. dev | dev,interp | slurm,cuda
#   bash scripts/setup.sh --wheelhouse DIR [EXTRAS]     offline: everything from the wheel folder DIR, nothing downloaded
#   bash scripts/setup.sh --check-kernels               only the import check of the CUDA kernels in .venv (exit 1 naming failures)
#
# torch comes first. A CUDA build of torch >= 2.7 that is already there is kept, never replaced: the one in .venv, or,
# when .venv does not exist yet, the one python3 ($PYTHON) imports (a cluster's module or a container's torch): .venv is
# then created with --system-site-packages, so that torch and the interpreter's other packages stay visible in it
# (when python3 is itself a venv, as on the device image, with a .pth file naming its site-packages instead).
# Otherwise: without a CUDA GPU (and without the cuda extra) this installs the CPU build of torch 2.13.0 (a bare
# `pip install -e .` would resolve a multi-GB CUDA build); TORCH_CPU_INDEX points at a mirror of PyTorch's CPU wheels.
# With a CUDA GPU (nvidia-smi -L) or the cuda extra it installs torch 2.8.0 built for CUDA 12 (TORCH_CUDA=cu128, or
# cu126 / cu129; TORCH_CUDA_INDEX for a mirror): flash-attn, causal-conv1d and mamba-ssm, at the versions the cuda
# extra pins, publish prebuilt wheels for torch 2.8 / CUDA 12 / C++11 ABI / CPython 3.10-3.13 (docs/gpu.md). The cuda
# extra is then installed with --no-build-isolation, taking those wheels only (never an nvcc compile), and every
# kernel is import-checked. TORCH_SPEC="torch==..." installs that torch instead when .venv has none.
# `interp` (the CPU test tier) also installs the pure-Python parts of mamba-ssm and causal-conv1d.
# --wheelhouse DIR (a GPU node without network; DIR built by scripts/wheelhouse.sh on a connected machine, see
# docs/gpu_node.md): pip runs with --no-index --find-links DIR only (no index, no pip configuration), installs canonlm
# with the extras, fla-core and the pure-Python parts of mamba-ssm and causal-conv1d, and keeps the torch that is there.
# Before anything is installed, every requirement is checked against what is installed and the wheels in DIR; what
# is missing is named in one message (exit 2). The `cuda` and `interp` extras cannot be installed offline.
# SETUP_DRY_RUN=1 prints the plan (each command that would change .venv, prefixed "+ ") and changes nothing.
set -euo pipefail
PY=${PYTHON:-python3}
VPY=.venv/bin/python
DRY=${SETUP_DRY_RUN:-}
run() { if [ -n "$DRY" ]; then echo "+ $*"; else "$@"; fi; }
die() { echo "[setup] ERROR: $*" >&2; exit 2; }

# --- command line (paths are taken relative to the caller's directory, before the cd below) ---------------------------
USAGE="allowed: an extras list such as dev,interp or slurm,cuda; --wheelhouse DIR; or --check-kernels"
extras="" extras_given="" wheelhouse="" check_only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check-kernels) check_only=1 ;;
    --wheelhouse) [ $# -ge 2 ] && [ -n "$2" ] || die "--wheelhouse needs a directory ($USAGE)"
                  wheelhouse=$2; shift ;;
    --wheelhouse=*) wheelhouse=${1#*=}; [ -n "$wheelhouse" ] || die "--wheelhouse needs a directory ($USAGE)" ;;
    -*) die "unknown option '$1' ($USAGE)" ;;
    *) [ -z "$extras_given" ] || die "two extras lists, '$extras' and '$1' (join them with commas, e.g. dev,slurm)"
       extras=$1; extras_given=1 ;;
  esac
  shift
done
if [ -n "$wheelhouse" ]; then
  [ -d "$wheelhouse" ] || die "--wheelhouse '$wheelhouse': no such directory (build one with bash scripts/wheelhouse.sh on a connected machine; docs/gpu_node.md)"
  wheelhouse=$(cd "$wheelhouse" && pwd)
fi
cd "$(dirname "$0")/.."

CUDA_TORCH=2.8.0                  # the torch of the kernels' prebuilt wheels (pyproject.toml, cuda extra; docs/gpu.md)
KERNEL_PKGS="flash-attn causal-conv1d mamba-ssm"
INTERP_PKGS="mamba-ssm==2.3.1 causal-conv1d==1.6.2.post1"
BUILD_TOOLS="setuptools wheel packaging ninja psutil"    # what those sdists' setup.py import without build isolation

# Import each kernel in a fresh python process; one message naming every one that does not load, exit status 1.
check_kernels() {
  local failed="" pair mod ext err
  for pair in flash_attn:flash_attn_2_cuda causal_conv1d:causal_conv1d_cuda mamba_ssm:selective_scan_cuda \
              "fla.ops.gla:fla's Triton kernels"; do
    mod=${pair%%:*} ext=${pair#*:}
    if [ -n "$DRY" ]; then echo "+ $VPY -c 'import $mod'    # import check: $ext"; continue; fi
    if err=$("$VPY" -c "import $mod" 2>&1); then echo "[setup] import $mod ($ext): ok"
    else failed+="  $ext (import $mod): $(printf '%s\n' "$err" | tail -n 1)"$'\n'; fi
  done
  [ -z "$failed" ] && return 0
  {
    echo "[setup] ERROR: CUDA kernels that do not load, with $("$VPY" -c 'import sys, torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, C++11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}), Python {sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null || echo "no importable torch"):"
    printf '%s' "$failed"
    cat <<EOF
"No module named '<extension>'": no prebuilt wheel matched this torch / CUDA / C++ ABI / Python, so pip installed the
package's Python files only (or the package is not installed). "undefined symbol": it was built for another torch.
What to do: with the tested torch $CUDA_TORCH (CUDA 12, Python 3.10-3.13; no TORCH_SPEC), remove the stale packages with
  .venv/bin/pip uninstall -y $KERNEL_PKGS
and run this setup again with the same extras; otherwise compile them for your torch with nvcc as docs/gpu.md says
("No prebuilt wheel"). Until then canonlm runs, but kernels=auto falls back to the PyTorch paths for these ops.
EOF
  } >&2
  return 1
}

if [ -n "$check_only" ]; then if check_kernels; then exit 0; else exit 1; fi; fi
has() { [[ ",$extras," == *",$1,"* ]]; }
if [ -n "$extras" ] && [ -f pyproject.toml ]; then                      # a misspelt extra is an error, not a no-op
  known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/s/^\([A-Za-z0-9_-]\+\) *=.*/\1/p' pyproject.toml | tr '\n' ' ')
  IFS=, read -r -a asked <<<"$extras"
  for e in "${asked[@]}"; do
    [[ " $known" == *" $e "* ]] || die "extras '$extras': unknown extra '$e' (pyproject.toml defines: ${known% })"
  done
fi
gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
cuda_torch=""
if [ -n "$gpu" ] || has cuda; then cuda_torch=1; fi
TORCH_CUDA=${TORCH_CUDA:-cu128}

# --- checks before any work -----------------------------------------------------------------------------------------
if [ -n "$wheelhouse" ]; then
  for e in cuda interp; do
    if has $e; then
      die "extras '$extras' with --wheelhouse: '$e' cannot be installed offline ('cuda': flash-attn and the CUDA builds of
causal-conv1d / mamba-ssm, whose setup.py downloads from GitHub; 'interp': triton==3.9.0 for the CPU test tier). Offline,
the kernels' Python parts (fla-core, mamba-ssm and causal-conv1d without their CUDA ops) are always installed from the
wheelhouse and the torch already there is kept: drop '$e' (e.g. --wheelhouse DIR dev)."
    fi
  done
fi
if has interp && [ -n "$cuda_torch" ]; then
  die "extras '$extras': 'interp' is the CPU test tier (Triton's interpreter, triton==3.9.0); it cannot share a venv with
the CUDA torch $CUDA_TORCH (triton 3.4.0) that a GPU or the cuda extra gets. On a GPU machine use dev,cuda and
\`pytest -m gpu\`; run dev,interp on a machine without a GPU."
fi
if [ -n "$cuda_torch" ] && [ -z "${TORCH_SPEC:-}" ] && [ -z "$wheelhouse" ]; then
  case "$TORCH_CUDA" in cu126|cu128|cu129) ;;
    *) die "TORCH_CUDA='$TORCH_CUDA' (allowed: cu126, cu128, cu129: the CUDA 12 builds of torch $CUDA_TORCH)" ;;
  esac
fi
pybin=$PY
if [ -x "$VPY" ]; then pybin=$VPY; fi
if has cuda; then
  pyv=$("$pybin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  case "$pyv" in 3.10|3.11|3.12|3.13) ;;
    *) echo "[setup] WARNING: Python $pyv: the kernels' prebuilt wheels are for CPython 3.10-3.13 only, expect the import" \
            "check to fail (remove .venv, run with PYTHON=python3.12)" >&2 ;;
  esac
fi

# --- which torch: the one in .venv, or a CUDA torch >= 2.7 of the base interpreter ---------------------------------
TORCH_PROBE='import torch; print(torch.__version__, torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)'
TORCH_PEEK='
import importlib.util, os, re, sys
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    sys.exit(1)
try:
    text = open(os.path.join(os.path.dirname(spec.origin), "version.py")).read()
    v = re.search(r"^__version__\s*=\s*[\x27\x22]([^\x27\x22]+)", text, re.M)[1]
    c = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:None|[\x27\x22]([^\x27\x22]*))", text, re.M)
    print(v, c[1] or "None", "unknown")
except (OSError, TypeError):                     # no version.py in the usual form: import it
    import torch
    print(torch.__version__, torch.version.cuda, "unknown")
'
# cuda_ge_27 VERSION CUDA: a CUDA build (torch.version.cuda is not None) of torch >= 2.7, the floor fla-core[cuda] 0.6
# sets (pyproject.toml, cuda extra). Such a torch is kept, never replaced.
cuda_ge_27() {
  [[ $1 =~ ^([0-9]+)\.([0-9]+) ]] || return 1
  [[ $2 != None && $2 != none && -n $2 ]] || return 1
  (( BASH_REMATCH[1] > 2 || (BASH_REMATCH[1] == 2 && BASH_REMATCH[2] >= 7) ))
}
torch_now=""    # "version cuda cxx11abi" of the torch .venv imports, empty when none does
torch_from=""   # where it comes from, for the messages
sys_site=""     # .venv shares the base interpreter's packages (its CUDA torch among them)
base_sites=""   # ... and when that interpreter is itself a venv: its site-packages folders, for a .pth file
if [ -x "$VPY" ]; then
  torch_now=$("$VPY" -c "$TORCH_PROBE" 2>/dev/null || true)
  torch_from=" (in .venv)"
elif ! has interp; then
  # torch's version.py read as text first (importing torch takes seconds); imported only when it is a CUDA build
  base_torch=$("$PY" -c "$TORCH_PEEK" 2>/dev/null || true)
  read -r bv bc _ <<<"${base_torch:-none none none}"
  if cuda_ge_27 "$bv" "$bc"; then
    base_torch=$("$PY" -c "$TORCH_PROBE" 2>/dev/null || true)
    read -r bv bc _ <<<"${base_torch:-none none none}"
  fi
  if cuda_ge_27 "$bv" "$bc"; then
    sys_site=1 torch_now=$base_torch torch_from=" (from $PY)"
    # A venv made from a venv with --system-site-packages sees the site-packages of the interpreter the outer venv
    # was made from, not the outer venv's (venv's `home` is sys._base_executable; site.py adds sys.base_prefix's
    # folders). The device image's python3 is such a venv (/opt/torch/.venv). Its folders are then named in a .pth
    # file in .venv's site-packages, which site.py appends to sys.path after .venv's own: the same packages, in the
    # same order, as $PY sees them.
    base_sites=$("$PY" -c 'import site, sys; sys.prefix != sys.base_prefix and print(" ".join(site.getsitepackages()))')
  fi
fi

# --- offline: check the wheelhouse before anything is written ------------------------------------------------------
FLA_PKG="fla-core==0.6.0"         # the fla the interp and cuda extras pin (pyproject.toml)
OFFLINE_BUILD="setuptools>=68 wheel"    # canonlm's [build-system] requires: offline, canonlm is built without isolation
if [ -n "$wheelhouse" ]; then
  # The interpreter .venv will be: .venv's own, or $PY (with its packages when --system-site-packages, else none).
  if [ -x "$VPY" ]; then chk=("$VPY" env); elif [ -n "$sys_site" ]; then chk=("$PY" env); else chk=("$PY" none); fi
  top=$FLA_PKG
  if [ -z "$torch_now" ] && [ -n "${TORCH_SPEC:-}" ]; then top+=" $TORCH_SPEC"; fi
  if ! "${chk[0]}" - "$wheelhouse" "$extras" "${chk[1]}" "$top" "$INTERP_PKGS" "$PY" <<'PYCHECK'
"""setup.sh --wheelhouse: is every requirement met by what is installed or by a wheel in the wheelhouse?

A greedy walk of the requirement graph, as pip's resolver would see it offline (pip install --no-index --find-links):
each requirement is met by the installed distribution if its version matches, else by the highest matching wheel in
the wheelhouse whose tags this interpreter supports (its Requires-Dist are then walked, markers evaluated for this
interpreter and the requested extras). Prints what is missing, each with what requires it, and exits 2; exits 0 when
nothing is missing. Reads only: pyproject.toml, the wheels' METADATA, importlib.metadata.
"""
import os
import sys
import zipfile
from email.parser import Parser

try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:                                           # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
try:
    import tomllib
except ImportError:                                           # Python 3.10
    from pip._vendor import tomli as tomllib
import importlib.metadata as md

wh, extras, mode, top, nodeps, base_py = sys.argv[1:]
extras = [e for e in extras.split(",") if e]
project = tomllib.load(open("pyproject.toml", "rb"))
installed = {}
if mode == "env":
    for d in md.distributions():
        name = d.metadata["Name"]
        if name:
            installed.setdefault(canonicalize_name(name), d)
supported = set(sys_tags())
wheels, foreign = {}, {}
for f in sorted(os.listdir(wh)):
    if not f.endswith(".whl"):
        continue
    try:
        name, version, _, tags = parse_wheel_filename(f)
    except Exception:
        continue
    (wheels if tags & supported else foreign).setdefault(name, []).append((version, f))

todo = [(Requirement(r), "canonlm", ()) for r in project["project"]["dependencies"]]
for e in extras:
    todo += [(Requirement(r), f"canonlm[{e}]", ()) for r in project["project"]["optional-dependencies"][e]]
todo += [(Requirement(r), "canonlm (build, offline without isolation)", ()) for r in
         project["build-system"]["requires"]]
todo += [(Requirement(r), "setup.sh (the kernels' Python parts)", ()) for r in top.split()]
chosen, done_extras, missing = {}, set(), []        # done_extras: the (package, extra) pairs walked


def wanted(req, extras_of_parent):
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("",) + tuple(extras_of_parent))


def deps_of(meta, parent, req_extras):
    return [(Requirement(r), parent, req_extras) for r in (meta.get_all("Requires-Dist") or [])]


def note(name, req):
    bits = []
    if name in installed:
        bits.append(f"installed: {installed[name].version}")
    have = sorted({str(v) for v, _ in wheels.get(name, [])})
    if have:
        bits.append(f"the wheelhouse has {name} {', '.join(have)}")
    if foreign.get(name):
        bits.append("the wheelhouse has only wheels for another Python or platform: "
                    + ", ".join(f for _, f in foreign[name]))
    return "; ".join(bits)


while todo:
    req, parent, parent_extras = todo.pop(0)
    if not wanted(req, parent_extras):
        continue
    name = canonicalize_name(req.name)
    if name in chosen:
        version, source = chosen[name]
        if not req.specifier.contains(version, prereleases=True):
            missing.append((str(req), parent, f"{name} {version} ({source}) is taken for another requirement"))
        elif {(name, e) for e in req.extras} - done_extras:
            pass                                              # walked below with the new extras
        else:
            continue
    if name in installed and req.specifier.contains(installed[name].version, prereleases=True):
        dist = installed[name]
        chosen[name] = (dist.version, "installed")
        meta = dist.metadata
    else:
        cands = wheels.get(name, [])
        ok = list(req.specifier.filter([v for v, _ in cands]))
        if not ok:
            missing.append((str(req), parent, note(name, req)))
            continue
        best = max(ok)
        f = dict((str(v), f) for v, f in cands)[str(best)]
        chosen[name] = (str(best), f)
        with zipfile.ZipFile(os.path.join(wh, f)) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            meta = Parser().parsestr(z.read(meta_name).decode("utf-8"))
    done_extras |= {(name, e) for e in req.extras}
    todo += deps_of(meta, f"{req.name} {chosen[name][0]}", tuple(req.extras))

for pin in nodeps.split():                                    # installed with --no-deps: present, nothing walked
    req = Requirement(pin)
    name = canonicalize_name(req.name)
    if name in installed and req.specifier.contains(installed[name].version, prereleases=True):
        continue
    if not any(v in req.specifier for v, _ in wheels.get(name, [])):
        missing.append((pin, "setup.sh (pure-Python part, installed with --no-deps)", note(name, req)))

tags = [str(t) for t in sys_tags()]
here = f"Python {sys.version_info[0]}.{sys.version_info[1]}, {next((t for t in tags if 'manylinux' in t), tags[0])}"
if missing:
    lines = [f"[setup] ERROR: the wheelhouse {wh} lacks what .[{','.join(extras)}] needs here ({here}); nothing was "
             "installed. Missing:"]
    seen = set()
    for req, parent, why in missing:
        if (req, parent) in seen:
            continue
        seen.add((req, parent))
        lines.append(f"  {req}    (required by {parent}{'; ' + why if why else ''})")
    if any(canonicalize_name(Requirement(r).name) == "torch" for r, _, _ in missing):
        lines.append(f"torch is never put into a wheelhouse: use the torch of the machine ({base_py} imports none that "
                     "is a CUDA build >= 2.7, or .venv already exists without one: remove it so that setup.sh creates "
                     "it with --system-site-packages), or add a torch wheel to the wheelhouse yourself.")
    ex = f" --extras {','.join(extras)}" if extras else ""
    lines.append(f"Rebuild the wheelhouse on a connected machine for this target: bash scripts/wheelhouse.sh{ex} "
                 f"--python-version {sys.version_info[0]}.{sys.version_info[1]} --have <this machine's "
                 "`python3 -m pip list --format=freeze`> --out DIR (docs/gpu_node.md).")
    print("\n".join(lines), file=sys.stderr)
    sys.exit(2)
from_wh = sorted(f"{n} {v}" for n, (v, src) in chosen.items() if src != "installed")
print(f"[setup] wheelhouse check ({here}): every requirement is met, {sum(s == 'installed' for _, s in chosen.values())}"
      f" already installed, {len(from_wh)} from {wh}" + (f": {', '.join(from_wh)}" if from_wh else ""))
PYCHECK
  then exit 2; fi
fi

# --- venv and torch -------------------------------------------------------------------------------------------------
if [ ! -x "$VPY" ]; then
  if [ -n "$sys_site" ] && [ -n "$base_sites" ]; then
    read -r bv bc _ <<<"$torch_now"
    pth=.venv/lib/python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages/_base_python.pth
    echo "[setup] $PY has torch $bv (CUDA $bc) and is itself a venv: creating .venv with its site-packages" \
         "($base_sites) in $pth, so that this torch and $PY's other packages stay visible in it (and are kept)"
    run "$PY" -m venv .venv
    if [ -n "$DRY" ]; then echo "+ write $pth: $base_sites"; else printf '%s\n' $base_sites >"$pth"; fi
  elif [ -n "$sys_site" ]; then
    read -r bv bc _ <<<"$torch_now"
    echo "[setup] $PY has torch $bv (CUDA $bc): creating .venv with --system-site-packages, so that this torch and" \
         "$PY's other packages stay visible in it (and are kept, not replaced)"
    run "$PY" -m venv --system-site-packages .venv
  else
    echo "[setup] creating .venv with $("$PY" --version 2>&1)"
    run "$PY" -m venv .venv
  fi
  # Before Python 3.12, venv also installs its bundled setuptools (65.5 for 3.11), which would hide $PY's own (and
  # canonlm's build needs setuptools >= 68): removed, so that .venv sees what $PY sees.
  if [ -n "$sys_site" ] && "$PY" -c 'import sys, setuptools; sys.exit(sys.version_info >= (3, 12))' 2>/dev/null; then
    run "$VPY" -m pip uninstall -y -q setuptools
  fi
fi
if [ -z "$DRY" ]; then . .venv/bin/activate; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip byte-compiles every file it installs, one file after another (80 of the 210 s a fresh dev,interp install took on
# 2 cores). Here pip skips it: Python compiles each module on its first import and keeps the .pyc, so only what is
# used gets compiled; where PYTHONDONTWRITEBYTECODE forbids that (every import would recompile), the venv is
# compiled once at the end on every core (compileall -j 0). pip reads the environment variable of a --no-* flag
# inverted: PIP_NO_COMPILE=0 means --no-compile.
export PIP_NO_COMPILE=0
read -r tv tc tabi <<<"${torch_now:-none none none}"

if [ -n "$wheelhouse" ]; then
  if [ -n "$torch_now" ]; then echo "[setup] keeping torch $tv (CUDA $tc)$torch_from; offline, nothing replaces it"
  else echo "[setup] no torch yet: it comes from the wheelhouse"; fi
  if [ -n "$gpu" ] && [ -n "$torch_now" ] && ! cuda_ge_27 "$tv" "$tc"; then
    echo "[setup] WARNING: a CUDA GPU is visible but torch $tv is not a CUDA build >= 2.7; the GPU paths will not run" >&2
  fi
elif [ -n "${TORCH_SPEC:-}" ]; then
  if [ -n "$cuda_torch" ]; then
    echo "[setup] WARNING: TORCH_SPEC=$TORCH_SPEC instead of the tested torch $CUDA_TORCH: the prebuilt flash-attn," \
         "causal-conv1d and mamba-ssm wheels may not match it (docs/gpu.md); the import check names any that" \
         "does not load" >&2
  fi
  if [ -z "$torch_now" ]; then run pip install "$TORCH_SPEC"; fi
elif [ -n "$cuda_torch" ]; then
  if [[ $tv == "${CUDA_TORCH%.*}".* && $tc == 12.* && $tabi == True ]]; then
    echo "[setup] torch $tv (CUDA $tc)$torch_from already installed: the kernels' prebuilt wheels are for it"
  elif cuda_ge_27 "$tv" "$tc"; then
    echo "[setup] torch $tv (CUDA $tc)$torch_from already installed: a CUDA build >= 2.7 is kept, not replaced"
    if has cuda; then
      echo "[setup] WARNING: the prebuilt flash-attn, causal-conv1d and mamba-ssm wheels are for torch $CUDA_TORCH" \
           "(CUDA 12, C++11 ABI); for torch $tv (CUDA $tc) they may not exist (docs/gpu.md); the import check names" \
           "any that does not load" >&2
    fi
  else
    if [ -n "$gpu" ]; then echo "[setup] CUDA GPU found: installing torch $CUDA_TORCH+$TORCH_CUDA"
    else echo "[setup] no CUDA GPU visible, but the cuda extra was asked for: installing torch $CUDA_TORCH+$TORCH_CUDA"; fi
    if [ -n "$torch_now" ]; then
      echo "[setup] it replaces torch $tv (CUDA $tc); kernel packages built for that torch are removed first"
      run pip uninstall -y $KERNEL_PKGS
    fi
    idx=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/$TORCH_CUDA}
    if ! run pip install "torch==$CUDA_TORCH+$TORCH_CUDA" --index-url "$idx"; then
      [ "$TORCH_CUDA" = cu128 ] || die "could not install torch==$CUDA_TORCH+$TORCH_CUDA from $idx (pip's error is above)"
      echo "[setup] no torch==$CUDA_TORCH+cu128 from $idx: torch==$CUDA_TORCH from the default index (on Linux x86_64 the same CUDA 12.8 build)"
      run pip install "torch==$CUDA_TORCH"
    fi
  fi
elif [ -z "$torch_now" ]; then
  echo "[setup] no CUDA GPU: installing the CPU build of torch 2.13.0"
  run pip install "torch==2.13.0+cpu" 2>/dev/null \
    || run pip install "torch==2.13.0" --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
elif [ -n "$sys_site" ]; then
  echo "[setup] torch $tv (CUDA $tc)$torch_from already installed: kept"
fi
if [ -z "$DRY" ] && [ -z "$wheelhouse" ]; then
  python -c "import torch; print('[setup] torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"
fi

# --- canonlm and its extras -----------------------------------------------------------------------------------------
# offline_pip ARGS: .venv's pip with ARGS (never another pip found on PATH), its output kept aside; on failure its
# last lines and exit 2 (the check above makes that rare: a conflict between versions rather than a missing package).
offline_pip() {
  if [ -n "$DRY" ]; then echo "+ pip $*"; return 0; fi
  local log
  log=$(mktemp)
  if "$VPY" -m pip "$@" >"$log" 2>&1; then
    sed -n 's/^Successfully installed /[setup] installed: /p' "$log"
    rm -f "$log"
    return 0
  fi
  echo "[setup] ERROR: offline, \`pip $*\` failed; its last lines:" >&2
  tail -n 20 "$log" >&2
  rm -f "$log"
  exit 2
}
if [ -n "$wheelhouse" ]; then
  # pip sees the wheelhouse and nothing else: --no-index, and no pip configuration file or PIP_* variable that could
  # add an index or another --find-links folder. canonlm is built without build isolation (its build requirements
  # are installed first, from the wheelhouse if .venv lacks them); --prefer-binary: a wheel over an sdist, always.
  if [ -z "$DRY" ] && ! "$VPY" -m pip --version >/dev/null 2>&1; then
    die ".venv has no pip ($VPY -m pip fails): remove .venv and run this again"
  fi
  for v in $(compgen -e); do if [[ $v == PIP_* ]]; then unset "$v"; fi; done
  export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_COMPILE=0
  echo "[setup] installing .${extras:+[$extras]}, $FLA_PKG and $INTERP_PKGS (pure-Python parts) from $wheelhouse only"
  offline_pip install --no-index --find-links "$wheelhouse" --prefer-binary $OFFLINE_BUILD
  torch_req=""
  if [ -z "$torch_now" ]; then torch_req=${TORCH_SPEC:-}; fi
  offline_pip install --no-index --find-links "$wheelhouse" --prefer-binary --no-build-isolation \
    -e ".${extras:+[$extras]}" $FLA_PKG $torch_req
  # mamba-ssm and causal-conv1d: wheels of their Python parts (wheelhouse.sh builds them with *_SKIP_CUDA_BUILD);
  # --no-deps as in the interp step below: their requirements name torch, triton and ninja.
  have=""
  if [ -x "$VPY" ]; then
    have=$("$VPY" -c 'from importlib.metadata import version as v; print("mamba-ssm==" + v("mamba-ssm"), "causal-conv1d==" + v("causal-conv1d"))' 2>/dev/null || true)
  fi
  if [ "$have" = "$INTERP_PKGS" ]; then echo "[setup] $INTERP_PKGS already installed"
  else offline_pip install --no-index --find-links "$wheelhouse" --only-binary=:all: --no-deps $INTERP_PKGS; fi
elif has cuda; then
  # flash-attn, causal-conv1d, mamba-ssm are sdists: without build isolation their setup.py sees the torch above and
  # downloads the matching wheel from the package's GitHub release; *_SKIP_CUDA_BUILD=TRUE turns the nvcc compile it
  # falls back to (hours) into a Python-only install that the import check below reports. --no-cache-dir: pip's wheel
  # cache would reuse a build made for another torch.
  run pip install $BUILD_TOOLS
  echo "[setup] installing .[$extras] without build isolation (flash-attn, causal-conv1d, mamba-ssm: prebuilt wheels only)"
  if ! run env FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE \
         pip install --no-build-isolation --no-cache-dir -e ".[$extras]"; then
    die "pip could not install .[$extras] (its error is above). '<urlopen error ...>' from a setup.py: GitHub, where the
kernels' prebuilt wheels are, is unreachable from here; install the wheel files as docs/gpu.md says, then run this again."
  fi
else
  run pip install -e ".${extras:+[$extras]}"
fi
# --- interpreter tier: mamba-ssm and causal-conv1d without their CUDA builds ---------------------------------------
# *_SKIP_CUDA_BUILD: no extension; *_FORCE_BUILD: no prebuilt-wheel download (its URL needs torch.version.cuda);
# --no-deps: their requirements would pull a CUDA triton/torch. tests/_triton_interp.py stands in for the extensions.
if has interp; then
  have=$("$VPY" -c 'from importlib.metadata import version as v; print("mamba-ssm==" + v("mamba-ssm"), "causal-conv1d==" + v("causal-conv1d"))' 2>/dev/null || true)
  if [ "$have" = "$INTERP_PKGS" ]; then
    echo "[setup] $INTERP_PKGS (pure-Python, for the interpreter tier) already installed"
  else
    echo "[setup] installing $INTERP_PKGS without their CUDA builds (interpreter tier)"
    run pip install $BUILD_TOOLS
    run env MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
      pip install --no-build-isolation --no-deps --no-cache-dir $INTERP_PKGS
  fi
fi
# --- Hugging Face interop tests (tests/test_interop.py, marker `interop`) ---------------------------------------
# With `dev` among the extras and the official PhysicsLM4 release files in ../shared/data/physicslm4/huggingface,
# side-install the transformers those official LlamaCanon classes were written for (4.51.3) into .cache/hf451; the
# tests run the official classes in a subprocess with that directory first on PYTHONPATH (the venv keeps its own
# transformers). Idempotent (skipped when present); a failure only prints a warning.
if has dev && [ -d ../shared/data/physicslm4/huggingface ] && [ -n "$wheelhouse" ]; then
  echo "[setup] offline: .cache/hf451 (transformers 4.51.3 for the interop tests) not side-installed; those tests skip"
elif has dev && [ -d ../shared/data/physicslm4/huggingface ]; then
  if [ -f .cache/hf451/transformers/__init__.py ]; then
    echo "[setup] .cache/hf451 (transformers 4.51.3 for the interop tests) already present"
  elif run pip install --no-deps --target .cache/hf451 transformers==4.51.3 "tokenizers>=0.21,<0.22" "huggingface_hub<1.0"; then
    echo "[setup] side-installed transformers 4.51.3 into .cache/hf451 (interop tests)"
  else
    echo "[setup] WARNING: could not side-install transformers 4.51.3 into .cache/hf451; tests/test_interop.py will skip" >&2
  fi
fi
if [ -z "$DRY" ] && [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  echo "[setup] PYTHONDONTWRITEBYTECODE is set: byte-compiling .venv now, on every core"
  python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
fi
if has cuda; then check_kernels || exit 1; fi
if [ -n "$DRY" ]; then echo "[setup] dry run: nothing was changed"; exit 0; fi
if [ -n "$wheelhouse" ]; then
  python -c "import torch; print('[setup] torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"
fi
echo "[setup] done: $(python -c 'import canonlm; print("canonlm", canonlm.__version__)')"
