#!/usr/bin/env bash
# The GPU check, one command, on a machine with one CUDA device and torch, transformers and llguidance
# installed (no Ray, vLLM or network needed; without a network, bring llguidance as its wheel):
#
#     bash bench/gpu_check.sh [MODEL_DIR ...]
#
# 1. environment: nvidia-smi -L, python/torch/CUDA/transformers versions, the modules the check needs;
# 2. python3 -m pytest tests/engine/test_gpu.py (greedy identity, sampling, bf16 on CUDA; tiny random models,
#    plus a real checkpoint when a MODEL_DIR is given);
# 3. python3 -m bench.gpu_bench (random-init SmolLM2-135M, Qwen2.5-1.5B and Llama-3-8B shapes in bf16, or the
#    MODEL_DIRs: HF safetensors directories), in parts ordered by value: batch 1 against HF generate with its
#    static cache; plain decoding 64 and 256 at once next to the HBM and compute floors; a profiler summary of
#    the last model at batch 1 and 64; then drafters / compile / CUDA graphs as the budget allows.
# 4. with 2+ GPUs: python3 -m bench.tp_bench, tensor parallel over 2 GPUs (NCCL) against one, on the random-init
#    Llama-3-8B shape at batch 1 and 64 at once, within GPU_CHECK_TP_S (default 300 s, beyond the total above;
#    GPU_CHECK_TP_ARGS replaces its arguments: a CPU dry run with gloo is
#    GPU_CHECK_TP_ARGS="--device cpu --dtype float32 --shape tiny --batches 4 --max-tokens 8 --repeats 1").
# A MODEL_DIR that does not exist is reported and skipped. Everything fits in GPU_CHECK_TOTAL_S
# (default 480 s): the tests get at most GPU_CHECK_TEST_S (210 s), the benchmark the rest (no run starts in
# the last 60 s; one still going 10 s before the end is cut, its JSON holding every run finished before).
# Logs and gpu_bench.json go to $OUT when it is set. Env: PYTHON (python3), GPU_CHECK_SKIP_TESTS=1,
# GPU_CHECK_SKIP_BENCH=1, GPU_BENCH_ARGS (more gpu_bench flags; a CPU dry run of this script:
# GPU_BENCH_ARGS="--device cpu --dtype float32 --tiny"). Exit status: 2 when the environment check fails,
# 3 when torch sees no CUDA device (outside the dry run), else the tests' (0 when skipped), else the benchmark's.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOTAL_S=${GPU_CHECK_TOTAL_S:-480}
TEST_S=${GPU_CHECK_TEST_S:-210}
LOGDIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOGDIR" || { echo "cannot create the log folder $LOGDIR" >&2; exit 2; }
log() { echo "[gpu_check +${SECONDS}s] $*"; }

log "== environment"
nvidia-smi -L 2>&1 || log "nvidia-smi: not available"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
log "C compiler (Triton builds its launcher with one): $(command -v gcc || command -v cc || echo NONE)"
"$PY" - <<'EOF'
import importlib, sys
import torch, transformers
print(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"transformers {transformers.__version__}")
print("cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no device")
for name in ("llguidance", "triton", "numpy", "safetensors", "tokenizers", "pytest"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except ImportError:
        print(f"  {name} MISSING")
import pipeline.engine, pipeline.loading.models   # what the check imports from the project
print("pipeline.engine and pipeline.loading.models import")
EOF
[ $? -eq 0 ] || { log "the environment check failed (above): nothing else can run"; exit 2; }
# Without a CUDA device every GPU test skips and the benchmark cannot start on cuda: say so and fail,
# unless this is the CPU dry run (GPU_BENCH_ARGS with --device cpu)
case " ${GPU_BENCH_ARGS:-} " in
    *" --device cpu "*) DRY_RUN=1 ;;
    *) DRY_RUN=0 ;;
esac
if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    log "torch sees no CUDA device: the GPU check cannot run here (a CPU dry run: GPU_BENCH_ARGS=\"--device cpu --dtype float32 --tiny\")"
    exit 3
fi

DIRS=()
for d in "$@"; do
    if [ -d "$d" ]; then DIRS+=("$d"); else log "model dir $d: not found, skipped (real-model figures need it)"; fi
done
if [ ${#DIRS[@]} -gt 0 ] && [ -z "${SPECPIPE_GPU_MODEL_DIR:-}" ]; then
    export SPECPIPE_GPU_MODEL_DIR="${DIRS[0]}"          # tests/engine/test_gpu.py's real-checkpoint test
fi
[ ${#DIRS[@]} -gt 0 ] || log "no model dir: tests use tiny random models, the benchmark random-init real shapes"

TEST_RC=0
if [ "${GPU_CHECK_SKIP_TESTS:-0}" = 1 ]; then
    log "== tests skipped (GPU_CHECK_SKIP_TESTS=1)"
elif ! "$PY" -c "import pytest" 2>/dev/null; then
    log "== pytest is not installed for $PY: tests/engine/test_gpu.py NOT run (no network to install it)"
else
    log "== tests/engine/test_gpu.py (at most ${TEST_S} s; log: $LOGDIR/gpu_tests.log)"
    timeout "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=8 tests/engine/test_gpu.py 2>&1 \
        | tee "$LOGDIR/gpu_tests.log"
    TEST_RC=${PIPESTATUS[0]}
    [ "$TEST_RC" -eq 124 ] && log "tests: cut at ${TEST_S} s (timeout)"
    log "tests: exit status $TEST_RC"
fi

BENCH_RC=0
BUDGET_S=$((TOTAL_S - SECONDS - 60))            # no configuration starts later; warm-ups may run over
if [ "${GPU_CHECK_SKIP_BENCH:-0}" = 1 ]; then
    log "== benchmark skipped (GPU_CHECK_SKIP_BENCH=1)"
elif [ "$BUDGET_S" -lt 60 ]; then
    log "== benchmark skipped: only ${BUDGET_S} s of the ${TOTAL_S} s left"
else
    log "== bench/gpu_bench.py (configurations start within ${BUDGET_S} s; log: $LOGDIR/gpu_bench.log)"
    timeout $((BUDGET_S + 50)) "$PY" -m bench.gpu_bench --budget-s "$BUDGET_S" --out "$LOGDIR/gpu_bench.json" \
        ${DIRS[@]+--model-dir "${DIRS[@]}"} ${GPU_BENCH_ARGS:-} 2>&1 | tee "$LOGDIR/gpu_bench.log"
    BENCH_RC=${PIPESTATUS[0]}
    [ "$BENCH_RC" -eq 124 ] && log "benchmark: cut by timeout (results so far are in gpu_bench.json)"
fi
TP_RC=0
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${GPUS:-0}" -ge 2 ] || [ -n "${GPU_CHECK_TP_ARGS:-}" ]; then
    log "== tensor parallel: bench/tp_bench.py, 2 ranks against 1 (at most ${GPU_CHECK_TP_S:-300} s; log: $LOGDIR/tp_bench.log)"
    # shellcheck disable=SC2086
    timeout "${GPU_CHECK_TP_S:-300}" "$PY" -m bench.tp_bench \
        ${GPU_CHECK_TP_ARGS:---device cuda --shape llama-3-8b-shape --batches 1 64 --max-tokens 64 --repeats 1} \
        --out "$LOGDIR/tp_bench.json" 2>&1 | tee "$LOGDIR/tp_bench.log"
    TP_RC=${PIPESTATUS[0]}
else
    log "== tensor parallel: skipped (${GPUS:-0} GPU; it needs 2)"
fi
log "done: tests exit $TEST_RC, benchmark exit $BENCH_RC, tensor parallel exit $TP_RC; logs and JSON in $LOGDIR"
[ "$TEST_RC" -ne 0 ] && exit "$TEST_RC"
[ "$BENCH_RC" -ne 0 ] && exit "$BENCH_RC"
exit "$TP_RC"
