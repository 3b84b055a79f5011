"""Comparison statuses that tell the truth: a value fitted to, reasoned from or computed with the paper number it
is compared with is named so (fit / chosen from / input), never counted as agreement; every row gets a verdict."""
from __future__ import annotations

import math

import pytest

from moelab.papers.kit.assumptions import AssumptionError, parse_assumptions
from moelab.papers.kit.compare import compare_one, verdict
from moelab.papers.kit.registry import products
from tests.papers.kit.test_kit import TOY, _emu, _numbers, _sim

ENTRY = _numbers()["n"]


def _row(src, circ=None):
    reg = products(TOY, "tests.papers.kit.test_kit")
    values = {"sim": _sim(None).value, "emu": _emu(None).value}
    return compare_one("n", ENTRY, src, values, reg, circ)


SIM = dict(product="sim", column="speedup", reduce="max")


def test_a_fitted_value_is_a_fit_not_a_ratio_and_not_evidence():
    r = _row(SIM, {"n": [("fit", "eta", ("sim",))]})
    assert r["status"] == "fit" and "eta was fitted to" in r["note"] and r["ratio"] == pytest.approx(3.0 / 2.5)
    assert verdict(r, ENTRY) == "not evidence"
    # a fit of another product does not touch this row
    r = _row(SIM, {"n": [("fit", "eta", ("other_product",))]})
    assert r["status"] == "ratio" and verdict(r, ENTRY) == "agrees"


def test_a_guess_chosen_from_the_number_and_a_paper_input_are_named():
    assert _row(SIM, {"n": [("chosen from", "t_paper", ())]})["status"] == "chosen from"
    r = _row({**SIM, "inputs": ["rate"]})
    assert r["status"] == "input" and "rate" in r["note"] and verdict(r, ENTRY) == "not evidence"


def test_verdicts():
    r = _row(SIM)  # 3.0 vs 2.5: ratio 1.2, within 25 %
    assert verdict(r, ENTRY) == "agrees"
    far = dict(r, ratio=2.0)
    assert verdict(far, ENTRY) == "off, no stated cause"
    assert verdict(far, ENTRY, closed=0.8) == "explained"
    assert verdict(far, ENTRY, closed=0.5) == "off, no stated cause"
    assert verdict(far, ENTRY, closed=2.6) == "off, no stated cause"  # overshoots far past the paper
    assert verdict(far, ENTRY, closed=1.2) == "explained"
    # a small gap: closing 69 % of it leaves 1.46 ** 0.31 = 1.12, where a direct row would agree
    near = dict(r, moelab=1.46 * r["paper"], ratio=1.46)
    assert verdict(near, ENTRY, closed=0.69) == "explained"
    assert verdict(near, ENTRY, closed=0.3) == "off, no stated cause"  # ends at 1.30: still off
    assert verdict(near, {**ENTRY, "neutral": 1.0}, closed=3.0) == "off, no stated cause"  # ends below 1/1.25
    assert verdict(far, {**ENTRY, "contradicted": "the mechanism X shows ..."}) == "contradicted"
    # within 25 % but on the other side of "no effect": moelab finds a slowdown where the paper claims a gain
    slower = dict(r, moelab=0.9, paper=1.1, ratio=0.9 / 1.1)
    assert verdict(slower, {**ENTRY, "neutral": 1.0}) == "off, no stated cause"
    assert verdict(slower, {**ENTRY, "neutral": 1.0, "contradicted": "SAA pays 8 phases"}) == "contradicted"
    t = _row(dict(product="emu", column="speedup"))
    assert t["status"] == "trend check" and verdict(t, ENTRY) == "trend: other side"
    # a SIMULATED value of a coarser quantity, flagged by its source: a trend check that says why
    t = _row({**SIM, "trend": "one value per model, the paper's is one task"})
    assert t["status"] == "trend check" and "one task" in t["note"] and t["ratio"] != t["ratio"]
    assert verdict(dict(r, status="no value", ratio=math.nan), ENTRY) == "no value"


def test_fitted_to_is_checked_in_the_assumptions_file():
    ok = {"assumptions": {"eta": dict(value=0.4, kind="fitted", source="fit", fitted_to=["a", "b"], affects=["f"])}}
    assert parse_assumptions(ok)["eta"].fitted_to == ("a", "b")
    with pytest.raises(AssumptionError, match="fitted_to is for kind 'fitted'"):
        parse_assumptions({"assumptions": {"t": dict(value=8, kind="assumption", source="s", fitted_to=["a"])}})
    with pytest.raises(AssumptionError, match="must list paper.yaml keys"):
        parse_assumptions({"assumptions": {"t": dict(value=8, kind="assumption", source="s", chosen_from=[3])}})


def test_a_ladder_explains_only_the_row_it_starts_from():
    from moelab.papers.kit.compare import _ladder_share

    row = _row(SIM)  # moelab 3.0
    assert _ladder_share(row, (3.0, 0.8)) == (0.8, ())
    assert _ladder_share(row, (2.0, 0.8)) == (None, ())  # the ladder walks another source's value
    assert _ladder_share(row, None) == (None, ())
    assert _ladder_share(row, (3.0, 0.8, ("fig11",))) == (0.8, ("fig11",))


def test_a_ladder_with_a_rung_read_off_a_paper_result_explains_nothing():
    from moelab.papers.kit.compare import compare
    from tests.papers.kit.test_kit import TOY

    reg = products(TOY, "tests.papers.kit.test_kit")
    values = {"sim": _sim(None).value, "emu": _emu(None).value}
    far = {"n": {**ENTRY, "value": 1.0, "moelab": [SIM]}}  # moelab 3.0 against 1.0: off
    ok = compare("toy", values, reg, far, closed={"n": (3.0, 0.9, ())})
    assert ok.verdict.iloc[0] == "explained"
    fit = compare("toy", values, reg, far, closed={"n": (3.0, 0.9, ("fig11",))})
    assert fit.verdict.iloc[0] == "off, no stated cause" and "read off fig11" in fit.why.iloc[0]
