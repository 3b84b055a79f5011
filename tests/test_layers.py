"""The library stands without the reproductions: importing moelab (and its core) loads no ``moelab.papers``
module and no strategy. The layers themselves are checked by import-linter (``lint-imports``, the contracts
in pyproject.toml), which scripts/test.sh runs before the suite."""
from __future__ import annotations

import subprocess
import sys


def _loaded(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_importing_moelab_loads_no_paper_and_no_strategy():
    mods = _loaded("import moelab")
    assert not [m for m in mods if m.startswith("moelab.papers")]
    assert not [m for m in mods if m.startswith("moelab.strategies.")]


def test_the_core_finds_a_strategy_by_name_without_the_papers():
    mods = _loaded("from moelab.registry import get\nget('hecate')\nimport moelab.runtime.train, moelab.sim")
    assert "moelab.strategies.hecate" in mods
    assert not [m for m in mods if m.startswith("moelab.papers")]
