"""Routing traces for reproductions whose papers' recorded traces are out of reach: a drifting
popularity generator, exact top-2 draws from a popularity, rescaling a recorded count matrix to
other sizes, popularity summaries, and a gate that replays given counts (as FastMoE's AE
``TraceRepGate``). Pure numpy/torch; a paper's calibration of them is its data (assumptions.yaml)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from moelab.models.traces import trace_to_token_choices
from moelab.moe.gates import Routing, capacity_locations


def top2_shares(p) -> np.ndarray:
    """Expected share of assignments per expert when every token draws 2 distinct experts from ``p``
    (first ~ p, second ~ p without the first): ``(p_e + sum_j p_j p_e / (1 - p_j)) / 2``."""
    p = np.asarray(p, dtype=np.float64)
    q = p / np.clip(1.0 - p, 1e-12, None)
    second = p * (q.sum(-1, keepdims=True) - q)
    return (p + second) / 2.0


def _calibrate_hot(base: np.ndarray, hot: np.ndarray, target: float) -> float:
    """The offset H added to the hot experts' scores so that their mean top-2 share is ``target``."""
    lo, hi = 0.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        z = base + mid * hot
        p = np.exp(z - z.max())
        p /= p.sum()
        if top2_shares(p)[hot].mean() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def drifting_popularity(iters: Sequence[int], E: int, *, hot_share: float, noise: float, step0: float, decay: float,
                        seed: Sequence[int]) -> np.ndarray:
    """Expert popularity ``p_t = softmax(z_t)`` at the given iterations, ``[len(iters), E]`` (any order,
    repeats allowed): a synthetic stand-in for recorded routing when a paper's traces are out of reach.

    ``z_0``: E/4 randomly chosen hot experts get an offset calibrated so that each takes ``hot_share`` of
    the top-2 assignments (scaled for E != 16); the others have N(0, ``noise``) scores. Then a Gaussian
    random walk with decaying step size ``step_t = step0 / (1 + t / decay)``; the walk between two
    requested iterations is one exact Gaussian increment (variance = sum of the step variances), so
    iteration 80500 costs the same as iteration 1. ``seed``: the RNG key (e.g. (seed, layer, E, tag)).
    """
    it = np.asarray(sorted(set(int(i) for i in iters)), dtype=np.int64)
    rng = np.random.default_rng([int(s) for s in seed])
    n_hot = max(1, E // 4)
    hot = np.zeros(E, dtype=bool)
    hot[rng.choice(E, n_hot, replace=False)] = True
    base = rng.standard_normal(E) * noise
    z = base + _calibrate_hot(base, hot, min(hot_share * 16 / E, 0.49)) * hot
    var_cum = lambda t: (step0 ** 2) * decay * (1.0 - 1.0 / (1.0 + t / decay))  # noqa: E731
    out, t_prev = [], 0
    for t in it:
        dv = var_cum(t) - var_cum(t_prev)
        if dv > 0:
            z = z + rng.standard_normal(E) * math.sqrt(dv)
        p = np.exp(z - z.max())
        out.append(p / p.sum())
        t_prev = t
    P = np.stack(out)
    order = np.searchsorted(it, np.asarray(iters))
    return P[order]


def top2_counts(p, tokens: int, sources: int, rng: np.random.Generator) -> np.ndarray:
    """``[sources, E]`` assignment counts: every source's ``tokens`` tokens each draw 2 distinct experts
    from ``p`` (exact distribution: first choices multinomial, then per first choice the second choices
    multinomial over the other experts)."""
    p = np.asarray(p, dtype=np.float64)
    E = len(p)
    out = np.zeros((sources, E), dtype=np.int64)
    for j in range(sources):
        first = rng.multinomial(tokens, p)
        row = first.copy()
        for i in np.nonzero(first)[0]:
            q = p.copy()
            q[i] = 0.0
            row += rng.multinomial(first[i], q / q.sum())
        out[j] = row
    return out


def rescale_counts(C, sources: int, tokens: int, k: int = 2, nodes: int = 2,
                   tokens_src: Optional[int] = None) -> np.ndarray:
    """Map a recorded ``[N_src, E]`` count matrix to ``sources`` workers with ``tokens`` tokens each.

    Sources are mapped node-preservingly (worker j of node n takes the row of a source of node n, round
    robin), each row scaled by ``tokens / tokens_src`` (so dropped slots stay dropped; ``tokens_src``
    defaults to row sum / k), rounded by largest remainder, every entry capped at ``tokens`` (a token
    picks k distinct experts). Used to replay T1 (and the convergence runs' routing) at other sizes.
    """
    C = np.asarray(C, dtype=np.float64)
    Ns, E = C.shape
    ns_per = max(Ns // nodes, 1)
    nd_per = max(sources // nodes, 1)
    out = np.zeros((sources, E), dtype=np.int64)
    for j in range(sources):
        node = min(j // nd_per, nodes - 1)
        src = min(node * ns_per + (j % nd_per) % ns_per, Ns - 1)
        row = C[src]
        ts = tokens_src if tokens_src is not None else max(row.sum() / k, 1.0)
        want = row * tokens / ts
        target = int(round(want.sum()))
        base = np.floor(want).astype(np.int64)
        rem = target - int(base.sum())
        if rem > 0:
            base[np.argsort(-(want - base), kind="stable")[:rem]] += 1
        over = np.clip(base - tokens, 0, None)
        base = np.minimum(base, tokens)
        spill = int(over.sum())
        while spill > 0:
            room = tokens - base
            idx = np.argsort(-row + (room <= 0) * 1e18, kind="stable")
            for e in idx:
                if spill == 0 or room[e] <= 0:
                    continue
                add = min(room[e], spill)
                base[e] += add
                spill -= add
            if room.sum() == 0:
                break
        out[j] = base
    return out


def popularity_summary(shares: np.ndarray) -> dict:
    """``shares[iter, E]`` -> the numbers Fig. 4's text quotes."""
    E = shares.shape[1]
    top = np.sort(shares, axis=1)[:, ::-1]
    return dict(experts=E, max_share=float(shares.max()), max_over_mean=float(shares.max() * E),
                mean_top4_share=float(top[:, :4].mean()), mean_top1_over_mean=float(top[:, 0].mean() * E),
                mean_abs_change=float(np.abs(np.diff(shares, axis=0)).sum(1).mean()) if len(shares) > 1 else 0.0)


class TraceGate(torch.nn.Module):
    """Replays recorded expert choices, as the AE's ``TraceRepGate``: ``set_counts(row)`` turns one
    source's per-expert counts into concrete per-token choices
    (:func:`moelab.models.traces.trace_to_token_choices`); weights are ``1/k`` each (no learning)."""

    def __init__(self, num_experts: int, k: int):
        super().__init__()
        self.num_experts, self.k = num_experts, k
        self.idx: Optional[torch.Tensor] = None

    def set_counts(self, counts, seed: int = 0) -> None:
        self.idx = trace_to_token_choices(torch.as_tensor(np.asarray(counts), dtype=torch.int64), self.k, seed)

    def forward(self, x, rng=None, shadowed=()):
        if self.idx is None or self.idx.shape[0] != x.shape[0]:
            raise ValueError(f"TraceGate: set_counts for {x.shape[0]} tokens first")
        idx = self.idx
        w = torch.full(idx.shape, 1.0 / self.k, dtype=x.dtype)
        z = torch.zeros((), dtype=x.dtype)
        return Routing(idx, w, capacity_locations(idx, self.num_experts), None, z, z, z)
