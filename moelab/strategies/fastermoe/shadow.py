"""Dynamic shadowing policy (FasterMoE §4.1, spec §2.4): one pure function, as FastMoE keeps it.

Every rank runs :func:`select_shadows` on the same all-gathered count matrix ``C[j][e]``
(assignments source worker j sends to global expert e, ``owner(e) = e // E``), so every rank
picks the same set without further communication.

Cost model (simplified network, one per-worker bandwidth ``W_net``), with
``L_i(S) = sum_{e: owner(e)=i, e not in S} sum_j C[j][e] + sum_{e in S} C[i][e]`` (tokens for a
shadowed expert are computed on their source worker)::

    T_imbl      = 12 h h_ff max_i L_i({}) / P + 4 h s max_i L_i({}) / W_net
    T_shadow(S) = 12 h h_ff max_i L_i(S) / P + 4 h s max_i L_i(S) / W_net + |S| c (2 h h_ff s) / W_net

Greedy (Algorithm 1): experts by total load, descending (stable, id tie-break, float64 from the
integer counts); add them one at a time; keep the best set; stop at the first non-improvement.
The result is always a prefix of the popularity order; it is returned sorted by expert id.

- The per-expert totals are a reduction over *sources* (``C.sum(0)``). The public FastMoE
  ``shadow_policy.py`` sums the stacked ``[N_src, N*E]`` counts over dim 1, i.e. per-source
  totals; with equal batches nothing is ever shadowed. Not reproduced here (a test checks it).
- ``exact=True`` (moelab default, prototype behaviour) recomputes ``max L(S)``; ``exact=False``
  uses the clean FastMoE approximation: the ``(|S|+1)``-th largest expert total.
- ``c`` (``shadow_comm_factor``) counts collectives per shadowed expert: 2 (broadcast params +
  reduce grads; paper prose and prototype; default), 1 in the clean FastMoE code.
- ``max_shadow`` defaults to ``N*E - 1``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np

from moelab.strategies.fastermoe.perf_model import ELEM_BYTES, P_V100_PCIE, W_NET_DEFAULT, as_counts

DEFAULT_H = 2048  # FMOE_FASTER_GLBPLC_DMODEL fallback when the feature length is unknown
DEFAULT_ALPHA = 2  # h_ff / h


def expert_totals(C) -> np.ndarray:
    """Assignments per global expert: the reduction over sources (dim 0)."""
    return as_counts(C).sum(0)


def shadow_loads(C, S: Sequence[int]) -> np.ndarray:
    """``L_i(S)`` for every worker i (float64)."""
    C = as_counts(C)
    N, NE = C.shape
    E = NE // N
    shadowed = np.zeros(NE, dtype=bool)
    shadowed[list(S)] = True
    totals = C.sum(0)
    owned = np.where(shadowed, 0.0, totals).reshape(N, E).sum(1)
    return owned + C[:, shadowed].sum(1)


def _time(max_load: float, n_shadow: int, h, h_ff, P, W_net, s, c) -> float:
    return (12.0 * h * h_ff * max_load / P + 4.0 * h * s * max_load / W_net
            + n_shadow * c * (2.0 * h * h_ff * s) / W_net)


def t_imbl(C, h, h_ff, P=P_V100_PCIE, W_net=W_NET_DEFAULT, s=ELEM_BYTES) -> float:
    return _time(float(shadow_loads(C, ()).max()), 0, h, h_ff, P, W_net, s, 0)


def t_shadow(C, S: Sequence[int], h, h_ff, P=P_V100_PCIE, W_net=W_NET_DEFAULT, s=ELEM_BYTES, c=2,
             exact: bool = True) -> float:
    if exact:
        max_load = float(shadow_loads(C, S).max())
    else:
        tot = np.sort(expert_totals(C))[::-1]
        max_load = float(tot[len(S)]) if len(S) < len(tot) else 0.0
    return _time(max_load, len(S), h, h_ff, P, W_net, s, c)


@dataclass(frozen=True)
class ShadowDecision:
    chosen: Tuple[int, ...]  # sorted by expert id
    order: Tuple[int, ...]  # popularity order the greedy walked
    t_imbl: float
    t_chosen: float  # predicted time of the chosen set (= t_imbl when nothing is chosen)
    trials: Tuple[float, ...] = field(default=())  # T_shadow of each prefix tried


def shadow_decision(C, h: int, h_ff: int, P: float = P_V100_PCIE, W_net: float = W_NET_DEFAULT,
                    s: int = ELEM_BYTES, c: int = 2, max_shadow: Optional[int] = None,
                    exact: bool = True) -> ShadowDecision:
    """Algorithm 1 with its bookkeeping (see module doc)."""
    C = as_counts(C)
    if h <= 0 or h_ff <= 0 or P <= 0 or s <= 0 or c < 0:
        raise ValueError("h, h_ff, P and s must be > 0 and c >= 0")
    NE = C.shape[1]
    max_shadow = NE - 1 if max_shadow is None else int(max_shadow)
    totals = expert_totals(C)
    order = tuple(int(e) for e in np.argsort(-totals, kind="stable"))
    if W_net <= 0:  # no network at all: nothing can be moved, no shadow either
        return ShadowDecision((), order, float("inf"), float("inf"))
    if exact:
        best = t_imbl(C, h, h_ff, P, W_net, s)
    else:
        best = t_shadow(C, (), h, h_ff, P, W_net, s, c, exact=False)
    t0, chosen, trials, S = best, (), [], []
    for e in order[:max(max_shadow, 0)]:
        S.append(e)
        t = t_shadow(C, S, h, h_ff, P, W_net, s, c, exact)
        trials.append(t)
        if t < best:
            best, chosen = t, tuple(S)
        else:
            break
    return ShadowDecision(tuple(sorted(chosen)), order, t0, best, tuple(trials))


def select_shadows(C, h: int, h_ff: int, P: float = P_V100_PCIE, W_net: float = W_NET_DEFAULT, s: int = ELEM_BYTES,
                   c: int = 2, max_shadow: Optional[int] = None, exact: bool = True) -> Tuple[int, ...]:
    """The experts to shadow, sorted by id (identical on every rank given the same ``C``)."""
    return shadow_decision(C, h, h_ff, P, W_net, s, c, max_shadow, exact).chosen
