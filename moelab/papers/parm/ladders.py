"""Parm's gap ladders (``experiments/parm/ladders.yaml``, walked by :mod:`moelab.papers.kit.ladder`): the SIMULATED
headlines, each exactly as its paper-vs-moelab row reads it, as functions of the assumptions.

Each function is ``fn(scale, overrides) -> float`` with ``overrides`` ``((assumption, value), ...)``; with none it
returns the row's moelab value (the same code path as the ``vic`` and ``table5s`` products). The paper's numbers
are references only: nothing here is tuned toward them.
"""
from __future__ import annotations

from . import paper_scale


def _name(scale):
    return getattr(scale, "name", scale)  # the session hands a ScaleSpec; the paper-scale frames cache by name


def _vic(scale, overrides: tuple, metric: str, testbed: str | None = None):
    df = paper_scale.vic(_name(scale), tuple(overrides), check=False)
    df = df[df.metric == metric]
    return df if testbed is None else df[df.testbed == testbed]


def speedup_max_cell(scale, overrides: tuple = ()) -> float:
    """``speedup_max_cell``: the largest Table IV cell mean of Parm over the baseline, both testbeds."""
    return float(_vic(scale, overrides, "parm_cell_mean_max", "A+B").value.iloc[0])


def table5_about3x(scale, overrides: tuple = ()) -> float:
    """``table5_about3x``: the mean of Table V's four SIMULATED speedups (two models on two testbeds)."""
    return float(paper_scale.table5_sim(_name(scale), tuple(overrides)).speedup.mean())
