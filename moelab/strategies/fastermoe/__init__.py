"""FasterMoE (PPoPP'22) in moelab: performance model, DDL-Roofline, dynamic shadowing, smart
fine-grained schedule and the topology-aware gate. Spec: ``shared/papers/fastermoe.md``.

Pure (no processes): :mod:`.perf_model` (§2.2 and the §2.5 speedup/pipeline model),
:mod:`.roofline` (§2.3), :mod:`.schedule` (§2.5 step plan), :mod:`.shadow` (§2.4 policy),
:func:`.topo_gate.topo_route` (§2.6). Runtime: :class:`.layer.FasterMoELayer` (a ``MoELayer``
subclass) with :mod:`.smart_schedule`; options in :mod:`.options`. Simulator: :mod:`.sim_graph`
(the same plan priced by ``moelab.sim``). Reproduction: :mod:`moelab.papers.fastermoe` (``notebooks/fastermoe.ipynb``;
its timing helper :mod:`moelab.papers.fastermoe.bench`).

Registered as strategy ``fastermoe``: ``parallel.strategy: fastermoe`` with
``parallel.strategy_options`` such as ``{shadow: true}``, ``{smart: true, group_size: 2}``,
``{topo_gate: true, topo_fraction: 0.14}``; ``{shadow_force: [0]}`` forces a shadow set (tests,
exploration). With no options it is the FastMoE baseline (synchronous sparse EP).
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.fastermoe.layer import FasterMoELayer
from moelab.strategies.fastermoe.options import FasterMoEOptionError, FasterMoEOptions
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: FasterMoEOptions):
    """The layer class of a run: FasterMoELayer with the run's (already checked) options bound."""
    return functools.partial(FasterMoELayer, options=opts)


STRATEGY = register_strategy(Strategy(
    "fastermoe", options=FasterMoEOptions, layer=layer_factory,
    techniques=(Technique("fastermoe", "placement", owns=("place", "combine_postprocess", "dispatch_compute_combine"),
        wraps=("route", "forward"),
        sim="moelab.strategies.fastermoe.sim_graph:fastermoe_contribution",
        doc="dynamic shadowing (place, local rows added in combine_postprocess); the smart schedule replaces the "
        "dispatch chain when on"),),
    sim_graph="moelab.strategies.fastermoe.sim_graph:fastermoe_iteration_graph",
    conformance=({}, {"shadow_force": [0, 3]}, {"shadow": True, "shadow_net_bw": 1e3}, {"smart": True, "group_size": 1},
                 {"smart": True, "group_size": 1, "shadow_force": [1]}, {"topo_gate": True}),
    changes_model=("topo_gate",),
    placement_policies=(("FasterMoE shadowing", "moelab.strategies.fastermoe.explore:shadowing"),),
    doc="FasterMoE: dynamic shadowing, smart schedule, topology-aware gate (FastMoE without options)"))

__all__ = ["STRATEGY", "layer_factory", "FasterMoEOptions", "FasterMoEOptionError"]
