"""The MoE layer as stages: route -> place -> dispatch -> expert compute -> combine.

Backward mirrors it through autograd (the all-to-alls are autograd Functions). A strategy changes
only the stage it needs: the placement (who holds which expert), the dispatcher, or what happens
to gradients. Usable as a drop-in replacement of a Transformer FFN: ``y = layer(x)`` for any
``x[..., d_model]``; the auxiliary loss is left in ``layer.aux_loss`` for the model to add.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.dispatch import DenseDispatcher, SparseDispatcher
from moelab.moe.experts import Experts, seeded_generator
from moelab.moe.gates import Gate
from moelab.placement import Placement


def init_gate_(gate: Gate, seed: int, layer_id: int) -> None:
    """Gate weights identical on every rank (and in the reference): seeded by (seed, layer)."""
    g = seeded_generator("gate", seed, layer_id)
    bound = 1 / math.sqrt(gate.wg.in_features)
    w = (torch.rand(gate.wg.weight.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
    with torch.no_grad():
        gate.wg.weight.copy_(w.to(gate.wg.weight.dtype))


class MoELayer(nn.Module):
    def __init__(self, d_model: int, d_ff: int, moe_cfg: MoEConfig, layer_id: int = 0, seed: int = 0,
                 comm: Optional[Communicator] = None, placement: Optional[Placement] = None,
                 dtype=torch.float32):
        super().__init__()
        self.cfg, self.layer_id, self.seed = moe_cfg, layer_id, seed
        self.comm = comm if comm is not None else Communicator(Topology(1, 1))
        self.placement = placement or Placement.expert_parallel(moe_cfg.num_experts, self.comm.world_size)
        if self.placement.world_size != self.comm.world_size or self.placement.num_experts != moe_cfg.num_experts:
            raise ValueError("placement does not match the communicator's world size or the expert count")
        self.gate = Gate(d_model, moe_cfg, dtype=dtype)
        init_gate_(self.gate, seed, layer_id)
        self.experts = Experts(d_model, d_ff, self.placement.local_experts(self.comm.rank), seed=seed,
                               layer_id=layer_id, activation=moe_cfg.activation, bias=moe_cfg.expert_bias, dtype=dtype)
        dispatcher_cls = {"sparse": SparseDispatcher, "dense": DenseDispatcher}[moe_cfg.dispatcher]
        self.dispatcher = dispatcher_cls(self.comm, self.placement)
        self.forward_calls = 0
        self.aux_loss = torch.zeros(())
        self.last_counts = torch.zeros(moe_cfg.num_experts, dtype=torch.int64)
        self.last_global_counts = None
        self.last_routing = None

    def route_rng(self) -> Optional[torch.Generator]:
        """Random routing draws from (seed, layer, call, rank): reproducible and rank-distinct."""
        if not self.cfg.random_routing:
            return None
        return seeded_generator("route", self.seed, self.layer_id, self.forward_calls, self.comm.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rec = self.comm.rec
        with rec.tagged(layer=self.layer_id, phase="fwd"):
            with rec.span("gate", "gate"):
                routing = self.gate(x, rng=self.route_rng())
            plan = self.dispatcher.plan(routing)
            xe = self.dispatcher.dispatch(x, plan, routing)
            with rec.span("experts", "expert"):
                ye = self.experts(xe, plan.rows_per_slot)
            y = self.dispatcher.combine(ye, plan, routing)
        self.forward_calls += 1
        self.aux_loss = routing.aux_loss
        self.last_routing = routing
        self.last_global_counts = plan.global_counts
        self.last_counts = plan.global_counts[self.comm.rank]
        return y.reshape(shape)
