"""BASE-layer routing (Lewis et al. 2021, "BASE Layers"; FasterMoE §3 baseline): a balanced top-1
assignment of a rank's tokens to experts that maximises the total token-expert affinity.

Affinity = the gate logit ``x . c_e`` (the router's weight rows are the expert centroids). During
training every expert receives exactly ``T / E`` of the rank's ``T`` tokens, found by the auction
algorithm (:func:`auction_assignment`); in eval mode (``gate.training`` False) each token takes its
argmax expert (no balancing, as FairSeq's ``greedy_assignment`` at inference).

Choices (documented, moelab's "BASE-like" gate):

- **Output weight** = ``sigmoid(logit of the assigned expert)``, so the layer returns
  ``sigmoid(x.c_e) * FFN_e(x)``. FairSeq's layer returns ``a*FFN_e(x) + (1-a)*x``; the ``(1-a)*x``
  term is left out here (the Transformer block's residual already adds ``x``; the routing interface
  is "weights times expert outputs" and is shared with the reference). The weight is
  differentiable (the router learns through it); the assignment itself is not.
- **Balance is per rank.** FairSeq shuffles tokens randomly across workers first and then
  balances the tokens each worker holds; moelab skips the shuffle and balances each rank's own
  ``T`` tokens, so every expert receives exactly ``T/E`` tokens from each rank (``N*T/E`` in all).
- **Remainder rule** (T not divisible by E, possible only outside training runs: ``RunConfig``
  rejects it): expert e has ``floor(T/E) + (1 if e < T mod E else 0)`` slots.
- **No auxiliary loss** (balancing is by construction): ``aux_loss`` is 0 whatever the balance and
  z-loss coefficients; ``balance_loss`` and ``z_loss`` are still reported (detached) as metrics.
- Capacity: none is needed (exactly balanced); a configured ``capacity_factor`` still clips as in
  the other gates (it only drops tokens when ``cf < 1``).

Auction (Bertsekas, for an assignment with identical slots per expert): unassigned tokens bid, all
at once, for their best expert at its price; an expert keeps its ``cap`` highest bids; its price is
the lowest kept bid once it is full (0 before). A token bids ``price + (best - second best net
value) + eps``. Spec defaults: ``eps = max((max - min) / 50, 1e-4)`` over the scores, at most 100
rounds; tokens still unassigned after that are placed greedily (best affinity first) on experts
with free slots, so the balance is always exact. A finished auction is within ``T*eps`` of the
optimum; ``min_eps`` adds eps-scaling phases (eps / 4 each, prices kept) down to ``min_eps`` for an
exact optimum in tests.
"""
from __future__ import annotations

from typing import Optional

import torch

from moelab.moe.routing import finish_routing

MAX_ITERS = 100


def default_eps(scores: torch.Tensor) -> float:
    if scores.numel() == 0:
        return 1e-4
    return max(float(scores.max() - scores.min()) / 50.0, 1e-4)


def balanced_capacities(T: int, E: int) -> torch.Tensor:
    """Slots per expert: ``T // E`` each, the first ``T % E`` experts one more."""
    base, rem = divmod(int(T), int(E))
    return torch.tensor([base + (1 if e < rem else 0) for e in range(E)], dtype=torch.int64)


def _auction_phase(a: torch.Tensor, cap: torch.Tensor, price: torch.Tensor, eps: float, max_iters: int):
    """One auction at a fixed eps from prices ``price`` (updated in place). Returns (assign, iters)."""
    T, E = a.shape
    assign = torch.full((T,), -1, dtype=torch.int64)
    bid_of = torch.zeros(T, dtype=a.dtype)
    it = 0
    while it < max_iters:
        un = (assign < 0).nonzero().squeeze(1)
        if un.numel() == 0:
            break
        it += 1
        net = a[un] - price  # [U, E]
        top = torch.topk(net, 2, dim=1)
        best = top.indices[:, 0]
        incr = top.values[:, 0] - top.values[:, 1] + eps
        bids = price[best] + incr
        # merge the new bids with the held ones; every expert keeps its cap highest (ties: lower token id)
        held = (assign >= 0).nonzero().squeeze(1)
        tok = torch.cat([held, un])
        ex = torch.cat([assign[held], best])
        bd = torch.cat([bid_of[held], bids])
        o = torch.argsort(tok, stable=True)
        tok, ex, bd = tok[o], ex[o], bd[o]
        o = torch.argsort(-bd, stable=True)
        tok, ex, bd = tok[o], ex[o], bd[o]
        o = torch.argsort(ex, stable=True)
        tok, ex, bd = tok[o], ex[o], bd[o]
        n_e = torch.bincount(ex, minlength=E)
        start = torch.cumsum(n_e, 0) - n_e
        rank_in = torch.arange(tok.numel()) - start[ex]
        keep = rank_in < cap[ex]
        assign.fill_(-1)
        assign[tok[keep]] = ex[keep]
        bid_of[tok[keep]] = bd[keep]
        # price of a full expert = its lowest kept bid (the kept bids are sorted descending)
        kept_n = torch.bincount(ex[keep], minlength=E)
        full = (kept_n == cap) & (cap > 0)
        last = start + cap - 1
        price[full] = bd[last[full]]
    return assign, it


def auction_assignment(scores: torch.Tensor, capacities: Optional[torch.Tensor] = None, *,
                       eps: Optional[float] = None, max_iters: int = MAX_ITERS,
                       min_eps: Optional[float] = None) -> torch.Tensor:
    """Token -> expert (``[T]`` int64) maximising ``sum_t scores[t, assign[t]]`` subject to expert e
    receiving exactly ``capacities[e]`` tokens (default :func:`balanced_capacities`).

    Pure and deterministic (float64 on the CPU whatever the input's dtype/device). ``eps`` defaults
    to :func:`default_eps`; ``max_iters`` bounds the bidding rounds of each phase; ``min_eps`` (optional)
    runs eps-scaling phases down to it. Non-finite scores are replaced by the smallest finite one.
    """
    a = scores.detach().to("cpu", torch.float64)
    if a.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    T, E = a.shape
    cap = balanced_capacities(T, E) if capacities is None else torch.as_tensor(capacities, dtype=torch.int64).cpu()
    if cap.numel() != E or int(cap.sum()) != T or bool((cap < 0).any()):
        raise ValueError(f"capacities must be {E} non-negative counts summing to T={T}, got {cap.tolist()}")
    if T == 0:
        return torch.zeros(0, dtype=torch.int64)
    ok = torch.isfinite(a)
    if not bool(ok.all()):
        a = torch.where(ok, a, a[ok].min() if bool(ok.any()) else torch.zeros((), dtype=a.dtype))
    if E == 1:
        return torch.zeros(T, dtype=torch.int64)
    # an expert without slots can never be chosen: price it out of every bid
    a = a.masked_fill((cap == 0).unsqueeze(0), float(a.min()) - 1e6 * (1.0 + float(a.max() - a.min())))
    eps = default_eps(a[:, cap > 0]) if eps is None else float(eps)
    price = torch.zeros(E, dtype=torch.float64)
    while True:
        assign, _ = _auction_phase(a, cap, price, eps, max_iters)
        if min_eps is None or eps <= min_eps:
            break
        eps = max(eps / 4.0, float(min_eps))
    un = (assign < 0).nonzero().squeeze(1)
    if un.numel():  # out of rounds: greedy fill of the free slots, most confident token first
        free = cap - torch.bincount(assign[assign >= 0], minlength=E)
        best_val = a[un].max(1).values
        for t in un[torch.argsort(-best_val, stable=True)].tolist():
            row = a[t].masked_fill(free <= 0, float("-inf"))
            e = int(torch.argmax(row))
            assign[t] = e
            free[e] -= 1
    return assign


def base_route(gate, x: torch.Tensor, logits: torch.Tensor):
    """The ``gate="base"`` routing of :class:`moelab.moe.gates.Gate` (top-1): see the module docstring."""
    if gate.k != 1:
        raise ValueError(f"gate='base' is a top-1 gate: set top_k=1 (got {gate.k})")
    if gate.training:
        idx = auction_assignment(logits.detach()).to(logits.device).unsqueeze(1)
    else:
        idx = logits.detach().argmax(dim=-1, keepdim=True)
    weights = torch.sigmoid(logits.gather(1, idx))
    return finish_routing(logits, idx, weights, gate.cfg, aux_loss=False)  # balanced by construction: no aux loss
