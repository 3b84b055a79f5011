"""Lina's gap ladders (``experiments/lina/ladders.yaml``, walked by :mod:`moelab.papers.kit.ladder`): the
SIMULATED training headlines, each exactly as its paper-vs-moelab row reads it (``fig14s``, the ``lina_full``
policy over ``ddp_overlap``), as functions of the assumptions.

Each function is ``fn(scale, overrides) -> float`` with ``overrides`` ``((assumption, value), ...)``: they are in
force (:func:`moelab.papers.lina.common.overriding`) while the whole chain runs again - the calibration to Table 1,
gamma's fit to Fig. 4 and the training table - so a rung on a model shape refits what depends on it. With none
each returns the row's moelab value. The paper's numbers are references only: nothing here is tuned toward them.
"""
from __future__ import annotations

from . import paper_scale
from .common import overriding


def _training(scale, overrides: tuple):
    with overriding(overrides):
        return paper_scale.training(getattr(scale, "name", scale))


def _lina_full(scale, overrides: tuple, column: str, experts=None) -> float:
    df = _training(scale, overrides)
    df = df[df.policy == "lina_full"]
    if experts is not None:
        df = df[df.experts == experts]
    return float(df[column].mean())


def step_mean(scale, overrides: tuple = ()) -> float:
    """``step_mean``: lina_full's step speedup, mean over the scale's models and E (Fig. 10's headline)."""
    return _lina_full(scale, overrides, "step_speedup")


def bwd_a2a_E4(scale, overrides: tuple = ()) -> float:
    """``bwd_a2a_E4``: lina_full's backward all-to-all speedup at E = 4, mean over the scale's models (Fig. 13)."""
    return _lina_full(scale, overrides, "bwd_a2a_speedup", experts=4)
