"""Gates: route each token to k experts, apply capacity, compute auxiliary losses.

All gates return a :class:`Routing` with ``idx[T,k]`` (global expert id, -1 for a slot dropped by
capacity), differentiable ``weights[T,k]`` and ``loc[T,k]`` (position in the expert's capacity
buffer, DeepSpeed order: all first choices in token order, then all second choices). Capacity is
per source rank, ``ceil(k * cf * T / E)`` (at least ``min_capacity``), as in DeepSpeed/GShard.

- ``topk``: renormalized top-k softmax (softmax over the k chosen logits); dropped slots get weight
  0, the kept one keeps its weight (FastMoE semantics).
- ``gshard``: top-2 over the softmax of all logits, optional random routing of the 2nd expert,
  weights renormalized over the surviving slots after capacity (DeepSpeed ``top2gating``).
- ``switch``: top-1, weight = softmax probability of the chosen expert, capacity drops.
- ``base``: BASE layers' balanced top-1 assignment (auction), weight = sigmoid of the chosen
  logit, no auxiliary loss: :mod:`moelab.moe.base_gate`.
All add the GShard/Switch balance loss ``E * sum_e mean_prob_e * frac_top1_e`` and the router
z-loss ``mean(logsumexp(logits)^2)``, each times its coefficient.
"""
from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import MoEConfig


@dataclass
class Routing:
    idx: torch.Tensor  # [T, k] int64, -1 = dropped
    weights: torch.Tensor  # [T, k]
    loc: torch.Tensor  # [T, k] int64 position within expert capacity (valid where idx >= 0)
    capacity: Optional[int]
    aux_loss: torch.Tensor  # scalar, coefficients applied
    balance_loss: torch.Tensor  # scalar, raw
    z_loss: torch.Tensor  # scalar, raw


def capacity_for(num_tokens: int, num_experts: int, k: int, cf: Optional[float], min_capacity: int = 0) -> Optional[int]:
    if cf is None:
        return None
    exact = Fraction(k * num_tokens, num_experts) * Fraction(str(cf))  # exact decimal cf: no float round-up
    return max(math.ceil(exact), int(min_capacity))


def capacity_locations(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Position of each slot within its expert: first choices in token order, then second choices."""
    T, k = idx.shape
    loc = torch.zeros_like(idx)
    base = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    for j in range(k):
        onehot = F.one_hot(idx[:, j].clamp(min=0), num_experts) * (idx[:, j] >= 0).unsqueeze(1)
        pos = torch.cumsum(onehot, dim=0) - 1 + base
        loc[:, j] = (pos * onehot).sum(1)
        base = base + onehot.sum(0)
    return loc


class Gate(nn.Module):
    """Linear router (no bias) + the routing rule of ``cfg.gate``."""

    def __init__(self, d_model: int, cfg: MoEConfig, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.k = cfg.top_k
        self.wg = nn.Linear(d_model, cfg.num_experts, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, rng: Optional[torch.Generator] = None) -> Routing:
        cfg, E, k = self.cfg, self.num_experts, self.k
        T = x.shape[0]
        logits = self.wg(x)
        if cfg.gate == "base":  # balanced top-1 assignment (BASE layers): moelab.moe.base_gate
            from moelab.moe.base_gate import base_route

            return base_route(self, x, logits)
        probs = torch.softmax(logits, dim=-1)
        if cfg.gate == "topk":
            vals, idx = torch.topk(logits, k, dim=-1)
            weights = torch.softmax(vals, dim=-1)
        elif cfg.gate == "switch":
            idx = probs.argmax(dim=-1, keepdim=True)
            weights = probs.gather(1, idx)
        elif cfg.gate == "gshard":
            i1 = probs.argmax(dim=-1)
            i2 = logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).argmax(dim=-1)
            idx = torch.stack([i1, i2], dim=1)
            weights = probs.gather(1, idx)
            if cfg.random_routing:
                u = torch.rand(T, generator=rng, dtype=torch.float64).to(probs.dtype)
                keep2 = (2 * weights[:, 1].detach()) > u
                idx = torch.stack([i1, torch.where(keep2, i2, torch.full_like(i2, -1))], dim=1)
        else:
            raise ValueError(f"unknown gate {cfg.gate!r}")

        return finish_routing(logits, idx, weights, cfg, renormalize=cfg.gate == "gshard")


def finish_routing(logits: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, cfg: MoEConfig, *,
                   top1: Optional[torch.Tensor] = None, renormalize: bool = False, aux_loss: bool = True) -> Routing:
    """What every gate does after choosing ``idx[T,k]`` and ``weights``: balance and z losses
    (balance over ``top1``, default ``idx[:, 0]``), capacity ``ceil(k*cf*T/E)`` with drops in
    DeepSpeed order, dropped slots weighted 0, optional renormalization over the surviving slots
    (GShard), and ``aux = coef_balance*balance + coef_z*z`` (or 0 for gates without aux loss)."""
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top1 = idx[:, 0] if top1 is None else top1
    frac = torch.bincount(top1, minlength=E).to(probs.dtype) / max(T, 1)
    balance = E * (probs.mean(0) * frac).sum() if T > 0 else probs.sum() * 0
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean() if T > 0 else logits.sum() * 0
    capacity = capacity_for(T, E, idx.shape[1], cfg.capacity_factor, cfg.min_capacity)
    loc = capacity_locations(idx, E)
    if capacity is not None:
        idx = torch.where(loc < capacity, idx, torch.full_like(idx, -1))
    weights = weights * (idx >= 0).to(weights.dtype)
    if renormalize:  # over surviving slots (DeepSpeed top2gating)
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    aux = cfg.balance_loss_coef * balance + cfg.z_loss_coef * z if aux_loss else logits.new_zeros(())
    return Routing(idx, weights, loc, capacity, aux, balance.detach(), z.detach())
