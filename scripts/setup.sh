#!/usr/bin/env bash
# Create ./.venv and install canonlm into it (editable).
#   bash scripts/setup.sh [EXTRAS]          EXTRAS e.g. dev | dev,interp | slurm,cuda
#   bash scripts/setup.sh --check-kernels   only the import check of the CUDA kernels in .venv (exit 1 naming failures)
#
# torch comes first. Without a CUDA GPU (and without the cuda extra) this installs the CPU build of torch 2.13.0 (a
# bare `pip install -e .` would resolve a multi-GB CUDA build); TORCH_CPU_INDEX points at a mirror of PyTorch's CPU
# wheels. With a CUDA GPU (nvidia-smi -L) or the cuda extra it installs torch 2.8.0 built for CUDA 12 (TORCH_CUDA=cu128,
# or cu126 / cu129; TORCH_CUDA_INDEX for a mirror): flash-attn, causal-conv1d and mamba-ssm, at the versions the cuda
# extra pins, publish prebuilt wheels for torch 2.8 / CUDA 12 / C++11 ABI / CPython 3.10-3.13 (docs/gpu.md). The cuda
# extra is then installed with --no-build-isolation, taking those wheels only (never an nvcc compile), and every
# kernel is import-checked. TORCH_SPEC="torch==..." installs that torch instead when .venv has none.
# `interp` (the CPU test tier) also installs the pure-Python parts of mamba-ssm and causal-conv1d.
# SETUP_DRY_RUN=1 prints the plan (each command that would change .venv, prefixed "+ ") and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VPY=.venv/bin/python
DRY=${SETUP_DRY_RUN:-}
run() { if [ -n "$DRY" ]; then echo "+ $*"; else "$@"; fi; }
die() { echo "[setup] ERROR: $*" >&2; exit 2; }

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

case "${1:-}" in
  --check-kernels) if check_kernels; then exit 0; else exit 1; fi ;;
  -*) die "unknown option '$1' (allowed: an extras list such as dev,interp or slurm,cuda; or --check-kernels)" ;;
esac
extras=${1:-}
has() { [[ ",$extras," == *",$1,"* ]]; }
gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
cuda_torch=""
if [ -n "$gpu" ] || has cuda; then cuda_torch=1; fi
TORCH_CUDA=${TORCH_CUDA:-cu128}

# --- checks before any work -----------------------------------------------------------------------------------------
if has interp && [ -n "$cuda_torch" ]; then
  die "extras '$extras': 'interp' is the CPU test tier (Triton's interpreter, triton==3.9.0); it cannot share a venv with
the CUDA torch $CUDA_TORCH (triton 3.4.0) that a GPU or the cuda extra gets. On a GPU machine use dev,cuda and
\`pytest -m gpu\`; run dev,interp on a machine without a GPU."
fi
if [ -n "$cuda_torch" ] && [ -z "${TORCH_SPEC:-}" ]; then
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

# --- venv and torch -------------------------------------------------------------------------------------------------
if [ ! -x "$VPY" ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1)"
  run "$PY" -m venv .venv
fi
if [ -z "$DRY" ]; then . .venv/bin/activate; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip byte-compiles every file it installs, one file after another (80 of the 210 s a fresh dev,interp install took on
# 2 cores). Here pip skips it: Python compiles each module on its first import and keeps the .pyc, so only what is
# used gets compiled; where PYTHONDONTWRITEBYTECODE forbids that (every import would recompile), the venv is
# compiled once at the end on every core (compileall -j 0). pip reads the environment variable of a --no-* flag
# inverted: PIP_NO_COMPILE=0 means --no-compile.
export PIP_NO_COMPILE=0
torch_now=""    # "version cuda cxx11abi" of the torch in .venv, empty when none imports
if [ -x "$VPY" ]; then
  torch_now=$("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)' \
              2>/dev/null || true)
fi

if [ -n "${TORCH_SPEC:-}" ]; then
  if [ -n "$cuda_torch" ]; then
    echo "[setup] WARNING: TORCH_SPEC=$TORCH_SPEC instead of the tested torch $CUDA_TORCH: the prebuilt flash-attn," \
         "causal-conv1d and mamba-ssm wheels may not match it (docs/gpu.md); the import check names any that" \
         "does not load" >&2
  fi
  if [ -z "$torch_now" ]; then run pip install "$TORCH_SPEC"; fi
elif [ -n "$cuda_torch" ]; then
  read -r tv tc tabi <<<"${torch_now:-none none none}"
  if [[ $tv == "${CUDA_TORCH%.*}".* && $tc == 12.* && $tabi == True ]]; then
    echo "[setup] torch $tv (CUDA $tc) already installed: the kernels' prebuilt wheels are for it"
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
fi
if [ -z "$DRY" ]; then
  python -c "import torch; print('[setup] torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"
fi

# --- canonlm and its extras -----------------------------------------------------------------------------------------
if has cuda; then
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
if has dev && [ -d ../shared/data/physicslm4/huggingface ]; then
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
if [ -n "$DRY" ]; then echo "[setup] dry run: nothing was changed"
else echo "[setup] done: $(python -c 'import canonlm; print("canonlm", canonlm.__version__)')"; fi
