"""Single-process brute-force reference of the MoE layer (the ground truth of the tests).

It holds every expert once, takes each rank's tokens as a separate chunk (gates and capacity are
per source rank), and computes ``y[t] = sum_j w[t,j] * FFN_{idx[t,j]}(x[t])`` with a plain loop
over experts and masks: no dispatch, no permutation, no communication. Same seeded weights as
the distributed layer.
"""
from __future__ import annotations

import torch
from torch import nn

from moelab.config import MoEConfig
from moelab.moe.experts import ACTIVATIONS, init_expert, seeded_generator
from moelab.moe.gates import Gate
from moelab.moe.layer import init_gate_


class ReferenceMoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, cfg: MoEConfig, layer_id: int = 0, seed: int = 0, dtype=torch.float64):
        super().__init__()
        self.cfg, self.layer_id, self.seed = cfg, layer_id, seed
        self.gate = Gate(d_model, cfg, dtype=dtype)
        init_gate_(self.gate, seed, layer_id)
        self.act = ACTIVATIONS[cfg.activation]
        self.expert_params = nn.ParameterList()
        for e in range(cfg.num_experts):
            w1, b1, w2, b2 = init_expert(d_model, d_ff, seed, layer_id, e, dtype)
            if not cfg.expert_bias:
                b1, b2 = torch.zeros_like(b1), torch.zeros_like(b2)
            self.expert_params.extend([nn.Parameter(w1), nn.Parameter(b1), nn.Parameter(w2), nn.Parameter(b2)])

    def expert(self, e: int):
        return tuple(self.expert_params[4 * e + i] for i in range(4))

    def forward_chunk(self, x: torch.Tensor, rank: int = 0, call: int = 0):
        rng = seeded_generator("route", self.seed, self.layer_id, call, rank) if self.cfg.random_routing else None
        r = self.gate(x, rng=rng)
        y = torch.zeros_like(x)
        for e in range(self.cfg.num_experts):
            mask = (r.idx == e).to(x.dtype)  # [T, k]
            wt = (r.weights * mask).sum(1, keepdim=True)  # [T, 1]
            if mask.sum() == 0:
                continue
            w1, b1, w2, b2 = self.expert(e)
            y = y + wt * (self.act(x @ w1 + b1) @ w2 + b2)
        return y, r

    def forward(self, chunks, call: int = 0):
        """``chunks``: one token tensor per rank. Returns (outputs per rank, sum of aux losses, routings)."""
        outs, aux, routes = [], 0, []
        for rank, x in enumerate(chunks):
            y, r = self.forward_chunk(x, rank, call)
            outs.append(y)
            aux = aux + r.aux_loss
            routes.append(r)
        return outs, aux, routes
