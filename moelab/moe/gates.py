"""Gates: route each token to k experts, apply capacity, compute auxiliary losses.

All gates return a :class:`~moelab.moe.routing.Routing` with ``idx[T,k]`` (global expert id, -1
for a slot dropped by capacity), differentiable ``weights[T,k]`` and ``loc[T,k]`` (position in the
expert's capacity buffer, DeepSpeed order: all first choices in token order, then all second
choices, ...). Capacity is per source rank, ``ceil(k * cf * T / E)`` (at least ``min_capacity``),
as in DeepSpeed/GShard.

The routing rule is looked up by ``cfg.gate`` in a registry (:func:`register_gate`), so a strategy
adds a gate without editing this module. Built in:

- ``topk``: renormalized top-k softmax (softmax over the k chosen logits), any ``1 <= k <= E``
  (DeepSeek-V3 routes 8 of 256); dropped slots get weight 0, the kept ones keep theirs (FastMoE).
- ``gshard``: top-2 over the softmax of all logits, optional random routing of the 2nd expert,
  weights renormalized over the surviving slots after capacity (DeepSpeed ``top2gating``).
- ``switch``: top-1, weight = softmax probability of the chosen expert, capacity drops.
- ``base``: BASE layers' balanced top-1 assignment (auction), weight = sigmoid of the chosen
  logit, no auxiliary loss: :mod:`moelab.moe.base_gate`.
All add the GShard/Switch balance loss ``E * sum_e mean_prob_e * frac_top1_e`` and the router
z-loss ``mean(logsumexp(logits)^2)``, each times its coefficient (:func:`finish_routing`), over the
tokens they see (one rank's); training takes the balance loss over the global batch from the
statistics they keep (``Routing.balance_stats``, :func:`moelab.moe.layer.global_aux_losses`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import MoEConfig
from moelab.kernels import impl_for
from moelab.kernels.router import route_triton
from moelab.moe.base_gate import base_route
from moelab.moe.routing import Routing, capacity_for, capacity_locations, finish_routing  # noqa: F401 (re-exported)

GATES: dict = {}
GATE_NEEDS: dict = {}  # name -> needs(run_cfg) -> [message]: what the gate asks of the run (top-k, batch)


def register_gate(name: str, rule: Optional[Callable] = None, *, needs: Optional[Callable] = None):
    """Register ``rule(gate, x, logits, rng) -> Routing`` as ``cfg.gate = name`` (also a decorator);
    ``needs(run_cfg) -> [message]`` says what the gate asks of the run (checked before any process starts)."""
    def deco(f):
        GATES[name] = f
        GATE_NEEDS[name] = needs or (lambda cfg: [])
        return f

    return deco(rule) if rule is not None else deco


def gate_errors(cfg) -> list:
    """``model.moe.gate`` names a registered gate, and the run gives it what it needs."""
    gate = cfg.model.moe.gate
    if gate not in GATES:
        return [f"model.moe.gate must be one of {tuple(sorted(GATES))}, got {gate!r}"]
    return GATE_NEEDS[gate](cfg)


def _top(k: int, name: str) -> Callable:
    """``needs`` of a gate that routes exactly ``k`` experts per token."""
    return lambda cfg: [] if cfg.model.moe.top_k == k else [
        f"model.moe.gate={name!r} is a top-{k} gate: set model.moe.top_k={k}"]


def _balanced_needs(cfg) -> list:
    """BASE layers assign every expert exactly T/E of a rank's T tokens, one expert each."""
    moe, T = cfg.model.moe, cfg.train.batch_size * cfg.model.seq_len
    if moe.top_k != 1 or T % max(moe.num_experts, 1):
        return [f"model.moe.gate='base' is a balanced top-1 gate (every expert gets exactly T/E of a rank's "
                f"T = train.batch_size * model.seq_len = {T} tokens): set model.moe.top_k=1 (got {moe.top_k}) "
                f"and make T divisible by num_experts={moe.num_experts}"]
    return []


@register_gate("topk")
def topk_rule(gate, x, logits, rng) -> Routing:
    if impl_for(gate.cfg.kernels, logits) == "triton":  # the fused router: top-k, weights and positions
        idx, weights, loc = route_triton(logits.detach(), gate.k)
        if logits.requires_grad:  # the kernel's weights carry no graph: the same softmax, differentiable
            weights = torch.softmax(logits.gather(1, idx), dim=-1)
        return finish_routing(logits, idx, weights, gate.cfg, loc=loc)
    vals, idx = torch.topk(logits, gate.k, dim=-1)
    return finish_routing(logits, idx, torch.softmax(vals, dim=-1), gate.cfg)


@register_gate("switch", needs=_top(1, "switch"))
def switch_rule(gate, x, logits, rng) -> Routing:
    probs = torch.softmax(logits, dim=-1)
    idx = probs.argmax(dim=-1, keepdim=True)
    return finish_routing(logits, idx, probs.gather(1, idx), gate.cfg)


@register_gate("gshard", needs=_top(2, "gshard"))
def gshard_rule(gate, x, logits, rng) -> Routing:
    probs = torch.softmax(logits, dim=-1)
    i1 = probs.argmax(dim=-1)
    i2 = logits.masked_fill(F.one_hot(i1, gate.num_experts).bool(), float("-inf")).argmax(dim=-1)
    idx = torch.stack([i1, i2], dim=1)
    weights = probs.gather(1, idx)
    if gate.cfg.random_routing:
        u = torch.rand(x.shape[0], generator=rng, dtype=torch.float64).to(probs.dtype)
        keep2 = (2 * weights[:, 1].detach()) > u
        idx = torch.stack([i1, torch.where(keep2, i2, torch.full_like(i2, -1))], dim=1)
    return finish_routing(logits, idx, weights, gate.cfg, renormalize=True)


register_gate("base", lambda gate, x, logits, rng: base_route(gate, x, logits), needs=_balanced_needs)


class Gate(nn.Module):
    """Linear router (no bias) + the routing rule registered as ``cfg.gate``."""

    def __init__(self, d_model: int, cfg: MoEConfig, dtype=torch.float32):
        super().__init__()
        if cfg.gate not in GATES:
            raise ValueError(f"unknown gate model.moe.gate={cfg.gate!r}; registered: {sorted(GATES)}")
        if not 1 <= cfg.top_k <= cfg.num_experts:
            raise ValueError(f"model.moe.top_k must be in 1..num_experts={cfg.num_experts}, got {cfg.top_k}")
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.k = cfg.top_k
        self.wg = nn.Linear(d_model, cfg.num_experts, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, rng: Optional[torch.Generator] = None) -> Routing:
        return GATES[self.cfg.gate](self, x, self.wg(x), rng)
