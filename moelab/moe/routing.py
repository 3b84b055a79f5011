"""What every gate produces and what every gate does after choosing experts (one place each).

:class:`Routing` is the gate's output; :func:`finish_routing` applies the balance and z losses,
capacity ``ceil(k*cf*T/E)`` with drops in DeepSpeed order (choice j's slots after all choices
< j, for any k) and weight masking. Kept apart from :mod:`.gates` so gates defined elsewhere
(:mod:`.base_gate`, strategies' gates) import it without importing the gate registry.

A gate sees one rank's tokens, so ``Routing.aux_loss`` is that rank's (DeepSpeed's per-device
``l_aux``). ``Routing.balance_stats`` keeps what the balance loss needs from those tokens, and
:func:`balance_share` turns the token group's summed counts into this rank's share of the balance
loss over the *global* batch (:func:`moelab.moe.layer.global_aux_losses`, what training adds).
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
class BalanceStats:
    """One rank's part of the balance loss ``E * sum_e f_e * P_e``: what its ``T`` tokens contribute."""

    probs_sum: torch.Tensor  # [E] sum over the tokens of softmax(logits) (differentiable): T * P_e of the rank
    top1_counts: torch.Tensor  # [E] int64, tokens whose first choice (before capacity) is e: T * f_e of the rank
    z_term: torch.Tensor  # z_loss_coef * z-loss (differentiable): the part of aux_loss that is not balance


@dataclass
class Routing:
    idx: torch.Tensor  # [T, k] int64, -1 = dropped
    weights: torch.Tensor  # [T, k]
    loc: torch.Tensor  # [T, k] int64 position within expert capacity (valid where idx >= 0)
    capacity: Optional[int]
    aux_loss: torch.Tensor  # scalar, coefficients applied
    balance_loss: torch.Tensor  # scalar, raw
    z_loss: torch.Tensor  # scalar, raw
    # the balance loss's statistics of these tokens; None: the gate adds no auxiliary loss (base)
    balance_stats: Optional[BalanceStats] = None


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
    counts = torch.bincount(top1, minlength=E)
    frac = counts.to(probs.dtype) / max(T, 1)
    balance = E * (probs.mean(0) * frac).sum() if T > 0 else probs.sum() * 0
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean() if T > 0 else logits.sum() * 0
    z_term = cfg.z_loss_coef * z
    capacity = capacity_for(T, E, idx.shape[1], cfg.capacity_factor, cfg.min_capacity)
    loc = capacity_locations(idx, E) if loc is None else loc
    if capacity is not None:
        idx = torch.where(loc < capacity, idx, torch.full_like(idx, -1))
    weights = weights * (idx >= 0).to(weights.dtype)
    if renormalize:  # over surviving slots (DeepSpeed top2gating)
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    aux = cfg.balance_loss_coef * balance + z_term if aux_loss else logits.new_zeros(())
    stats = BalanceStats(probs.sum(0), counts, z_term) if aux_loss else None
    return Routing(idx, weights, loc, capacity, aux, balance.detach(), z.detach(), stats)


def balance_share(stats: BalanceStats, global_counts: torch.Tensor, ranks: int) -> torch.Tensor:
    """This rank's share of the balance loss over a global batch split across ``ranks`` ranks.

    With ``C_e`` = ``global_counts`` (the first choices summed over the ranks), ``N = sum_e C_e``
    the global token count, ``f_e = C_e / N`` and ``P_e`` the mean router probability over all ``N``
    tokens, the global loss is ``L = E * sum_e f_e * P_e``. The share of rank ``r`` is
    ``L_r = E * sum_e f_e * (sum_{t on r} p_te) * ranks / N``: the mean of the shares over the ranks
    is ``L``, and, ``f`` carrying no gradient (counts of argmax / top-k choices), so is the mean of
    their gradients, exactly, for any split of the batch (uneven and empty ranks included). A
    data-parallel sync that averages the replicated gate's gradients therefore applies ``dL/dθ``
    with no autograd collective."""
    dtype = stats.probs_sum.dtype
    E = stats.probs_sum.numel()
    n = global_counts.sum().clamp(min=1).to(dtype)
    frac = global_counts.to(dtype) / n
    return E * (frac * stats.probs_sum).sum() * (ranks / n)
