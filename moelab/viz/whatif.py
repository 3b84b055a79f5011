"""Figures of a cluster-scale what-if sweep (:func:`moelab.sim.whatif.sweep`): one line per strategy."""
from __future__ import annotations

import plotly.graph_objects as go

from moelab.viz.figures import finish, labelled

METRICS = {"step_ms": "simulated step (ms)", "bytes_inter_GB": "inter-node bytes per iteration (GB)",
           "mem_static_GB": "params + grads + optimizer, busiest rank (GB)", "sim_wall_s": "simulator wall time (s)"}


@labelled
def versus(frame, x: str, y: str, *, label: str, title: str, log_x: bool = False, log_y: bool = False) -> go.Figure:
    """``y`` against ``x``, one line per strategy; points a strategy could not price are left out and
    named in the legend (``not priced``)."""
    fig = go.Figure()
    for name, g in frame.groupby("strategy", sort=False):
        ok = g[g["note"] == ""] if "note" in g else g
        missing = len(g) - len(ok)
        fig.add_scatter(x=ok[x], y=ok[y], mode="lines+markers",
                        name=name + (f" ({missing} not priced)" if missing else ""))
    fig.update_xaxes(title=x.replace("_", " "), type="log" if log_x else None)
    fig.update_yaxes(title=METRICS.get(y, y), type="log" if log_y else None)
    return finish(fig, title, label)
