"""LSH-MoE's MoE layer on real gloo ranks with EMULATED links (2 nodes x 2 ranks by default), fed the hidden
states a tiny masked-LM MoE trained here really produces (and a random-row control), beside the Amdahl and
simulator predictions.

One spawn. Every rank builds the trained layer (its gate and its experts, sliced by expert parallelism) as
``ep`` (the core layer), ``identity`` (LSH-MoE with every row alone: the overhead of the machinery), CP with
L in {2, 4, 6} (r = 2) and CP L = 6 without residual compensation, and runs forward + backward on its own
captured batch ``--reps`` times after ``--warmup``; variants interleave within each repetition, so drift
on this shared host hits them alike.
A repetition's wall time is the slowest rank's; CPU time is the process's (emulated sleeps excluded).

Printed, per input (trained / random) and variant, as ratios over ``ep``:
- all-to-all bytes from the door's records / ep's, beside the layer's M/A (they must be equal, exactly);
- layer forward + backward speedup, beside the Amdahl prediction ``1/((1-p) + p*rho_remote)`` from ep's
  measured all-to-all share p and the variant's measured rho_remote, and beside the simulator's prediction
  (``moelab.sim`` on the emulated links, this machine's compute rate, the variant's recorded counts and its
  measured hashing cost per row);
- hashing + centroid + decompression time as a fraction of the layer's wall time (slowest rank's stage wall
  time) and of its CPU time (the stages' thread CPU time over the process CPU time, summed over ranks).
Targets (issue #11): identity <= 1.15x ep in CPU time; at rho <= 0.3 with an all-to-all share >= 50%, a
speedup >= 80% of Amdahl's; hashing overhead <= 20% of layer CPU time. CPU numbers are not paper numbers.

Default links 0.5 / 0.0005 GB/s per rank: an all-to-all's bytes, not its fixed cost on this host (~3.5 ms a
call on 4 ranks sharing 2 cores, printed), set its time, as on the paper's GPUs, where launching a call costs
microseconds against milliseconds of bytes. Compression shrinks only the bytes: at faster links (``--inter 0.01``)
the fixed cost is a large part of what is left at rho ~ 0.03-0.1, and the speedup falls short of Amdahl's by
that much (the 'A+fixed' column keeps it unshrunk).

Usage: python benchmarks/lsh_moe.py [--scale default] [--layer 0] [--reps 8] [--warmup 2] [--intra 0.5] [--inter 0.0005]
"""
from __future__ import annotations

import argparse
import sys
import time

VARIANTS = {"ep": None, "identity": {"hash_family": "identity"}, "CP L=2": {"num_hashes": 2},
            "CP L=4": {"num_hashes": 4},
            "CP L=6": {"num_hashes": 6}, "CP L=6 no-EC": {"num_hashes": 6, "error_compensation": False}}


def _rank(rank, world, a, cap, sources):
    import torch

    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import EmulationConfig, MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.strategies.lsh_moe.layer import LSHMoELayer
    from moelab.strategies.lsh_moe.options import LSHMoEOptions

    torch.set_num_threads(1)
    emu = EmulationConfig(enabled=True, intra_bw_GBps=a.intra, inter_bw_GBps=a.inter, intra_latency_us=a.latency,
                          inter_latency_us=a.latency)
    w1, b1, w2, b2 = cap["experts"][a.layer]
    E, d = cap["gates"][a.layer].shape
    fixed = _fixed_a2a_cost(Communicator(Topology(world, world // a.nodes), emulation=emu), world)
    out = []
    for source in sources:
        x0 = cap["x"][a.layer][rank]
        if source == "random":
            g = torch.Generator().manual_seed(1000 + rank)
            z = torch.randn(x0.shape, generator=g)
            x0 = z / z.norm(dim=1, keepdim=True) * x0.norm(dim=1).mean()
        built = {}
        for name, opts in VARIANTS.items():
            comm = Communicator(Topology(world, world // a.nodes), emulation=emu)
            cfg = MoEConfig(num_experts=E, top_k=2)
            kw = {} if opts is None else {"options": LSHMoEOptions(error_sample=0, **opts)}
            layer = (MoELayer if opts is None else LSHMoELayer)(d, w1.shape[2], cfg, layer_id=a.layer, comm=comm, **kw)
            mine = list(layer.experts.experts)
            with torch.no_grad():
                layer.gate.wg.weight.copy_(cap["gates"][a.layer])
                for p, full in zip(layer.experts.stacked(), (w1, b1, w2, b2)):
                    if p is not None:
                        p.copy_(full[mine])
            built[name] = (comm, layer, [])
        gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(rank))
        for i in range(a.warmup + a.reps):  # variants interleaved within each repetition: drift hits them alike
            for name, (comm, layer, reps) in built.items():
                with comm.rec.paused():
                    comm.all_reduce_(torch.zeros(1))  # line the ranks up
                n_rec, n_span = len(comm.rec.comm), len(comm.rec.spans)
                x = x0.clone().requires_grad_()
                t0, c0 = time.perf_counter(), time.process_time()
                y = layer(x)
                (y * gy).sum().backward()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                recs = comm.rec.comm[n_rec:]
                a2a = [r for r in recs if r.op == "all_to_all"]
                lsh_s = sum(t1 - t0 for _, cat, t0, t1, _ in comm.rec.spans[n_span:] if cat == "lsh")
                m = dict(getattr(layer, "last_metrics", {}) or {})
                reps.append(dict(wall=wall, cpu=cpu, emulated=sum(r.emulated_s for r in recs), a2a_calls=len(a2a),
                                 a2a_s=sum(r.t_end - r.t_start for r in a2a),
                                 a2a_bytes=sum(sum(r.sent_to.values()) for r in a2a),
                                 lsh_s=lsh_s, A=m.get("A"), M=m.get("M"), A_remote=m.get("A_remote"),
                                 M_remote=m.get("M_remote"),
                                 lsh_cpu=sum(m.get(f"{st}_cpu_s", 0.0) for st in ("hash", "centroid", "decompress")),
                                 warm=i >= a.warmup))
        for name, (comm, layer, reps) in built.items():
            rec = layer.plan_record()
            out.append(dict(source=source, variant=name, reps=reps, counts=rec["counts"],
                            centroids=(rec.get("lsh") or {}).get("centroids", rec["counts"])))
    return {"fixed_a2a_s": fixed, "variants": out}


def _fixed_a2a_cost(comm, world: int, reps: int = 25) -> float:
    """What one all-to-all call costs however few bytes it moves, on these links and this machine: the median
    time of a one-element-per-peer all-to-all, all ranks calling at once (the part that compression cannot shrink)."""
    import statistics

    import torch

    x, times = torch.zeros(world, 1), []
    for _ in range(reps + 5):
        t = time.perf_counter()
        comm.all_to_all_raw(x, [1] * world, [1] * world)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


def simulate_layer(a, cap, counts, centroids, variant_opts, lsh_row_s, tokens_per_rank):
    """The simulator's MoE-layer time (forward + backward) of one variant on the emulated links."""
    import numpy as np

    from moelab.config import RunConfig
    from moelab.measure.local import machine_profile
    from moelab.sim.engine import simulate
    from moelab.sim.graphs import ep_iteration_graph
    from moelab.strategies.lsh_moe.sim_graph import lsh_moe_iteration_graph

    E, d = cap["gates"][a.layer].shape
    f = cap["experts"][a.layer][0].shape[2]
    cfg = RunConfig().with_overrides({
        "model.d_model": d, "model.d_ff": f, "model.n_layers": 1, "model.moe_every": 1, "model.n_heads": 1,
        "model.seq_len": tokens_per_rank, "model.moe.num_experts": E, "model.moe.top_k": 2, "train.batch_size": 1,
        "parallel.nproc": a.nproc, "parallel.topology.nodes": a.nodes,
        "parallel.strategy": "ep" if variant_opts is None else "lsh_moe",
        "parallel.strategy_options": variant_opts or {}, "emulation.enabled": True, "emulation.intra_bw_GBps": a.intra,
        "emulation.inter_bw_GBps": a.inter, "emulation.intra_latency_us": a.latency,
        "emulation.inter_latency_us": a.latency}).validate()
    prof = machine_profile(cfg, None, compute="model")
    loads = np.asarray([counts])
    g = ep_iteration_graph(cfg, prof, loads) if variant_opts is None else \
        lsh_moe_iteration_graph(cfg, prof, loads, centroids=np.asarray([centroids]), lsh_row_s=lsh_row_s)
    return float(simulate(g).moe_layer_times([0])[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", default="default", help="capture scale (experiments/lsh_moe/scales.yaml)")
    p.add_argument("--layer", type=int, default=0, help="captured MoE layer")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--intra", type=float, default=0.5, help="emulated intra-node GB/s per rank")
    p.add_argument("--inter", type=float, default=0.0005, help="emulated inter-node GB/s per rank")
    p.add_argument("--latency", type=float, default=50.0, help="emulated latency, us")
    p.add_argument("--timeout", type=float, default=1800.0)
    a = p.parse_args(argv)

    import numpy as np

    from moelab.papers.lsh_moe import tokens as T
    from moelab.runtime.ranks import run_ranks

    cap = T.capture(a.scale)
    a.nproc = len(cap["x"][a.layer])
    if a.nproc % a.nodes:
        print(f"{a.nproc} captured batches (ranks) do not split over {a.nodes} nodes", file=sys.stderr)
        return 2
    sources = ("trained", "random")
    res = run_ranks(_rank, a.nproc, a, cap, sources, timeout=a.timeout)
    fixed = float(np.median([r["fixed_a2a_s"] for r in res]))
    res = [r["variants"] for r in res]
    info = T.summary(a.scale)
    print(f"LSH-MoE layer benchmark: {a.nproc} gloo ranks as {a.nodes} nodes, EMULATED links {a.intra}/{a.inter} GB/s "
          f"intra/inter, {a.latency} us; MoE layer {a.layer} of the tiny bert-MoE trained {info['iters']} iterations "
          f"(d={info['d']}, {info['experts']} experts, top-2, ~{info['rows_per_group']:.0f} rows per group); "
          f"{a.reps} reps after {a.warmup} warm-up; medians; wall = slowest rank")
    tokens_per_rank = cap["x"][a.layer][0].shape[0]
    ok = True
    for si, source in enumerate(sources):
        rows = {}
        for vi, name in enumerate(VARIANTS):
            i = si * len(VARIANTS) + vi
            per = [r[i] for r in res]
            warm = [[x for x in pr["reps"] if x["warm"]] for pr in per]
            n = len(warm[0])
            wall = float(np.median([max(w[j]["wall"] for w in warm) for j in range(n)]))
            cpu = float(np.median([sum(w[j]["cpu"] for w in warm) for j in range(n)]))
            a2a = float(np.median([max(w[j]["a2a_s"] for w in warm) for j in range(n)]))
            lsh = float(np.median([max(w[j]["lsh_s"] for w in warm) for j in range(n)]))
            lsh_cpu = float(np.median([sum(w[j]["lsh_cpu"] for w in warm) for j in range(n)]))
            bytes_ = sum(w[0]["a2a_bytes"] for w in warm)
            A = sum(w[0]["A"] or 0 for w in warm)
            M = sum(w[0]["M"] or 0 for w in warm)
            Ar = sum(w[0]["A_remote"] or 0 for w in warm)
            Mr = sum(w[0]["M_remote"] or 0 for w in warm)
            row_s = lsh / max(1, max(w[0]["A"] or 0 for w in warm))
            sim = simulate_layer(a, cap, per[0]["counts"], per[0]["centroids"], VARIANTS[name],
                                 row_s if VARIANTS[name] is not None else None, tokens_per_rank)
            rows[name] = dict(wall=wall, cpu=cpu, a2a=a2a, lsh=lsh, lsh_cpu=lsh_cpu, bytes=bytes_, A=A, M=M,
                              rho=M / A if A else 1.0, rho_remote=Mr / Ar if Ar else 1.0, sim=sim)
        ep = rows["ep"]
        p_share = ep["a2a"] / ep["wall"]
        calls = max(x["a2a_calls"] for r in res for x in r[si * len(VARIANTS)]["reps"] if x["warm"])  # ep's, per rep
        f_fixed = min(1.0, calls * fixed / ep["a2a"])  # the share of ep's all-to-all time no compression removes
        print(f"\n[{source} rows]  ep: layer {ep['wall'] * 1e3:.1f} ms (sim {ep['sim'] * 1e3:.1f}), "
              f"all-to-all share p = {p_share:.2f}, CPU {ep['cpu'] * 1e3:.1f} ms over all ranks")
        print(f"fixed cost per all-to-all call {fixed * 1e3:.2f} ms x {calls:.0f} calls = {f_fixed:.1%} of ep's "
              "all-to-all time; 'Amdahl+fixed' keeps that part unshrunk")
        print(f"{'variant':14s} {'bytes/ep':>9s} {'M/A':>7s} {'rho_rem':>8s} {'speedup':>8s} {'Amdahl':>7s} "
              f"{'A+fixed':>8s} {'sim':>6s} {'CPU/ep':>7s} {'lsh/wall':>9s} {'lsh/CPU':>8s}")
        for name, r in rows.items():
            if name == "ep":
                continue
            amdahl = 1.0 / ((1 - p_share) + p_share * r["rho_remote"])
            amdahl_fixed = 1.0 / ((1 - p_share) + p_share * (f_fixed + (1 - f_fixed) * r["rho_remote"]))
            ratio_b = r["bytes"] / ep["bytes"]
            lsh_cpu = r["lsh_cpu"] / r["cpu"]  # thread CPU of hash + centroid + decompress, summed over ranks
            print(f"{name:14s} {ratio_b:9.4f} {r['rho']:7.4f} {r['rho_remote']:8.4f} {ep['wall'] / r['wall']:7.2f}x "
                  f"{amdahl:6.2f}x {amdahl_fixed:7.2f}x {ep['sim'] / r['sim']:5.2f}x {r['cpu'] / ep['cpu']:6.2f}x "
                  f"{r['lsh'] / r['wall']:8.1%} {lsh_cpu:7.1%}")
            ok &= abs(ratio_b - r["rho"]) < 1e-12
        ident = rows["identity"]
        print(f"targets: identity CPU/ep = {ident['cpu'] / ep['cpu']:.2f} (<= 1.15); "
              + "; ".join(f"{n}: speedup/Amdahl = "
                          f"{(ep['wall'] / r['wall']) / (1.0 / ((1 - p_share) + p_share * r['rho_remote'])):.2f} "
                          "(>= 0.8 where rho <= 0.3 and p >= 0.5: "
                          f"{'applies' if r['rho'] <= 0.3 and p_share >= 0.5 else 'n/a'})"
                          for n, r in rows.items() if n.startswith("CP")))
    print("\nbytes/ep == M/A for every variant:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
