"""Seeded synthetic routing traces: how many tokens each source rank sends to each expert.

Why: placement policies, the simulator and edge-load tests need controllable loads (balanced, one
hot expert, one hot rank, drifting Zipf popularity, a rank with no tokens) without training a
model. A trace is an int64 tensor ``C[iter, layer, src_rank, expert]``; every (iter, layer, src)
row sums to ``tokens_per_rank * top_k`` (except the silent rank of ``zero_rank``) and no entry
exceeds ``tokens_per_rank`` (a token picks k *distinct* experts), so every row can be realised as
concrete per-token choices by :func:`trace_to_token_choices`.

Kinds (``kind_params`` in brackets):

- ``balanced``: every expert gets ``k*T/E`` assignments; the remainder (if any) goes one each to a
  seeded random subset of experts, so max - min <= 1.
- ``hot_expert`` [expert=0, share=0.4]: ``expert`` receives ``round(share*k*T)`` of the row's
  ``k*T`` assignments (share <= 1/k; share = 1/k means every token picks it); the rest is balanced
  over the other experts.
- ``hot_rank`` [rank=0, share=0.5]: the experts rank ``rank`` owns under plain expert parallelism
  (contiguous blocks of E/world) together receive ``round(share*k*T)`` assignments, balanced among
  them; the rest is balanced over the other experts.
- ``zipf_drift`` [s=1.2, drift=0.05]: expert popularity follows Zipf's law ``p ∝ 1/rank^s``; the
  ranking comes from latent scores that take a Gaussian random-walk step of std ``drift`` per
  iteration (independent per layer), so the hot set changes slowly. Each source samples its k*T
  assignments from p (multinomial, capped at T per expert).
- ``zero_rank`` [rank=0, base='balanced', base_params={}]: the ``base`` trace with source ``rank``'s
  rows set to zero (the rank has no tokens this iteration, the classic hang case).
"""
from __future__ import annotations

import numpy as np
import torch

KINDS = ("balanced", "hot_expert", "hot_rank", "zipf_drift", "zero_rank")


def _even(total: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` split over ``n`` bins as evenly as possible; the remainder lands on random bins."""
    out = np.full(n, total // n, dtype=np.int64)
    out[rng.choice(n, total % n, replace=False)] += 1
    return out


def _capped_multinomial(total: int, p: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """A multinomial draw of ``total`` over ``p`` with every bin clipped to ``cap``; the overflow is
    redrawn over the bins still below the cap (requires total <= cap * len(p))."""
    c = rng.multinomial(total, p)
    while True:
        excess = int(np.clip(c - cap, 0, None).sum())
        if excess == 0:
            return c.astype(np.int64)
        c = np.minimum(c, cap)
        room = (c < cap) * np.maximum(p, 1e-12)
        c = c + rng.multinomial(excess, room / room.sum())


def _split_hot(hot: np.ndarray, hot_total: int, T: int, k: int, rng) -> np.ndarray:
    """A row where experts in boolean mask ``hot`` get ``hot_total`` assignments (even), the rest the remainder."""
    E = len(hot)
    total = k * T
    row = np.zeros(E, dtype=np.int64)
    n_hot, n_cold = int(hot.sum()), E - int(hot.sum())
    cold_total = total - hot_total
    if -(-hot_total // n_hot) > T or (n_cold and -(-cold_total // n_cold) > T) or (n_cold == 0 and cold_total):
        raise ValueError(f"cannot give {hot_total} of {total} assignments to {n_hot} hot expert(s) "
                         f"with at most {T} tokens per expert (tokens_per_rank={T}, top_k={k}, experts={E})")
    row[hot] = _even(hot_total, n_hot, rng)
    if n_cold:
        row[~hot] = _even(cold_total, n_cold, rng)
    return row


def routing_trace(kind: str, iters: int, layers: int, world: int, num_experts: int,
                  tokens_per_rank: int, top_k: int = 2, seed: int = 0, **kind_params) -> torch.Tensor:
    """Counts ``C[iter, layer, src, expert]`` (int64) of the named kind; see the module docstring."""
    E, T, k = num_experts, tokens_per_rank, top_k
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {KINDS}")
    if not 1 <= k <= E:
        raise ValueError(f"top_k={k} must be in 1..num_experts={E}")
    rng = np.random.default_rng([int(seed) & (2**63 - 1), KINDS.index(kind)])
    C = np.zeros((iters, layers, world, E), dtype=np.int64)

    if kind == "zero_rank":
        rank = int(kind_params.pop("rank", 0))
        base = kind_params.pop("base", "balanced")
        base_params = dict(kind_params.pop("base_params", None) or {})
        _no_extra(kind, kind_params)
        if not 0 <= rank < world or base == "zero_rank":
            raise ValueError(f"zero_rank needs 0 <= rank < {world} and a base kind other than zero_rank")
        C = routing_trace(base, iters, layers, world, E, T, k, seed, **base_params).clone()
        C[:, :, rank, :] = 0
        return C

    if kind == "zipf_drift":
        s = float(kind_params.pop("s", 1.2))
        drift = float(kind_params.pop("drift", 0.05))
        _no_extra(kind, kind_params)
        zipf = 1.0 / np.arange(1, E + 1) ** s
        zipf /= zipf.sum()
        scores = rng.standard_normal((layers, E))
        for it in range(iters):
            if it:
                scores = scores + drift * rng.standard_normal((layers, E))
            for layer in range(layers):
                p = np.empty(E)
                p[np.argsort(-scores[layer], kind="stable")] = zipf  # rank 1 = highest score
                for src in range(world):
                    C[it, layer, src] = _capped_multinomial(k * T, p, T, rng)
        return torch.from_numpy(C)

    if kind == "balanced":
        _no_extra(kind, kind_params)
        hot = np.zeros(E, dtype=bool)
        hot_total = None
    elif kind == "hot_expert":
        e = int(kind_params.pop("expert", 0))
        share = float(kind_params.pop("share", 0.4))
        _no_extra(kind, kind_params)
        if not 0 <= e < E:
            raise ValueError(f"hot expert {e} is outside 0..{E - 1}")
        hot = np.arange(E) == e
        hot_total = round(share * k * T)
    else:  # hot_rank
        r = int(kind_params.pop("rank", 0))
        share = float(kind_params.pop("share", 0.5))
        _no_extra(kind, kind_params)
        if E % world or not 0 <= r < world:
            raise ValueError(f"hot_rank needs num_experts % world == 0 and 0 <= rank < world "
                             f"(got E={E}, world={world}, rank={r})")
        hot = np.arange(E) // (E // world) == r
        hot_total = round(share * k * T)
    for it in range(iters):
        for layer in range(layers):
            for src in range(world):
                if hot_total is None:
                    C[it, layer, src] = _even(k * T, E, rng)
                else:
                    C[it, layer, src] = _split_hot(hot, hot_total, T, k, rng)
    return torch.from_numpy(C)


def _no_extra(kind: str, params: dict) -> None:
    if params:
        raise TypeError(f"trace kind {kind!r} got unknown parameter(s) {sorted(params)}")


def trace_to_token_choices(counts, top_k: int, seed: int = 0) -> torch.Tensor:
    """Concrete routing for one trace row: ``[T, k]`` expert ids, each token's k ids distinct, whose
    per-expert histogram equals ``counts`` (length E, summing to T*k, each entry <= T).

    Construction: list expert e ``counts[e]`` times in ascending order and give token t the entries
    t, t+T, ..., t+(k-1)T; an expert's run has length <= T, so no token sees it twice. Tokens and
    the order within each token are then shuffled with ``seed`` so no position is special.
    """
    c = torch.as_tensor(counts, dtype=torch.int64).cpu()
    total = int(c.sum())
    if c.dim() != 1 or (c < 0).any() or total % top_k:
        raise ValueError(f"counts must be a non-negative 1-D row whose sum is a multiple of top_k={top_k}")
    T = total // top_k
    if T and int(c.max()) > T:
        raise ValueError(f"an expert has {int(c.max())} > T={T} tokens: k distinct experts per token is impossible")
    flat = torch.repeat_interleave(torch.arange(len(c)), c)
    choices = flat.view(top_k, T).t().contiguous()
    g = torch.Generator().manual_seed(int(seed))
    choices = choices[torch.randperm(T, generator=g)]
    order = torch.argsort(torch.rand(T, top_k, generator=g), dim=1)
    return torch.gather(choices, 1, order)
