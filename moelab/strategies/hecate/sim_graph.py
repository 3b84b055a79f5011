"""Hecate in the simulator: one training iteration priced from the plan the runtime executes (or a replay
of the same policies at paper scale, :mod:`moelab.papers.hecate.replay`).

Per MoE layer ``j``: tokens go to the final P' (``holders[j]``) by Hecate's rule (LocalityFirst); the
prefetch gather spAG(P, P'_prefetch) runs on the ``sparse`` stream beside attention_j's forward (the
gate waits for it, as the layer waits before dispatch); an accepted calibration adds a blocking gather
of the added copies after the count exchange; spRS(P'_final, P) is issued when the layer's backward
ends and waited at the iteration's sync; the calibration policy's measured CPU time (a real run's records) is
compute on every rank before dispatch; with RM the layer's replicas are gathered again beside the
next layer's attention backward and waited before this layer's expert backward. A migration (Alg. 2)
is one all-to-all of ``3 × expert`` rows on all ranks. Bytes per peer are exactly the runtime's: the
transfers come from the same :class:`moelab.comm.sparse.SparsePlan` stages the runtime executes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from moelab.comm import costs
from moelab.comm.sparse import part_numel, sparse_plan
from moelab.placement import Placement
from moelab.placement.rules import LocalityFirst
from moelab.sim.graphs import (
    elem_bytes_of,
    expert_param_count,
    moe_layer_ids,
    token_stages,
    topology_of,
    transformer_iteration_graph,
)
from moelab.strategies.hecate.policy import homogeneous_owners


def _stage_matrices(P, Q, N: int, G: int, backend: str, numel: int, elem_bytes: int) -> list:
    """Byte matrices ``[src, dst]`` of the stages of spAG(P -> Q) (reverse and transpose for spRS)."""
    plan = sparse_plan(P, Q, 0, N, G)
    if plan.empty:
        return []
    out = []
    for st in plan.gather_stages(backend):
        M = np.zeros((N, N), dtype=np.int64)
        for s, d, _, part in st:
            M[s, d] += part_numel(numel, part, G) * elem_bytes
        out.append(M)
    return out


def _full(owners, extra) -> tuple:
    """Holders from owners plus ``{expert: [replica ranks]}``."""
    return tuple((int(o),) + tuple(sorted(int(r) for r in extra.get(str(e), extra.get(e, ()))))
                 for e, o in enumerate(owners))


def hecate_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *, holders=None, owners=None,
                           prefetch=None, moved: Sequence = (), rm: bool = False, backend: str = "a2a",
                           policy_s: Optional[Sequence[float]] = None, elem_bytes: Optional[int] = None,
                           hierarchical_a2a: bool = False, **_ignored):
    """The op graph of one Hecate iteration. ``owners[j]`` (P), ``prefetch[j]`` (P' gathered beside
    attention) and ``holders[j]`` (the final P' after calibration) per MoE layer, default EP / P;
    ``moved``: ``(layer, expert, src, dst)`` of this iteration's migration; ``rm``: re-materialization;
    ``policy_s[j]``: CPU seconds every rank spends in layer j's calibration policy before dispatch (measured
    in a real run; none in a replay)."""
    m, moe = cfg.model, cfg.model.moe
    topo = topology_of(cfg)
    N, E, G = topo.world_size, moe.num_experts, topo.ranks_per_node
    loads = np.asarray(loads, dtype=np.int64)
    L = loads.shape[0]
    eb = elem_bytes or elem_bytes_of(cfg)
    owners = [list(o) for o in owners] if owners is not None else homogeneous_owners(L, E, N)
    P = [tuple((int(o),) for o in row) for row in owners]
    final = [tuple(tuple(h) for h in hs) for hs in holders] if holders is not None else P
    pre = [tuple(tuple(h) for h in hs) for hs in prefetch] if prefetch is not None else final
    numel = expert_param_count(m)
    row = numel * eb
    routes = [Placement(E, N, final[j], LocalityFirst(G)).routes(loads[j]) for j in range(L)]
    ranks = list(range(N))
    moe_ids = moe_layer_ids(m)
    op = "p2p" if backend == "p2p" else "all_to_all"

    def collective(ctx, name, mats, deps, layer, phase, category, beside_compute=False):
        """Chained stages on the ``sparse`` stream; returns the last op (None if nothing moves).
        ``beside_compute``: the stages are issued while the ranks compute (spAG beside attention, spRS
        beside the backward before it), at the busy fixed costs where the profile has them."""
        last = None
        for k, M in enumerate(mats):
            last = ctx.g.transfer(f"{name}.{k}" if len(mats) > 1 else name, ranks,
                                  costs.alltoall_demands(M, ranks, ctx.topo, ctx.profile, False),
                                  deps=deps if last is None else (last,), category=category, stream="sparse",
                                  layer=layer, phase=phase, beside_compute=beside_compute,
                                  comm={"op": op if k == 0 or backend != "hier" else "all_to_all", "group": ranks,
                                        "splits": M})
        return last

    spag = [_stage_matrices(P[j], pre[j], N, G, backend, numel, eb) for j in range(L)]
    cal = [_stage_matrices(P[j], tuple(h[:1] + tuple(d for d in f[1:] if d not in h) for h, f in zip(pre[j], final[j])),
                           N, G, backend, numel, eb) if final[j] != pre[j] else [] for j in range(L)]
    sprs = [[M.T.copy() for M in reversed(_stage_matrices(P[j], final[j], N, G, backend, numel, eb))] for j in range(L)]
    has_rm = [bool(rm) and j < L - 1 and final[j] != P[j] for j in range(L)]
    rm_ops: dict = {}
    rs_ops: list = []

    def beside(ctx, i, phase, deps):
        j = moe_ids.index(i) if i in moe_ids else None
        if phase == "fwd" and j is not None and spag[j]:
            o = collective(ctx, f"L{i}.spag", spag[j], tuple(deps), i, "fwd", "spag", beside_compute=True)
            return [o] * N
        if phase == "bwd" and j is not None and j > 0 and has_rm[j - 1]:  # re-gather the layer below
            ip = moe_ids[j - 1]
            rm_ops[ip] = collective(ctx, f"L{ip}.spag_rm",
                                    _stage_matrices(P[j - 1], final[j - 1], N, G, backend, numel, eb),
                                    tuple(deps), ip, "bwd", "spag", beside_compute=True)
        return None

    stage_fwd, stage_bwd = token_stages(routes, lambda i: (rm_ops[i],) if i in rm_ops else ())

    def moe_forward(ctx, i, j, deps):
        if policy_s is not None and policy_s[j] > 0:  # every rank prices the calibration before it dispatches
            deps = tuple(ctx.g.compute(r, f"L{i}.calibrate_policy.{r}", policy_s[j], deps=tuple(deps), category="gate",
                                       layer=i, phase="fwd") for r in ranks)
        if cal[j]:  # an accepted calibration: a blocking gather of the added copies before dispatch
            deps = (collective(ctx, f"L{i}.calibrate", cal[j], deps, i, "fwd", "spag"),)
        return stage_fwd(ctx, i, j, deps)

    def moe_backward(ctx, i, j, deps):
        done = stage_bwd(ctx, i, j, deps)
        if sprs[j]:  # issued when the layer's backward ends, waited at the iteration's sync
            rs_ops.append(collective(ctx, f"L{i}.sprs", sprs[j], (done[0],), i, "bwd", "sprs", beside_compute=True))
        return done

    g, ctx, prev = transformer_iteration_graph(cfg, profile, loads, Placement.expert_parallel(E, N), moe_forward,
                                               moe_backward, elem_bytes=eb, hierarchical_a2a=hierarchical_a2a,
                                               meta={"strategy": "hecate", "rm": bool(rm), "backend": backend},
                                               beside_attention=beside)
    last = prev + tuple(rs_ops)
    if moved:
        M = np.zeros((N, N), dtype=np.int64)
        for _, _, s, d in moved:
            M[int(s), int(d)] += 3 * row
        last = (g.transfer("migrate", ranks, costs.alltoall_demands(M, ranks, topo, profile, False), deps=last,
                           category="migrate", phase="migrate",
                           comm={"op": "all_to_all", "group": ranks, "splits": M}),)
    g.add("iteration.done", ranks, kind="compute", category="other", deps=last)
    return g


def hecate_sim_plan(cfg, records) -> dict:
    """The graph's keyword arguments from one iteration's plan records (``layer.plan_record()["hecate"]``)."""
    recs = [r["hecate"] for r in records]
    if not recs:
        return {}
    owners = [r["owners"] for r in recs]
    return dict(owners=owners, holders=[tuple(tuple(h) for h in r["holders"]) for r in recs],
                prefetch=[_full(r["owners"], r["prefetch"]) for r in recs],
                moved=[(j, *mv) for j, r in enumerate(recs) for mv in r["moved"]],
                rm=any(r["rm"] for r in recs), backend=recs[0]["backend"],
                policy_s=[float(r.get("calibration_cpu_s", 0.0)) for r in recs])
