"""The MoE layer of the ZeRO baseline: every rank holds every expert and runs its own tokens
through them locally (FasterMoE §3: "the whole MoE layer is logically replicated and each worker
runs its own tokens through all experts locally"; FastMoE with ``world_size=1`` inside ZeRO).

Stages: route (the core gate, unchanged) -> place (:func:`full_replication`: every rank holds every
expert, so by the placement's rule "a holder keeps its own tokens") -> dispatch/combine become a
local permutation (no count exchange, no all-to-all: tokens never leave their rank) -> expert
compute on the rank's own rows. The arithmetic per expert block is the core's
(:class:`~moelab.moe.experts.Experts`), so outputs equal the EP layer's row for row.

The only collective here is optional and *not training traffic*: with ``global_loads`` the
per-expert counts are all-gathered with the recorder disabled (as the Trainer's loss all-reduce),
so ``last_global_counts`` is the ``[N, E]`` matrix the loads metrics and the simulator's
validation read. Whether an expert's gradient is synchronised is the Update's business
(:class:`~moelab.strategies.zero.update.ZeroUpdate`), not the layer's.
"""
from __future__ import annotations

from typing import Optional

import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.dispatch import combine_slots
from moelab.moe.layer import MoELayer
from moelab.placement import Placement
from moelab.strategies.zero.options import ZeroOptions


def full_replication(num_experts: int, world_size: int) -> Placement:
    """Every rank holds every expert. The owner (first holder) is the EP owner where E % N == 0
    (``e // (E/N)``), else ``e % N``; it only matters to code that asks for an owner."""
    def owner(e):
        return e * world_size // num_experts if num_experts % world_size == 0 else e % world_size

    holders = []
    for e in range(num_experts):
        o = owner(e)
        holders.append((o,) + tuple(r for r in range(world_size) if r != o))
    return Placement(num_experts, world_size, tuple(holders))


class ZeroMoELayer(MoELayer):
    """:class:`MoELayer` with the full-replication placement and a local dispatch (no communication)."""

    def __init__(self, d_model: int, d_ff: int, moe_cfg: MoEConfig, layer_id: int = 0, seed: int = 0,
                 comm: Optional[Communicator] = None, placement: Optional[Placement] = None,
                 dtype=torch.float32, options: Optional[ZeroOptions] = None):
        comm = comm if comm is not None else Communicator(Topology(1, 1))
        # the Trainer passes the run's EP placement; ZeRO replaces it by full replication
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm,
                         placement=full_replication(moe_cfg.num_experts, comm.world_size), dtype=dtype)
        self.options = options or ZeroOptions()
        assert self.experts.experts == tuple(range(moe_cfg.num_experts))  # slot s is expert s

    def _global_counts(self, lec: torch.Tensor) -> torch.Tensor:
        comm, N = self.comm, self.comm.world_size
        if N == 1 or not self.options.global_loads:
            C = torch.zeros(N, lec.numel(), dtype=torch.int64)
            C[comm.rank] = lec
            return C
        was = comm.rec.enabled
        comm.rec.enabled = False  # metric traffic, not training traffic (and not link-emulated)
        try:
            return comm.all_gather(lec, group="dp").cpu()
        finally:
            comm.rec.enabled = was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rec, E = self.comm.rec, self.cfg.num_experts
        with rec.tagged(layer=self.layer_id, phase="fwd"):
            with rec.span("gate", "gate"):
                routing = self.gate(x, rng=self.route_rng())
            T, k = routing.idx.shape
            flat = routing.idx.reshape(-1).cpu()
            valid = (flat >= 0).nonzero().squeeze(1)
            order = torch.argsort(flat[valid], stable=True)
            pos = valid[order]  # slot index (token*k + j) of each row, expert-major, token order inside
            lec = torch.bincount(flat[valid], minlength=E).to(torch.int64)
            xe = x.index_select(0, (pos // k).to(x.device))
            with rec.span("experts", "expert"):
                ye = self.experts(xe, lec.tolist())
            out_flat = ye.new_zeros(T * k, ye.shape[1]).index_copy(0, pos.to(ye.device), ye)
            y = combine_slots(out_flat, routing.weights)
            C = self._global_counts(lec)
        self.forward_calls += 1
        self.aux_loss = routing.aux_loss
        self.last_routing = routing
        self.last_global_counts = C
        self.last_counts = C[self.comm.rank]
        return y.reshape(shape)

    def plan_record(self) -> dict:
        """The plan of the latest call: counts only (every rank holds every expert; nothing moves)."""
        if self.last_global_counts is None:
            raise RuntimeError("plan_record() needs a forward call first")
        return {"layer": self.layer_id, "call": self.forward_calls - 1, "dispatcher": "local",
                "counts": self.last_global_counts.tolist(), "placement": "full_replication"}
