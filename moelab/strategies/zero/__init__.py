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

from moelab.strategies import register, register_update
from moelab.strategies.zero.options import ZeroOptionError, ZeroOptions
from moelab.strategies.zero.update import ZeroUpdate


def _options(run_cfg) -> ZeroOptions:
    opts = ZeroOptions.from_dict(run_cfg.parallel.strategy_options)
    opts.check_against(run_cfg.model.moe.dispatcher, has_placement=run_cfg.parallel.placement is not None)
    return opts


def layer_factory(run_cfg):
    """``run_cfg -> layer class`` taking MoELayer's constructor args, options bound and validated."""
    from moelab.strategies.zero.layer import ZeroMoELayer

    return functools.partial(ZeroMoELayer, options=_options(run_cfg))


register("zero", layer_factory)
register_update("zero", ZeroUpdate)  # the Trainer calls ZeroUpdate(model, comm, cfg): options from cfg

from moelab.strategies.zero import sim_graph  # noqa: E402,F401  (registers the simulator's graph)

__all__ = ["layer_factory", "ZeroOptions", "ZeroOptionError", "ZeroUpdate"]
