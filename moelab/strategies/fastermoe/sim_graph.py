"""The simulator's op graph of one FasterMoE training iteration (``moelab.sim`` executor of the same
plan the runtime runs): the ``sim_graph`` of the ``fastermoe`` :class:`~moelab.registry.Strategy`.

The model skeleton is :func:`moelab.sim.graphs.transformer_iteration_graph` (attention, gate,
count exchange, MoE, head, backward, one dense all-reduce), shared with the EP graph; the MoE
layers (its hooks) follow
:class:`~moelab.strategies.fastermoe.layer.FasterMoELayer` op for op:

- the shadow set per layer is the runtime's: ``shadow_force``, or :func:`.shadow.select_shadows`
  on that layer's load matrix with the strategy options' constants (pure: same answer);
- plain path, forward: dispatch all-to-all (non-shadowed tokens), experts, combine all-to-all, then
  per shadowed expert a broadcast from its owner and the local shadow compute; backward: shadow
  backward compute and one reduce per shadowed expert, then the two all-to-alls and the experts;
- smart path: per step ``s`` a globally aligned exchange ``S_s`` on the comm stream (the step's
  flows only), ``C_s`` on the compute stream, ``R_s`` on the comm stream after ``C_s``; comm
  order ``S_0..S_{G-1}, bcast|reduce(S), R_0..R_{G-1}`` as on the runtime's comm thread.

Bytes: every transfer carries the record the runtime's communicator writes, so
:func:`moelab.sim.graphs.graph_bytes` equals the measured bytes, op by op (the smart schedule's
steps are ``p2p`` batches with the step's per-peer splits, as ``Communicator.exchange`` records them).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm import costs
from moelab.placement import Placement
from moelab.sim.compose import Contribution, composed_graph
from moelab.sim.engine import OpGraph
from moelab.sim.graphs import expert_param_count, route_matrix, topology_of
from moelab.strategies.fastermoe.options import FasterMoEOptions
from moelab.strategies.fastermoe.schedule import check_group_size, send_peers
from moelab.strategies.fastermoe.shadow import select_shadows


def shadow_sets(cfg, loads, options: Optional[FasterMoEOptions] = None) -> list:
    """The shadow set of every MoE layer for one iteration's ``loads[layer][src][expert]``."""
    o = options or FasterMoEOptions.from_dict(cfg.parallel.strategy_options)
    m = cfg.model
    out = []
    for L in np.asarray(loads):
        if o.shadow_force is not None:
            out.append(tuple(o.shadow_force))
        elif o.shadow:
            out.append(select_shadows(L, h=o.shadow_d_model or m.d_model, h_ff=o.shadow_d_ff or m.d_ff,
                                      P=o.shadow_gpu_flops, W_net=o.shadow_net_bw, s=o.shadow_elem_bytes,
                                      c=o.shadow_comm_factor, max_shadow=o.shadow_max, exact=o.shadow_exact))
        else:
            out.append(())
    return out


def fastermoe_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                              elem_bytes: Optional[int] = None, options: Optional[FasterMoEOptions] = None,
                              shadows: Optional[list] = None) -> OpGraph:
    """One FasterMoE training iteration (:func:`fastermoe_contribution` on the skeleton)."""
    part = fastermoe_contribution(cfg, profile, loads, placement, options=options, shadows=shadows)
    return composed_graph(cfg, profile, loads, placement, [part], elem_bytes=elem_bytes)


def fastermoe_contribution(cfg, profile, loads, placement: Optional[Placement] = None, *,
                           options: Optional[FasterMoEOptions] = None, shadows: Optional[list] = None) -> Contribution:
    """FasterMoE's placement in the skeleton: it owns the token path (shadowed experts broadcast and
    reduced, the rest dispatched; the smart schedule's steps when on)."""
    moe = cfg.model.moe
    o = options or FasterMoEOptions.from_dict(cfg.parallel.strategy_options)
    N, E = topology_of(cfg).world_size, moe.num_experts
    placement = placement or Placement.expert_parallel(E, N)
    if not placement.is_trivial:
        raise ValueError("fastermoe runs on plain expert parallelism (no placement replicas)")
    if moe.dispatcher != "sparse":
        raise ValueError("fastermoe builds on the sparse dispatcher")
    E_local = E // N
    loads = np.asarray(loads, dtype=np.int64)
    shadows = shadows if shadows is not None else shadow_sets(cfg, loads, o)
    Gs = min(o.group_size, N)
    G = check_group_size(N, Gs) if o.smart else 1
    routes, local_sh = [], []
    for j in range(loads.shape[0]):
        L = loads[j].copy()
        S = list(shadows[j])
        local_sh.append(L[:, S].sum(1) if S else np.zeros(N, dtype=np.int64))
        L[:, S] = 0
        routes.append(route_matrix(placement, L))
    ranks = list(range(N))

    def bcast(ctx, name, e, deps, layer, op):
        root, p_bytes = e // E_local, expert_param_count(cfg.model) * ctx.eb
        return ctx.g.transfer(name, ranks, [costs.broadcast_demand(ranks, root, ctx.topo, profile, p_bytes, op=op)],
                              deps=deps, category="shadow", layer=layer, phase="fwd" if op == "broadcast" else "bwd",
                              comm={"op": op, "group": ranks, "nbytes": p_bytes, "root": root})

    def step_matrix(route, st):
        M = np.zeros_like(route)
        for src in ranks:
            for dst in send_peers(src, st, N, Gs):
                M[src, dst] = route[src, dst]
        return M

    def moe_forward(ctx, i, j, deps):
        route, S, g = routes[j], list(shadows[j]), ctx.g
        if not o.smart:
            recv = route.sum(0)
            disp = ctx.a2a(f"L{i}.dispatch", route, deps, i, "fwd")
            exps = [ctx.experts(r, f"L{i}.experts.fwd", recv[r], (disp,), i, "fwd") for r in ranks]
            prev = [ctx.a2a(f"L{i}.combine", route.T, exps, i, "fwd")] * N
            for e in S:  # one thread: broadcast e, compute e, broadcast the next ...
                bc = bcast(ctx, f"L{i}.shadow{e}.bcast", e, prev, i, "broadcast")
                prev = [ctx.experts(r, f"L{i}.shadow{e}.fwd", loads[j][r, e], (bc,), i, "fwd") for r in ranks]
            return prev
        mats = [step_matrix(route, st) for st in range(G)]
        s_ops = [ctx.a2a(f"L{i}.S{st}", mats[st], deps if st == 0 else (), i, "fwd", op="p2p") for st in range(G)]
        bcs = [bcast(ctx, f"L{i}.shadow{e}.bcast", e, (), i, "broadcast") for e in S]
        ends = []
        for st in range(G):
            rc = mats[st].sum(0)
            cs = [ctx.experts(r, f"L{i}.C{st}.fwd", rc[r], (s_ops[st],), i, "fwd") for r in ranks]
            ends.append(ctx.a2a(f"L{i}.R{st}", mats[st].T, cs, i, "fwd", op="p2p"))
        tails = [ctx.experts(r, f"L{i}.shadow.fwd", local_sh[j][r], (bcs[-1],), i, "fwd") if S else None
                 for r in ranks]
        return [g.add(f"L{i}.moe.done", r, category="other", kind="compute",
                      deps=tuple(x for x in (ends[-1], tails[r]) if x is not None)) for r in ranks]

    def moe_backward(ctx, i, j, deps):
        route, S, g = routes[j], list(shadows[j]), ctx.g
        if not o.smart:
            recv = route.sum(0)
            prev = list(deps)
            for e in S:  # one thread: private backward of e, reduce e, the next ...
                cb = [ctx.experts(r, f"L{i}.shadow{e}.bwd", loads[j][r, e], (prev[r],), i, "bwd") for r in ranks]
                prev = [bcast(ctx, f"L{i}.shadow{e}.reduce", e, cb, i, "reduce")] * N
            comb_b = ctx.a2a(f"L{i}.combine.bwd", route, prev, i, "bwd")
            exps = [ctx.experts(r, f"L{i}.experts.bwd", recv[r], (comb_b,), i, "bwd") for r in ranks]
            return [ctx.a2a(f"L{i}.dispatch.bwd", route.T, exps, i, "bwd")] * N
        mats = [step_matrix(route, st) for st in range(G)]
        s_ops = [ctx.a2a(f"L{i}.S{st}.bwd", mats[st], deps if st == 0 else (), i, "bwd", op="p2p") for st in range(G)]
        reds, prev = [], list(deps)
        for e in S:  # compute thread: private backward of e; comm thread: its reduce (after the S steps)
            cb = [ctx.experts(r, f"L{i}.shadow{e}.bwd", loads[j][r, e], (prev[r],), i, "bwd") for r in ranks]
            reds.append(bcast(ctx, f"L{i}.shadow{e}.reduce", e, cb, i, "reduce"))
            prev = cb
        ends = []
        for st in range(G):
            rc = mats[st].sum(0)
            cs = [ctx.experts(r, f"L{i}.C{st}.bwd", rc[r], (s_ops[st],), i, "bwd") for r in ranks]
            ends.append(ctx.a2a(f"L{i}.R{st}.bwd", mats[st].T, cs, i, "bwd", op="p2p"))
        return [g.add(f"L{i}.moe.bwd.done", r, category="other", kind="compute",
                      deps=tuple([ends[-1]] + ([reds[-1]] if reds else []))) for r in ranks]

    return Contribution(token_path=lambda pls, lds: (moe_forward, moe_backward),
                        meta={"technique": "fastermoe", "strategy": "fastermoe", "shadows": [list(x) for x in shadows],
                              "smart": o.smart, "group_size": Gs if o.smart else None})


