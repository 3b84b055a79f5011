"""The placement explorer's figures: tokens per rank, bytes per rank, memory per rank, the experts x ranks grid,
and A vs B. Pure functions of :func:`moelab.viz.explorer_cost.evaluate`'s dict; labelled SIMULATED."""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm.topology import LINK_CLASSES
from moelab.placement import Placement
from moelab.viz.explorer_cost import MEMORY_CATEGORIES
from moelab.viz.figures import LINK_COLOURS, check_label, finish


def load_figure(ev: dict, *, label: Optional[str] = None, baseline: Optional[dict] = None,
                width: Optional[int] = None):
    """Tokens computed per rank (bars), the mean (dashed), and optionally a baseline's bars (e.g. EP)."""
    import plotly.graph_objects as go

    label = check_label(label or ev["label"])
    fig = go.Figure()
    N = len(ev["rank_tokens"])
    if baseline is not None:
        fig.add_bar(x=list(range(N)), y=baseline["rank_tokens"], name="expert parallelism", marker_color="#c7c7c7")
    fig.add_bar(x=list(range(N)), y=ev["rank_tokens"], name="this placement", marker_color="#4c78a8")
    fig.add_hline(y=ev["mean_load"], line_dash="dash", annotation_text="mean")
    return finish(fig, f"Tokens computed per rank: max {ev['max_load']}, imbalance {ev['imbalance']:.2f}", label,
                  barmode="group", xaxis_title="rank", yaxis_title="tokens", width=width)


def bytes_figure(ev: dict, *, label: Optional[str] = None, width: Optional[int] = None):
    """Bytes each rank sends in the MoE layer (count exchange + 4 all-to-alls), stacked by link class."""
    import plotly.graph_objects as go

    label = check_label(label or ev["label"])
    fig = go.Figure()
    b = ev["bytes"]
    for c in LINK_CLASSES:
        fig.add_bar(x=list(b.index), y=b[c] / 1e6, name=c, marker_color=LINK_COLOURS.get(c))
    return finish(fig, f"Layer time {ev['layer_time_s'] * 1e3:.2f} ms: MoE layer bytes sent per rank (fwd + bwd)",
                  label, barmode="stack", xaxis_title="rank", yaxis_title="MB", width=width)


def memory_figure(ev: dict, *, label: Optional[str] = None, width: Optional[int] = None):
    """Peak bytes per rank by category (each its own peak, stacked) and the peak of their sum, against the
    profile's memory per GPU."""
    import plotly.graph_objects as go

    label = check_label(label or ev["label"])
    mem = ev["memory"]
    fig = go.Figure()
    colours = {"params": "#4c78a8", "grads": "#72b7b2", "optimizer": "#f58518", "activations": "#b279a2"}
    for c in MEMORY_CATEGORIES:
        fig.add_bar(x=list(mem.index), y=mem[c] / 1e9, name=c, marker_color=colours[c])
    fig.add_scatter(x=list(mem.index), y=mem["total"] / 1e9, name="peak total", mode="markers",
                    marker=dict(symbol="line-ew-open", size=14, color="#222"))
    fig.add_hline(y=ev["memory_limit"] / 1e9, line_dash="dot", line_color="#c00",
                  annotation_text=f"{ev['profile'].mem_GB:g} GB per GPU")
    return finish(fig, f"Peak memory per rank: {mem['total'].max() / 1e9:.3f} GB at most", label,
                  barmode="stack", xaxis_title="rank", yaxis_title="GB", width=width)


def expert_rank_tokens(placement: Placement, loads) -> np.ndarray:
    """``[E, N]``: tokens each rank computes for each expert (the dispatcher's split of ``loads[src, e]``
    over the expert's holders, :meth:`Placement.routes` expert by expert)."""
    C = np.asarray(loads, dtype=np.int64)
    N, E = C.shape
    out = np.zeros((E, N), dtype=np.int64)
    out[np.arange(E), placement.owners] = C.sum(0)
    for e, h in enumerate(placement.holders):
        if len(h) > 1:
            out[e] = Placement(1, N, (h,), placement.rule).routes(C[:, e:e + 1]).sum(0)
    return out


GRID_COLOURS = {"tokens": "Blues", "holders": [[0.0, "#9ecae1"], [1.0, "#08519c"]]}


def grid_arrays(ev: dict, colour: str = "tokens") -> tuple:
    """``(z, text)`` of the experts x ranks grid: z[e, r] = tokens rank r computes for expert e (``colour``
    "tokens") or 1 replica / 2 owner ("holders"), None where r does not hold e; hover text says which."""
    pl = ev["placement"]
    E, N = pl.num_experts, pl.world_size
    tok = expert_rank_tokens(pl, ev["loads"])
    held = np.zeros((E, N), dtype=np.int8)
    for e, h in enumerate(pl.holders):
        held[e, list(h[1:])] = 1
        held[e, h[0]] = 2
    z = np.where(held > 0, tok if colour == "tokens" else held, 0).astype(object)
    z[held == 0] = None  # a blank cell (JSON null: the widget cannot send NaN)
    role = np.array(["", "replica", "owner"], dtype=object)[held]
    text = np.char.add(np.char.add(role.astype(str), ", tokens "), tok.astype(str))
    return z, np.where(held > 0, text, "not held")


def grid_figure(ev: dict, *, colour: str = "tokens", label: Optional[str] = None, width: Optional[int] = None):
    """Experts (rows) x ranks (columns): a cell is coloured where the rank holds the expert (by tokens it
    computes for it, or owner / replica), blank elsewhere; node boundaries as lines. The editor's canvas
    (:mod:`moelab.viz.explorer_ui` wraps it in a ``FigureWidget`` and listens to clicks)."""
    import plotly.graph_objects as go

    label = check_label(label or ev["label"])
    pl = ev["placement"]
    E, N = pl.num_experts, pl.world_size
    z, text = grid_arrays(ev, colour)
    fig = go.Figure(go.Heatmap(z=z, x=list(range(N)), y=list(range(E)), text=text, colorscale=GRID_COLOURS[colour],
                               hovertemplate="expert %{y}, rank %{x}: %{text}<extra></extra>", xgap=1 if N <= 32 else 0,
                               ygap=1 if E <= 64 else 0, zmin=0, showscale=colour == "tokens",
                               colorbar=dict(title="tokens", thickness=12)))
    G = ev["profile"].gpus_per_node
    for b in range(G, N, G):
        fig.add_vline(x=b - 0.5, line_color="#e4572e", line_width=1)
    return finish(fig, grid_headline(ev), label,
                  xaxis_title="rank", yaxis_title="expert", height=grid_height(E),
                  yaxis=dict(autorange="reversed"), margin=dict(l=60, r=20, b=50), width=width)


def grid_headline(ev: dict) -> str:
    pl = ev["placement"]
    return f"Placement: {pl.num_experts} experts x {pl.world_size} ranks, {pl.num_replicas} replica(s) (click a cell)"


def grid_height(E: int) -> int:
    """Pixels of the grid: about 3 px per expert row at 256 experts, never under 320."""
    return int(min(900, max(320, 3 * E + 140)))


def ab_table(a: dict, b: dict):
    """A vs B: each headline price of both and B - A (a DataFrame, one row per price)."""
    import pandas as pd

    def row(ev):
        m = ev["memory"]["total"]
        return {"layer time (ms)": ev["layer_time_s"] * 1e3, "forward (ms)": ev["fwd_s"] * 1e3,
                "backward (ms)": ev["bwd_s"] * 1e3, "replica sync (ms)": ev["replica_sync_s"] * 1e3,
                "count exchange (ms)": ev["count_exchange_s"] * 1e3, "dense update (ms)": ev["dense_update_s"] * 1e3,
                "iteration (ms)": ev["iteration_s"] * 1e3, "max tokens per rank": float(ev["max_load"]),
                "imbalance": ev["imbalance"], "inter-node MB": ev["bytes"]["inter"].sum() / 1e6,
                "replicas": float(ev["placement"].num_replicas), "peak memory (GB)": m.max() / 1e9}

    A, B = row(a), row(b)
    return pd.DataFrame({"A": A, "B": B, "B - A": {k: B[k] - A[k] for k in A}})


def ab_figure(a: dict, b: dict, *, label: Optional[str] = None, width: Optional[int] = None):
    """Tokens per rank of A and B side by side, and B - A of the layer time in the title."""
    import plotly.graph_objects as go

    label = check_label(label or b["label"])
    N = len(a["rank_tokens"])
    fig = go.Figure()
    fig.add_bar(x=list(range(N)), y=a["rank_tokens"], name="A (pinned)", marker_color="#c7c7c7")
    fig.add_bar(x=list(range(N)), y=b["rank_tokens"], name="B (current)", marker_color="#4c78a8")
    d = (b["layer_time_s"] - a["layer_time_s"]) * 1e3
    return finish(fig, f"A vs B: layer time {a['layer_time_s'] * 1e3:.2f} -> {b['layer_time_s'] * 1e3:.2f} ms "
                       f"({d:+.2f} ms)", label, barmode="group", xaxis_title="rank", yaxis_title="tokens",
                  width=width)


__all__ = ["load_figure", "bytes_figure", "memory_figure", "grid_figure", "grid_arrays", "grid_height", "grid_headline",
           "expert_rank_tokens", "ab_table", "ab_figure"]
