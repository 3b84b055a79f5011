"""``fsdp_expert``: FSDP of each MoE layer's experts, the Hecate paper's FSDP baseline (spec
``shared/papers/hecate.md`` §3 "FSDP", §5.1 ``P' = D×E``, §5.5 AllGather bytes ``(N-1)/N S``).

Each MoE layer's ``E`` experts form one flat buffer padded to a multiple of N, sharded 1/N per rank
(the shard and its Adam state are all a rank owns of the experts). Per layer per iteration: an
all-gather of the whole layer before its experts compute (every rank runs all of its own tokens
through all experts, no token all-to-all), a reduce-scatter of the layer's flat expert gradient in
its backward (:mod:`.layer`); with ``reshard_after_forward`` the gathered buffer is freed after the
forward and gathered again when the layer's backward starts. Dense parameters are plain data
parallel (:mod:`.update`). The simulator prices the same plan (:mod:`.sim_graph`).

Registered as strategy ``fsdp_expert``: ``parallel.strategy: fsdp_expert`` with the options of
:mod:`.options` (``reshard_after_forward``, ``global_loads``).
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.fsdp_expert.layer import FsdpExpertMoELayer
from moelab.strategies.fsdp_expert.options import FsdpExpertOptionError, FsdpExpertOptions
from moelab.strategies.fsdp_expert.update import FsdpExpertUpdate
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: FsdpExpertOptions):
    """The layer class of a run: FsdpExpertMoELayer with the run's (already checked) options bound."""
    return functools.partial(FsdpExpertMoELayer, options=opts)


STRATEGY = register_strategy(Strategy(
    "fsdp_expert", options=FsdpExpertOptions, layer=layer_factory, update=FsdpExpertUpdate,
    techniques=(Technique("fsdp_expert", "placement",
        owns=("exchange_counts", "plan", "token_dispatch", "token_combine", "materialize", "update", "expert_layout"),
        wraps=("compute_experts", "forward"), doc="every expert gathered before the layer, no token all-to-all"),),
    sim_graph="moelab.strategies.fsdp_expert.sim_graph:fsdp_expert_iteration_graph",
    conformance=({}, {"reshard_after_forward": True}),
    doc="FSDP of each MoE layer's experts (all-gather before the layer, reduce-scatter in its backward); "
        "dense data parallel"))

__all__ = ["STRATEGY", "layer_factory", "FsdpExpertOptions", "FsdpExpertOptionError", "FsdpExpertUpdate"]
