"""Plotly builders for the Lina figures. Each takes the required keyword ``label`` (REAL / EMULATED /
SIMULATED / SUBSTITUTE first)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from moelab.viz.figures import finish, labelled

PALETTE = qualitative.Plotly + qualitative.Pastel  # 21 distinct colours before any repeats


def _c(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


@labelled
def bars(frame, x: str, y: str, *, label: str, title: str, color: str = None, ytitle: str = None, line: float = None):
    """Grouped bars of ``y`` over ``x`` (one group per value of ``color``); ``line``: a reference level."""
    fig = go.Figure()
    groups = frame.groupby(color, sort=False) if color else [(None, frame)]
    for i, (name, g) in enumerate(groups):
        fig.add_bar(x=[str(v) for v in g[x]], y=g[y], name=str(name) if name is not None else y, marker_color=_c(i))
    if line is not None:
        fig.add_hline(y=line, line_dash="dot", line_color="grey")
    fig.update_layout(barmode="group", xaxis_title=x, yaxis_title=ytitle or y)
    return finish(fig, title, label, height=420)


@labelled
def cdf(values: dict, *, label: str, title: str, xtitle: str):
    """Empirical CDFs, one line per key."""
    fig = go.Figure()
    for i, (name, v) in enumerate(values.items()):
        v = np.sort(np.asarray(v, dtype=float))
        if len(v):
            fig.add_scatter(x=v, y=np.arange(1, len(v) + 1) / len(v), mode="lines", name=str(name),
                            line={"color": _c(i), "shape": "hv"})
    fig.update_layout(xaxis_title=xtitle, yaxis_title="fraction of operations")
    return finish(fig, title, label, height=420)


@labelled
def timeline(frame, *, label: str, title: str):
    """One row per (rank, lane); one bar per interval (columns rank, lane, name, start, end)."""
    fig = go.Figure()
    lanes = sorted({(r, ln) for r, ln in zip(frame["rank"], frame["lane"])})
    ypos = {k: i for i, k in enumerate(lanes)}
    for i, (name, g) in enumerate(frame.groupby("name", sort=False)):
        fig.add_bar(y=[f"rank {r} {ln}" for r, ln in zip(g["rank"], g["lane"])], x=1e3 * (g.end - g.start),
                    base=1e3 * g.start, orientation="h", name=str(name), marker_color=_c(i))
    fig.update_layout(barmode="overlay", xaxis_title="ms", height=max(300, 40 * len(ypos) + 150))
    return finish(fig, title, label)


@labelled
def lines(frame, x: str, y: str, *, label: str, title: str, color: str = None, ytitle: str = None):
    fig = go.Figure()
    groups = frame.groupby(color, sort=False) if color else [(None, frame)]
    for i, (name, g) in enumerate(groups):
        fig.add_scatter(x=g[x], y=g[y], mode="lines+markers", name=str(name) if name is not None else y,
                        line={"color": _c(i)})
    fig.update_layout(xaxis_title=x, yaxis_title=ytitle or y)
    return finish(fig, title, label, height=420)


@labelled
def routing_sankey(frame, *, label: str, title: str):
    """One MoE layer as a flow: each source rank's tokens through the gate to the experts (on their holders)
    and back to the rank in the combine; flows that leave a rank (the all-to-alls' bytes) coloured."""
    ranks = sorted(set(frame.src) | set(frame.holder))
    experts = sorted(set(frame.expert))
    holder = dict(zip(frame.expert, frame.holder))
    nodes = ([f"rank {r}: tokens" for r in ranks] + [f"expert {e} (rank {holder[e]})" for e in experts]
             + [f"rank {r}: output" for r in ranks])
    src_i = {r: i for i, r in enumerate(ranks)}
    exp_i = {e: len(ranks) + i for i, e in enumerate(experts)}
    out_i = {r: len(ranks) + len(experts) + i for i, r in enumerate(ranks)}
    f = frame[frame.tokens > 0]
    color = ["rgba(99,110,250,0.55)" if m else "rgba(160,160,160,0.35)" for m in f.moves]
    link = {"source": [src_i[r] for r in f.src] + [exp_i[e] for e in f.expert],
            "target": [exp_i[e] for e in f.expert] + [out_i[r] for r in f.src],
            "value": list(f.tokens) * 2, "color": color * 2}
    fig = go.Figure(go.Sankey(node={"label": nodes, "pad": 12}, link=link))
    fig.add_annotation(x=0.5, y=-0.1, xref="paper", yref="paper", showarrow=False,
                       text="left to middle: gate and dispatch all-to-all; middle to right: combine all-to-all; "
                            "blue: tokens that cross ranks")
    return finish(fig, title, label, height=460)
