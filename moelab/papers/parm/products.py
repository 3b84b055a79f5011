"""Parm's products: one registered function per figure or table moelab makes of the paper (ids as in
``experiments/parm/manifest.yaml``); the notebook calls ``Session.show(id)`` once per product."""
from __future__ import annotations

import pandas as pd

from moelab.papers.kit.registry import Made, Quantity, product

from . import figures as F
from . import frames, paper_scale
from .common import paper, scale_spec  # noqa: F401 - scale_spec: the Session's scale lookup

P = "parm"
LAYER_SPEEDUP = "mean MoE-layer speedup over the DeepSpeed-MoE baseline over a cell's configurations"
Q = {s: Quantity(f"{LAYER_SPEEDUP} ({n})", "x") for s, n in (("s1", "S1"), ("s2", "S2"), ("parm", "Parm"))}
SHARE = Quantity("communication share of the baseline MoE layer's time", "fraction")
ITER_SPEEDUP = Quantity("training iteration speedup of Parm over DeepSpeed-MoE", "x")


@product(P, "table1")
def table1(ctx):
    df = paper_scale.notation()
    return Made(df, tables={"table1_notation": (df, "Table I: the paper's symbols and moelab's names")})


@product(P, "table2")
def table2(ctx):
    df = paper_scale.testbeds()
    return Made(df, tables={"table2_testbeds": (df, "Table II: testbeds as simulator profiles (each field sourced)")})


@product(P, "table3")
def table3(ctx):
    df = paper_scale.grid_counts(ctx.scale.name)
    notes = [f"{int(df.kept.sum())} of {int(df.configs.sum())} configurations fit in memory over the four settings "
             f"(the paper: {paper('valid_configs'):.0f} valid; P7: its exact set cannot be rebuilt)"]
    return Made(df, tables={"table3_grid": (df, "Table III: configurations per setting, kept by the memory filter")},
                notes=notes)


@product(P, "fig1", quantities={"comm_share": SHARE})
def fig1(ctx):
    df = paper_scale.fig1_share(ctx.scale.name)
    notes = [f"baseline communication share {df.comm_share.min():.1%} - {df.comm_share.max():.1%} over {len(df)} "
             f"configurations (paper: {paper('comm_share_min'):.2%} - {paper('comm_share_max'):.2%} over "
             f"{paper('fig1_configs'):.0f})"]
    return Made(df, figures={"fig01_share_sim": F.sorted_share(df, label=df.attrs["label"])},
                tables={"table_fig01_share": (df, "Fig. 1: per configuration, baseline comm share")}, notes=notes)


@product(P, "fig1r", needs_real=True)
def fig1r(ctx):
    df = frames.fig1_real_share(ctx.scale.name, ctx.seed)
    return Made(df, figures={"fig01r_share_real": F.sorted_share(df, label=df.attrs["label"],
                                                                 title="Fig. 1 analog: baseline comm share, "
                                                                       "8 gloo ranks")},
                tables={"table_fig01r": (df, "Fig. 1 analog: baseline comm share per cell")})


@product(P, "fig2")
def fig2(ctx):
    df = frames.layout_frame()
    return Made(df, figures={"fig02_layout": F.layout_diagram(df, label=df.attrs["label"])},
                tables={"table_fig02_layout": (df, "Fig. 2: every rank's groups and expert shard")})


def _timelines(ctx, world, cell, stem, what):
    df = frames.timeline(world, ctx.scale.name, cell, ctx.seed)
    calls = df[df.kind == "comm"].groupby("schedule").size().to_dict()
    notes = [f"{what}: collective calls per rank per schedule (fwd+bwd): "
             + ", ".join(f"{k} {v // world}" for k, v in calls.items())]
    return Made(df, figures={stem: F.timelines(df, label=df.attrs["label"])},
                tables={f"table_{stem}": (df, f"{what}: every op of every rank")}, notes=notes)


@product(P, "fig3", needs_real=True)
def fig3(ctx):
    return _timelines(ctx, 4, (2, 2), "fig03_timelines_p4", "Fig. 3 at P=4, (N_MP, N_ESP)=(2,2)")


@product(P, "fig3p8", needs_real=True)
def fig3p8(ctx):
    return _timelines(ctx, 8, (4, 4), "fig03_timelines_p8", "Fig. 3 at P=8, (N_MP, N_ESP)=(4,4)")


@product(P, "fig4", needs_real=True)
def fig4(ctx):
    figs, frames_ = {}, []
    for cell in ((1, 2), (2, 2)):
        df = frames.byte_matrices(4, ctx.scale.name, cell, seed=ctx.seed)
        df.insert(0, "cell", str(cell))
        frames_.append(df)
        figs[f"fig04_bytes_mp{cell[0]}"] = F.byte_matrices(df, label=df.attrs["label"],
                                                           title="Fig. 4: src -> dst bytes per forward call, "
                                                                 f"N_MP={cell[0]}, N_ESP=2")
    out = pd.concat(frames_, ignore_index=True)
    out.attrs["label"] = frames_[0].attrs["label"].replace("(1, 2)", "(1, 2) and (2, 2)")
    return Made(out, figures=figs, tables={"table_fig04_bytes": (out, "Fig. 4: bytes per (call, src, dst)")})


@product(P, "fig5", needs_real=True)
def fig5(ctx):
    tr = frames.saa_trace(ctx.scale.name, ctx.seed)
    ph = frames.saa_phase_table()
    n = int((tr.kind == "saa phase").sum())
    return Made(ph, figures={"fig05_saa_trace": F.saa_phases(tr, label=tr.attrs["label"])},
                tables={"table_fig05_phases": (ph, "Fig. 5: what each phase moves, per rank"),
                        "table_fig05_trace": (tr, "Fig. 5: measured SAA phase spans")},
                notes=[f"{n} SAA phase spans recorded over 4 ranks (forward and backward SAA: 2 x 4 phases per rank)"])


@product(P, "fig6", needs_real=True)
def fig6(ctx):
    df, fits = paper_scale.fig6_frame(ctx.scale.name, ctx.seed)
    return Made(fits, figures={"fig06_fits": F.fits(df, label=df.attrs["label"])},
                tables={"table_fig06_fits": (fits, "Fig. 6: alpha-beta fits (alpha s, beta s per element, R^2) "
                                                   "per source"),
                        "table_fig06_points": (df, "Fig. 6: measured points and fitted / paper / simulated curves")})


@product(P, "table4", quantities={f"{s}_speedup": Q[s] for s in Q})
def table4(ctx):
    df = paper_scale.table4(ctx.scale.name)
    notes = [f"{r.dispatcher} {r.setting} ({r.n_mp},{r.n_esp}): "
             f"Parm {r.parm_speedup:.2f}x (S1 {r.s1_speedup:.2f}, S2 {r.s2_speedup:.2f}, "
             f"oracle {r.oracle_speedup:.2f}), Alg. 1 right in {r.selection_accuracy:.0%} of {int(r.configs)}"
             + (" - Parm trails the better fixed schedule here"
                if r.parm_speedup < max(r.s1_speedup, r.s2_speedup) - 1e-9
                else "") for r in df.itertuples()]
    return Made(df, figures={"table4_speedups": F.speedup_bars(df, label=df.attrs["label"],
                                                               by=("dispatcher", "setting", "n_mp", "n_esp"),
                                                               cols=("s1_speedup", "s2_speedup", "parm_speedup",
                                                                     "oracle_speedup"))},
                tables={"table4": (df, "Table IV: mean speedup over the baseline per setting and cell")}, notes=notes)


@product(P, "table4e", needs_real=True, quantities={"parm_speedup": Q["parm"]})
def table4e(ctx):
    df = frames.table4_emulated(ctx.scale.name, ctx.seed)
    right = int(df.auto_right.sum())
    notes = [f"auto picked the measured better of S1/S2 in {right} of {len(df)} cells"]
    return Made(df, figures={"table4e_speedups": F.speedup_bars(df, label=df.attrs["label"])},
                tables={"table4e": (df, "Table IV analog: per cell, median layer time and speedups")}, notes=notes)


VIC = {"parm_speedup_min_config": Quantity("smallest per-configuration MoE-layer speedup of Parm over the "
                                           "DeepSpeed-MoE baseline", "x"),
       "parm_cell_mean_max": Quantity("largest cell-mean MoE-layer speedup of Parm over the DeepSpeed-MoE "
                                      "baseline", "x"),
       "parm_over_worse": Quantity("mean time of the worse of S1/S2 divided by Parm's (Alg. 1's pick)", "x"),
       "saa_over_aas": Quantity("mean S2-AAS time divided by S2 (SAA) time", "x")}


@product(P, "vic", quantities={"value": ("metric", VIC)})
def vic(ctx):
    df = paper_scale.vic(ctx.scale.name)
    sw = paper_scale.saa_sweep(ctx.scale.name)
    lo, hi = sw.aas_over_saa.min(), sw.aas_over_saa.max()
    big = sw[sw.x_elems == sw.x_elems.max()]
    notes = [df.attrs.get("note", ""),
             f"SAA alone vs all-to-all then all-gather (table_vic_saa_sweep): (a2a + AG) / SAA {lo:.2f} - {hi:.2f} "
             f"over 2^12 - 2^24 elements (paper: {paper('saa_over_aas'):g}x at the layer); at the largest size "
             f"{big.aas_over_saa.min():.2f} - {big.aas_over_saa.max():.2f}. SAA, as the paper's kernel runs it, pays "
             "one call and P serial rounds against the all-to-all's one call and the all-gather's N_MP - 1 ring steps, "
             "saves bytes only where its halves use different links (the all-to-all on the NICs: 32 GPUs), and "
             "forwards raw chunks: with N_ESP > 1 its gather moves N_ESP x AAS's (experiments/parm/README.md)"]
    return Made(df, tables={"table_vic": (df, "Sec. VI-C: ranges and ratios, SIMULATED over the filtered grid"),
                            "table_vic_saa_sweep": (sw, "SAA vs all-to-all then all-gather over message sizes, "
                                                        "SIMULATED alone on parm_A / parm_B, beside the paper's "
                                                        "claim")},
                notes=notes)


@product(P, "fig7", quantities={"parm_speedup": Quantity("mean MoE-layer speedup of Parm over the DeepSpeed-MoE "
                                                         "baseline", "x"),
                                "above_4x": Quantity("fraction of configurations where Parm is more than 4x faster "
                                                     "than the baseline", "fraction")})
def fig7(ctx):
    df = paper_scale.fig7(ctx.scale.name)
    notes = [f"mean {df.parm_speedup.mean():.2f}x, {df.above_4x.mean():.0%} of {len(df)} configurations above 4x "
             f"(paper: {paper('b32_44_mean'):.2f}x, {paper('b32_44_above4'):.0%})"]
    return Made(df, figures={"fig07_distribution": F.speedup_distribution(df, label=df.attrs["label"])},
                tables={"table_fig07": (df, "Fig. 7: per configuration, B-32 (4,4)")}, notes=notes)


@product(P, "fig7e", needs_real=True)
def fig7e(ctx):
    df = frames.fig7_emulated(ctx.scale.name, ctx.seed)
    return Made(df, figures={"fig07e_distribution": F.speedup_distribution(df, label=df.attrs["label"],
                                                                           title="Fig. 7 analog: Parm's speedup, "
                                                                                 "8 ranks (4,4)")},
                tables={"table_fig07e": (df, "Fig. 7 analog: per configuration")})


@product(P, "table5", needs_real=True, quantities={"speedup": ITER_SPEEDUP})
def table5(ctx):
    df = paper_scale.table5_real_frame(ctx.scale.name, ctx.seed)
    return Made(df, figures={"fig_table5_real": F.iteration_bars(df[df.system != "speedup"],
                                                                 label=df.attrs["label"])},
                tables={"table5_real": (df, "Table V analog: tiny models on 8 gloo ranks")})


@product(P, "table5s", quantities={"speedup": ITER_SPEEDUP})
def table5s(ctx):
    df = paper_scale.table5_sim(ctx.scale.name)
    return Made(df, figures={"fig_table5_sim": F.iteration_bars(df.rename(columns={"testbed": "setup"}).melt(
        id_vars=["model", "setup"], value_vars=["baseline_ms", "parm_ms"], var_name="system", value_name="iter_ms"),
        label=df.attrs["label"])}, tables={"table5_sim": (df, "Table V: full-size models, SIMULATED")})
