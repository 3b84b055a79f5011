"""ZeRO (stages 1/2/3) data parallelism of the whole MoE model: FasterMoE's main baseline
(spec ``shared/papers/fastermoe.md`` §3: DeepSpeed ZeRO with FastMoE ``world_size=1`` inside).

Every rank holds every expert (:func:`.layer.full_replication`) and runs its own tokens through all
of them locally (:class:`.layer.ZeroMoELayer`: no dispatch, no all-to-all); dense and expert
parameters are data-parallel, with optimizer state (stage 1), gradients (2) and parameters (3)
sharded by :class:`.update.ZeroUpdate` over flat, padded buffers. Stage 0 is plain data
parallelism of the same model (the unsharded memory reference). The simulator prices the same
iteration with :mod:`.sim_graph` (registered as ``"zero"``).

Registered as strategy ``zero``: ``parallel.strategy: zero`` with ``parallel.strategy_options``
``{stage: 1|2|3}`` (default 3) and the options of :mod:`.options`.
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.zero.layer import ZeroMoELayer
from moelab.strategies.zero.options import ZeroOptionError, ZeroOptions
from moelab.strategies.zero.update import ZeroUpdate
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: ZeroOptions):
    """The layer class of a run: ZeroMoELayer with the run's (already checked) options bound."""
    return functools.partial(ZeroMoELayer, options=opts)


STRATEGY = register_strategy(Strategy(
    "zero", options=ZeroOptions, layer=layer_factory, update=ZeroUpdate,  # ZeroUpdate(model, comm, cfg)
    techniques=(Technique("zero", "placement",
        owns=("exchange_counts", "plan", "token_dispatch", "token_combine", "update", "expert_layout"),
        doc="every expert on every rank, ZeRO-sharded update"),),
    sim_graph="moelab.strategies.zero.sim_graph:zero_iteration_graph",
    conformance=({"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "regather_backward": False}),
    doc="ZeRO-1/2/3 data parallelism of the whole MoE model (FasterMoE's baseline)"))

__all__ = ["STRATEGY", "layer_factory", "ZeroOptions", "ZeroOptionError", "ZeroUpdate"]
