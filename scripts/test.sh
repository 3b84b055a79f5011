#!/usr/bin/env bash
# Fresh machine -> set up and pass the tests (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1
if [ $# -gt 0 ]; then  # a selection (-m browser, -k ..., a file): one pass, in order
    exec python -m pytest -q --durations=40 tests "$@"
fi
# The suite on MOELAB_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process): a multi-rank test spends
# most of its wall time starting processes and waiting on emulated links, so two at once share the cores well.
# Tests that assert on wall-clock time (marker "timing") run alone afterwards. --durations: the slowest, so CI
# logs show where the time goes.
python -m pytest -q --durations=40 -n "${MOELAB_TEST_WORKERS:-2}" --dist loadgroup -m "not timing" tests
python -m pytest -q --durations=10 -m timing tests
