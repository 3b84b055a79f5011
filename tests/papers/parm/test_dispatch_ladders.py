"""Parm's headline dispatcher is an assumption (``dense_dispatch``) that reaches the simulator, and its gap ladders
start from the very numbers the paper-vs-moelab rows compare."""
from __future__ import annotations

import pytest

from moelab.papers.kit.ladder import load_ladders, walk
from moelab.papers.parm import ladders, paper_scale

SMOKE = "smoke"
INDEX = (("dense_dispatch", 0),)


def test_dense_dispatch_picks_the_headline_dispatcher():
    assert paper_scale.headline_dispatcher() == "einsum"
    assert paper_scale.headline_dispatcher(INDEX) == "index"


def test_the_dense_dispatch_is_a_cost_of_the_gathering_baseline():
    """The einsum is quadratic in the gate's tokens: the baseline gates N_ESP x S gathered tokens, S1 S / N_MP, so
    an index dispatch takes far more time off the baseline than off Parm's pick (Table V, N_MP = N_ESP = 4)."""
    dense, index = paper_scale.table5_sim(SMOKE), paper_scale.table5_sim(SMOKE, INDEX)
    assert "einsum dispatcher" in dense.attrs["label"] and "index dispatcher" in index.attrs["label"]
    saved_base = dense.baseline_ms - index.baseline_ms
    saved_parm = dense.parm_ms - index.parm_ms
    assert (saved_base > 0).all() and (saved_parm >= 0).all()
    assert (saved_base > 10 * saved_parm).all()
    assert (index.speedup < dense.speedup).all()


def test_the_parm_ladders_name_one_sourced_switch():
    lads = load_ladders("parm")
    assert set(lads) == {"speedup_max_cell", "table5_about3x"}
    for lad in lads.values():
        assert [(r.set, r.to, r.kind) for r in lad.rungs] == [("dense_dispatch", 0, "mechanism")]
        assert all("Fig. 1" in r.source for r in lad.rungs)


def test_the_table5_ladder_starts_from_the_compared_value():
    """Rung 0 is moelab's setting: the mean of table5s's speedups (paper.yaml's reducer for table5_about3x)."""
    df = walk("parm", load_ladders("parm")["table5_about3x"], SMOKE)
    assert df.headline.iloc[0] == pytest.approx(paper_scale.table5_sim(SMOKE).speedup.mean(), rel=1e-12)
    assert df.headline.iloc[1] == pytest.approx(ladders.table5_about3x(SMOKE, INDEX), rel=1e-12)
    assert df.headline.iloc[1] < df.headline.iloc[0]


def test_out_of_range_overrides_are_refused():
    with pytest.raises(Exception, match="range"):
        paper_scale.headline_dispatcher((("dense_dispatch", 2),))
