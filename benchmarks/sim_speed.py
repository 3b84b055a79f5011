"""How fast the simulator prices one paper-scale iteration: 64 GPUs (trevor), 24 layers, 64 experts.

Target: build + simulate under 1 second. Prints the split between graph building and simulation.
Usage: python benchmarks/sim_speed.py [--profile trevor] [--layers 24] [--repeat 3]
"""
from __future__ import annotations

import argparse
import time

from moelab.config import RunConfig
from moelab.sim import config_for_profile, ep_iteration_graph, get_profile, simulate, synthetic_loads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="trevor")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    prof = get_profile(a.profile)
    cfg = config_for_profile(RunConfig(), prof, **{
        "model.n_layers": a.layers, "model.d_model": 1024, "model.d_ff": 2048, "model.n_heads": 16,
        "model.seq_len": 512, "model.vocab_size": 50257, "model.moe.num_experts": a.experts,
        "model.moe.top_k": 2, "train.batch_size": 2})
    loads = synthetic_loads(cfg, seed=0, skew=1.0)
    best = None
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        g = ep_iteration_graph(cfg, prof, loads)
        t1 = time.perf_counter()
        res = simulate(g)
        t2 = time.perf_counter()
        if best is None or t2 - t0 < best[0]:
            best = (t2 - t0, t1 - t0, t2 - t1)
    bd = res.breakdown()
    print(f"profile {prof.name}: {prof.world_size} GPUs, {a.layers} layers, {a.experts} experts, {len(g)} ops")
    print(f"simulated iteration: {res.makespan * 1e3:.2f} ms; critical path: "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(bd.items(), key=lambda kv: -kv[1])))
    print(f"sim speed: {best[0]:.3f} s total (build {best[1]:.3f} s + simulate {best[2]:.3f} s), "
          f"best of {a.repeat}; target < 1 s")
    return best[0]


if __name__ == "__main__":
    main()
