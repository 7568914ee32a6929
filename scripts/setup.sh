#!/usr/bin/env bash
# Create ./.venv and install canonlm into it (editable).   Usage: bash scripts/setup.sh [extras, e.g. dev | dev,slurm]
#
# torch comes first: on a machine without a CUDA GPU this installs the CPU build of torch (a bare
# `pip install -e .` would resolve a multi-GB CUDA build). Set TORCH_SPEC to choose another build yourself, e.g.
# TORCH_SPEC="torch==2.7.1" on a GPU box, or TORCH_CPU_INDEX to point at a mirror of PyTorch's CPU wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version 2>&1)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    pip install "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA GPU found: installing torch from the default index"
    pip install "torch>=2.5"
  else
    echo "[setup] no CUDA GPU: installing the CPU build of torch 2.13.0"
    pip install "torch==2.13.0+cpu" 2>/dev/null \
      || pip install "torch==2.13.0" --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
python -c "import torch; print('[setup] torch', torch.__version__, '| CUDA available:', torch.cuda.is_available())"

extras=${1:-}
pip install -e ".${extras:+[$extras]}"
# --- Hugging Face interop tests (tests/test_interop.py, marker `interop`) ---------------------------------------
# With `dev` among the extras and the official PhysicsLM4 release files in ../shared/data/physicslm4/huggingface,
# side-install the transformers those official LlamaCanon classes were written for (4.51.3) into .cache/hf451; the
# tests run the official classes in a subprocess with that directory first on PYTHONPATH (the venv keeps its own
# transformers). Idempotent (skipped when present); a failure only prints a warning.
if [[ ",${extras}," == *",dev,"* ]] && [ -d ../shared/data/physicslm4/huggingface ]; then
  if [ -f .cache/hf451/transformers/__init__.py ]; then
    echo "[setup] .cache/hf451 (transformers 4.51.3 for the interop tests) already present"
  elif pip install --no-deps --target .cache/hf451 transformers==4.51.3 "tokenizers>=0.21,<0.22" "huggingface_hub<1.0"; then
    echo "[setup] side-installed transformers 4.51.3 into .cache/hf451 (interop tests)"
  else
    echo "[setup] WARNING: could not side-install transformers 4.51.3 into .cache/hf451; tests/test_interop.py will skip" >&2
  fi
fi
echo "[setup] done: $(python -c 'import canonlm; print("canonlm", canonlm.__version__)')"
