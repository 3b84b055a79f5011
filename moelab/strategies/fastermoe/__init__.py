"""FasterMoE (PPoPP'22) in moelab: performance model, DDL-Roofline, dynamic shadowing, smart
fine-grained schedule and the topology-aware gate. Spec: ``shared/papers/fastermoe.md``.

Pure (no processes): :mod:`.perf_model` (§2.2 and the §2.5 speedup/pipeline model),
:mod:`.roofline` (§2.3), :mod:`.schedule` (§2.5 step plan), :mod:`.shadow` (§2.4 policy),
:func:`.topo_gate.topo_route` (§2.6). Runtime: :class:`.layer.FasterMoELayer` (a ``MoELayer``
subclass) with :mod:`.smart_schedule`; options in :mod:`.options`. Simulator: :mod:`.sim_graph`
(the same plan priced by ``moelab.sim``); timing helper: :mod:`.bench`.

Registered as strategy ``fastermoe``: ``parallel.strategy: fastermoe`` with
``parallel.strategy_options`` such as ``{shadow: true}``, ``{smart: true, group_size: 2}``,
``{topo_gate: true, topo_fraction: 0.14}``; ``{shadow_force: [0]}`` forces a shadow set (tests,
exploration). With no options it is the FastMoE baseline (synchronous sparse EP).
"""
from __future__ import annotations

import functools

from moelab.strategies import register
from moelab.strategies.fastermoe.options import FasterMoEOptionError, FasterMoEOptions


def layer_factory(run_cfg):
    """``run_cfg -> layer class`` taking MoELayer's constructor args, options bound and validated."""
    from moelab.strategies.fastermoe.layer import FasterMoELayer

    opts = FasterMoEOptions.from_dict(run_cfg.parallel.strategy_options)
    moe = run_cfg.model.moe
    opts.check_against(moe.num_experts, run_cfg.parallel.nproc, moe.top_k, moe.gate, moe.dispatcher,
                       has_placement=run_cfg.parallel.placement is not None)
    return functools.partial(FasterMoELayer, options=opts)


register("fastermoe", layer_factory)

from moelab.strategies.fastermoe import sim_graph  # noqa: E402,F401  (registers the simulator's graph)

__all__ = ["layer_factory", "FasterMoEOptions", "FasterMoEOptionError"]
