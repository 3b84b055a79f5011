"""The simulator's op graph of one ``fsdp_expert`` iteration: the ``sim_graph`` of the strategy,
built on :func:`moelab.sim.graphs.transformer_iteration_graph` (attention, gate, tied head, mirror
backward, the dense all-reduce).

Per MoE layer ``i`` (``S`` = the layer's ``E × expert`` elements padded to a multiple of N, times
the element size, as the runtime pads), in the runtime's order:

- forward: after the gate, ``all_gather`` of the ``S/N`` shard (params +S), then rank r's experts on
  all of its own token assignments ``loads[i][r].sum()`` (no all-to-all); with
  ``reshard_after_forward`` the buffer is freed when the layer's forward ends (params -S);
- backward: with ``reshard_after_forward`` a second ``all_gather`` first; the experts' backward (local
  gradient +S), then the ``reduce_scatter`` of ``S`` (frees the local gradient and the buffer).

The count exchange of the skeleton is the layer's *unrecorded* metric gather here (``global_loads``),
or nothing: its op keeps its time (or none) but carries no byte record, so
:func:`moelab.sim.graphs.graph_bytes` equals the runtime's records exactly. ``placement`` is ignored
(every rank computes every expert). Memory [estimate]: parameters, gradients and Adam state start at
dense + one shard per layer (the skeleton's EP accounting, which is exactly that when E % N == 0).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm import costs
from moelab.placement import Placement
from moelab.sim.engine import OpGraph
from moelab.sim.graphs import elem_bytes_of, expert_param_count, moe_layer_ids, topology_of, transformer_iteration_graph
from moelab.strategies.fsdp_expert.options import FsdpExpertOptions


def layer_flat_bytes(model, N: int, elem_bytes: int) -> int:
    """S: one MoE layer's experts (``E × expert numel``) padded to a multiple of N, in bytes."""
    n = model.moe.num_experts * expert_param_count(model)
    return -(-n // N) * N * elem_bytes


def fsdp_expert_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                                elem_bytes: Optional[int] = None, options: Optional[FsdpExpertOptions] = None,
                                **_ignored) -> OpGraph:
    m = cfg.model
    o = options or FsdpExpertOptions.from_dict(cfg.parallel.strategy_options)
    topo = topology_of(cfg)
    N, E = topo.world_size, m.moe.num_experts
    eb = elem_bytes or elem_bytes_of(cfg)
    loads = np.asarray(loads, dtype=np.int64)
    S = layer_flat_bytes(m, N, eb)
    shard = S // N
    assign = loads.sum(-1)  # [layer, rank]: the rank's own token assignments, computed locally
    ranks = list(range(N))
    reshard = o.reshard_after_forward

    def collective(ctx, name, op, nbytes, deps, layer, phase, category, alloc=None, free=None):
        return ctx.g.transfer(name, ranks, [costs.ring_demand(op, ranks, ctx.topo, ctx.profile, nbytes)],
                              deps=deps, category=category, layer=layer, phase=phase, alloc=alloc, free=free,
                              comm={"op": op, "group": ranks, "nbytes": nbytes})

    def moe_forward(ctx, i, j, deps):
        ag = collective(ctx, f"L{i}.params.allgather", "all_gather", shard, deps, i, "fwd", "allgather",
                        alloc={"params": S})
        exps = [ctx.experts(r, f"L{i}.experts.fwd", assign[j, r], (ag,), i, "fwd") for r in ranks]
        if not reshard:
            return exps
        return [ctx.g.add(f"L{i}.params.free", r, kind="compute", category="other", deps=(exps[r],), layer=i,
                          phase="fwd", free={"params": S}) for r in ranks]

    def moe_backward(ctx, i, j, deps):
        if reshard:
            deps = [collective(ctx, f"L{i}.params.allgather.bwd", "all_gather", shard, deps, i, "bwd",
                               "allgather", alloc={"params": S})] * N
        exps = [ctx.experts(r, f"L{i}.experts.bwd", assign[j, r], (deps[r],), i, "bwd") for r in ranks]
        for r in ranks:
            ctx.g.ops[exps[r]].alloc = {**(ctx.g.ops[exps[r]].alloc or {}), "grads": S}
        return [collective(ctx, f"L{i}.grads.reduce_scatter", "reduce_scatter", S, exps, i, "bwd",
                           "reduce_scatter", free={"grads": S, "params": S})] * N

    g, ctx, prev = transformer_iteration_graph(
        cfg, profile, loads, Placement.expert_parallel(E, N), moe_forward, moe_backward, elem_bytes=eb,
        meta={"strategy": "fsdp_expert", "reshard_after_forward": reshard, "layer_flat_bytes": S,
              "moe_layers": len(moe_layer_ids(m))})
    for op in g.ops:  # the count gather: unrecorded metric traffic (global_loads) or none at all
        if op.category == "count_exchange":
            op.comm = None
            if not o.global_loads:
                op.links, op.duration = None, 0.0
    g.add("iteration.done", ranks, kind="compute", category="other", deps=prev)
    return g
