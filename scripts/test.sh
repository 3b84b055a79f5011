#!/usr/bin/env bash
# Fresh machine -> set up and pass the tests (this is what CI runs).
#   bash scripts/test.sh                     the whole suite (layers, lint, tests, then the timing tests alone)
#   bash scripts/test.sh -k gates            a selection, one pass
#   bash scripts/test.sh --under-load [N]    the whole suite beside N busy CPU processes (default: one per core),
#                                            as on a shared laptop or CI host; timing tests are skipped
set -euo pipefail
cd "$(dirname "$0")/.."
load=0
if [ "${1:-}" = "--under-load" ]; then
    shift
    load="$(nproc 2>/dev/null || echo 2)"
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then load="$1"; shift; fi
fi
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1
spinners=()
stop_spinners() { for pid in "${spinners[@]}"; do kill "$pid" 2>/dev/null || true; done; }
if [ "$load" -gt 0 ]; then  # pure CPU spinners owned by this script, stopped by pid whatever happens
    trap stop_spinners EXIT INT TERM
    for _ in $(seq "$load"); do python -c "while True: pass" & spinners+=("$!"); done
    export MOELAB_UNDER_LOAD="$load"
    echo "under load: $load CPU spinners (pids ${spinners[*]}); timing tests skipped"
fi
if [ $# -eq 0 ]; then  # the whole suite starts with the layers (import-linter) and lint (ruff): seconds, and first
    lint-imports
    ruff check .
fi
if [ $# -gt 0 ]; then  # a selection (-m browser, -k ..., a file): one pass, in order
    python -m pytest -q --durations=40 tests "$@"
    exit
fi
# The suite on MOELAB_TEST_WORKERS pytest-xdist workers (default: one per core this process may use, nproc; 0: in
# this process): a multi-rank test spends most of its wall time starting processes and waiting on emulated links,
# so one test per core shares the cores well. Tests that assert on wall-clock time (marker "timing") run alone
# afterwards. --durations: the slowest, so CI logs show where the time goes.
workers="${MOELAB_TEST_WORKERS:-$(nproc 2>/dev/null || python -c 'import os; print(os.cpu_count() or 1)')}"
python -m pytest -q --durations=40 -n "$workers" --dist loadgroup -m "not timing" tests
if [ "$load" -eq 0 ]; then
    python -m pytest -q --durations=10 -m timing tests
fi
