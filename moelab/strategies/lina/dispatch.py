"""The MoE layer's token path at inference with a placement per call (Lina §2.3, spec §2.3).

Every rank holds the full expert bank (the host copy, :class:`moelab.moe.experts.Experts` over all
E experts, seeded as in training); a call's *placement* (device -> experts, replicas allowed, several
experts packed per device) says which rank computes which expert's tokens. No capacity, no drops:
every token is computed exactly once by one holder of its expert and comes back to its position.

Dispatch (:func:`serve_forward`): the per-rank counts ``[N, E]`` are all-gathered (the count
exchange, also phase 2's input); a source sends its tokens of expert e in near-equal contiguous
parts to e's holders (:func:`moelab.strategies.lina.placement.replica_split`: rotation by source rank), rows
ordered by (destination, expert, position); each receiver knows every split from the counts, runs
its experts one after another on their rows (a packed device computes its experts in turn) and
returns the outputs by the reverse uneven all-to-all. Both all-to-alls go through the door.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from moelab.strategies.lina.placement import replica_split


def holders_of(devs: Sequence[Sequence[int]], num_experts: int) -> list:
    """``holders[e]``: the devices computing expert e, in device order."""
    h = [[] for _ in range(num_experts)]
    for d, es in enumerate(devs):
        for e in es:
            h[e].append(d)
    missing = [e for e, x in enumerate(h) if not x]
    if missing:
        raise ValueError(f"the placement computes experts {missing} nowhere")
    return h


def parts(count: int, holders: Sequence[int], src: int) -> list:
    """``[(device, rows)]`` in chunk order: a source's ``count`` tokens of one expert over its holders."""
    sizes = replica_split(count, len(holders), src)
    R = len(holders)
    return [(holders[(j + src) % R], sizes[(j + src) % R]) for j in range(R)]


def route_table(counts, devs) -> torch.Tensor:
    """``rows[src, expert, dst]``: the tokens of expert e that source src sends to device dst (the rule of
    :func:`parts`, every source at once: replica i of e gets ``base + (j < extra)`` with j = (i - src) mod R)."""
    C = np.asarray(torch.as_tensor(counts, dtype=torch.int64))
    N, E = C.shape
    t = np.zeros((N, E, len(devs)), dtype=np.int64)
    src = np.arange(N)
    for e, holders in enumerate(holders_of(devs, E)):
        R = len(holders)
        base, extra = np.divmod(C[:, e], R)
        for i, d in enumerate(holders):
            t[:, e, d] += base + ((i - src) % R < extra)
    return torch.from_numpy(t)


def serve_forward(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, devs, bank, comm,
                  counts=None, group: str = "ep", times: dict = None) -> torch.Tensor:
    """``y[t] = weight[t] * FFN_{idx[t]}(x[t])`` computed where ``devs`` (device -> experts) puts each
    expert. ``idx [T]`` top-1 expert ids, ``bank``: the full :class:`Experts` (every expert, every
    rank). ``counts``: the all-gathered ``[N, E]`` counts if already exchanged. ``times`` (a dict)
    receives the seconds of the dispatch and combine all-to-alls and of the experts."""
    import time

    clock = time.perf_counter
    N, me, E = comm.world_size, comm.rank, len(bank.experts)
    if len(devs) != N:
        raise ValueError(f"the placement describes {len(devs)} devices, the group has {N} ranks")
    if counts is None:
        counts = comm.all_gather(torch.bincount(idx, minlength=E).to(torch.int64), group=group)
    table = route_table(counts, devs).numpy()  # [src, e, dst]
    # my send order: by destination, then expert, then position (parts of one expert are contiguous)
    order_e = torch.argsort(idx, stable=True)
    start = np.concatenate([[0], np.cumsum(np.bincount(idx.numpy(), minlength=E))]).tolist()
    H = holders_of(devs, E)
    mine = torch.as_tensor(counts)[me].tolist()
    chunks = [[] for _ in range(N)]
    for e in range(E):
        off = start[e]
        for d, n in parts(mine[e], H[e], me):
            chunks[d].append(order_e[off:off + n])
            off += n
    perm = torch.cat([c for d in range(N) for c in chunks[d]]) if len(idx) else idx.new_zeros(0)
    send, recv = table[me].sum(0).tolist(), table[:, :, me].sum(1).tolist()
    t0 = clock()
    got = comm.all_to_all_raw(x[perm], recv, send, group=group)
    t1 = clock()
    # received rows: by source, then expert; run each of my experts on its rows from every source
    out = torch.empty_like(got)
    owner = torch.from_numpy(np.repeat(np.tile(np.arange(E), N), table[:, :, me].reshape(-1)))  # (source, expert)
    for e in devs[me]:
        rows = (owner == e).nonzero().reshape(-1)
        if len(rows):
            out[rows] = bank(got[rows], [len(rows)], experts=[e])
    t2 = clock()
    back = comm.all_to_all_raw(out, send, recv, group=group)
    if times is not None:
        times.update(dispatch_s=t1 - t0, experts_s=t2 - t1, combine_s=clock() - t2)
    y = torch.empty_like(x)
    y[perm] = back
    return y * weight.reshape(-1, 1).to(y.dtype)
