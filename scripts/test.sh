#!/usr/bin/env bash
# The project's test command (README and CI): the whole suite, slow tests included, on three pytest
# workers (pytest-xdist; tests take work from each other's queue) with the 25 slowest tests listed.
# Three on two cores: many tests wait on processes they start (Ray, jobs), so a third worker fills
# the cores those waits leave idle. SPECPIPE_TEST_WORKERS sets another count.
# Extra arguments go to pytest: `-m "not slow"` is the fast tier, `-n 0` runs in one process.
set -uo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SPECPIPE_TEST_WORKERS:-3}" --dist worksteal \
    --durations=25 "$@"
