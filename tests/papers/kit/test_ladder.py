"""The gap ladder: rungs are checked data (a sourced paper-side value of an assumption the code reads, inside its
range) and each rung's share of the log-gap is what the headline did."""
from __future__ import annotations

import math

import pytest

from moelab.papers.kit.assumptions import AssumptionError
from moelab.papers.kit.compare import paper_value
from moelab.papers.kit.ladder import LadderError, load_ladders, walk

KEY = "zero3_speedup_trevor"


def _toy(scale, overrides):
    """Four times the paper's number, halved by each rung applied."""
    return 4 * paper_value("fastermoe", KEY) / 2 ** len(overrides)


def _yaml(tmp_path, rungs, key=KEY):
    body = "\n".join(f"      - {r}" for r in rungs)
    p = tmp_path / "ladders.yaml"
    p.write_text(f"ladders:\n  {key}:\n    evaluate: tests.papers.kit.test_ladder:_toy\n    profile: toy\n"
                 f"    rungs:\n{body}\n")
    return p


RUNG = '{set: trevor_nic_Gbps, to: 100, kind: setting, source: "paper §5"}'
RUNG2 = '{set: shadow_comm_factor, to: 1, kind: mechanism, source: "code"}'


def test_each_rung_closes_its_share_of_the_log_gap(tmp_path):
    lad = load_ladders("fastermoe", _yaml(tmp_path, [RUNG, RUNG2]))[KEY]
    df = walk("fastermoe", lad, "smoke")
    assert df.headline.tolist() == pytest.approx([4 * 17.87, 2 * 17.87, 17.87])
    assert df.closes.tolist()[1:] == pytest.approx([0.5, 0.5]) and math.isnan(df.closes.iloc[0])
    assert df.closed.iloc[-1] == pytest.approx(1.0) and df.ratio.iloc[-1] == pytest.approx(1.0)
    assert df.moelab_value.tolist()[1:] == [62.0, 2.0] and df.attrs["label"].startswith("SIMULATED: toy")


def test_rungs_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(LadderError, match="not in assumptions.yaml"):
        load_ladders("fastermoe", _yaml(tmp_path, ['{set: no_such, to: 1, kind: setting, source: s}']))
    with pytest.raises(AssumptionError, match="outside its range"):
        load_ladders("fastermoe", _yaml(tmp_path, ['{set: trevor_nic_Gbps, to: 400, kind: setting, source: s}']))
    with pytest.raises(LadderError, match="lacks"):
        load_ladders("fastermoe", _yaml(tmp_path, ['{set: trevor_nic_Gbps, to: 100, kind: setting}']))
    with pytest.raises(LadderError, match="kind must be"):
        load_ladders("fastermoe", _yaml(tmp_path, ['{set: trevor_nic_Gbps, to: 100, kind: guess, source: s}']))
    with pytest.raises(LadderError, match="no such paper number"):
        load_ladders("fastermoe", _yaml(tmp_path, [RUNG], key="no_such_number"))
    with pytest.raises(LadderError, match="chosen_from names no paper number"):
        load_ladders("fastermoe", _yaml(tmp_path, [RUNG[:-1] + ", chosen_from: [nope]}"]))
    lad = load_ladders("fastermoe", _yaml(tmp_path, [RUNG[:-1] + f", chosen_from: [{KEY}]}}"]))[KEY]
    assert lad.rungs[0].chosen_from == (KEY,)


def test_the_fastermoe_ladders_start_from_the_compared_value():
    """Rung 0 is moelab's setting: the very number the paper-vs-moelab row compares."""
    from moelab.papers.fastermoe.end_to_end import fig10_end_to_end

    lad = load_ladders("fastermoe")[KEY]
    df = walk("fastermoe", lad, "smoke")
    f = fig10_end_to_end("smoke", 0, (), ("trevor", "johnny"))
    row = f[(f.system == "FasterMoE") & (f.cluster == "trevor")].speedup_vs_zero3.max()
    assert df.headline.iloc[0] == pytest.approx(row, rel=1e-12)
    assert df.closes.iloc[1:].sum() == pytest.approx(df.closed.iloc[-1])
