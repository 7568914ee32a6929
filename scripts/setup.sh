#!/usr/bin/env bash
# Create ./.venv and install canonlm into it (editable), everything but torch from the lock file uv.lock, with uv.
#   bash scripts/setup.sh [EXTRAS]                      EXTRAS e.g. dev | dev,interp,eval | slurm,cuda
#   bash scripts/setup.sh --wheelhouse DIR [EXTRAS]     offline: from the wheel folder DIR only (scripts/wheelhouse.sh)
#   bash scripts/setup.sh --check-kernels               only the import check of the CUDA kernels in .venv (exit 1)
#
# uv: $UV, else .venv's or PATH's uv 0.13+, else uv 0.13.9 from PyPI (offline: from DIR) into ~/.cache/canonlm.
# torch is never taken from the lock; it is chosen per machine. A CUDA build of torch >= 2.7 already there is kept:
# the one in .venv or, when .venv does not exist yet, the one python3 ($PYTHON) imports (a cluster module, a
# container): .venv then sees python3's packages (--system-site-packages; when python3 is itself a venv, as on the
# device image, a .pth file naming its site-packages). Otherwise, without a CUDA GPU and without the cuda extra: the
# CPU build of torch $CPU_TORCH from PyTorch's CPU index (TORCH_CPU_INDEX), or from a find-links folder of pip's
# configuration that holds it. With a CUDA GPU (nvidia-smi -L) or the cuda extra: torch $CUDA_TORCH for CUDA 12
# (TORCH_CUDA=cu128 | cu126 | cu129, TORCH_CUDA_INDEX), the torch the kernels' prebuilt wheels are for (docs/gpu.md).
# TORCH_SPEC="torch==..." installs that torch instead when .venv has none.
# The rest: `uv sync --locked --inexact --no-install-package torch`, which fails when pyproject.toml and uv.lock
# disagree. The kernels' sdists (cuda: flash-attn, causal-conv1d, mamba-ssm; interp: the last two) are built in a
# second sync, after the `build` group, without isolation against that torch and with *_SKIP_CUDA_BUILD=TRUE: cuda
# downloads their prebuilt wheels (never an nvcc compile) and import-checks every kernel; interp (the CPU test tier)
# adds *_FORCE_BUILD=TRUE and installs only their Python parts.
# --wheelhouse DIR: the locked versions for this machine (uv export: the extras, the `build` and `node` groups),
# less torch, triton and what .venv already sees at that version, are checked against DIR's wheels; what is missing is
# named in one line (exit 2, nothing written); then `uv pip install --offline --no-index --find-links DIR --no-deps`.
# The cuda and interp extras cannot be installed offline.
# SETUP_DRY_RUN=1 prints each command that would change .venv ("+ ...") and changes nothing.
set -euo pipefail
PY=${PYTHON:-python3}
VPY=.venv/bin/python
DRY=${SETUP_DRY_RUN:-}
CPU_TORCH=2.13.0                 # the torch uv.lock names (pyproject.toml [tool.uv] constraint-dependencies)
CUDA_TORCH=2.8.0                 # the torch of the kernels' prebuilt wheels (pyproject.toml, cuda extra; docs/gpu.md)
KERNEL_PKGS="flash-attn causal-conv1d mamba-ssm"
run() { if [ -n "$DRY" ]; then echo "+ $*"; else "$@"; fi; }
die() { echo "[setup] ERROR: $*" >&2; exit 2; }

# --- command line (paths are taken relative to the caller's directory, before the cd below) ---------------------------
USAGE="allowed: an extras list such as dev,interp or slurm,cuda; --wheelhouse DIR; or --check-kernels"
extras="" extras_given="" wheelhouse="" check_only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check-kernels) check_only=1 ;;
    --wheelhouse) { [ $# -ge 2 ] && [ -n "$2" ]; } || die "--wheelhouse needs a directory ($USAGE)"
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
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac   # before the cd, like the paths
cd "$(dirname "$0")/.."

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
"No module named '<extension>'": no prebuilt wheel matched this torch / CUDA / C++ ABI / Python, so only the package's
Python files were installed (or the package is not installed). "undefined symbol": it was built for another torch.
What to do: with the tested torch $CUDA_TORCH (CUDA 12, Python 3.10-3.13; no TORCH_SPEC), remove the stale packages with
  $UV_SHOWN pip uninstall --python .venv/bin/python $KERNEL_PKGS
and run this setup again with the same extras; otherwise compile them for your torch with nvcc as docs/gpu.md says
("No prebuilt wheel"). Until then canonlm runs, but kernels=auto falls back to the PyTorch paths for these ops.
EOF
  } >&2
  return 1
}
UV_SHOWN=uv
if [ -n "$check_only" ]; then if check_kernels; then exit 0; else exit 1; fi; fi

# --- checks before any work -----------------------------------------------------------------------------------------
has() { [[ ",$extras," == *",$1,"* ]]; }
known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/s/^\([A-Za-z0-9_-]\+\) *=.*/\1/p' pyproject.toml | tr '\n' ' ')
IFS=, read -r -a asked <<<"$extras"
for e in ${asked[@]+"${asked[@]}"}; do                             # a misspelt extra is an error, not a no-op
  [[ " $known" == *" $e "* ]] || die "extras '$extras': unknown extra '$e' (pyproject.toml defines: ${known% })"
done
gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
cuda_torch=""
if [ -n "$gpu" ] || has cuda; then cuda_torch=1; fi
TORCH_CUDA=${TORCH_CUDA:-cu128}
[ "$(uname -s)" = Linux ] || die "uv.lock covers Linux only (triton, mamba-ssm and the CUDA kernels publish no wheels for
$(uname -s)); there, install without the lock: python3 -m pip install -e '.[$extras]' (without interp and cuda)"
for e in cuda interp; do
  if [ -n "$wheelhouse" ] && has $e; then
    die "extras '$extras' with --wheelhouse: '$e' cannot be installed offline ('cuda': flash-attn and the CUDA builds of
causal-conv1d / mamba-ssm, whose setup.py downloads from GitHub; 'interp': triton==3.9.0 for the CPU test tier). Offline,
the kernels' Python parts (fla-core, mamba-ssm and causal-conv1d without their CUDA ops) are always installed from the
wheelhouse and the torch already there is kept: drop '$e' (e.g. --wheelhouse DIR dev)."
  fi
done
if has interp && [ -n "$cuda_torch" ]; then
  die "extras '$extras': 'interp' is the CPU test tier (Triton's interpreter, triton==3.9.0); it cannot share a venv with
the CUDA torch $CUDA_TORCH (triton 3.4.0) that a GPU or the cuda extra gets. On a GPU machine use dev,cuda and
\`pytest -m gpu\`; run dev,interp on a machine without a GPU."
fi
pybin=$PY
if [ -x "$VPY" ]; then pybin=$VPY; fi
pyv=$("$pybin" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "PYTHON='$PY' does not run"
if has interp && [ "$pyv" = 3.10 ]; then
  die "extras '$extras': 'interp' needs Python >= 3.11 (triton 3.9.0 publishes no wheel for $pyv): run with PYTHON=python3.11 or newer"
fi
if [ -n "$cuda_torch" ] && [ -z "${TORCH_SPEC:-}" ] && [ -z "$wheelhouse" ]; then
  case "$TORCH_CUDA" in cu126|cu128|cu129) ;;
    *) die "TORCH_CUDA='$TORCH_CUDA' (allowed: cu126, cu128, cu129: the CUDA 12 builds of torch $CUDA_TORCH)" ;;
  esac
fi
if has cuda; then
  case "$pyv" in 3.10|3.11|3.12|3.13) ;;
    *) echo "[setup] WARNING: Python $pyv: the kernels' prebuilt wheels are for CPython 3.10-3.13 only, expect the import" \
            "check to fail (remove .venv, run with PYTHON=python3.12)" >&2 ;;
  esac
fi

# --- which torch: the one in .venv, or a CUDA torch >= 2.7 of the base interpreter ---------------------------------
TORCH_PROBE='import torch; print(torch.__version__, torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)'
# cuda_ge_27 VERSION CUDA: a CUDA build of torch >= 2.7 (the floor fla-core[cuda] 0.6 sets): kept, never replaced
cuda_ge_27() {
  [[ $1 =~ ^([0-9]+)\.([0-9]+) ]] && [[ $2 != None && -n $2 ]] || return 1
  (( BASH_REMATCH[1] > 2 || (BASH_REMATCH[1] == 2 && BASH_REMATCH[2] >= 7) ))
}
torch_now="" torch_from="" sys_site="" base_sites=""
if [ -x "$VPY" ]; then
  torch_now=$("$VPY" -c "$TORCH_PROBE" 2>/dev/null || true) torch_from=" (in .venv)"
elif ! has interp; then
  base_torch=$("$PY" -c "$TORCH_PROBE" 2>/dev/null || true)
  read -r bv bc _ <<<"${base_torch:-none none none}"
  if cuda_ge_27 "$bv" "$bc"; then
    sys_site=1 torch_now=$base_torch torch_from=" (from $PY)"
    # A venv made from a venv with --system-site-packages sees the interpreter the outer venv was made from, not the
    # outer venv's packages: those folders go into a .pth file in .venv's site-packages instead
    base_sites=$("$PY" -c 'import site, sys; sys.prefix != sys.base_prefix and print(" ".join(site.getsitepackages()))')
  fi
fi
read -r tv tc tabi <<<"${torch_now:-none none none}"

# --- uv --------------------------------------------------------------------------------------------------------------
. scripts/_uv.sh
find_uv "$wheelhouse" || die "no uv: neither \$UV, nor uv 0.13+ on PATH, nor could pip install uv==$UV_PIN$([ -n "$wheelhouse" ] && echo " from $wheelhouse (bash scripts/wheelhouse.sh puts it there)")"
UV_SHOWN=$UV
export UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=.venv
# uv compiles nothing by default (Python compiles each module on its first import and keeps the .pyc); where
# PYTHONDONTWRITEBYTECODE forbids that, every install compiles at once
compile=()
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then compile=(--compile-bytecode); fi

# --- offline: the locked versions this machine needs, checked against the wheelhouse before anything is written ------
if [ -n "$wheelhouse" ]; then
  need=$(mktemp); trap 'rm -f "$need" "$need.all" "$need.have"' EXIT
  groups=(); for e in ${asked[@]+"${asked[@]}"}; do groups+=(--extra "$e"); done
  node_export "$need.all" --frozen --offline ${groups[@]+"${groups[@]}"} || die "uv export from uv.lock failed (its error is above)"
  # the check evaluates markers and wheel tags for $PY: it must be the Python .venv runs
  if [ -x "$VPY" ] && [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$pyv" ]; then
    die "offline: .venv runs Python $pyv but PYTHON='$PY' is another; run with PYTHON=<the Python .venv was made from>"
  fi
  # what .venv will see installed: .venv's own packages, or python3's when .venv is to share them
  seen=$PY; if [ -x "$VPY" ]; then seen=$VPY; fi
  if [ -x "$VPY" ] || [ -n "$sys_site" ]; then
    "$seen" -c 'import importlib.metadata as m; [print(d.metadata["Name"] + "==" + d.version) for d in m.distributions() if d.metadata["Name"]]' >"$need.have"
  else : >"$need.have"; fi
  "$PY" scripts/wheelhouse.py check "$wheelhouse" "$need.all" "$need.have" "$need" "$extras" || exit 2
  if [ -z "$torch_now" ] && [ -z "${TORCH_SPEC:-}" ]; then
    die "offline, and no torch: neither .venv nor $PY has a CUDA build of torch >= 2.7 to keep, and torch is never put
into a wheelhouse. Use the machine's torch (remove .venv so that setup.sh creates it sharing $PY's packages), or add a
torch wheel to $wheelhouse and name it with TORCH_SPEC=torch==<version>."
  fi
fi

# --- venv and torch -------------------------------------------------------------------------------------------------
if [ ! -x "$VPY" ]; then
  if [ -n "$sys_site" ] && [ -n "$base_sites" ]; then
    pth=.venv/lib/python$pyv/site-packages/_base_python.pth
    echo "[setup] $PY has torch $tv (CUDA $tc) and is itself a venv: creating .venv with its site-packages" \
         "($base_sites) in $pth, so that this torch stays visible in it and is kept"
    run "$UV" venv --quiet --python "$PY" .venv
    if [ -n "$DRY" ]; then echo "+ write $pth: $base_sites"; else printf '%s\n' $base_sites >"$pth"; fi
  elif [ -n "$sys_site" ]; then
    echo "[setup] $PY has torch $tv (CUDA $tc): creating .venv with --system-site-packages, so that this torch" \
         "stays visible in it and is kept, not replaced"
    run "$UV" venv --quiet --python "$PY" --system-site-packages .venv
  else
    echo "[setup] creating .venv with $("$PY" --version 2>&1)"
    run "$UV" venv --quiet --python "$PY" .venv
  fi
fi
pip=("$UV" pip install --python "$VPY" ${compile[@]+"${compile[@]}"})
if [ -n "$wheelhouse" ]; then
  if [ -n "$torch_now" ]; then echo "[setup] keeping torch $tv (CUDA $tc)$torch_from; offline, nothing replaces it"
  else run "${pip[@]}" --offline --no-index --find-links "$wheelhouse" "$TORCH_SPEC"; fi
  if [ -n "$gpu" ] && [ -n "$torch_now" ] && ! cuda_ge_27 "$tv" "$tc"; then
    echo "[setup] WARNING: a CUDA GPU is visible but torch $tv is not a CUDA build >= 2.7; the GPU paths will not run" >&2
  fi
elif [ -n "${TORCH_SPEC:-}" ]; then
  if [ -n "$cuda_torch" ]; then
    echo "[setup] WARNING: TORCH_SPEC=$TORCH_SPEC instead of the tested torch $CUDA_TORCH: the prebuilt flash-attn," \
         "causal-conv1d and mamba-ssm wheels may not match it (docs/gpu.md); the import check names any that" \
         "does not load" >&2
  fi
  if [ -z "$torch_now" ]; then run "${pip[@]}" "$TORCH_SPEC"; fi
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
      run "$UV" pip uninstall --python "$VPY" $KERNEL_PKGS
    fi
    run "${pip[@]}" "torch==$CUDA_TORCH+$TORCH_CUDA" --index "${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/$TORCH_CUDA}"
  fi
elif [ -z "$torch_now" ]; then
  # uv does not read pip's configuration: a find-links folder of it that holds the wheel is used instead of the index
  links=$("$PY" -m pip config get global.find-links 2>/dev/null || true)
  local_whl=""
  for d in ${PIP_FIND_LINKS:-} $links; do
    if compgen -G "$d/torch-$CPU_TORCH+cpu-*.whl" >/dev/null; then local_whl=$d; break; fi
  done
  if [ -n "$local_whl" ]; then
    echo "[setup] no CUDA GPU: installing the CPU build of torch $CPU_TORCH (from pip's find-links folder $local_whl)"
    run "${pip[@]}" "torch==$CPU_TORCH+cpu" --find-links "$local_whl"
  else
    echo "[setup] no CUDA GPU: installing the CPU build of torch $CPU_TORCH"
    run "${pip[@]}" "torch==$CPU_TORCH+cpu" --index "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
elif [ -n "$sys_site" ]; then
  echo "[setup] torch $tv (CUDA $tc)$torch_from already installed: kept"
fi

# --- canonlm and everything else ------------------------------------------------------------------------------------
if [ -n "$wheelhouse" ]; then
  echo "[setup] installing the locked wheels this machine lacks, then canonlm, from $wheelhouse only"
  if [ -s "$need" ]; then run "${pip[@]}" --offline --no-index --find-links "$wheelhouse" --no-deps -r "$need"; fi
  run "${pip[@]}" --offline --no-index --find-links "$wheelhouse" --no-deps --no-build-isolation -e .
else
  sync=("$UV" sync --locked --inexact --no-install-package torch ${compile[@]+"${compile[@]}"})
  for e in ${asked[@]+"${asked[@]}"}; do sync+=(--extra "$e"); done
  if has cuda; then sync+=(--no-install-package triton); fi                       # torch's own, kept
  if has cuda || has interp; then
    # the sdists build against .venv's torch and the build group, so those come first
    skip=(); for p in $KERNEL_PKGS; do skip+=(--no-install-package "$p"); done
    run "${sync[@]}" --group build "${skip[@]}"
    flags=(CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE)
    if has cuda; then
      # their setup.py downloads the prebuilt wheel for this torch; --no-cache: never a build made for another torch
      flags+=(FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE)
      echo "[setup] building flash-attn, causal-conv1d, mamba-ssm against torch $CUDA_TORCH (prebuilt wheels only)"
      run env "${flags[@]}" "${sync[@]}" --group build --no-cache \
        || die "uv could not install the CUDA kernels (its error is above). '<urlopen error ...>' from a setup.py: GitHub,
where the kernels' prebuilt wheels are, is unreachable from here; install the wheel files as docs/gpu.md says."
    else
      echo "[setup] building mamba-ssm and causal-conv1d without their CUDA builds (interpreter tier)"
      run env "${flags[@]}" CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${sync[@]}" --group build
    fi
  else
    run "${sync[@]}"
  fi
fi
# --- Hugging Face interop tests (tests/test_interop.py): the transformers the official LlamaCanon classes were
# written for (4.51.3), side-installed into .cache/hf451 when dev is asked for and the official release files are
# beside the checkout. The tests put it first on PYTHONPATH in a subprocess; a failure only warns.
if has dev && [ -d ../shared/data/physicslm4/huggingface ]; then
  if [ -n "$wheelhouse" ]; then
    echo "[setup] offline: .cache/hf451 (transformers 4.51.3 for the interop tests) not side-installed; those tests skip"
  elif [ -f .cache/hf451/transformers/__init__.py ]; then
    echo "[setup] .cache/hf451 (transformers 4.51.3 for the interop tests) already present"
  elif run "$UV" pip install --quiet --python "$VPY" --no-deps --target .cache/hf451 transformers==4.51.3 \
         "tokenizers>=0.21,<0.22" "huggingface_hub<1.0"; then
    echo "[setup] side-installed transformers 4.51.3 into .cache/hf451 (interop tests)"
  else
    echo "[setup] WARNING: could not side-install transformers 4.51.3 into .cache/hf451; tests/test_interop.py will skip" >&2
  fi
fi
if has cuda; then check_kernels || exit 1; fi
if [ -n "$DRY" ]; then echo "[setup] dry run: nothing was changed"; exit 0; fi
"$VPY" -c "import torch, canonlm; print('[setup] done: canonlm', canonlm.__version__, '| torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"
