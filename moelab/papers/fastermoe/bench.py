"""Small real-run timing of the FasterMoE layer variants on gloo ranks (CPU), for notebooks and the
closing numbers: forward+backward of one layer, same inputs and routing for every variant,
variants interleaved round-robin, a barrier before each iteration, an iteration's time = the
slowest rank's, the median over ``iters`` after ``warmup``.

Optional link emulation (the comm door sleeps until the declared links would be done; on the smart
schedule's comm thread, so emulated transfers overlap with compute) - results are then EMULATED.
On a 2-core machine the ranks, gloo's threads and the comm threads share the cores: the numbers
show mechanisms, not paper-scale speedups (spec §6.7).

Usage: ``python -m moelab.papers.fastermoe.bench --nproc 4 --emulate``
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import EmulationConfig, MoEConfig
from moelab.runtime.ranks import run_ranks
from moelab.strategies.fastermoe.layer import FasterMoELayer


def _bench_rank(rank, world, a, variants):
    import torch.distributed as dist

    torch.set_num_threads(1)
    emu = EmulationConfig(enabled=True, intra_bw_GBps=a["bw"], inter_bw_GBps=a["bw"], intra_latency_us=a["lat"],
                          inter_latency_us=a["lat"]) if a["emulate"] else None
    comm = Communicator(Topology(world, world), emulation=emu)
    cfg = MoEConfig(num_experts=a["experts"], top_k=a["k"], gate="topk", balance_loss_coef=0.0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a["tokens"], a["d"], generator=g) + (1.0 if a["hot"] is not None else 0.0)
    layers = {}
    for name, opts in variants.items():
        layer = FasterMoELayer(a["d"], a["f"], cfg, comm=comm, options=opts)
        if a["hot"] is not None:
            with torch.no_grad():
                layer.gate.wg.weight[a["hot"]] += a["hot_strength"]
        layers[name] = layer
    times = {n: [] for n in variants}
    shadows = {n: [] for n in variants}
    for it in range(a["warmup"] + a["iters"]):
        for name, layer in layers.items():
            dist.barrier()
            t0 = time.perf_counter()
            xi = x.clone().requires_grad_()
            layer(xi).sum().backward()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if it >= a["warmup"]:
                times[name].append(float(dt))
                shadows[name].append(layer.last_shadowed)
            layer.zero_grad(set_to_none=True)
    C = next(iter(layers.values())).last_global_counts.to(torch.float64)
    return dict(times=times, shadows=shadows, expert_share=(C.sum(0) / C.sum()).tolist())


def run(nproc=4, tokens=1024, d=256, f=512, experts=None, k=2, hot=0, hot_strength=0.05, iters=10, warmup=3,
        emulate=False, bw=0.5, lat=50.0, group_sizes=(1, 2), timeout=600, variants=None):
    """Returns ``{variant: median seconds}`` and the raw per-iteration times."""
    experts = experts or nproc
    if variants is None:
        variants = {"fastmoe": {}, f"shadow[{hot}]": {"shadow_force": [hot]}}
        for gs in group_sizes:
            if nproc % gs == 0:
                variants[f"smart Gs={gs}"] = {"smart": True, "group_size": gs}
        variants[f"smart Gs={group_sizes[0]} + shadow"] = {"smart": True, "group_size": group_sizes[0],
                                                           "shadow_force": [hot]}
    a = dict(tokens=tokens, d=d, f=f, experts=experts, k=k, hot=hot, hot_strength=hot_strength, iters=iters,
             warmup=warmup, emulate=emulate, bw=bw, lat=lat)
    res = run_ranks(_bench_rank, nproc, a, variants, timeout=timeout)[0]
    med = {n: statistics.median(t) for n, t in res["times"].items()}
    spread = {n: (min(t), max(t)) for n, t in res["times"].items()}
    return dict(median_s=med, spread_s=spread, times=res["times"], expert_share=res["expert_share"],
                label="EMULATED links" if emulate else "REAL (gloo/CPU)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--f", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--bw", type=float, default=0.5, help="emulated GB/s per rank")
    p.add_argument("--hot-strength", type=float, default=0.05)
    a = p.parse_args(argv)
    out = run(a.nproc, a.tokens, a.d, a.f, iters=a.iters, warmup=a.warmup, emulate=a.emulate, bw=a.bw,
              hot_strength=a.hot_strength)
    base = out["median_s"]["fastmoe"]
    print(f"{out['label']}, {a.nproc} ranks, {a.tokens} tokens/rank, d={a.d}, f={a.f}, "
          f"expert shares {[round(v, 3) for v in out['expert_share']]}")
    for n, t in out["median_s"].items():
        lo, hi = out["spread_s"][n]
        print(f"  {n:24s} {t * 1e3:8.2f} ms  (min {lo * 1e3:.2f}, max {hi * 1e3:.2f})  speedup {base / t:.2f}x")


if __name__ == "__main__":
    main()
