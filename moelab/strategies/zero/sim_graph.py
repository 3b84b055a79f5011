"""The simulator's op graph of one ZeRO training iteration (``moelab.sim`` executor of the plan
:class:`~moelab.strategies.zero.update.ZeroUpdate` and :class:`~moelab.strategies.zero.layer.ZeroMoELayer`
run): the ``sim_graph`` of the ``zero`` :class:`~moelab.registry.Strategy`.

Compute: the EP skeleton of :func:`moelab.sim.graphs.ep_iteration_graph` (attention, gate, MoE or
dense FFN, tied head; backward 2x) except that an MoE layer has no count exchange and no
all-to-all: rank r runs all of its own token assignments ``loads[layer][r].sum()`` through the
experts locally (every rank holds every expert). The ``placement`` argument is ignored (ZeRO's is
full replication whatever the run's config says).

Communication (one flat buffer of ``S = Pp * elem_bytes`` bytes, ``Pp`` = every parameter of the
model - dense and all ``E`` experts - padded to a multiple of N, as the runtime pads), in the
runtime's order:

- stage 3: ``all_gather`` of the ``S/N`` shard before the first layer; with ``regather_backward``
  another one after the forward pass (the runtime's gradient hook on the model's output, before
  the head's backward); ``reduce_scatter`` of ``S`` after the backward;
- stages 1-2: ``reduce_scatter`` of ``S`` (stage 1 with ``grad_collective: all_reduce``: an
  ``all_reduce``) after the backward, then the ``all_gather`` of the updated shards;
- stage 0: one ``all_reduce`` of ``S``;
- with a balance loss, the ``all_reduce`` of the layers' first-choice counts after the forward pass
  (:func:`moelab.moe.layer.global_aux_losses`, before the stage-3 regather).

Every collective carries the runtime's record, so :func:`moelab.sim.graphs.graph_bytes` equals the
measured bytes exactly (the layer's count all-gather is metric traffic: unrecorded there, absent
here). The optimizer's own compute is not priced (as in the EP graph).

Memory (``SimResult.peak_memory``; [estimate] as the EP graph: Adam moments priced at 2 x 4 bytes
per element): params ``S`` (stages 0-2) or the shard ``S/N`` plus ``S`` while gathered (stage 3);
grads ``S`` resident (stages 0-1) or the shard plus a transient ``S`` from the start of backward to
the end of the gradient collective (stages 2-3); optimizer state over the rank's elements.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm import costs
from moelab.moe.layer import balance_allreduce_bytes
from moelab.placement import Placement
from moelab.sim.engine import OpGraph
from moelab.sim.graphs import dense_param_count, elem_bytes_of, expert_param_count, moe_layer_ids, topology_of
from moelab.strategies.zero.options import ZeroOptions
from moelab.strategies.zero.update import padded_numel


def zero_param_count(model) -> int:
    """Elements in ZeRO's flat buffer before padding: dense parameters + every expert of every MoE layer."""
    return dense_param_count(model) + len(moe_layer_ids(model)) * model.moe.num_experts * expert_param_count(model)


def zero_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                         elem_bytes: Optional[int] = None, options: Optional[ZeroOptions] = None) -> OpGraph:
    m, moe = cfg.model, cfg.model.moe
    o = options or ZeroOptions.from_dict(cfg.parallel.strategy_options)
    topo = topology_of(cfg)
    N, E, k = topo.world_size, moe.num_experts, moe.top_k
    eb = elem_bytes or elem_bytes_of(cfg)
    d, f, s, V = m.d_model, m.d_ff, m.seq_len, m.vocab_size
    T = cfg.train.batch_size * s
    moe_ids = moe_layer_ids(m)
    loads = np.asarray(loads, dtype=np.int64)
    if loads.shape != (len(moe_ids), N, E):
        raise ValueError(f"loads must be [moe_layers={len(moe_ids)}][ranks={N}][experts={E}], got {loads.shape}")
    Pp = padded_numel(zero_param_count(m), N)
    S, shard = Pp * eb, Pp // N * eb
    own = Pp if o.stage == 0 else Pp // N  # elements this rank's optimizer updates

    g = OpGraph(N, costs.link_capacities(profile, topo),
                meta={"strategy": "zero", "profile": profile.name, "topology": topo.describe(), "elem_bytes": eb,
                      "stage": o.stage, "regather_backward": o.regather_backward, "grad_op": o.grad_op,
                      "flat_bytes": S})
    ranks = list(range(N))
    ct = lambda flops: costs.compute_time(flops, profile)  # noqa: E731
    t_attn, t_gate = ct(costs.attention_flops(T, d, s)), ct(costs.gate_flops(T, d, E))
    t_ffn, t_head = ct(costs.ffn_flops(T, d, f)), ct(costs.head_flops(T, d, V))
    act_attn = T * (6 * d + m.n_heads * s) * eb  # [estimate] as the EP graph
    act_ffn_per_tok = (d + 2 * f) * eb
    assign = loads.sum(-1)  # [layer, rank]: token assignments each rank computes locally

    sharded_grads = o.stage >= 2
    last = [g.add("init", r, category="other", kind="compute",
                  alloc={"params": shard if o.stage == 3 else S, "grads": shard if sharded_grads else S,
                         "optimizer": 2 * own * 4}) for r in ranks]

    def collective(name, op, nbytes, deps, category, phase, alloc=None, free=None):
        return g.transfer(name, ranks, [costs.ring_demand(op, ranks, topo, profile, nbytes)], deps=deps,
                          category=category, phase=phase, alloc=alloc, free=free,
                          comm={"op": op, "group": ranks, "nbytes": nbytes})

    if o.stage == 3:
        last = [collective("params.allgather.fwd", "all_gather", shard, last, "allgather", "fwd",
                           alloc={"params": S})] * N
    # forward
    for i in range(m.n_layers):
        last = [g.compute(r, f"L{i}.attn.fwd", t_attn, deps=(last[r],), category="attention", layer=i,
                          phase="fwd", alloc={"activations": act_attn}) for r in ranks]
        if i in moe_ids:
            j = moe_ids.index(i)
            last = [g.compute(r, f"L{i}.gate.fwd", t_gate, deps=(last[r],), category="gate", layer=i,
                              phase="fwd", alloc={"activations": T * (E + k * d) * eb}) for r in ranks]
            last = [g.compute(r, f"L{i}.experts.fwd", ct(costs.ffn_flops(int(assign[j, r]), d, f)), deps=(last[r],),
                              category="expert", layer=i, phase="fwd",
                              alloc={"activations": int(assign[j, r]) * act_ffn_per_tok}) for r in ranks]
        else:
            last = [g.compute(r, f"L{i}.ffn.fwd", t_ffn, deps=(last[r],), category="ffn", layer=i, phase="fwd",
                              alloc={"activations": T * act_ffn_per_tok}) for r in ranks]
    regather = o.stage == 3 and o.regather_backward
    last = [g.compute(r, "head.fwd", t_head, deps=(last[r],), category="head", phase="fwd",
                      alloc={"activations": T * V * eb}, free={"params": S} if regather else None) for r in ranks]
    bal = balance_allreduce_bytes(moe, len(moe_ids), N)  # the global balance loss's counts (model's aux_loss)
    if bal:
        last = [collective("balance.allreduce", "all_reduce", bal, last, "balance", "fwd")] * N
    if regather:
        last = [collective("params.allgather.bwd", "all_gather", shard, last, "allgather", "bwd",
                           alloc={"params": S})] * N
    last = [g.compute(r, "head.bwd", 2 * t_head, deps=(last[r],), category="head", phase="bwd",
                      free={"activations": T * V * eb}, alloc={"grads": S} if sharded_grads else None) for r in ranks]
    # backward
    for i in reversed(range(m.n_layers)):
        if i in moe_ids:
            j = moe_ids.index(i)
            last = [g.compute(r, f"L{i}.experts.bwd", 2 * ct(costs.ffn_flops(int(assign[j, r]), d, f)),
                              deps=(last[r],), category="expert", layer=i, phase="bwd",
                              free={"activations": int(assign[j, r]) * act_ffn_per_tok}) for r in ranks]
            last = [g.compute(r, f"L{i}.gate.bwd", 2 * t_gate, deps=(last[r],), category="gate", layer=i,
                              phase="bwd", free={"activations": T * (E + k * d) * eb}) for r in ranks]
        else:
            last = [g.compute(r, f"L{i}.ffn.bwd", 2 * t_ffn, deps=(last[r],), category="ffn", layer=i,
                              phase="bwd", free={"activations": T * act_ffn_per_tok}) for r in ranks]
        last = [g.compute(r, f"L{i}.attn.bwd", 2 * t_attn, deps=(last[r],), category="attention", layer=i,
                          phase="bwd", free={"activations": act_attn}) for r in ranks]
    # gradient collective, then (stages 1-2) the all-gather of the updated shards
    free = {}
    if sharded_grads:
        free["grads"] = S
    if o.stage == 3:
        free["params"] = S
    if o.grad_op == "all_reduce":
        last = collective("grads.allreduce", "all_reduce", S, last, "allreduce", "sync", free=free or None)
    else:
        last = collective("grads.reduce_scatter", "reduce_scatter", S, last, "reduce_scatter", "sync",
                          free=free or None)
    if o.stage in (1, 2):
        collective("params.allgather", "all_gather", shard, (last,), "allgather", "sync")
    return g


