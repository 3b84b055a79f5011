"""Hecate's placement policies as explorer starting points (:class:`moelab.placement.query.PolicyQuery`)."""
from __future__ import annotations

from moelab.placement.query import PolicyQuery, single
from moelab.sim.placement_cost import PlacementCost
from moelab.strategies.hecate.options import HecateOptions
from moelab.strategies.hecate.policy import materialize_plan, memory_slots, reshard_owners


def overlap_and_slots(q: PolicyQuery) -> tuple:
    """t: experts a node receives while the layer's attention runs (the simulated attention op); m: replicas that
    fit in the memory the busiest rank has left at peak (one live layer, params + grads per replica)."""
    cost = PlacementCost.from_profile(q.profile, q.d_model, q.d_ff)
    t = cost.overlap_degree(q.attention_s, q.experts)
    m = min(q.experts, memory_slots(max(0.0, q.free_bytes), 1, cost.expert_bytes, cost.expert_bytes))
    return t, m


def _note(t: int, m: int) -> str:
    why = " (no expert arrives while the attention runs: Alg. 1 keeps the sharding)" if t == 0 else (
        " (no memory left for a replica)" if m == 0 else "")
    return f"Hecate: overlap degree t = {t}, memory slots m = {m}{why}"


def alg1(q: PolicyQuery) -> tuple:
    """Hecate Alg. 1 (:func:`moelab.strategies.hecate.policy.materialize_plan`) over the current owners."""
    t, m = overlap_and_slots(q)
    plan = materialize_plan(list(q.owners), q.expert_tokens().tolist(), t, m, q.ranks, q.profile.gpus_per_node,
                            HecateOptions().assign)
    return plan, _note(t, m)


def alg2(q: PolicyQuery) -> tuple:
    """Hecate Alg. 2 (:func:`moelab.strategies.hecate.policy.reshard_owners`): new owners for this layer."""
    t, _ = overlap_and_slots(q)
    new = reshard_owners(q.expert_tokens()[None], t, [list(q.owners)], q.ranks, q.profile.gpus_per_node,
                         HecateOptions().prefer_fewer_free)
    return single(new[0]), f"Hecate: overlap degree t = {t} (the top-t experts keep their owners where they can)"
