"""Lina's placement policy as an explorer starting point (:class:`moelab.placement.query.PolicyQuery`)."""
from __future__ import annotations

import numpy as np

from moelab.placement.query import PolicyQuery
from moelab.strategies.lina.options import LinaServeOptions
from moelab.strategies.lina.placement import allocate, to_placement


def popularity(q: PolicyQuery) -> tuple:
    """Lina's allocation (:func:`moelab.strategies.lina.placement.allocate`): expert e wants ``N · popularity(e)``
    devices, at most ``max_pack`` experts per device (Lina's serving defaults)."""
    o = LinaServeOptions()
    tot = q.expert_tokens().astype(np.float64)
    pop = tot / tot.sum() if tot.sum() else np.full(q.experts, 1.0 / q.experts)
    return to_placement(allocate(q.ranks * pop, q.ranks, o.max_pack, rounding=o.replica_rounding), q.experts).holders
