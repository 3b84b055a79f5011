"""LSH-MoE's products: one registered function per figure or table moelab makes of the paper (ids as in
``experiments/lsh_moe/manifest.yaml``); the notebook calls ``Session.show(id)`` once per product."""
from __future__ import annotations

from moelab.papers.kit.compare import paper_value
from moelab.papers.kit.registry import Made, Quantity, product
from moelab.strategies.lsh_moe import analysis

from . import figures as F
from . import finetune, quality, rates, share, speed
from .common import scale_spec  # noqa: F401 - the Session's scale lookup

P = "lsh_moe"
RATE = Quantity("compression rate (centroid rows / token rows) at L=6 hash functions", "fraction")


@product(P, "fig4", needs_real=True, quantities={"rho_L6": ("source", {"trained": RATE})})
def fig4(ctx):
    import pandas as pd

    f = rates.pca(ctx.scale.name, seed=ctx.seed)
    t = pd.DataFrame([dict(source=k, rho_L6=v) for k, v in f.attrs["rho"].items()])
    t.attrs["label"] = f.attrs["label"]
    notes = [f"rho at L=6: trained {f.attrs['rho']['trained']:.3f}, untrained {f.attrs['rho']['untrained']:.3f}, "
             f"random rows {f.attrs['rho']['random']:.3f}: similarity "
             + ("comes with training (the controls compress less)" if f.attrs["rho"]["trained"] < min(
                 f.attrs["rho"]["untrained"], f.attrs["rho"]["random"])
                else "is NOT specific to the trained model here")]
    return Made(t, figures={"fig04_pca": F.pca_scatter(f, label=f.attrs["label"])},
                tables={"table_fig04_rho": (t, "Fig. 4: compression rate of each source at L=6, r=2")}, notes=notes)


@product(P, "fig7m", needs_real=True, quantities={"rho": ("L", {6: RATE})})
def fig7m(ctx):
    df = rates.rate_sweep(ctx.scale.name, seed=ctx.seed)
    gs = rates.group_size_sweep(ctx.scale.name, seed=ctx.seed)
    trained = df[(df.source == "trained") & (df.family == "cross_polytope") & (df.r == 2)]
    Lc = rates.calibrated_L(ctx.scale.name, seed=ctx.seed)
    notes = [f"trained tokens, CP r=2: rho {', '.join(f'L={int(r.L)}: {r.rho:.3f}' for r in trained.itertuples())}; "
             f"largest L with rho <= 0.25: {Lc}"]
    return Made(trained[["L", "rho"]].reset_index(drop=True),
                figures={"fig07m_rate_vs_L": F.rate_vs_L(df, label=df.attrs["label"],
                                                         paper_rate=paper_value(P, "rate_at_L6")),
                         "fig07m_rate_vs_group": F.rate_vs_group(gs, label=gs.attrs["label"])},
                tables={"table_fig07m_rates": (df, "Fig. 7 (middle): compression rate per source, family, r and L"),
                        "table_fig07m_group_size": (gs, "Compression rate vs group size (CP L=6, r=2)")},
                notes=notes)


@product(P, "ec_error", needs_real=True)
def ec_error(ctx):
    df = rates.ec_error(ctx.scale.name, seed=ctx.seed)
    worse = df[df.err_ec > df.err_noec]
    notes = [f"EC raises the error at {len(worse)} of {len(df)} L values "
             "(spec §2.6: exact only for experts with Jacobian I)"]
    return Made(df, figures={"fig_ec_error": F.ec_error(df, label=df.attrs["label"])},
                tables={"table_ec_error": (df, "Compression error with and without residual compensation")},
                notes=notes)


PPL_GAP = Quantity("validation perplexity of LSH-MoE without error compensation minus with it, at equal time", "ppl")
TIME_TO_PPL = Quantity("time-to-target-perplexity speedup of LSH-MoE over the uncompressed model", "x")


def _convergence(ctx, task: str, stem: str, panel: str):
    df = quality.convergence(ctx.scale.name, task)
    s = speed.simulated_time(quality.summary(df), task, ctx.scale.name)
    label = df.attrs["label"]
    sim = s.attrs["sim"]
    notes = [f"target = Origin's final smoothed perplexity {s.attrs['target_ppl']:.2f}; time to equal perplexity (the "
             "paper's metric, time_speedup_to_target) = to the level both the variant and Origin reach",
             f"simulated time (sim_* columns, spec §4 Fig. 6 (ii)): the iterations above x one {sim['model']} step on "
             f"{sim['profile']} ({sim['gpus']} GPUs) priced at each variant's measured rho; the iterations are the "
             "substitute's, so this is a trend check, not a paper-scale ratio"]
    ref = s.attrs.get("reference_ppl")
    if ref:
        notes.append(f"reference (dashed): the same model uncompressed on 1 rank, {s.attrs['reference_iters']} "
                     f"iterations of the same global batch (the fine-tuning checkpoint), held-out ppl {ref:.2f}; "
                     "runs ending far above it compare early training only")
    for r in s.itertuples():
        notes.append(f"{r.variant}: final ppl {r.final_ppl:.2f} ({r.ppl_vs_origin:+.2f} vs Origin), "
                     f"measured rho {r.rho:.3f}, step {r.step_s * 1e3:.0f} ms ({r.step_speedup:.2f}x Origin's), "
                     + (f"target reached after {r.iters_to_target} iterations" if r.reached else "target NOT reached")
                     + (f"; to ppl {r.equal_ppl:.2f} in {r.time_to_equal_s:.0f} s "
                        f"against Origin's {r.origin_time_to_equal_s:.0f} s "
                        f"({r.time_speedup_to_target:.2f}x time, {r.iters_speedup_to_target:.2f}x iterations)"
                        if r.variant != "Origin" and r.time_speedup_to_target else "")
                     + (f"; simulated time {r.sim_time_speedup_to_target:.2f}x "
                        f"({r.sim_time_speedup_experts_on_tokens:.2f}x with experts on every token)"
                        if r.variant != "Origin" and r.sim_time_speedup_to_target > 0
                        else ""))
    return Made(s, figures={f"{stem}_ppl_vs_time": F.convergence(df, label=label,
                                                                 title=f"{panel}: validation perplexity "
                                                                       "vs training time"),
                            f"{stem}_ppl_vs_iter": F.convergence(df, label=label, x="iter", x_title="iteration",
                                                                 title=f"{panel}: validation perplexity vs iteration")},
                tables={f"table_{stem}_summary": (s, f"{panel}: per variant, perplexity, rho, step time, "
                                                     "time to target (EMULATED and simulated time)"),
                        f"table_{stem}_curves": (df, f"{panel}: every run's iterations")}, notes=notes)


@product(P, "fig6l", needs_real=True, quantities={"time_speedup_to_target": ("variant", {"LSH-MoE": TIME_TO_PPL}),
                                                 "sim_time_speedup_to_target": ("variant", {"LSH-MoE": TIME_TO_PPL}),
                                                 "ppl_gap_noec_equal_time": ("variant", {"LSH-MoE w/o EC": PPL_GAP})})
def fig6l(ctx):
    return _convergence(ctx, "lm", "fig06l", "Fig. 6 (left)")


@product(P, "fig6r", needs_real=True, quantities={"time_speedup_to_target": ("variant", {"LSH-MoE": TIME_TO_PPL}),
                                                 "sim_time_speedup_to_target": ("variant", {"LSH-MoE": TIME_TO_PPL})})
def fig6r(ctx):
    return _convergence(ctx, "span", "fig06r", "Fig. 6 (right)")


@product(P, "table1")
def table1(ctx):
    t = analysis.table1()
    bad = t[t.moe_matches == False]  # noqa: E712 - a pandas column
    notes = [f"{r.model}: {r.note}" for r in t.itertuples() if r.note]
    notes.insert(0, f"MoE parameters equal to the paper's for {int((t.moe_matches == True).sum())} "  # noqa: E712
                    f"of {t.moe_matches.notna().sum()} "
                    f"counted models; differs for {list(bad.model)}")
    return Made(t, tables={"table1_models": (t, "Table 1: models and parameters (millions)")}, notes=notes)


@product(P, "table4")
def table4(ctx):
    # uncompressed, and the paper's two rates (read from paper.yaml: Fig. 7's ~L=6 rate and Table 3's)
    df = analysis.ratio_curves(rhos=(1.0, paper_value(P, "rate_at_L6"), paper_value(P, "swin_rate")))
    at = df[(df.axis == "w") & (df.k == 2) & (df.rho == 1.0)].set_index("x").ratio
    notes = [f"Eq. 9, k=2, h=768, A100 peak, 200 Gb/s: ratio {at[2]:.2f} at w=2, {at[4]:.2f} at w=4, "
             f"{at[64]:.2f} at w=64 "
             f"((w-1)/w: +50% from 2 to 4 servers, which the paper calls nearly constant, spec §6.12)"]
    return Made(df, figures={"table4_ratio_curves": F.ratio_curves(df, label=df.attrs["label"])},
                tables={"table4_ratio_curves": (df, "Table 4 / Eq. 6-9: all-to-all to compute ratio vs w and h")},
                notes=notes)


SHARE = Quantity("share of the training step spent in all-to-all", "fraction")


@product(P, "fig3", quantities={"share": SHARE})
def fig3(ctx):
    df = share.fig3(ctx.scale.name)
    f = df.attrs["fit"]
    a, b, c = (df[df.setup == s].set_index("model").share for s in ("a", "b", "c"))
    notes = [f"fit: MFU {f['mfu']:.2f} (assumed), eta_n {f['eta']:.3f}, "
             f"rms error over the three (a) bars {f['rmse']:.3f}"
             + (" (at the grid's edge)" if f["at_edge"] else "")
             + (f"; equals the value recorded in assumptions.yaml (eta_n {f['recorded']:.3f}, kind fitted)"
                if f["matches_record"] else
                f"; DIFFERS from the value recorded in assumptions.yaml (eta_n {f['recorded']:.3f}): update it"),
             "prediction (b) 32 GPUs vs (a): " + ", ".join(f"{m} {a[m]:.2f} -> {b[m]:.2f}" for m in a.index),
             "prediction (c) 2x experts vs (a): " + ", ".join(f"{m} {a[m]:.2f} -> {c[m]:.2f}" for m in a.index)]
    return Made(df, figures={"fig03_a2a_share": F.a2a_share_bars(df, label=df.attrs["label"])},
                tables={"table_fig03_share": (df, "Fig. 3: all-to-all share per setup and model")}, notes=notes)


@product(P, "fig3r", needs_real=True)
def fig3r(ctx):
    df = share.measured(ctx.scale.name)
    return Made(df, tables={"table_fig03_measured": (df, "Fig. 3 (here): measured all-to-all share of tiny models")},
                notes=[f"{r.ranks} ranks, {r.links}: share {r.share:.2f}, step {r.step_ms:.0f} ms"
                       for r in df.itertuples()])


SPEEDUP = Quantity("fine-tuning throughput speedup of LSH-MoE over the uncompressed model", "x")
TRAIN_SPEEDUP = Quantity("end-to-end training speedup of LSH-MoE over the uncompressed model", "x")


@product(P, "table2s", quantities={"speedup": SPEEDUP})
def table2s(ctx):
    df = speed.table2_speed(ctx.scale.name)
    notes = [f"{r.model} at rho {r.rho:.3f} ({r.rho_source}; {r.rho_effective:.3f} after each group's bounds): "
             f"{r.speedup:.2f}x with experts on centroids, "
             f"{r.speedup_experts_on_tokens:.2f}x counting the all-to-alls only"
             for r in df.itertuples()]
    return Made(df, tables={"table2_speed": (df, "Table 2, Speed column: GPT-MoE fine-tuning "
                                                 "step speedup on lsh_v100")},
                notes=notes)


@product(P, "table3s", quantities={"speedup": TRAIN_SPEEDUP})
def table3s(ctx):
    df = speed.table3_speed(ctx.scale.name)
    notes = [f"rho {r.rho:.3f} ({r.rho_source}): {r.speedup:.2f}x "
             f"({r.speedup_experts_on_tokens:.2f}x with experts on every token); "
             f"the stand-in's absolute samples/s ({r.samples_per_s_origin:.0f}) is not Swin-MoE-L's: compare ratios"
             for r in df.itertuples()]
    notes += [f"rho {r.rho:.3f}: all-to-all share of the uncompressed step {r.a2a_share_ep:.2f}, Amdahl on the bytes "
              f"alone {r.amdahl_speedup:.2f}x; the paper's speedup_min would need a share of {r.implied_a2a_share:.2f} "
              f"or {r.overhead_needed:.0%} of the uncompressed step added (moelab's hashing: {r.hash_share:.2%})"
              for r in df.itertuples()]
    return Made(df, tables={"table3_speed": (df, "Table 3, samples/s: the Swin-MoE-L stand-in on lsh_a100")},
                notes=notes)


ACC_DELTA = Quantity("absolute accuracy difference between LSH-MoE and the uncompressed model on a fine-tuning task",
                     "points")
TOP1_DELTA = Quantity("Top-1 accuracy of LSH-MoE minus the uncompressed model's", "points")
IMG_RATE = Quantity("compression rate (centroid rows / token rows) in image-classification fine-tuning", "fraction")
CP_VS_SP = Quantity("cross-polytope accuracy at least spherical hashing's at equal compression rate (1 = yes)", "flag")


@product(P, "table2", needs_real=True, quantities={"abs_acc_delta_points": ACC_DELTA})
def table2(ctx):
    df = finetune.table2(ctx.scale.name)
    t = finetune.table2_summary(df)
    t["abs_acc_delta_points"] = t.abs_acc_delta * 100
    notes = []
    for r in t.itertuples():
        at_chance = r.chance is not None and max(r.origin_acc, r.lsh_acc) <= r.chance + 0.05
        notes.append(f"{r.task}: Origin {r.origin_acc:.3f}±{r.origin_std:.3f}, LSH-MoE {r.lsh_acc:.3f}±{r.lsh_std:.3f} "
                     f"(compressed eval {r.lsh_acc_compressed_eval:.3f}), rho {r.lsh_rho:.3f}"
                     + (f"; {r.low_rate_variant} {r.low_rate_acc:.3f} at rho {r.low_rate_rho:.3f}"
                        if r.low_rate_variant else "")
                     + (" — both at chance: this task tells nothing here" if at_chance else ""))
    return Made(t, tables={"table2_accuracy": (t, "Table 2 (substitute): fine-tuning accuracy per task, "
                                                  "Origin vs LSH-MoE"),
                           "table2_runs": (df, "Table 2 (substitute): every fine-tuning run")}, notes=notes)


@product(P, "table3", needs_real=True, quantities={"top1_delta": ("variant", {"LSH-MoE": TOP1_DELTA}),
                                                   "rho": ("variant", {"LSH-MoE": IMG_RATE})})
def table3(ctx):
    df = finetune.table3(ctx.scale.name)
    t = finetune.table3_summary(df)
    notes = [f"{r.variant}: Top-1 {r.top1:.3f}, Top-2 {r.top2:.3f}, rho {r.rho:.3f}, {r.samples_per_s:.0f} samples/s "
             f"({r.throughput_speedup:.2f}x Origin's, EMULATED links)" for r in t.itertuples()]
    return Made(t, tables={"table3_digits": (t, "Table 3 (substitute): digits Top-1/Top-2, rate, EMULATED samples/s"),
                           "table3_runs": (df, "Table 3 (substitute): every run")}, notes=notes)


@product(P, "fig7lr", needs_real=True, quantities={"cp_at_least_sp": CP_VS_SP})
def fig7lr(ctx):
    df = finetune.fig7(ctx.scale.name)
    right = finetune.fig7_right_summary(df)
    left = df[df.panel == "left"].groupby(["variant", "L"], sort=False).agg(acc=("acc", "mean"),
                                                                            rho=("rho", "mean")).reset_index()
    left.attrs["label"] = df.attrs["label"]
    notes = ["left: " + ", ".join(f"{r.variant}: acc {r.acc:.3f} at rho {r.rho:.3f}" for r in left.itertuples())]
    notes += [f"right, target {r.target:.0%}: CP L={r.cp_L} reached rho {r.cp_rho:.3f}, acc {r.cp_acc:.3f}; "
              f"SP L={r.sp_L} reached rho {r.sp_rho:.3f}, acc {r.sp_acc:.3f}" for r in right.itertuples()]
    return Made(right, figures={"fig07l_acc_vs_L": F.acc_vs_L(left, label=df.attrs["label"]),
                                "fig07r_cp_vs_sp": F.cp_vs_sp(right, label=df.attrs["label"])},
                tables={"table_fig07l": (left, "Fig. 7 (left): topic accuracy and measured rho vs L"),
                        "table_fig07r": (right, "Fig. 7 (right): CP vs SP at target rates (achieved rates beside)"),
                        "table_fig07_runs": (df, "Fig. 7: every fine-tuning run")}, notes=notes)
