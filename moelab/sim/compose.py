"""A training iteration's op graph built from what each technique contributes to the skeleton.

:func:`moelab.sim.graphs.transformer_iteration_graph` has hooks (the MoE layer's forward and backward,
the count exchange's bytes, the dense-gradient sync, stream priorities); a technique
(:mod:`moelab.techniques`) fills the ones it owns with a :class:`Contribution`, and :func:`composed_graph`
builds one graph from any set of them, with no per-combination code:

- the **placement** (where experts live) gives each MoE layer's :class:`~moelab.placement.Placement`
  (``placements``) and the ops it adds after the dense sync (``after``: SmartMoE's migration);
- the **token path** (dispatch, experts, combine: ``token_path(placements, loads) -> (moe_forward,
  moe_backward)``) comes from the technique owning the dispatch chain (FasterMoE's shadows and smart
  schedule, LSH-MoE's centroid rows), else from a technique's fallback (``owns_token_path=False``: Lina's
  capacity-clipped rows when it runs alone), else the core dispatcher's rows on the placements;
  ``count_bytes`` (the count exchange) from the wire format that changes it;
- the **schedule** wraps the MoE backward (``wrap_backward``), synchronises the dense gradients
  (``dense_sync``) and adjusts the graph once built (``finish``: Lina's interference factor).

At most one contribution owns each of ``placements``, ``token_path``, ``count_bytes`` and ``dense_sync``
(the techniques' conflict rule guarantees it for a composition that runs; a ValueError otherwise). A
single strategy's graph is :func:`composed_graph` of its own contribution, so a composition prices
exactly the pieces each technique prices alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from moelab.placement import Placement
from moelab.sim.graphs import capacity, route_matrix, token_stages, topology_of, transformer_iteration_graph


@dataclass
class Contribution:
    """What one technique contributes to :func:`moelab.sim.graphs.transformer_iteration_graph`."""

    placements: Optional[list] = None  # per MoE layer (placement)
    token_path: Optional[Callable] = None  # (placements, loads) -> (moe_forward, moe_backward)
    owns_token_path: bool = True  # False: a fallback, used only when no other contribution owns the token path
    count_bytes: Optional[int] = None  # the count exchange's bytes per rank (wire format)
    wrap_backward: Optional[Callable] = None  # moe_backward -> moe_backward (schedule)
    dense_sync: Optional[Callable] = None  # (ctx, ready) -> op ids (schedule)
    after: Optional[Callable] = None  # (g, ctx, prev) -> prev: ops after the dense sync (placement)
    finish: Optional[Callable] = None  # g -> None, once the graph is built (schedule)
    meta: dict = field(default_factory=dict)
    # (build(windows) -> graph) -> graph: a plan priced to its steady state (Lina's launch_agreement: plan)
    steady: Optional[Callable] = None


def core_token_path(cfg):
    """The core dispatcher's token path on per-layer placements: rows clipped to the capacity, the dense
    dispatcher's capacity-padded equal splits (as :func:`moelab.sim.graphs.ep_iteration_graph`)."""
    def path(placements, loads):
        cap = capacity(cfg)
        N = topology_of(cfg).world_size
        if cfg.model.moe.dispatcher == "dense":
            routes = [np.tile(np.array([len(pl.local_experts(r)) * cap for r in range(N)], dtype=np.int64), (N, 1))
                      for pl in placements]
        else:
            routes = [route_matrix(pl, np.minimum(L, cap) if cap is not None else L)
                      for pl, L in zip(placements, loads)]
        return token_stages(routes)
    return path


def _one(parts, key, pred=lambda p, v: v is not None):
    have = [p for p in parts if pred(p, getattr(p, key))]
    if len(have) > 1:
        raise ValueError(f"{len(have)} contributions set {key} ({[p.meta.get('technique') for p in have]}): "
                         "one technique owns it")
    return getattr(have[0], key) if have else None


def composed_graph(cfg, profile, loads, placement: Optional[Placement], parts, *, elem_bytes: Optional[int] = None,
                   hierarchical_a2a: bool = False, meta: Optional[dict] = None):
    """One iteration's graph from the contributions ``parts`` (see the module doc)."""
    loads = np.asarray(loads, dtype=np.int64)
    E, N = cfg.model.moe.num_experts, topology_of(cfg).world_size
    placements = _one(parts, "placements")
    if placements is None:
        placements = [placement or Placement.expert_parallel(E, N)] * loads.shape[0]
    path = (_one(parts, "token_path", lambda p, v: v is not None and p.owns_token_path)
            or _one(parts, "token_path", lambda p, v: v is not None and not p.owns_token_path)
            or core_token_path(cfg))
    fwd, bwd = path(placements, loads)
    for p in parts:
        if p.wrap_backward is not None:
            bwd = p.wrap_backward(bwd)
    g, ctx, prev = transformer_iteration_graph(
        cfg, profile, loads, placements[0], fwd, bwd, elem_bytes=elem_bytes, hierarchical_a2a=hierarchical_a2a,
        count_bytes=_one(parts, "count_bytes"), dense_sync=_one(parts, "dense_sync"),
        meta={k: v for p in parts for k, v in p.meta.items() if k != "technique"} | dict(meta or {}))
    for p in parts:
        if p.after is not None:
            prev = p.after(g, ctx, prev)
    for p in parts:
        if p.finish is not None:
            p.finish(g)
    return g


__all__ = ["Contribution", "composed_graph", "core_token_path"]
