"""LSH-MoE in the simulator (spec §2.9): the shared skeleton with the all-to-alls priced on centroid rows.

Per MoE layer: the count exchange carries ``2E`` int64 (tokens and centroids per expert), a hashing
op (category ``lsh``) on each rank before the dispatch, the four all-to-alls on the centroid counts,
the experts on centroids (``experts_on_centroids``, what the runtime does) or on every token (the
paper's analysis ignores the FLOP saving, §6.8), and the decompression after the combine; backward
mirrors it (centroid gradients summed before the combine-gradient all-to-all, spread after the
dispatch-gradient one).

Centroid counts come from a run's plan records (:func:`lsh_sim_plan`: exactly what the door moved),
or, at paper scale, from token loads × a compression rate clipped to each group's bounds
(:func:`centroid_counts`). The hashing cost per row is ``lsh_row_s`` when measured, else the
FLOPs of projection, centroid and residual at the profile's throughput (labelled an estimate).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.placement import Placement
from moelab.sim.compose import Contribution, composed_graph
from moelab.sim.graphs import elem_bytes_of, route_matrix, token_stages


def centroid_counts(loads, rho: float, bmax: Optional[int] = None) -> np.ndarray:
    """Paper-scale centroids per (layer, source, expert) group: ``round(rho·n)`` clipped to the §2.9
    group bounds ``[min(1, n), min(n, Bmax)]`` (an empty group sends nothing)."""
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    n = np.asarray(loads, dtype=np.int64)
    m = np.rint(rho * n).astype(np.int64)
    hi = n if bmax is None else np.minimum(n, int(bmax))
    return np.clip(m, np.minimum(n, 1), hi)


def lsh_row_flops(d: int, L: int, r: int) -> float:
    """Forward FLOPs per dispatched row: the L projections (2·d·r each), the centroid sum and the
    residual + compensation (about 3·d)."""
    return 2.0 * d * r * L + 3.0 * d


def lsh_moe_contribution(cfg, profile, loads, placement: Optional[Placement] = None, *, centroids=None,
                         rho: Optional[float] = None, bmax: Optional[int] = None, experts_on_centroids: bool = True,
                         num_hashes: Optional[int] = None, cp_dim: Optional[int] = None,
                         lsh_row_s: Optional[float] = None) -> Contribution:
    """LSH-MoE's wire format in the skeleton: the token path on centroid rows (routed by whatever placement
    each layer has), the hashing / decompression around it, and the ``2E`` count exchange. ``centroids``:
    ``[layers][N][E]`` recorded centroid counts (a run's plan records), else ``rho`` (with ``bmax``) makes
    them from ``loads``; with neither, the layer is uncompressed (identity: M = A) but still pays the hashing
    op and the 2E count exchange; ``hash_family: none`` is the plain path (nothing contributed)."""
    m, moe = cfg.model, cfg.model.moe
    E = moe.num_experts
    opts = dict(cfg.parallel.strategy_options or {}) if cfg.parallel.strategy == "lsh_moe" else {}
    L = int(num_hashes if num_hashes is not None else opts.get("num_hashes", 6))
    r = int(cp_dim if cp_dim is not None else opts.get("cp_dim", 2))
    loads = np.asarray(loads, dtype=np.int64)
    if centroids is None and rho is None and opts.get("hash_family") == "none":  # the plain EP path
        return Contribution(token_path=lambda pls, lds: token_stages([route_matrix(pl, t) for pl, t in zip(pls, lds)]),
                            meta={"technique": "lsh_moe", "strategy": "lsh_moe (none)"})
    if centroids is not None:
        cen = np.asarray(centroids, dtype=np.int64)
        if cen.shape != loads.shape:
            raise ValueError(f"centroids {cen.shape} must match loads {loads.shape}")
    elif rho is not None:
        cen = centroid_counts(loads, rho, bmax)
    else:
        cen = loads
    rows = loads.sum(axis=2)  # [layers, N] rows each source hashes (A)

    def local_work(ctx, i, j, phase, where, deps):
        per_row = lsh_row_s if lsh_row_s is not None else ctx.compute_time(lsh_row_flops(m.d_model, L, r))
        share = {("fwd", "before"): 2 * m.d_model * r * L + m.d_model, ("fwd", "after"): 2 * m.d_model,
                 ("bwd", "before"): m.d_model, ("bwd", "after"): 2 * m.d_model}[(phase, where)]
        frac = share / lsh_row_flops(m.d_model, L, r)
        name = {"before": "hash" if phase == "fwd" else "decompress",
                "after": "decompress" if phase == "fwd" else "centroid"}
        return [ctx.g.compute(rk, f"L{i}.lsh.{name[where]}.{phase}", float(rows[j][rk]) * per_row * frac, deps=deps[rk],
                              category="lsh", layer=i, phase=phase) for rk in ctx.ranks]

    def token_path(pls, lds):
        routes = [route_matrix(pl, c) for pl, c in zip(pls, cen)]
        work = [rt.sum(0) if experts_on_centroids else route_matrix(pl, t).sum(0)
                for rt, pl, t in zip(routes, pls, lds)]
        return token_stages(routes, expert_rows=work, local_work=local_work)

    return Contribution(token_path=token_path, count_bytes=16 * E,
                        meta={"technique": "lsh_moe", "strategy": "lsh_moe",
                              "experts_on_centroids": experts_on_centroids,
                              "rho": float(cen.sum() / loads.sum()) if loads.sum() else None,
                              "lsh_row_s": "measured" if lsh_row_s is not None else "FLOP estimate"})


def lsh_moe_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *, centroids=None,
                            rho: Optional[float] = None, bmax: Optional[int] = None, experts_on_centroids: bool = True,
                            num_hashes: Optional[int] = None, cp_dim: Optional[int] = None,
                            lsh_row_s: Optional[float] = None, elem_bytes: Optional[int] = None,
                            hierarchical_a2a: bool = False):
    """One training iteration of LSH-MoE (:func:`lsh_moe_contribution` on the placement)."""
    part = lsh_moe_contribution(cfg, profile, loads, placement, centroids=centroids, rho=rho, bmax=bmax,
                                experts_on_centroids=experts_on_centroids, num_hashes=num_hashes, cp_dim=cp_dim,
                                lsh_row_s=lsh_row_s)
    return composed_graph(cfg, profile, loads, placement, [part], elem_bytes=elem_bytes or elem_bytes_of(cfg),
                          hierarchical_a2a=hierarchical_a2a)


def lsh_sim_plan(cfg, records) -> dict:
    """The graph's ``centroids`` from one iteration's plan records (what the runtime's all-to-alls moved);
    none for an uncompressed run (``hash_family: none`` records no ``lsh``)."""
    recs = [r.get("lsh") for r in records]
    if not recs or any(r is None for r in recs):
        return {}
    return {"centroids": [r["centroids"] for r in recs]}
