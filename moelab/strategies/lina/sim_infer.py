"""Lina's inference for the simulator: one batch of a serving run priced from routing traces (spec §2.4).

Input: a batch's traces ``[tokens, moe_layers]`` (the expert of every token at every MoE layer, from a
real model: :meth:`moelab.strategies.lina.server.LinaServer.prepare` or a served run's ``routing_traces.npy``) with the
rank each token sits on, and the path table fitted on the profiling split. Every (variant, layer)
plan comes from the same pure functions the runtime runs (:func:`.infer.choose_plan`); the
replica-aware split is :func:`moelab.strategies.lina.dispatch.route_table`. Per MoE layer the graph holds, on every
rank: attention and gate compute; the count exchange; phase 2 (``o_check`` when Lina compares and
keeps its plan, ``o_plan`` when it re-plans or plans from counts) and the swap of the experts it newly
puts on a rank (their bytes over ``h2d_GBps``), on the critical path; the dispatch all-to-all (bytes
from the split), the rank's experts one after another (``ffn_flops`` + a per-expert launch cost), the
combine all-to-all. Phase 1 of layer l (Lina, ``lina_no_finetune``) runs while layer l-1 does (spec
§2.4: ``T_p1 = max(0, o_plan - T_hide)``, swaps "if not prefetched"): ``o_plan`` on the rank's ``plan``
stream once layer l-1's count exchange, which carries the estimates (:func:`.infer.piggyback_bytes`), is
through, then the load of the experts phase 1 newly places on the rank's ``h2d`` stream; layer l's
experts wait for that load, so a plan or a load longer than layer l-1 shows. (The REAL serving path
does the same on a loader thread, :meth:`.infer.LinaServeLayer._phase1_issue`: plan and load beside
layer l-1's dispatch; on a CPU the load is a memory copy.)

Constants (data with sources, :data:`DEFAULT_OVERHEADS`; a caller passes its own in ``overheads``): the
scheduler's costs ``o_check_s`` and ``o_plan_s`` default to 0 - they are the caller's to state: Lina's
paper-scale reproduction (:mod:`moelab.papers.lina.serving_scale`) passes the paper's measured costs (§7.3,
"Overheads") from ``experiments/lina/assumptions.yaml`` (``o_check``, ``o_plan``), a prediction of a REAL
run times the run's own plans. ``h2d_GBps`` (swaps) and ``expert_launch_s`` default to generic GPU guesses
(the reproduction passes its assumptions file's ``h2d_GBps`` and ``expert_launch_us``). Compute is the
profile's (FLOP model at its achieved rate); ``host_layer_s`` (0 for the paper) is a REAL serving path's own
work per layer and rank beyond that model (the interpreter's gate and permutation), which a prediction of a
CPU run fits on held-out runs together with ``expert_launch_s`` (there the interpreter's cost per expert a
rank runs).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from moelab.comm import costs
from moelab.moe.dispatch import count_exchange_bytes
from moelab.sim.engine import simulate
from moelab.sim.graphs import new_graph
from moelab.strategies.lina.dispatch import route_table
from moelab.strategies.lina.infer import (
    choose_plan,
    estimates,
    phase1_plan,
    piggyback_bytes,
    schedules,
    static_placement,
)

DEFAULT_OVERHEADS = {  # name -> (default, where the default comes from); ``overheads`` arguments override them
    "o_check_s": (0.0, "none unless given: phase 2's check without a re-plan is the caller's to state (Lina's "
                       "reproduction passes the paper's, experiments/lina/assumptions.yaml o_check)"),
    "o_plan_s": (0.0, "none unless given: one scheduling round is the caller's to state (Lina's reproduction "
                      "passes the paper's, experiments/lina/assumptions.yaml o_plan)"),
    "h2d_GBps": (25.0, "[assumption] PCIe 4.0 x16 effective host-to-device bandwidth for expert swaps (Lina's "
                       "reproduction passes experiments/lina/assumptions.yaml h2d_GBps)"),
    "expert_launch_s": (20e-6, "[assumption] per-expert kernel launch on the GPU (Lina's reproduction passes "
                               "experiments/lina/assumptions.yaml expert_launch_us)"),
    "host_layer_s": (0.0, "[paper model] none: T_batch holds the layers' compute and transfers only"),
}


@dataclasses.dataclass
class InferShape:
    """A served model's shape; the defaults are generic (Lina's reproduction passes its assumptions file's)."""
    d_model: int = 512
    d_ff: int = 2048
    seq_len: int = 512
    elem_bytes: int = 2


def plans_for_batch(traces, src, variant: str, sv, table, N: int, E: int, seed: int = 0, batch: int = 0) -> list:
    """``[(devs, planned_from, replanned, counts [N, E], phase-1 devs or None)]`` per MoE layer of one
    batch, as the runtime decides them (phase 1 from the paths, phase 2 from the counts)."""
    t = np.asarray(traces, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    static = static_placement(N, E)
    sv = dataclasses.replace(sv, variant=variant)
    out = []
    for j in range(t.shape[1]):
        idx = t[:, j]
        if variant == "ideal":  # the runtime's balanced gate: a rank's i-th token to (i + rank * T) mod E
            local = np.zeros(len(idx), dtype=np.int64)
            for r in np.unique(src):
                mine = np.nonzero(src == r)[0]
                local[mine] = np.arange(len(mine)) + r * len(mine)
            idx = local % E
        counts = np.zeros((N, E), dtype=np.int64)
        np.add.at(counts, (src, idx), 1)
        pop = counts.sum(0) / max(1, counts.sum())
        scheduled = schedules(sv, j)
        pop_hat = None
        if estimates(sv, j):
            pop_hat = table.estimate(t[:, j - sv.path_len:j], j, sv.k_est)
        plan_seed = hash((seed, batch, j)) & 0x7FFFFFFF
        early = phase1_plan(sv, pop_hat, N, plan_seed) if pop_hat is not None else None  # phase 1, as loaded
        devs, how, replanned = choose_plan(sv, scheduled, pop, pop_hat, N, static, plan_seed, early)
        out.append((devs, how, replanned, counts, early))
    return out


def batch_graph(plans, profile, topo, shape: InferShape, overheads: dict = None, loaded=None, io=None):
    """The OpGraph of one batch from its per-layer plans; ``loaded[j][d]``: experts rank d held for
    layer j after the previous batch (updated in place: swaps persist across batches); ``io``: ``(bytes
    in, bytes out)`` of the REAL serving path's batch, rank 0's broadcast of the requests' tokens before
    the first layer and the all-gather of the answers after the last (None: the paper's T_batch, layers only)."""
    o = {k: v[0] for k, v in DEFAULT_OVERHEADS.items()} | dict(overheads or {})
    N = topo.world_size
    g = new_graph(profile, topo, meta={"profile": profile.name})
    ranks = list(range(N))
    ct = lambda f: costs.compute_time(f, profile)  # noqa: E731
    d, f, s, eb = shape.d_model, shape.d_ff, shape.seq_len, shape.elem_bytes
    expert_bytes = (2 * d * f + d + f) * eb
    swap_s = lambda n: n * expert_bytes / (o["h2d_GBps"] * 1e9)  # noqa: E731 - n experts from the host bank
    last = [g.compute(r, "start", 0.0) for r in ranks]
    if io is not None:
        last = [g.transfer("requests", ranks, [costs.broadcast_demand(ranks, 0, topo, profile, int(io[0]))],
                           deps=last, category="serve_io")] * N
    exchanged = None  # layer l-1's count exchange: phase 1 of layer l plans once its estimates came with it
    for j, (devs, how, replanned, counts, early) in enumerate(plans):
        tok = counts.sum(1)
        E = counts.shape[1]
        have = [loaded[j][r] if loaded is not None else set(devs[r]) for r in ranks]
        loads = [None] * N  # phase 1's expert loads, overlapped with layer l-1
        if early is not None:
            for r in ranks:
                new = [e for e in early[r] if e not in have[r]]
                plan = g.compute(r, f"L{j}.phase1", o["o_plan_s"], deps=(exchanged,), category="schedule", layer=j,
                                 stream="plan")
                loads[r] = g.compute(r, f"L{j}.prefetch", swap_s(len(new)),
                                     deps=(plan,), category="swap", layer=j, stream="h2d", swapped=len(new))
                have[r] = have[r] | set(new)
        att = [g.compute(r, f"L{j}.attn", ct(costs.attention_flops(int(tok[r]), d, s)
                                             + costs.gate_flops(int(tok[r]), d, E))
                         + o["host_layer_s"], deps=(last[r],), category="attention", layer=j) for r in ranks]
        nbytes = count_exchange_bytes(E) + (piggyback_bytes(E) if j + 1 < len(plans) and plans[j + 1][4] is not None
                                            else 0)  # with the next layer's estimates (phase 1)
        cnt = exchanged = g.transfer(f"L{j}.counts", ranks,
                                     [costs.ring_demand("all_gather", ranks, topo, profile, nbytes)],
                                     deps=att, category="count_exchange", layer=j,
                                     comm={"op": "all_gather", "group": ranks, "nbytes": nbytes})
        p2 = 0.0 if how == "static" else o["o_plan_s"] if (how == "actual" or replanned) else o["o_check_s"]
        pre = []
        for r in ranks:
            new = [e for e in devs[r] if e not in have[r]]
            if loaded is not None:
                loaded[j][r] = set(devs[r])
            pre.append(g.compute(r, f"L{j}.phase2+swap", p2 + swap_s(len(new)),
                                 deps=(cnt,), category="schedule", layer=j, swapped=len(new)))
        table = route_table(counts, devs).numpy()  # [src, e, dst] rows
        received = table.sum((0, 1))  # tokens each device serves in this layer
        g.meta.setdefault("load_max_over_mean", []).append(float(received.max() / received.mean())
                                                           if received.sum() > 0 else 1.0)
        mat = table.sum(1) * d * eb
        a1 = g.transfer(f"L{j}.dispatch", ranks, costs.alltoall_demands(mat, ranks, topo, profile), deps=pre,
                        category="a2a", layer=j, comm={"op": "all_to_all", "group": ranks, "splits": mat})
        ffn = [g.compute(r, f"L{j}.experts", sum(ct(costs.ffn_flops(int(table[:, e, r].sum()), d, f)) +
                                                o["expert_launch_s"] for e in devs[r]),
                         deps=(a1,) if loads[r] is None else (a1, loads[r]), category="expert", layer=j) for r in ranks]
        a2 = g.transfer(f"L{j}.combine", ranks, costs.alltoall_demands(mat.T, ranks, topo, profile), deps=ffn,
                        category="a2a", layer=j, comm={"op": "all_to_all", "group": ranks, "splits": mat.T})
        last = [a2] * N
    if io is not None:
        g.transfer("answers", ranks, [costs.ring_demand("all_gather", ranks, topo, profile, int(io[1]))],
                   deps=last, category="serve_io")
    return g


def static_loaded(N: int, E: int, L: int) -> list:
    """``loaded[j][d]`` (:func:`batch_graph`) before a run's first batch: every rank holds its static block."""
    return [[set(devs) for devs in static_placement(N, E)] for _ in range(L)]


def recorded_plans(layer_rows) -> list:
    """``[(round, batch, plans)]`` in serving order from one rank's layer records of a REAL serve run
    (:class:`.infer.LinaServeLayer`), ``plans`` as :func:`plans_for_batch` gives them: the placement the
    run used, how it was planned, whether phase 2 re-planned, the all-gathered counts ``[N, E]`` and phase
    1's placement (None where there was none). The simulator then prices the run's own decisions."""
    import json

    load = lambda v: json.loads(v) if isinstance(v, str) else v  # noqa: E731 - records hold lists as JSON
    by: dict = {}
    for r in layer_rows:
        if r["batch"] >= 0:  # profiling passes carry negative batch numbers
            by.setdefault((r.get("round", 0), r["batch"]), []).append(r)
    out = []
    for (rnd, b), rows in sorted(by.items()):
        plans = [(load(r["devs"]), r["planned_from"], bool(r["replanned"]),
                  np.asarray(load(r["counts"]), dtype=np.int64),
                  load(r["p1_devs"]) if isinstance(r.get("p1_devs"), (str, list)) else None)
                 for r in sorted(rows, key=lambda r: r["layer"])]
        out.append((rnd, b, plans))
    return out


def predict_served(layer_rows, profile, topo, shape: InferShape, overheads: dict = None, io=None) -> dict:
    """``{(round, batch): seconds}``: every batch of a REAL serve run priced by :func:`batch_graph` from its
    recorded plans (:func:`recorded_plans`); each round starts from the static placement, as each run
    does, and carries its swaps from batch to batch."""
    out, loaded, at = {}, None, None
    for rnd, b, plans in recorded_plans(layer_rows):
        if rnd != at:
            loaded, at = static_loaded(*plans[0][3].shape, len(plans)), rnd
        out[(rnd, b)] = simulate(batch_graph(plans, profile, topo, shape, overheads, loaded, io)).makespan
    return out


def replay_latencies(requests, batch_s: dict, batch_size: int, max_wait_s: float) -> list:
    """Request latencies with each batch taking ``batch_s[(round, batch)]`` seconds: the run's batches (their
    members, ``requests[i]["batch"]``) leave in order, each when the server is free and it is ready - full,
    or the last, once its latest member has arrived; otherwise also not before its first member's
    ``max_wait_s`` (the REAL batcher's rule, :func:`moelab.runtime.serve.serve`). Queueing is what sets a
    saturated server's latencies, so a faster batch shortens every later request's wait."""
    by: dict = {}
    for q in requests:
        by.setdefault((q.get("round", 0), q["batch"]), []).append(q)
    out, free, at = [], 0.0, None
    keys = sorted(by)
    for i, key in enumerate(keys):
        if key[0] != at:
            free, at = 0.0, key[0]
        arr = [q["arrival_s"] for q in by[key]]
        last = i + 1 == len(keys) or keys[i + 1][0] != key[0]
        ready = max(arr) if len(arr) >= batch_size or last else max(max(arr), min(arr) + max_wait_s)
        free = max(free, ready) + batch_s[key]
        out += [free - a for a in arr]
    return out


def simulate_serving(traces, src, batches, variants, sv, table, profile, topo, shape: InferShape, seed: int = 0,
                     overheads: dict = None) -> list:
    """Rows ``{variant, batch, batch_s, a2a_s, ffn_max_s, replans, swaps, load_max_over_mean, layer_s,
    layer_a2a_s}`` for every batch (index arrays into the traces) and variant, swaps carried across the batches
    of a variant; ``load_max_over_mean``: the busiest device's received tokens over the mean, median over the MoE
    layers (1 = balanced; what a placement leaves of the routing's skew); ``layer_s`` / ``layer_a2a_s``: per MoE
    layer in order, its time (from the previous layer's last op to its own; the first from the batch's start)
    and its all-to-alls' time (Figs. 17, 18)."""
    rows = []
    E = int(np.asarray(traces).max()) + 1 if table is None else table.E
    L = np.asarray(traces).shape[1]
    for v in variants:
        loaded = static_loaded(topo.world_size, E, L)
        for b, sel in enumerate(batches):
            plans = plans_for_batch(traces[sel], src[sel], v, sv, table, topo.world_size, E, seed, b)
            ov = dict(overheads or {})
            if v != "lina":
                ov["o_check_s"] = 0.0  # only Lina's phase 2 compares an estimate with the counts
            g = batch_graph(plans, profile, topo, shape, ov, loaded)
            res = simulate(g)
            df = res.ops_frame()
            done = df[df.layer.notna()].groupby("layer").end.max().sort_index()
            span = done.diff().fillna(done)  # from the layer before's last op (phase 1 ahead of it is hidden there)
            a2a = df[df.category == "a2a"]
            rows.append({"variant": v, "batch": b, "batch_s": res.makespan, "a2a_s": float(a2a.duration.sum()),
                         "ffn_max_s": float(df[df.category == "expert"].groupby("layer").duration.max().sum()),
                         "replans": sum(p[2] for p in plans),
                         "swaps": int(sum(op.meta.get("swapped", 0) for op in g.ops)),
                         "load_max_over_mean": float(np.median(g.meta["load_max_over_mean"])),
                         "layer_s": span.tolist(),
                         "layer_a2a_s": a2a.groupby("layer").duration.sum()
                                        .reindex(span.index, fill_value=0.0).tolist()})
    return rows
