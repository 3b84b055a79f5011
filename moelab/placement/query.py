"""What a placement policy is asked, as plain data: the loads of one layer and the cluster they run on.

The placement explorer (:mod:`moelab.viz.explorer_policies`) offers every registered strategy's placement policy as
a starting point. A strategy declares them (``Strategy.placement_policies``: button name -> ``"module:function"``);
each function takes a :class:`PolicyQuery` and returns the placement it would execute, per expert
``(owner, replicas...)``, or ``(holders, note)`` when it has something to say about its decision. The query is built
by the explorer from its state and its simulated evaluation, so the policies need nothing above this layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PolicyQuery:
    loads: np.ndarray  # [N ranks, E experts] tokens each rank routes to each expert (one layer)
    owners: tuple  # the current owner of each expert (replicas dropped)
    profile: Any  # the cluster (moelab.sim.profiles.ClusterProfile): FLOP/s, bandwidths, GPUs per node
    d_model: int
    d_ff: int
    attention_s: float  # one layer's simulated attention forward (the non-MoE work a gather can hide behind)
    free_bytes: float  # the memory the busiest rank has left at its simulated peak

    @property
    def ranks(self) -> int:
        return int(self.loads.shape[0])

    @property
    def experts(self) -> int:
        return int(self.loads.shape[1])

    def expert_tokens(self) -> np.ndarray:
        """Tokens per expert over all ranks."""
        return self.loads.sum(0)


def single(owners) -> tuple:
    """Holders with no replica: expert e on its owner alone."""
    return tuple((int(o),) for o in owners)
