"""The placement explorer's prices: every cost of a placement, from the simulator.

:func:`evaluate` routes the chosen ``[N, E]`` matrix with :meth:`Placement.routes` (the dispatcher's
rule) and simulates one training iteration of a one-MoE-layer model with
:func:`moelab.sim.graphs.ep_iteration_graph` (the core's replica-aware expert parallelism). From that one
simulated iteration it reads

- the MoE layer's forward window (gate to combine) and backward window (combine.bwd to gate.bwd),
- the count exchange (the layer's all-gather of counts),
- the replicas' gradient synchronisation (the graph's ``replica_sync`` ops: each replica's gradient to
  the owner and the sum back, :mod:`moelab.moe.sync`), its span and its bytes,
- the dense update (the dense gradients' all-reduce),
- peak memory per rank (:meth:`moelab.sim.result.SimResult.peak_memory`: parameters, gradients and
  optimizer state of the dense part and of every expert the rank holds, replicas included, and the
  activations), against the profile's ``mem_GB``;

and prices the migration from ``state.moved_from`` (the placement before the edit) with
:mod:`moelab.sim.migration`: the bytes :mod:`moelab.moe.migrate` moves and that all-to-all's time.

The *layer time* is forward + backward window + replica sync span: what adding a replica costs and saves.

With ``state.strategy == "hecate"`` the same layer is priced by Hecate's own simulator graph
(:func:`moelab.strategies.hecate.sim_graph.hecate_iteration_graph`, the registered ``sim_graph``, through
:func:`moelab.sim.graphs.get_graph`) for the plan P = the owners, P' = the drawn holders: the replicas are
materialized by spAG(P, P') beside the attention (the gate waits for it) and their gradients reduced by
spRS(P', P) after the layer's backward (waited at the iteration's end), instead of the replica gradient sync.
Its forward window then starts where the attention ends (the exposed spAG is the layer's), the layer time adds
the spRS left exposed past the rest of the iteration, and a change of owners is Hecate's migration (the graph's
``migrate`` all-to-all, 3 x expert rows per moved owner; replicas are rebuilt each iteration, never moved).
"""
from __future__ import annotations

import functools

import numpy as np

from moelab.comm.bytes import by_link_class
from moelab.comm.topology import LINK_CLASSES
from moelab.config import RunConfig
from moelab.placement import Placement
from moelab.sim import config_for_profile
from moelab.sim.engine import simulate
from moelab.sim.graphs import ep_iteration_graph, expert_param_count, get_graph, graph_bytes, route_matrix, topology_of
from moelab.sim.migration import migration_matrix, migration_row_bytes, migration_time
from moelab.viz.explorer_state import ExplorerState, layer_loads, placement_of, profile_of, trace_label

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations")


def sim_config(state: ExplorerState, E: int, T: int):
    """The run config the explorer simulates: one MoE layer of the state's sizes on its profile's cluster,
    ``T`` tokens per rank (also what :mod:`moelab.viz.explorer_run` exports, resized to the local ranks)."""

    return config_for_profile(RunConfig(), profile_of(state), **{
        "model.n_layers": 1, "model.moe_every": 1, "model.d_model": state.d_model, "model.d_ff": state.d_ff,
        "model.n_heads": 1, "model.moe.num_experts": E, "model.moe.top_k": state.top_k,
        "model.seq_len": max(T, 1), "train.batch_size": 1})


def replica_sync_bytes(placement: Placement, topo, param_bytes: int):
    """Bytes per rank and link class the runtime's ``sync_replica_grads`` sends for one MoE layer:
    each replica sends its gradient to the owner, the owner sends the sum back to each replica (by hand,
    the check on the graph's ``replica_sync`` ops)."""
    import pandas as pd

    out = np.zeros((placement.world_size, len(LINK_CLASSES)), dtype=np.int64)
    for h in placement.holders:
        owner = h[0]
        for r in h[1:]:
            for src, dst in ((r, owner), (owner, r)):
                cls = by_link_class(topo, src, {dst: param_bytes})
                out[src] += [cls[c] for c in LINK_CLASSES]
    return pd.DataFrame(out, columns=list(LINK_CLASSES)).rename_axis("rank")


def _frame(gb: dict, N: int):
    import pandas as pd

    return pd.DataFrame([[gb[r][c] for c in LINK_CLASSES] for r in range(N)],
                        columns=list(LINK_CLASSES)).rename_axis("rank")


def _span(ops, mask) -> float:
    o = ops[mask]
    return float(o["end"].max() - o["start"].min()) if len(o) else 0.0


def moved_from_of(state: ExplorerState, placement: Placement):
    """The previous placement's holders if they fit this cluster and expert count, else None."""
    old = state.moved_from
    if len(old) != placement.num_experts or any(not 0 <= r < placement.world_size for h in old for r in h):
        return None
    return old


@functools.lru_cache(maxsize=64)
def evaluate(state: ExplorerState) -> dict:
    """Every price of ``state``'s placement (module doc), as a dict: ``placement``, ``loads`` ([N, E] input),
    ``route`` ([src, dst] tokens), ``rank_tokens`` (tokens each rank's experts compute), ``max_load``,
    ``mean_load``, ``imbalance``, ``bytes`` (DataFrame rank x local/intra/inter: count exchange + the four
    all-to-alls), ``replica_sync_bytes`` (the graph's replica_sync ops, same frame), ``layer_time_s``,
    ``fwd_s``, ``bwd_s``, ``replica_sync_s``, ``count_exchange_s``, ``dense_update_s``, ``iteration_s``,
    ``memory`` (DataFrame rank x params/grads/optimizer/activations/total, bytes at peak),
    ``memory_limit`` (bytes per rank), ``fits_memory``, ``migration_bytes`` ([src, dst] from
    ``moved_from``), ``migration_s``, ``experts_moved``, ``breakdown``, ``result``, ``profile``, ``label``.
    Cached per state (states are immutable)."""

    if state.strategy == "hecate":
        return _evaluate_hecate(state)

    prof = profile_of(state)
    L = layer_loads(state)
    N, E = L.shape
    pl = placement_of(state)
    T = int(round(L.sum() / (state.top_k * N))) if L.sum() else 1
    cfg = sim_config(state, E, T)
    route = route_matrix(pl, L)
    g = ep_iteration_graph(cfg, prof, L[None], pl, elem_bytes=prof.elem_bytes)
    res = simulate(g)
    ops = res.ops_frame()
    topo = topology_of(cfg)

    def window(first, last):
        return float(ops[ops.name == last]["end"].max() - ops[ops.name == first]["start"].min())

    fwd, bwd = window("L0.gate.fwd", "L0.combine"), window("L0.combine.bwd", "L0.gate.bwd")
    sync_s = _span(ops, ops.category == "replica_sync")
    gb = graph_bytes(g, topo, categories={"a2a", "count_exchange"})
    sync_b = graph_bytes(g, topo, categories={"replica_sync"})
    mem = _memory(res)
    limit = float(prof.mem_GB) * 1e9
    numel = expert_param_count(cfg.model)
    old = moved_from_of(state, pl)
    mig = (migration_matrix(old, pl.holders, N, migration_row_bytes(numel, prof.elem_bytes)) if old is not None
           else np.zeros((N, N), dtype=np.int64))
    rank_tokens = route.sum(0)
    mean = float(rank_tokens.mean())
    return dict(placement=pl, loads=L, route=route, rank_tokens=rank_tokens, max_load=int(rank_tokens.max()),
                mean_load=mean, imbalance=float(rank_tokens.max() / mean) if mean else 1.0, bytes=_frame(gb, N),
                replica_sync_bytes=_frame(sync_b, N), layer_time_s=fwd + bwd + sync_s, fwd_s=fwd, bwd_s=bwd,
                replica_sync_s=sync_s, strategy="ep", count_exchange_s=_span(ops, ops.category == "count_exchange"),
                dense_update_s=_span(ops, ops.category == "allreduce"), iteration_s=float(res.makespan),
                memory=mem, memory_limit=limit, fits_memory=bool(mem["total"].max() <= limit),
                migration_bytes=mig, migration_s=migration_time(mig, prof, topo),
                experts_moved=int(mig.sum() // migration_row_bytes(numel, prof.elem_bytes)),
                breakdown=res.breakdown(), result=res, profile=prof, label=label_of(state))


def hecate_plan(state: ExplorerState) -> dict:
    """The keyword arguments of Hecate's graph for ``state``'s placement (one MoE layer): owners P, final
    holders P' (prefetched beside the attention), and ``moved`` = the owners changed from ``moved_from``."""
    pl = placement_of(state)
    owners = [h[0] for h in pl.holders]
    old = moved_from_of(state, pl)
    moved = [(0, e, int(o[0]), int(n)) for e, (o, n) in enumerate(zip(old, owners)) if o[0] != n] if old else []
    return dict(owners=[owners], holders=[pl.holders], prefetch=[pl.holders], moved=moved)


def hecate_graph(state: ExplorerState):
    """Hecate's own simulator graph of one iteration of ``state``'s layer (the registered ``sim_graph``)."""

    prof, L = profile_of(state), layer_loads(state)
    N, E = L.shape
    T = int(round(L.sum() / (state.top_k * N))) if L.sum() else 1
    return get_graph("hecate")(sim_config(state, E, T), prof, L[None], **hecate_plan(state),
                               elem_bytes=prof.elem_bytes)


def _evaluate_hecate(state: ExplorerState) -> dict:

    prof, L, pl = profile_of(state), layer_loads(state), placement_of(state)
    N, E = L.shape
    g = hecate_graph(state)
    res = simulate(g)
    ops = res.ops_frame()
    topo = topology_of(sim_config(state, E, 1))
    first = lambda n: float(ops[ops.name == n]["start"].min())  # noqa: E731
    last = lambda n: float(ops[ops.name == n]["end"].max())  # noqa: E731
    attn_end = last("L0.attn.fwd")
    spag_exposed = max(0.0, first("L0.gate.fwd") - attn_end)
    fwd = last("L0.combine") - first("L0.gate.fwd") + spag_exposed
    bwd = last("L0.gate.bwd") - first("L0.combine.bwd")
    rest = ops[~ops.category.isin(["sprs", "migrate", "other"])]
    sprs = ops[ops.category == "sprs"]
    sprs_exposed = max(0.0, float(sprs["end"].max()) - float(rest["end"].max())) if len(sprs) else 0.0
    mig = ops[ops.category == "migrate"]
    mig_s = float(mig.duration.sum())
    plan = hecate_plan(state)
    M = np.zeros((N, N), dtype=np.int64)
    for op in g.ops:
        if op.category == "migrate":
            M += np.asarray(op.comm["splits"], dtype=np.int64)
    mem = _memory(res)
    limit = float(prof.mem_GB) * 1e9
    route = route_matrix(pl, L)
    rank_tokens = route.sum(0)
    mean = float(rank_tokens.mean())
    zero = _frame({r: dict.fromkeys(LINK_CLASSES, 0) for r in range(N)}, N)
    return dict(placement=pl, loads=L, route=route, rank_tokens=rank_tokens, max_load=int(rank_tokens.max()),
                mean_load=mean, imbalance=float(rank_tokens.max() / mean) if mean else 1.0,
                bytes=_frame(graph_bytes(g, topo, categories={"a2a", "count_exchange"}), N),
                replica_sync_bytes=zero, layer_time_s=fwd + bwd + sprs_exposed, fwd_s=fwd, bwd_s=bwd,
                replica_sync_s=sprs_exposed, strategy="hecate",
                spag_s=_span(ops, ops.category == "spag"), spag_exposed_s=spag_exposed,
                sprs_s=_span(ops, ops.category == "sprs"), sprs_exposed_s=sprs_exposed,
                spag_bytes=_frame(graph_bytes(g, topo, categories={"spag"}), N),
                sprs_bytes=_frame(graph_bytes(g, topo, categories={"sprs"}), N),
                count_exchange_s=_span(ops, ops.category == "count_exchange"),
                dense_update_s=_span(ops, ops.category == "allreduce"), iteration_s=float(res.makespan) - mig_s,
                memory=mem, memory_limit=limit, fits_memory=bool(mem["total"].max() <= limit),
                migration_bytes=M, migration_s=mig_s, experts_moved=len(plan["moved"]),
                breakdown=res.breakdown(), result=res, profile=prof, label=label_of(state))


def _memory(res):
    mem = res.peak_memory()
    for c in MEMORY_CATEGORIES:
        if c not in mem:
            mem[c] = 0.0
    return mem[list(MEMORY_CATEGORIES) + ["total"]]


def check_fits(ev: dict) -> dict:
    """``ev`` if its placement fits every rank's memory, else ValueError naming the ranks over the limit."""
    if not ev["fits_memory"]:
        tot = ev["memory"]["total"]
        over = [int(r) for r in tot.index[tot > ev["memory_limit"]]]
        raise ValueError(f"the placement does not fit memory: rank(s) {over[:8]} need up to "
                         f"{tot.max() / 1e9:.2f} GB of {ev['memory_limit'] / 1e9:.0f} GB")
    return ev


def label_of(state: ExplorerState) -> str:
    p = profile_of(state)
    how = ", priced as Hecate (spAG / spRS)" if state.strategy == "hecate" else ""
    return f"SIMULATED: {p.name} ({p.nodes} x {p.gpus_per_node}){how}, {trace_label(state)}"


def summary_text(ev: dict) -> str:
    pl = ev["placement"]
    b = ev["bytes"].sum()
    mem = ev["memory"]["total"]
    if ev.get("strategy") == "hecate":
        sync = (f"Hecate: spAG {ev['spag_s'] * 1e3:.2f} ms ({ev['spag_exposed_s'] * 1e3:.2f} exposed, "
                f"{ev['spag_bytes'].values.sum() / 1e6:.1f} MB), spRS {ev['sprs_s'] * 1e3:.2f} ms "
                f"({ev['sprs_exposed_s'] * 1e3:.2f} exposed, {ev['sprs_bytes'].values.sum() / 1e6:.1f} MB)")
        head = (f"layer time {ev['layer_time_s'] * 1e3:.2f} ms (fwd {ev['fwd_s'] * 1e3:.2f}, bwd "
                f"{ev['bwd_s'] * 1e3:.2f}, spRS exposed {ev['replica_sync_s'] * 1e3:.2f}); {sync}; ")
    else:
        head = (f"layer time {ev['layer_time_s'] * 1e3:.2f} ms (fwd {ev['fwd_s'] * 1e3:.2f}, bwd "
                f"{ev['bwd_s'] * 1e3:.2f}, replica sync {ev['replica_sync_s'] * 1e3:.2f}); ")
    sync_mb = "" if ev.get("strategy") == "hecate" else (
        f", replica grad sync {ev['replica_sync_bytes'].values.sum() / 1e6:.1f} MB")
    return (head +
            f"max/mean tokens per rank {ev['max_load']}/{ev['mean_load']:.0f} (imbalance {ev['imbalance']:.2f}); "
            f"bytes intra {b['intra'] / 1e6:.1f} MB, inter {b['inter'] / 1e6:.1f} MB; "
            f"{pl.num_replicas} replica(s){sync_mb}; "
            f"count exchange {ev['count_exchange_s'] * 1e3:.3f} ms; dense update {ev['dense_update_s'] * 1e3:.2f} ms; "
            f"iteration {ev['iteration_s'] * 1e3:.2f} ms; peak memory {mem.max() / 1e9:.3f} GB on rank "
            f"{int(mem.idxmax())} of {ev['memory_limit'] / 1e9:.0f} GB; migration from the previous placement "
            f"{ev['experts_moved']} cop{'y' if ev['experts_moved'] == 1 else 'ies'}, "
            f"{ev['migration_bytes'].sum() / 1e6:.1f} MB, {ev['migration_s'] * 1e3:.2f} ms")


__all__ = ["evaluate", "check_fits", "hecate_graph", "hecate_plan", "replica_sync_bytes",
           "label_of", "summary_text", "sim_config",
           "MEMORY_CATEGORIES", "moved_from_of"]
