"""Lina's MoE layer: the core layer plus the combine marker (and, for ``lina_pipe``, the pipeline
of :mod:`.pipeline`).

:class:`CombineMarker` is an identity on the layer's output whose backward tells the rank's
scheduler that this layer's combine all-to-all is imminent (spec §2.2: "stop launching all-reduce
once the combine backward starts"), so no micro-op is launched into the gap right before it.
"""
from __future__ import annotations

import torch

from moelab.comm.view import GroupView
from moelab.moe.dispatch import from_capacity_buffer, to_capacity_buffer
from moelab.moe.layer import MoELayer
from moelab.placement import Placement
from moelab.strategies.lina.pipeline import PipelinedExperts


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
    """Packed (a block of P < N ranks, or the packing controller on): the core layer over its block's
    ``ep`` group (a :class:`moelab.comm.view.GroupView`), all E experts spread over the block's P ranks;
    the copies of a block's experts sum their gradients over ``expert_dp_group``. The controller moves a
    layer to a smaller block with :meth:`use_block` (and :func:`moelab.moe.migrate.move_experts`)."""

    def __init__(self, d_model, d_ff, moe_cfg, layer_id=0, seed=0, comm=None, placement=None, dtype=None,
                 options=None):
        import torch as _t

        self.expert_dp_group = None
        if options is not None and comm is not None:
            P = options.block_sizes(comm.world_size, moe_cfg.num_experts)[0]
            if P < comm.world_size or options.pack_controller:
                comm, placement = self._block_view(comm, options, P, moe_cfg.num_experts)
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype or _t.float32)
        self.options = options

    def _block_view(self, world, options, P: int, num_experts: int) -> tuple:
        ep, self.expert_dp_group = options.block_groups(P, world.world_size)
        view = GroupView(world, {"ep": ep})
        return view, Placement.expert_parallel(num_experts, view.world_size)

    def use_block(self, P: int):
        """Run expert parallelism over blocks of ``P`` ranks from now on; returns the layer's placement
        in the new block (the caller moves the expert slots into it: ``set_placement``)."""
        base = getattr(self.comm, "base", self.comm)
        self.comm, placement = self._block_view(base, self.options, P, self.cfg.num_experts)
        return placement

    def forward(self, x):
        y = super().forward(x)
        sched = self.comm.scheduler
        if torch.is_grad_enabled() and sched is not None and hasattr(sched, "stalls"):
            # cumulative counters of the rank's scheduler (so a run says whether its bounded waits fired)
            self.last_metrics = {"sched_stalls": sched.stalls,
                                 "sched_low_ops": sum(r["kind"] == "low" for r in sched.records),
                                 "experts_per_rank": len(self.experts.experts), "block": self.comm.world_size}
            decision = self.__dict__.pop("pack_decision", None)  # the packing controller's, this iteration
            if decision is not None:
                self.last_metrics["pack_decision"] = decision["decision"]
        if hasattr(self.comm, "base"):  # packed: the counts cover the block; the run's loads cover the world
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
        E, C = self.cfg.num_experts, plan.capacity
        buf = to_capacity_buffer(x, routing, E, C)
        out = PipelinedExperts.apply(buf, self.experts, self.comm, min(self.options.a2a_chunks, C),
                                     dict(self.comm.rec.tags))
        return from_capacity_buffer(out, routing, C)
