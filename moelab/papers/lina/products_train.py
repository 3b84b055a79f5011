"""Lina's training products (Figs. 1, 2, 4, 5, 7, 8, 10-15, Tables 1, 3, 4): one registered function per
figure or table, ids as in ``experiments/lina/manifest.yaml``."""
from __future__ import annotations

import pandas as pd

from moelab.papers.kit.compare import load_numbers
from moelab.papers.kit.registry import Made, Quantity, product

from . import contention, frames, paper_scale
from . import figures as F
from . import layer_views as LV
from .common import P, fired, paper
from .gpu import gpu_timings
from .runs import DEPARTURE_NOTE, partition_runs, policy_runs

STEP = Quantity("training step speedup over DeepSpeed-MoE-style DDP overlap (ddp_overlap)", "x")
BWD = Quantity("backward all-to-all time speedup over ddp_overlap", "x")
SHARE = Quantity("all-to-all share of the training step (baseline)", "fraction")
A2A_MS = Quantity("baseline training all-to-all time per step", "ms")


@product(P, "fig1r", needs_real=True)
def fig1r(ctx):
    routing, tl, counts = LV.dp_ep_frames(ctx.scale.name, ctx.seed)
    per = {ph: " or ".join(str(n) for n in sorted(set(counts[ph]))) for ph in ("fwd", "bwd")}
    moved = routing[routing.moves].tokens.sum() / max(1, routing.tokens.sum())
    notes = [f"all-to-all calls per MoE layer, every rank (counted from the records): forward {per['fwd']}, "
             f"backward {per['bwd']} (the paper's Fig. 1(b): two per layer each way)",
             f"{moved:.0%} of the layer's routed tokens leave their rank in the dispatch and come back in the combine"]
    return Made(counts, figures={"fig01r_layer": F.routing_sankey(routing, label=routing.attrs["label"],
                                                                  title="Fig. 1(a) redrawn: one MoE layer's routing, "
                                                                        "rank to expert to rank"),
                                 "fig01r_dp_ep": F.timeline(tl, label=tl.attrs["label"],
                                                            title="Fig. 1(b) redrawn: DP + EP, one training step, "
                                                                  "every rank")},
                tables={"table_fig01r_routing": (routing, "Fig. 1(a): tokens per (source rank, expert)"),
                        "table_fig01r_calls": (counts, "Fig. 1(b): all-to-all calls per (rank, MoE layer, pass)"),
                        "table_fig01r_timeline": (tl, "Fig. 1(b): every op of the step")}, notes=notes)


PAPER_MODELS = ("txl", "gpt2", "bert2gpt2")  # the paper's three training models, as paper.yaml keys name them


def _table1_share_range() -> str:
    """Table 1's all-to-all shares (training and inference, every model at 4 and 16 GPUs), lowest to highest."""
    v = [e["value"] for k, e in load_numbers(P).items() if k.startswith(("train_a2a_share_", "infer_a2a_share_"))]
    return f"{100 * min(v):.0f}-{100 * max(v):.0f} %"


def _moe_layer_paper(util: bool = True) -> str:
    """Figs. 11/12's MoE-layer numbers, as the paper gives them (2 and 8 experts; utilization at 16)."""
    return (f"paper: forward {paper('moe_fwd_E2'):.2f}x / {paper('moe_fwd_E8'):.2f}x, backward "
            f"{paper('moe_bwd_E2'):.2f}x / {paper('moe_bwd_E8'):.2f}x at 2 / 8 experts"
            + (f"; MoE-layer GPU utilization +>={100 * paper('moe_util_gain_E16'):.0f} % at 16" if util else ""))


@product(P, "fig4e", needs_real=True,
         quantities={"slowdown": Quantity("backward all-to-all slowdown under overlap", "x")})
def fig4e(ctx):
    df = frames.bwd_a2a_slowdown(ctx.scale.name, ctx.seed)
    med = df.groupby("policy").slowdown.median()
    notes = ["median backward all-to-all slowdown vs the same call with nothing overlapping it (after_backward): "
             + ", ".join(f"{k} {v:.2f}x" for k, v in med.items())
             + f" (paper: median > {paper('bwd_a2a_slowdown_median'):.2f}x, max {paper('bwd_a2a_slowdown_max'):.2f}x)"]
    value = df.groupby("policy").slowdown.agg(["median", "max"]).reset_index()
    value.attrs["label"] = df.attrs["label"]
    return Made(value, figures={"fig04e_slowdown_cdf": F.cdf({k: g.slowdown for k, g in df.groupby("policy")},
                                                             label=df.attrs["label"], xtitle="slowdown (x)",
                                                             title="Fig. 4 analog: backward all-to-all slowdown")},
                tables={"table_fig04e": (value, "Fig. 4 analog: backward all-to-all slowdown per policy")}, notes=notes)


@product(P, "fig4s", quantities={"slowdown": Quantity("backward all-to-all slowdown under overlapping all-reduce, "
                                                       "over the same op alone", "x")})
def fig4s(ctx):
    fit = paper_scale.fitted_gamma()
    parts = []
    for name, g in (("fitted", None), ("1 (fair sharing)", 1.0)):
        d = paper_scale.a2a_slowdown(ctx.scale.name, g)
        parts.append(d.assign(gamma=name, gamma_value=d.gamma))
    df = pd.concat(parts, ignore_index=True)
    df.attrs["label"] = parts[0].attrs["label"]
    over = df[df.overlapped]
    stats = over.groupby("gamma").slowdown.agg(["count", "median", "max"])
    table = stats.reset_index()
    table.attrs["label"] = df.attrs["label"]
    models, experts = paper_scale.PAPER_GRID
    notes = [f"gamma = {fit['gamma']:.3g} is FITTED (regula falsi over the paper's {len(models)} models x E = "
             f"{min(experts)}..{max(experts)}, "
             f"{fit['overlapped_ops']} overlapped backward all-to-alls) to the paper's median slowdown "
             f"{fit['target_median']:.2f}x: a fit, not a result"
             + ("" if fit["reached"] else " — the fit did NOT reach it"),
             "Fig. 4's population: backward all-to-alls of ddp_overlap during which an all-reduce runs; this scale: "
             + ", ".join(f"gamma {k}: {int(r['count'])} ops, median {r['median']:.2f}x, max {r['max']:.2f}x"
                         for k, r in stats.iterrows())
             + f" (the max is a check, not fitted; paper {paper('bwd_a2a_slowdown_max'):.2f}x over "
               f"{paper('bwd_a2a_slowdown_ops'):,.0f} ops)"]
    if over.empty:
        notes.append("no backward all-to-all overlaps an all-reduce at this scale: the CDF is empty")
    cont = contention.baseline_contention()
    notes += contention.notes(cont)
    return Made(df, figures={"fig04s_slowdown_cdf": F.cdf({f"gamma {k}": g.slowdown for k, g in over.groupby("gamma")},
                                                          label=df.attrs["label"], xtitle="slowdown (x)",
                                                          title="Fig. 4: backward all-to-all slowdown "
                                                                "under all-reduce")},
                tables={"table_fig04s": (table, "Fig. 4: slowdown of overlapped backward all-to-alls"),
                        "table_fig04s_contention": (cont, "Figs. 2 and 4: the baseline's contention per paper "
                                                          "configuration, beside the paper's numbers")},
                notes=notes)


@product(P, "fig5e", needs_real=True)
def fig5e(ctx):
    out = {}
    tables = {}
    for pol in ("ddp_overlap", "lina"):
        df = frames.backward_timeline(ctx.scale.name, pol, ctx.seed)
        out[f"fig05e_timeline_{pol}"] = F.timeline(df, label=df.attrs["label"],
                                                   title=f"Fig. 5 analog: all-to-all and all-reduce, {pol}")
        tables[f"table_fig05e_{pol}"] = (df, f"Fig. 5 analog: call intervals, {pol}")
    return Made(None, figures=out, tables=tables)


@product(P, "fig14e", needs_real=True, quantities={"step_speedup": STEP, "bwd_a2a_speedup": BWD, "a2a_share": SHARE})
def fig14e(ctx):
    df = policy_runs(ctx.scale.name, ctx.seed)["summary"]
    notes = [f"a2a share of the ddp_overlap step: {df.set_index('policy').a2a_share['ddp_overlap']:.1%} "
             f"(the paper's Table 1: {_table1_share_range()})", DEPARTURE_NOTE]
    return Made(df, figures={"fig14e_ablation": F.bars(df, "policy", "step_speedup", label=df.attrs["label"], line=1.0,
                                                       title="Fig. 14 analog: step speedup over ddp_overlap "
                                                             "(lina_coalesce departs from the spec)"),
                             "fig13e_bwd_a2a": F.bars(df, "policy", "bwd_a2a_speedup", label=df.attrs["label"],
                                                      line=1.0, title="Fig. 13 analog: backward all-to-all speedup "
                                                      "(lina_coalesce departs from the spec)")},
                tables={"table_fig14e": (df, "Figs. 13/14 analog: every policy on 4 ranks")}, notes=notes)


@product(P, "fig14s", quantities={"step_speedup": STEP, "bwd_a2a_speedup": BWD, "a2a_share_baseline": SHARE})
def fig14s(ctx):
    df = paper_scale.training(ctx.scale.name)
    df["model"] = [f"{n}L" for n in df.layers]
    df["case"] = [f"{m} E={e}" for m, e in zip(df.model, df.experts)]
    return Made(df, figures={"fig14s_ablation": F.bars(df, "case", "step_speedup", color="policy",
                                                       label=df.attrs["label"], line=1.0,
                                                       title="Figs. 10/14: step speedup over ddp_overlap"),
                             "fig13s_bwd_a2a": F.bars(df, "case", "bwd_a2a_speedup", color="policy",
                                                      label=df.attrs["label"], line=1.0,
                                                      title="Fig. 13: backward all-to-all speedup")},
                tables={"table_fig14s": (df, "Figs. 10, 13, 14 and Table 1 (share): every policy, model and E")},
                notes=["all-reduce micro-ops are priced as NCCL's: the faster of the ring and halving-doubling "
                       "(2 log2 n step latencies), as NCCL's tuner picks its tree for small messages"])


@product(P, "fig10t", quantities={"step_speedup_vs_tutel": Quantity(
    "training step speedup over Tutel (tutel_like: ddp_overlap with hierarchical all-to-alls)", "x")})
def fig10t(ctx):
    df = _cases(paper_scale.training(ctx.scale.name))
    df = df[df.policy.isin(["ddp_overlap", "lina", "lina_full"])][
        ["case", "layers", "experts", "policy", "step_s", "step_speedup",
         "step_speedup_vs_tutel"]].reset_index(drop=True)
    df.attrs["label"] = ("SUBSTITUTE of Tutel (spec §3: the baseline with Tutel's 2D hierarchical all-to-all, its fast "
                         "kernels not modelled); " + paper_scale.sim_label())
    full = df[df.policy == "lina_full"]
    notes = ["lina_full over tutel_like "
             f"{full.step_speedup_vs_tutel.min():.2f}-{full.step_speedup_vs_tutel.max():.2f}x, "
             f"over ddp_overlap {full.step_speedup.min():.2f}-{full.step_speedup.max():.2f}x (paper, Fig. 10: the "
             "speedup over Tutel is 'slightly smaller' than over DeepSpeed)"]
    return Made(df, figures={"fig10t_over_tutel": F.bars(df, "case", "step_speedup_vs_tutel", color="policy",
                                                         label=df.attrs["label"], line=1.0,
                                                         title="Fig. 10: step speedup over Tutel (substitute)")},
                tables={"table_fig10t": (df, "Fig. 10: step speedups over Tutel (substitute) and DeepSpeed-style DDP")},
                notes=notes)


MOE_FWD = Quantity("MoE-layer forward time speedup over ddp_overlap", "x")
MOE_BWD = Quantity("MoE-layer backward time speedup over ddp_overlap", "x")
BUSY_GAIN = Quantity("compute-busy fraction (GPU utilization stand-in), lina_full minus ddp_overlap", "fraction")
PIPE = Quantity("pipelining efficiency: compute-busy fraction inside the all-to-alls", "fraction")
PIPE_GAIN = Quantity("pipelining efficiency with packing over without (best q)", "x")
MEM_RATIO = Quantity("peak memory per GPU, lina_full over ddp_overlap", "x")


def _cases(df):
    df["case"] = [f"{n}L E={e}" for n, e in zip(df.layers, df.experts)]
    return df


@product(P, "fig11_12s", quantities={"moe_fwd_speedup": MOE_FWD, "moe_bwd_speedup": MOE_BWD})
def fig11_12s(ctx):
    df = _cases(paper_scale.training(ctx.scale.name))
    df = df[["case", "layers", "experts", "policy", "moe_fwd_s", "moe_bwd_s", "moe_fwd_speedup", "moe_bwd_speedup",
             "moe_compute_busy"]].reset_index(drop=True)
    df.attrs["label"] = paper_scale.sim_label()
    full = df[df.policy == "lina_full"]
    notes = [f"lina_full MoE layers: forward {full.moe_fwd_speedup.min():.2f}-{full.moe_fwd_speedup.max():.2f}x, "
             f"backward {full.moe_bwd_speedup.min():.2f}-{full.moe_bwd_speedup.max():.2f}x over ddp_overlap "
             f"({_moe_layer_paper()})"]
    figs = {f"fig{n}s_moe_{ph}": F.bars(df, "case", f"moe_{ph}_speedup", color="policy", label=df.attrs["label"],
                                        line=1.0,
                                        title=f"Fig. {n}: MoE-layer {name} time speedup over ddp_overlap")
            for n, ph, name in ((11, "fwd", "forward"), (12, "bwd", "backward"))}
    figs["fig12s_moe_busy"] = F.bars(df, "case", "moe_compute_busy", color="policy", label=df.attrs["label"],
                                     title="Fig. 12: compute-busy fraction of the MoE layers "
                                           "(GPU utilization stand-in)")
    return Made(df, figures=figs, tables={"table_fig11_12s": (df, "Figs. 11/12: MoE-layer time per pass and "
                                                                  "compute-busy fraction")}, notes=notes)


@product(P, "fig11_12e", needs_real=True, quantities={"moe_fwd_speedup": MOE_FWD, "moe_bwd_speedup": MOE_BWD})
def fig11_12e(ctx):
    df = LV.layer_times(ctx.scale.name, ctx.seed)
    full = df.set_index("policy").loc["lina_full"]
    notes = [f"lina_full MoE layers over ddp_overlap: forward {full.moe_fwd_speedup:.2f}x, backward "
             f"{full.moe_bwd_speedup:.2f}x ({_moe_layer_paper(util=False)}); "
             "a layer's forward runs from its gate to its combine's finish, its backward over its backward all-to-alls"]
    figs = {f"fig{n}e_moe_{ph}": F.bars(df, "policy", f"moe_{ph}_speedup", label=df.attrs["label"], line=1.0,
                                        title=f"Fig. {n} analog: MoE-layer {name} time speedup over ddp_overlap")
            for n, ph, name in ((11, "fwd", "forward"), (12, "bwd", "backward"))}
    return Made(df, figures=figs, tables={"table_fig11_12e": (df, "Figs. 11/12 analog: MoE-layer time per pass")},
                notes=notes)


@product(P, "table3s", quantities={"pipelining_eff": PIPE, "pipe_gain": PIPE_GAIN})
def table3s(ctx):
    df = paper_scale.packing(ctx.scale.name)
    df = df[["layers", "experts", "experts_per_gpu", "step_s", "pipelining_eff"]].reset_index(drop=True)
    rows = []
    for layers, g in df.groupby("layers"):
        base = g[g.experts_per_gpu == 1].pipelining_eff.iloc[0]
        best = g.loc[g.pipelining_eff.idxmax()]
        rows.append({"layers": layers, "experts": int(best.experts), "without_packing": base,
                     "with_packing": best.pipelining_eff, "best_q": int(best.experts_per_gpu),
                     "pipe_gain": best.pipelining_eff / base if base > 0 else float("nan")})
    out = pd.DataFrame(rows)
    out.attrs["label"] = df.attrs["label"]
    notes = [] if (df.pipelining_eff > 0).any() else ["pipelining did not fire: no compute inside any all-to-all"]
    notes.append("paper: " + ", ".join(
        f"{100 * paper(f'pipe_eff_without_{m}'):.0f} -> {100 * paper(f'pipe_eff_with_{m}'):.0f} % "
        f"(q = {paper(f'pipe_best_q_{m}'):.0f})" for m in PAPER_MODELS)
        + f", on average {paper('pipelining_gain'):.2f}x")
    return Made(out, figures={"table3s_pipelining": F.bars(df, "experts_per_gpu", "pipelining_eff", color="layers",
                                                           label=df.attrs["label"],
                                                           title="Table 3: pipelining efficiency vs experts per GPU")},
                tables={"table3s_packing": (out, "Table 3: pipelining efficiency without and with packing"),
                        "table3s_sweep": (df, "Table 3: every q")}, notes=notes)


@product(P, "table4s", quantities={"busy_gain": BUSY_GAIN, "mem_ratio": MEM_RATIO})
def table4s(ctx):
    df = _cases(paper_scale.training(ctx.scale.name))
    df = df[df.experts == df.experts.max()]
    piv = df.pivot(index="layers", columns="policy", values=["compute_busy", "peak_mem_GB"])
    out = pd.DataFrame({"layers": piv.index, "experts": int(df.experts.max()),
                        "busy_baseline": piv["compute_busy"]["ddp_overlap"].values,
                        "busy_lina_full": piv["compute_busy"]["lina_full"].values,
                        "mem_GB_baseline": piv["peak_mem_GB"]["ddp_overlap"].values,
                        "mem_GB_lina_full": piv["peak_mem_GB"]["lina_full"].values})
    out["busy_gain"] = out.busy_lina_full - out.busy_baseline
    out["mem_ratio"] = out.mem_GB_lina_full / out.mem_GB_baseline
    out.attrs["label"] = paper_scale.sim_label() + "; memory: the simulator's static + activation estimate"
    return Made(out, tables={"table4s_util_mem": (out, "Table 4: compute-busy fraction and peak memory, ddp_overlap "
                                                       "vs lina_full")},
                notes=["paper (16 experts): GPU utilization " + ", ".join(
                    f"{100 * paper(f'gpu_util_baseline_{m}'):.1f} -> {100 * paper(f'gpu_util_lina_{m}'):.1f}"
                    for m in PAPER_MODELS) + f" % (+{100 * paper('utilization_gain'):.1f} % on average); peak memory "
                    f"+{100 * (paper('memory_ratio') - 1):.1f} % for BERT2GPT2, the others offload to DRAM "
                    "(not modelled)"])


@product(P, "table1e", needs_real=True, quantities={"a2a_share": SHARE})
def table1e(ctx):
    df = frames.a2a_share(ctx.scale.name, ctx.seed)
    return Made(df, tables={"table1e_a2a_share": (df, "Table 1 analog: all-to-all share of the step on 4 ranks")},
                notes=[f"paper (Table 1): {_table1_share_range()} of the step, {100 * paper('a2a_share'):.1f} % on "
                       "average, on its 16-GPU testbed"])


@product(P, "table3e", needs_real=True, quantities={"pipelining_eff": PIPE, "pipe_gain": PIPE_GAIN})
def table3e(ctx):
    df = frames.pipelining_efficiency(ctx.scale.name, ctx.seed)
    eff = df.set_index("policy").pipelining_eff
    df["pipe_gain"] = float(eff["lina_full"] / eff["lina_pipe"]) if eff["lina_pipe"] > 0 else float("nan")
    notes = [] if (df.pipelining_eff > 0).any() else [
        "pipelining did not fire: no expert compute inside any all-to-all"]
    return Made(df, tables={"table3e_pipelining": (df, "Table 3 analog: pipelining efficiency without (q = 1) and "
                                                       "with packing (q = 2) on 4 ranks")}, notes=notes)


@product(P, "table4e", needs_real=True, quantities={"busy_gain": BUSY_GAIN, "mem_ratio": MEM_RATIO})
def table4e(ctx):
    df = frames.busy_and_memory(ctx.scale.name, ctx.seed)
    return Made(df, tables={"table4e_busy_memory": (df, "Table 4 analog: compute-busy fraction (CPU time of the "
                                                        "step) and peak memory, ddp_overlap vs lina_full; no offload")})


@product(P, "fig2s", quantities={"a2a_share": Quantity("all-to-all share of one MoE layer's forward (ddp_overlap)",
                                                       "fraction")})
def fig2s(ctx):
    df = paper_scale.layer_timeline(ctx.scale.name, "ddp_overlap", "fwd")
    a = df.attrs
    value = pd.DataFrame([{"layers": a["layers"], "experts": a["experts"], "layer": a["layer"],
                           "layer_fwd_s": a["span_s"], "a2a_share": a["a2a_share"]}])
    value.attrs["label"] = a["label"]
    return Made(value, figures={"fig02s_layer_fwd": F.timeline(df, label=a["label"],
                                                               title="Fig. 2: one MoE layer's forward on rank 0")},
                tables={"table_fig02s": (df, "Fig. 2: rank 0's ops in the layer's forward")},
                notes=[f"all-to-all share of the MoE layer's forward: {a['a2a_share']:.1%} "
                       f"(paper: {100 * paper('layer_a2a_share'):.1f} %)"])


@product(P, "fig2e", needs_real=True)
def fig2e(ctx):
    df = LV.policy_layer_pass(ctx.scale.name, "ddp_overlap", "fwd", ctx.seed)
    a = df.attrs
    value = pd.DataFrame([{"layer": a["layer"], "layer_fwd_s": a["span_s"], "a2a_share": a["a2a_share"]}])
    value.attrs["label"] = a["label"]
    return Made(value, figures={"fig02e_layer_fwd": F.timeline(df, label=a["label"],
                                                               title="Fig. 2 analog: one MoE layer's forward "
                                                                     "on rank 0")},
                tables={"table_fig02e": (df, "Fig. 2 analog: rank 0's ops in the layer's forward")},
                notes=[f"all-to-all share of the MoE layer's forward (gate to combine): {a['a2a_share']:.1%} "
                       f"(paper: {100 * paper('layer_a2a_share'):.1f} %)"])


def _layer_backwards(ctx, fig: int, policies, busiest: bool, real: bool) -> tuple:
    """One MoE layer's backward on rank 0 under each policy, SIMULATED at paper scale or (``real``) EMULATED from
    the policy runs: a timeline each, and a row each of what ran."""
    figs, rows = {}, []
    for pol in policies:
        df = (LV.policy_layer_pass(ctx.scale.name, pol, "bwd", ctx.seed, busiest) if real
              else paper_scale.layer_timeline(ctx.scale.name, pol, "bwd", busiest))
        figs[f"fig{fig:02d}{'e' if real else 's'}_{pol}"] = F.timeline(
            df, label=df.attrs["label"], title=f"Fig. {fig}{' analog' if real else ''}: one MoE layer's backward on "
                                               f"rank 0, {pol}")
        rows.append({"policy": pol, "layer": df.attrs["layer"], "layer_bwd_s": df.attrs["span_s"],
                     "a2a_share": df.attrs["a2a_share"],
                     **({"allreduce_beside_s": df.attrs["allreduce_s"]} if real else {}),
                     "allreduce_ops": int((df.name == "allreduce").sum()), "a2a_calls": int((df.name == "a2a").sum()),
                     **({} if real else {"expert_chunks": int((df.name == "expert").sum())})})
    value = pd.DataFrame(rows)
    value.attrs["label"] = df.attrs["runs_label"] if real else paper_scale.sim_label()
    return value, figs


SCHEDULES = {7: (("ddp_overlap", "priority", "fixed"), True, "one MoE layer's backward per schedule",
                  ["(a) baseline = ddp_overlap, (b) naive priority = priority, (c) deferred all-reduce = fixed; "
                   "(d) the "
                   "oracle's gap placement is not a moelab policy and is not drawn; "
                   "each policy's layer is the one whose "
                   "backward overlaps the most all-reduce on rank 0"], "an all-reduce during a MoE layer's backward"),
             8: (("lina", "lina_pipe"), False, "what runs in one MoE layer's backward", [],
                 "overlap of all-reduce micro-ops with the layer's backward")}


def _schedules(ctx, fig: int, real: bool) -> Made:
    """Figs. 7 and 8: one MoE layer's backward per policy, SIMULATED at paper scale or EMULATED (``real``)."""
    policies, busiest, what, notes, fire = SCHEDULES[fig]
    value, figs = _layer_backwards(ctx, fig, policies, busiest, real)
    name = f"Fig. {fig}" + (" analog" if real else "")
    return Made(value, figures=figs, tables={f"table_fig{fig:02d}{'e' if real else 's'}": (value, f"{name}: {what}")},
                notes=notes + fired(value, "allreduce_ops", fire))


@product(P, "fig7s")
def fig7s(ctx):
    return _schedules(ctx, 7, real=False)


@product(P, "fig8s")
def fig8s(ctx):
    return _schedules(ctx, 8, real=False)


@product(P, "fig7e", needs_real=True)
def fig7e(ctx):
    return _schedules(ctx, 7, real=True)


@product(P, "fig8e", needs_real=True)
def fig8e(ctx):
    return _schedules(ctx, 8, real=True)


@product(P, "table1s", quantities={"a2a_share_baseline": SHARE, "a2a_ms": A2A_MS})
def table1s(ctx):
    df = paper_scale.training(ctx.scale.name)
    df = df[df.policy == "ddp_overlap"][["layers", "experts", "step_s", "a2a_s", "a2a_share_baseline",
                                         "a2a_bytes_per_gpu"]].reset_index(drop=True)
    df["a2a_ms"] = 1e3 * df.a2a_s
    df.attrs["label"] = paper_scale.sim_label()
    c = paper_scale.calibration()
    fit = pd.DataFrame([{"constant": k, "fitted": c[k], "start": c["start"][k], "target": v,
                         "paper": c["targets"][v], "calibrated_model": c["reached"][v]}
                        for k, v in paper_scale.CALIBRATION_TARGETS.items()])
    fit.attrs["label"] = ("SIMULATED on lina: the profile's FITTED constants (a fit, not a result), Table 1's 12-layer "
                          "numbers they are fitted to and what the calibrated model gives; every other Table 1 number "
                          "is a check")
    return Made(df, tables={"table1s_a2a_share": (df, "Table 1 / Fig. 3: all-to-all time and share of the step"),
                            "table1s_calibration": (fit, "Table 1: the calibration of the lina profile")},
                notes=[f"calibrated to Table 1's 12-layer row: {c['batch_per_gpu']} sequences per GPU (start "
                       f"{c['start']['batch_per_gpu']}), intra-node {c['intra_bw_GBps']:.3g} GB/s per GPU (start "
                       f"{c['start']['intra_bw_GBps']:g}), {c['achieved_flops'] / 1e12:.3g} TFLOP/s achieved (start "
                       f"{c['start']['achieved_flops'] / 1e12:.3g}); the other rows are predictions"])


@product(P, "fig15s")
def fig15s(ctx):
    df = paper_scale.partition_sweep(ctx.scale.name)
    df["model"] = [f"{n}L" for n in df.layers]
    return Made(df, figures={"fig15s_partition": F.lines(df, "partition_MB", "step_s", color="model",
                                                         label=df.attrs["label"],
                                                         title="Fig. 15: step time vs micro-op size (16 experts)")},
                tables={"table_fig15s": (df, "Fig. 15: step time vs partition size")})


@product(P, "fig15e", needs_real=True)
def fig15e(ctx):
    df = partition_runs(ctx.scale.name, ctx.seed)
    best = df.loc[df.step_s.idxmin()]
    notes = [f"lina's step vs the micro-op size S on 4 ranks (S scaled with the model): fastest at "
             f"{int(best.partition_bytes)} B ({best.S_factor:g} x the scale's S, "
             f"{int(best.micro_ops)} micro-ops a step); "
             + ", ".join(f"{r.S_factor:g} x S: {1e3 * r.step_s:.0f} ms, {r.micro_ops} micro-ops"
                         for r in df.itertuples())
             + f" (paper: > {paper('partition_slow_above_MB'):g} MB slower than "
               f"{paper_scale.assumed('partition_MB'):g} MB, < {paper('partition_costly_below_MB'):g} MB costly, "
               "several optima)"]
    whole = df[df.micro_ops == df.micro_ops.min()]
    if len(whole) > 1:
        notes.append(f"from {int(whole.partition_bytes.min())} B on every gradient is one micro-op "
                     f"({int(whole.micro_ops.min())} "
                     "a step): the larger sizes run the same schedule, their steps differ by the host's noise only")
    return Made(df, figures={"fig15e_partition": F.lines(df, "partition_bytes", "step_s", label=df.attrs["label"],
                                                         title="Fig. 15 analog: lina's step time vs micro-op size")},
                tables={"table_fig15e": (df, "Fig. 15 analog: step time and micro-ops per partition size")},
                notes=notes)


@product(P, "gpu_c", needs_gpu=True)
def gpu_c(ctx):
    a = paper_scale.assumed
    df = gpu_timings("cuda", d=a("d_model"), f=a("d_ff"), heads=a("n_heads"), seq=a("seq_len"),
                     partition_MB=a("partition_MB"))
    return Made(df, tables={"table_gpu_c": (df, "§4(c): one GPU's times for Lina's cost model")},
                notes=["reported beside the model, not fed into the lina profile (calibrated to Table 1); "
                       "one GPU cannot "
                       "show the all-to-all / all-reduce contention, which stays EMULATED and SIMULATED"])
