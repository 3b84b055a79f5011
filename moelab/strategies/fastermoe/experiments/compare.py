"""FasterMoE reproduction: compare."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd


# ==== paper vs moelab ===================================================================================================
def paper_numbers(path=None) -> pd.DataFrame:
    """The paper's own numbers (``experiments/fastermoe/paper.yaml``): key, value, what, figure, source."""
    import yaml

    from moelab.reproduce import project_path

    p = project_path(path or "experiments/fastermoe/paper.yaml")
    data = yaml.safe_load(p.read_text())
    rows = [dict(key=k, **v) for k, v in data["numbers"].items()]
    df = pd.DataFrame(rows)
    df.attrs["label"] = f"PAPER: FasterMoE numbers from {p.name} (spec sections in 'source')"
    return df


def _get(results, key):
    v = results.get(key)
    return v if isinstance(v, pd.DataFrame) and len(v) else None


def _lab(frame, default=""):
    return (frame.attrs.get("label") if frame is not None else None) or default


def _extract(results: dict) -> dict:
    """paper key -> list of (moelab value, label of that value)."""
    out: dict = {}

    def put(key, value, label):
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            out.setdefault(key, []).append((float(value), label))

    f10 = _get(results, "fig10")
    if f10 is not None:
        fm = f10[f10.system == "FasterMoE"]
        j, t = fm[fm.cluster == "johnny"], fm[fm.cluster == "trevor"]
        lab = "SIMULATED: johnny, ZeRO analytic (spec §3)"
        if len(j):
            put("zero3_speedup_johnny", j.speedup_vs_zero3.max(), lab + f", best of {', '.join(j.model)}")
        if len(t):
            put("zero3_speedup_trevor", t.speedup_vs_zero3.max(), "SIMULATED: trevor, BERT-Wide [R sizes], ZeRO analytic")
        put("zero2_speedup_max", fm.speedup_vs_zero2.max(), "SIMULATED: johnny + trevor, ZeRO analytic")
    f10r = _get(results, "fig10_real")
    if f10r is not None and "speedup_vs_zero3" in f10r:
        t = f10r.set_index("system")
        if "FasterMoE" in t.index:
            put("zero3_speedup_johnny", t.loc["FasterMoE", "speedup_vs_zero3"], _lab(f10r, "EMULATED"))
            if "ZeRO-2" in t.index:
                put("zero2_speedup_max", t.loc["ZeRO-2", "step_ms"] / t.loc["FasterMoE", "step_ms"], _lab(f10r, "EMULATED"))
    f9 = _get(results, "fig9_metrics")
    if f9 is not None:
        # johnny (dedicated network) <-> emulated links; trevor (shared network, noisy) <-> plain loopback gloo
        for key, mode in (("predictor_r2_johnny", "emulated"), ("predictor_r2_trevor", "plain")):
            r = f9[(f9["mode"] == mode) & (f9.split == "evaluation") & (f9.part == "e2e")]
            if len(r):
                put(key, r.r2.iloc[0], r.label.iloc[0] + " (held-out half)")
    f11 = _get(results, "fig11_summary")
    if f11 is not None:
        put("shadow_fraction_mean", f11.mean_fraction_shadowed.iloc[0], "SIMULATED: johnny, MoE-BERT-Deep layer 12, T2")
        put("shadow_speedup_one_expert_max", f11.max_speedup_one_shadow.iloc[0],
            "SIMULATED: johnny, MoE-BERT-Deep layer 12, T2")
    f11r = _get(results, "fig11_real_summary")
    if f11r is not None:
        put("shadow_fraction_mean", f11r.mean_fraction_shadowed.iloc[0], _lab(f11r, "EMULATED"))
    f12 = _get(results, "fig12")
    if f12 is not None:
        lab = "SIMULATED: johnny, per layer of GPT-S/L, BERT-Deep/-L, T2"
        put("smart_achieved_max", f12.achieved_simulator.max(), lab + " (moelab.sim)")
        put("smart_theoretical_max", f12.theoretical.max(), lab + " (perf model)")
    f12r = _get(results, "fig12_real")
    if f12r is not None:
        put("smart_achieved_max", f12r.achieved.max(), _lab(f12r, "EMULATED"))
        if "measured_fraction_of_theory" in f12r:  # measured / theory, the paper's quantity (not model / theory)
            put("smart_fraction_of_theory_max", f12r.measured_fraction_of_theory.max(), _lab(f12r, "EMULATED"))
    f13 = _get(results, "fig13")
    if f13 is not None:
        j, t = f13[f13.cluster == "johnny"], f13[f13.cluster == "trevor"]
        for v in ("shadow", "both"):
            if len(j):
                put(f"breakdown_{v}_johnny", j[j.variant == v].speedup.max(), "SIMULATED: johnny, best of 4 models, T2")
            if len(t):
                put(f"breakdown_{v}_trevor", t[t.variant == v].speedup.max(), "SIMULATED: trevor, BERT-Wide [R], T2")
        put("breakdown_smart", f13[f13.variant == "smart"].speedup.max(), "SIMULATED: johnny + trevor, best model, T2")
    f13r = _get(results, "fig13_real")
    if f13r is not None:
        for v, key in (("shadow", "breakdown_shadow_johnny"), ("smart", "breakdown_smart"),
                       ("both", "breakdown_both_johnny")):
            r = f13r[f13r.variant == v]
            if len(r):
                put(key, r.speedup.iloc[0], _lab(f13r, "EMULATED"))
    f4 = _get(results, "fig4_summary")
    if f4 is not None:
        for _, r in f4[~f4.trace.str.startswith("PAPER")].iterrows():
            lab = ("SUBSTITUTE: " + r.trace) if r.trace.startswith("T2") else (
                "REAL (SUBSTITUTE for the paper's models): " + r.trace)
            put("popularity_top4_share", r.mean_top4_share, lab)
            put("popularity_max_over_mean", r.mean_top4_share * r.experts, lab + " (top-4 mean share x E)")
    t3 = _get(results, "table3")
    if t3 is not None:
        lab0 = "SUBSTITUTE: tiny REAL MoE-GPT runs; time SIMULATED on johnny from their routing"
        targets = list(dict.fromkeys(t3.target)) if "target" in t3 else [None]

        def val(col, a, b=None, op="ratio"):
            """The first target (80 %, then 40 %) where the value exists: (value, label suffix)."""
            for tg in targets:
                t = (t3[t3.target == tg] if tg is not None else t3).set_index("system")
                if a not in t.index or (b is not None and b not in t.index):
                    return None, ""
                x = t.loc[a, col] if b is None else (t.loc[a, col] / t.loc[b, col] if op == "ratio" else None)
                if x is not None and np.isfinite(x):
                    return float(x), f" (target: {tg})" if tg else ""
            return None, ""

        v, tag = val("iter_speedup_vs_fastmoe", "FasterMoE")
        put("fastermoe_iter_speedup_no_topo", v, lab0)
        v, _ = val("mean_modelled_iter_ms", "FasterMoE", "FasterMoE + topo gate")
        put("topo_gate_iter_gain", None if v is None else v - 1, lab0)
        v, tag = val("steps_to_target", "FasterMoE + topo gate", "FasterMoE")
        put("topo_gate_extra_steps", None if v is None else v - 1, lab0 + " (loss: REAL)" + tag)
        v, tag = val("steps_to_target", "GShard", "FastMoE (top-2)")
        put("gshard_steps_ratio", v, lab0 + " (loss: REAL)" + tag)
        v, tag = val("modelled_time_to_target_s", "GShard", "FasterMoE")
        put("time_to_loss_vs_gshard", v, lab0 + tag)
        v, tag = val("modelled_time_to_target_s", "BASE", "FasterMoE")
        put("time_to_loss_vs_base", v, lab0 + tag)
    return out


def paper_vs_moelab(results: dict, paper: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The "paper vs moelab" table: one row per (paper number, moelab number): the paper's value, what it
    is and where it comes from, the moelab value, its label (SIMULATED: johnny / EMULATED: 8 ranks ...),
    and moelab / paper. ``results``: frames keyed ``fig4_summary, fig9_metrics, fig10, fig10_real, fig11_summary,
    fig11_real_summary, fig12, fig12_real, fig13, fig13_real, table3`` (missing ones give rows marked
    'not run')."""
    paper = paper_numbers() if paper is None else paper
    ex = _extract(results)
    rows = []
    for _, p in paper.iterrows():
        got = ex.get(p.key) or [(float("nan"), "not run / not available (see notebook)")]
        for v, lab in got:
            rows.append(dict(key=p.key, figure=p.figure, what=p.what, paper=float(p.value), moelab=v,
                             moelab_label=lab, ratio=v / float(p.value) if p.value else float("nan"),
                             paper_source=p.source))
    df = pd.DataFrame(rows)
    df.attrs["label"] = "PAPER vs moelab: paper numbers from experiments/fastermoe/paper.yaml; each moelab number labelled"
    return df


