"""SmartMoE in the simulator: EP on each layer's permutation of the iteration, plus the migration all-to-all
(rows of 3 × expert: params + Adam moments) on a re-placement iteration, exactly as the runtime records it;
and the policy replayed over a load trace (:func:`smartmoe_replay`) for paper-scale figures."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from moelab.comm import costs
from moelab.placement import Placement
from moelab.placement.rebalance import smartmoe_round
from moelab.sim.compose import Contribution, composed_graph
from moelab.sim.graphs import (
    elem_bytes_of,
    expert_param_count,
    route_matrix,
    token_stages,
    topology_of,
)


def smartmoe_contribution(cfg, profile, loads, placement: Optional[Placement] = None, *, owners=None,
                          moved: Sequence = (), elem_bytes: Optional[int] = None) -> Contribution:
    """SmartMoE's placement in the skeleton: each layer's permutation of the iteration (``owners``), and the
    migration all-to-all after the dense sync on a re-placement iteration (``moved``)."""
    m = cfg.model
    topo = topology_of(cfg)
    N, E = topo.world_size, m.moe.num_experts
    L = np.asarray(loads).shape[0]
    owners = owners if owners is not None else [[e // (E // N) for e in range(E)]] * L
    pls = [Placement(E, N, tuple((int(o),) for o in row)) for row in owners]
    eb = elem_bytes or elem_bytes_of(cfg)

    def after(g, ctx, prev):
        if not moved:
            return prev
        M = np.zeros((N, N), dtype=np.int64)
        for _, _, s, d in moved:
            M[int(s), int(d)] += 3 * expert_param_count(m) * eb
        ranks = list(range(N))
        return (g.transfer("smartmoe.migrate", ranks, costs.alltoall_demands(M, ranks, topo, profile), deps=prev,
                           category="migrate", phase="migrate",
                           comm={"op": "all_to_all", "group": ranks, "splits": M}),)

    return Contribution(placements=pls, after=after, meta={"technique": "smartmoe"})


def smartmoe_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *, owners=None,
                             moved: Sequence = (), elem_bytes: Optional[int] = None, hierarchical_a2a: bool = False):
    part = smartmoe_contribution(cfg, profile, loads, placement, owners=owners, moved=moved, elem_bytes=elem_bytes)
    part.token_path = lambda pls, lds: token_stages([route_matrix(pl, ld) for pl, ld in zip(pls, lds)])
    return composed_graph(cfg, profile, loads, placement, [part], elem_bytes=elem_bytes or elem_bytes_of(cfg),
                          hierarchical_a2a=hierarchical_a2a, meta={"strategy": "smartmoe"})


def smartmoe_sim_plan(cfg, records) -> dict:
    recs = [r["smartmoe"] for r in records]
    return {"owners": [r["owners"] for r in recs], "moved": [(j, *mv) for j, r in enumerate(recs) for mv in r["moved"]]}


def smartmoe_replay(trace, *, K: int, window: int, cost, N: int, decision: str = "cost") -> tuple:
    """``(plans, note)``: per iteration of ``trace`` ``[iters, L, N, E]`` the graph's ``owners``/``moved``, the
    same round as :class:`.update.SmartMoEUpdate` (every K iterations, from the previous ``window`` iterations)."""
    trace = np.asarray(trace, dtype=np.int64)
    iters, L, _, E = trace.shape
    owners = [[e // (E // N) for e in range(E)] for _ in range(L)]
    hist, plans, applied, rejected = [], [], 0, 0
    for it in range(iters):
        moved = []
        if it > 0 and it % K == 0 and hist:
            rnd = smartmoe_round(owners, np.sum(hist, axis=0, dtype=np.int64), K, cost, N, decision, len(hist))
            for li, (new, status, _, _) in enumerate(rnd):
                moved += [(li, e, owners[li][e], new[e]) for e in range(E) if new[e] != owners[li][e]]
                applied += status == "applied"
                rejected += status == "rejected"
            owners = [list(r[0]) for r in rnd]
        plans.append(dict(owners=[list(o) for o in owners], moved=moved))
        hist.append(trace[it])
        del hist[:-window]
    return plans, f"K={K}; layer re-placements applied: {applied}, rejected by the cost model: {rejected}"
