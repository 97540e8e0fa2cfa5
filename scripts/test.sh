#!/usr/bin/env bash
# The project's test command (README and CI): the whole suite, slow tests included, on three pytest
# workers (pytest-xdist; tests take work from each other's queue) with the 25 slowest tests listed.
# Three on two cores: many tests wait on processes they start (Ray, jobs), so a third worker fills
# the cores those waits leave idle. SPECPIPE_TEST_WORKERS sets another count.
# Extra arguments go to pytest: `-m "not slow"` is the fast tier, `-n 0` runs in one process.
# SPECPIPE_TEST_CPU=avx2 | avx512 | avx512_bf16 runs the suite as on that kind of CPU, where this one has
# more: the product's flags mask (pipeline/engine/backends/cpu/isa.py: its plans, dtype and kernel
# builds) and torch's and oneDNN's own instruction sets.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${SPECPIPE_TEST_CPU:-}" in
  "") ;;
  avx2)        export SPECPIPE_CPU_FLAGS_OFF="avx512*,amx*,avx_vnni*" ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avx512)      export SPECPIPE_CPU_FLAGS_OFF="avx512_bf16,avx512_fp16,amx*" ATEN_CPU_CAPABILITY=avx512 \
                      ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI ;;
  avx512_bf16) export SPECPIPE_CPU_FLAGS_OFF="avx512_fp16,amx*" ATEN_CPU_CAPABILITY=avx512 \
                      ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ;;
  *) echo "SPECPIPE_TEST_CPU must be avx2, avx512 or avx512_bf16, got '$SPECPIPE_TEST_CPU'" >&2; exit 2 ;;
esac
# inductor's on-disk cache is not keyed by ATEN_CPU_CAPABILITY: code it compiled for this CPU's own
# instructions, read back under another capability, computes garbage. Each kind gets its own cache.
if [[ -n "${SPECPIPE_TEST_CPU:-}" ]]; then
  export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor-$(id -u)-$SPECPIPE_TEST_CPU"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SPECPIPE_TEST_WORKERS:-3}" --dist worksteal \
    --durations=25 "$@"
