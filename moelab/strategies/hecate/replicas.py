"""One layer's replicas in one call: the pool they live in, the autograd boundary that gathers them in
forward and reduce-scatters their gradients in backward, and re-materialization (spec §2.8).

The replicas of a call are rows of one pool tensor (one storage), so re-materialization can free and
refill them at once: after the layer's forward the storage is resized to 0 (the experts' saved tensors
are views of it, so nothing else keeps the bytes alive) and, when the *next* layer's expert backward
ends, a sparse all-gather re-fetches the owners' parameters (unchanged: the optimizer has not stepped)
into the same storage through an alias, which leaves the version counter autograd checks untouched.
:class:`_RMGate` sits on the experts' output, so its backward — which waits for that gather — runs
right before the experts' backward needs the weights.
"""
from __future__ import annotations

from typing import Optional

import torch


class ReplicaPool:
    """The flat replicas ``{expert: row}`` of one call, rows of one ``[n, numel]`` storage."""

    def __init__(self, flats: dict, numel: int, dtype):
        self.experts = tuple(sorted(flats))
        self.pool = torch.empty((len(self.experts), numel), dtype=dtype)
        for i, e in enumerate(self.experts):
            self.pool[i].copy_(flats[e].reshape(-1))
        self.nbytes = self.pool.numel() * self.pool.element_size()
        self.released = False

    def rows(self) -> list:
        return [self.pool[i] for i in range(len(self.experts))]

    def release(self) -> None:
        """Free the bytes (RM); the rows keep their shapes and the autograd graph its references."""
        if self.experts and not self.released:
            self.pool.untyped_storage().resize_(0)
            self.released = True

    def refill(self, flats: dict) -> None:
        """Put the re-gathered rows back into the same storage without touching the version counter."""
        if not self.released:
            return
        st = self.pool.untyped_storage()
        st.resize_(self.nbytes)
        alias = torch.empty(0, dtype=self.pool.dtype).set_(st, 0, self.pool.shape)
        with torch.no_grad():
            for i, e in enumerate(self.experts):
                alias[i].copy_(flats[e].reshape(-1))
        self.released = False

    def storage_bytes(self) -> int:
        return int(self.pool.untyped_storage().nbytes())


class _Materialize(torch.autograd.Function):
    """``(x, *replica rows) = f(x, call, *stacked params)``: the gathered replicas enter the graph here;
    backward reduce-scatters their gradients to the owners (:meth:`HecateCall.backward_end`)."""

    @staticmethod
    def forward(ctx, x, call, *params):
        ctx.call = call
        ctx.has = [p is not None for p in params]
        ctx.shapes = [None if p is None else p.shape for p in params]
        ctx.like = next(p for p in params if p is not None)
        return (x, *call.pool.rows())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_x, *g_rows):
        call = ctx.call
        acc = call.backward_end(g_rows)  # None: the driver adds the owners' sums in its sync
        ctx.call = None
        if acc is None:
            return (g_x, None, *[None] * len(ctx.has))
        return (g_x, None, *acc)


class _RMGate(torch.autograd.Function):
    """Identity on the experts' output; its backward waits for the re-materialized replicas."""

    @staticmethod
    def forward(ctx, ye, call):
        ctx.call = call
        return ye.view_as(ye)

    @staticmethod
    def backward(ctx, g):
        ctx.call.before_expert_backward()
        ctx.call = None
        return g, None


def materialize(x, call, params):
    """Run ``call``'s replicas into the graph: returns ``(x, rows)``."""
    x, *rows = _Materialize.apply(x, call, *params)
    return x, rows


def rm_gate(ye, call: Optional[object]):
    return ye if call is None else _RMGate.apply(ye, call)
