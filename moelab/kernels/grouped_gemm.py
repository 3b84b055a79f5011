"""Grouped GEMM over variable-size expert blocks: ``Y[rows of e] = X[rows of e] @ W[e]`` for the
expert-contiguous rows that :mod:`.permute` lays out (``counts[e]`` rows each, empty experts allowed).

Forward and both backward GEMMs — ``dX = dY @ W[e]^T`` (the same kernel, W read transposed through its
strides) and ``dW[e] = X_e^T @ dY_e`` (a reduction over the expert's rows) — accumulate in fp32 (fp64 for
fp64 inputs) and write the input dtype, so bf16 runs keep an fp32 sum. The row tiles of every expert are
listed once per call on the host from ``counts`` (the dispatch plan has them on the CPU already).
:func:`grouped_mm_torch` is the reference: a loop over experts.
"""
from __future__ import annotations

import functools

import torch

from moelab.kernels import acc_dtype, tl_acc


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """Per-expert loop: ``x [S, d]``, ``w [E, d, f]``, ``counts [E]`` -> ``[S, f]``."""
    out, start = [], 0
    for e, n in enumerate(torch.as_tensor(counts).tolist()):
        out.append((x[start:start + n].to(acc_dtype(x.dtype)) @ w[e].to(acc_dtype(w.dtype))).to(x.dtype))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2])


@functools.cache  # compiled (or interpreted) once, on first use: importing moelab needs no Triton
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def mm(x, w, y, tile_e, tile_row, tile_end, D, F, sx, swe, swd, swf, ACC: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        t = tl.program_id(0)
        e = tl.load(tile_e + t)
        r0 = tl.load(tile_row + t)
        r1 = tl.load(tile_end + t)
        rows = r0 + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=ACC)
        for k0 in range(0, D, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(x + rows[:, None] * sx + ks[None, :], mask=(rows[:, None] < r1) & (ks[None, :] < D), other=0.0)
            b = tl.load(w + e * swe + ks[:, None] * swd + cols[None, :] * swf,
                        mask=(ks[:, None] < D) & (cols[None, :] < F), other=0.0)
            acc += tl.dot(a.to(ACC), b.to(ACC), out_dtype=ACC)
        tl.store(y + rows[:, None] * F + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=(rows[:, None] < r1) & (cols[None, :] < F))

    @triton.jit
    def wgrad(x, dy, dw, starts, D, F, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        e = tl.program_id(0)
        dcols = tl.program_id(1) * BM + tl.arange(0, BM)
        fcols = tl.program_id(2) * BN + tl.arange(0, BN)
        r0 = tl.load(starts + e)
        r1 = tl.load(starts + e + 1)
        acc = tl.zeros([BM, BN], dtype=ACC)
        for k0 in range(r0, r1, BK):
            rows = k0 + tl.arange(0, BK)
            a = tl.load(x + rows[None, :] * D + dcols[:, None], mask=(rows[None, :] < r1) & (dcols[:, None] < D),
                        other=0.0)  # X_e^T tile [BM, BK]
            b = tl.load(dy + rows[:, None] * F + fcols[None, :], mask=(rows[:, None] < r1) & (fcols[None, :] < F),
                        other=0.0)
            acc += tl.dot(a.to(ACC), b.to(ACC), out_dtype=ACC)
        tl.store(dw + e * D * F + dcols[:, None] * F + fcols[None, :], acc.to(dw.dtype.element_ty),
                 mask=(dcols[:, None] < D) & (fcols[None, :] < F))

    return mm, wgrad


BM, BN, BK = 32, 32, 32  # tile sizes; 16 is the smallest tl.dot accepts


def _tiles(counts: list, device) -> tuple:
    """(expert, first row, end row) of every BM-row tile of every expert, as device tensors."""
    es, r0, r1, start = [], [], [], 0
    for e, n in enumerate(counts):
        for s in range(start, start + n, BM):
            es.append(e)
            r0.append(s)
            r1.append(start + n)
        start += n
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(es), as_t(r0), as_t(r1)


def _mm(x, w, counts: list, transpose_w: bool = False):
    import triton

    x = x.contiguous()
    E, d_in, d_out = (w.shape[0], w.shape[2], w.shape[1]) if transpose_w else w.shape
    y = x.new_empty(x.shape[0], d_out)
    te, t0, t1 = _tiles(counts, x.device)
    if te.numel() and d_out:
        swe, swd, swf = w.stride(0), *((w.stride(2), w.stride(1)) if transpose_w else (w.stride(1), w.stride(2)))
        mm, _ = _kernels()
        mm[(te.numel(), triton.cdiv(d_out, BN))](x, w, y, te, t0, t1, d_in, d_out, x.stride(0), swe, swd, swf,
                                                 ACC=tl_acc(x.dtype), BM=BM, BN=BN, BK=BK)
    elif d_out:
        y.zero_()
    return y


def _wgrad(x, dy, counts: list):
    import triton

    x, dy = x.contiguous(), dy.contiguous()
    E, D, F = len(counts), x.shape[1], dy.shape[1]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64, device=x.device)
    dw = x.new_empty(E, D, F)
    if E and D and F:
        _, wgrad = _kernels()
        wgrad[(E, triton.cdiv(D, BM), triton.cdiv(F, BN))](x, dy, dw, starts, D, F, ACC=tl_acc(x.dtype),
                                                           BM=BM, BN=BN, BK=BK)
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return _mm(x, w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _mm(dy, w, ctx.counts, transpose_w=True) if ctx.needs_input_grad[0] else None
        dw = _wgrad(x, dy, ctx.counts) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts, impl: str = "triton") -> torch.Tensor:
    """``[S, f]`` rows of ``x [S, d]`` times their expert's ``w [E, d, f]`` (differentiable in both)."""
    counts = [int(c) for c in torch.as_tensor(counts).tolist()]
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"counts {counts} must give one block per expert ({w.shape[0]}) covering {x.shape[0]} rows")
    if impl == "torch":
        return grouped_mm_torch(x, w, counts)
    return _GroupedMM.apply(x, w, counts)
