"""Hecate's REAL products (Figs. 1r, 4, 5, 6, 8, 9r, 11r, 12r, 13r, 15ar), Fig. 1's simulated timeline, the motivation
(M1-M3) and the sweeps beside them (Figs. 9t, 14): registered functions, ids as in
``experiments/hecate/manifest.yaml``."""
from __future__ import annotations

from moelab.models.params import paper_model
from moelab.papers.kit.compare import paper_value
from moelab.papers.kit.registry import Made, Quantity, product
from moelab.sim.engine import simulate
from moelab.sim.graphs import iteration_graph

from . import end_to_end as EE
from . import figures as F
from . import motivation as M
from . import real
from .baselines import FLEXMOE
from .common import BASELINES, RM_UP_TO, P, X
from .memory import max_replicas, state_bytes
from .paper_scale import paper_config, paper_loads, paper_profile
from .trace import real_trace, upsample


# ---- REAL (Figs. 1, 4, 5, 6, 8) ---------------------------------------------------------------------------------
@product(P, "fig4", needs_real=True, quantities={"fsdp_over_hecate": Quantity(
    "bytes of an FSDP of the layer over Hecate's spAG + spRS bytes", X)})
def fig4(ctx):
    df = real.fig4_bytes(ctx.scale.name)
    df["fsdp_over_hecate"] = df.fsdp / df.hecate_sparse.where(df.hecate_sparse > 0)
    notes = [] if (df.hecate_sparse > 0).any() else [
        "no replica was materialized in these iterations: spAG/spRS moved 0 bytes"]
    return Made(df, tables={"table_fig04_bytes": (df, "Fig. 4: bytes per MoE layer and iteration")},
                figures={"fig04_bytes": F.bytes_per_layer(df, label=df.attrs["label"])}, notes=notes)


@product(P, "fig5", needs_real=True)
def fig5(ctx):
    ev = real.event_order(ctx.scale.name)
    ev["row"] = "rank " + ev["rank"].astype(str) + " " + ev["kind"]
    return Made(ev, tables={"table_fig05_events": (ev, "Fig. 5: one iteration's events (REAL)")},
                figures={"fig05_events": F.gantt(ev, label=ev.attrs["label"],
                                                 title="Fig. 5: FSSDP workflow of one iteration "
                                                       "(spAG beside attention, spRS after backward)")})


@product(P, "fig1r", needs_real=True)
def fig1r(ctx):
    """Fig. 1's two timelines on the REAL runs: one iteration of EP and of Hecate on the same gloo ranks and data."""
    import pandas as pd

    frames = []
    for system in ("EP", "Hecate"):
        ev = real.event_order(ctx.scale.name, system=system)
        ev["row"] = system + " rank " + ev["rank"].astype(str) + " " + ev["kind"]
        frames.append(ev.assign(system=system))
    df = pd.concat(frames, ignore_index=True)
    span = df.groupby("system").end_ms.max()
    df.attrs["label"] = frames[1].attrs["label"].replace("; iteration", "; EP and Hecate, iteration")
    return Made(df, tables={"table_fig01r_events": (df, "Fig. 1 (REAL): one iteration of EP and of Hecate")},
                notes=["iteration span (first event to last, ms): "
                       + ", ".join(f"{k} {v:.1f}" for k, v in span.items()),
                       "attention spans are recorded by Hecate's pre-hooks only: "
                       "in EP's rows it is the gap before each gate"],
                figures={"fig01r_events": F.gantt(df, label=df.attrs["label"],
                                                  title="Fig. 1 (REAL): one iteration of EP and of FSSDP, every rank")})


@product(P, "fig6", needs_real=True)
def fig6(ctx):
    df = real.fig6_buffers()
    return Made(df, tables={"table_fig06_chunks": (df, "Fig. 6: chunk values per device")},
                figures={"fig06_chunks": F.chunk_grid(df, label=df.attrs["label"])})


@product(P, "fig8", needs_real=True)
def fig8(ctx):
    df = real.fig8_sharding(ctx.scale.name)
    s = real.max_over_mean(df)
    return Made(s, tables={"table_fig08_sharding": (df, "Fig. 8: experts and load per device and layer"),
                           "table_fig08_balance": (s, "Fig. 8: max/mean device load per layer")},
                figures={"fig08_sharding": F.sharding_bars(df, label=df.attrs["label"])})


@product(P, "fig11r", needs_real=True)
def fig11r(ctx):
    """Fig. 11's device load on the REAL runs: max / mean tokens per device per MoE layer call."""
    df = real.device_loads(ctx.scale.name)
    s = df.groupby("system", sort=False).max_over_mean.median()
    notes = ["median max / mean tokens per device: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items())]
    return Made(df, tables={"table_fig11r_load": (df, "Fig. 11 (REAL): device load per MoE layer call")}, notes=notes,
                figures={"fig11r_load": F.device_load(df, label=df.attrs["label"])})


@product(P, "fig12r", needs_real=True)
def fig12r(ctx):
    """Fig. 12's byte breakdown on the REAL runs: bytes per iteration by phase, every system."""
    df = real.bytes_by_phase(ctx.scale.name)
    return Made(df, tables={"table_fig12r_bytes": (df, "Fig. 12 (REAL): bytes per iteration by phase")},
                figures={"fig12r_bytes": F.phase_bytes(df, label=df.attrs["label"])})


@product(P, "fig15ar", needs_real=True)
def fig15ar(ctx):
    """Fig. 15a's ablation on the REAL runs (their plans timed by the simulator, as Fig. 9's small run)."""
    df = real.ablation_real(ctx.scale.name)
    idle = [r.system for r in df.itertuples() if r.system != "EP" and not r.policy_fired]
    notes = [f"no plan change in these iterations (the policy did not fire): {idle}"] if idle else []
    notes.append("REAL, this CPU's wall clock of the same runs, speedup over EP: " + ", ".join(
        f"{r.system} {r.real_speedup_vs_ep:.2f}x" for r in df.itertuples() if r.system != "EP"))
    return Made(df, tables={"table_fig15ar_ablation": (df, "Fig. 15a (REAL plans): ablation priced on cluster A")},
                notes=notes,
                figures={"fig15ar_ablation": F.speedup_bars(df, label=df.attrs["label"], facet="gpus",
                                                            title="Fig. 15a (small): REAL plans of the ablation, "
                                                                  "timed by the simulator on cluster A")})


@product(P, "fig13r", needs_real=True, quantities={
    "flexmoe_over_hecate": Quantity("peak memory (params + grads + optimizer) of FlexMoE over Hecate", X),
    "hecate_params_over_ep": Quantity("parameter memory of Hecate over EP", X),
    "hecate_total_over_ep": Quantity("peak memory (params + grads + optimizer) of Hecate over EP", X)})
def fig13r(ctx):
    """Fig. 13's exact accounting on the REAL runs (fp32 storages), beside the SIMULATED paper-scale ``fig13``."""
    df = real.fig13_real(ctx.scale.name)
    s = df.set_index("system").total_MB
    df["flexmoe_over_hecate"] = s["FlexMoE"] / s["Hecate"]
    df["hecate_params_over_ep"] = df.set_index("system").param_over_ep["Hecate"]
    df["hecate_total_over_ep"] = s["Hecate"] / s["EP"]
    order = "holds" if s["FlexMoE"] > s["Hecate"] > s["EP"] else "does NOT hold"
    notes = [f"trend check, the paper's order FlexMoE > Hecate > EP in model states {order} here (FlexMoE / Hecate "
             f"{s['FlexMoE'] / s['Hecate']:.2f}, Hecate / EP {s['Hecate'] / s['EP']:.2f})"]
    return Made(df, tables={"table_fig13r_memory": (df, "Fig. 13 (REAL): peak model-state memory per rank")},
                notes=notes,
                figures={"fig13r_memory": F.memory_bars(df, label=df.attrs["label"], unit="MB",
                                                        title="Fig. 13 (REAL): model-state memory per rank "
                                                              "at the iteration peak")})


@product(P, "fig1")
def fig1(ctx):
    """SIMULATED timelines of one GPT-MoE-S iteration (2 layers) on cluster A, EP vs Hecate, rank 0."""
    import pandas as pd

    prof = paper_profile("hecate_A", 16)
    loads = paper_loads(ctx.scale.name, "GPT-MoE-S", "hecate_A", 16, ctx.seed, layers=2)
    cfg = paper_config("GPT-MoE-S", prof, layers=2)
    frames = []
    for system in ("EP", "Hecate"):
        scfg, plans, _ = EE.system_plans(system, cfg, prof, loads)
        it = len(loads) - 1
        tl = simulate(iteration_graph(scfg, prof, loads[it], None, elem_bytes=2, **plans[it])).timeline()
        tl = tl[tl["rank"] == 0]
        frames.append(pd.DataFrame(dict(row=system + " " + tl.stream, what=tl.category, start_ms=1e3 * tl.start,
                                        end_ms=1e3 * tl.end)))
    df = pd.concat(frames, ignore_index=True)
    df.attrs["label"] = ("SIMULATED: hecate_A profile, 16 GPUs, GPT-MoE-S (2 layers), rank 0, "
                         "last replayed iteration of "
                         "the REAL trace upsampled; Hecate t from the paper's rule (end_to_end.t_derivation), "
                         "m = E (memory does not bind)")
    return Made(df, tables={"table_fig01_timeline": (df, "Fig. 1: simulated timeline rows")},
                figures={"fig01_timeline": F.gantt(df, label=df.attrs["label"],
                                                   title="Fig. 1: one iteration, EP vs FSSDP (simulated, rank 0)")})


# ---- motivation (M1-M3) -----------------------------------------------------------------------------------------
@product(P, "m1", quantities={"slowdown": Quantity("EP iteration time under imbalanced over balanced loads", X)})
def m1(ctx):
    df = M.m1(ctx.scale.name, ctx.seed)
    fit = M.m1_fit(ctx.scale.name, ctx.seed)
    best = fit.max_slowdown.max()
    paper = paper_value(P, "m1_imbalance_slowdown")
    notes = [f"M1 fit: over efficiency x latency the largest EP slowdown the model reaches is {best:.2f}x; "
             f"{'it reaches' if best >= paper else 'it cannot reach'} the paper's {paper:g}x, so no constant is fitted "
             "to it (profile constants stay as sourced)"]
    return Made(df, tables={"table_m1_imbalance": (df, "M1: EP imbalanced vs balanced"),
                            "table_m1_fit": (fit, "M1: the fit's scan")}, notes=notes,
                figures={"m1_imbalance": F.speedup_bars(df.assign(system="EP imbalanced / balanced", gpus=16),
                                                        label=df.attrs["label"], y="slowdown",
                                                        title="M1: EP slowdown under imbalanced loads",
                                                        y_title="imbalanced / balanced iteration time")})


@product(P, "m2", quantities={"speedup": ("r", {6: Quantity("FlexMoE speedup reached with 4x reserved memory", X)})})
def m2(ctx):
    df = M.m2(ctx.scale.name, ctx.seed)
    fig = F.memory_speedup(df, label=df.attrs["label"])
    return Made(df, tables={"table_m2_flexmoe": (df, "M2: FlexMoE speedup vs reserved memory")},
                figures={"m2_flexmoe": fig},
                notes=[f"r={r.r}: {r.note}" for r in df.itertuples()])


BATCHES = (1, 2, 4, 6, 8)  # spec §6.11: sequences per GPU


@product(P, "fig14", quantities={"rm_over_hecate": Quantity("iteration time of Hecate-RM over Hecate", X),
                                 "rm_vs_worst": RM_UP_TO})
def fig14(ctx):
    """Throughput vs batch with OOM cut-offs: per system and batch the simulated iteration (GPT-MoE-S, cluster B)
    and the per-device memory = model states (:mod:`.memory`, replicas from that batch's replayed plans) +
    the simulator's activation peak; a point over the GPU's memory is an OOM (no throughput)."""
    import numpy as np
    import pandas as pd

    sp = ctx.scale
    prof = paper_profile("hecate_B", 32)
    m = paper_model("GPT-MoE-S")
    m.moe.num_experts = 64
    base = paper_loads(sp.name, "GPT-MoE-S", "hecate_B", 32, ctx.seed)
    L = base.shape[1]
    scale_L = m.n_layers / L  # activations of the simulated layers, scaled to the model's depth
    rows = []
    for b in BATCHES:
        tr = real_trace(sp.name, experts=64)[:len(base)]
        loads = upsample(tr[:, [l % tr.shape[1] for l in range(L)]], 32, b * m.seq_len, seed=ctx.seed)
        cfg = paper_config("GPT-MoE-S", prof, layers=L, batch=b)
        for system in ("EP", "FasterMoE", "FlexMoE", "Hecate", "Hecate-RM"):
            scfg, plans, _ = EE.system_plans(system, cfg, prof, loads)
            res = [simulate(iteration_graph(scfg, prof, loads[i], None, elem_bytes=2, **plans[i]))
                   for i in range(1, len(loads))]
            t = float(np.mean([r.makespan for r in res]))
            act = max(float(r.peak_memory().get("activations", 0.0).max()) for r in res) * scale_L
            kw = {"replicas": max_replicas(plans[1:], 32)} if system.startswith("Hecate") else {}
            if system == "Hecate-RM":
                kw["live_layers"] = 2
            if system == "FlexMoE":
                kw["extra_slots"] = FLEXMOE["r"]
            mem = (state_bytes(m, 32, 64, **kw)["total"] + act) / 1e9
            oom = mem > prof.mem_GB
            rows.append(dict(system=system, batch=b, iter_ms=1e3 * t, memory_GB=mem, oom=oom,
                             tokens_per_s=np.nan if oom else b * m.seq_len * 32 / t))
    df = pd.DataFrame(rows)
    h = df[df.system == "Hecate"].set_index("batch").iter_ms
    df["rm_over_hecate"] = df.batch.map(df[df.system == "Hecate-RM"].set_index("batch").iter_ms / h)
    df.loc[df.system != "Hecate-RM", "rm_over_hecate"] = np.nan
    # the introduction's "up to ...x with RM" (rm_speedup_up_to): per batch Hecate-RM's throughput over the slowest
    # baseline that fits
    # there (FasterMoE, FlexMoE; no speedup where either runs out of memory)
    tput = df.pivot(index="batch", columns="system", values="tokens_per_s")
    worst = tput[[s for s in BASELINES if s in tput]].min(axis=1)
    df["rm_vs_worst"] = df.batch.map(tput["Hecate-RM"] / worst)
    df.loc[df.system != "Hecate-RM", "rm_vs_worst"] = np.nan
    df.attrs["label"] = (f"SIMULATED: hecate_B profile, 32 GPUs ({prof.mem_GB:g} GB each), GPT-MoE-S ({L} simulated "
                         f"layers, activations scaled to {m.n_layers}); "
                         "model states analytic (fp16 + 12 B/param optimizer); "
                         "loads = REAL tiny-model trace upsampled per batch")
    return Made(df, tables={"table_fig14_batch": (df, "Fig. 14: throughput and memory vs batch")},
                figures={"fig14_batch": F.throughput_batch(df, label=df.attrs["label"])},
                notes=[f"OOM: {sorted(set(df[df.oom].system + ' @' + df[df.oom].batch.astype(str)))}"])


@product(P, "fig9r", needs_real=True)
def fig9r(ctx):
    df = real.fig9_real(ctx.scale.name)
    idle = [r.system for r in df.itertuples() if r.system != "EP" and r.system != "FSDP" and not r.policy_fired]
    notes = [f"no plan change in these iterations (the policy did not fire): {idle}"] if idle else []
    return Made(df, notes=notes,
                tables={"table_fig09r_real_plans": (df, "Fig. 9 (small): REAL plans priced on cluster A")},
                figures={"fig09r_real_plans": F.speedup_bars(df, label=df.attrs["label"], facet="gpus",
                                                             title="Fig. 9 (small): REAL plans of every system, "
                                                                   "timed by the simulator on cluster A")})


T_SWEEP = (0, 1, 2, 4, 8)


@product(P, "fig9t")
def fig9t(ctx):
    """How the guessed overlap degree moves Fig. 9/10 (t = m): Hecate's speedup over EP for each t on both
    clusters (GPT-MoE-S and BERT-MoE), the formula's own t marked."""
    import pandas as pd

    rows = []
    for cluster, gpus in (("hecate_A", 16), ("hecate_B", 32)):
        prof = paper_profile(cluster, gpus)
        for model in ("GPT-MoE-S", "BERT-MoE"):
            loads = paper_loads(ctx.scale.name, model, cluster, gpus, ctx.seed)
            cfg = paper_config(model, prof, layers=loads.shape[1])
            ep = EE.simulate_system(cfg, prof, loads, [{}] * len(loads)).iter_s.mean()
            formula = EE.overlap_degree(cfg, prof)
            for t in T_SWEEP:
                scfg, plans, note = EE.system_plans("Hecate", cfg, prof, loads, t=t, m=t, calibration=False)
                h = EE.simulate_system(scfg, prof, loads, plans).iter_s.mean()
                rows.append(dict(cluster=cluster, gpus=gpus, model=model, t=t, t_formula=formula, speedup_vs_ep=ep / h))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("SIMULATED: hecate_A (16 GPUs) and hecate_B (32 GPUs), batch 1, REAL trace upsampled; "
                         "t = m swept, "
                         "calibration off (Alg. 1's plans alone)")
    fig = F.t_sweep(df, label=df.attrs["label"])
    return Made(df, tables={"table_fig09t_t_sweep": (df, "Hecate speedup over EP vs the overlap degree t")},
                figures={"fig09t_t_sweep": fig})


@product(P, "m3", quantities={
    "best_interval": Quantity("best SmartMoE re-arrangement interval", "iterations"),
    "iter_gain_10_vs_25": Quantity(
        "per-iteration time saved by SmartMoE at interval 10 over 25 (non-rearranging iterations)", "fraction"),
    "total_loss_10_vs_25": Quantity("total time added by SmartMoE at interval 10 over 25", "fraction")})
def m3(ctx):
    df = M.m3(ctx.scale.name, ctx.seed)
    return Made(df, tables={"table_m3_smartmoe": (df, "M3: SmartMoE interval")},
                figures={"m3_smartmoe": F.interval_bars(df.assign(speedup=df.total_s.min() / df.total_s),
                                                        label=df.attrs["label"],
                                                        title="M3: SmartMoE total time relative to the best interval")},
                notes=[f"K={r.interval}: {r.note}" for r in df.itertuples()]
                + ([] if df.replacements.sum()
                   else ["no re-placement was applied at any K: SmartMoE's policy did not fire "
                         f"({df.reason.iloc[0]})"]))
