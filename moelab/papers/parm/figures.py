"""Plotly builders for the Parm figures, over the frames of :mod:`moelab.papers.parm`.
Each takes the required keyword ``label`` (REAL / EMULATED / SIMULATED / SUBSTITUTE / PAPER first)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moelab.viz.figures import finish, labelled

SCHED_COLOURS = {"baseline": "#4c78a8", "s1": "#e45756", "s2": "#54a24b", "s2_aas": "#b279a2", "parm": "#f58518",
                 "oracle": "#9d755d"}
OP_COLOURS = {"compute": "#bab0ac", "saa phase": "#f58518"}


def _c(i: int) -> str:
    return qualitative.Plotly[i % len(qualitative.Plotly)]


@labelled
def layout_diagram(frame, *, label: str, title: str = "Fig. 2: MP x EP x ESP layout"):
    """One box per rank, grouped by node: its MP group, expert shard and EP group."""
    fig = go.Figure()
    for r in frame.itertuples():
        x, y = r.rank, 0
        fig.add_shape(type="rect", x0=x - 0.45, x1=x + 0.45, y0=-0.45, y1=0.45, line={"color": _c(r.node)},
                      fillcolor=_c(r.node), opacity=0.15)
        fig.add_annotation(x=x, y=y, showarrow=False, align="center",
                           text=(f"rank {r.rank} (node {r.node})<br>experts {list(r.experts)} shard {r.shard}"
                                 f"<br>(ep, esp)=({r.ep},{r.esp}) (dp, mp)=({r.dp},{r.mp})"))
    cols = [c for c in frame.columns if c.endswith(" group")]
    table = "<br>".join(f"{c}: " + ", ".join(sorted({str(list(v)) for v in frame[c]})) for c in cols)
    fig.add_annotation(x=(len(frame) - 1) / 2, y=-0.9, showarrow=False, text=table, align="left")
    fig.update_xaxes(visible=False, range=[-0.6, len(frame) - 0.4])
    fig.update_yaxes(visible=False, range=[-1.4, 0.6])
    return finish(fig, title, label, height=420, width=max(520, 230 * len(frame)))


@labelled
def timelines(frame, *, label: str, title: str = "Fig. 3: op timelines of one MoE layer (fwd + bwd)"):
    """One panel per schedule; per rank a row of bars (comm calls coloured by op, compute grey, SAA phases)."""
    scheds = list(dict.fromkeys(frame.schedule))
    fig = make_subplots(rows=len(scheds), cols=1, subplot_titles=scheds, shared_xaxes=False, vertical_spacing=0.08)
    ops = sorted(frame[frame.kind == "comm"].op.unique())
    colour = {o: _c(i) for i, o in enumerate(ops)}
    seen = set()
    for row, s in enumerate(scheds, 1):
        sub = frame[frame.schedule == s]
        for r in sub.itertuples():
            c = colour.get(r.op, OP_COLOURS.get(r.kind, "#999"))
            key = r.op if r.kind == "comm" else r.kind
            y = f"rank {r.rank}" + (" (SAA phases)" if r.kind == "saa phase" else "")
            fig.add_trace(go.Bar(x=[r.end_ms - r.start_ms], base=[r.start_ms], y=[y], orientation="h",
                                 marker={"color": c}, name=key, legendgroup=key, showlegend=key not in seen,
                                 hovertext=f"{r.op} {r.phase}"), row, 1)
            seen.add(key)
        fig.update_xaxes(title_text="ms", row=row, col=1)
    return finish(fig, title, label, barmode="overlay", height=260 * len(scheds) + 100, width=1000)


@labelled
def byte_matrices(frame, *, label: str, title: str = "Fig. 4: bytes each rank sends each rank, per call"):
    """A heatmap per (schedule, forward call): src rows, dst columns."""
    calls = frame[frame.phase == "fwd"][["schedule", "call", "op"]].drop_duplicates().values.tolist()
    fig = make_subplots(rows=1, cols=len(calls), subplot_titles=[f"{s}: {o}" for s, _, o in calls])
    n = int(frame.src.max()) + 1
    for c, (s, i, o) in enumerate(calls, 1):
        sub = frame[(frame.schedule == s) & (frame.call == i)]
        m = np.zeros((n, n))
        for r in sub.itertuples():
            m[r.src, r.dst] += r.bytes
        fig.add_trace(go.Heatmap(z=m, x=list(range(n)), y=list(range(n)), coloraxis="coloraxis"), 1, c)
        fig.update_xaxes(title_text="dst", row=1, col=c)
        fig.update_yaxes(title_text="src" if c == 1 else None, autorange="reversed", row=1, col=c)
    return finish(fig, title, label, coloraxis={"colorscale": "Blues", "colorbar": {"title": "bytes"}},
                  height=340, width=260 * len(calls) + 150)


@labelled
def saa_phases(frame, *, label: str, title: str = "Fig. 5: SAA phases (all-to-all half and MP gather half)"):
    fig = go.Figure()
    for rank in sorted(frame["rank"].unique()):
        sub = frame[(frame["rank"] == rank) & (frame.kind == "saa phase")]
        fig.add_trace(go.Bar(x=sub.end_ms - sub.start_ms, base=sub.start_ms, y=[f"rank {rank}"] * len(sub),
                             orientation="h", text=[o.replace("saa ", "") for o in sub.op], name=f"rank {rank}",
                             marker={"color": [_c(i) for i in range(len(sub))]}))
    return finish(fig, title, label, barmode="overlay", xaxis_title="ms", showlegend=False, height=360, width=900)


@labelled
def speedup_bars(frame, *, label: str, cols=("s1_speedup", "s2_speedup", "aas_speedup", "parm_speedup"),
                 title: str = "Table IV: mean speedup over the baseline per (N_MP, N_ESP)", by=("P", "n_mp", "n_esp")):
    fig = go.Figure()
    x = [" ".join(f"{k}={v}" for k, v in zip(by, row)) for row in frame[list(by)].values.tolist()]
    for c in cols:
        name = c.replace("_speedup", "")
        fig.add_trace(go.Bar(x=x, y=frame[c], name=name, marker={"color": SCHED_COLOURS.get(name, None)}))
    fig.add_hline(y=1.0, line_dash="dot")
    return finish(fig, title, label, barmode="group", yaxis_title="speedup over baseline (x)", height=420, width=1000)


@labelled
def sorted_share(frame, *, label: str, col: str = "comm_share",
                 title: str = "Fig. 1: baseline communication share per configuration (sorted)"):
    v = np.sort(frame[col].to_numpy())
    fig = go.Figure(go.Scatter(x=np.arange(len(v)), y=v * 100, mode="lines+markers" if len(v) < 40 else "lines"))
    return finish(fig, title, label, xaxis_title="configuration (sorted)", yaxis_title="communication share (%)",
                  height=380, width=760)


@labelled
def fits(frame, *, label: str, title: str = "Fig. 6: collective time vs message size, with alpha-beta fits"):
    """Points and fitted lines per (source, collective), coloured by the collective (a legend group each) and
    dashed by the source: measured sources solid (then long dash-dot), PAPER rows dashed (then long dashes),
    SIMULATED dotted (then dash-dot); measured points in one marker symbol per source."""
    fig = go.Figure()
    names = list(dict.fromkeys(frame.name))
    palette = qualitative.Plotly if len(names) <= len(qualitative.Plotly) else qualitative.Dark24
    colour = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    styles = {"PAPER": ["dash", "longdash"], "SIMULATED": ["dot", "dashdot"], "": ["solid", "longdashdot"]}
    dash, symbol, seen = {}, {}, {k: 0 for k in styles}
    for src in dict.fromkeys(frame.source):
        kind = next((k for k in ("PAPER", "SIMULATED") if src.startswith(k)), "")
        dash[src] = styles[kind][seen[kind] % len(styles[kind])]
        seen[kind] += 1
        symbol[src] = ("circle", "square", "diamond", "triangle-up", "cross", "x")[len(symbol) % 6]
    for (src, name), g in frame.groupby(["source", "name"], sort=False):
        if "time_s" in g and g.time_s.notna().any() and not src.startswith(("PAPER", "SIMULATED")):
            fig.add_scatter(x=g.x, y=g.time_s * 1e3, mode="markers", name=f"{src}: {name}", legendgroup=name,
                            marker={"color": colour[name], "symbol": symbol[src]})
        fig.add_scatter(x=g.x, y=g.fit_s * 1e3, mode="lines", line={"dash": dash[src], "color": colour[name]},
                        name=f"{src}: {name} fit", legendgroup=name, showlegend=True)
    return finish(fig, title, label, xaxis={"type": "log", "title": "elements (x as the paper counts)"},
                  yaxis={"type": "log", "title": "ms"}, height=520, width=1000)


@labelled
def speedup_distribution(frame, *, label: str, col: str = "parm_speedup",
                         title: str = "Fig. 7: distribution of Parm's speedup over the baseline"):
    v = np.sort(frame[col].to_numpy())
    fig = make_subplots(rows=1, cols=2, subplot_titles=["histogram", "CDF"])
    fig.add_trace(go.Histogram(x=v, nbinsx=min(30, max(5, len(v) // 3)), name="configurations"), 1, 1)
    fig.add_trace(go.Scatter(x=v, y=np.arange(1, len(v) + 1) / max(len(v), 1), mode="lines", name="CDF"), 1, 2)
    fig.update_xaxes(title_text="speedup (x)", row=1, col=1)
    fig.update_xaxes(title_text="speedup (x)", row=1, col=2)
    return finish(fig, title, label, height=380, width=900, showlegend=False)


@labelled
def iteration_bars(frame, *, label: str, title: str = "Table V: iteration time"):
    fig = go.Figure()
    for sys_ in dict.fromkeys(frame.system):
        sub = frame[frame.system == sys_]
        fig.add_trace(go.Bar(x=sub["model"] + " " + sub["setup"], y=sub["iter_ms"], name=sys_))
    return finish(fig, title, label, barmode="group", yaxis_title="ms per iteration", height=400, width=900)
