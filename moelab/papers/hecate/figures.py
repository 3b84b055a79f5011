"""Plotly builders for the Hecate figures, over the frames of :mod:`moelab.papers.hecate`.

Every builder takes the required keyword ``label`` (checked by :func:`moelab.viz.figures.labelled`: it
must start with REAL, EMULATED, SIMULATED, SUBSTITUTE or PAPER), puts it under the title and in
``layout.meta``, and returns through :func:`moelab.viz.figures.finish`."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moelab.viz.figures import finish, labelled

from .end_to_end import T_CHOSEN

# one colour per system; Hecate's variants in shades of its red, each its own
SYSTEM_COLOURS = {"EP": "#4c78a8", "FasterMoE": "#54a24b", "SmartMoE": "#eeca3b", "FlexMoE": "#b279a2",
                  "FSDP": "#9d755d", "Hecate": "#e45756", "Hecate-RM": "#ff9da6", T_CHOSEN: "#9c2a2a",
                  "Hecate (sharding only)": "#f4a582", "Hecate (materialization only)": "#b2182b"}


def _c(i: int) -> str:
    return qualitative.Plotly[i % len(qualitative.Plotly)]


def _system_colour(s: str, i: int) -> str:
    """The system's own colour: its full name first (a variant has its own entry), then the system it varies."""
    return SYSTEM_COLOURS.get(s) or SYSTEM_COLOURS.get(s.split(" (")[0], _c(i))


def _category_colours(cats) -> dict:
    """One colour per category: plotly's 10 while they suffice, else a 24-colour palette."""
    cats = list(cats)
    palette = qualitative.Plotly if len(cats) <= len(qualitative.Plotly) else qualitative.Dark24
    return {c: palette[i % len(palette)] for i, c in enumerate(cats)}


@labelled
def fig3_heatmap(frame, *, label: str, title: str = "Fig. 3: share of tokens per expert over iterations"):
    """One heatmap per MoE layer: iteration x expert, colour = the expert's share of the layer's
    assignments in that iteration (imbalance within an iteration, drift across iterations)."""
    layers = sorted(frame.layer.unique())
    fig = make_subplots(rows=len(layers), cols=1, subplot_titles=[f"MoE layer {l}" for l in layers],
                        vertical_spacing=0.12 / max(1, len(layers) - 1) if len(layers) > 1 else 0.1)
    for r, l in enumerate(layers, 1):
        g = frame[frame.layer == l].pivot_table(index="expert", columns="iter", values="share", fill_value=0)
        fig.add_trace(go.Heatmap(z=g.values, x=list(g.columns), y=list(g.index), colorscale="Viridis",
                                 zmin=0, zmax=float(frame.share.max()), showscale=r == 1,
                                 colorbar={"title": "share"}), r, 1)
        fig.update_yaxes(title_text="expert", row=r, col=1)
    fig.update_xaxes(title_text="iteration", row=len(layers), col=1)
    return finish(fig, title, label, height=260 * len(layers) + 120, width=900)


@labelled
def speedup_bars(frame, *, label: str, title: str, y: str = "speedup_vs_ep", facet: str = "gpus",
                 y_title: str = "speedup over EP"):
    """Grouped bars: one group per model, one bar per system, one panel per ``facet`` value; a system the
    checkout lacks (NaN) is left out and named in the legend title."""
    facets = list(dict.fromkeys(frame[facet])) if facet in frame else [None]
    fig = make_subplots(rows=1, cols=len(facets),
                        subplot_titles=[f"{f} {facet}" if f is not None else "" for f in facets],
                        shared_yaxes=True)
    systems = list(dict.fromkeys(frame.system))
    for c, f in enumerate(facets, 1):
        sub = frame if f is None else frame[frame[facet] == f]
        for i, s in enumerate(systems):
            g = sub[sub.system == s]
            fig.add_bar(x=g.model, y=g[y], name=s, legendgroup=s, showlegend=c == 1,
                        marker_color=_system_colour(s, i), row=1, col=c)
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    missing = sorted(set(frame[frame[y].isna()].system))
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    return finish(fig, title, label, barmode="group", width=520 * len(facets) + 200,
                  legend_title_text="not built yet: " + ", ".join(missing) if missing else "system")


@labelled
def layer_speedups(frame, *, label: str, title: str = "Fig. 11: MoE-layer speedup of Hecate over EP, per layer"):
    fig = go.Figure(go.Bar(x=frame.layer, y=frame.speedup, marker_color=SYSTEM_COLOURS["Hecate"],
                           text=[f"{v:.2f}x" for v in frame.speedup], textposition="outside"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, xaxis_title="MoE layer", yaxis_title="speedup over EP (MoE-layer time)")


@labelled
def breakdown_bars(frame, *, label: str, title: str = "Fig. 12: critical-path breakdown per system"):
    """Stacked bars: seconds of each op category on the simulated critical path, per system."""
    cats = [c for c in frame.columns if c.startswith("cp_")]
    fig = go.Figure()
    for i, c in enumerate(cats):
        fig.add_bar(x=frame.system, y=frame[c], name=c[3:], marker_color=_c(i))
    return finish(fig, title, label, barmode="stack", yaxis_title="ms per iteration on the critical path")


@labelled
def interval_bars(frame, *, label: str, title: str = "Fig. 15b: speedup of re-sharding every R iterations over none"):
    fig = go.Figure(go.Bar(x=[str(r) for r in frame.interval], y=frame.speedup, marker_color=SYSTEM_COLOURS["Hecate"],
                           text=[f"{v:.2f}x" for v in frame.speedup], textposition="outside"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, xaxis_title="re-sharding interval R (iterations)",
                  yaxis_title="speedup over materialization only")


@labelled
def memory_bars(frame, *, label: str, title: str = "Fig. 13: peak memory per device (activations excluded)",
                unit: str = "GB"):
    """Stacked Opt / Grad / Param bars from the frame's ``optim_<unit>``, ``grad_<unit>``, ``param_<unit>``."""
    fig = go.Figure()
    for c, name, colour in (("optim", "Opt", "#4c78a8"), ("grad", "Grad", "#f58518"), ("param", "Param", "#54a24b")):
        fig.add_bar(x=frame.system, y=frame[f"{c}_{unit}"], name=name, marker_color=colour)
    return finish(fig, title, label, barmode="stack", yaxis_title=f"{unit} per device")


@labelled
def bytes_per_layer(frame, *, label: str, title: str = "Fig. 4: bytes per MoE layer per iteration, FSDP vs FSSDP"):
    g = frame.groupby("layer")[["fsdp", "fsdp_formula", "hecate_sparse", "hecate_a2a", "ep_a2a"]].mean().reset_index()
    fig = go.Figure()
    for c, name, colour in (("fsdp", "FSDP all-gather + reduce-scatter (measured)", "#9d755d"),
                            ("fsdp_formula", "FSDP formula 2(N-1)/N·S per rank", "#bab0ac"),
                            ("hecate_sparse", "Hecate spAG + spRS (measured)", "#e45756"),
                            ("hecate_a2a", "Hecate token all-to-alls (measured)", "#ff9da6"),
                            ("ep_a2a", "EP token all-to-alls (measured)", "#4c78a8")):
        fig.add_bar(x=[f"layer {l}" for l in g.layer], y=g[c], name=name, marker_color=colour)
    return finish(fig, title, label, barmode="group", yaxis_title="bytes (all ranks, mean over iterations)")


@labelled
def gantt(frame, *, label: str, title: str, row: str = "row"):
    """Horizontal bars ``start_ms .. end_ms`` per ``row``, coloured by ``what``."""
    fig = go.Figure()
    colours = _category_colours(dict.fromkeys(frame["what"]))
    for what, g in frame.groupby("what", sort=False):
        fig.add_bar(y=g[row], x=g.end_ms - g.start_ms, base=g.start_ms, orientation="h", name=what,
                    marker_color=colours[what])
    return finish(fig, title, label, barmode="overlay", xaxis_title="ms", height=120 + 28 * frame[row].nunique(),
                  yaxis={"autorange": "reversed"})


@labelled
def chunk_grid(frame, *, label: str, title: str = "Fig. 6: spAG and spRS on 4 devices (chunk values)"):
    cols = (("before", "before (P: owners)"), ("after_spag", "after spAG(P, P')"),
            ("after_sprs", "after spRS(P', P): owners"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in cols], shared_yaxes=True)
    for c, (col, _) in enumerate(cols, 1):
        grid = frame.pivot_table(index="device", columns="chunk", values=col, aggfunc="first")
        z = grid.to_numpy(dtype=float)
        fig.add_trace(go.Heatmap(z=z, x=[f"chunk {x}" for x in grid.columns], y=[f"device {y}" for y in grid.index],
                                 text=[["" if v != v else f"{v:g}" for v in r] for r in z], texttemplate="%{text}",
                                 colorscale="Blues", showscale=False), 1, c)
    fig.update_yaxes(autorange="reversed")
    return finish(fig, title, label, width=1100, height=380)


@labelled
def sharding_bars(frame, *, label: str, title: str = "Fig. 8: homogeneous vs heterogeneous sharding (Alg. 2)"):
    kinds = list(dict.fromkeys(frame.sharding))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=kinds, shared_yaxes=True)
    for c, k in enumerate(kinds, 1):
        sub = frame[frame.sharding == k]
        for l, g in sub.groupby("layer"):
            fig.add_bar(x=[f"device {d}" for d in g.device], y=g.load, name=f"layer {l}", legendgroup=f"l{l}",
                        showlegend=c == 1, marker_color=_c(int(l)), text=g.experts, textposition="inside",
                        hovertext=g.owned, row=1, col=c)
    fig.update_yaxes(title_text="tokens (window), bar text = experts owned", row=1, col=1)
    return finish(fig, title, label, barmode="stack", width=1000)


@labelled
def memory_speedup(frame, *, label: str, title: str = "M2: FlexMoE speedup over EP vs its expert memory"):
    fig = go.Figure(go.Scatter(x=frame.expert_memory_over_ep, y=frame.speedup, mode="lines+markers+text",
                               text=[f"r={r}" for r in frame.r], textposition="top center",
                               marker_color=SYSTEM_COLOURS["FlexMoE"]))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, xaxis_title="expert memory over EP (E/N + r) / (E/N)",
                  yaxis_title="speedup over EP")


@labelled
def throughput_batch(frame, *, label: str, title: str = "Fig. 14: throughput vs batch size (OOM: no point)"):
    fig = go.Figure()
    for i, (s, g) in enumerate(frame.groupby("system", sort=False)):
        fig.add_scatter(x=g.batch, y=g.tokens_per_s, mode="lines+markers", name=s,
                        marker_color=_system_colour(s, i))
    return finish(fig, title, label, xaxis_title="batch (sequences per GPU)", yaxis_title="tokens / s (all GPUs)")


@labelled
def t_sweep(frame, *, label: str, title: str = "Sensitivity: Hecate's speedup over EP vs the overlap degree t (= m)"):
    fig = go.Figure()
    for i, ((cl, model), g) in enumerate(frame.groupby(["cluster", "model"], sort=False)):
        fig.add_scatter(x=g.t, y=g.speedup_vs_ep, mode="lines+markers",
                        name=f"{model} on {cl} (formula t={g.t_formula.iloc[0]})",
                        marker_color=_c(i))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, xaxis_title="t = m (experts replicated per layer)", yaxis_title="speedup over EP")


@labelled
def device_load(frame, *, label: str, title: str = "Fig. 11 (REAL): busiest device over the mean, per MoE layer call"):
    """Boxes of max / mean tokens per device over the calls of each layer, one box per system."""
    fig = go.Figure()
    for i, s in enumerate(dict.fromkeys(frame.system)):
        g = frame[frame.system == s]
        fig.add_box(x=[f"layer {l}" for l in g.layer], y=g.max_over_mean, name=s,
                    marker_color=_system_colour(s, i))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    return finish(fig, title, label, boxmode="group", yaxis_title="max / mean tokens per device")


@labelled
def phase_bytes(frame, *, label: str, title: str = "Fig. 12 (REAL): bytes per iteration by phase and system"):
    """Stacked bars: bytes all ranks sent per iteration, one segment per (phase, op)."""
    fig = go.Figure()
    phases = sorted(set(frame.phase))
    colours = _category_colours(phases)
    for ph in phases:
        g = frame[frame.phase == ph]
        fig.add_bar(x=g.system, y=g.bytes, name=ph, marker_color=colours[ph])
    return finish(fig, title, label, barmode="stack", yaxis_title="bytes sent per iteration (all ranks)")
