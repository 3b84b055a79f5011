"""What every gate produces and what every gate does after choosing experts (one place each).

:class:`Routing` is the gate's output; :func:`finish_routing` applies the balance and z losses,
capacity ``ceil(k*cf*T/E)`` with drops in DeepSpeed order (choice j's slots after all choices
< j, for any k) and weight masking. Kept apart from :mod:`.gates` so gates defined elsewhere
(:mod:`.base_gate`, strategies' gates) import it without importing the gate registry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch

from moelab.config import MoEConfig
from moelab.kernels.router import capacity_locations


@dataclass
class Routing:
    idx: torch.Tensor  # [T, k] int64, -1 = dropped
    weights: torch.Tensor  # [T, k]
    loc: torch.Tensor  # [T, k] int64 position within expert capacity (valid where idx >= 0)
    capacity: Optional[int]
    aux_loss: torch.Tensor  # scalar, coefficients applied
    balance_loss: torch.Tensor  # scalar, raw
    z_loss: torch.Tensor  # scalar, raw


def capacity_for(num_tokens: int, num_experts: int, k: int, cf: Optional[float],
                 min_capacity: int = 0) -> Optional[int]:
    if cf is None:
        return None
    exact = Fraction(k * num_tokens, num_experts) * Fraction(str(cf))  # exact decimal cf: no float round-up
    return max(math.ceil(exact), int(min_capacity))


def finish_routing(logits: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, cfg: MoEConfig, *,
                   top1: Optional[torch.Tensor] = None, renormalize: bool = False, aux_loss: bool = True,
                   loc: Optional[torch.Tensor] = None) -> Routing:
    """What every gate does after choosing ``idx[T,k]`` and ``weights``: balance and z losses
    (balance over ``top1``, default ``idx[:, 0]``), capacity ``ceil(k*cf*T/E)`` with drops in
    DeepSpeed order, dropped slots weighted 0, optional renormalization over the surviving slots
    (GShard), and ``aux = coef_balance*balance + coef_z*z`` (or 0 for gates without aux loss).
    ``loc``: the slots' capacity positions when a kernel computed them already (:mod:`moelab.kernels.router`)."""
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top1 = idx[:, 0] if top1 is None else top1
    frac = torch.bincount(top1, minlength=E).to(probs.dtype) / max(T, 1)
    balance = E * (probs.mean(0) * frac).sum() if T > 0 else probs.sum() * 0
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean() if T > 0 else logits.sum() * 0
    capacity = capacity_for(T, E, idx.shape[1], cfg.capacity_factor, cfg.min_capacity)
    loc = capacity_locations(idx, E) if loc is None else loc
    if capacity is not None:
        idx = torch.where(loc < capacity, idx, torch.full_like(idx, -1))
    weights = weights * (idx >= 0).to(weights.dtype)
    if renormalize:  # over surviving slots (DeepSpeed top2gating)
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    aux = cfg.balance_loss_coef * balance + cfg.z_loss_coef * z if aux_loss else logits.new_zeros(())
    return Routing(idx, weights, loc, capacity, aux, balance.detach(), z.detach())
