"""Single-process brute-force reference of the MoE layer (the ground truth of the tests).

It holds every expert once, takes each rank's tokens as a separate chunk (gates and capacity are
per source rank), and computes ``y[t] = sum_j w[t,j] * FFN_{idx[t,j]}(x[t])`` with a plain loop
over experts and masks: no dispatch, no permutation, no communication. Same seeded weights as
the distributed layer (the gate through :func:`moelab.moe.layer.init_gate_`, the experts through
:func:`moelab.moe.experts.init_expert`).

The routing (:class:`ReferenceRouter`) is written here from scratch, plainly and slowly, and
shares no code with :mod:`moelab.moe.gates`, so a bug in the production gates (top-k, weights,
capacity positions, drops, losses) shows up as a disagreement instead of being copied to both
sides. What it shares with production on purpose:

- the router weights and the seeded initialisation (the premise of every comparison);
- GShard's random routing draws: ``torch.rand(T, generator=seeded_generator("route", seed,
  layer, call, rank), dtype=float64)``, one uniform per token in token order. This draw order is
  the one fact both sides must agree on; the rule applied to the draws is re-implemented here;
- the BASE gate's assignment (:func:`moelab.moe.base_gate.auction_assignment`). The auction
  stops at an eps-optimal assignment, and which one it stops at decides the layer's exact output,
  so no independent solver can reproduce it bit for bit. The reference takes the assignment from
  the auction and re-derives everything after it (weights, losses); ``tests/moe/test_reference.py``
  checks the assignment itself independently with scipy's ``linear_sum_assignment`` (exact balance,
  within ``T*eps`` of the optimum, and equal to it once eps is small).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
from torch import nn

from moelab.config import MoEConfig
from moelab.moe.base_gate import auction_assignment
from moelab.moe.experts import ACTIVATIONS, init_expert, seeded_generator
from moelab.moe.layer import init_gate_


@dataclass
class RefRouting:
    """The reference's routing of one chunk; the same fields as the production ``Routing``."""

    idx: torch.Tensor  # [T, k] expert per slot, -1 = dropped
    weights: torch.Tensor  # [T, k], 0 on dropped slots
    loc: torch.Tensor  # [T, k] position in the expert's capacity buffer (meaningful where idx >= 0)
    capacity: Optional[int]
    aux_loss: torch.Tensor  # coefficients applied
    balance_loss: torch.Tensor  # raw, detached
    z_loss: torch.Tensor  # raw, detached


def reference_capacity(T: int, E: int, k: int, cf: Optional[float], min_capacity: int = 0) -> Optional[int]:
    """``max(ceil(k * cf * T / E), min_capacity)`` per source rank, with ``cf`` taken as the exact
    decimal it is written as (1.1 is 11/10, not the float just above it); None when dropless."""
    if cf is None:
        return None
    return max(math.ceil(Fraction(repr(float(cf))) * k * T / E), int(min_capacity))


def positions(idx: torch.Tensor, E: int) -> torch.Tensor:
    """Each slot's place in its expert's queue: every first choice in token order, then every
    second choice, and so on. Slots already dropped (-1) take no place (and get 0)."""
    T, k = idx.shape
    loc = torch.zeros(T, k, dtype=torch.int64)
    filled = [0] * E
    for j in range(k):
        for t in range(T):
            e = int(idx[t, j])
            if e >= 0:
                loc[t, j] = filled[e]
                filled[e] += 1
    return loc


def softmax_rows(z: torch.Tensor) -> torch.Tensor:
    """``exp(z - max) / sum exp(z - max)`` along the last axis (written out, differentiable)."""
    ez = torch.exp(z - z.max(dim=-1, keepdim=True).values.detach())
    return ez / ez.sum(dim=-1, keepdim=True)


def choose(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest entries of each row, largest first (ties: lower expert id), as ``[T, k]`` ids."""
    return torch.argsort(scores.detach(), dim=-1, descending=True, stable=True)[:, :k]


class ReferenceRouter(nn.Module):
    """Linear router (no bias) and the four routing rules, written out plainly (see module doc)."""

    def __init__(self, d_model: int, cfg: MoEConfig, seed: int = 0, layer_id: int = 0, dtype=torch.float64):
        super().__init__()
        self.cfg, self.seed, self.layer_id = cfg, seed, layer_id
        self.wg = nn.Linear(d_model, cfg.num_experts, bias=False, dtype=dtype)
        init_gate_(self, seed, layer_id)

    def forward(self, x: torch.Tensor, rng: Optional[torch.Generator] = None) -> RefRouting:
        cfg, E = self.cfg, self.cfg.num_experts
        T = x.shape[0]
        logits = self.wg(x)
        probs = softmax_rows(logits) if T else logits
        renormalize, has_aux = False, True
        if cfg.gate == "topk":
            k = cfg.top_k
            idx = choose(logits, k)
            weights = softmax_rows(torch.gather(logits, 1, idx)) if T else logits[:, :k]
        elif cfg.gate == "switch":
            idx = choose(probs, 1)
            weights = torch.gather(probs, 1, idx)
        elif cfg.gate == "gshard":
            first = choose(probs, 1)[:, 0]
            masked = logits.detach().clone()
            masked[torch.arange(T), first] = float("-inf")
            second = choose(masked, 1)[:, 0]
            idx = torch.stack([first, second], dim=1)
            weights = torch.gather(probs, 1, idx)
            if cfg.random_routing:  # keep the 2nd expert with probability min(1, 2 * p2)
                u = torch.rand(T, generator=rng, dtype=torch.float64)
                idx = idx.clone()  # the gather above saved idx for backward
                for t in range(T):
                    if not float(2 * weights[t, 1].detach()) > float(u[t].to(weights.dtype)):
                        idx[t, 1] = -1
            renormalize = True
        elif cfg.gate == "base":
            if cfg.top_k != 1:
                raise ValueError(f"gate='base' is a top-1 gate: set top_k=1 (got {cfg.top_k})")
            chosen = auction_assignment(logits.detach()) if self.training else logits.detach().argmax(-1)
            idx = chosen.reshape(T, 1)
            weights = torch.sigmoid(torch.gather(logits, 1, idx))
            has_aux = False
        else:
            raise ValueError(f"unknown gate {cfg.gate!r}")

        # losses, over the choices before any capacity drop
        if T:
            top1 = [int(e) for e in idx[:, 0]]
            frac = torch.tensor([top1.count(e) / T for e in range(E)], dtype=probs.dtype)
            balance = E * (probs.mean(dim=0) * frac).sum()
            lse = logits.max(-1).values + torch.log(torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1))
            z = (lse ** 2).mean()
        else:
            balance = z = logits.sum() * 0
        aux = cfg.balance_loss_coef * balance + cfg.z_loss_coef * z if has_aux else logits.sum() * 0

        # capacity by position: a slot whose place in its expert's queue is past the capacity is dropped
        k = idx.shape[1]
        capacity = reference_capacity(T, E, k, cfg.capacity_factor, cfg.min_capacity)
        loc = positions(idx, E)
        keep = torch.ones(T, k, dtype=torch.bool)
        for t in range(T):
            for j in range(k):
                if int(idx[t, j]) < 0 or (capacity is not None and int(loc[t, j]) >= capacity):
                    keep[t, j] = False
        idx = torch.where(keep, idx, torch.full_like(idx, -1))
        weights = weights * keep.to(weights.dtype)
        if renormalize:  # GShard: over the slots that survived
            total = weights.sum(dim=1, keepdim=True)
            weights = weights / torch.clamp(total, min=torch.finfo(weights.dtype).eps)
        return RefRouting(idx, weights, loc, capacity, aux, balance.detach(), z.detach())


class ReferenceMoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, cfg: MoEConfig, layer_id: int = 0, seed: int = 0, dtype=torch.float64):
        super().__init__()
        self.cfg, self.layer_id, self.seed = cfg, layer_id, seed
        self.gate = ReferenceRouter(d_model, cfg, seed, layer_id, dtype=dtype)
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
