"""The MoE layer of the ``fsdp_expert`` baseline: FSDP applied to each layer's experts (spec
``papers/hecate.md`` §3 "FSDP", §5.1 ``P' = D×E``).

Parameters. All ``E`` experts of the layer live in one flat buffer ``full`` (the stacked ``w1, b1,
w2, b2`` one after the other, ``E × expert numel`` elements padded to a multiple of N); the stacked
parameters of :class:`~moelab.moe.experts.Experts` are views into it (with their own version
counters, as ZeRO's). Rank r *owns* block r of it, ``shard`` (a leaf tensor outside the module's
parameters, optimized by :class:`.update.FsdpExpertUpdate` with its Adam state); ``full``'s storage is
resident only while the layer needs it (resized to 0 otherwise).

One call. Route, count exchange, placement (every rank holds every expert, :func:`full_replication`),
plan and the identity all-to-alls are :class:`~moelab.strategies.zero.layer.ZeroMoELayer`'s: each rank
runs all of its own tokens through all experts locally. The ``materialize`` stage is the all-gather:
one autograd Function (``_GatherFn``) passes the layer input through and hands the experts' stacks
out as aliases of ``full``; its backward reduce-scatters the layer's flat local expert gradient onto
the shard. Passing ``x`` through orders the gather before the experts in forward and the
reduce-scatter after the experts' backward on every rank by data dependence (as the core's
Materializer), so a rank with no token still joins both collectives. The stacked parameters also
receive the local (unreduced) gradients, so the layer used on its own reports what ZeRO's does
(their sum over ranks is the model's gradient); the update drops them.

``reshard_after_forward``: the storage is freed when the forward returns and a gradient hook on the
layer output gathers it again when the layer's backward starts (the aliases the experts saved for
backward see the refilled storage). Without it the storage is freed when the last pending backward
of the layer has reduce-scattered.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moelab.moe.experts import Experts
from moelab.strategies.fsdp_expert.options import FsdpExpertOptions
from moelab.strategies.zero.layer import ZeroMoELayer, full_replication

__all__ = ["FsdpExpertMoELayer", "full_replication"]


class _GatherFn(torch.autograd.Function):
    """``(x, *stacks) = f(x, layer, shard, *stacked params)``: all-gather in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, layer, shard, *stacked):
        ctx.layer = layer
        ctx.tags = dict(layer.comm.rec.tags)
        layer.gather("param_gather")
        return (x, *layer.aliases())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_x, *g_stacks):
        layer, ctx.layer = ctx.layer, None
        with layer.comm.rec.tagged(**{**ctx.tags, "phase": "grad_reduce_scatter"}):
            g_shard = layer.comm.reduce_scatter(layer.flat_grad(g_stacks), group=layer.group)
        layer.backward_done()
        return (g_x, None, g_shard, *g_stacks)


class FsdpExpertMoELayer(ZeroMoELayer):
    """:class:`ZeroMoELayer` whose experts are sharded 1/N per rank and all-gathered per call."""

    group = "dp"

    def __init__(self, d_model, d_ff, moe_cfg, layer_id=0, seed=0, comm=None, placement=None,
                 dtype=torch.float32, options: Optional[FsdpExpertOptions] = None):
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype, options=options or FsdpExpertOptions())
        ranks = self.comm.group_ranks(self.group)
        self.N, self.shard_index = len(ranks), ranks.index(self.comm.rank)
        stacks = [p for p in self.experts.stacked() if p is not None]
        self.numel = sum(p.numel() for p in stacks)
        self.padded = -(-self.numel // self.N) * self.N
        self.shard_numel = self.padded // self.N
        self.full = torch.zeros(self.padded, dtype=dtype)
        self.layout = []  # (offset, shape) of each stacked parameter in ``full`` (None: no bias)
        off = 0
        with torch.no_grad():
            for p in self.experts.stacked():
                if p is None:
                    self.layout.append(None)
                    continue
                self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + p.numel()].view_as(p)
                self.layout.append((off, tuple(p.shape)))
                off += p.numel()
        lo = self.shard_index * self.shard_numel
        self.shard = self.full[lo:lo + self.shard_numel].clone().requires_grad_(True)  # owned: Adam steps it
        self.full_bytes = self.padded * self.full.element_size()  # S
        self.driver = None  # the update, told when storage is (re)allocated (memory accounting)
        self._resident = True
        self._pinned = False
        self._pending = 0  # forward calls whose backward has not reduce-scattered yet
        self._call_stacks: Optional[list] = None
        self.release()

    # ---- the gathered buffer's lifecycle ---------------------------------------------------------------
    @property
    def resident(self) -> bool:
        """Whether ``full`` (every expert of the layer) is resident on this rank."""
        return self._resident

    def gather(self, phase: str) -> None:
        """Collective over ``dp``: every rank's shard into ``full`` (nothing if already resident)."""
        if self._resident:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        with self.comm.rec.tagged(layer=self.layer_id, phase=phase), torch.no_grad():
            g = self.comm.all_gather(self.shard.detach(), group=self.group)
            self.full.copy_(g.reshape(-1))  # full's version counter only: saved aliases stay valid
        self._resident = True
        if self.driver is not None:
            self.driver.gathered(self)

    def release(self) -> None:
        """Free ``full``'s storage (the stacked parameters keep their shapes, no data)."""
        if self._resident and not self._pinned:
            self.full.untyped_storage().resize_(0)
            self._resident = False

    @contextlib.contextmanager
    def gathered(self, phase: str = "param_gather_inspect"):
        """``with layer.gathered(): ...`` - every expert resident inside (a collective on every rank);
        forward calls inside compute with the stacked parameters, without gathering or reduce-scattering."""
        self.gather(phase)
        self._pinned = True
        try:
            yield self
        finally:
            self._pinned = False
            if self._pending == 0:
                self.release()

    def aliases(self) -> list:
        """The stacked parameters as fresh tensors on ``full``'s storage (own version counters: the
        backward re-gather writes ``full`` without invalidating what the experts saved)."""
        st = self.full.untyped_storage()
        out = []
        for lay in self.layout:
            if lay is None:
                out.append(None)
                continue
            off, shape = lay
            out.append(torch.empty(0, dtype=self.full.dtype).set_(st, off, shape,
                                                                  torch.empty(shape, device="meta").stride()))
        return out

    def flat_grad(self, grads) -> torch.Tensor:
        """The layer's local expert gradient in ``full``'s layout (zeros where autograd gave none)."""
        flat = torch.zeros(self.padded, dtype=self.full.dtype)
        for lay, g in zip([lay for lay in self.layout if lay is not None], grads):
            if g is not None:
                off, shape = lay
                flat[off:off + g.numel()].copy_(g.reshape(-1))
        return flat

    def backward_done(self) -> None:
        self._pending -= 1
        if self.options.reshard_after_forward or self._pending == 0:
            self.release()

    def _regather(self, grad):
        self.gather("param_gather_bwd")
        return None

    # ---- the stages ------------------------------------------------------------------------------------
    def materialize(self, x, plan):
        """The all-gather of the layer's experts (skipped while :meth:`gathered` pins them)."""
        self.last_materialized = ()
        if self._pinned:
            self._call_stacks = None
            return x
        stacked = [p for p in self.experts.stacked() if p is not None]
        x, *aliases = _GatherFn.apply(x, self, self.shard, *stacked)
        if torch.is_grad_enabled():
            self._pending += 1
        it = iter(aliases)
        self._call_stacks = [None if lay is None else next(it) for lay in self.layout]
        return x

    def compute_experts(self, xe, plan):
        """Slot s = expert s on its rows, with this call's gathered stacks (the core's FFN arithmetic)."""
        if self._call_stacks is None:
            return super().compute_experts(xe, plan)
        w1, b1, w2, b2 = [None if t is None else t.unbind(0) for t in self._call_stacks]
        outs, start = [], 0
        for s, n in enumerate(plan.rows_per_slot):
            n = int(n)
            if n:
                outs.append(Experts._ffn(self.experts.act, xe[start:start + n], w1[s],
                                         None if b1 is None else b1[s], w2[s], None if b2 is None else b2[s]))
            start += n
        if not outs:  # keep the graph connected (the reduce-scatter must run on every rank)
            return xe * 1
        return torch.cat(outs, 0)

    def forward(self, x):
        try:
            y = super().forward(x)
        finally:
            self._call_stacks = None
        if self._pinned:
            return y
        if not (torch.is_grad_enabled() and y.requires_grad):
            if self._pending == 0:
                self.release()  # no backward will come for this call
        elif self.options.reshard_after_forward:
            self.release()
            y.register_hook(self._regather)
        return y
