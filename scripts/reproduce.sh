#!/usr/bin/env bash
# Fresh machine -> set up and reproduce the papers' figures at the default scale into reports/: HTML figures
# loading one reports/assets/plotly-*.min.js, and a PNG and an SVG of each where a Chromium is found.
#   bash scripts/reproduce.sh [--scale smoke|default|full] [--no-images] [NAMES...]
# Other options go to `moelab reproduce` as given (moelab reproduce --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${MOELAB_VENV:-.venv}/bin/activate"
SCALE=default
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --scale) SCALE="$2"; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
[ ${#ARGS[@]} -eq 0 ] && ARGS=(all)
moelab reproduce "${ARGS[@]}" --scale "$SCALE" --out reports
