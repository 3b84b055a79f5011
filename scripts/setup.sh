#!/usr/bin/env bash
# Create (or reuse) .venv with moelab and its test/dev extras. Idempotent.
#   MOELAB_VENV      where the environment goes (default: .venv)
#   MOELAB_TORCH     the torch requirement installed first (default: torch==2.13.0; GPU users may
#                    set e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   MOELAB_EXTRAS    pip extras (default: dev = tests + jupyterlab)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOELAB_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086
    python -m pip install -q ${MOELAB_TORCH:-torch==2.13.0}
fi
python -m pip install -q -e ".[${MOELAB_EXTRAS:-dev}]"
python -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 || true
# Optional: a Chromium lets kaleido export PNG/SVG (HTML is always written without it).
if ! command -v chromium >/dev/null 2>&1 && [ "${MOELAB_INSTALL_CHROMIUM:-1}" = 1 ] \
        && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "note: could not install chromium; figures will be exported as HTML only"
fi
echo "moelab environment ready: $VENV ($(python -c 'import torch; print("torch", torch.__version__)'))"
