"""Materialization: bring the parameters of experts this call's placement puts on ranks that do not
hold them, and return their gradients to the owner.

Given the static placement (who holds each expert) and this call's placement (who computes it,
:mod:`moelab.placement.policy`), every expert with a computing rank outside its static holders is
*materialized*: in forward its owner's current parameters (one flat buffer per expert) are
broadcast over the group (``Communicator.broadcast_``); in backward every rank's gradient of that
buffer is summed onto the owner (``Communicator.reduce_``; a rank that computed nothing for it
joins with zeros) and returned as the gradient of the owner's stacked parameters, so autograd
*adds* it to what the owner's own rows gave (micro-batches accumulate). Nothing is kept across
calls: the buffers live in the call's autograd graph only (parameters change every step).

The transport is one ``fetch`` / ``give_back`` pair per expert, the unit a schedule can issue on
its own stream (FasterMoE's smart schedule does), and ``fetch_all`` / ``give_back_all`` for the
whole call, which the autograd path uses. A broadcast to the whole group is the simple transport
(ranks that do not compute the expert receive and drop it); Hecate's sparse all-gather /
reduce-scatter (one all-to-all to the computing ranks only) is a subclass overriding the two
``_all`` methods.

Ordering: :meth:`Materializer.apply` is one autograd Function that passes the layer input ``x``
through. Every consumer of the call's rows (dispatch, locally computed rows) reads that ``x``, so
the broadcasts run before the dispatch all-to-all in forward and the reduces after its backward,
on every rank alike, by data dependence rather than by the autograd engine's scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from moelab.moe.experts import expert_param_shapes, flatten_slot, unflatten
from moelab.placement import Placement


@dataclass(frozen=True)
class Materialization:
    """What one call materializes, as data (identical on every rank)."""

    experts: Tuple[int, ...]  # ascending
    owners: Tuple[int, ...]  # static owner of each: the source of its parameters, the sink of its grads
    slots: Tuple[int, ...]  # the expert's slot on its owner
    totals: Tuple[int, ...]  # rows routed to it over all sources (0: no gradient returned, as plain EP)

    @classmethod
    def of(cls, static: Placement, experts: Sequence[int], counts) -> "Materialization":
        experts = tuple(sorted(int(e) for e in experts))
        owners = tuple(static.owner(e) for e in experts)
        totals = torch.as_tensor(counts).to(torch.int64).sum(0)
        return cls(experts, owners, tuple(static.slot_of(o, e) for o, e in zip(owners, experts)),
                   tuple(int(totals[e]) for e in experts))

    @classmethod
    def between(cls, static: Placement, placement: Placement, counts) -> "Materialization":
        """The experts ``placement`` puts on a rank outside their static holders."""
        if (placement.num_experts, placement.world_size) != (static.num_experts, static.world_size):
            raise ValueError("this call's placement and the static one differ in experts or ranks")
        new = [e for e in range(static.num_experts) if set(placement.holders[e]) - set(static.holders[e])]
        return cls.of(static, new, counts)


class Materializer:
    """The collectives of one call's :class:`Materialization` over ``comm``'s group, on ``experts``
    (the rank's :class:`~moelab.moe.experts.Experts` store)."""

    def __init__(self, comm, experts, plan: Materialization, group: str = "world"):
        self.comm, self.plan, self.group = comm, plan, group
        self.me = comm.rank
        self.shapes = expert_param_shapes(experts)

    def fetch(self, params: Sequence[Optional[torch.Tensor]], i: int) -> torch.Tensor:
        """Collective: the owner's current parameters of ``plan.experts[i]`` as one flat buffer, on
        every rank (``params``: the stacked ``[w1, b1, w2, b2]``)."""
        o, slot = self.plan.owners[i], self.plan.slots[i]
        if self.me == o:
            buf = flatten_slot(params, slot).clone()
        else:
            real = [p for p in params if p is not None]
            buf = torch.empty(sum(p[0].numel() for p in real), dtype=real[0].dtype, device=real[0].device)
        self.comm.broadcast_(buf, root=o, group=self.group)
        return buf

    def views(self, buf: torch.Tensor) -> list:
        """``[w1, b1, w2, b2]`` views of a fetched buffer (None where there is no bias)."""
        return unflatten(buf, self.shapes)

    def give_back(self, i: int, flat_grad: torch.Tensor, acc: list) -> None:
        """Collective: SUM every rank's ``flat_grad`` of ``plan.experts[i]`` onto its owner, which
        adds it into ``acc`` (grads shaped like the stacked parameters)."""
        o = self.plan.owners[i]
        self.comm.reduce_(flat_grad, root=o, group=self.group)
        if self.me != o or self.plan.totals[i] == 0:
            return
        for j, g in enumerate(self.views(flat_grad)):
            if g is not None:
                acc[j][self.plan.slots[i]] += g

    def fetch_all(self, params: Sequence[Optional[torch.Tensor]]) -> list:
        """Every materialized expert's flat buffer, in ``plan.experts`` order."""
        return [self.fetch(params, i) for i in range(len(self.plan.experts))]

    def give_back_all(self, flat_grads: Sequence[torch.Tensor], acc: list) -> None:
        """Every materialized expert's flat gradient back to its owner, in ``plan.experts`` order."""
        for i, g in enumerate(flat_grads):
            self.give_back(i, g, acc)

    def owner_gets_grads(self) -> bool:
        """Whether ``give_back`` hands this rank a gradient (it owns an expert with rows somewhere);
        otherwise the stacked parameters get no gradient from materialization (None, as plain EP)."""
        return any(o == self.me and t > 0 for o, t in zip(self.plan.owners, self.plan.totals))

    def apply(self, x: torch.Tensor, params: Sequence[Optional[torch.Tensor]]):
        """``(x, {e: [w1, b1, w2, b2]})``: ``x`` passed through (see the module doc on ordering), the
        materialized experts' parameters as differentiable views of their fetched buffers."""
        if not self.plan.experts:
            return x, {}
        x, *bufs = _MaterializeFn.apply(x, self, *params)
        return x, {e: self.views(b) for e, b in zip(self.plan.experts, bufs)}


class _MaterializeFn(torch.autograd.Function):
    """``(x, *buffers) = f(x, materializer, *stacked params)``: broadcasts in forward, reduces in backward."""

    @staticmethod
    def forward(ctx, x, mat: Materializer, *params):
        ctx.mat = mat
        ctx.tags = dict(mat.comm.rec.tags)  # the layer's tags, for the backward's records
        ctx.save_for_backward(*[p for p in params if p is not None])
        ctx.has = [p is not None for p in params]
        return (x, *mat.fetch_all(params))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_x, *g_bufs):
        mat, saved = ctx.mat, iter(ctx.saved_tensors)
        params = [next(saved) if h else None for h in ctx.has]
        acc = [None if p is None else torch.zeros_like(p) for p in params]
        real = [p for p in params if p is not None]
        n = sum(p[0].numel() for p in real)  # a rank that computed nothing for an expert joins with zeros
        flats = [torch.zeros(n, dtype=real[0].dtype, device=real[0].device) if g is None else g.contiguous().clone()
                 for g in g_bufs]
        with mat.comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            mat.give_back_all(flats, acc)
        ctx.mat = None
        grads = acc if mat.owner_gets_grads() else [None] * len(acc)
        return (g_x, None, *grads)
