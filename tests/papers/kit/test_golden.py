"""Regressions caught: the SIMULATED paper-scale values at smoke scale equal the checked-in golden file to 1e-9
(a change that moves one is a deliberate ``python -m moelab.papers.kit.golden --write <paper>``, reviewed)."""
from __future__ import annotations

import pytest

from moelab.papers.kit.golden import differences, golden_path, load_golden, simulated_values

PAPERS = ("fastermoe", "hecate", "lina", "lsh_moe", "parm")


@pytest.mark.parametrize("paper", PAPERS)
def test_simulated_values_equal_the_golden_file(paper):
    assert golden_path(paper).is_file(), f"no golden file: python -m moelab.papers.kit.golden --write {paper}"
    old, new = load_golden(paper), simulated_values(paper)
    assert new, f"{paper}: no SIMULATED comparison row was made at smoke scale"
    diff = differences(old, new)
    assert not diff, (f"{paper}: SIMULATED values moved (if meant: python -m moelab.papers.kit.golden --write "
                      f"{paper}, and say why in the commit):\n" + "\n".join(diff))


def test_differences_name_what_moved_appeared_and_vanished():
    old = {"a": 1.0, "b": 2.0, "c": 3.0}
    assert differences(old, dict(old)) == []
    assert differences(old, {**old, "a": 1.0 + 1e-12}) == []  # within 1e-9 relative
    d = differences(old, {"a": 1.0 + 1e-8, "b": 2.0, "d": 4.0})
    assert [line.split(":")[0] for line in d] == ["moved", "gone", "new"]
    assert "1.0 -> 1.00000001" in d[0]
