"""SmartMoE's placement policy as an explorer starting point (:class:`moelab.placement.query.PolicyQuery`)."""
from __future__ import annotations

from moelab.placement.query import PolicyQuery, single
from moelab.placement.rebalance import lpt_owners


def lpt(q: PolicyQuery) -> tuple:
    """SmartMoE's re-placement (:func:`moelab.placement.rebalance.lpt_owners`): experts by load to the least
    loaded rank with a free slot, E/N slots each."""
    if q.experts % q.ranks:
        raise ValueError(f"SmartMoE needs experts divisible by ranks: {q.experts} experts on {q.ranks} ranks")
    return single(lpt_owners(q.expert_tokens().tolist(), q.ranks, q.experts // q.ranks))
