"""Dispatchers: move each routed token to a holder of its expert and bring the result back.

- :class:`SparseDispatcher` (FastMoE/Tutel style): count exchange (``all_gather`` of each rank's
  per-expert counts - every rank then knows the full ``[N, E]`` load matrix and, the placement's
  routing rule being pure, every split), then an uneven ``all_to_all``. Replica-aware through
  :class:`~moelab.placement.Placement`. Only real tokens move.
- :class:`DenseDispatcher` (DeepSpeed/GShard style): a capacity-padded ``[E, C, d]`` buffer and an
  equal-split ``all_to_all``; padding moves too (and is computed, as DeepSpeed does). EP only.

A :class:`DispatchPlan` holds every decision as data, so strategies and the simulator can read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moelab.comm.door import Communicator
from moelab.moe.gates import Routing
from moelab.placement import Placement


@dataclass
class DispatchPlan:
    global_counts: torch.Tensor  # [N, E] tokens each source routes to each expert (before replica split)
    in_rows: list  # rows this rank sends to each rank
    out_rows: list  # rows this rank receives from each rank
    rows_per_slot: list  # rows each local expert slot computes
    send_pos: Optional[torch.Tensor] = None  # sparse: flat (token*k + j) slot index of each sent row
    recv_perm: Optional[torch.Tensor] = None  # sparse: source-major received rows -> slot-major
    recv_counts: Optional[torch.Tensor] = None  # sparse: [N, slots] rows from source j for slot s
    capacity: Optional[int] = None  # dense


def block_permutation(counts: torch.Tensor) -> torch.Tensor:
    """Rows laid out block (j, s) in j-major order -> index that reorders them s-major."""
    J, S = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # j-major offsets
    sm_counts = counts.t().reshape(-1)
    sm_starts = starts.view(J, S).t().reshape(-1)
    total = int(flat.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    sm_offsets = torch.cumsum(sm_counts, 0) - sm_counts
    within = torch.arange(total) - torch.repeat_interleave(sm_offsets, sm_counts)
    return torch.repeat_interleave(sm_starts, sm_counts) + within


def combine_slots(out_flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * out_flat[t*k + j]``."""
    T, k = weights.shape
    return torch.bmm(weights.unsqueeze(1), out_flat.view(T, k, out_flat.shape[-1])).squeeze(1)


class SparseDispatcher:
    def __init__(self, comm: Communicator, placement: Placement):
        self.comm, self.placement = comm, placement
        self.rank, self.N, self.E = comm.rank, placement.world_size, placement.num_experts
        self.local = placement.local_experts(self.rank)

    def plan(self, routing: Routing) -> DispatchPlan:
        pl, E, N, me = self.placement, self.E, self.N, self.rank
        flat = routing.idx.reshape(-1).cpu()  # planning is small integer work: on the CPU
        valid_pos = (flat >= 0).nonzero().squeeze(1)
        experts = flat[valid_pos]
        order = torch.argsort(experts, stable=True)
        pos_sorted, exp_sorted = valid_pos[order], experts[order]
        lec = torch.bincount(experts, minlength=E).to(torch.int64)
        C = self.comm.all_gather(lec, group="ep")  # [N, E]: the count exchange

        ranks, ns = [], []
        for e in range(E):
            for r, n in pl.blocks(me, e, int(lec[e])):
                ranks.append(r)
                ns.append(n)
        dest = torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int64), torch.tensor(ns, dtype=torch.int64)) \
            if ranks else torch.zeros(0, dtype=torch.int64)
        key = dest * E + pl.slot_table[dest, exp_sorted]
        send_pos = pos_sorted[torch.argsort(key, stable=True)]
        in_rows = torch.bincount(dest, minlength=N).tolist()

        local_idx = torch.tensor(self.local, dtype=torch.int64)
        if pl.is_trivial:  # plain EP: every source sends all its tokens for my experts to me
            recv_counts = C.cpu()[:, local_idx]
        else:
            recv_counts = torch.zeros(N, len(self.local), dtype=torch.int64)
            for j in range(N):
                if len(self.local):
                    recv_counts[j] = pl.split_counts(j, C[j])[local_idx, me]
        return DispatchPlan(C, in_rows, recv_counts.sum(1).tolist(), recv_counts.sum(0).tolist(),
                            send_pos=send_pos, recv_perm=block_permutation(recv_counts), recv_counts=recv_counts)

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        k = routing.idx.shape[1]
        # index_select, not x[idx]: its backward is a plain index_add, not an accumulating index_put
        recv = self.comm.all_to_all(x.index_select(0, (plan.send_pos // k).to(x.device)), plan.out_rows, plan.in_rows)
        return recv.index_select(0, plan.recv_perm.to(x.device))

    def combine(self, y: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        T, k = routing.idx.shape
        back = torch.empty_like(y).index_copy(0, plan.recv_perm.to(y.device), y)  # slot-major -> source-major
        back = self.comm.all_to_all(back, plan.in_rows, plan.out_rows)
        out_flat = y.new_zeros(T * k, y.shape[1]).index_copy(0, plan.send_pos.to(y.device), back)
        return combine_slots(out_flat, routing.weights)


class DenseDispatcher:
    def __init__(self, comm: Communicator, placement: Placement):
        if not placement.is_trivial:
            raise ValueError("the dense (DeepSpeed-style) dispatcher supports plain expert parallelism only")
        self.comm, self.placement = comm, placement
        self.N, self.E = placement.world_size, placement.num_experts
        self.E_local = self.E // self.N

    def plan(self, routing: Routing) -> DispatchPlan:
        if routing.capacity is None:
            raise ValueError("the dense dispatcher needs a capacity factor")
        flat = routing.idx.reshape(-1).cpu()
        lec = torch.bincount(flat[flat >= 0], minlength=self.E).to(torch.int64)
        # counts for metrics plus each rank's capacity: ranks with fewer tokens have a smaller
        # capacity, but the equal-split buffer must be the same size everywhere (the max)
        gathered = self.comm.all_gather(torch.cat([lec, torch.tensor([routing.capacity])]), group="ep")
        cap = int(gathered[:, -1].max())
        rows = self.E_local * cap
        return DispatchPlan(gathered[:, :-1], [rows] * self.N, [rows] * self.N, [self.N * cap] * self.E_local,
                            capacity=cap)

    def _buffer_index(self, routing: Routing, cap: int):
        flat_idx = routing.idx.reshape(-1)
        valid = (flat_idx >= 0).nonzero().squeeze(1)
        return valid, flat_idx[valid] * cap + routing.loc.reshape(-1)[valid]

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        Cap, d, k = plan.capacity, x.shape[1], routing.idx.shape[1]
        valid, buf_idx = self._buffer_index(routing, Cap)
        buf = x.new_zeros(self.E * Cap, d).index_copy(0, buf_idx, x[valid // k])
        recv = self.comm.all_to_all(buf, plan.out_rows, plan.in_rows)  # [(src, e_local, c), d]
        return recv.view(self.N, self.E_local, Cap, d).transpose(0, 1).reshape(-1, d)

    def combine(self, y: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        Cap, d = plan.capacity, y.shape[1]
        T, k = routing.idx.shape
        back = y.view(self.E_local, self.N, Cap, d).transpose(0, 1).reshape(-1, d)
        back = self.comm.all_to_all(back, plan.in_rows, plan.out_rows)  # [(e, c), d]
        valid, buf_idx = self._buffer_index(routing, Cap)
        out_flat = y.new_zeros(T * k, d).index_copy(0, valid, back[buf_idx])
        return combine_slots(out_flat, routing.weights)
