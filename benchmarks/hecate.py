"""Hecate and its baselines trained on real gloo ranks with EMULATED links (2 nodes x 4 ranks by default),
with the simulator's prediction of the same plans beside every measured number.

One spawn; every system trains the same model on the same data (they are numerically the same model, so
they route the same tokens: one skewed, drifting load trace for all — the real routing of the byte
corpus), fp32, attention + MoE blocks, systems run one after another (not interleaved: say so when
comparing small differences). An iteration's time is the slowest rank's; the table shows medians after
``--warmup``. Predictions: ``moelab.sim`` on the emulated network with each run's own recorded plans
(:meth:`moelab.measure.realruns.RealRun.graph_plans`) and this machine's measured compute rate, with and
without the door's held-out fixed costs per call (``moelab.measure.local.emulated_call_costs``: a call's
software beside its link time, then the emulator's sync), with the ranks' compute scaled by a static core share or
with the host's cores pooled (``machine_profile(share_cores="pool")``: k ranks computing at once share them, a rank
waiting for a collective leaves its core to the others), pooled with the sparse collectives issued beside
compute priced at the fixed costs measured on busy ranks, and pooled with every call's fixed costs and moved bytes
as its ranks' CPU work on the shared cores (``ClusterProfile.software_on_cores``, ``cpu_s_per_byte`` from
:func:`moelab.measure.local.transport_cpu_per_byte`, held out).

Printed: iteration time and speedup over EP (measured / simulated) of Hecate (full, sharding only,
materialization only, RM, no calibration) and every baseline present (FasterMoE, FlexMoE, FSDP, SmartMoE);
inter-node all-to-all bytes EP / Hecate; spAG + spRS bytes vs FlexMoE's replica all-reduce bytes;
memory at the iteration peak per category (params, grads, optim, activations) and in total, with the iteration of
the total peak, per system; the computed overlap degree t; the MoE layers alone
(real: gate to last token exchange forward, first to last backward; sim: the critical path's MoE ops); exposed /
total spAG time of every Hecate variant; RM's replica bytes and time, at ``--layers`` and, in one more spawn of EP,
Hecate and Hecate-RM, at ``--rm-layers`` (RM keeps the last layer's replicas, so at 2 layers it frees half).
A second table: the same medians over the
timed iterations in which no system re-sharded (the run re-shards every ``max(2, warmup)`` iterations so that Alg. 2
runs inside it; the paper's interval is 100), and with each run's migration time per re-shard spread over 100
iterations. CPU timings are not paper numbers (spec §6.15): the ratios check
mechanisms, the simulator carries the paper scale.

Defaults (d = 128, 16 sequences per rank, links 0.5 / 0.01 GB/s per rank): a token all-to-all's bytes, not its
fixed cost on 8 ranks sharing 2 cores (~5 ms of software, ~3 ms of sync, printed), set its time, as on the paper's
GPUs; intra-node links are much faster than a node's NIC, as NVLink against the paper's InfiniBand, so ``hier``'s
fan-out inside a node is short beside its crossing, which t is sized on; and T_nonMoE · bw / s_e lands near 2.
Every Hecate variant gets one T_nonMoE, measured first by Hecate in a 4-iteration run (``--t-nonmoe`` gives it):
each run measuring its own moved t by one or two between variants on this shared host. At faster links
(``--batch 4 --d 64 --intra 0.1 --inter 0.02``) the fixed costs of Hecate's extra collectives dominate and it
trails EP.

``--compute-yields`` (default ``off``; ``auto``: on where the host allows): ``emulation.compute_yields`` for
every system, the ranks' compute threads at SCHED_IDLE during the iterations (:mod:`moelab.comm.cpu_priority`),
so a call that a side stream issues beside attention does not wait for a core; the busy-cost probe then computes
at SCHED_IDLE too. Off by default: on 8 ranks sharing 2 cores it made every system slower (one pair of runs,
2026-11-28, same t: EP 1962 against 1930 ms, FSDP 970 against 806 ms, Hecate 1.50x over EP against 1.66x).

Usage: python benchmarks/hecate.py [--nproc 8] [--nodes 2] [--d 128] [--ff 2] [--experts 16] [--batch 16] [--iters 8]
                                   [--warmup 3] [--intra 0.5] [--inter 0.01] [--t-nonmoe S] [--m M] [--rm-layers 6]
                                   [--compute-yields auto|on|off]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

# FlexMoE prices a step's gain with the hecate_A profile; at that profile's migration cost (params + Adam state
# over a 100 Gb/s NIC) a step never pays back within K iterations on these tiny experts, its policy makes no
# replica and FlexMoE is EP. A free migration (its documented option for tiny CPU models) lets the mechanism
# fire: every step that balances the window is kept, and its replicas' own Adam state is what it costs.
FLEXMOE_OPTIONS = {"migration_cost_s": 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--ff", type=int, default=2, help="expert hidden size as a multiple of --d")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--intra", type=float, default=0.5, help="emulated intra-node GB/s per rank")
    p.add_argument("--inter", type=float, default=0.01, help="emulated inter-node GB/s per rank")
    p.add_argument("--spag-backend", default="hier", choices=("a2a", "p2p", "hier", "stripe"),
                   help="Hecate's sparse collectives (t is sized on the node's links with hier, a rank's otherwise)")
    p.add_argument("--t-nonmoe", type=float, default=None,
                   help="T_nonMoE in seconds for every Hecate variant "
                   "(default: measured by Hecate in a short run first)")
    p.add_argument("--rm-layers", type=int, default=6,
                   help="also run EP, Hecate and Hecate-RM with this many layers, where RM can free more than "
                   "half the replicas (0: skip)")
    p.add_argument("--m", type=int, default=None,
                   help="Hecate's replica slots per device (default: profiled from free memory, spec §2.3; "
                   "--m equal to t leaves calibration no slot)")
    p.add_argument("--only", nargs="*", metavar="SYSTEM",
                   help="run only these systems besides EP and Hecate (also: 'FasterMoE shadowing only')")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--compute-yields", choices=("auto", "on", "off"), default="off",
                   help="emulation.compute_yields: the ranks' compute threads at SCHED_IDLE during the iterations, "
                   "so a communication thread's call does not wait for a core (auto: on where the host allows)")
    a = p.parse_args(argv)
    from moelab.comm.cpu_priority import resolve

    a.compute_yields = resolve(a.compute_yields)

    from moelab.config import RunConfig
    from moelab.measure.validate import compare, machine_profile, measure_emulated_call_costs, simulate_real, validate
    from moelab.registry import known_strategies

    base = {"model.d_model": a.d, "model.d_ff": a.ff * a.d, "model.n_layers": a.layers, "model.n_heads": 4,
            "model.seq_len": a.seq, "model.moe.num_experts": a.experts, "model.moe.top_k": 2,
            "model.moe.balance_loss_coef": 0.0, "parallel.nproc": a.nproc, "parallel.topology.nodes": a.nodes,
            "train.iters": a.iters, "train.batch_size": a.batch, "train.trace": False,
            "emulation.enabled": True, "emulation.intra_bw_GBps": a.intra, "emulation.inter_bw_GBps": a.inter,
            "emulation.compute_yields": a.compute_yields}
    hec = {"reshard_interval": max(2, a.warmup), "spag_backend": a.spag_backend}
    if a.t_nonmoe is None:  # one T_nonMoE for every Hecate variant, measured by Hecate itself in a short run
        from moelab.measure.realruns import run_real

        pre = RunConfig().with_overrides({**base, "train.iters": 4, "parallel.strategy": "hecate",
                                          "parallel.strategy_options": hec}).validate()
        a.t_nonmoe = run_real(pre, timeout=a.timeout).plans[-1][0]["hecate"]["t_nonmoe_s"]
        print(f"# T_nonMoE = {1e3 * a.t_nonmoe:.2f} ms: measured by Hecate (median of its first 3 iterations' "
              "attention forward, max over ranks) in a 4-iteration run, given to every Hecate variant")
    hec["t_nonmoe_s"] = a.t_nonmoe
    if a.m is not None:
        hec["m"] = a.m
    systems = {"EP": ("ep", {}), "Hecate": ("hecate", hec),
               "Hecate sharding only": ("hecate", {**hec, "materialize": False, "calibration": False}),
               "Hecate materialization only": ("hecate", {**hec, "shard": False}),
               "Hecate-RM": ("hecate", {**hec, "rm": True}),
               "Hecate no calibration": ("hecate", {**hec, "calibration": False}),
               "FasterMoE": ("fastermoe", {"shadow": True, "smart": True, "group_size": a.nproc // a.nodes}),
               "FlexMoE": ("flexmoe", FLEXMOE_OPTIONS), "FSDP": ("fsdp_expert", {}),
               "SmartMoE": ("smartmoe", {"interval": max(2, a.warmup)})}
    extra = {"FasterMoE shadowing only": ("fastermoe", {"shadow": True, "smart": False}),  # with --only
             "Hecate, best calibration": ("hecate", {**hec, "calibration_rule": "best"}),
             # the paper's baselines were hand-tuned, FlexMoE's reserved memory among them (spec §4): more slots,
             # each with its own Adam state, and steps enough to fill them in a round
             **{f"FlexMoE r={r}": ("flexmoe", {**FLEXMOE_OPTIONS, "r": r, "max_steps": 4 * r}) for r in (2, 4, 8)},
             **{f"Hecate, {b}": ("hecate", {**hec, "spag_backend": b})
                for b in ("a2a", "hier", "stripe") if b != a.spag_backend}}
    if a.only:
        unknown = set(a.only) - set(systems) - set(extra)
        if unknown:
            p.error(f"--only: unknown systems {sorted(unknown)}; known: {sorted(systems) + sorted(extra)}")
        systems = {n: c for n, c in {**systems, **extra}.items() if n in ("EP", "Hecate") or n in a.only}
    have = known_strategies()
    named = [(n, RunConfig().with_overrides({**base, "parallel.strategy": s,
                                             "parallel.strategy_options": o}).validate())
             for n, (s, o) in systems.items() if s in have]
    print(f"# {len(named)} systems on {a.nproc} gloo ranks as {a.nodes} nodes, EMULATED links intra {a.intra} GB/s, "
          f"inter {a.inter} GB/s per rank; d={a.d}, d_ff={a.ff * a.d}, {a.layers} layers, {a.experts} experts, "
          f"{a.iters} iterations; compute threads "
          f"{'yield to communication (SCHED_IDLE)' if a.compute_yields else 'at the same priority as communication'}")
    comp0, reals, _ = validate(named, warmup=a.warmup, timeout=a.timeout, warn=False)
    fixed = measure_emulated_call_costs(named[0][1], timeout=a.timeout, busy=True)

    def predict(share_cores, busy=False, on_cores=False):
        busy_costs = {"busy_call_overhead_s": fixed["busy"]["call_s"],
                      "busy_emulated_sync_s": fixed["busy"]["sync_s"]} if busy else {}
        if on_cores:  # the calls' fixed costs and bytes as CPU work on the pooled cores (held-out probes)
            busy_costs = {"software_on_cores": True, "cpu_s_per_byte": fixed["cpu_s_per_byte"]}
        sims = [simulate_real(c, r.loads, dataclasses.replace(
            machine_profile(c, None, compute="model", share_cores=share_cores), call_overhead_s=fixed["call_s"],
            emulated_sync_s=fixed["sync_s"], **busy_costs), plans=r.graph_plans()) for (_, c), r in zip(named, reals)]
        return compare(reals, sims, warmup=a.warmup, names=[n for n, _ in named], warn=False), sims

    (comp, sims), (comp_pool, sims_pool) = predict(True), predict("pool")
    comp_busy, _ = predict("pool", busy=True)
    comp_cpu, _ = predict("pool", on_cores=True)
    print(f"held-out fixed costs of a call through the emulated door (1-element all-to-all, all ranks at once): "
          f"software {1e3 * fixed['call_s']:.2f} ms beside its link time, then sync {1e3 * fixed['sync_s']:.2f} ms; "
          f"with a thread computing beside the calls on every rank {1e3 * fixed['busy']['call_s']:.2f} + "
          f"{1e3 * fixed['busy']['sync_s']:.2f} ms; CPU per byte a rank moves (64 and 512 KiB a peer, slope): "
          f"{1e9 * fixed['cpu_s_per_byte']:.3f} ns")
    t0, t, tp, tb, tc = (timed_medians(c) for c in (comp0, comp, comp_pool, comp_busy, comp_cpu))
    ep, ep0, epp, epb, epc = t.loc["EP"], t0.loc["EP"], tp.loc["EP"], tb.loc["EP"], tc.loc["EP"]
    print(f"\n{'system':30s} {'iter ms real':>12s} {'sim':>8s} {'speedup real':>12s} {'sim':>6s} {'pred err':>8s}"
          f" | {'w/o fixed':>9s} {'speedup':>7s} {'err':>5s} | {'pooled':>7s} {'speedup':>7s} {'err':>5s}"
          f" | {'+busy':>7s} {'speedup':>7s} {'err':>5s} | {'cpu':>7s} {'speedup':>7s} {'err':>5s}")
    for name, row in t.iterrows():
        cols = [(t0.loc[name].sim_s, ep0.sim_s), (tp.loc[name].sim_s, epp.sim_s), (tb.loc[name].sim_s, epb.sim_s),
                (tc.loc[name].sim_s, epc.sim_s)]
        print(f"{name:30s} {1e3 * row.real_s:12.1f} {1e3 * row.sim_s:8.1f} {ep.real_s / row.real_s:12.2f} "
              f"{ep.sim_s / row.sim_s:6.2f} {(row.sim_s - row.real_s) / row.real_s:+8.0%}" + "".join(
                  f" | {1e3 * x:{w}.1f} {e / x:7.2f} {(x - row.real_s) / row.real_s:+5.0%}"
                  for (x, e), w in zip(cols, (9, 7, 7, 7))))
    print("sim: the cores shared by a static factor (every rank at cores / ranks), with the idle fixed costs; "
          "'pooled': the engine's pool instead (k ranks computing at once share the cores, a waiting rank's core "
          "goes to the others); '+busy': pooled, and the sparse collectives issued beside compute (spAG beside "
          "attention, spRS beside backward) at the busy fixed costs; 'cpu': pooled, every call's fixed costs and "
          "every byte it moves as CPU work of its ranks on the pooled cores (held out: the idle costs, the CPU per "
          "byte), instead of the busy costs")

    runs = dict(zip([n for n, _ in named], reals))
    steady_state(comp, runs, a.warmup, comp_pool)

    def inter_a2a(r):
        c = r.comm[(r.comm.op == "all_to_all") & r.comm.phase.isin(["fwd", "bwd"]) & (r.comm.iter >= a.warmup)]
        return c.bytes_inter.sum()

    ih = inter_a2a(runs["Hecate"])
    print("\ninter-node token all-to-all bytes EP / Hecate: " + (f"{inter_a2a(runs['EP']) / ih:.2f}" if ih else
                                                               "inf (Hecate's tokens never cross nodes)"))
    h = runs["Hecate"].comm
    sparse = h[h.phase.isin(["spag", "sprs", "calibrate"]) & (h.iter >= a.warmup)]
    print(f"Hecate spAG+spRS bytes per iteration (sent, all links): "
          f"{sparse[['bytes_intra', 'bytes_inter']].sum().sum() / (a.iters - a.warmup):.0f}")
    if "FlexMoE" in runs:
        f = runs["FlexMoE"].comm
        ar = f[(f.phase == "replica_sync") & (f.iter >= a.warmup)]
        print("FlexMoE replica all-reduce bytes per iteration: "
              f"{ar[['bytes_intra', 'bytes_inter']].sum().sum() / (a.iters - a.warmup):.0f}"
              " (its replicas differ from Hecate's plan: not the same-plan identity of spec §2.2, see tests; "
              f"0: its policy made no replica; options {FLEXMOE_OPTIONS})")
    for n, r in runs.items():
        if not n.startswith("Hecate"):
            continue
        plans = r.plans
        calls = [rec['hecate']['calibration'] for it in plans for rec in it]
        cpu = [rec['hecate'].get('calibration_cpu_s', 0.0) for it in plans for rec in it]
        print(f"{n}: m = {plans[-1][0]['hecate']['m']} ({plans[-1][0]['hecate'].get('m_source')}); calibrations: "
              f"{calls.count('accepted')} of {len(calls)} layer calls accepted, "
              f"policy CPU {1e3 * np.median(cpu):.1f} ms a call (median of rank 0's calls); experts migrated: "
              f"{sum(len(rec['hecate']['moved']) for it in plans for rec in it)}")
    print("overlap degree t (T_nonMoE·bw/s_e): " + ", ".join(
        f"{n} {r.plans[-1][0]['hecate']['t']} ({r.plans[-1][0]['hecate'].get('t_quotient') or 0:.2f})"
        for n, r in runs.items() if n.startswith("Hecate")))
    cats = ("params", "grads", "optim", "activations", "total")
    print(f"\n{'memory peak MB (max over ranks, iterations)':44s}" + "".join(f"{c:>12s}" for c in cats)
          + f" {'total / EP':>10s} {'at rank, iter':>14s} {'states / EP':>11s}")
    peak = {}
    for n, r in runs.items():
        mem = r.memory
        peak[n] = [float(mem[f"mem_{c}_peak_bytes"].max()) for c in cats]
        at = mem.loc[mem.mem_total_peak_bytes.idxmax()]
        print(f"{n:44s}" + "".join(f"{v / 1e6:12.3f}" for v in peak[n])
              + f" {peak[n][-1] / peak['EP'][-1]:10.2f} {int(at['rank']):>8d}, {int(at['iter']):<5d}"
              + f" {sum(peak[n][:3]) / sum(peak['EP'][:3]):11.2f}")
    print("states: model states, params + grads + optim (each at its peak), the paper's memory comparison; the total "
          "adds the activations, which follow the busiest device's tokens")
    flexmoe_tuned(runs, peak, t)
    dev = {n: max_device_tokens(r.plans[a.warmup:], a.nproc, a.nproc // a.nodes) for n, r in runs.items()
           if n == "EP" or n.startswith("Hecate")}
    print("tokens the busiest device computes per MoE layer over EP's (median over iterations; each call's counts "
          "routed through its holders by the dispatcher's rule, exact): "
          + ", ".join(f"{n} {v / dev['EP']:.2f}" for n, v in dev.items()))
    moe = {n: (real_moe_s(r, a.warmup), sim_moe_s(sm, c, a.warmup), sim_moe_s(sp, c, a.warmup))
           for (n, c), r, sm, sp in zip(named, reals, sims, sims_pool)}
    print(f"\n{'MoE layers alone (ms/iter)':30s} {'real':>8s} {'sim':>8s} {'speedup real':>12s} {'sim':>6s} "
          f"{'cores pooled':>12s}")
    for n, (mr, ms, mp) in moe.items():
        print(f"{n:30s} {1e3 * mr:8.1f} {1e3 * ms:8.1f} {moe['EP'][0] / mr:12.2f} {moe['EP'][1] / ms:6.2f} "
              f"{moe['EP'][2] / mp:12.2f}"
              + ("  (no token exchange to bound the layer: not measured)" if np.isnan(mr) else ""))
    print("spAG exposed / total (rank 0, the wait before dispatch over issue-to-done): " + ", ".join(
        "{} {:.2f} ({:.1f} of {:.1f} ms)".format(n, *spag_exposed(r, a.warmup)) for n, r in runs.items()
        if n.startswith("Hecate") and n != "Hecate sharding only"))
    if "Hecate-RM" in runs:
        rm_line(f"{a.layers} layers", peak, t)
    print(f"\nsimulated bytes == measured bytes: {comp.metrics['bytes_exact']} ({comp.metrics['bytes_cells']} cells); "
          f"median prediction error {comp.metrics['median_rel_err']:.0%}")
    if a.rm_layers and "Hecate-RM" in runs:
        rm_at_depth(named, a)
    return 0


def flexmoe_tuned(runs: dict, peak: dict, t) -> None:
    """The paper hand-tuned FlexMoE's reserved memory: the fastest FlexMoE run (``--only "FlexMoE r=4" ...``)
    and whether the paper's memory order FlexMoE > Hecate > EP (model states) holds at it."""
    flex = [n for n in runs if n.startswith("FlexMoE")]
    if not flex:
        return
    best = min(flex, key=lambda n: t.loc[n].real_s)
    states = {n: sum(peak[n][:3]) for n in ("EP", "Hecate", best)}
    order = states[best] > states["Hecate"] > states["EP"]
    print(f"FlexMoE tuned over its reserved slots ({', '.join(flex)}): fastest {best}, "
          f"{t.loc['EP'].real_s / t.loc[best].real_s:.2f}x over EP; model states FlexMoE / Hecate "
          f"{states[best] / states['Hecate']:.2f}, Hecate / EP {states['Hecate'] / states['EP']:.2f}: the order "
          f"FlexMoE > Hecate > EP {'holds' if order else 'does NOT hold'} there")


def rm_line(label: str, peak: dict, t) -> None:
    """Hecate-RM against Hecate: replica params at the iteration peak (params over EP's), iteration time."""
    rep = {n: peak[n][0] - peak["EP"][0] for n in ("Hecate", "Hecate-RM")}
    print(f"Hecate-RM, {label}: replica params at the peak {1e-6 * rep['Hecate-RM']:.3f} vs Hecate "
          f"{1e-6 * rep['Hecate']:.3f} MB "
          f"({1 - rep['Hecate-RM'] / rep['Hecate'] if rep['Hecate'] > 0 else float('nan'):.0%}"
          f" lower), iteration {t.loc['Hecate-RM'].real_s / t.loc['Hecate'].real_s:.2f}x Hecate's")


def rm_at_depth(named, a) -> None:
    """RM frees every layer's replicas but the last one's (spec §6.5), so at most (L - 1) / L of them can go: at
    the default 2 layers half. EP, Hecate and Hecate-RM again at ``--rm-layers``, same options otherwise."""
    from moelab.measure.validate import validate

    deep = [(n, c.with_overrides({"model.n_layers": a.rm_layers}).validate()) for n, c in named
            if n in ("EP", "Hecate", "Hecate-RM")]
    print(f"\n# RM at depth: EP, Hecate and Hecate-RM with {a.rm_layers} layers (one more spawn, same options)")
    comp, reals, _ = validate(deep, warmup=a.warmup, timeout=a.timeout, warn=False)
    peak = {n: [float(r.memory["mem_params_peak_bytes"].max())] for (n, _), r in zip(deep, reals)}
    rm_line(f"{a.rm_layers} layers", peak, timed_medians(comp))


PAPER_R = 100  # the paper's re-sharding interval (spec §2.5)


def timed_medians(comp, skip=()):
    """Per system, the median real and simulated iteration time over the timed iterations not in ``skip``."""
    it = comp.iters[~comp.iters.warmup & ~comp.iters["iter"].isin(skip)]
    return it.groupby("config", sort=False)[["real_s", "sim_s"]].median()


def steady_state(comp, runs: dict, warmup: int, comp_pool=None) -> None:
    """The table above times a re-shard every ``max(2, warmup)`` iterations, in the timed window; the paper
    re-shards every 100. Print the same medians over the timed iterations in which no system re-sharded,
    and each sharding system's migration time per re-shard (slowest rank) spread over 100 iterations;
    ``comp_pool``: the prediction with the cores pooled, beside."""
    resh = {it for r in runs.values() for it, recs in enumerate(r.plans) if it >= warmup
            and any(rec.get("hecate", {}).get("moved") for rec in recs)}
    it = comp.iters[~comp.iters.warmup & ~comp.iters["iter"].isin(resh)]
    if not resh or it.empty:
        print(f"\nre-sharding: {'none in the timed iterations' if not resh else 'in every timed iteration'}: "
              "no steady-state table")
        return
    t = timed_medians(comp, resh)
    pool = timed_medians(comp_pool, resh).sim_s if comp_pool is not None else None
    print(f"\nsteady state: timed iterations without a re-shard ({sorted(set(it['iter']))}; re-shards at "
          f"{sorted(resh)}), medians; '+R={PAPER_R}': plus the run's migration time per re-shard / {PAPER_R}")
    print(f"{'system':30s} {'iter ms real':>12s} {'sim':>8s} {'speedup real':>12s} {'sim':>6s} "
          f"{'+R=' + str(PAPER_R) + ' real':>12s} {'speedup':>7s}"
          + ("  sim, cores pooled" if pool is not None else ""))
    ep = t.loc["EP"]
    for name, row in t.iterrows():
        c = runs[name].comm
        mig = c[c.phase == "migrate"]
        per = (mig.t_end - mig.t_start).groupby([mig.iter, mig["rank"]]).sum().groupby(level=0).max()
        amort = row.real_s + (float(per.mean()) / PAPER_R if len(per) else 0.0)
        print(f"{name:30s} {1e3 * row.real_s:12.1f} {1e3 * row.sim_s:8.1f} {ep.real_s / row.real_s:12.2f} "
              f"{ep.sim_s / row.sim_s:6.2f} {1e3 * amort:12.1f} {ep.real_s / amort:7.2f}"
              + (f"  {pool['EP'] / pool[name]:18.2f}" if pool is not None else ""))


def spag_exposed(run, warmup: int) -> tuple:
    """Rank 0's spAG: (exposed / total, exposed ms, total ms); exposed = the wait before dispatch its plans
    record, total = the gathers' issue-to-done time."""
    c = run.comm
    spag = c[(c.phase == "spag") & (c.iter >= warmup) & (c["rank"] == 0)]
    exposed = sum(r["hecate"].get("spag_exposed_s", 0.0) for it in run.plans[warmup:] for r in it)
    total = float((spag.t_end - spag.t_start).sum())
    return (exposed / total if total else float("nan")), 1e3 * exposed, 1e3 * total


def max_device_tokens(plans, N: int, G: int) -> float:
    """Median over iterations of the mean over layers of the busiest device's tokens: each layer call's recorded
    counts routed through its recorded holders by Hecate's dispatcher rule (``call_device_load``, exact)."""
    from moelab.papers.hecate.real import call_device_load

    return float(np.median([np.mean([int(call_device_load(rec, N, G).max()) for rec in it]) for it in plans]))


def real_moe_s(run, warmup: int) -> float:
    """Median over iterations of the slowest rank's MoE-layer time, summed over layers: forward from the gate's
    start to the layer's last forward token exchange (the exposed gather in between), backward from its first to
    its last backward token exchange (the experts' backward in between); token exchanges: the layer's calls
    tagged fwd / bwd (all-to-alls, or a system's point-to-point exchanges). NaN without any."""
    c = run.comm[run.comm.phase.isin(["fwd", "bwd"]) & (run.comm.iter >= warmup) & (run.comm.layer >= 0)]
    if c.empty:
        return float("nan")
    g = run.spans[(run.spans.name == "gate") & (run.spans.iter >= warmup)]
    key = ["rank", "iter", "layer"]
    fwd = c[c.phase == "fwd"].groupby(key).t_end.max() - g.groupby(key).t_start.min()
    b = c[c.phase == "bwd"].groupby(key)
    per = fwd.add(b.t_end.max() - b.t_start.min(), fill_value=0.0)
    return float(per.groupby(["rank", "iter"]).sum().groupby("iter").max().median())


def sim_moe_s(sim, cfg, warmup: int) -> float:
    """The simulator's MoE-layer time (critical path, :func:`moelab.papers.hecate.end_to_end.layer_times`),
    summed over layers, median over the iterations after ``warmup``."""
    from moelab.papers.hecate.end_to_end import layer_times
    from moelab.sim.graphs import moe_layer_ids

    ids = moe_layer_ids(cfg.model)
    return float(np.median([layer_times(r, ids).sum() for r in sim.results[warmup:]]))


if __name__ == "__main__":
    sys.exit(main())
