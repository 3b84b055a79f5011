"""Permute and unpermute: token rows into expert-contiguous order by a dispatch plan, and back with the
weighted combine fused in.

A :class:`PermutePlan` comes from the routing (``idx [T, k]``, -1 = dropped): ``src[i]`` is the token of
row ``i`` of the expert-contiguous buffer (experts in order, tokens in order inside), ``pos[t, j]`` the
row of token t's j-th slot (-1 when dropped), ``counts[e]`` the rows of expert e. Every direction, forward
and backward, is then a gather, so no kernel needs atomics and results do not depend on scheduling:

- permute ``out[i] = x[src[i]]``; its backward ``dx[t] = sum_j dout[pos[t, j]]`` (a combine with weight 1);
- unpermute ``y[t] = sum_j w[t, j] * rows[pos[t, j]]``; its backward ``drows[i] = w_of_row[i] * dy[src[i]]``
  (a permute with a scale) and ``dw[t, j] = <dy[t], rows[pos[t, j]]>``.

Each op takes ``impl="torch"`` (the reference) or ``"triton"``; both accumulate in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from moelab.kernels import acc_dtype, tl_acc


@dataclass(frozen=True)
class PermutePlan:
    src: torch.Tensor  # [S] int64: token of each expert-contiguous row
    pos: torch.Tensor  # [T, k] int64: row of each slot, -1 = dropped
    counts: Optional[torch.Tensor]  # [E] int64: rows per expert (None when the rows are not expert-contiguous)
    slot: torch.Tensor  # [S] int64: flat slot (t * k + j) of each row


def plan_of_rows(slots: torch.Tensor, shape, counts: Optional[torch.Tensor] = None) -> PermutePlan:
    """The plan of a buffer whose row ``i`` holds flat slot ``slots[i]`` (``t * k + j``) of a ``[T, k]``
    routing; slots not listed (dropped, shadowed) map to -1. Any row order: the sparse dispatcher's send
    order (destination-major) as well as :func:`plan`'s expert-contiguous one."""
    T, k = shape
    pos = torch.full((T * k,), -1, dtype=torch.int64, device=slots.device)
    pos[slots] = torch.arange(slots.numel(), device=slots.device)
    return PermutePlan(slots // k, pos.view(T, k), counts, slots)


def plan(idx: torch.Tensor, num_experts: int) -> PermutePlan:
    """The expert-contiguous layout of the kept slots of ``idx`` (stable: token order inside an expert)."""
    flat = idx.reshape(-1)
    kept = (flat >= 0).nonzero().squeeze(1)
    order = kept[torch.sort(flat[kept], stable=True).indices]
    return plan_of_rows(order, idx.shape, torch.bincount(flat[kept], minlength=num_experts))


# ---- torch references ------------------------------------------------------------------------------------
def _gather_torch(x, src, scale=None):
    out = x.index_select(0, src)
    return out if scale is None else out * scale.unsqueeze(1).to(out.dtype)


def _picked(rows, pos):
    T, k = pos.shape
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # row -1: zeros
    return padded.index_select(0, torch.where(pos >= 0, pos, rows.shape[0]).reshape(-1)).view(T, k, rows.shape[1])


def _combine_torch(rows, pos, w):
    acc = acc_dtype(rows.dtype)
    return torch.einsum("tk,tkd->td", w.to(acc), _picked(rows, pos).to(acc)).to(rows.dtype)


def _rowdot_torch(dy, rows, pos):
    acc = acc_dtype(rows.dtype)
    return torch.einsum("td,tkd->tk", dy.to(acc), _picked(rows, pos).to(acc))


# ---- Triton kernels --------------------------------------------------------------------------------------
@functools.cache  # compiled (or interpreted) once, on first use: importing moelab needs no Triton
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(x, src, scale, out, D, HAS_SCALE: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = cols < D
        s = tl.load(src + i)
        v = tl.load(x + s * D + cols, mask=m, other=0.0).to(ACC)
        if HAS_SCALE:
            v = v * tl.load(scale + i).to(ACC)
        tl.store(out + i * D + cols, v.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def combine(rows, pos, w, out, D, K: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = cols < D
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        for j in tl.static_range(K):
            p = tl.load(pos + t * K + j)
            wj = tl.load(w + t * K + j).to(ACC)
            keep = m & ((cols * 0 + p) >= 0)  # the slot's flag as a vector (the interpreter wants one)
            acc += wj * tl.load(rows + p * D + cols, mask=keep, other=0.0).to(ACC)
        tl.store(out + t * D + cols, acc.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def rowdot(dy, rows, pos, dw, D, K: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        for j in tl.static_range(K):
            p = tl.load(pos + t * K + j)
            acc = tl.zeros([BLOCK_D], dtype=ACC)
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                keep = (cols < D) & ((cols * 0 + p) >= 0)
                acc += (tl.load(dy + t * D + cols, mask=cols < D, other=0.0).to(ACC)
                        * tl.load(rows + p * D + cols, mask=keep, other=0.0).to(ACC))
            tl.store(dw + t * K + j, tl.sum(acc, 0))

    return gather, combine, rowdot


def _block_d(D: int) -> int:
    import triton

    return min(triton.next_power_of_2(max(D, 1)), 1024)


def _gather_triton(x, src, scale=None):
    import triton

    x = x.contiguous()
    S, D = src.numel(), x.shape[1]
    out = x.new_empty(S, D)
    if S and D:
        bd = _block_d(D)
        gather = _kernels()[0]
        gather[(S, triton.cdiv(D, bd))](x, src, scale if scale is not None else src, out, D,
                                        HAS_SCALE=scale is not None, ACC=tl_acc(x.dtype), BLOCK_D=bd)
    return out


def _combine_triton(rows, pos, w):
    import triton

    rows, pos, w = rows.contiguous(), pos.contiguous(), w.contiguous()
    (T, k), D = pos.shape, rows.shape[1]
    out = rows.new_empty(T, D)
    if T and D:
        bd = _block_d(D)
        _kernels()[1][(T, triton.cdiv(D, bd))](rows, pos, w, out, D, K=k, ACC=tl_acc(rows.dtype), BLOCK_D=bd)
    return out


def _rowdot_triton(dy, rows, pos):
    dy, rows, pos = dy.contiguous(), rows.contiguous(), pos.contiguous()
    (T, k), D = pos.shape, rows.shape[1]
    dw = torch.zeros(T, k, dtype=acc_dtype(rows.dtype), device=dy.device)
    if T and D:
        _kernels()[2][(T,)](dy, rows, pos, dw, D, K=k, ACC=tl_acc(rows.dtype), BLOCK_D=_block_d(D))
    return dw


_IMPL = {"torch": (_gather_torch, _combine_torch, _rowdot_torch),
         "triton": (_gather_triton, _combine_triton, _rowdot_triton)}


# ---- autograd ------------------------------------------------------------------------------------------
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, pos, impl):
        ctx.save_for_backward(pos)
        ctx.impl = impl
        return _IMPL[impl][0](x, src)

    @staticmethod
    def backward(ctx, dout):
        (pos,) = ctx.saved_tensors
        ones = torch.ones(pos.shape, dtype=dout.dtype, device=dout.device)
        return _IMPL[ctx.impl][1](dout.contiguous(), pos, ones), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, w, src, slot, pos, impl):
        ctx.save_for_backward(rows, w, src, slot, pos)
        ctx.impl = impl
        return _IMPL[impl][1](rows, pos, w)

    @staticmethod
    def backward(ctx, dy):
        rows, w, src, slot, pos = ctx.saved_tensors
        gather, _, rowdot = _IMPL[ctx.impl]
        dy = dy.contiguous()
        drows = gather(dy, src, w.reshape(-1).index_select(0, slot)) if ctx.needs_input_grad[0] else None
        dw = rowdot(dy, rows, pos).to(w.dtype) if ctx.needs_input_grad[1] else None
        return drows, dw, None, None, None, None


def permute(x: torch.Tensor, p: PermutePlan, impl: str = "torch") -> torch.Tensor:
    """Rows of ``x [T, d]`` in the plan's expert-contiguous order ``[S, d]`` (differentiable)."""
    return _Permute.apply(x, p.src, p.pos, impl)


def unpermute(rows: torch.Tensor, weights: torch.Tensor, p: PermutePlan, impl: str = "torch") -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * rows[pos[t, j]]`` (dropped slots add nothing); differentiable in
    ``rows`` and ``weights``."""
    return _Unpermute.apply(rows, weights, p.src, p.slot, p.pos, impl)
