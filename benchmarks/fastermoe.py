"""FasterMoE layer on real gloo ranks with EMULATED links: speedup of dynamic shadowing, the smart
schedule and both over the FastMoE baseline on a skewed trace, with the performance model's and the
simulator's prediction beside each measured number.

One run (one spawn of ``--nproc`` ranks declared as ``--nodes`` nodes; the comm door sleeps until the
declared links would be done, so overlap and topology show on one machine), one thread per rank, fp32,
the same routing for every variant (a trace-replay gate: ``hot`` = one expert takes 40 % of the
assignments, as ``moelab.models.traces`` ``hot_expert``; ``t2`` = the synthetic drifting popularity),
variants interleaved round-robin, a barrier before each iteration; an iteration's time is the slowest
rank's, the table shows the median (min-max) after ``--warmup``.

Rows: ``fastmoe`` (synchronous sparse EP), ``shadow`` (the shadow policy, constants calibrated here:
P = the measured per-rank FFN rate, W_net = the emulated NIC, c = 2: a broadcast and a reduce, each a
pipelined chain), ``shadow[e]`` (the hot expert forced), ``smart`` (Gs = 2, two streams),
``smart seq`` (same steps on one thread), ``both`` (policy + smart).

Predictions: ``model`` = the paper's performance model on the emulated network
(``experiments.predict_layer_variants``: ``3 Tc + 4 Tm``, the shadow variant's loads and broadcasts,
the two-stream pipeline for the smart schedule), ``sim`` = ``moelab.sim`` on the same network
(``experiments.simulate_layer_variants``), both with the measured per-rank FLOP/s and the shadow sets the
run used (``smart seq``: the model's sequential sum; the simulator has no sequential smart plan). Neither
models Python / gloo overheads or the CPU contention of N ranks on few cores (spec §6.7: never read CPU
timings as paper numbers). The emulator, ``model`` and the simulator price a broadcast / reduce alike, as a
pipelined chain from / to the owner (before 2026-11-27 the emulator and ``model`` priced a flat tree, N_inter
copies through the owner's NIC, and the simulator's shadowing predictions were optimistic here).

Usage: python benchmarks/fastermoe.py [--nproc 8] [--nodes 2] [--d 256] [--tokens 512] [--iters 10]
                                      [--warmup 2] [--intra 0.1] [--inter 0.02] [--trace hot|t2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--d", type=int, default=256, help="h (d_model); h_ff = 2h")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (x top-2)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--intra", type=float, default=0.1, help="emulated intra-node GB/s per rank")
    p.add_argument("--inter", type=float, default=0.02, help="emulated inter-node GB/s per rank")
    p.add_argument("--latency", type=float, default=50.0, help="emulated latency per call, us")
    p.add_argument("--trace", choices=("hot", "t2"), default="hot")
    p.add_argument("--share", type=float, default=0.4, help="hot trace: the hot expert's share")
    p.add_argument("--timeout", type=float, default=1200.0)
    a = p.parse_args(argv)

    from moelab.models.traces import routing_trace
    from moelab.papers import fastermoe as E
    from moelab.strategies.fastermoe import perf_model as pm

    n_it = a.warmup + a.iters
    hot = 3
    if a.trace == "hot":
        tr = routing_trace("hot_expert", n_it, 1, a.nproc, a.experts, a.tokens, 2, 0, expert=hot,
                           share=a.share).numpy()[:, 0]
    else:
        tr = E.t2_counts(list(range(5000, 5000 + n_it)), 1, a.nproc, a.experts, a.tokens)[:, 0]
        hot = int(np.argmax(tr[0].sum(0)))
    variants = {"fastmoe": {}, "shadow": {"_policy": True}, f"shadow[{hot}]": {"shadow_force": [hot]},
                "smart": {"smart": True, "group_size": 2}, "smart seq": {"smart": True, "group_size": 2,
                                                                      "smart_threaded": False},
                "both": {"_policy": True, "smart": True, "group_size": 2}}
    t0 = time.time()
    s = E.run_layer_suite(tr, variants, nodes=a.nodes, d=a.d, emulate=True, intra_GBps=a.intra, inter_GBps=a.inter,
                          latency_us=a.latency, warmup=a.warmup, timeout=a.timeout)
    wall = time.time() - t0
    df = s["times"]
    df = df[(df["rank"] == 0) & (df.iter >= a.warmup)]
    cl = E.suite_cluster(s)
    C_all = s["trace"]
    its = sorted(df.iter.unique())

    # predictions per iteration (with the shadow set each variant really used), medians over iterations
    model, sim = {v: [] for v in variants}, {v: [] for v in variants}
    for it in its:
        sims = E.simulate_layer_variants(s, it)
        for v in variants:
            row = df[(df.variant == v) & (df.iter == it)]
            S = tuple(row.shadowed.iloc[0]) if len(row) else ()
            pr = E.predict_layer_variants(C_all[it], cl, s["d"], s["f"], s["P_eff"], 2, S)
            key = {"fastmoe": "fastmoe", "smart": "smart", "smart seq": None, "both": "both"}.get(v, "shadow")
            if v == "smart seq":
                model[v].append(3 * pr["Tc"] + 4 * pr["Tm"] + 0.0)  # no overlap: every op in turn
            else:
                model[v].append(pr[key])
            sim[v].append(float("nan") if v == "smart seq" else sims.get(v, float("nan")))
    loads = pm.worker_loads(C_all[its[0]])
    print(f"{s['label']}; trace {a.trace}: expert shares "
          f"{np.round(C_all[its[0]].sum(0) / C_all[its[0]].sum(), 3).tolist()}")
    print(f"rank loads (assignments) {loads.astype(int).tolist()}; measured per-rank FFN rate "
          f"{s['P_eff'] / 1e9:.1f} GFLOP/s (all ranks at once); policy W_net {a.inter:g} GB/s, c = {s['policy_c']}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; wall {wall:.0f} s")
    base = statistics.median(df[df.variant == "fastmoe"].time_s)
    mb, sb = statistics.median(model["fastmoe"]), statistics.median(sim["fastmoe"])
    hdr = (f"{'variant':12s} {'measured ms':>12s} {'(min-max)':>17s} {'speedup':>8s} | {'model ms':>9s} {'speedup':>8s}"
           f" | {'sim ms':>8s} {'speedup':>8s} | shadowed")
    print(hdr)
    print("-" * len(hdr))
    for v in variants:
        t = df[df.variant == v].time_s
        med = statistics.median(t)
        m, si = statistics.median(model[v]), float(np.median(sim[v]))
        sh = sorted({tuple(x) for x in df[df.variant == v].shadowed})
        print(f"{v:12s} {1e3 * med:12.1f} {f'({1e3 * t.min():.1f}-{1e3 * t.max():.1f})':>17s} {base / med:8.2f} | "
              f"{1e3 * m:9.1f} {mb / m:8.2f} | {1e3 * si:8.1f} {sb / si:8.2f} | {sh if sh != [()] else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
