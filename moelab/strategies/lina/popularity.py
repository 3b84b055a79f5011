"""Lina's popularity estimator and the trace metrics around it (spec §2.3, Figs. 9 and 19).

Traces are ``[tokens, layers]`` integer arrays: the expert each token chose at every MoE layer
(top-1 routing). :class:`PathTable` is the offline profile: for each target layer l >= ``path_len``
and each path (the token's experts at the ``path_len`` preceding layers), the distribution of its
expert at layer l. Unseen paths back off to the longest seen suffix, finally to the layer's
marginal. :meth:`PathTable.estimate` keeps each token's ``K_est`` largest entries (not renormalised)
and averages over the batch: ``pop_hat``; ``n(e) = N * pop_hat(e)`` is Eq. (1).
"""
from __future__ import annotations

import numpy as np

from moelab.strategies.lina.placement import top_set


class PathTable:
    def __init__(self, num_experts: int, path_len: int, num_layers: int):
        if path_len < 1 or path_len >= num_layers:
            raise ValueError(f"path_len must lie in 1..{num_layers - 1} (MoE layers - 1), got {path_len}")
        self.E, self.path_len, self.num_layers = num_experts, path_len, num_layers
        self.tables: dict = {}  # (layer, suffix length) -> {path tuple: prob vector}
        self.marginal: dict = {}  # layer -> prob vector
        self.model_id = None  # what the traces came from (a checkpoint's identity), checked at use
        self._kept: dict = {}  # (layer, k_est, width) -> {path code: its kept entries}: estimate()'s memo

    @classmethod
    def fit(cls, traces, num_experts: int, path_len: int, model_id=None) -> "PathTable":
        t = np.asarray(traces, dtype=np.int64)
        if t.ndim != 2 or t.size == 0:
            raise ValueError(f"traces must be a non-empty [tokens, layers] array, got shape {t.shape}")
        if t.min() < 0 or t.max() >= num_experts:
            raise ValueError(f"trace expert ids must lie in 0..{num_experts - 1}")
        tab = cls(num_experts, path_len, t.shape[1])
        tab.model_id = model_id
        E = num_experts
        for l in range(t.shape[1]):
            tab.marginal[l] = np.bincount(t[:, l], minlength=E) / len(t)
            for s in range(1, min(path_len, l) + 1):
                keys = t[:, l - s:l]
                uniq, inv = np.unique(keys, axis=0, return_inverse=True)
                counts = np.zeros((len(uniq), E))
                np.add.at(counts, (inv.reshape(-1), t[:, l]), 1.0)
                tab.tables[(l, s)] = {tuple(int(v) for v in k): c / c.sum() for k, c in zip(uniq, counts)}
        return tab

    def dist(self, layer: int, path) -> np.ndarray:
        """``Pr_layer[path]``: the longest seen suffix of ``path`` (the experts of the preceding layers,
        oldest first), else the layer's marginal."""
        path = tuple(int(v) for v in path)
        for s in range(min(self.path_len, len(path), layer), 0, -1):
            d = self.tables.get((layer, s), {}).get(path[-s:])
            if d is not None:
                return d
        return self.marginal[layer]

    def estimate(self, paths, layer: int, k_est: int = 2) -> np.ndarray:
        """``pop_hat`` for a batch: ``paths [B, >=path_len]`` (each token's preceding experts, oldest
        first), the mean over tokens of their distribution's ``k_est`` largest entries."""
        if not 1 <= k_est <= self.E:
            raise ValueError(f"K_est must lie in 1..{self.E}, got {k_est}")
        p = np.asarray(paths, dtype=np.int64)
        if len(p) == 0:
            return np.zeros(self.E)
        p = p[:, -self.path_len:]
        codes, n = np.unique(p @ self.E ** np.arange(p.shape[1] - 1, -1, -1, dtype=np.int64), return_counts=True)
        # each path's kept entries once per table (the serving path estimates every layer of every batch)
        memo = self._kept.setdefault((layer, k_est, p.shape[1]), {})
        rows = []
        for c in codes.tolist():
            q = memo.get(c)
            if q is None:
                d = self.dist(layer, [(c // self.E ** i) % self.E for i in range(p.shape[1] - 1, -1, -1)])
                top = np.argsort(-d, kind="stable")[:k_est]
                q = memo[c] = np.zeros(self.E)
                q[top] = d[top]
            rows.append(q)
        return (n @ np.stack(rows)) / len(p)


def pattern_share(traces, layer: int, k: int = 1) -> float:
    """Fig. 9: tokens grouped by their expert at ``layer``; per group the share of its tokens whose
    expert at ``layer + 1`` is one of the group's ``k`` most frequent; the mean over groups."""
    t = np.asarray(traces, dtype=np.int64)
    shares = []
    for e in np.unique(t[:, layer]):
        nxt = t[t[:, layer] == e, layer + 1]
        counts = np.sort(np.bincount(nxt))[::-1]
        shares.append(counts[:k].sum() / len(nxt))
    return float(np.mean(shares))


def estimation_accuracy(pop_hats, pops, k: int = 2) -> float:
    """Fig. 19: the fraction of (batch, layer) instances whose estimated and actual top-k sets agree."""
    pairs = list(zip(pop_hats, pops))
    if not pairs:
        raise ValueError("no (estimate, actual) pairs to score")
    return sum(top_set(a, k) == top_set(b, k) for a, b in pairs) / len(pairs)


def markov_traces(num_tokens: int, num_layers: int, num_experts: int, order: int, seed: int = 0,
                  sharpness: float = 4.0, return_table: bool = False):
    """SYNTHETIC traces from an order-``order`` Markov chain over experts (a seeded random transition
    table, sharpened by ``sharpness``): the estimator's test bed (spec §5 I13)."""
    rng = np.random.default_rng(seed)
    E = num_experts
    logits = rng.standard_normal((E,) * order + (E,)) * sharpness
    table = np.exp(logits - logits.max(-1, keepdims=True))
    table /= table.sum(-1, keepdims=True)
    rng = np.random.default_rng((seed, num_tokens))  # the chain is the seed's; the sample also the size's
    t = np.zeros((num_tokens, num_layers), dtype=np.int64)
    t[:, :order] = rng.integers(0, E, size=(num_tokens, order))
    for l in range(order, num_layers):
        probs = table[tuple(t[:, l - order + i] for i in range(order))]
        u = rng.random(num_tokens)[:, None]
        t[:, l] = (probs.cumsum(-1) < u).sum(-1).clip(0, E - 1)
    return (t, table) if return_table else t
