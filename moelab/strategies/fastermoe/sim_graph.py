"""The simulator's op graph of one FasterMoE training iteration (``moelab.sim`` executor of the same
plan the runtime runs): registered as ``register_graph("fastermoe", ...)`` when this package is
imported.

Same model skeleton as :func:`moelab.sim.graphs.ep_iteration_graph` (attention, gate, count
exchange, MoE, head, backward, one dense all-reduce); the MoE layers follow
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
:func:`moelab.sim.graphs.graph_bytes` equals the measured bytes - except that the smart schedule's
steps are recorded by the runtime as op ``p2p`` (``Communicator.exchange``) and here as
``all_to_all`` with the step's splits (``moelab.comm.bytes`` has no ``p2p`` op): same bytes per
peer and link class, another op name.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.placement import Placement
from moelab.sim import costs
from moelab.sim.engine import OpGraph
from moelab.sim.graphs import (dense_param_count, elem_bytes_of, expert_param_count, moe_layer_ids, register_graph,
                               route_matrix, topology_of)
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
    m, moe = cfg.model, cfg.model.moe
    o = options or FasterMoEOptions.from_dict(cfg.parallel.strategy_options)
    topo = topology_of(cfg)
    N, E, k = topo.world_size, moe.num_experts, moe.top_k
    placement = placement or Placement.expert_parallel(E, N)
    if not placement.is_trivial:
        raise ValueError("fastermoe runs on plain expert parallelism (no placement replicas)")
    if moe.dispatcher != "sparse":
        raise ValueError("fastermoe builds on the sparse dispatcher")
    E_local = E // N
    eb = elem_bytes or elem_bytes_of(cfg)
    d, f, s, V = m.d_model, m.d_ff, m.seq_len, m.vocab_size
    T = cfg.train.batch_size * s
    moe_ids = moe_layer_ids(m)
    loads = np.asarray(loads, dtype=np.int64)
    if loads.shape != (len(moe_ids), N, E):
        raise ValueError(f"loads must be [moe_layers={len(moe_ids)}][ranks={N}][experts={E}], got {loads.shape}")
    shadows = shadows if shadows is not None else shadow_sets(cfg, loads, o)
    Gs = min(o.group_size, N)
    G = check_group_size(N, Gs) if o.smart else 1
    routes, local_sh = [], []
    for j in range(len(moe_ids)):
        L = loads[j].copy()
        S = list(shadows[j])
        local_sh.append(L[:, S].sum(1) if S else np.zeros(N, dtype=np.int64))
        L[:, S] = 0
        routes.append(route_matrix(placement, L))
    n_exp = expert_param_count(m)
    p_bytes = n_exp * eb

    g = OpGraph(N, costs.link_capacities(profile, topo),
                meta={"strategy": "fastermoe", "profile": profile.name, "topology": topo.describe(),
                      "elem_bytes": eb, "shadows": [list(x) for x in shadows], "smart": o.smart,
                      "group_size": Gs if o.smart else None})
    ranks = list(range(N))
    ct = lambda flops: costs.compute_time(flops, profile)  # noqa: E731
    t_attn, t_gate = ct(costs.attention_flops(T, d, s)), ct(costs.gate_flops(T, d, E))
    t_ffn, t_head = ct(costs.ffn_flops(T, d, f)), ct(costs.head_flops(T, d, V))
    act_attn = T * (6 * d + m.n_heads * s) * eb
    act_ffn_per_tok = (d + 2 * f) * eb
    n_dense = dense_param_count(m)
    last = [g.add("init", r, category="other", kind="compute",
                  alloc={"params": (n_dense + E_local * n_exp) * eb, "grads": (n_dense + E_local * n_exp) * eb,
                         "optimizer": 2 * (n_dense + E_local * n_exp) * 4}) for r in ranks]

    def a2a(name, mat_tokens, deps, layer, phase):
        mat = mat_tokens * d * eb
        return g.transfer(name, ranks, costs.alltoall_demands(mat, ranks, topo, profile), deps=deps,
                          category="a2a", layer=layer, phase=phase,
                          comm={"op": "all_to_all", "group": ranks, "splits": mat})

    def bcast(name, e, deps, layer, op):
        root = e // E_local
        return g.transfer(name, ranks, [costs.broadcast_demand(ranks, root, topo, profile, p_bytes, op=op)],
                          deps=deps, category="shadow", layer=layer, phase="fwd" if op == "broadcast" else "bwd",
                          comm={"op": op, "group": ranks, "nbytes": p_bytes, "root": root})

    def step_matrix(route, st):
        M = np.zeros_like(route)
        for src in ranks:
            for dst in send_peers(src, st, N, Gs):
                M[src, dst] = route[src, dst]
        return M

    def moe_forward(i, j, deps):
        route, S = routes[j], list(shadows[j])
        recv = route.sum(0)
        if not o.smart:
            disp = a2a(f"L{i}.dispatch", route, deps, i, "fwd")
            exps = [g.compute(r, f"L{i}.experts.fwd", ct(costs.ffn_flops(int(recv[r]), d, f)), deps=(disp,),
                              category="expert", layer=i, phase="fwd",
                              alloc={"activations": int(recv[r]) * act_ffn_per_tok}) for r in ranks]
            prev = [a2a(f"L{i}.combine", route.T, exps, i, "fwd")] * N
            for e in S:  # one thread: broadcast e, compute e, broadcast the next ...
                bc = bcast(f"L{i}.shadow{e}.bcast", e, prev, i, "broadcast")
                prev = [g.compute(r, f"L{i}.shadow{e}.fwd", ct(costs.ffn_flops(int(loads[j][r, e]), d, f)),
                                  deps=(bc,), category="expert", layer=i, phase="fwd",
                                  alloc={"activations": int(loads[j][r, e]) * act_ffn_per_tok}) for r in ranks]
            return prev
        mats = [step_matrix(route, st) for st in range(G)]
        s_ops = [a2a(f"L{i}.S{st}", mats[st], deps if st == 0 else (), i, "fwd") for st in range(G)]
        bcs = [bcast(f"L{i}.shadow{e}.bcast", e, (), i, "broadcast") for e in S]
        ends = []
        for st in range(G):
            rc = mats[st].sum(0)
            cs = [g.compute(r, f"L{i}.C{st}.fwd", ct(costs.ffn_flops(int(rc[r]), d, f)), deps=(s_ops[st],),
                            category="expert", layer=i, phase="fwd",
                            alloc={"activations": int(rc[r]) * act_ffn_per_tok}) for r in ranks]
            ends.append(a2a(f"L{i}.R{st}", mats[st].T, cs, i, "fwd"))
        tails = []
        for r in ranks:
            dep = (bcs[-1],) if bcs else ()
            tails.append(g.compute(r, f"L{i}.shadow.fwd", ct(costs.ffn_flops(int(local_sh[j][r]), d, f)), deps=dep,
                                   category="expert", layer=i, phase="fwd",
                                   alloc={"activations": int(local_sh[j][r]) * act_ffn_per_tok}) if S else None)
        return [g.add(f"L{i}.moe.done", r, category="other", kind="compute",
                      deps=tuple(x for x in (ends[-1], tails[r]) if x is not None)) for r in ranks]

    def moe_backward(i, j, deps):
        route, S = routes[j], list(shadows[j])
        recv = route.sum(0)
        if not o.smart:
            prev = list(deps)
            for e in S:  # one thread: private backward of e, reduce e, the next ...
                cb = [g.compute(r, f"L{i}.shadow{e}.bwd", 2 * ct(costs.ffn_flops(int(loads[j][r, e]), d, f)),
                                deps=(prev[r],), category="expert", layer=i, phase="bwd",
                                free={"activations": int(loads[j][r, e]) * act_ffn_per_tok}) for r in ranks]
                prev = [bcast(f"L{i}.shadow{e}.reduce", e, cb, i, "reduce")] * N
            comb_b = a2a(f"L{i}.combine.bwd", route, prev, i, "bwd")
            exps = [g.compute(r, f"L{i}.experts.bwd", 2 * ct(costs.ffn_flops(int(recv[r]), d, f)), deps=(comb_b,),
                              category="expert", layer=i, phase="bwd",
                              free={"activations": int(recv[r]) * act_ffn_per_tok}) for r in ranks]
            return [a2a(f"L{i}.dispatch.bwd", route.T, exps, i, "bwd")] * N
        mats = [step_matrix(route, st) for st in range(G)]
        s_ops = [a2a(f"L{i}.S{st}.bwd", mats[st], deps if st == 0 else (), i, "bwd") for st in range(G)]
        reds, prev = [], list(deps)
        for e in S:  # compute thread: private backward of e; comm thread: its reduce (after the S steps)
            cb = [g.compute(r, f"L{i}.shadow{e}.bwd", 2 * ct(costs.ffn_flops(int(loads[j][r, e]), d, f)),
                            deps=(prev[r],), category="expert", layer=i, phase="bwd",
                            free={"activations": int(loads[j][r, e]) * act_ffn_per_tok}) for r in ranks]
            reds.append(bcast(f"L{i}.shadow{e}.reduce", e, cb, i, "reduce"))
            prev = cb
        ends = []
        for st in range(G):
            rc = mats[st].sum(0)
            cs = [g.compute(r, f"L{i}.C{st}.bwd", 2 * ct(costs.ffn_flops(int(rc[r]), d, f)), deps=(s_ops[st],),
                            category="expert", layer=i, phase="bwd",
                            free={"activations": int(rc[r]) * act_ffn_per_tok}) for r in ranks]
            ends.append(a2a(f"L{i}.R{st}.bwd", mats[st].T, cs, i, "bwd"))
        return [g.add(f"L{i}.moe.bwd.done", r, category="other", kind="compute",
                      deps=tuple([ends[-1]] + ([reds[-1]] if reds else []))) for r in ranks]

    for i in range(m.n_layers):
        last = [g.compute(r, f"L{i}.attn.fwd", t_attn, deps=(last[r],), category="attention", layer=i,
                          phase="fwd", alloc={"activations": act_attn}) for r in ranks]
        if i in moe_ids:
            j = moe_ids.index(i)
            gates = [g.compute(r, f"L{i}.gate.fwd", t_gate, deps=(last[r],), category="gate", layer=i,
                               phase="fwd", alloc={"activations": T * (E + k * d) * eb}) for r in ranks]
            cnt = g.transfer(f"L{i}.counts", ranks, [costs.ring_demand("all_gather", ranks, topo, profile, 8 * E)],
                             deps=gates, category="count_exchange", layer=i, phase="fwd",
                             comm={"op": "all_gather", "group": ranks, "nbytes": 8 * E})
            last = moe_forward(i, j, (cnt,))
        else:
            last = [g.compute(r, f"L{i}.ffn.fwd", t_ffn, deps=(last[r],), category="ffn", layer=i, phase="fwd",
                              alloc={"activations": T * act_ffn_per_tok}) for r in ranks]
    last = [g.compute(r, "head.fwd", t_head, deps=(last[r],), category="head", phase="fwd",
                      alloc={"activations": T * V * eb}) for r in ranks]
    last = [g.compute(r, "head.bwd", 2 * t_head, deps=(last[r],), category="head", phase="bwd",
                      free={"activations": T * V * eb}) for r in ranks]
    for i in reversed(range(m.n_layers)):
        if i in moe_ids:
            j = moe_ids.index(i)
            done = moe_backward(i, j, last)
            last = [g.compute(r, f"L{i}.gate.bwd", 2 * t_gate, deps=(done[r],), category="gate", layer=i,
                              phase="bwd", free={"activations": T * (E + k * d) * eb}) for r in ranks]
        else:
            last = [g.compute(r, f"L{i}.ffn.bwd", 2 * t_ffn, deps=(last[r],), category="ffn", layer=i,
                              phase="bwd", free={"activations": T * act_ffn_per_tok}) for r in ranks]
        last = [g.compute(r, f"L{i}.attn.bwd", 2 * t_attn, deps=(last[r],), category="attention", layer=i,
                          phase="bwd", free={"activations": act_attn}) for r in ranks]
    grad_bytes = n_dense * eb
    g.transfer("dense_grads.allreduce", ranks, [costs.ring_demand("all_reduce", ranks, topo, profile, grad_bytes)],
               deps=last, category="allreduce", phase="sync",
               comm={"op": "all_reduce", "group": ranks, "nbytes": grad_bytes})
    return g


register_graph("fastermoe", fastermoe_iteration_graph)
