"""The fused router: logits ``[T, E]`` -> top-k experts, their renormalized softmax weights and each
slot's position within its expert (DeepSpeed's order: every first choice in token order, then every
second choice, ...), which a capacity then cuts.

:func:`route_torch` is the reference (the same ops as ``moelab.moe.gates.topk_rule`` +
``capacity_locations`` below). :func:`route_triton` does it in two kernel launches and no
host sync: one pass per block of tokens (softmax, k rounds of arg-max, weights, per-block counts per
(choice, expert)), an exclusive scan of those small counts, and one pass placing each slot. Ties between
equal logits go to the lower expert id in the kernel; torch.topk does not promise an order there.
"""
from __future__ import annotations

import functools

import torch

from moelab.kernels import MAX_TOP_K, acc_dtype, tl_acc


def capacity_locations(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Position of each slot within its expert: first choices in token order, then second choices,
    ... (choice j's slots come after those of every choice < j: DeepSpeed's order, any k)."""
    T, k = idx.shape
    loc = torch.zeros_like(idx)
    base = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    for j in range(k):
        onehot = torch.nn.functional.one_hot(idx[:, j].clamp(min=0), num_experts) * (idx[:, j] >= 0).unsqueeze(1)
        pos = torch.cumsum(onehot, dim=0) - 1 + base
        loc[:, j] = (pos * onehot).sum(1)
        base = base + onehot.sum(0)
    return loc


def check_top_k(k: int, num_experts: int) -> None:
    if not 1 <= k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k must be in 1..min(num_experts={num_experts}, {MAX_TOP_K}), got {k}")


def route_torch(logits: torch.Tensor, k: int) -> tuple:
    """(idx ``[T, k]`` int64, weights ``[T, k]`` = softmax over the top-k logits, loc ``[T, k]`` int64)."""
    check_top_k(k, logits.shape[1])
    vals, idx = torch.topk(logits, k, dim=-1)
    return idx, torch.softmax(vals, dim=-1), capacity_locations(idx, logits.shape[1])


@functools.cache  # compiled (or interpreted) once, on first use: importing moelab needs no Triton
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def topk_block(logits, idx_out, w_out, counts, T, E, stride, K: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < T
        x = tl.load(logits + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & (cols[None, :] < E),
                    other=float("-inf")).to(ACC)
        x = tl.where(rmask[:, None], x, 0.0)  # rows past T: finite (never stored), so no inf - inf
        top = tl.max(x, 1)
        denom = tl.zeros([BLOCK_T], dtype=ACC)
        for j in tl.static_range(K):
            v = tl.max(x, 1)
            a = tl.min(tl.where(x == v[:, None], cols[None, :], BLOCK_E), 1)  # lowest id among the maxima
            e = tl.exp(v - top)
            denom += e
            tl.store(idx_out + rows * K + j, a.to(tl.int64), mask=rmask)
            tl.store(w_out + rows * K + j, e, mask=rmask)
            hit = (cols[None, :] == a[:, None]) & rmask[:, None]
            tl.store(counts + (pid * K + j) * BLOCK_E + cols, tl.sum(hit.to(tl.int32), 0))
            x = tl.where(cols[None, :] == a[:, None], float("-inf"), x)
        for j in tl.static_range(K):
            w = tl.load(w_out + rows * K + j, mask=rmask, other=0.0)
            tl.store(w_out + rows * K + j, w / denom, mask=rmask)

    @triton.jit
    def place_block(idx, offsets, loc_out, T, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < T
        for j in tl.static_range(K):
            a = tl.load(idx + rows * K + j, mask=rmask, other=0)
            hit = ((cols[None, :] == a[:, None]) & rmask[:, None]).to(tl.int32)
            before = tl.cumsum(hit, 0) - hit  # earlier tokens of this block with the same choice j
            base = tl.load(offsets + (pid * K + j) * BLOCK_E + cols)
            pos = tl.sum((before + base[None, :]) * hit, 1)
            tl.store(loc_out + rows * K + j, pos.to(tl.int64), mask=rmask)

    return topk_block, place_block


def route_triton(logits: torch.Tensor, k: int, block_t: int = 64) -> tuple:
    """The same triple as :func:`route_torch`, from the Triton kernels."""
    import triton

    check_top_k(k, logits.shape[1])
    topk_block, place_block = _kernels()
    logits = logits.contiguous()
    T, E = logits.shape
    block_e = triton.next_power_of_2(E)
    blocks = triton.cdiv(T, block_t)
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    acc = acc_dtype(logits.dtype)
    w = torch.empty(T, k, dtype=acc, device=logits.device)
    loc = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return idx, w.to(logits.dtype), loc
    counts = torch.empty(blocks, k, block_e, dtype=torch.int32, device=logits.device)
    topk_block[(blocks,)](logits, idx, w, counts, T, E, logits.stride(0), K=k, ACC=tl_acc(acc), BLOCK_T=block_t,
                          BLOCK_E=block_e)
    # slot (block b, choice j, expert e) starts after: all earlier choices' slots of e, then blocks < b's
    counts = counts.to(torch.int64)
    per_choice = counts.sum(0)  # [k, E]
    choice_base = torch.cumsum(per_choice, 0) - per_choice
    offsets = (torch.cumsum(counts, 0) - counts + choice_base[None]).to(torch.int32).contiguous()
    place_block[(blocks,)](idx, offsets, loc, T, K=k, BLOCK_T=block_t, BLOCK_E=block_e)
    return idx, w.to(logits.dtype), loc
