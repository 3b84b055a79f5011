"""The simulator's op graph of one FlexMoE training iteration: the ``sim_graph`` of the ``flexmoe``
:class:`~moelab.registry.Strategy`, pricing the plan :class:`.update.FlexMoEUpdate` executed.

- The EP skeleton (:func:`moelab.sim.graphs.transformer_iteration_graph`: attention, gate, count
  exchange, dispatch / experts / combine and the mirror backward, dense all-reduce) with each MoE
  layer's own holders: tokens routed by the placement's rule, as the dispatcher does (the same
  closures as :func:`moelab.sim.graphs.ep_iteration_graph`, whose replica sync is the core's
  owner-gather p2p, not FlexMoE's);
- after the dense all-reduce, per layer and replicated expert (ascending), one ring ``all_reduce`` of
  the expert's flat gradient (``expert_param_count × elem_bytes``) within its replica set;
- on a scheduling iteration, the round's copies (:func:`moelab.moe.migrate.copies_between` of the
  holders before the round, recovered from the recorded steps by
  :func:`moelab.strategies.flexmoe.policy.undo_steps`, and after) as ONE ``all_to_all`` over all ranks of rows of
  params + two Adam moments (``3 × expert_param_count × elem_bytes``), issued beside layer 0's attention
  and waited by its gate (the runtime runs it just before the forward).

Every collective carries the runtime's record, so :func:`moelab.sim.graphs.graph_bytes` equals the
measured bytes exactly.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from moelab.comm import costs
from moelab.moe.migrate import copies_between
from moelab.placement import Placement
from moelab.sim.engine import OpGraph
from moelab.sim.graphs import (
    elem_bytes_of,
    expert_param_count,
    moe_layer_ids,
    route_matrix,
    token_stages,
    topology_of,
    transformer_iteration_graph,
)
from moelab.strategies.flexmoe.policy import canonical, undo_steps


def migration_matrix(holders, steps, N: int, row_bytes: int) -> np.ndarray:
    """``bytes[src, dst]`` of one iteration's migration (all layers): per copy one row of ``row_bytes``."""
    mat = np.zeros((N, N), dtype=np.int64)
    for h, st in zip(holders, steps):
        if st:
            for _, src, dst in copies_between(undo_steps(h, st), canonical(h)):
                mat[src, dst] += row_bytes
    return mat


def flexmoe_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                            holders: Optional[Sequence] = None, steps: Sequence = (),
                            elem_bytes: Optional[int] = None, hierarchical_a2a: bool = False) -> OpGraph:
    """One FlexMoE iteration (module doc). ``holders[j]``: MoE layer j's holders per expert (default: those
    of ``placement``, else EP, for every layer); ``steps[j]``: the steps executed before this forward
    (``[kind, e, src, dst]``; empty: no migration)."""
    m = cfg.model
    topo = topology_of(cfg)
    N, E = topo.world_size, m.moe.num_experts
    L = len(moe_layer_ids(m))
    base = placement or Placement.expert_parallel(E, N)
    holders = [canonical(h) for h in (holders if holders is not None else [base.holders] * L)]
    steps = list(steps) or [[] for _ in range(L)]
    if len(holders) != L or len(steps) != L:
        raise ValueError(f"need holders and steps for {L} MoE layers, got {len(holders)} and {len(steps)}")
    pls = [Placement(E, N, h, base.rule) for h in holders]
    loads = np.asarray(loads, dtype=np.int64)
    routes = [route_matrix(pl, ld) for pl, ld in zip(pls, loads)]
    eb = elem_bytes or elem_bytes_of(cfg)
    numel = expert_param_count(m)
    mig = migration_matrix(holders, steps, N, 3 * numel * eb)
    first = moe_layer_ids(m)[0]

    def beside_attention(ctx, i, phase, deps):
        if i != first or phase != "fwd" or not mig.any():
            return None
        op = ctx.g.transfer("flexmoe.migrate", ctx.ranks, costs.alltoall_demands(mig, ctx.ranks, ctx.topo, profile),
                            deps=tuple(deps), category="migrate", phase="migrate",
                            comm={"op": "all_to_all", "group": ctx.ranks, "splits": mig})
        return [op] * N

    moe_forward, moe_backward = token_stages(routes)

    g, ctx, prev = transformer_iteration_graph(cfg, profile, loads, pls[0], moe_forward, moe_backward,
                                               elem_bytes=eb, hierarchical_a2a=hierarchical_a2a,
                                               meta={"strategy": "flexmoe"}, beside_attention=beside_attention)
    nbytes = numel * eb
    for i, h in zip(moe_layer_ids(m), holders):
        for e, group in enumerate(h):
            if len(group) > 1:
                prev = (g.transfer(f"L{i}.e{e}.replica_allreduce", list(group),
                                   [costs.ring_demand("all_reduce", list(group), topo, profile, nbytes)],
                                   deps=prev, category="replica_sync", layer=i, phase="sync",
                                   comm={"op": "all_reduce", "group": list(group), "nbytes": nbytes}),)
    return g


def flexmoe_sim_plan(cfg, records) -> dict:
    """One iteration's plan records (every MoE layer, in order) -> the graph's ``holders`` and ``steps``."""
    recs = [r["flexmoe"] for r in records]
    return {"holders": [r["holders"] for r in recs], "steps": [r["steps"] for r in recs]}
