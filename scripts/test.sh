#!/usr/bin/env bash
# Fresh machine -> set up and pass the tests (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1
if [ $# -eq 0 ]; then  # the whole suite starts with the layers (import-linter) and lint (ruff): seconds, and first
    lint-imports
    ruff check .
fi
if [ $# -gt 0 ]; then  # a selection (-m browser, -k ..., a file): one pass, in order
    exec python -m pytest -q --durations=40 tests "$@"
fi
# The suite on MOELAB_TEST_WORKERS pytest-xdist workers (default: one per core this process may use, nproc; 0: in
# this process): a multi-rank test spends most of its wall time starting processes and waiting on emulated links,
# so one test per core shares the cores well. Tests that assert on wall-clock time (marker "timing") run alone
# afterwards. --durations: the slowest, so CI logs show where the time goes.
workers="${MOELAB_TEST_WORKERS:-$(nproc 2>/dev/null || python -c 'import os; print(os.cpu_count() or 1)')}"
python -m pytest -q --durations=40 -n "$workers" --dist loadgroup -m "not timing" tests
python -m pytest -q --durations=10 -m timing tests
