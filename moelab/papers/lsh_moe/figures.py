"""Plotly builders for the LSH-MoE figures, over the frames of :mod:`moelab.papers.lsh_moe`.
Each takes the required keyword ``label`` (REAL / EMULATED / SIMULATED / SUBSTITUTE / PAPER first), checked
by :func:`moelab.viz.figures.labelled`, and returns through :func:`moelab.viz.figures.finish`."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moelab.viz.figures import finish, labelled

VARIANT_COLOURS = {"Origin": "#4c78a8", "LSH-MoE": "#e45756", "LSH-MoE w/o EC": "#54a24b"}


def _c(i: int) -> str:
    return qualitative.Plotly[i % len(qualitative.Plotly)]


@labelled
def pca_scatter(frame, *, label: str, title: str = "Fig. 4: PCA of the all-to-all input rows"):
    """One panel per source (trained / untrained / random), rows coloured by destination expert."""
    sources = list(dict.fromkeys(frame.source))
    rho = frame.attrs.get("rho", {})
    fig = make_subplots(rows=1, cols=len(sources),
                        subplot_titles=[f"{s} (rho {rho.get(s, float('nan')):.2f})" for s in sources])
    for c, s in enumerate(sources, 1):
        sub = frame[frame.source == s]
        for e in sorted(sub.expert.unique()):
            pts = sub[sub.expert == e]
            fig.add_trace(go.Scattergl(x=pts.pc1, y=pts.pc2, mode="markers", marker={"size": 4, "color": _c(int(e))},
                                       name=f"expert {e}", legendgroup=f"e{e}", showlegend=c == 1), 1, c)
        fig.update_xaxes(title_text="PC 1", row=1, col=c)
    fig.update_yaxes(title_text="PC 2", row=1, col=1)
    return finish(fig, title, label, height=420, width=360 * len(sources) + 120)


@labelled
def rate_vs_L(frame, *, label: str, title: str = "Fig. 7 (middle): compression rate vs number of hash functions",
              paper_rate: float | None = None):
    """rho vs L: one line per (source, family, r), coloured by the hash (one colour and legend group per CP rank
    r, one for spherical) and dashed by the source (trained tokens solid, each control its own dash);
    ``paper_rate``: the paper's rate at L=6 (paper.yaml ``rate_at_L6``, passed in by the product), drawn as a
    dashed grey line."""
    fig = go.Figure()
    keys = list(frame[["source", "family", "r"]].drop_duplicates().itertuples(index=False))
    cp = "cross_polytope"

    def hash_of(fam, r):
        return f"CP r={int(r)}" if fam == cp else fam

    hashes = sorted({(fam != cp, r if fam == cp else 0, hash_of(fam, r)) for _, fam, r in keys})  # CP by r, then others
    colour = {h: _c(i) for i, (_, _, h) in enumerate(hashes)}
    sources = list(dict.fromkeys(src for src, _, _ in keys))
    others = iter(("dot", "dash", "dashdot", "longdash", "longdashdot"))
    dash = {src: "solid" if src == "trained" else next(others, "dot") for src in sources}
    for src, fam, r in keys:
        sub = frame[(frame.source == src) & (frame.family == fam) & ((frame.r == r) | (frame.r.isna() & (r != r)))]
        h = hash_of(fam, r)
        fig.add_trace(go.Scatter(x=sub.L, y=sub.rho, mode="lines+markers", name=f"{src}, {h}", legendgroup=h,
                                 line={"dash": dash[src], "color": colour[h]}))
    if paper_rate is not None:
        fig.add_hline(y=paper_rate, line_dash="dash", line_color="grey",
                      annotation_text=f"paper: ~{paper_rate:.0%} at L=6")
    fig.update_xaxes(title_text="hash functions L")
    fig.update_yaxes(title_text="compression rate rho (kept fraction)", range=[0, 1.02])
    return finish(fig, title, label, height=480, width=900)


@labelled
def rate_vs_group(frame, *, label: str, title: str = "Compression rate vs group size"):
    x = [str(v) for v in frame.group_rows]
    fig = go.Figure(go.Scatter(x=x, y=frame.rho, mode="lines+markers", name="rho"))
    fig.update_xaxes(title_text="rows per (source rank, expert) group", type="category")
    fig.update_yaxes(title_text="rho", range=[0, 1.02])
    return finish(fig, title, label, height=380, width=700)


@labelled
def ec_error(frame, *, label: str, title: str = "Compression error with and without residual compensation"):
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=frame.L, y=frame.err_ec, mode="lines+markers", name="with EC: E(c) + x − c"))
    fig.add_trace(go.Scatter(x=frame.L, y=frame.err_noec, mode="lines+markers", name="without EC: E(c)"))
    fig.update_xaxes(title_text="hash functions L")
    fig.update_yaxes(title_text="‖E(x) − ŷ‖ / ‖E(x)‖")
    return finish(fig, title, label, height=400, width=760)


@labelled
def convergence(frame, *, label: str, x: str = "time_s", x_title: str = "training time (s)",
                title: str = "Fig. 6 (left): validation perplexity vs training time"):
    """Mean eval perplexity over seeds (band: min-max) vs ``x`` per variant."""
    ev = frame.dropna(subset=["eval_ppl"])
    fig = go.Figure()
    for i, (v, sub) in enumerate(ev.groupby("variant", sort=False)):
        g = sub.groupby("iter").agg(x=(x, "mean"), ppl=("eval_ppl", "mean"), lo=("eval_ppl", "min"),
                                    hi=("eval_ppl", "max"))
        colour = VARIANT_COLOURS.get(v, _c(i + 3))
        fig.add_trace(go.Scatter(x=list(g.x) + list(g.x[::-1]), y=list(g.hi) + list(g.lo[::-1]), fill="toself",
                                 line={"width": 0}, fillcolor=colour, opacity=0.15, showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=g.x, y=g.ppl, mode="lines+markers", name=v, line={"color": colour}))
    ref = frame.attrs.get("reference_ppl")
    if ref:  # the same model trained longer: how early these runs stop
        fig.add_hline(y=ref, line={"dash": "dash", "color": "grey"},
                      annotation_text=f"same model, {frame.attrs.get('reference_iters')} iterations: {ref:.1f}")
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text="validation perplexity")
    return finish(fig, title, label, height=440, width=820)


@labelled
def a2a_share_bars(frame, *, label: str, title: str = "Fig. 3: share of the step in all-to-all"):
    """Bars per model, one panel per setup; the paper's (a) bars as markers, Eq. 9's share as a dash."""
    names = {"a": "(a) 16 GPUs", "b": "(b) 32 GPUs", "c": "(c) 16 GPUs, 2x experts"}
    setups = list(dict.fromkeys(frame.setup))
    fig = make_subplots(rows=1, cols=len(setups), subplot_titles=[names.get(s, s) for s in setups], shared_yaxes=True)
    for c, s in enumerate(setups, 1):
        sub = frame[frame.setup == s]
        fig.add_trace(go.Bar(x=sub.model, y=sub.share, name="moelab (SIMULATED)", marker_color="#4c78a8",
                             showlegend=c == 1), 1, c)
        fig.add_trace(go.Scatter(x=sub.model, y=sub.eq9_share, mode="markers",
                                 marker={"symbol": "line-ew-open", "size": 28},
                                 name="Eq. 9 closed form", line={"color": "#54a24b"}, showlegend=c == 1), 1, c)
        if sub.paper_share.notna().any():
            fig.add_trace(go.Scatter(x=sub.model, y=sub.paper_share, mode="markers",
                                     marker={"symbol": "diamond", "size": 12}, name="paper (Fig. 3 a, reference)",
                                     line={"color": "#e45756"}, showlegend=True), 1, c)
    fig.update_yaxes(title_text="all-to-all share of the step", range=[0, 1], row=1, col=1)
    return finish(fig, title, label, height=420, width=1100)


@labelled
def ratio_curves(frame, *, label: str, title: str = "Table 4 / Eq. 6-9: all-to-all to compute ratio"):
    """Ratio vs servers w (left) and vs hidden size h (right); one line per (k, rho)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["vs servers w", "vs hidden size h"])
    for i, ((k, rho), sub) in enumerate(frame.groupby(["k", "rho"])):
        for c, axis in enumerate(("w", "h"), 1):
            s = sub[sub.axis == axis]
            fig.add_trace(go.Scatter(x=s.x, y=s.ratio, mode="lines", name=f"k={k}, rho={rho:g}", line={"color": _c(i)},
                                     legendgroup=f"{k}-{rho}", showlegend=c == 1), 1, c)
    fig.update_xaxes(title_text="servers w", row=1, col=1)
    fig.update_xaxes(title_text="hidden size h", type="log", row=1, col=2)
    fig.update_yaxes(title_text="T_a2a / T_compute", row=1, col=1)
    return finish(fig, title, label, height=420, width=1000)


@labelled
def acc_vs_L(frame, *, label: str, title: str = "Fig. 7 (left): accuracy vs number of hash functions"):
    """Accuracy (bars) and measured rho (line, right axis) per variant (Origin, CP L=...)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=frame.variant, y=frame.acc, name="accuracy", marker_color="#4c78a8"), secondary_y=False)
    fig.add_trace(go.Scatter(x=frame.variant, y=frame.rho, mode="lines+markers", name="measured rho",
                             line={"color": "#e45756"}), secondary_y=True)
    fig.update_yaxes(title_text="held-out accuracy", range=[0, 1], secondary_y=False)
    fig.update_yaxes(title_text="rho", range=[0, 1.02], secondary_y=True)
    return finish(fig, title, label, height=420, width=820)


@labelled
def cp_vs_sp(frame, *, label: str, title: str = "Fig. 7 (right): cross-polytope vs spherical hashing at equal rate"):
    x = [f"{t:.0%}" for t in frame.target]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=frame.cp_acc, name="cross-polytope", marker_color="#e45756",
                         text=[f"rho {r:.2f}" for r in frame.cp_rho], textposition="outside"))
    fig.add_trace(go.Bar(x=x, y=frame.sp_acc, name="spherical", marker_color="#4c78a8",
                         text=[f"rho {r:.2f}" for r in frame.sp_rho], textposition="outside"))
    fig.update_xaxes(title_text="target compression rate (achieved rate on each bar)")
    fig.update_yaxes(title_text="held-out accuracy", range=[0, 1.1])
    return finish(fig, title, label, height=420, width=760)
