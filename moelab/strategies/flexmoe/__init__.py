"""FlexMoE (dynamic device placement; Hecate's baseline, spec ``shared/papers/hecate.md`` §3) in moelab.

Pure: the scheduler (:mod:`moelab.strategies.flexmoe.policy`: slot budget E/N + r, balance ratio, Expand /
Shrink / Migrate kept while gain × K > migration cost). Runtime: the core layer on a placement with
replicas (:class:`.layer.FlexMoELayer` only adds its plan record), driven by :class:`.update.FlexMoEUpdate`
(scheduling before the forward, :func:`moelab.moe.migrate.migrate_holders` for params + Adam state, one
all-reduce per replicated expert over its cached replica-set group). Plans are priced with the cost model
Hecate and SmartMoE share (:mod:`moelab.sim.placement_cost`). Simulator: :mod:`.sim_graph`.

Registered as strategy ``flexmoe``: ``parallel.strategy: flexmoe`` with ``parallel.strategy_options``
such as ``{r: 2, interval: 10, threshold: 1.2, max_steps: 4}`` (:mod:`.options`).
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.flexmoe.layer import FlexMoELayer
from moelab.strategies.flexmoe.options import FlexMoEOptionError, FlexMoEOptions
from moelab.strategies.flexmoe.update import FlexMoEUpdate
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: FlexMoEOptions):
    return functools.partial(FlexMoELayer, options=opts)


STRATEGY = register_strategy(Strategy(
    "flexmoe", options=FlexMoEOptions, layer=layer_factory, update=FlexMoEUpdate,
    techniques=(Technique("flexmoe", "placement", owns=("update",), wraps=("plan_record",),
        doc="replicas with their own Adam state, Expand/Shrink/Migrate between iterations"),),
    sim_graph="moelab.strategies.flexmoe.sim_graph:flexmoe_iteration_graph",
    sim_plan="moelab.strategies.flexmoe.sim_graph:flexmoe_sim_plan",
    conformance=({}, {"interval": 1, "threshold": 1.01, "r": 1, "migration_cost_s": 0.0}),
    placement_policies=(("FlexMoE", "moelab.strategies.flexmoe.explore:scheduling_round"),),
    doc="FlexMoE: replicas with their own Adam state (E/N + r slots), ring all-reduce per replica set, "
        "Expand/Shrink/Migrate"))

__all__ = ["STRATEGY", "layer_factory", "FlexMoEOptions", "FlexMoEOptionError", "FlexMoEUpdate"]
