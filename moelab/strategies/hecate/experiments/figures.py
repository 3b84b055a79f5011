"""Plotly builders for the Hecate figures, over the frames of :mod:`moelab.strategies.hecate.experiments`.

Every builder takes the required keyword ``label`` (checked by :func:`moelab.viz.figures.labelled`: it
must start with REAL, EMULATED, SIMULATED, SUBSTITUTE or PAPER), puts it under the title and in
``layout.meta``, and returns through :func:`moelab.viz.figures.finish`."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moelab.viz.figures import finish, labelled

SYSTEM_COLOURS = {"EP": "#4c78a8", "FasterMoE": "#54a24b", "SmartMoE": "#eeca3b", "FlexMoE": "#b279a2",
                  "FSDP": "#9d755d", "Hecate": "#e45756", "Hecate-RM": "#ff9da6"}


def _c(i: int) -> str:
    return qualitative.Plotly[i % len(qualitative.Plotly)]


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
