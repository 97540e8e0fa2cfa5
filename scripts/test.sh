#!/usr/bin/env bash
# The project's test command (README and CI): the whole suite, slow tests included.
set -uo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
