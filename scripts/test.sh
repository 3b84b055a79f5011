#!/usr/bin/env bash
# Fresh machine -> set up and pass the tests (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1
python -m pytest -q tests "$@"
