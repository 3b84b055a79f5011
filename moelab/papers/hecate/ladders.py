"""Hecate's gap ladders (``experiments/hecate/ladders.yaml``, walked by :mod:`moelab.papers.kit.ladder`): the
headline end-to-end speedups of Figs. 9 and 10, each exactly as its paper-vs-moelab row reads it, as functions of
the assumptions of ``experiments/hecate/assumptions.yaml``.

Each function is ``fn(scale, overrides) -> float`` with ``overrides`` ``((assumption, value), ...)``; with none it
returns the row's moelab value (the same :func:`.end_to_end.end_to_end` frames the fig9 / fig10 products read, t
from the paper's rule at the overridden setting). The paper's numbers are references only: nothing here is tuned
toward them.
"""
from __future__ import annotations

from . import end_to_end as EE
from .motivation import m1, m2
from .products import _summaries

HEADLINE_SYSTEMS = tuple(s for s in EE.SYSTEMS if s != EE.T_CHOSEN)  # the rows never read the chosen-t variant


def _name(scale):
    return getattr(scale, "name", scale)  # the session hands a ScaleSpec; end_to_end caches by name


def _frame(scale, cluster: str, gpus: int, overrides: tuple, systems: tuple = ("EP", "Hecate")):
    return EE.end_to_end(_name(scale), cluster, gpus, systems=systems, overrides=tuple(overrides))


def _vs_ep(scale, cluster, gpus, overrides):
    df = _frame(scale, cluster, gpus, overrides)
    return df[df.system == "Hecate"].speedup_vs_ep


def a16_vs_ep_min(scale, overrides: tuple = ()) -> float:
    """``a16_vs_ep_min``: the smallest of the 4 models' Hecate-over-EP speedups, cluster A, 16 GPUs."""
    return float(_vs_ep(scale, "hecate_A", 16, overrides).min())


def a16_vs_ep_max(scale, overrides: tuple = ()) -> float:
    """``a16_vs_ep_max``: the largest of them."""
    return float(_vs_ep(scale, "hecate_A", 16, overrides).max())


def b_vs_ep_min(scale, overrides: tuple = ()) -> float:
    """``b_vs_ep_min``: the smallest of the 4 models' Hecate-over-EP speedups, cluster B, 32 GPUs."""
    return float(_vs_ep(scale, "hecate_B", 32, overrides).min())


def b_vs_ep_max(scale, overrides: tuple = ()) -> float:
    """``b_vs_ep_max``: the largest of them."""
    return float(_vs_ep(scale, "hecate_B", 32, overrides).max())


def speedup_up_to(scale, overrides: tuple = ()) -> float:
    """``speedup_up_to``: Hecate over the slowest baseline, largest over models, both clusters (the larger of the
    fig9 and fig10 rows, as paper.yaml reads the paper's "up to")."""
    import pandas as pd

    frames = [_frame(scale, c, g, overrides, HEADLINE_SYSTEMS) for c, g in (("hecate_A", 16), ("hecate_A", 32))]
    a = _summaries(pd.concat(frames, ignore_index=True))
    b = _summaries(_frame(scale, "hecate_B", 32, overrides, HEADLINE_SYSTEMS))
    return float(max(a[a.system == "Hecate"].speedup_vs_worst.max(), b[b.system == "Hecate"].speedup_vs_worst.max()))


def t_table(scale, overrides: tuple = ()):
    """Per (cluster, GPUs, model) the paper's t at the setting with its terms (T_nonMoE, bw, s_e)."""
    import pandas as pd

    rows = []
    for c, g in (("hecate_A", 16), ("hecate_A", 32), ("hecate_B", 32)):
        df = _frame(scale, c, g, overrides)
        rows.append(df[df.system == "Hecate"][["cluster", "gpus", "model", "t_formula", "T_nonMoE_ms", "bw_GBps",
                                               "s_e_MB"]])
    return pd.concat(rows, ignore_index=True)


def m2_flexmoe_speedup(scale, overrides: tuple = ()) -> float:
    """``m2_flexmoe_speedup``: FlexMoE over EP with 4x EP's expert memory (r = 6), GPT-MoE-S, cluster A."""
    return float(m2(_name(scale), rs=(6,), overrides=tuple(overrides)).speedup.iloc[0])


def m1_imbalance_slowdown(scale, overrides: tuple = ()) -> float:
    """``m1_imbalance_slowdown``: EP's iteration time under the trace's loads over the same tokens spread evenly,
    the largest over the 4 models, cluster A, 16 GPUs."""
    return float(m1(_name(scale), overrides=tuple(overrides)).slowdown.max())
