"""SmartMoE (online expert placement; Hecate's baseline, spec ``shared/papers/hecate.md`` §3) in moelab.

Pure: LPT permutation and the cost decision (:mod:`moelab.placement.rebalance`). Runtime: the core layer on the
current permutation (:class:`.layer.SmartMoELayer` adds its plan record) driven by :class:`.update.SmartMoEUpdate`
(every K iterations a round; :func:`moelab.moe.migrate.migrate_owners` moves params + Adam state). Simulator and
paper-scale replay: :mod:`.sim_graph`; options
in :mod:`.options`.

Registered as strategy ``smartmoe``: ``parallel.strategy: smartmoe`` with ``{interval: 25, decision: cost}``.
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.smartmoe.layer import SmartMoELayer
from moelab.strategies.smartmoe.options import SmartMoEOptionError, SmartMoEOptions
from moelab.strategies.smartmoe.update import SmartMoEUpdate
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: SmartMoEOptions):
    return functools.partial(SmartMoELayer, options=opts)


STRATEGY = register_strategy(Strategy(
    "smartmoe", options=SmartMoEOptions, layer=layer_factory, update=SmartMoEUpdate,
    techniques=(Technique("smartmoe", "placement", owns=("update",), wraps=("plan_record",),
        sim="moelab.strategies.smartmoe.sim_graph:smartmoe_contribution",
        doc="LPT re-placement every K iterations (the update moves experts)"),),
    sim_graph="moelab.strategies.smartmoe.sim_graph:smartmoe_iteration_graph",
    sim_plan="moelab.strategies.smartmoe.sim_graph:smartmoe_sim_plan",
    conformance=({}, {"interval": 1, "decision": "never"}, {"interval": 1, "decision": "always"}),
    placement_policies=(("SmartMoE", "moelab.strategies.smartmoe.explore:lpt"),),
    doc="SmartMoE: LPT re-placement every K iterations when the modeled gain exceeds the migration"))

__all__ = ["STRATEGY", "layer_factory", "SmartMoEOptions", "SmartMoEOptionError", "SmartMoEUpdate"]
