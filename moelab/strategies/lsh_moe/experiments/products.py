"""LSH-MoE's products: one registered function per figure or table moelab makes of the paper (ids as in
``experiments/lsh_moe/manifest.yaml``); the notebook calls ``Session.show(id)`` once per product."""
from __future__ import annotations

from moelab.repro.registry import Made, Quantity, product

from . import figures as F
from . import quality, rates
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
                 f.attrs["rho"]["untrained"], f.attrs["rho"]["random"]) else "is NOT specific to the trained model here")]
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
                figures={"fig07m_rate_vs_L": F.rate_vs_L(df, label=df.attrs["label"]),
                         "fig07m_rate_vs_group": F.rate_vs_group(gs, label=gs.attrs["label"])},
                tables={"table_fig07m_rates": (df, "Fig. 7 (middle): compression rate per source, family, r and L"),
                        "table_fig07m_group_size": (gs, "Compression rate vs group size (CP L=6, r=2)")},
                notes=notes)


@product(P, "ec_error", needs_real=True)
def ec_error(ctx):
    df = rates.ec_error(ctx.scale.name, seed=ctx.seed)
    worse = df[df.err_ec > df.err_noec]
    notes = [f"EC raises the error at {len(worse)} of {len(df)} L values (spec §2.6: exact only for experts with Jacobian I)"]
    return Made(df, figures={"fig_ec_error": F.ec_error(df, label=df.attrs["label"])},
                tables={"table_ec_error": (df, "Compression error with and without residual compensation")}, notes=notes)


PPL_GAP = Quantity("validation perplexity of LSH-MoE without error compensation minus with it, at equal time", "ppl")
TIME_TO_PPL = Quantity("time-to-target-perplexity speedup of LSH-MoE over the uncompressed model", "x")


@product(P, "fig6l", needs_real=True, quantities={"time_speedup_to_target": ("variant", {"LSH-MoE": TIME_TO_PPL}),
                                                 "ppl_gap_noec_equal_time": ("variant", {"LSH-MoE w/o EC": PPL_GAP})})
def fig6l(ctx):
    df = quality.convergence(ctx.scale.name)
    s = quality.summary(df)
    label = df.attrs["label"]
    notes = [f"target = Origin's final smoothed perplexity {s.attrs['target_ppl']:.2f}"]
    for r in s.itertuples():
        notes.append(f"{r.variant}: final ppl {r.final_ppl:.2f} ({r.ppl_vs_origin:+.2f} vs Origin), measured rho {r.rho:.3f}, "
                     f"step {r.step_s * 1e3:.0f} ms ({r.step_speedup:.2f}x Origin's), "
                     + (f"target reached after {r.iters_to_target} iterations" if r.reached else "target NOT reached"))
    return Made(s, figures={"fig06l_ppl_vs_time": F.convergence(df, label=label),
                            "fig06l_ppl_vs_iter": F.convergence(df, label=label, x="iter", x_title="iteration",
                                                                title="Fig. 6 (left): validation perplexity vs iteration")},
                tables={"table_fig06l_summary": (s, "Fig. 6 (left): per variant, perplexity, rho, step time, time to target"),
                        "table_fig06l_curves": (df, "Fig. 6 (left): every run's iterations")}, notes=notes)
