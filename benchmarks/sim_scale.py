"""The simulator at cluster scale: wall time and peak memory to price one iteration from 64 to 4,096 ranks.

The model of issue #17: ``experiments/core/quickstart.yaml``'s GPT-MoE resized onto ``fastermoe_trevor``
scaled by nodes (its 4 GPUs per node), one expert per rank, d_model 1024, 12 layers, top-2,
``synthetic_loads`` (Zipf 1.0). Per (strategy, ranks): graph build + simulation wall time, the
process's peak RSS (run one strategy per invocation for a clean memory figure), ops in the graph,
the simulated step. At
the end, per strategy, the fitted growth exponent of wall time in ranks (log-log slope over the
largest three sizes). Parm runs with what it needs (``moelab.sim.whatif.STRATEGY_NEEDS``: capacity
factor 1.25, the dense dispatcher, the gshard gate); the others are dropless.
Targets: <= 2 s at 1,024 ranks, <= 30 s at 4,096, <= 4 GB. A strategy whose
graph cannot be built for this model says why. A size that takes longer than ``--budget`` seconds
stops that strategy's sweep (the next size would take longer still).

Measured on the 2-core development machine (one strategy per process, 2026-11-26): at 1,024 ranks every
registered strategy takes 0.6-1.4 s; at 4,096, 2.7 s (zero) to 10.5 s (ep, lsh_moe), peak RSS 2.1-3.7 GB
of which the int64 loads [12, 4096, 4096] are 1.6 GB.

Usage: python benchmarks/sim_scale.py [--max-ranks 4096] [--strategies ep,fastermoe,...] [--budget 120]
"""
from __future__ import annotations

import argparse
import math
import resource
import time


def config(ranks: int, layers: int = 12, strategy: str = "ep"):
    from moelab.config import RunConfig
    from moelab.sim import get_profile
    from moelab.sim.whatif import STRATEGY_NEEDS, point_config

    base = RunConfig.load("experiments/core/quickstart.yaml").with_overrides({
        "model.n_layers": layers, "model.d_model": 1024, "model.d_ff": 4096, "model.n_heads": 16,
        "model.moe.top_k": 2})
    return point_config(base, get_profile("fastermoe_trevor"), ranks, strategy, 1, STRATEGY_NEEDS.get(strategy))


def measure(ranks: int, strategy: str, layers: int) -> dict:
    """One point, timed without tracing; memory is the process's peak RSS so far (sizes only grow
    within a sweep, so it is this point's peak, the loads [layers, ranks, experts] included)."""
    from moelab.sim import iteration_graph, simulate, synthetic_loads

    cfg, prof = config(ranks, layers, strategy)
    loads = synthetic_loads(cfg, seed=0, skew=1.0)
    t0 = time.perf_counter()
    g = iteration_graph(cfg, prof, loads)
    t1 = time.perf_counter()
    res = simulate(g)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"build_s": t1 - t0, "sim_s": t2 - t1, "total_s": t2 - t0, "peak_MB": peak / 2**20, "ops": len(g),
            "step_ms": res.makespan * 1e3}


def slope(points: list) -> float | None:
    """Least-squares slope of log(time) over log(ranks)."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(r) for r, _ in points], [math.log(max(t, 1e-9)) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None):
    from moelab.registry import all_strategies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-ranks", type=int, default=64)
    ap.add_argument("--max-ranks", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--strategies", default="ep", help="comma-separated, or 'all' (every registered one with a graph)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per point before a sweep stops")
    a = ap.parse_args(argv)
    if a.min_ranks < 8 or a.max_ranks < a.min_ranks:
        ap.error("need 8 <= --min-ranks <= --max-ranks")
    names = [s.name for s in all_strategies() if s.sim_graph] if a.strategies == "all" else a.strategies.split(",")
    sizes = []
    r = a.min_ranks
    while r <= a.max_ranks:
        sizes.append(r)
        r *= 2
    print("SIMULATED on fastermoe_trevor scaled by nodes (4 GPUs/node); one expert per rank, d_model 1024, "
          f"{a.layers} layers, top-2, synthetic Zipf(1.0) loads")
    print(f"{'strategy':<12} {'ranks':>6} {'ops':>9} {'build s':>9} {'sim s':>8} {'total s':>8} {'RSS MB':>8} "
          f"{'step ms':>9}")
    for name in names:
        points = []
        for n in sizes:
            try:
                m = measure(n, name, a.layers)
            except Exception as e:  # noqa: BLE001 - a strategy that cannot build this model says why
                print(f"{name:<12} {n:>6}  n/a: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                break
            points.append((n, m["total_s"]))
            print(f"{name:<12} {n:>6} {m['ops']:>9} {m['build_s']:>9.3f} {m['sim_s']:>8.3f} {m['total_s']:>8.3f} "
                  f"{m['peak_MB']:>8.0f} {m['step_ms']:>9.2f}", flush=True)
            if m["total_s"] > a.budget:
                print(f"{name:<12} stops: {m['total_s']:.0f} s > --budget {a.budget:g} s")
                break
        k = slope(points[-3:])
        if k is not None:
            print(f"{name:<12} growth exponent (largest 3 sizes): {k:.2f}")


if __name__ == "__main__":
    main()
