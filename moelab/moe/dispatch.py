"""Dispatchers: move each routed row to a holder of its expert and bring the result back.

Each dispatcher is staged as Megatron-Core's token dispatcher, so a strategy overrides one stage:
``exchange_counts`` (the one collective before the plan) -> ``plan_from_counts`` (pure) ->
``dispatch_preprocess`` / ``token_dispatch`` (the all-to-all) / ``dispatch_postprocess`` ->
experts -> ``combine_preprocess`` / ``token_combine`` (the all-to-all) / ``combine_postprocess``.

- :class:`SparseDispatcher` (FastMoE/Tutel style): count exchange (``all_gather`` of each rank's
  per-expert counts - every rank then knows the full ``[N, E]`` load matrix and, the placement's
  routing rule being pure, every split), then an uneven ``all_to_all``. Replica-aware through
  :class:`~moelab.placement.Placement`. Only real rows move. The plan is the pure
  :func:`plan_from_counts`: it takes any rows tagged with a destination expert (tokens x k slots
  here; LSH-MoE's centroids elsewhere) and a per-call placement.
- :class:`DenseDispatcher` (DeepSpeed/GShard style): a capacity-padded ``[E, C, d]`` buffer and an
  equal-split ``all_to_all``; padding moves too (and is computed, as DeepSpeed does). EP only.

A :class:`DispatchPlan` holds every decision as data, so strategies and the simulator can read it.
Dispatchers are registered by name (:func:`register_dispatcher`), ``cfg.dispatcher`` picks one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from moelab.comm.door import Communicator
from moelab.kernels import impl_for
from moelab.kernels.permute import PermutePlan, permute, plan_of_rows, unpermute
from moelab.moe.routing import Routing
from moelab.placement import Placement

DISPATCHERS: dict = {}


def register_dispatcher(name: str, cls=None):
    """Register a dispatcher class ``cls(comm, placement)`` as ``cfg.dispatcher = name`` (also a decorator). The
    class may say what it asks of the run: ``needs(run_cfg) -> [message]`` (a static method), checked before any
    process starts (:func:`dispatcher_errors`)."""
    def deco(c):
        DISPATCHERS[name] = c
        return c

    return deco(cls) if cls is not None else deco


def dispatcher_errors(cfg) -> list:
    """``model.moe.dispatcher`` names a registered dispatcher, and the run gives it what it needs."""
    name = cfg.model.moe.dispatcher
    if name not in DISPATCHERS:
        return [f"model.moe.dispatcher must be one of {tuple(sorted(DISPATCHERS))}, got {name!r}"]
    needs = getattr(DISPATCHERS[name], "needs", None)
    return needs(cfg) if needs is not None else []


@dataclass
class CountExchange:
    """What the count exchange learnt: every source's rows per expert (and, dense, the buffer size)."""

    counts: torch.Tensor  # [N, E] rows each source routes to each expert (before the replica split)
    capacity: Optional[int] = None  # dense: the largest source capacity (every rank's equal split)


@dataclass
class DispatchPlan:
    global_counts: torch.Tensor  # [N, E] rows each source routes to each expert (before replica split)
    in_rows: list  # rows this rank sends to each rank
    out_rows: list  # rows this rank receives from each rank
    rows_per_slot: list  # rows each local expert slot computes
    send_pos: Optional[torch.Tensor] = None  # sparse: index (into the planned rows) of each sent row, in send order
    recv_perm: Optional[torch.Tensor] = None  # sparse: source-major received rows -> slot-major
    recv_counts: Optional[torch.Tensor] = None  # sparse: [N, slots] rows from source j for slot s
    send_split: Optional[torch.Tensor] = None  # sparse: [E, N] rows this rank sends to rank r for expert e
    capacity: Optional[int] = None  # dense
    placement: Optional[Placement] = None  # the placement this call was planned with
    shadowed: tuple = ()  # experts whose rows stay on their source (computed there on copied parameters)
    shadow_pos: Optional[torch.Tensor] = None  # index of each shadowed row, expert-major, source order inside
    shadow_counts: tuple = ()  # this rank's rows for each shadowed expert
    _rows_plan: Optional[tuple] = field(default=None, repr=False, compare=False)  # (send_pos it was built from, plan)

    def rows_plan(self, shape, device) -> PermutePlan:
        """The send order as the kernels' permute plan, built once per call (dispatch and combine share it;
        a plan copied with another ``send_pos`` builds its own)."""
        if self._rows_plan is None or self._rows_plan[0] is not self.send_pos:
            self._rows_plan = (self.send_pos, plan_of_rows(self.send_pos.to(device), shape))
        return self._rows_plan[1]


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


def capacity_index(routing: Routing, cap: int) -> tuple:
    """(kept slot ids into ``idx.reshape(-1)``, their rows ``e * cap + loc`` in an ``[E * cap]`` buffer)."""
    flat_idx = routing.idx.reshape(-1)
    valid = (flat_idx >= 0).nonzero().squeeze(1)
    return valid, flat_idx[valid] * cap + routing.loc.reshape(-1)[valid]


def to_capacity_buffer(x: torch.Tensor, routing: Routing, num_experts: int, cap: int) -> torch.Tensor:
    """The ``[E, cap, d]`` capacity buffer of tokens ``x`` (zero where a slot is empty): DeepSpeed's
    dispatch, by index. Pure: the dense dispatcher sends it, Parm's schedules split and dump it."""
    k = routing.idx.shape[1]
    valid, rows = capacity_index(routing, cap)
    return x.new_zeros(num_experts * cap, x.shape[1]).index_copy(0, rows, x[valid // k]).view(num_experts, cap, -1)


def from_capacity_buffer(buf: torch.Tensor, routing: Routing, cap: int) -> torch.Tensor:
    """Tokens' outputs ``[T, d]`` from an expert-output capacity buffer (``[E, cap, d]`` or its rows),
    weighted by the routing: the inverse of :func:`to_capacity_buffer`, the combine."""
    T, k = routing.idx.shape
    buf = buf.reshape(-1, buf.shape[-1])
    valid, rows = capacity_index(routing, cap)
    return combine_slots(buf.new_zeros(T * k, buf.shape[1]).index_copy(0, valid, buf[rows]), routing.weights)


def count_exchange_bytes(num_experts: int, dispatcher: str = "sparse") -> int:
    """Bytes each rank all-gathers in the count exchange: its int64 rows per expert, and for the
    dense dispatcher its capacity too (:meth:`DenseDispatcher.exchange_counts`). The simulator prices
    this number; the real runs' records equal it (the simulator-vs-real byte tests)."""
    return torch.empty((), dtype=torch.int64).element_size() * (num_experts + (1 if dispatcher == "dense" else 0))


def local_counts(dest: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` rows of this rank per destination expert (``dest < 0``: dropped, not counted), on
    ``dest``'s device without a host sync (a scatter-add, where bincount or a mask would read the device)."""
    dest = dest.reshape(-1)
    bins = torch.zeros(num_experts + 1, dtype=torch.int64, device=dest.device)
    return bins.scatter_add_(0, dest.clamp(min=-1) + 1, torch.ones_like(dest, dtype=torch.int64))[1:]


def plan_from_counts(counts, placement: Placement, dest: torch.Tensor, rank: int,
                     shadowed: Sequence[int] = ()) -> DispatchPlan:
    """The sparse dispatch plan of ``rank``: pure (no communication, same answer on every rank).

    ``counts[N, E]``: every source's rows per expert (the count exchange's result; row ``rank``
    must be this rank's ``dest`` counts). ``dest[R]``: destination expert of each of this rank's
    rows (-1: dropped). ``placement``: this call's placement; its rule splits each source's rows
    over holders (:meth:`Placement.split`). ``shadowed``: experts computed where their rows are
    (FasterMoE's shadows): their rows are neither sent nor received, listed in ``shadow_pos``.

    Send order: rows sorted by (destination rank, its slot of the expert), stable, so within a
    block they keep their order in ``dest``; a rule's blocks take an expert's rows in that order.
    """
    E, N = placement.num_experts, placement.world_size
    C = torch.as_tensor(counts).to(torch.int64).cpu()
    dest = dest.reshape(-1).cpu()
    if tuple(C.shape) != (N, E):
        raise ValueError(f"counts must be [{N}, {E}], got {tuple(C.shape)}")
    if not torch.equal(local_counts(dest, E), C[rank]):
        raise ValueError(f"counts row {rank} {C[rank].tolist()} does not count this rank's rows "
                         f"{local_counts(dest, E).tolist()}")
    shadowed = tuple(sorted(int(e) for e in shadowed))
    valid_pos = (dest >= 0).nonzero().squeeze(1)
    experts = dest[valid_pos]
    sent = C
    if shadowed:
        held = torch.zeros(E, dtype=torch.bool)
        held[list(shadowed)] = True
        keep = ~held[experts]
        sh_pos, sh_exp = valid_pos[~keep], experts[~keep]
        valid_pos, experts = valid_pos[keep], experts[keep]
        sent = C.clone()
        sent[:, held] = 0
        per_expert = torch.bincount(sh_exp, minlength=E)
        shadow_pos, shadow_counts = (sh_pos[torch.argsort(sh_exp, stable=True)],
                                     tuple(int(per_expert[e]) for e in shadowed))
    else:
        shadow_pos, shadow_counts = torch.zeros(0, dtype=torch.int64), ()
    order = torch.argsort(experts, stable=True)
    pos_sorted, exp_sorted = valid_pos[order], experts[order]

    split = torch.from_numpy(placement.split(sent.numpy()))  # [N, E, N]: src -> expert -> dst
    if placement.is_trivial:  # one holder each: every row goes to its expert's owner
        to_rank = torch.from_numpy(placement.owners)[exp_sorted]
    else:
        ranks, ns = [], []
        for e in range(E):
            for r, n in placement.blocks(rank, e, int(sent[rank, e])):
                ranks.append(r)
                ns.append(n)
        to_rank = torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int64), torch.tensor(ns, dtype=torch.int64)) \
            if ranks else torch.zeros(0, dtype=torch.int64)
    if placement.is_expert_parallel:  # rank-major expert ids: expert order is already (rank, slot) order
        send_pos = pos_sorted
    else:
        send_pos = pos_sorted[torch.argsort(to_rank * E + placement.slot_table[to_rank, exp_sorted], stable=True)]
    in_rows = torch.bincount(to_rank, minlength=N).tolist()

    local = list(placement.local_experts(rank))
    recv_counts = split[:, local, rank] if local else torch.zeros(N, 0, dtype=torch.int64)
    return DispatchPlan(C, in_rows, recv_counts.sum(1).tolist(), recv_counts.sum(0).tolist(),
                        send_pos=send_pos, recv_perm=block_permutation(recv_counts), recv_counts=recv_counts,
                        send_split=split[rank], placement=placement, shadowed=shadowed,
                        shadow_pos=shadow_pos, shadow_counts=shadow_counts)


@register_dispatcher("sparse")
class SparseDispatcher:
    def __init__(self, comm: Communicator, placement: Placement):
        self.comm, self.placement = comm, placement
        self.rank, self.N, self.E = comm.rank, placement.world_size, placement.num_experts
        self.kernels = "torch"  # model.moe.kernels (set by the layer): torch | triton | auto

    # ---- plan -------------------------------------------------------------------------------
    def exchange_counts(self, routing: Routing) -> CountExchange:
        """The collective before the plan: ``all_gather`` of this rank's per-expert counts."""
        return CountExchange(self.comm.all_gather(local_counts(routing.idx, self.E), group="ep"))

    def plan_from_counts(self, counts: CountExchange, routing: Routing, placement: Optional[Placement] = None,
                         shadowed: Sequence[int] = ()) -> DispatchPlan:
        return plan_from_counts(counts.counts, placement or self.placement, routing.idx, self.rank, shadowed)

    def plan(self, routing: Routing) -> DispatchPlan:
        return self.plan_from_counts(self.exchange_counts(routing), routing)

    # ---- dispatch ------------------------------------------------------------------------------
    def dispatch_preprocess(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        """Rows to send, destination-major (row ``p`` of the plan is token ``p // k``)."""
        k = routing.idx.shape[1]
        if impl_for(self.kernels, x) == "triton":
            return permute(x, plan.rows_plan(routing.idx.shape, x.device), "triton")
        # index_select, not x[idx]: its backward is a plain index_add, not an accumulating index_put
        return x.index_select(0, (plan.send_pos // k).to(x.device))

    def token_dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.comm.all_to_all(rows, plan.out_rows, plan.in_rows)

    def dispatch_postprocess(self, recv: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Source-major received rows -> slot-major (each local expert's rows contiguous)."""
        return recv.index_select(0, plan.recv_perm.to(recv.device))

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        return self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x, plan, routing), plan), plan)

    # ---- combine -------------------------------------------------------------------------------
    def combine_preprocess(self, y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return torch.empty_like(y).index_copy(0, plan.recv_perm.to(y.device), y)  # slot-major -> source-major

    def token_combine(self, back: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.comm.all_to_all(back, plan.in_rows, plan.out_rows)

    def combine_postprocess(self, back: torch.Tensor, plan: DispatchPlan, routing: Routing,
                            shadow_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returned rows (and the shadowed rows' outputs, computed here) to their slots, weighted."""
        T, k = routing.idx.shape
        if shadow_out is None and impl_for(self.kernels, back) == "triton":  # the weighted combine, fused
            return unpermute(back, routing.weights, plan.rows_plan((T, k), back.device), "triton")
        out_flat = back.new_zeros(T * k, back.shape[1]).index_copy(0, plan.send_pos.to(back.device), back)
        if shadow_out is not None:
            out_flat = out_flat.index_copy(0, plan.shadow_pos.to(back.device), shadow_out)
        return combine_slots(out_flat, routing.weights)

    def combine(self, y: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y, plan), plan), plan, routing)


@register_dispatcher("dense")
class DenseDispatcher:
    @staticmethod
    def needs(cfg) -> list:
        """A capacity to pad to, and plain expert parallelism (every rank the same experts, no replica)."""
        errs = [] if cfg.model.moe.capacity_factor is not None else [
            "the dense dispatcher pads to a capacity: set model.moe.capacity_factor"]
        if cfg.parallel.placement is not None:
            errs.append("the dense (DeepSpeed-style) dispatcher supports plain expert parallelism only")
        return errs

    def __init__(self, comm: Communicator, placement: Placement):
        if not placement.is_trivial:
            raise ValueError("the dense (DeepSpeed-style) dispatcher supports plain expert parallelism only")
        self.comm, self.placement = comm, placement
        self.N, self.E = placement.world_size, placement.num_experts
        self.E_local = self.E // self.N

    # ---- plan -------------------------------------------------------------------------------
    def exchange_counts(self, routing: Routing) -> CountExchange:
        """Counts for metrics plus each rank's capacity, in one ``all_gather``: ranks with fewer tokens
        have a smaller capacity, but the equal-split buffer must be the same size everywhere (the max)."""
        if routing.capacity is None:
            raise ValueError("the dense dispatcher needs a capacity factor")
        lec = local_counts(routing.idx, self.E)
        gathered = self.comm.all_gather(torch.cat([lec, torch.tensor([routing.capacity])]), group="ep")
        return CountExchange(gathered[:, :-1], int(gathered[:, -1].max()))

    def plan_from_counts(self, counts: CountExchange, routing: Routing, placement: Optional[Placement] = None,
                         shadowed: Sequence[int] = ()) -> DispatchPlan:
        if (placement is not None and placement != self.placement) or shadowed:
            raise ValueError("the dense dispatcher plans plain expert parallelism only (no per-call placement, "
                             "no shadowed experts)")
        cap = counts.capacity
        rows = self.E_local * cap
        return DispatchPlan(counts.counts, [rows] * self.N, [rows] * self.N, [self.N * cap] * self.E_local,
                            capacity=cap, placement=self.placement)

    def plan(self, routing: Routing) -> DispatchPlan:
        return self.plan_from_counts(self.exchange_counts(routing), routing)

    # ---- dispatch ------------------------------------------------------------------------------
    def dispatch_preprocess(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        """The ``[E, C, d]`` capacity buffer (zero padding where a slot is empty)."""
        return to_capacity_buffer(x, routing, self.E, plan.capacity).reshape(-1, x.shape[1])

    def token_dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.comm.all_to_all(rows, plan.out_rows, plan.in_rows)  # [(src, e_local, c), d]

    def dispatch_postprocess(self, recv: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        d = recv.shape[1]
        return recv.view(self.N, self.E_local, plan.capacity, d).transpose(0, 1).reshape(-1, d)

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        return self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x, plan, routing), plan), plan)

    # ---- combine -------------------------------------------------------------------------------
    def combine_preprocess(self, y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        d = y.shape[1]
        return y.view(self.E_local, self.N, plan.capacity, d).transpose(0, 1).reshape(-1, d)

    def token_combine(self, back: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.comm.all_to_all(back, plan.in_rows, plan.out_rows)  # [(e, c), d]

    def combine_postprocess(self, back: torch.Tensor, plan: DispatchPlan, routing: Routing,
                            shadow_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if shadow_out is not None:
            raise ValueError("the dense dispatcher has no shadowed experts")
        return from_capacity_buffer(back, routing, plan.capacity)

    def combine(self, y: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y, plan), plan), plan, routing)
