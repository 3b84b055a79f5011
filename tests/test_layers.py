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


def test_no_core_module_names_a_system_in_its_imports():
    """A system lives in its strategy package (and its reproduction in moelab.papers): the core reaches it through
    the registry by name. Any import, at module top or inside a function, of a strategy package from outside
    moelab/strategies/ and moelab/papers/ fails here (the composer, moelab.strategies.compose, is the strategies'
    own layer)."""
    import ast
    from pathlib import Path

    import moelab

    root = Path(moelab.__file__).parent
    systems = {p.name for p in (root / "strategies").iterdir() if (p / "__init__.py").is_file()}
    bad = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).parts
        if rel[0] in ("strategies", "papers"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                parts = n.split(".")
                if parts[:2] == ["moelab", "strategies"] and len(parts) > 2 and parts[2] in systems:
                    bad.append(f"{'/'.join(rel)}:{node.lineno} imports {n}")
    assert not bad, "\n".join(bad)
