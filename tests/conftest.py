"""Shared pytest hooks, for every folder under tests/.

- Each test gets a marker named after its top folder under tests/ (``comm``, ``moe``, ``strategies``,
  ``papers``, ``e2e``, ...; ``toplevel`` for the files beside this one, which test moelab's top-level
  modules), so ``pytest -m comm`` or ``-m "not e2e"`` selects by area. Every folder's marker must be
  registered in pyproject.toml's ``[tool.pytest.ini_options] markers``: a new folder without one fails
  collection with a message saying so.
- The browser tests' screenshots are named at the end of the run (CI log).
- Under ``MOELAB_UNDER_LOAD`` (``bash scripts/test.sh --under-load``: CPU spinners beside the suite) the
  ``timing`` tests are skipped, not loosened: their bounds hold for an idle machine only.

Layout: tests/ mirrors the package (tests/<package>/test_<module>.py, tests/strategies/<name>/,
tests/papers/<paper>/, tests/papers/kit/) plus tests/e2e/ (multi-process runs, notebooks, the browser)
and tests/benchmarks/ (the scripts of benchmarks/). Every folder is a package (an ``__init__.py``), so
two folders may hold files of the same name; a test imports another test's helpers, and the shared
helpers here (fake_worker, browser_kit), as ``tests.<folder>.<module>``.
"""
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TOPLEVEL = "toplevel"  # the marker of tests/test_*.py


def folder_marker(path) -> str:
    """The marker of a test file: its top folder under tests/, or ``toplevel``."""
    rel = Path(path).resolve().relative_to(TESTS)
    return rel.parts[0] if len(rel.parts) > 1 else TOPLEVEL


def pytest_collection_modifyitems(config, items):
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    missing = set()
    for item in items:
        try:
            name = folder_marker(item.path)
        except ValueError:  # a test outside tests/ (none today)
            continue
        if name not in registered:
            missing.add(name)
        item.add_marker(getattr(pytest.mark, name))
        if os.environ.get("MOELAB_UNDER_LOAD") and item.get_closest_marker("timing"):
            item.add_marker(pytest.mark.skip(reason="a timing bound holds for an idle machine; this run is under load "
                                                    f"({os.environ['MOELAB_UNDER_LOAD']} CPU spinners)"))
    if missing:
        raise pytest.UsageError(f"test folder marker(s) {sorted(missing)} not registered: add each to "
                                "pyproject.toml's [tool.pytest.ini_options] markers")


def pytest_terminal_summary(terminalreporter):
    import sys

    kit = sys.modules.get("tests.browser_kit")
    shots = getattr(kit, "ARTIFACTS", [])
    if shots:
        terminalreporter.write_sep("-", "browser screenshots")
        for p in shots:
            terminalreporter.write_line(str(p))
