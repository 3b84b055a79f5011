"""Hecate's Table 1 counted by the paper's rule (the notebook's smoke execution is in
tests/e2e/test_paper_notebooks.py)."""
from __future__ import annotations


def test_table1_counts_the_papers_params():
    from moelab.papers.hecate.common import table1

    t = table1()
    assert t.matches_paper.all(), t[["model", "params_B", "paper_params_B"]]
    assert (t.params == t.layers * (4 * t.experts + 4) * t.d_model ** 2).all()
