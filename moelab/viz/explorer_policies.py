"""Starting points for the placement explorer: each registered placement policy applied to the current loads.

A policy here is ``fn(state, ev) -> holders`` (per expert ``(owner, replicas...)``), or ``(holders, note)`` where
it has something to say about its decision (Hecate's t and m: a plan with no replica says why): it reads the state's
layer loads ``ev["loads"]`` ``[N, E]`` and cluster, calls the strategy's own pure decision function with that
strategy's default options, and returns the placement it would execute. The explorer applies it with
:func:`moelab.viz.explorer_state.with_holders` (so the migration from the current placement is priced) and the
user edits from there; Hecate's two are priced by Hecate's own graph (spAG / spRS, ``strategy="hecate"``), the
others by expert parallelism with the replicas' gradient sync. Owners-based policies start
from the current placement's owners (replicas dropped).

Built in: FasterMoE's dynamic shadowing (Alg. 1 on its cost model, shadows on every rank), SmartMoE's LPT
re-placement, FlexMoE's scheduling round (Expand / Shrink / Migrate), Hecate's Alg. 1 (materialization,
t from the layer's non-MoE compute and m from the memory left at peak) and Alg. 2 (re-sharding), Lina's
popularity allocation (``allocate(N · popularity)``). :func:`register_policy` adds more.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from moelab.viz.explorer_state import ExplorerState, placement_of, profile_of, with_holders, with_strategy

POLICIES: dict = {}  # name -> (fn(state, ev) -> holders, one line saying what it does)
POLICY_STRATEGY: dict = {}  # name -> how its placement is priced (explorer_state.STRATEGIES)


def register_policy(name: str, fn: Callable, doc: str, strategy: str = "ep") -> Callable:
    """Offer ``fn(state, ev) -> holders`` as a starting point named ``name`` (one button in the widget); its
    placement is priced as ``strategy`` (``"hecate"``: by Hecate's spAG / spRS graph, the strategy that executes it)."""
    POLICIES[name] = (fn, doc)
    POLICY_STRATEGY[name] = strategy
    return fn


def apply_policy(state: ExplorerState, name: str, ev: dict = None) -> ExplorerState:
    """``state`` with the placement policy ``name`` decides for its current loads (``ev``: its evaluation,
    computed when not given). ValueError when the policy does not apply (e.g. experts not divisible by ranks)."""
    return decide(state, name, ev)[0]


def decide(state: ExplorerState, name: str, ev: dict = None) -> tuple:
    """``(new state, note)``: :func:`apply_policy` and what the policy said about its decision ("" if nothing)."""
    from moelab.viz.explorer_cost import evaluate

    if name not in POLICIES:
        raise ValueError(f"unknown placement policy {name!r}; known: {sorted(POLICIES)}")
    ev = ev if ev is not None else evaluate(state)
    out = POLICIES[name][0](state, ev)
    holders, note = out if len(out) == 2 and isinstance(out[1], str) else (out, "")
    return with_strategy(with_holders(state, holders), POLICY_STRATEGY.get(name, "ep")), note


def _owners(state: ExplorerState) -> list:
    return [h[0] for h in placement_of(state).holders]


def _single(owners) -> tuple:
    return tuple((int(o),) for o in owners)


def fastermoe_shadowing(state: ExplorerState, ev: dict) -> tuple:
    """FasterMoE Alg. 1 (:func:`moelab.strategies.fastermoe.shadow.select_shadows`) with the profile's GPU
    FLOP/s and a worker's share of its node's NIC; the chosen experts shadowed on every rank."""
    from moelab.placement.policy import replicate
    from moelab.strategies.fastermoe.options import FasterMoEOptions
    from moelab.strategies.fastermoe.shadow import select_shadows

    o, p, pl = FasterMoEOptions(), profile_of(state), placement_of(state)
    S = select_shadows(ev["loads"], h=state.d_model, h_ff=state.d_ff, P=p.achieved_flops,
                       W_net=p.inter_bw_GBps * 1e9 / p.gpus_per_node, s=p.elem_bytes, c=o.shadow_comm_factor,
                       max_shadow=o.shadow_max, exact=o.shadow_exact)
    from moelab.placement import Placement

    return replicate(Placement(pl.num_experts, pl.world_size, _single(_owners(state))), S).holders


def smartmoe_lpt(state: ExplorerState, ev: dict) -> tuple:
    """SmartMoE's re-placement (:func:`moelab.placement.rebalance.lpt_owners`): experts by load to the least
    loaded rank with a free slot, E/N slots each."""
    from moelab.placement.rebalance import lpt_owners

    N, E = ev["loads"].shape
    if E % N:
        raise ValueError(f"SmartMoE needs experts divisible by ranks: {E} experts on {N} ranks")
    return _single(lpt_owners(ev["loads"].sum(0).tolist(), N, E // N))


def flexmoe_round(state: ExplorerState, ev: dict) -> tuple:
    """One FlexMoE scheduling round (:func:`moelab.strategies.flexmoe.policy.schedule`) from the current owners
    with FlexMoE's default reserve ``r`` and ``max_steps``, gains in tokens (its load rule)."""
    from moelab.strategies.flexmoe.options import FlexMoEOptions
    from moelab.strategies.flexmoe.policy import schedule

    o = FlexMoEOptions()
    N, _ = ev["loads"].shape
    holders, _ = schedule(_single(_owners(state)), ev["loads"].sum(0).tolist(), N, o.r, max_steps=o.max_steps)
    return holders


def _hecate_t_m(state: ExplorerState, ev: dict) -> tuple:
    """t: experts a node receives while the layer's attention runs (the simulated attention op); m: replicas
    that fit in the memory the busiest rank has left at peak (one live layer, params + grads per replica)."""
    from moelab.sim.placement_cost import PlacementCost
    from moelab.strategies.hecate.policy import memory_slots

    p = profile_of(state)
    N, E = ev["loads"].shape
    cost = PlacementCost.from_profile(p, state.d_model, state.d_ff)
    ops = ev["result"].ops_frame()
    t_attn = float(ops[ops.name == "L0.attn.fwd"].duration.max())
    t = cost.overlap_degree(t_attn, E)
    free = max(0.0, ev["memory_limit"] - float(ev["memory"]["total"].max()))
    m = min(E, memory_slots(free, 1, cost.expert_bytes, cost.expert_bytes))
    return t, m


def hecate_alg1(state: ExplorerState, ev: dict) -> tuple:
    """Hecate Alg. 1 (:func:`moelab.strategies.hecate.policy.materialize_plan`) over the current owners."""
    from moelab.strategies.hecate.options import HecateOptions
    from moelab.strategies.hecate.policy import materialize_plan

    t, m = _hecate_t_m(state, ev)
    N, _ = ev["loads"].shape
    plan = materialize_plan(_owners(state), ev["loads"].sum(0).tolist(), t, m, N, profile_of(state).gpus_per_node,
                            HecateOptions().assign)
    return plan, _t_m_note(t, m)


def _t_m_note(t: int, m: int) -> str:
    why = " (no expert arrives while the attention runs: Alg. 1 keeps the sharding)" if t == 0 else (
        " (no memory left for a replica)" if m == 0 else "")
    return f"Hecate: overlap degree t = {t}, memory slots m = {m}{why}"


def hecate_alg2(state: ExplorerState, ev: dict) -> tuple:
    """Hecate Alg. 2 (:func:`moelab.strategies.hecate.policy.reshard_owners`): new owners for this layer."""
    from moelab.strategies.hecate.options import HecateOptions
    from moelab.strategies.hecate.policy import reshard_owners

    t, _ = _hecate_t_m(state, ev)
    N, _ = ev["loads"].shape
    F = ev["loads"].sum(0)[None]
    new = reshard_owners(F, t, [_owners(state)], N, profile_of(state).gpus_per_node, HecateOptions().prefer_fewer_free)
    return _single(new[0]), f"Hecate: overlap degree t = {t} (the top-t experts keep their owners where they can)"


def lina_popularity(state: ExplorerState, ev: dict) -> tuple:
    """Lina's allocation (:func:`moelab.strategies.lina.placement.allocate`): expert e wants ``N · popularity(e)``
    devices, at most ``max_pack`` experts per device (Lina's serving defaults)."""
    from moelab.strategies.lina.options import LinaServeOptions
    from moelab.strategies.lina.placement import allocate, to_placement

    o = LinaServeOptions()
    N, E = ev["loads"].shape
    tot = ev["loads"].sum(0).astype(np.float64)
    pop = tot / tot.sum() if tot.sum() else np.full(E, 1.0 / E)
    return to_placement(allocate(N * pop, N, o.max_pack, rounding=o.replica_rounding), E).holders


for _name, _fn in (("FasterMoE shadowing", fastermoe_shadowing), ("SmartMoE", smartmoe_lpt),
                   ("FlexMoE", flexmoe_round), ("Hecate Alg. 1", hecate_alg1), ("Hecate Alg. 2", hecate_alg2),
                   ("Lina popularity", lina_popularity)):
    register_policy(_name, _fn, (_fn.__doc__ or "").split("\n")[0], "hecate" if _name.startswith("Hecate") else "ep")

__all__ = ["POLICIES", "POLICY_STRATEGY", "register_policy", "apply_policy", "decide"]
