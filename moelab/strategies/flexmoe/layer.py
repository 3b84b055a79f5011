"""FlexMoE's MoE layer: the core layer (:class:`moelab.moe.layer.MoELayer`) on a placement with replicas.

Nothing in the stages changes: the core dispatcher splits a source's tokens for an expert over its
holders (a holder keeps its own, :class:`moelab.placement.rules.HolderOrder`), and every holder computes
with its own copy. What FlexMoE adds lives in :class:`.update.FlexMoEUpdate` (scheduler, migration,
replica-group gradient all-reduce); the layer only describes it in its plan record.
"""
from __future__ import annotations

from moelab.moe.layer import MoELayer
from moelab.strategies.flexmoe.policy import balance_ratio


class FlexMoELayer(MoELayer):
    def __init__(self, *args, options=None, **kw):
        super().__init__(*args, **kw)
        self.options = options
        self.flex_steps: list = []  # this iteration's scheduling steps (set by the update before forward)

    def plan_record(self) -> dict:
        """The core record plus ``flexmoe``: the call's holders per expert, the steps executed before this
        forward (``[kind, expert, src, dst]``) and the call's balance ratio (max / mean device load of its
        own loads, tokens split evenly over replicas)."""
        rec = super().plan_record()
        pl = self.last_plan.placement or self.placement
        F = self.last_plan.global_counts.sum(0).tolist()
        rec["flexmoe"] = {"holders": [list(h) for h in pl.holders], "steps": [list(s) for s in self.flex_steps],
                          "ratio": balance_ratio(pl.holders, F, pl.world_size)}
        return rec
