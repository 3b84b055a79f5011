"""Lina's MoE layer: the core layer plus the combine marker (and, for ``lina_pipe``, the pipeline
of :mod:`.pipeline`).

:class:`CombineMarker` is an identity on the layer's output whose backward tells the rank's
scheduler that this layer's combine all-to-all is imminent (spec §2.2: "stop launching all-reduce
once the combine backward starts"), so no micro-op is launched into the gap right before it.
"""
from __future__ import annotations

import torch

from moelab.moe.layer import MoELayer


class CombineMarker(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, comm):
        ctx.comm = comm
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        sched = ctx.comm.scheduler
        if sched is not None and hasattr(sched, "imminent"):
            sched.imminent()
        return g, None


class LinaMoELayer(MoELayer):
    """``options.q > 1`` (packing): the core layer over the ``lina_ep`` block (a
    :class:`moelab.comm.view.GroupView`), all E experts spread over its E/q ranks, q per rank; the
    copies of a block's experts sum their gradients over ``lina_edp`` (``expert_dp_group``)."""

    def __init__(self, d_model, d_ff, moe_cfg, layer_id=0, seed=0, comm=None, placement=None, dtype=None,
                 options=None):
        import torch as _t

        if options is not None and options.q > 1:
            from moelab.comm.view import GroupView
            from moelab.placement import Placement

            comm = GroupView(comm, {"ep": "lina_ep"})
            placement = Placement.expert_parallel(moe_cfg.num_experts, comm.world_size)
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype or _t.float32)
        self.options = options
        self.expert_dp_group = "lina_edp" if options is not None and options.q > 1 else None

    def forward(self, x):
        y = super().forward(x)
        sched = self.comm.scheduler
        if torch.is_grad_enabled() and sched is not None and hasattr(sched, "stalls"):
            # cumulative counters of the rank's scheduler (so a run says whether its bounded waits fired)
            self.last_metrics = {"sched_stalls": sched.stalls, "sched_low_ops": sum(r["kind"] == "low" for r in sched.records)}
        if self.expert_dp_group is not None:  # packed: the counts cover the block; the run's loads cover the world
            world = self.comm.base
            with world.rec.paused():
                self.last_global_counts = world.all_gather(self.last_counts, group="world")
        return y

    def dispatch_compute_combine(self, x, plan, routing):
        if self.options is not None and self.options.pipelined:
            y = self._pipelined(x, plan, routing)
        else:
            y = super().dispatch_compute_combine(x, plan, routing)
        return CombineMarker.apply(y, self.comm) if torch.is_grad_enabled() else y

    def _pipelined(self, x, plan, routing):
        """``lina_pipe``: the capacity buffer through :class:`~.pipeline.PipelinedExperts` in
        ``a2a_chunks`` micro-ops (the dense dispatcher's layout, so ``a2a_chunks=1`` is the plain path)."""
        from moelab.moe.dispatch import from_capacity_buffer, to_capacity_buffer
        from moelab.strategies.lina.pipeline import PipelinedExperts

        E, C = self.cfg.num_experts, plan.capacity
        buf = to_capacity_buffer(x, routing, E, C)
        out = PipelinedExperts.apply(buf, self.experts, self.comm, min(self.options.a2a_chunks, C),
                                     dict(self.comm.rec.tags))
        return from_capacity_buffer(out, routing, C)
