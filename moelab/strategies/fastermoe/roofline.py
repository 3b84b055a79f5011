"""DDL-Roofline (FasterMoE §3.3, Fig. 5; spec §2.3): pure functions.

x axis ``rho = T_comp / T_comm`` (log scale), y axis ``Theta = 12 h h_ff sum_i B_i / (N T_e2e)``
(useful FLOP/s per worker). Lines: *ideal* ``P min(1, rho)`` (full overlap, ``T_e2e = max(Tc, Tm)``),
*semi-ideal* ``P rho / (1 + rho)`` (synchronous, ``T_e2e = Tc + Tm``); the roof is ``P``.

[R] ``T_comp``, ``T_comm`` in rho are the strategy's **per-iteration totals** (EP: ``3 T_comp_round``,
``4 T_comm_round``), so the knee sits at rho = 1 (``rho_mode="total"``); ``rho_mode="per_round"``
takes the ratio of one compute round to one communication round instead.

Points: data parallel (synchronous and all-reduce overlapped with backward), model parallel,
expert parallel (below semi-ideal by ``mean(B)/max(B)``), EP with shadowing (arrow 1), EP with the
smart schedule (arrow 2: same rho, lifted towards ideal), and EP with both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from moelab.strategies.fastermoe import perf_model as pm

RHO_MODES = ("total", "per_round")


def ideal(rho, P: float):
    return P * np.minimum(1.0, np.asarray(rho, dtype=np.float64))


def semi_ideal(rho, P: float):
    rho = np.asarray(rho, dtype=np.float64)
    return P * rho / (1.0 + rho)


def theta(h: int, h_ff: int, total_assignments: float, N: int, T_e2e: float) -> float:
    """``12 h h_ff sum_i B_i / (N T_e2e)``: useful FLOP/s per worker."""
    return pm.ITER_FLOP_FACTOR * h * h_ff * float(total_assignments) / (N * T_e2e)


@dataclass
class RooflinePoint:
    name: str
    Tc: float  # compute in rho (see rho_mode)
    Tm: float  # communication in rho
    T_e2e: float  # iteration time of the strategy
    theta: float  # FLOP/s per worker
    rho_mode: str = "total"
    extra: dict = field(default_factory=dict)

    @property
    def rho(self) -> float:
        return self.Tc / self.Tm if self.Tm > 0 else float("inf")


def _rho_pair(Tc_round, Tm_round, comp_rounds, comm_rounds, rho_mode):
    if rho_mode not in RHO_MODES:
        raise ValueError(f"rho_mode must be one of {RHO_MODES}, got {rho_mode!r}")
    if rho_mode == "total":
        return comp_rounds * Tc_round, comm_rounds * Tm_round
    return Tc_round, Tm_round


def dp_points(B: float, h: int, h_ff: int, cl: pm.Cluster, s: int = pm.ELEM_BYTES, P: Optional[float] = None,
              rho_mode: str = "total") -> list:
    """Data parallel: every worker holds the MLP (2 h h_ff params) and runs its own B assignments.
    Synchronous (``Tc + Tm``) and all-reduce overlapped with backward (``Tc/3 + max(2Tc/3, Tm)``)."""
    P = cl.P if P is None else P
    N = cl.world_size
    Tc = pm.ITER_FLOP_FACTOR * B * h * h_ff / P
    Tm = pm.allreduce_time(cl, 2 * h * h_ff * s)
    rc, rm = _rho_pair(Tc / 3, Tm, 3, 1, rho_mode)
    sync, over = Tc + Tm, Tc / 3 + max(2 * Tc / 3, Tm)
    return [RooflinePoint("DP", rc, rm, sync, theta(h, h_ff, N * B, N, sync), rho_mode),
            RooflinePoint("DP overlapped", rc, rm, over, theta(h, h_ff, N * B, N, over), rho_mode)]


def mp_point(B: float, h: int, h_ff: int, cl: pm.Cluster, s: int = pm.ELEM_BYTES, P: Optional[float] = None,
             rho_mode: str = "total") -> RooflinePoint:
    """Model parallel: weights split N ways, all workers share one batch of B assignments; two
    all-reduces of a ``B x h`` embedding per iteration; no overlap possible."""
    P = cl.P if P is None else P
    N = cl.world_size
    Tc = pm.ITER_FLOP_FACTOR * B * h * h_ff / (N * P)
    Tm = 2 * pm.allreduce_time(cl, B * h * s)
    rc, rm = _rho_pair(Tc / 3, Tm / 2, 3, 2, rho_mode)
    return RooflinePoint("MP", rc, rm, Tc + Tm, theta(h, h_ff, B, N, Tc + Tm), rho_mode)


def ep_point(C, h: int, h_ff: int, cl: pm.Cluster, s: int = pm.ELEM_BYTES, P: Optional[float] = None,
             rho_mode: str = "total") -> RooflinePoint:
    """Synchronous expert parallelism from the count matrix: ``T_e2e = 3 T_comp + 4 T_a2a``."""
    P = cl.P if P is None else P
    C = pm.as_counts(C)
    pred = pm.predict_layer(C, cl, h, h_ff, s, P)
    rc, rm = _rho_pair(pred.T_comp, pred.T_comm, 3, 4, rho_mode)
    T = pred.e2e
    return RooflinePoint("EP", rc, rm, T, theta(h, h_ff, C.sum(), cl.world_size, T), rho_mode,
                         extra=dict(T_comp=pred.T_comp, T_comm=pred.T_comm))


def shadow_counts(C, shadowed: Sequence[int]):
    """The routing after shadowing: tokens for a shadowed expert stay on their source worker.
    Returns ``(C_dispatched, local_loads)`` where ``local_loads[i] = sum_{e in S} C[i][e]``."""
    C = pm.as_counts(C).copy()
    S = list(shadowed)
    local = C[:, S].sum(1) if S else np.zeros(C.shape[0])
    C[:, S] = 0
    return C, local


def ep_shadow_point(C, shadowed: Sequence[int], h: int, h_ff: int, cl: pm.Cluster, s: int = pm.ELEM_BYTES,
                    P: Optional[float] = None, comm_factor: int = 2, rho_mode: str = "total") -> RooflinePoint:
    """Arrow (1): shadowed experts' tokens computed at their source; their params broadcast and
    grads reduced (``comm_factor`` collectives of ``2 h h_ff s`` bytes per shadowed expert)."""
    P = cl.P if P is None else P
    C = pm.as_counts(C)
    Cd, local = shadow_counts(C, shadowed)
    loads = pm.worker_loads(Cd) + local
    Tc_round = pm.compute_time_from_loads(loads, h, h_ff, P)
    Ta2a = pm.comm_time(Cd, cl, h, s)
    E = C.shape[1] // C.shape[0]
    t_sh = 0.0
    for e in shadowed:
        o = e // E
        t_sh += pm.broadcast_time(cl, 2 * h * h_ff * s, root=o)
        if comm_factor >= 2:
            t_sh += pm.reduce_time(cl, 2 * h * h_ff * s, root=o)
    Tm_total = 4 * Ta2a + t_sh
    T = 3 * Tc_round + Tm_total
    if rho_mode == "total":
        rc, rm = 3 * Tc_round, Tm_total
    else:
        rc, rm = _rho_pair(Tc_round, Tm_total / 4, 3, 4, rho_mode)
    return RooflinePoint("EP+shadow", rc, rm, T, theta(h, h_ff, C.sum(), cl.world_size, T), rho_mode,
                         extra=dict(shadowed=list(shadowed)))


def smart_point(base: RooflinePoint, Tc_round: float, Tm_round: float, name: str = "EP+smart") -> RooflinePoint:
    """Arrow (2): same rho as ``base``, iteration time from the theoretical two-stream pipeline
    ``max(2 Tm, Tc) + max(2 Tm, 2 Tc)`` (``Tm``, ``Tc`` per round)."""
    T = max(2 * Tm_round, Tc_round) + max(2 * Tm_round, 2 * Tc_round)
    th = base.theta * base.T_e2e / T
    return RooflinePoint(name, base.Tc, base.Tm, T, th, base.rho_mode, extra=dict(base.extra))


def ep_smart_point(C, h: int, h_ff: int, cl: pm.Cluster, s: int = pm.ELEM_BYTES, P: Optional[float] = None,
                   rho_mode: str = "total") -> RooflinePoint:
    base = ep_point(C, h, h_ff, cl, s, P, rho_mode)
    return smart_point(base, base.extra["T_comp"], base.extra["T_comm"])


def roofline_points(C, B_dp: float, h: int, h_ff: int, cl: pm.Cluster, shadowed: Sequence[int] = (),
                    s: int = pm.ELEM_BYTES, P: Optional[float] = None, rho_mode: str = "total") -> list:
    """Every Fig. 5 point for one layer: DP (2), MP, EP, EP+shadow, EP+smart."""
    pts = dp_points(B_dp, h, h_ff, cl, s, P, rho_mode) + [mp_point(B_dp, h, h_ff, cl, s, P, rho_mode)]
    pts.append(ep_point(C, h, h_ff, cl, s, P, rho_mode))
    pts.append(ep_shadow_point(C, shadowed, h, h_ff, cl, s, P, rho_mode=rho_mode))
    pts.append(ep_smart_point(C, h, h_ff, cl, s, P, rho_mode))
    return pts
