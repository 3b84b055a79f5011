"""Plotly builders for the FasterMoE figures (paper Figs. 3-14, Table 3), over the frames of
:mod:`moelab.papers.fastermoe`.

Every builder takes the required keyword ``label`` (checked by :func:`moelab.viz.figures.labelled`:
it must start with REAL, EMULATED, SIMULATED, SUBSTITUTE or PAPER), puts it under the title and in
``layout.meta`` (so :func:`moelab.papers.kit.report.record_figure` files it), and returns through
:func:`moelab.viz.figures.finish`. The experiment frames carry their label in ``frame.attrs["label"]``:
``fig5_roofline(points, lines, label=points.attrs["label"])``.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moelab.viz.figures import finish, labelled

PALETTE = qualitative.Plotly
SYSTEM_COLOURS = {"ZeRO-1": "#bab0ac", "ZeRO-2": "#9d755d", "ZeRO-3": "#4c78a8", "FastMoE": "#f58518",
                  "FasterMoE": "#54a24b", "fastmoe": "#f58518", "shadow": "#e45756", "smart": "#72b7b2",
                  "both": "#54a24b"}
OP_COLOURS = {"S": "#4c78a8", "C": "#54a24b", "R": "#f58518", "shadow": "#b279a2", "p2p": "#4c78a8",
              "all_gather": "#eeca3b", "broadcast": "#b279a2", "reduce": "#ff9da6"}


def _c(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


# ---- Fig. 3 ----------------------------------------------------------------------------------------
@labelled
def fig3_ep_example(routing, workers, *, label: str,
                    title: str = "Fig. 3: expert parallelism, routing and idle workers"):
    """Left: tokens each worker sends to each expert (one expert per worker). Right: forward expert
    compute per worker and how long it waits for the slowest one."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens: source worker -> expert", "forward expert compute"),
                        column_widths=[0.5, 0.5])
    grid = routing.pivot_table(index="source", columns="expert", values="tokens", aggfunc="sum")
    fig.add_trace(go.Heatmap(z=grid.values, x=list(grid.columns), y=list(grid.index), colorscale="Blues",
                             text=grid.values, texttemplate="%{text}", showscale=False), 1, 1)
    fig.add_bar(x=workers.worker, y=workers.compute_fw_ms, name="compute", marker_color="#54a24b", row=1, col=2)
    fig.add_bar(x=workers.worker, y=workers.idle_ms, name="idle (waits for the slowest)", marker_color="#d9d9d9",
                row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    return finish(fig, title, label, barmode="stack", width=1000)


# ---- Fig. 4 ----------------------------------------------------------------------------------------
@labelled
def fig4_popularity(shares, *, label: str, title: str = "Fig. 4: expert-selection share over iterations"):
    """One stacked-area panel per trace: each expert's share of the iteration's assignments."""
    traces = list(dict.fromkeys(shares.trace))
    experts = sorted(set(int(e) for e in shares.expert))
    palette = PALETTE if len(experts) <= len(PALETTE) else qualitative.Dark24  # one colour per expert (up to 24)
    colour = {e: palette[i % len(palette)] for i, e in enumerate(experts)}
    spacing = 0.18  # not a paper number: the gap between panels
    fig = make_subplots(rows=len(traces), cols=1, subplot_titles=traces, vertical_spacing=spacing)
    for r, t in enumerate(traces, 1):
        g = shares[shares.trace == t]
        for e, ge in g.groupby("expert"):
            fig.add_scatter(x=ge.iter, y=ge.share, stackgroup=f"s{r}", mode="lines", line={"width": 0.5},
                            name=f"expert {e}", legendgroup=f"e{e}", showlegend=r == 1, marker_color=colour[int(e)],
                            row=r, col=1)
        fig.update_yaxes(title_text="share", range=[0, 1], row=r, col=1)
        fig.update_xaxes(title_text="iteration", row=r, col=1)
    return finish(fig, title, label, height=320 * len(traces))


# ---- Fig. 5 ----------------------------------------------------------------------------------------
@labelled
def fig5_roofline(points, lines, *, label: str, unit: str = "TFLOPs",
                  title: str = "Fig. 5: DDL-Roofline"):
    """x: rho = T_comp / T_comm (log); y: Theta, useful FLOP/s per worker. Solid: ideal (full overlap),
    dashed: semi-ideal (synchronous, fully used). Arrows: (1) shadowing, (2) smart scheduling."""
    ycol = f"theta_{unit}"
    fig = go.Figure()
    fig.add_scatter(x=lines.rho, y=lines[f"ideal_{unit}"], mode="lines", name="ideal (overlap)",
                    line={"color": "black"})
    fig.add_scatter(x=lines.rho, y=lines[f"semi_ideal_{unit}"], mode="lines", name="semi-ideal (synchronous)",
                    line={"color": "grey", "dash": "dash"})
    tags = {"EP+shadow": " (1)", "EP+smart": " (2)"}
    for i, (_, p) in enumerate(points.iterrows()):
        fig.add_scatter(x=[p.rho], y=[p[ycol]], mode="markers+text", text=[p["name"] + tags.get(p["name"], "")],
                        textposition="bottom center" if p["name"] in tags else "top center",
                        marker={"size": 12, "color": _c(i)}, name=p["name"])
    pts = {p["name"]: p for _, p in points.iterrows()}
    ep = next((n for n in pts if n.startswith("EP") and "+" not in n), None)

    def arrow(a, b, text):
        if a in pts and b in pts:
            fig.add_annotation(x=np.log10(pts[b].rho), y=np.log10(pts[b][ycol]), ax=np.log10(pts[a].rho),
                               ay=np.log10(pts[a][ycol]), xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                               arrowhead=3, arrowwidth=2, text=text, font={"size": 14})

    if ep:
        arrow(ep, "EP+shadow", "")
        arrow(ep, "EP+smart", "")
    return finish(fig, title, label, xaxis={"type": "log", "title": "rho = T_comp / T_comm (per-iteration totals)"},
                  yaxis={"type": "log", "title": f"Theta ({unit.replace('FLOPs', 'FLOP/s')} per worker, log)"})


# ---- Fig. 6 ----------------------------------------------------------------------------------------
@labelled
def fig6_shadow_bytes(frame, *, label: str, title: str = "Fig. 6: shadowing moves parameters instead of tokens"):
    """Bytes one iteration moves (all ranks), per collective and link class, without and with the
    hottest expert shadowed."""
    fig = go.Figure()
    for link, colour in (("intra", "#3b82c4"), ("inter", "#e4572e")):
        g = frame[frame.link == link]
        fig.add_bar(x=[g.variant, g.op], y=g.MB, name=f"{link}-node", marker_color=colour)
    return finish(fig, title, label, barmode="stack", yaxis_title="MB sent (all ranks, one iteration)")


# ---- Gantt helpers (Figs. 7, 8) ---------------------------------------------------------------------
def _gantt(fig, rows, y, row=None, col=None, showlegend=True, seen=None):
    seen = set() if seen is None else seen
    for _, r in rows.iterrows():
        key = str(r["name"]).split()[0].rstrip("0123456789") or str(r["name"])
        colour = OP_COLOURS.get(key, "#9aa5b1")
        fig.add_bar(y=[y(r)], x=[r.end_ms - r.start_ms], base=[r.start_ms], orientation="h", marker_color=colour,
                    text=[r["name"]], textposition="inside", insidetextanchor="middle", name=key, legendgroup=key,
                    showlegend=showlegend and key not in seen,
                    hovertemplate=f"{r['name']}<br>%{{base:.3f}} ms + %{{x:.3f}} ms<extra></extra>",
                    **({} if row is None else {"row": row, "col": col}))
        seen.add(key)
    return seen


@labelled
def fig7_schedule(gantt, *, label: str, title: str = "Fig. 7: fine-grained operations of worker 0 (S, C, R per step)"):
    fig = go.Figure()
    _gantt(fig, gantt, lambda r: f"{r.stream} stream")
    return finish(fig, title, label, barmode="overlay", xaxis_title="time (ms)",
                  yaxis={"categoryorder": "array", "categoryarray": ["compute stream", "comm stream"]})


@labelled
def fig8_schedules(frame, *, label: str, by: str = "variant",
                   title: str = "Fig. 8: schedules of one MoE layer (comm and compute streams)"):
    """One panel per ``by`` value (a measured variant, or a simulated schedule), comm and compute rows."""
    panels = list(dict.fromkeys(frame[by]))
    fig = make_subplots(rows=len(panels), cols=1, subplot_titles=panels, shared_xaxes=True, vertical_spacing=0.08)
    seen = set()
    for i, p in enumerate(panels, 1):
        seen = _gantt(fig, frame[frame[by] == p], lambda r: r.stream, row=i, col=1, seen=seen)
        fig.update_yaxes(categoryorder="array", categoryarray=["compute", "comm"], row=i, col=1)
    fig.update_xaxes(title_text="time (ms)", row=len(panels), col=1)
    return finish(fig, title, label, barmode="overlay", height=220 * len(panels) + 120)


# ---- Fig. 9 ----------------------------------------------------------------------------------------
@labelled
def fig9_predictor(points, metrics, *, label: str, title: str = "Fig. 9: performance model, predicted vs measured"):
    """Predicted vs measured (ms), one panel per part: the whole layer (forward + backward), the
    forward expert compute, the all-to-alls (each measured on the real runs); markers by run kind
    (EMULATED links / REAL loopback gloo) and calibration/evaluation split; y = x dashed. Each panel's
    title gives R^2 and median |rel. error| of the held-out points per run kind and the part's share
    of the measured end-to-end time, flagged when too few points or a part was not measured (the paper's
    R^2 is in the paper-vs-moelab table, from paper.yaml)."""
    parts = (("e2e", "e2e_s", "predicted_e2e_s"), ("compute", "compute_fw_s", "predicted_compute_fw_s"),
             ("comm", "comm_s", "predicted_comm_s"))
    names = {"e2e": "end-to-end (fw+bw)", "compute": "compute (fw experts)", "comm": "communication (4 a2a)"}
    kind = {"emulated": "EMULATED links", "plain": "REAL loopback gloo"}
    short = {"emulated": "emu", "plain": "loopback"}

    def score(mode, part):
        m = metrics[(metrics["mode"] == mode) & (metrics.split == "evaluation") & (metrics.part == part)]
        if not len(m) or not np.isfinite(m.r2.iloc[0]):
            return f"{short.get(mode, mode)}: not measured" if len(m) else f"{short.get(mode, mode)}: -"
        r = m.iloc[0]
        flag = "" if r.get("r2_meaningful", True) else f" (n={int(r.n)}: too few)"
        share = r.get("share_of_e2e", np.nan)
        share = f" · {100 * share:.0f}% of e2e" if part != "e2e" and np.isfinite(share) else ""
        return f"{short.get(mode, mode)}: R² {r.r2:.2f} · err {100 * r.median_rel_err:.0f}%{share}{flag}"

    modes = list(dict.fromkeys(points["mode"]))
    subt = [f"{names[p]}<br>" + "<br>".join(score(m, p) for m in modes) for p, _, _ in parts]
    fig = make_subplots(rows=1, cols=3, subplot_titles=subt, horizontal_spacing=0.08)
    fig.update_annotations(font_size=11)  # the subplot titles: two or three lines each
    symbols = {"calibration": "circle-open", "evaluation": "circle"}
    for c, (part, meas, pred) in enumerate(parts, 1):
        lim = 0.0
        for i, mode in enumerate(modes):
            for split, g in points[points["mode"] == mode].groupby("split"):
                fig.add_scatter(x=1e3 * g[meas], y=1e3 * g[pred], mode="markers",
                                name=f"{kind.get(mode, mode)}, {split}",
                                legendgroup=mode, showlegend=c == 1,
                                marker={"color": _c(i), "symbol": symbols.get(split, "circle"), "size": 9},
                                text=g.point, hovertemplate="%{text}<br>measured %{x:.2f} ms<br>predicted %{y:.2f} ms",
                                row=1, col=c)
                lim = max(lim, 1e3 * float(np.nanmax([g[meas].max(), g[pred].max()])))
        fig.add_scatter(x=[0, lim], y=[0, lim], mode="lines", line={"dash": "dash", "color": "grey"}, name="y = x",
                        showlegend=c == 1, row=1, col=c)
        fig.update_xaxes(title_text="measured (ms)", row=1, col=c)
        fig.update_yaxes(title_text="predicted (ms)", row=1, col=c)
    return finish(fig, title + " (held-out half)", label, height=560, width=1250, margin={"t": 170})


# ---- Fig. 10, 13 -----------------------------------------------------------------------------------
@labelled
def fig10_end_to_end(frame, *, label: str, title: str = "Fig. 10: speedup over ZeRO-3"):
    fig = go.Figure()
    for system, g in frame.groupby("system", sort=False):
        fig.add_bar(x=g.model + " (" + g.cluster + ")", y=g.speedup_vs_zero3, name=system,
                    marker_color=SYSTEM_COLOURS.get(system), text=[f"{v:.2f}" for v in g.speedup_vs_zero3],
                    textposition="outside")
    return finish(fig, title, label, barmode="group", yaxis_title="speedup over ZeRO-3 (MoE layers)")


@labelled
def fig10_real(frame, *, label: str, title: str = "Fig. 10 (a): whole training steps on CPU ranks"):
    """Median step time per system (bars, min-max as error bars) with the speedup over ZeRO-3 on top."""
    fig = go.Figure()
    sp = frame.speedup_vs_zero3 if "speedup_vs_zero3" in frame else None
    fig.add_bar(x=frame.system, y=frame.step_ms, marker_color=[SYSTEM_COLOURS.get(s, "#9aa5b1") for s in frame.system],
                error_y={"type": "data", "symmetric": False, "array": frame.max_ms - frame.step_ms,
                         "arrayminus": frame.step_ms - frame.min_ms},
                text=[f"{v:.2f}x" for v in sp] if sp is not None else None, textposition="outside", name="step time")
    return finish(fig, title + (" (text: speedup over ZeRO-3)" if sp is not None else ""), label,
                  yaxis_title="median step time (ms)", showlegend=False)


@labelled
def fig13_breakdown(frame, *, label: str, x: str = "model", title: str = "Fig. 13: speedup over FastMoE"):
    fig = go.Figure()
    xs = (frame[x] + (" (" + frame.cluster + ")" if "cluster" in frame else "")) if x in frame else frame.variant
    for v in ("shadow", "smart", "both"):
        m = frame.variant == v
        fig.add_bar(x=xs[m], y=frame.speedup[m], name={"shadow": "shadowing", "smart": "smart schedule",
                                                      "both": "both"}[v], marker_color=SYSTEM_COLOURS[v],
                    text=[f"{s:.2f}" for s in frame.speedup[m]], textposition="outside")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, barmode="group", yaxis_title="speedup over FastMoE")


# ---- Fig. 11 ---------------------------------------------------------------------------------------
@labelled
def fig11_shadowing(latency, shadow_map, *, label: str,
                    title: str = "Fig. 11: latency with and without shadowing, and the shadowed experts"):
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.55, 0.45], vertical_spacing=0.06)
    names = {"fastmoe": "no optimization", "shadow": "dynamic shadowing"}
    for v, g in latency.groupby("variant", sort=False):
        fig.add_scatter(x=g.iter, y=g.latency_ms, mode="lines+markers", name=names.get(v, v),
                        marker_color=SYSTEM_COLOURS.get(v), row=1, col=1)
    grid = shadow_map.pivot_table(index="expert", columns="iter", values="shadowed", aggfunc="max", fill_value=0)
    fig.add_trace(go.Heatmap(z=grid.values, x=list(grid.columns), y=list(grid.index), showscale=False,
                             colorscale=[[0, "#f0f0f0"], [1, "#e45756"]], zmin=0, zmax=1,
                             hovertemplate="iteration %{x}<br>expert %{y}<br>shadowed %{z}<extra></extra>"), 2, 1)
    fig.update_yaxes(title_text="latency (ms)", row=1, col=1)
    fig.update_yaxes(title_text="expert (shadowed = red)", dtick=max(1, len(grid) // 16), row=2, col=1)
    fig.update_xaxes(title_text="iteration", row=2, col=1)
    return finish(fig, title, label, height=600)


# ---- Fig. 12 ---------------------------------------------------------------------------------------
@labelled
def fig12_smart(frame, *, label: str,
                title: str = "Fig. 12: smart scheduling speedup per layer, theoretical vs achieved"):
    fig = go.Figure()
    x = [frame.model, frame.layer.astype(str)]
    fig.add_bar(x=x, y=frame.theoretical, name="theoretical", marker_color="#bab0ac")
    if "achieved_simulator" in frame:
        fig.add_bar(x=x, y=frame.achieved_simulator, name="achieved (simulator)", marker_color="#54a24b")
    if "achieved_pipeline_model" in frame:
        fig.add_scatter(x=x, y=frame.achieved_pipeline_model, mode="markers", name="pipeline model",
                        marker={"color": "black", "symbol": "line-ew-open", "size": 10})
    fig.add_hline(y=1.75, line_dash="dot", line_color="grey", annotation_text="upper bound 7/4")
    return finish(fig, title, label, barmode="group", yaxis_title="speedup over FastMoE", xaxis_title="model / layer")


@labelled
def fig12_smart_real(frame, *, label: str, title: str = "Fig. 12 (a): smart schedule on CPU ranks, per group size"):
    fig = go.Figure()
    x = [f"Gs={g} (G={n})" for g, n in zip(frame.group_size, frame.groups)]
    fig.add_bar(x=x, y=frame.theoretical, name="theoretical (calibrated model)", marker_color="#bab0ac")
    fig.add_bar(x=x, y=frame.pipeline_model, name="pipeline model", marker_color="#72b7b2")
    fig.add_bar(x=x, y=frame.achieved, name="achieved (measured)", marker_color="#54a24b")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, barmode="group", yaxis_title="speedup over FastMoE")


# ---- Fig. 14 ---------------------------------------------------------------------------------------
@labelled
def fig14_convergence(curves, *, label: str, title: str = "Fig. 14: training loss vs time"):
    """Left: smoothed loss vs modelled time at paper scale; middle: vs measured (emulated) time; right:
    vs step."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("vs modelled time (johnny, SIMULATED)",
                                                        "vs measured time (EMULATED links)", "vs step"))
    for i, (name, g) in enumerate(curves.groupby("system", sort=False)):
        for c, x in enumerate(("modelled_time_s", "measured_time_s", "step"), 1):
            fig.add_scatter(x=g[x], y=g.loss_smooth, mode="lines", name=name, legendgroup=name, showlegend=c == 1,
                            line={"color": _c(i)}, row=1, col=c)
    fig.update_xaxes(title_text="modelled time (s)", row=1, col=1)
    fig.update_xaxes(title_text="measured time (s)", row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=3)
    fig.update_yaxes(title_text="LM loss (smoothed)", row=1, col=1)
    return finish(fig, title, label, height=450, width=1150)
