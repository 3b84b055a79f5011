"""Lina's training iteration for the simulator: the EP graph with the policy's dense-gradient sync.

The skeleton (:func:`moelab.sim.graphs.transformer_iteration_graph`) hands over its gradient-ready
points; this module turns them into the all-reduces each policy issues, on stream ``allreduce``:

- ``after_backward``: one all-reduce after backward (the skeleton's default);
- ``ddp_overlap``: DDP buckets (:func:`moelab.runtime.update.make_buckets`'s rule) as soon as full,
  sharing links fairly with the all-to-alls (free overlap);
- ``fixed``: the same buckets, each released at the next point between two MoE layers (after a
  layer's backward dispatch all-to-all);
- ``priority``: buckets at readiness, the all-to-all stream strictly first, a started bucket
  non-preemptive (:attr:`moelab.sim.engine.OpGraph.nonpreemptive`);
- ``lina``, ``lina_pipe``: the runtime's micro-ops (:func:`moelab.strategies.lina.update.micro_op_plan`),
  each a call paying the profile's per-call overhead, under the same priority rule; ``lina_pipe``
  also cuts each MoE layer's all-to-alls into ``a2a_chunks`` along the capacity, chunk j's experts
  running while chunk j+1 moves (:func:`pipelined_stages`, the runtime's
  :mod:`moelab.strategies.lina.pipeline`); ``lina_full`` also packs q experts per rank: all-to-alls
  inside blocks of E/q ranks, the copies' expert gradients all-reduced over the ranks holding them (the
  partitioned policies: as micro-ops queued when the layer's backward ends, as the runtime's hook does).

Every policy but ``after_backward`` issues its all-reduces beside backward's compute
(``beside_compute``: where the profile measured that, such a call pays a busy host's fixed costs).

``gamma`` (spec §2.4): where an all-to-all and an all-reduce both move on one link, each gets
1/gamma of its fair share (:meth:`moelab.sim.engine.OpGraph.interfere`; 1 = fair sharing, no worse).

The scheduled policies (``priority`` and the partitioned ones) also gate calls per rank
(:attr:`moelab.sim.engine.OpGraph.call_gate`): a started micro-op is not shared with the all-to-all
that arrives, the all-to-all waits for it (``a2a_waits_for_inflight``). Micro-op n starts after
micro-op n - ``max_inflight``, or, with ``drain_inflight``, after n - ``drain_inflight`` once the backward's
last gradient is ready (:attr:`moelab.sim.engine.OpGraph.any_of`). With ``launch_agreement: leader`` every
micro-op is preceded by its leader's go, a 1-element broadcast on the same stream (category ``scheduler``:
a call's fixed cost each; the leader's gate is priced as every rank's).

A pipelined layer's backward holds the gate from its first chunk's call to its last
(:attr:`moelab.sim.engine.OpGraph.gate_holds`), as the runtime's
:meth:`~moelab.strategies.lina.priority.PriorityScheduler.hold` (not under ``launch_agreement: plan``, nor without
the combine block).

``launch_agreement: plan`` (:mod:`moelab.strategies.lina.sim_windows`): no call gate; each micro-op launches once
the backward window it is planned in opens (the ones no window holds after the last backward all-to-all), each
backward all-to-all waits for its window's ops, and two small all-gathers agree on the plan after the drain; the
plan is the steady state of pricing, measuring the windows and planning again, as the runtime does step by step.

Not modelled: the combine-backward block (the DES knows the all-to-all's time, so nothing is launched
"just before" it by accident) and the bounded wait's releases
(a cross-rank race; the runtime pays one bound per stalled micro-op, ~1-3 a step in benchmarks/lina.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from moelab.comm import costs
from moelab.placement import Placement
from moelab.registry import get
from moelab.runtime.update import bucket_groups
from moelab.sim.compose import Contribution, composed_graph
from moelab.sim.graphs import (
    capacity,
    elem_bytes_of,
    moe_layer_ids,
    route_matrix,
    token_stages,
    topology_of,
)
from moelab.strategies.lina.pipeline import chunk_bounds
from moelab.strategies.lina.sim_windows import WindowLayout, steady_plan, window_of
from moelab.strategies.lina.update import micro_op_plan

A2A, AR = "comm", "allreduce"


def _units(ready, partitioned: bool, cap_bytes: float, part_bytes: float, eb: int, coalesce_bytes: float = 0.0):
    """``[(bytes, ready point index)]`` in issue order: DDP buckets or the runtime's micro-ops
    (:func:`moelab.strategies.lina.update.micro_op_plan`; packed experts' gradients on their own group)."""
    params = [(k, n) for k, (_, _, sizes) in enumerate(ready) for n in sizes]
    if partitioned:
        groups = [ready[k][0].endswith(".experts") for k, _ in params]
        plan = micro_op_plan([(n, eb) for _, n in params], groups, part_bytes, coalesce_bytes)
        return [(sum(b - a for _, a, b in op) * eb, params[op[-1][0]][0]) for op in plan]
    return [(sum(params[i][1] for i in b) * eb, params[b[-1]][0])
            for b in bucket_groups([n * eb for _, n in params], cap_bytes)]


def lina_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                         elem_bytes: Optional[int] = None, policy: Optional[str] = None,
                         partition_bytes: Optional[float] = None, bucket_mb: Optional[float] = None,
                         hierarchical_a2a: bool = False, gamma=1.0, windows: Optional[list] = None):
    """One training iteration under Lina's ``policy`` (default: the run's strategy options);
    ``hierarchical_a2a``: all-to-alls intra-node first, then across nodes (Tutel's 2D all-to-all);
    ``gamma``: the all-to-all / all-reduce interference factor (a number >= 1, or op -> number);
    ``windows`` (``launch_agreement: plan``): the micro-ops planned by the end of each backward window,
    cumulative (default: the plan's steady state, :func:`moelab.strategies.lina.sim_windows.steady_plan`)."""
    part = lina_contribution(cfg, profile, loads, placement, elem_bytes=elem_bytes, policy=policy,
                             partition_bytes=partition_bytes, bucket_mb=bucket_mb, hierarchical_a2a=hierarchical_a2a,
                             gamma=gamma, windows=windows)
    if part.steady is not None:
        return part.steady(lambda w: lina_iteration_graph(
            cfg, profile, loads, placement, elem_bytes=elem_bytes, policy=part.meta["policy"],
            partition_bytes=partition_bytes, bucket_mb=bucket_mb, hierarchical_a2a=hierarchical_a2a, gamma=gamma,
            windows=w))
    return composed_graph(cfg, profile, loads, placement, [part], elem_bytes=elem_bytes,
                          hierarchical_a2a=hierarchical_a2a)


def lina_contribution(cfg, profile, loads, placement: Optional[Placement] = None, *,
                      elem_bytes: Optional[int] = None, policy: Optional[str] = None,
                      partition_bytes: Optional[float] = None, bucket_mb: Optional[float] = None,
                      hierarchical_a2a: bool = False, gamma=1.0, windows: Optional[list] = None) -> Contribution:
    """Lina's schedule in the skeleton: the dense-gradient sync of ``policy`` (its buckets or micro-ops, the
    all-to-all stream first), the MoE backward wrapped to mark the points between layers, the interference
    factor; alone, also its token path (capacity-clipped rows; packed blocks, ``lina_pipe``'s chunks), a
    fallback a partner owning the dispatch chain replaces. ``launch_agreement: plan`` without ``windows``:
    only ``steady`` (the caller prices the plan to its steady state, rebuilding with ``windows``)."""
    import dataclasses

    cls = get("lina").options
    opts = cls.from_dict(cfg.parallel.strategy_options) if cfg.parallel.strategy == "lina" else cls()
    opts = dataclasses.replace(opts, policy=policy or opts.policy)
    policy = opts.policy
    planned = opts.scheduled and opts.launch_agreement == "plan"
    meta = {"technique": "lina", "strategy": "lina", "policy": policy, "hierarchical_a2a": hierarchical_a2a}
    if planned and windows is None:
        return Contribution(steady=steady_plan, meta=meta)
    S = partition_bytes or opts.partition_bytes
    cap_bytes = (bucket_mb or cfg.parallel.bucket_mb) * 2**20
    m, moe = cfg.model, cfg.model.moe
    topo = topology_of(cfg)
    N, E = topo.world_size, moe.num_experts
    q = opts.q
    inflight = opts.max_inflight if opts.scheduled else 1  # the scheduler's in-flight bound (DDP: 1)
    # in the drain after backward (no all-to-all can arrive): drain_inflight (fixed mode's drain is ungated anyway)
    drain_inflight = opts.drain_bound if opts.scheduled and policy != "fixed" else inflight
    streams = ar_streams(drain_inflight)
    placement = opts.placement(N, E) if q > 1 else (placement or Placement.expert_parallel(E, N))
    eb = elem_bytes or elem_bytes_of(cfg)
    loads = np.asarray(loads, dtype=np.int64)
    cap = capacity(cfg)
    P = E // q  # ranks per expert block (N when nothing is packed)
    if moe.dispatcher == "dense":
        block = np.arange(N) // P
        per = np.where(block[:, None] == block[None, :], (E // P) * cap, 0).astype(np.int64)
        routes = [per.copy() for _ in range(loads.shape[0])]
    else:
        routes = [route_matrix(placement, np.minimum(L, cap) if cap is not None else L) for L in loads]
    if opts.pipelined:
        if moe.dispatcher != "dense":
            raise ValueError("lina_pipe pipelines the dense dispatcher's capacity buffer")
        m_chunks = opts.a2a_chunks
        fwd, bwd = pipelined_stages(routes, [b - a for a, b in chunk_bounds(cap, min(m_chunks, cap))], cap,
                                    hold=opts.holds_pipelined_backward)
    else:
        fwd, bwd = token_stages(routes)
    between: list = []  # op ids of each MoE layer's backward dispatch all-to-all (between two MoE layers)
    moe_done: dict = {}  # "L{i}.gate" (the layer's gate ready point) -> its MoE backward's last ops per rank
    expert_groups = [list(range(pos, N, P)) for pos in range(P)]  # one expert-dp group per block position
    # a packed layer's expert gradients in the runtime's reverse parameter order (b2, b1, w2, w1)
    expert_sizes = [q * n for n in ([m.d_model, m.d_ff] if moe.expert_bias else [])
                                   + [m.d_ff * m.d_model, m.d_model * m.d_ff]]

    def moe_backward(inner, ctx, i, j, deps):
        out = inner(ctx, i, j, deps)
        between.append(max(out))
        moe_done[f"L{i}.gate"] = list(out)
        return out

    def with_packed_experts(ready):
        """The partitioned policies queue packed experts' gradients from the same hook as the dense ones:
        a ready point per MoE layer, when its backward ends, before its gate's (reverse parameter order)."""
        out = []
        for name, deps, sizes in ready:
            if name in moe_done:
                out.append((name.replace(".gate", ".experts"), moe_done[name], expert_sizes))
            out.append((name, deps, sizes))
        return out

    def dense_sync(ctx, ready):
        g, ranks = ctx.g, ctx.ranks
        hooked_experts = q > 1 and opts.partitioned
        if hooked_experts:
            ready = with_packed_experts(ready)
        if policy == "after_backward":
            units = [(sum(n for _, _, sizes in ready for n in sizes) * eb, len(ready) - 1)]
        else:
            units = _units(ready, opts.partitioned, cap_bytes, S, eb, opts.coalesce_bytes)
        if opts.scheduled and policy != "fixed":  # strict priority of the all-to-alls
            g.stream_priority[A2A] = 1
            g.nonpreemptive.update(streams)
            # ... decided per rank and call, as the scheduler does: no micro-op starts while an all-to-all
            # waits or runs on one of its ranks, an arriving all-to-all waits for the ones in flight
            low = set(streams) | {AR}
            if not planned:  # a plan decides the launches instead (below)
                g.call_gate = ({A2A, f"{A2A}.software"}, low | {f"{x}.software" for x in low},
                               opts.a2a_waits_for_inflight)
        if planned:  # the backward all-to-alls close the windows: each as issued, before it waits for a plan
            layout = g.meta["window_layout"] = WindowLayout(opens=list(ready[0][1]))
            layout.calls = [(c, tuple(dict.fromkeys(d for h in g.call_heads[c] for d in g.ops[h].deps)))
                            for c in g.call_heads if g.ops[c].stream == A2A and g.ops[c].meta.get("phase") == "bwd"]
            if opts.pipelined:  # a call after another of its layer's backward: issued while that one is in flight
                layer = [g.ops[c].meta.get("layer") for c, _ in layout.calls]
                layout.inner = {w for w in range(1, len(layer)) if layer[w] == layer[w - 1]}
        issued: list = []  # per unit, its ops
        leader = opts.scheduled and opts.launch_agreement == "leader"
        for n, (nbytes, k) in enumerate(units):
            deps = list(ready[k][1])
            if policy == "fixed":
                later = [b for b in between if b > max(ready[k][1])]
                if later:
                    deps.append(min(later))
            if planned:  # launched once its window opens; unplanned: after the last backward call (none: the drain)
                w = window_of(windows, n)
                if w is None:
                    deps += [layout.calls[-1][0]] if windows and layout.calls else list(ready[-1][1])
                elif w > 0:
                    deps.append(layout.calls[w - 1][0])
            if n >= len(streams):  # a rank's queue: at most max_inflight at once, unit n after unit n - max_inflight
                deps += issued[n - len(streams)]
            groups = expert_groups if ready[k][0].endswith(".experts") else [ranks]
            if drain_inflight > inflight and n >= inflight:  # n - max_inflight has ended, or the drain began
                go = g.add(f"grad.{policy}.{n}.go", ranks, stream="allreduce.go", deps=deps, category="scheduler")
                g.any_of[go] = (issued[n - inflight], tuple(ready[-1][1]))
                deps = [go]
            ops, stream = [], streams[n % len(streams)]
            for gi, grp in enumerate(groups):
                name, d = f"grad.{policy}.{n}" + (f".g{gi}" if len(groups) > 1 else ""), deps
                if leader:  # the leader's go: a 1-element broadcast on the group's control group, then the op
                    d = [g.transfer(f"{name}.lead", grp, [costs.broadcast_demand(grp, grp[0], ctx.topo, profile, 4)],
                                    deps=deps, category="scheduler", stream=stream, phase="sync", beside_compute=True,
                                    comm={"op": "broadcast", "group": grp, "nbytes": 4})]
                ops.append(g.transfer(name, grp, [costs.ring_demand("all_reduce", grp, ctx.topo, profile, nbytes)],
                                      deps=d, category="allreduce", stream=stream, phase="sync",
                                      beside_compute=policy != "after_backward",
                                      comm={"op": "all_reduce", "group": grp, "nbytes": nbytes}))
            issued.append(tuple(ops))
        last = tuple(x for ops in issued[-len(streams):] for x in ops) or tuple(ready[-1][1])
        if planned:
            last = planned_windows(ctx, layout, windows, issued, [ready[k][1] for _, k in units], last)
        return packed_expert_sync(ctx, last) if q > 1 and not hooked_experts else last

    def packed_expert_sync(ctx, deps):
        """Packed experts under the bucketed policies: each copy's gradients all-reduced over the ranks
        holding the same experts, after backward, on the same low-priority stream (layer by layer)."""
        g = ctx.g
        ends = list(deps)
        for i in moe_layer_ids(m):
            if opts.scheduled:  # fixed, priority: one op per tensor, as the queue sends them
                units = [n * eb for n in expert_sizes]
            else:
                units = [sum(expert_sizes) * eb]  # the core updates: one flat all-reduce per layer
            for n, nbytes in enumerate(units):  # a rank's stream keeps them in order
                for pos, grp in enumerate(expert_groups):  # side by side
                    ends.append(g.transfer(f"L{i}.experts.grad.{n}.g{pos}", grp,
                                           [costs.ring_demand("all_reduce", grp, ctx.topo, profile, nbytes)],
                                           deps=tuple(deps), category="allreduce", stream=AR, phase="sync", layer=i,
                                           comm={"op": "all_reduce", "group": grp, "nbytes": nbytes}))
        return tuple(ends)

    def finish(g):
        if callable(gamma) or gamma != 1.0:
            g.interfere((A2A, streams), gamma)

    return Contribution(placements=[placement] * loads.shape[0] if q > 1 else None,
                        token_path=lambda pls, lds: (fwd, bwd), owns_token_path=False,
                        wrap_backward=lambda inner: functools.partial(moe_backward, inner), dense_sync=dense_sync,
                        finish=finish, meta=meta)


def planned_windows(ctx, layout, windows, issued, ready_ops, last) -> tuple:
    """``launch_agreement: plan``: each backward all-to-all waits for the micro-ops planned in its window
    (ended, as the runtime's call waits for them), and after the drain two small all-gathers over every rank
    agree on the next step's plan (the windows' free times and queued counts, the ops' durations); returns
    the iteration's last ops."""
    g, planned = ctx.g, {}
    for n, ops in enumerate(issued):  # window -> the ops planned in it
        w = window_of(windows, n)
        if w is not None:
            planned.setdefault(w, []).extend(ops)
    for w, ops in planned.items():
        g.also_after(layout.calls[w][0], ops)
    layout.units = [(tuple(ops), list(r)) for ops, r in zip(issued, ready_ops)]
    ranks = ctx.ranks
    for name, nbytes in (("shape", 16), ("data", 8 * (2 * len(layout.calls) + len(issued)))):
        last = (g.transfer(f"lina_plan.{name}", ranks,
                           [costs.ring_demand("all_gather", ranks, ctx.topo, ctx.profile, nbytes)], deps=last,
                           category="scheduler", phase="sync",
                           comm={"op": "all_gather", "group": ranks, "nbytes": nbytes}),)
    return last


def ar_streams(inflight: int) -> tuple:
    """The all-reduce streams of a rank whose scheduler keeps ``inflight`` micro-ops in flight: one
    serial stream each (``allreduce``, ``allreduce.1``, ...), micro-ops dealt round-robin."""
    return (AR,) + tuple(f"{AR}.{i}" for i in range(1, inflight))


def pipelined_stages(routes, chunks, cap, hold: bool = True):
    """The token path of :func:`moelab.sim.graphs.token_stages` cut into all-to-all micro-ops of
    ``chunks[j]`` capacity rows each: dispatch j+1 in flight while experts compute chunk j, combine j
    issued when it is done; backward mirrors it (combine gradient first, 2x expert compute). Every
    chunk's all-to-all but the first dispatch and the last combine is issued beside expert compute.
    ``hold``: the backward holds the call gate from its first chunk's call to its last (where the runtime's
    scheduler does: :attr:`moelab.strategies.lina.options.LinaOptions.holds_pipelined_backward`)."""
    def stage(ctx, i, j, deps, phase):
        first, second = ("dispatch", "combine") if phase == "fwd" else ("combine.bwd", "dispatch.bwd")
        parts = [routes[j] * c // cap for c in chunks]
        moves = [ctx.a2a(f"L{i}.{first}.c0", parts[0], tuple(deps), i, phase)]
        outs, last = [], len(parts) - 1
        for n, part in enumerate(parts):  # issue order as the runtime: d0, d1, c0, d2, c1, ...
            if n + 1 < len(parts):  # moves while chunk n's experts compute
                moves.append(ctx.a2a(f"L{i}.{first}.c{n + 1}", parts[n + 1], (moves[-1],), i, phase,
                                     beside_compute=True))
            rows = part.sum(0)
            exps = [ctx.experts(r, f"L{i}.experts.{phase}.c{n}", rows[r], (moves[n],), i, phase) for r in ctx.ranks]
            outs.append(ctx.a2a(f"L{i}.{second}.c{n}", part.T, exps, i, phase, beside_compute=n < last))
        if hold and phase == "bwd":  # the runtime's hold: no micro-op launches until the last chunk's call is issued
            ctx.g.gate_holds.append((moves[0], outs[-1]))
        return [outs[-1]] * len(ctx.ranks)  # one comm stream: the last combine ends last

    def moe_forward(ctx, i, j, deps):
        return stage(ctx, i, j, deps, "fwd")

    def moe_backward(ctx, i, j, deps):
        return stage(ctx, i, j, deps, "bwd")

    return moe_forward, moe_backward
