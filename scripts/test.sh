#!/usr/bin/env bash
# Fresh machine -> set up and pass the tests (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1
python -m pytest -q --durations=40 tests "$@"  # the 40 slowest, so CI logs show where the time goes
