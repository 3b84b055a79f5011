"""Cross-polytope LSH hashing for LSH-MoE in one pass: rotate each row by every ``R_l [d, r]``, take the
nearest cross-polytope vertex (``argmax(cat(z, -z))``, the first maximum on ties) and fold the expert id
and the L codes into one mixed-radix bucket key (expert most significant, then code 0, 1, ...).

:func:`hash_torch` is the reference: ``moelab.strategies.lsh_moe.hashing.cross_polytope`` and the
mixed-radix key of its bucketing. The kernel accumulates the projections in fp32 (fp64 for fp64 rows),
so a row whose two best vertices are closer than that rounding may pick the other one.
"""
from __future__ import annotations

import functools

import torch

from moelab.kernels import acc_dtype, tl_acc

INT64_MAX = 2 ** 63 - 1


def key_fits(num_experts: int, r: int, L: int) -> bool:
    """Whether the key ``expert * (2r)^L + ...`` fits an int64 (else bucketing falls back to unique rows)."""
    return num_experts * (2 * r) ** L - 1 <= INT64_MAX


def hash_torch(x: torch.Tensor, R: torch.Tensor, expert: torch.Tensor) -> tuple:
    """(codes ``[A, L]`` int64 in ``[0, 2r)``, key ``[A]`` int64)."""
    z = torch.einsum("ad,ldr->alr", x.to(acc_dtype(x.dtype)), R.to(acc_dtype(x.dtype)))
    codes = torch.cat([z, -z], dim=-1).argmax(-1)
    key = expert.to(torch.int64).clone()
    for l in range(codes.shape[1]):
        key = key * (2 * R.shape[2]) + codes[:, l]
    return codes, key


@functools.cache  # compiled (or interpreted) once, on first use: importing moelab needs no Triton
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cp_hash(x, R, expert, codes, key, A, D, L, RD: tl.constexpr, ACC: tl.constexpr, BA: tl.constexpr,
                BD: tl.constexpr):
        rows = tl.program_id(0) * BA + tl.arange(0, BA)
        rmask = rows < A
        k = tl.load(expert + rows, mask=rmask, other=0).to(tl.int64)
        for l in range(L):
            best = tl.full([BA], float("-inf"), ACC)
            arg = tl.zeros([BA], dtype=tl.int64)
            for i in tl.static_range(RD):
                z = tl.zeros([BA], dtype=ACC)
                for d0 in range(0, D, BD):
                    cols = d0 + tl.arange(0, BD)
                    xv = tl.load(x + rows[:, None] * D + cols[None, :], mask=rmask[:, None] & (cols[None, :] < D),
                                 other=0.0).to(ACC)
                    rv = tl.load(R + (l * D + cols) * RD + i, mask=cols < D, other=0.0).to(ACC)
                    z += tl.sum(xv * rv[None, :], 1)
                # candidates i (+z) and RD + i (-z): keep the larger, the lower index on a tie
                take = z > best
                arg = tl.where(take, i, arg)
                best = tl.where(take, z, best)
                take = (-z > best) | ((-z == best) & (RD + i < arg))
                arg = tl.where(take, RD + i, arg)
                best = tl.where(take, -z, best)
            tl.store(codes + rows * L + l, arg, mask=rmask)
            k = k * (2 * RD) + arg
        tl.store(key + rows, k, mask=rmask)

    return cp_hash


def hash_triton(x: torch.Tensor, R: torch.Tensor, expert: torch.Tensor, block_rows: int = 32) -> tuple:
    """The same (codes, key) as :func:`hash_torch`, from one kernel launch."""
    import triton

    x, R, expert = x.contiguous(), R.to(x.dtype).contiguous(), expert.contiguous()
    A, D = x.shape
    L, r = R.shape[0], R.shape[2]
    codes = torch.empty(A, L, dtype=torch.int64, device=x.device)
    key = torch.empty(A, dtype=torch.int64, device=x.device)
    if A:
        _kernel()[(triton.cdiv(A, block_rows),)](x, R, expert, codes, key, A, D, L, RD=r, ACC=tl_acc(x.dtype),
                                                 BA=block_rows, BD=min(triton.next_power_of_2(max(D, 1)), 128))
    return codes, key
