"""Lina's MoE layer: the core layer plus the combine marker (and, for ``lina_pipe``, the pipeline).

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
    def __init__(self, *args, options=None, **kw):
        super().__init__(*args, **kw)
        self.options = options

    def dispatch_compute_combine(self, x, plan, routing):
        y = super().dispatch_compute_combine(x, plan, routing)
        return CombineMarker.apply(y, self.comm) if torch.is_grad_enabled() else y
