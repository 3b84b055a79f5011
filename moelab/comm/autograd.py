"""Autograd-aware collectives on named groups: the blocks tensor- and expert-sharded layers are made of.

Each is one ``torch.autograd.Function`` whose forward and backward both go through the comm door
(:class:`moelab.comm.door.Communicator`: recorded, numbered, emulated), the backward tagged
``phase=bwd``. They are the conjugate pairs of Megatron-style model parallelism, named by what
they do to rows of a tensor (``dim`` picks the axis):

=================  ==============================  =================================
block              forward                          backward
=================  ==============================  =================================
``gather_rows``    all-gather, concatenate          keep own block (grads replicated)
``split_rows``     keep own block                   all-gather the grads
``reduce_fwd``     all-reduce sum ("g")             identity
``reduce_bwd``     identity ("f")                   all-reduce sum
``all_to_all``     equal-split all-to-all           the reverse all-to-all
=================  ==============================  =================================

Under grad mode each output requires grad even when the input does not (a zero-size anchor
input), so a rank whose own input is constant still runs the backward collective its peers run:
no hang. Received blocks are written into fresh contiguous buffers (never ``empty_like`` of a
strided view: Parm spec P16).
"""
from __future__ import annotations

import torch


def _anchor() -> torch.Tensor:
    return torch.empty(0, requires_grad=torch.is_grad_enabled())


def _member(comm, group: str) -> tuple:
    ranks = comm.group_ranks(group)
    return ranks.index(comm.rank), len(ranks)


def _gather(comm, x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    parts = comm.all_gather(x.contiguous(), group=group)  # [n, *x.shape]
    return torch.cat(list(parts.unbind(0)), dim=dim)


def _own(comm, x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    me, n = _member(comm, group)
    if x.shape[dim] % n:
        raise ValueError(f"split_rows: dim {dim} of size {x.shape[dim]} does not split over group {group!r} of {n}")
    b = x.shape[dim] // n
    return x.narrow(dim, me * b, b).contiguous()


class _Op(torch.autograd.Function):
    """One conjugate pair: ``fwd`` and ``bwd`` are ``(comm, tensor, group, dim) -> tensor``."""

    @staticmethod
    def forward(ctx, x, anchor, comm, group, dim, fwd, bwd):
        ctx.comm, ctx.group, ctx.dim, ctx.bwd = comm, group, dim, bwd
        ctx.tags = dict(comm.rec.tags)
        return fwd(comm, x, group, dim)

    @staticmethod
    def backward(ctx, g):
        with ctx.comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            gx = ctx.bwd(ctx.comm, g.contiguous(), ctx.group, ctx.dim)
        return gx, None, None, None, None, None, None


def _reduce(comm, x, group, dim):
    return comm.all_reduce_(x.clone(memory_format=torch.contiguous_format), group=group)


def _same(comm, x, group, dim):
    return x.view_as(x)


def _a2a(comm, x, group, dim):
    _, n = _member(comm, group)
    if x.shape[0] % n:
        raise ValueError(f"all_to_all: {x.shape[0]} rows do not split equally over group {group!r} of {n}")
    rows = [x.shape[0] // n] * n
    return comm.all_to_all_raw(x.contiguous(), rows, rows, group)


def gather_rows(comm, x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    """All members' ``x`` concatenated along ``dim`` (member order); backward keeps this member's block."""
    return _Op.apply(x, _anchor(), comm, group, dim, _gather, _own)


def split_rows(comm, x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    """This member's 1/n block of ``dim`` (``x`` replicated over the group); backward all-gathers the grads."""
    return _Op.apply(x, _anchor(), comm, group, dim, _own, _gather)


def reduce_fwd(comm, x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group (partial sums in, replicated total out); backward is the identity."""
    return _Op.apply(x, _anchor(), comm, group, 0, _reduce, _same)


def reduce_bwd(comm, x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity (a replicated input enters sharded work); backward sums the partial grads over the group."""
    return _Op.apply(x, _anchor(), comm, group, 0, _same, _reduce)


def all_to_all(comm, x: torch.Tensor, group: str) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (block i to member i); backward is the reverse all-to-all."""
    return _Op.apply(x, _anchor(), comm, group, 0, _a2a, _a2a)
