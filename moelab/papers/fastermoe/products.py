"""FasterMoE's products: one registered function per figure or table moelab makes of the paper
(ids as in ``experiments/fastermoe/manifest.yaml``). Each calls the experiment of its figure family
and the plot builder of :mod:`moelab.papers.fastermoe.figures`; the notebook calls
``Session.show(id)`` once per product."""
from __future__ import annotations

from moelab.papers.fastermoe import figures as F
from moelab.papers.kit.registry import Made, Quantity, product

from . import convergence, end_to_end, popularity, predictor, roofline, schedule, sensitivity, shadowing, suite
from .common import scale_spec, table2_models  # noqa: F401 - scale_spec: the Session's scale lookup

P = "fastermoe"
X = "x"
SPEEDUP_Z3 = Quantity("MoE-layer time speedup of FasterMoE over ZeRO-3", X)
SPEEDUP_Z2 = Quantity("MoE-layer time speedup of FasterMoE over ZeRO-2", X)
SHADOW_FRACTION = Quantity("mean fraction of experts shadowed per iteration")
SHADOW_ONE = Quantity("max MoE-layer speedup of shadowing in iterations with one shadowed expert", X)
SMART_ACHIEVED = Quantity("max per-layer speedup of the smart schedule over FastMoE, achieved", X)
SMART_THEORY = Quantity("max per-layer theoretical speedup of the smart schedule", X)
BREAKDOWN = {v: Quantity(f"MoE-layer speedup over FastMoE of {w}", X)
             for v, w in (("shadow", "shadowing alone"), ("smart", "the smart schedule alone"),
                          ("both", "shadowing + smart schedule"))}


def _label(frame) -> str:
    return frame.attrs["label"]


def _table2_label(t) -> str:
    """Table 2's label, read off its ``*_kind`` columns: SUBSTITUTE (the manifest's class: the write-up drops
    the table, spec §4 rebuilds it from the AE scripts and moelab fills the sizes they do not give), then
    which sizes are the paper's and which are moelab's, then the assumptions' values as the frame has them."""
    cols = [c for c in t.columns if c.endswith("_kind")]
    rows = t.to_dict("records")

    def sizes(kind: str) -> str:
        per = [(r["model"], [c[:-len("_kind")] for c in cols if r[c] == kind]) for r in rows]
        return "; ".join(f"{m} ({', '.join(fs)})" for m, fs in per if fs)

    others = sorted({r[c] for r in rows for c in cols} - {"paper"})
    label = t.attrs["label"]
    assumes = label[label.find("assumes:"):] if "assumes:" in label else ""
    return ("SUBSTITUTE: the model specs moelab prices the paper's models with, rebuilt from the AE scripts in "
            "place of Table 2 (the write-up drops it, spec §4); the paper's sizes as its AE scripts state them "
            "(*_kind = paper): " + sizes("paper")
            + "".join(f"; moelab's where the paper gives none (*_kind = {k}, column 'assumed'): {sizes(k)}"
                      for k in others)
            + (f"; {assumes}" if assumes else ""))


@product(P, "table2")
def table2(ctx):
    t = table2_models()
    t.attrs["label"] = _table2_label(t)
    return Made(t, tables={"table2_models": (t, "Table 2: models (reconstructed from the AE scripts)")})


@product(P, "fig3", needs_real=True)
def fig3(ctx):
    routing, workers = popularity.fig3_ep_example(ctx.scale)
    return Made(workers, tables={"table_fig03_workers": (workers, "Fig. 3: per-worker tokens and idle time")},
                figures={"fig03_ep_example": F.fig3_ep_example(routing, workers, label=_label(workers))})


@product(P, "fig4", quantities={"mean_top4_share": Quantity("mean share of each of the 4 most popular of 16 experts"),
                                "top4_over_mean": Quantity("share of a popular expert over the mean share", X)})
def fig4(ctx):
    shares, pop = popularity.fig4_popularity(ctx.scale, ctx.seed, include_t1=ctx.run_real)
    pop = pop.assign(source=pop.trace.str.split().str[0].str.rstrip(":"),  # T1 | T2 | PAPER
                     top4_over_mean=pop.mean_top4_share * pop.experts)
    return Made(pop, tables={"table_fig04_popularity": (pop, "Fig. 4: popularity summary")},
                figures={"fig04_popularity": F.fig4_popularity(shares, label=_label(shares))})


@product(P, "fig5")
def fig5(ctx):
    pts, lines = roofline.fig5_roofline(ctx.scale, ctx.seed)
    return Made(pts, tables={"table_fig05_roofline": (pts, "Fig. 5: roofline points (johnny)")},
                figures={"fig05_roofline": F.fig5_roofline(pts, lines, label=_label(pts))})


@product(P, "fig5a", needs_real=True)
def fig5a(ctx):
    pts, lines = roofline.fig5_roofline_measured(ctx.scale)
    return Made(pts, tables={"table_fig05a_roofline_measured": (pts, "Fig. 5 (a): measured roofline points")},
                figures={"fig05a_roofline_measured": F.fig5_roofline(
                    pts, lines, unit="GFLOPs", label=_label(pts),
                    title="Fig. 5 (a): DDL-Roofline, measured on CPU ranks")})


@product(P, "fig6", needs_real=True)
def fig6(ctx):
    b6 = shadowing.fig6_shadow_bytes(ctx.scale)
    return Made(b6, notes=[f"tokens computed per rank: {b6.attrs['compute_rows']}"],
                figures={"fig06_shadow_bytes": F.fig6_shadow_bytes(b6, label=_label(b6))})


@product(P, "fig7")
def fig7(ctx):
    g7 = schedule.fig7_schedule()
    return Made(g7, figures={"fig07_schedule": F.fig7_schedule(g7, label=_label(g7))})


@product(P, "fig8a", needs_real=True)
def fig8a(ctx):
    real8, _ = schedule.fig8_schedules(ctx.scale)
    ms = {k: round(v, 1) for k, v in real8.attrs["measured_ms"].items()}
    return Made(real8, notes=[f"measured layer times (ms): {ms}"], figures={"fig08a_schedules_real": F.fig8_schedules(
        real8, label=_label(real8), title="Fig. 8 (a): measured timelines, most loaded rank")})


@product(P, "fig8b", needs_real=True)
def fig8b(ctx):
    _, sim8 = schedule.fig8_schedules(ctx.scale)
    ms = {k: round(v, 2) for k, v in sim8.attrs["makespan_ms"].items()}
    return Made(sim8, notes=[f"pipeline model makespans (ms), from the measured op times: {ms}"],
                figures={"fig08b_schedules_sim": F.fig8_schedules(
                    sim8, by="schedule", label=_label(sim8),
                    title="Fig. 8 (b): 8a sequential, 8b two streams, 8c smart order")})


@product(P, "fig9", needs_real=True,
         quantities={"r2": Quantity("R² of the performance model, end-to-end latency")})
def fig9(ctx):
    pts, metrics = predictor.fig9_predictor(ctx.scale, ctx.seed)
    return Made(metrics, tables={"table_fig09_points": (pts, "Fig. 9: predictor points"),
                                 "table_fig09_r2": (metrics, "Fig. 9: R² and median relative error, in parts")},
                figures={"fig09_predictor": F.fig9_predictor(pts, metrics, label=_label(pts))})


@product(P, "fig10", quantities={"speedup_vs_zero3": SPEEDUP_Z3, "speedup_vs_zero2": SPEEDUP_Z2})
def fig10(ctx):
    f10 = end_to_end.fig10_end_to_end(ctx.scale, ctx.seed)
    piv = f10.pivot_table(index="model", columns="system", values="speedup_vs_zero3", sort=False).round(2)
    return Made(f10, notes=[piv.to_string()],
                tables={"table_fig10_end_to_end": (f10, "Fig. 10: MoE-layer time and speedup over ZeRO-3")},
                figures={"fig10_end_to_end": F.fig10_end_to_end(f10, label=_label(f10))})


@product(P, "fig10a", needs_real=True,
         quantities={"speedup_vs_zero3": Quantity("training-step time speedup over ZeRO-3, tiny model", X)})
def fig10a(ctx):
    f10r = end_to_end.fig10_real(ctx.scale)
    notes = [f"not compared: {f10r.attrs['missing']}"] if f10r.attrs.get("missing") else []
    return Made(f10r, notes=notes, tables={"table_fig10a_end_to_end_real": (f10r, "Fig. 10 (a): whole training steps")},
                figures={"fig10a_end_to_end_real": F.fig10_real(f10r, label=_label(f10r))})


@product(P, "fig10c")
def fig10c(ctx):
    full10 = end_to_end.fig10_full_iteration(ctx.scale, ctx.seed)
    if not len(full10):
        return Made(full10, notes=["no 'zero' simulator graph registered: the analytic ZeRO model stands alone"])
    return Made(full10, tables={"table_fig10_full_iteration": (
        full10, "Fig. 10 cross-check: whole-iteration makespans (moelab.sim zero graph)")})


@product(P, "fig10s")
def fig10s(ctx):
    """Which guessed constant moves the speedup over ZeRO-3, and how far (no tuning toward the paper)."""
    s = sensitivity.fig10_sensitivity(ctx.scale, ctx.seed)
    return Made(s, tables={"table_fig10_sensitivity": (
        s, "Fig. 10 sensitivity: FasterMoE over ZeRO-3 with each assumption at the ends of its range")})


@product(P, "fig11", quantities={"mean_fraction_shadowed": SHADOW_FRACTION, "max_speedup_one_shadow": SHADOW_ONE})
def fig11(ctx):
    lat, smap, summ = shadowing.fig11_shadowing(ctx.scale, ctx.seed)
    return Made(summ, tables={"table_fig11_summary": (summ, "Fig. 11: shadowing summary")},
                figures={"fig11_shadowing": F.fig11_shadowing(lat, smap, label=_label(lat))})


@product(P, "fig11a", needs_real=True, quantities={"mean_fraction_shadowed": SHADOW_FRACTION})
def fig11a(ctx):
    lat, smap, summ = shadowing.fig11_shadowing_real(ctx.scale)
    dec = suite.shadow_decisions(suite.layer_suite(ctx.scale))
    title = "Fig. 11 (a): shadowing on CPU ranks" + ("" if summ.attrs["fired"] else ": the policy never fired")
    return Made(summ, notes=[summ.attrs["shadowing"]],
                tables={"table_fig11a_summary": (summ, "Fig. 11 (a): shadowing on CPU ranks"),
                        "table_fig11a_decisions": (dec, "Fig. 11 (a): the shadow policy's decision per iteration")},
                figures={"fig11a_shadowing_real": F.fig11_shadowing(lat, smap, label=_label(lat), title=title)})


@product(P, "fig12", quantities={"achieved_simulator": SMART_ACHIEVED, "theoretical": SMART_THEORY,
                                 "model_fraction_of_theory": Quantity(
                                     "pipeline-model / theoretical speedup of the smart schedule")})
def fig12(ctx):
    f12 = schedule.fig12_smart(ctx.scale, ctx.seed)
    return Made(f12, tables={"table_fig12_smart": (f12, "Fig. 12: per-layer smart-schedule speedup")},
                figures={"fig12_smart": F.fig12_smart(f12, label=_label(f12))})


@product(P, "fig12a", needs_real=True, quantities={
    "achieved": SMART_ACHIEVED,
    "measured_fraction_of_theory": Quantity("measured / theoretical speedup of the smart schedule, best layer")})
def fig12a(ctx):
    f12r = schedule.fig12_smart_real(ctx.scale)
    return Made(f12r, tables={"table_fig12a_smart_real": (f12r, "Fig. 12 (a): smart schedule on CPU ranks")},
                figures={"fig12a_smart_real": F.fig12_smart_real(f12r, label=_label(f12r))})


@product(P, "fig13", quantities={"speedup": ("variant", BREAKDOWN)})
def fig13(ctx):
    f13 = end_to_end.fig13_breakdown(ctx.scale, ctx.seed)
    piv = f13.pivot_table(index="model", columns="variant", values="speedup", sort=False).round(2)
    return Made(f13, notes=[piv.to_string()], tables={"table_fig13_breakdown": (f13, "Fig. 13: breakdown")},
                figures={"fig13_breakdown": F.fig13_breakdown(f13, label=_label(f13))})


@product(P, "fig13a", needs_real=True, quantities={"speedup": ("variant", BREAKDOWN)})
def fig13a(ctx):
    f13r = end_to_end.fig13_breakdown_real(ctx.scale)
    title = "Fig. 13 (a): on CPU ranks" + ("" if f13r.attrs["fired"] else ": the shadow policy never fired")
    return Made(f13r, notes=[f13r.attrs["shadowing"]],
                tables={"table_fig13a_breakdown_real": (f13r, "Fig. 13 (a): on CPU ranks")},
                figures={"fig13a_breakdown_real": F.fig13_breakdown(f13r, x="variant", label=_label(f13r),
                                                                    title=title)})


@product(P, "fig14", needs_real=True)
def fig14(ctx):
    f14 = convergence.fig14_convergence(ctx.scale)
    notes = [f"not compared: {f14.attrs['missing']}"] if f14.attrs.get("missing") else []
    return Made(f14, notes=notes, figures={"fig14_convergence": F.fig14_convergence(f14, label=_label(f14))})


TABLE3 = {"iter_speedup_vs_fastmoe": Quantity("per-iteration speedup over FastMoE, MoE-GPT on johnny", X),
          "iter_gain_vs_fastermoe": Quantity(
              "fraction by which an iteration is shorter than FasterMoE's (no topology gate)"),
          "extra_steps_vs_fastermoe": Quantity(
              "extra steps to the target loss relative to FasterMoE (no topology gate)"),
          "steps_vs_fastmoe": Quantity("steps to the target loss relative to FastMoE (faithful top-2)", X),
          "time_vs_fastermoe": Quantity("time to the target loss relative to FasterMoE's", X)}


@product(P, "table3", needs_real=True, quantities=TABLE3)
def table3(ctx):
    t3 = convergence.table3_time_to_loss(ctx.scale, ctx.values.get("fig14"))
    return Made(t3, tables={"table3_time_to_loss": (t3, "Table 3: steps and time to the target loss")})
