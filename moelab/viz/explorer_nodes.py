"""The placement explorer's grid at cluster scale: experts x nodes, and a drill-down into one node's ranks.

At 256 experts x 64 ranks the experts x ranks grid has 16,384 cells of 3 px; the node view folds each node's
ranks into one column (experts x nodes): colour = tokens the node's ranks compute for the expert
(:func:`moelab.viz.explorer_figures.expert_rank_tokens` summed over the node), or how many of its ranks hold
it. A click on a node's column drills into that node (experts x its ranks, the rank grid's cells and clicks).

A *view* is ``"ranks"`` (the whole rank grid), ``"nodes"``, or an int: the node drilled into. Pure functions of
:func:`moelab.viz.explorer_cost.evaluate`'s dict, as the other figures.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np

from moelab.placement import Placement
from moelab.viz.explorer_figures import GRID_COLOURS, expert_rank_tokens, grid_arrays, grid_headline, grid_height
from moelab.viz.figures import check_label, finish

View = Union[str, int]


def node_of_ranks(world: int, gpus_per_node: int) -> np.ndarray:
    """``[N]``: the node of each rank (contiguous blocks of ``gpus_per_node``, as :mod:`moelab.comm.topology`)."""
    return np.arange(world) // int(gpus_per_node)


def expert_node_tokens(placement: Placement, loads, gpus_per_node: int) -> np.ndarray:
    """``[E, nodes]``: tokens the node's ranks compute for each expert (the rank grid's row summed per node)."""
    tok = expert_rank_tokens(placement, loads)
    node = node_of_ranks(placement.world_size, gpus_per_node)
    out = np.zeros((placement.num_experts, int(node.max()) + 1), dtype=np.int64)
    np.add.at(out.T, node, tok.T)
    return out


def expert_node_holders(placement: Placement, gpus_per_node: int) -> np.ndarray:
    """``[E, nodes]``: how many of the node's ranks hold each expert (owner or replica)."""
    node = node_of_ranks(placement.world_size, gpus_per_node)
    out = np.zeros((placement.num_experts, int(node.max()) + 1), dtype=np.int64)
    for e, h in enumerate(placement.holders):
        np.add.at(out[e], node[list(h)], 1)
    return out


def node_ranks(ev: dict, node: int) -> list:
    """The global rank ids of ``node``."""
    G, N = ev["profile"].gpus_per_node, ev["placement"].world_size
    if not 0 <= node < -(-N // G):
        raise ValueError(f"node {node} outside the cluster ({-(-N // G)} nodes)")
    return list(range(node * G, min(N, (node + 1) * G)))


def view_arrays(ev: dict, colour: str = "tokens", view: View = "ranks") -> dict:
    """What the grid shows in ``view``: ``z`` ([E, columns], None where nothing is held), hover ``text``,
    column ids ``x`` (ranks, or nodes), ``xtitle``, ``headline`` and ``bounds`` (x of the node boundary lines)."""
    pl, G = ev["placement"], ev["profile"].gpus_per_node
    E, N = pl.num_experts, pl.world_size
    if view == "nodes":
        tok, held = expert_node_tokens(pl, ev["loads"], G), expert_node_holders(pl, G)
        z = np.where(held > 0, tok if colour == "tokens" else held, 0).astype(object)
        z[held == 0] = None
        text = np.char.add(np.char.add(held.astype(str), f" of {G} ranks hold it, tokens "), tok.astype(str))
        return dict(z=z, text=np.where(held > 0, text, "not held"), x=list(range(held.shape[1])), xtitle="node",
                    bounds=[], headline=(f"Placement: {E} experts x {held.shape[1]} nodes of {G} ranks, "
                                         f"{pl.num_replicas} replica(s) (click a node to see its ranks)"))
    z, text = grid_arrays(ev, colour)
    if view == "ranks":
        return dict(z=z, text=text, x=list(range(N)), xtitle="rank", bounds=[b - 0.5 for b in range(G, N, G)],
                    headline=grid_headline(ev))
    ranks = node_ranks(ev, int(view))
    sl = slice(ranks[0], ranks[-1] + 1)
    return dict(z=z[:, sl], text=text[:, sl], x=ranks, xtitle=f"rank (node {int(view)})", bounds=[],
                headline=(f"Placement: node {int(view)}, {E} experts x ranks {ranks[0]}-{ranks[-1]}, "
                          f"{pl.num_replicas} replica(s) in the cluster (click a cell)"))


def view_figure(ev: dict, *, colour: str = "tokens", view: View = "ranks", label: Optional[str] = None,
                width: Optional[int] = None):
    """The grid of ``view`` as a heatmap figure (:func:`view_arrays`; node boundaries as lines in the rank view)."""
    import plotly.graph_objects as go

    v = view_arrays(ev, colour, view)
    E, C = v["z"].shape
    col = v["xtitle"].split()[0]
    fig = go.Figure(go.Heatmap(z=v["z"], x=v["x"], y=list(range(E)), text=v["text"], colorscale=GRID_COLOURS[colour],
                               hovertemplate=f"expert %{{y}}, {col} %{{x}}: %{{text}}<extra></extra>",
                               xgap=1 if C <= 32 else 0, ygap=1 if E <= 64 else 0, zmin=0,
                               showscale=colour == "tokens", colorbar=dict(title="tokens", thickness=12)))
    for b in v["bounds"]:
        fig.add_vline(x=b, line_color="#e4572e", line_width=1)
    return finish(fig, v["headline"], check_label(label or ev["label"]), xaxis_title=v["xtitle"],
                  yaxis_title="expert", height=grid_height(E), yaxis=dict(autorange="reversed"),
                  margin=dict(l=60, r=20, b=50), width=width)


__all__ = ["expert_node_tokens", "expert_node_holders", "node_of_ranks", "node_ranks", "view_arrays", "view_figure"]
