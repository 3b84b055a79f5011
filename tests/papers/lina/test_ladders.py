"""Lina's gap-ladder functions read the paper-vs-moelab rows exactly, and a rung reprices the whole chain."""
import pytest

from moelab.papers.kit.compare import load_numbers
from moelab.papers.kit.ladder import load_ladders
from moelab.papers.lina import ladders, paper_scale


def _row(key, df):
    src = load_numbers("lina")[key]["moelab"][0]
    for col, want in src["where"].items():
        df = df[df[col] == want]
    return float(df[src["column"]].mean())


def test_each_ladder_starts_from_its_rows_value_and_its_rung_reprices():
    df = paper_scale.training("smoke")
    lads = load_ladders("lina")
    assert set(lads) == {"bwd_a2a_E4", "step_mean"}
    for key, fn in (("bwd_a2a_E4", ladders.bwd_a2a_E4), ("step_mean", ladders.step_mean)):
        assert fn("smoke") == pytest.approx(_row(key, df), rel=1e-12)
        rung = tuple((r.set, r.to) for r in lads[key].rungs)
        assert fn("smoke", rung) > 0
    assert ladders.step_mean("smoke", (("vocab", 256.0),)) != ladders.step_mean("smoke")  # the head shrinks
