#!/usr/bin/env bash
# The project's test command (README and CI): the whole suite, slow tests included, on two pytest
# workers (pytest-xdist; tests take work from each other's queue) with the 25 slowest tests listed.
# Extra arguments go to pytest: `-m "not slow"` is the fast tier, `-n 0` runs in one process.
set -uo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SPECPIPE_TEST_WORKERS:-2}" --dist worksteal \
    --durations=25 "$@"
