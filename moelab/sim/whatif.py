"""Cluster-scale what-ifs: every registered strategy on one model from 16 to thousands of simulated GPUs.

"What does this strategy do on 1,024 GPUs, on DeepSeek-V3's shape, if the inter-node bandwidth
doubles?" — :func:`sweep` answers it with one simulated iteration per point: step time, bytes by link
class (the runtime's byte rule, :func:`moelab.sim.graphs.graph_bytes`), the memory of the busiest
rank's parameters, gradients and optimizer state (the static memory that decides whether it
fits), and the simulator's own wall time. The model keeps its layers and widths while the expert
count grows with the cluster (``experts_per_rank`` per GPU, as the papers' scaling runs do), since
expert parallelism needs experts divisible by ranks. Every row is SIMULATED on a named paper testbed
scaled by nodes (:meth:`ClusterProfile.with_nodes`), its inter-node links scaled by ``inter_bw_scale``.
Strategies come from the registry, so each paper's system appears as it lands; one whose graph
cannot be built for a point says why in ``note`` (nothing is silently dropped).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from moelab.comm.topology import LINK_CLASSES
from moelab.config import ConfigError, RunConfig
from moelab.registry import all_strategies
from moelab.sim import simulate
from moelab.sim.graphs import config_for_profile, graph_bytes, iteration_graph, synthetic_loads, topology_of

# what a strategy needs to run at all, applied to its points only (and recorded per row)
STRATEGY_NEEDS = {"parm": {"model.moe.capacity_factor": 1.25, "model.moe.dispatcher": "dense",
                           "model.moe.gate": "gshard"}}  # Parm's schedules are DeepSpeed's capacity buffers


def strategies_with_graphs() -> list:
    return [s.name for s in all_strategies() if s.sim_graph]


def check_sweep(ranks: Iterable[int], gpus_per_node: int, experts_per_rank: int, bw_scales, skews) -> None:
    """The clear errors before any work: empty ranges, ranks that do not fill nodes, experts that do
    not divide over ranks."""
    ranks = list(ranks)
    for name, values in (("ranks", ranks), ("inter_bw_scales", list(bw_scales)), ("skews", list(skews))):
        if not values:
            raise ConfigError(f"sweep: {name} is empty")
    if not isinstance(experts_per_rank, int) or experts_per_rank < 1:
        raise ConfigError(f"sweep: experts_per_rank must be an integer >= 1 (experts divisible by ranks), "
                          f"got {experts_per_rank!r}")
    for n in ranks:
        if n < 1 or n % gpus_per_node:
            raise ConfigError(f"sweep: {n} ranks do not fill nodes of {gpus_per_node} GPUs")
    if any(b <= 0 for b in bw_scales) or any(s < 0 for s in skews):
        raise ConfigError("sweep: inter_bw_scales must be > 0 and skews >= 0")


def point_config(base: RunConfig, profile, ranks: int, strategy: str, experts_per_rank: int,
                 overrides: dict | None = None) -> tuple:
    """(cfg, profile) of one point: ``base`` resized onto ``profile`` with ``ranks`` GPUs, plus the
    strategy's own ``overrides`` (what it needs to run at all, e.g. Parm's capacity buffers)."""
    prof = profile.with_nodes(ranks // profile.gpus_per_node)
    E = int(experts_per_rank * ranks)
    cfg = config_for_profile(base, prof, **{"model.moe.num_experts": E, "parallel.strategy": strategy,
                                             "parallel.placement": None, "emulation.enabled": False,
                                             **(overrides or {})})
    return cfg, prof


def simulate_point(cfg, prof, skew: float = 1.0, seed: int = 0, bytes_by_class: bool = True) -> dict:
    """One simulated iteration of ``cfg`` on ``prof``: step, bytes by link class, static memory of the
    busiest rank, wall time."""
    t0 = time.perf_counter()
    loads = synthetic_loads(cfg, seed=seed, skew=skew)
    g = iteration_graph(cfg, prof, loads)
    res = simulate(g)
    sim_s = time.perf_counter() - t0
    row = {"step_ms": res.makespan * 1e3, "ops": len(g), "sim_wall_s": sim_s,
           "mem_static_GB": _static_bytes_of_busiest(g) / 1e9}
    if bytes_by_class:
        per = graph_bytes(g, topology_of(cfg))
        for cls in LINK_CLASSES:
            row[f"bytes_{cls}_GB"] = sum(b[cls] for b in per.values()) / 1e9
    row["wall_s"] = time.perf_counter() - t0
    return row


def _static_bytes_of_busiest(g) -> float:
    """Bytes the ``init`` ops allocate on the rank that holds the most (parameters, gradients, Adam):
    the static part of memory, which decides whether a configuration fits at all."""
    per_rank = {}
    for o in g.ops:
        if o.name == "init":
            for r in o.ranks:
                per_rank[r] = per_rank.get(r, 0) + sum((o.alloc or {}).values())
    return float(max(per_rank.values(), default=0))


def sweep(base: RunConfig, profile, ranks: Iterable[int], *, strategies=None, experts_per_rank: int = 1,
          inter_bw_scales=(1.0,), skews=(1.0,), bytes_by_class: bool = True, progress: bool = True,
          per_strategy: dict | None = None):
    """One row per (strategy, ranks, inter-node bandwidth scale, skew); see the module docstring.
    ``per_strategy``: strategy -> config overrides for that strategy only, recorded in ``overrides``."""
    import pandas as pd
    from tqdm.auto import tqdm

    ranks = list(ranks)
    strategies = list(strategies or strategies_with_graphs())
    check_sweep(ranks, profile.gpus_per_node, experts_per_rank, inter_bw_scales, skews)
    points = [(s, n, b, k) for s in strategies for n in ranks for b in inter_bw_scales for k in skews]
    rows = []
    for strategy, n, bw, skew in tqdm(points, desc=f"what-if on {profile.name}", disable=not progress):
        extra = (per_strategy or {}).get(strategy, {})
        cfg, prof = point_config(base, profile, n, strategy, experts_per_rank, extra)
        prof = dataclasses.replace(prof, inter_bw_GBps=prof.inter_bw_GBps * bw)
        row = {"strategy": strategy, "ranks": n, "nodes": prof.nodes, "experts": cfg.model.moe.num_experts,
               "inter_bw_scale": bw, "skew": skew, "profile": profile.name,
               "label": f"SIMULATED: {profile.name} x{prof.nodes} nodes, inter-node x{bw:g}, Zipf({skew:g}) loads",
               "overrides": ", ".join(f"{k}={v}" for k, v in extra.items()), "note": ""}
        try:
            row.update(simulate_point(cfg.validate(), prof, skew=skew, bytes_by_class=bytes_by_class))
        except Exception as e:  # noqa: BLE001 - the row says why this strategy cannot price this point
            row["note"] = f"not priced: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        rows.append(row)
    return pd.DataFrame(rows)
