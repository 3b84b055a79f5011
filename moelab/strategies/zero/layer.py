"""The MoE layer of the ZeRO baseline: every rank holds every expert and runs its own tokens
through them locally (FasterMoE §3: "the whole MoE layer is logically replicated and each worker
runs its own tokens through all experts locally"; FastMoE with ``world_size=1`` inside ZeRO).

It overrides only the stages it changes: the count exchange (local counts) and the two all-to-alls
(identities). Route, place, plan and expert compute are the core's: the placement
(:func:`full_replication`: every rank holds every expert, so by the placement's rule "a holder
keeps its own tokens") makes the core's plan keep every row on its rank, so ``last_plan`` and
:meth:`~moelab.moe.layer.MoELayer.plan_record` describe ZeRO's calls like any layer's. The
arithmetic per expert block is the core's (:class:`~moelab.moe.experts.Experts`), so outputs equal
the EP layer's row for row.

The only collective here is optional and *not training traffic*: with ``global_loads`` the
per-expert counts are all-gathered with the recorder disabled (as the Trainer's loss all-reduce),
so ``last_global_counts`` is the ``[N, E]`` matrix the loads metrics and the simulator's
validation read. Whether an expert's gradient is synchronised is the Update's business
(:class:`~moelab.strategies.zero.update.ZeroUpdate`), not the layer's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.dispatch import CountExchange, DispatchPlan, local_counts
from moelab.moe.layer import MoELayer
from moelab.moe.routing import Routing
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
        with comm.rec.paused():  # metric traffic, not training traffic (and not link-emulated)
            return comm.all_gather(lec, group="dp").cpu()

    # ---- the stages ZeRO changes (route, place, plan and expert compute are the core's) ----------
    def exchange_counts(self, routing: Routing) -> CountExchange:
        """Local counts; the ``[N, E]`` matrix only through the unrecorded metric gather."""
        return CountExchange(self._global_counts(local_counts(routing.idx, self.cfg.num_experts)))

    def plan(self, routing: Routing, counts: CountExchange, placement: Placement,
             shadowed: Sequence[int] = ()) -> DispatchPlan:
        plan = super().plan(routing, counts, placement, shadowed)
        me = self.comm.rank
        if (any(n for r, n in enumerate(plan.in_rows) if r != me)
                or any(n for r, n in enumerate(plan.out_rows) if r != me)):
            raise RuntimeError(f"zero: the plan sends rows off rank {me} ({plan.in_rows}, {plan.out_rows}); "
                               "full replication keeps every row local")
        return plan

    def token_dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return rows  # every row stays on its rank (checked in plan): no all-to-all

    def token_combine(self, back: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return back
