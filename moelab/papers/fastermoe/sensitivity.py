"""FasterMoE reproduction: how far each assumption moves Fig. 10's speedup over ZeRO-3.

The paper-scale Fig. 10 rests on guesses (ZeRO's overlap, trevor's P, BERT-Wide's sizes, ...). Here each
assumption that affects ``fig10`` and has a ``range`` in ``experiments/fastermoe/assumptions.yaml`` is
set to its low and high end, everything else at its base value, and FasterMoE's speedup over ZeRO-3 is
recomputed. The paper's number is a reference column only: nothing here is tuned toward it.
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from moelab.papers.kit.compare import paper_value

from .common import MODEL_CLUSTERS, assumptions, scale_spec
from .end_to_end import fig10_end_to_end

CLUSTERS = ("trevor", "johnny")


def clusters_of(name: str) -> tuple:
    """The paper clusters whose Fig. 10 numbers an assumption can move (by its name)."""
    for cl in CLUSTERS:
        if name.startswith(cl + "_"):
            return (cl,)
    if name.startswith("model."):
        return (MODEL_CLUSTERS[name.split(".")[1]],)
    return CLUSTERS


def fig10_speedups(scale, seed: int = 0, overrides: tuple = (), clusters: tuple = CLUSTERS) -> dict:
    """cluster -> (model, FasterMoE time / ZeRO-3 time speedup): trevor's one model (BERT-Wide), johnny's
    best of four (as the paper quotes it)."""
    df = fig10_end_to_end(scale, seed, overrides, tuple(clusters))
    f = df[df.system == "FasterMoE"]
    out = {}
    for cl, g in f.groupby("cluster"):
        r = g.loc[g.speedup_vs_zero3.idxmax()]
        out[cl] = (r.model, float(r.speedup_vs_zero3))
    return out


def _paper_speedup(cluster: str) -> float:
    """The paper's FasterMoE-over-ZeRO-3 number (``experiments/fastermoe/paper.yaml``), a reference only."""
    return paper_value("fastermoe", f"zero3_speedup_{cluster}")


SENSITIVITY_LAYERS = 2  # layers per model the sweep simulates: base and ends alike (each layer a different T2 draw)


def sweep_spec(scale):
    """The scale's spec at the sweep's fidelity: at most :data:`SENSITIVITY_LAYERS` layers per model and
    the last trace iteration only (80500: 93 % of the AE's time weight). Each assumption costs two
    full Fig. 10 simulations, so the sweep trades fidelity for time; its base is recomputed alike."""
    sp = scale_spec(scale)
    return dataclasses.replace(sp, paper_layers=min(sp.paper_layers or SENSITIVITY_LAYERS, SENSITIVITY_LAYERS),
                               trace_iters=(sp.trace_iters[-1],))


def fig10_sensitivity(scale, seed: int = 0) -> pd.DataFrame:
    """One row per (assumption with a range affecting fig10, cluster it can move): the assumption at low /
    base / high,
    FasterMoE's SIMULATED speedup over ZeRO-3 at each, the changes from base and the swing (high - low
    of the three); ``paper_speedup`` is the paper's number as a reference column."""
    sp = scale = sweep_spec(scale)
    A = assumptions()
    base = fig10_speedups(scale, seed)
    rows = []
    for a in A.values():
        if "fig10" not in a.affects or a.range is None:
            continue
        moved = clusters_of(a.name)
        at = {"base": base}
        for end, v in zip(("low", "high"), a.range):
            at[end] = base if v == a.value else {**base, **fig10_speedups(scale, seed, ((a.name, v),), moved)}
        for cl in moved:  # the other cluster's number cannot move (same simulation): no row for it
            s = {k: at[k][cl][1] for k in ("low", "base", "high")}
            rows.append(dict(assumption=a.name, kind=a.kind, unit=a.unit, cluster=cl, model=base[cl][0],
                             value_low=a.range[0], value_base=a.value, value_high=a.range[1],
                             speedup_low=s["low"], speedup_base=s["base"], speedup_high=s["high"],
                             change_low=s["low"] - s["base"], change_high=s["high"] - s["base"],
                             swing=max(s.values()) - min(s.values()), best_model_low=at["low"][cl][0],
                             best_model_high=at["high"][cl][0], paper_speedup=_paper_speedup(cl),
                             source=a.source))
    df = pd.DataFrame(rows)
    df = df.sort_values(["cluster", "swing"], ascending=[False, False], kind="stable").reset_index(drop=True)
    layers = f"{sp.paper_layers} layers per model, trace iteration {sp.trace_iters[0]}"
    df.attrs["label"] = (f"SIMULATED: fastermoe_trevor / fastermoe_johnny profiles, SUBSTITUTE T2 traces, scale "
                         f"{sp.name} ({layers}); one assumption at a time set to the ends of its range in "
                         "experiments/fastermoe/assumptions.yaml, all others at base; johnny: best of 4 models; "
                         "paper_speedup (paper.yaml) is a reference only, nothing is tuned toward it")
    df.attrs["assumptions"] = list(dict.fromkeys(df.assumption))
    return df


# ---- gap ladders (experiments/fastermoe/ladders.yaml): the headlines at the row's own fidelity ----------------
def trevor_headline(scale, overrides: tuple = ()) -> float:
    """FasterMoE over ZeRO-3 on trevor (BERT-Wide), as paper.yaml's ``zero3_speedup_trevor`` row reads it."""
    return fig10_speedups(scale, 0, overrides, ("trevor",))["trevor"][1]


def johnny_headline(scale, overrides: tuple = ()) -> float:
    """FasterMoE over ZeRO-3 on johnny, the best of its four models (``zero3_speedup_johnny``)."""
    return fig10_speedups(scale, 0, overrides, ("johnny",))["johnny"][1]


def zero2_headline(scale, overrides: tuple = ()) -> float:
    """FasterMoE over ZeRO-2, the largest over both clusters' models (``zero2_speedup_max``)."""
    df = fig10_end_to_end(scale, 0, overrides, CLUSTERS)
    return float(df[df.system == "FasterMoE"].speedup_vs_zero2.max())
