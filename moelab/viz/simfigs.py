"""Plotly builders for the simulator: calibration fits, predicted vs measured, one simulated
iteration as a Gantt chart, and the critical-path breakdown.

Every builder takes a required keyword ``label`` saying what the numbers are; it must start with
REAL, EMULATED, SIMULATED, SUBSTITUTE or PAPER (checked by :func:`moelab.viz.figures.check_label`)
and is shown under the title, e.g. ``"SIMULATED: fastermoe_trevor"`` or
``"REAL: 4 ranks gloo vs SIMULATED: local"``.
"""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from moelab.measure.validate import median_rel_err, r2_score
from moelab.viz.figures import check_label, finish

# one colour per simulator op category, stable across figures
CATEGORY_COLOURS = {
    "attention": "#4c78a8", "ffn": "#72b7b2", "expert": "#54a24b", "gate": "#b3de69", "head": "#9d755d",
    "a2a": "#e45756", "count_exchange": "#ff9da6", "allreduce": "#f58518", "allgather": "#eeca3b",
    "reduce_scatter": "#bab0ac", "p2p": "#b279a2", "comm": "#d62728", "other": "#c7c7c7", "idle": "#eeeeee",
}


def _colour(cat: str, i: int = 0) -> str:
    return CATEGORY_COLOURS.get(cat, qualitative.Dark24[i % len(qualitative.Dark24)])


# ---- calibration ----------------------------------------------------------------------------------
def alpha_beta_fits(calibration, *, label: str, log: bool = True, title: str = "Collective cost: alpha-beta fits",
                    ops=None) -> go.Figure:
    """Measured collective times and their fitted lines ``t = alpha + beta * x`` (as Parm Fig. 6).

    ``calibration``: a :func:`moelab.measure.calibrate.calibrate_local` result (``raw.collectives``
    rows with ``op``, ``sent_bytes``, ``time_s``; ``collectives[op]`` with ``alpha``, ``beta``,
    ``r2``), or a pair ``(frame, {op: AlphaBeta | dict})``. x is the most non-local bytes a rank
    sends in the call (the shared byte rule), so beta is seconds per byte on the link.
    """
    import pandas as pd

    label = check_label(label)
    if isinstance(calibration, tuple):
        df, fits = calibration
    else:
        df, fits = pd.DataFrame(calibration["raw"]["collectives"]), calibration["collectives"]
    fig = go.Figure()
    for i, (op, g) in enumerate(df.groupby("op", sort=False)):
        if ops is not None and op not in ops:
            continue
        colour = qualitative.Plotly[i % len(qualitative.Plotly)]
        fig.add_scatter(x=g["sent_bytes"], y=g["time_s"] * 1e3, mode="markers", name=f"{op} (measured)",
                        marker={"color": colour, "size": 8}, legendgroup=op)
        fit = fits.get(op)
        if fit is None:
            continue
        if isinstance(fit, Mapping):
            a, b, r2 = fit["alpha"], fit["beta"], fit.get("r2")
        else:
            a, b, r2 = fit.alpha, fit.beta, fit.r2
        xs = np.geomspace(max(float(g["sent_bytes"].min()), 1.0), float(g["sent_bytes"].max()), 50)
        bw = f"{1 / b / 1e9:.2f} GB/s" if b > 0 else "inf"
        fig.add_scatter(x=xs, y=(a + b * xs) * 1e3, mode="lines", line={"color": colour}, legendgroup=op,
                        name=f"{op} fit: {a * 1e6:.0f} us + x / {bw}" + (f" (R^2 {r2:.3f})" if r2 is not None else ""))
    kind = "log" if log else "linear"
    return finish(fig, title, label, xaxis={"title": "bytes sent per rank (non-local)", "type": kind},
                  yaxis={"title": "time (ms)", "type": kind})


# ---- validation -------------------------------------------------------------------------------------
def predicted_vs_measured(frame, *, label: str, measured: str = "real_s", predicted: str = "sim_s",
                          color: Optional[str] = "config", title: str = "Simulated vs measured step time",
                          unit: float = 1e3, unit_name: str = "ms") -> go.Figure:
    """Scatter of predicted against measured, the y = x line, and R^2 of the prediction in the title.

    ``frame``: e.g. :attr:`moelab.measure.validate.Comparison.iters` (rows with ``warmup`` True are
    dropped) or ``.layers``. R^2 is around y = x (:func:`moelab.measure.validate.r2_score`). When the
    frame splits each side into compute and communication (``real_compute_s``/``sim_compute_s``,
    ``real_comm_s``/``sim_comm_s``, as ``Comparison`` frames do), the title gives R^2 of each part
    alone too: a good total can hide two compensating errors.
    """

    label = check_label(label)
    df = frame[~frame["warmup"]] if "warmup" in frame else frame
    if df.empty:
        raise ValueError("no points to plot")
    y, p = df[measured].to_numpy(float), df[predicted].to_numpy(float)
    r2, mre = r2_score(y, p), median_rel_err(y, p)
    fig = go.Figure()
    groups = df.groupby(color, sort=False) if color and color in df else [(None, df)]
    for i, (name, g) in enumerate(groups):
        fig.add_scatter(x=g[measured] * unit, y=g[predicted] * unit, mode="markers", name=str(name),
                        marker={"size": 8, "color": qualitative.Dark24[i % 24]},
                        hovertext=[f"{name} iter {it}" for it in g["iter"]] if "iter" in g else None)
    hi = float(max(y.max(), p.max())) * unit * 1.05
    fig.add_scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x", line={"color": "black", "dash": "dash"})
    split = ""
    if measured == "real_s" and predicted == "sim_s" and {"real_compute_s", "real_comm_s"} <= set(df.columns):
        split = "<br>" + "; ".join(
            f"{part} only: R^2 = {r2_score(df[f'real_{key}_s'], df[f'sim_{key}_s']):.3f}, median |error| = "
            f"{100 * median_rel_err(df[f'real_{key}_s'], df[f'sim_{key}_s']):.1f}%"
            for part, key in (("compute", "compute"), ("communication", "comm")))
    return finish(fig, f"{title}: R^2 = {r2:.3f}, median |error| = {100 * mre:.1f}% ({len(df)} points){split}", label,
                  xaxis={"title": f"measured ({unit_name})", "range": [0, hi]},
                  yaxis={"title": f"simulated ({unit_name})", "range": [0, hi], "scaleanchor": "x"})


# ---- one simulated iteration ------------------------------------------------------------------------
def sim_gantt(result, *, label: str, ranks=None, max_ranks: int = 16, title: str = "One simulated iteration",
              unit: float = 1e3, unit_name: str = "ms") -> go.Figure:
    """Per-rank Gantt chart of a :class:`moelab.sim.engine.SimResult`: one row per (rank, stream),
    bars coloured by op category. ``ranks`` picks rows (default: the first ``max_ranks`` ranks; at
    paper scale every rank looks alike under EP, and 64 x 2 rows are unreadable)."""
    label = check_label(label)
    tl = result.timeline()
    all_ranks = sorted(tl["rank"].unique())
    ranks = list(ranks) if ranks is not None else all_ranks[:max_ranks]
    tl = tl[tl["rank"].isin(ranks)]
    tl = tl.assign(row=[f"rank {r} / {s}" for r, s in zip(tl["rank"], tl["stream"])])
    order = sorted(tl["row"].unique(), key=lambda s: (int(s.split()[1]), s.split("/ ")[1]))
    fig = go.Figure()
    for i, (cat, g) in enumerate(tl.groupby("category", sort=True)):
        fig.add_bar(y=g["row"], x=(g["end"] - g["start"]) * unit, base=g["start"] * unit, orientation="h",
                    name=cat, marker_color=_colour(cat, i), customdata=g["name"],
                    hovertemplate="%{customdata}<br>start %{base:.3f}<br>dur %{x:.3f}<extra>" + cat + "</extra>")
    shown = f" (ranks {ranks[0]}-{ranks[-1]} of {len(all_ranks)})" if len(ranks) < len(all_ranks) else ""
    return finish(fig, f"{title}: makespan {result.makespan * unit:.2f} {unit_name}{shown}", label,
                  barmode="overlay", xaxis_title=f"time ({unit_name})",
                  yaxis={"categoryorder": "array", "categoryarray": order[::-1]},
                  height=max(300, 22 * len(order) + 120))


def critical_path_breakdown(results, *, label: str, by: str = "category", title: str = "Critical-path breakdown",
                            unit: float = 1e3, unit_name: str = "ms") -> go.Figure:
    """Stacked bar of the critical path's time per category (sums to the makespan).

    ``results``: one :class:`SimResult`, a ``{name: SimResult}`` mapping (one bar each), or a
    ``{name: {category: seconds}}`` mapping of breakdowns already computed.
    """
    label = check_label(label)
    if hasattr(results, "breakdown"):
        results = {"iteration": results}
    bds = {k: (v.breakdown(by=by) if hasattr(v, "breakdown") else dict(v)) for k, v in results.items()}
    cats = []
    for bd in bds.values():
        cats += [c for c in bd if c not in cats]
    names = list(bds)
    fig = go.Figure()
    for i, c in enumerate(cats):
        fig.add_bar(x=names, y=[bds[n].get(c, 0.0) * unit for n in names], name=c, marker_color=_colour(c, i))
    totals = [sum(bds[n].values()) * unit for n in names]
    fig.add_scatter(x=names, y=totals, mode="text", text=[f"{t:.2f}" for t in totals], textposition="top center",
                    showlegend=False)
    return finish(fig, title, label, barmode="stack", yaxis_title=f"time on the critical path ({unit_name})")


def bytes_check_table(comparison, *, label: str, title: str = "Bytes: simulated vs measured") -> go.Figure:
    """A table figure of :meth:`moelab.measure.validate.Comparison.bytes_table` (per config, rank, link class)."""
    label = check_label(label)
    t = comparison.bytes_table()
    fig = go.Figure(go.Table(
        header={"values": ["config", "rank", "link", "measured bytes", "simulated bytes", "equal"]},
        cells={"values": [t["config"], t["rank"], t["link"], t["real"], t["sim"],
                          ["yes" if e else "NO" for e in t["equal"]]],
               "fill_color": [["#ffffff" if e else "#f8c4c4" for e in t["equal"]]] * 6}))
    ok = bool(t["equal"].all())
    return finish(fig, f"{title}: {'EXACT' if ok else 'MISMATCH'}", label, height=max(300, 24 * len(t) + 120))


__all__ = ["alpha_beta_fits", "predicted_vs_measured", "sim_gantt", "critical_path_breakdown", "bytes_check_table",
           "CATEGORY_COLOURS"]
