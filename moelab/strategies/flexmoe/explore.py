"""FlexMoE's placement policy as an explorer starting point (:class:`moelab.placement.query.PolicyQuery`)."""
from __future__ import annotations

from moelab.placement.query import PolicyQuery, single
from moelab.strategies.flexmoe.options import FlexMoEOptions
from moelab.strategies.flexmoe.policy import schedule


def scheduling_round(q: PolicyQuery) -> tuple:
    """One FlexMoE scheduling round (:func:`moelab.strategies.flexmoe.policy.schedule`) from the current owners
    with FlexMoE's default reserve ``r`` and ``max_steps``, gains in tokens (its load rule)."""
    o = FlexMoEOptions()
    holders, _ = schedule(single(q.owners), q.expert_tokens().tolist(), q.ranks, o.r, max_steps=o.max_steps)
    return holders
