"""Lina's inference products (Figs. 6, 9, 16-19, Tables 2, 5, 6): one registered function per figure or
table, ids as in ``experiments/lina/manifest.yaml``."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.papers.kit.assumptions import load_assumptions
from moelab.papers.kit.registry import Made, Quantity, product
from moelab.strategies.lina.options import LinaServeOptions
from moelab.strategies.lina.placement import BALANCE_TOL

from . import figures as F
from . import frames, serving_scale
from .common import P, fired, paper, paper_at
from .runs import BALANCED_SUFFIX, FIRST_KEYS, LOAD_KEY, SCHEDULED

INFER_SHARE = Quantity("all-to-all share of the inference batch time (baseline)", "fraction")
INFER = Quantity("inference batch time over Ideal", "x")
INFER_GAIN = Quantity("inference batch time, baseline over the variant", "x")
ACC = Quantity("estimation accuracy (top-2 set of the batch's experts right)", "fraction")
REPLAN = Quantity("share of scheduled (batch, layer) instances that re-planned in phase 2", "fraction")
PATTERN = Quantity("share of tokens following their group's most frequent next expert(s)", "fraction")


LAYER_P95 = Quantity("p95 MoE-layer time, baseline over Lina", "x")
TAIL_A2A = Quantity("tail (p95) all-to-all time, baseline over Lina", "x")


@product(P, "fig6r", needs_real=True)
def fig6r(ctx):
    df = frames.popularity_skew(ctx.scale.name, ctx.seed)
    notes = [f"most/least popular expert: training {df.train_max_over_min.median():.2f}x, inference "
             f"{df.infer_max_over_min_median.median():.2f}x (median over layers; "
             f"paper {paper('popularity_skew_E4'):.2f}x at 4 and {paper('popularity_skew_E16'):.2f}x at 16 experts)"]
    return Made(df, figures={"fig06r_skew": F.bars(df.melt(id_vars="layer", value_vars=["train_max_over_min",
                                                                                        "infer_max_over_min_median"]),
                                                   "layer", "value", color="variable", label=df.attrs["label"],
                                                   title="Fig. 6 analog: expert popularity skew, "
                                                         "training vs inference")},
                tables={"table_fig06r": (df, "Fig. 6 analog: most/least popular expert per layer")}, notes=notes)


@product(P, "fig9r", needs_real=True, quantities={"share": PATTERN})
def fig9r(ctx):
    df = frames.pattern(ctx.scale.name, ctx.seed)
    df["k'"] = [f"k'={k}" for k in df.k]
    notes = [f"mean share: k'=1 {df[df.k == 1].share.mean():.1%}, k'=2 {df[df.k == 2].share.mean():.1%} "
             f"(paper: {100 * paper('pattern_k1'):.2f} % and {100 * paper('pattern_k2'):.2f} %; uniform routing would "
             "give k'/E)"]
    return Made(df, figures={"fig09r_pattern": F.lines(df, "layer", "share", color="k'", label=df.attrs["label"],
                                                       title="Fig. 9 analog: layer-to-layer expert pattern")},
                tables={"table_fig09r": (df, "Fig. 9 analog: pattern share per layer")}, notes=notes)


@product(P, "table2r", needs_real=True)
def table2r(ctx):
    df = frames.top_experts(ctx.scale.name, ctx.seed)
    return Made(df, tables={"table2r_top_experts": (df, "Table 2 analog: the 4 most popular experts per layer")})


@product(P, "fig16r", needs_real=True, quantities={"median_batch_over_ideal": INFER, "p95_batch_over_ideal": INFER,
                                                   "median_speedup_over_baseline": INFER_GAIN,
                                                   "p95_speedup_over_baseline": INFER_GAIN})
def fig16r(ctx):
    df = frames.serve_summary(ctx.scale.name, ctx.seed)
    balanced = df[df.variant.str.endswith(BALANCED_SUFFIX)]
    notes = [f"rows '{BALANCED_SUFFIX.strip()}': the same model served with "
             "serve.strategy_options.replica_rounding balanced (an option, "
             "not the spec's floor): the baseline's p95 batch time over theirs " + ", ".join(
                 f"{r.variant} {r.p95_speedup_over_baseline:.2f}x"
                 for r in balanced.itertuples())] if len(balanced) else []
    notes += [LOAD_NOTE + ": the baseline's p95 batch time over its " + ", ".join(
        f"{r.p95_speedup_over_baseline:.2f}x" for r in df[df.variant == LOAD_KEY].itertuples())] \
        if (df.variant == LOAD_KEY).any() else []
    notes += _first_note(df)
    long = df.melt(id_vars="variant", value_vars=["median_batch_over_ideal", "p95_batch_over_ideal"])
    return Made(df, figures={"fig16r_inference": F.bars(long, "variant", "value", color="variable", line=1.0,
                                                        label=df.attrs["label"],
                                                        title="Fig. 16 analog: batch time over Ideal")},
                tables={"table_fig16r": (df, "Fig. 16 analog: latency and batch time per variant")}, notes=notes)


@product(P, "fig16s", needs_real=True, quantities={"median_batch_over_ideal": INFER, "p95_batch_over_ideal": INFER,
                                                   "median_speedup_over_baseline": INFER_GAIN,
                                                   "p95_speedup_over_baseline": INFER_GAIN, "a2a_share": INFER_SHARE})
def fig16s(ctx):
    raw = serving_scale.inference(ctx.scale.name, ctx.seed)
    bal = serving_scale.inference(ctx.scale.name, ctx.seed, variants=SCHEDULED, rounding="balanced")
    bal["variant"] = bal.variant + BALANCED_SUFFIX  # the same batches, replica counts for the busiest device
    load = serving_scale.inference(ctx.scale.name, ctx.seed, variants=("lina",), rounding="balanced",
                                   replan_test="load")
    load["variant"] = LOAD_KEY
    first = [serving_scale.inference(ctx.scale.name, ctx.seed, variants=("lina",), first_layers="actual",
                                   rounding=o.get("serve.strategy_options.replica_rounding", "floor")).assign(variant=k)
             for k, o in FIRST_KEYS.items()]
    attrs, raw = raw.attrs, pd.concat([raw, bal, load, *first], ignore_index=True)
    raw.attrs = attrs
    g = raw.groupby("variant", sort=False).batch_s
    df = pd.DataFrame({"variant": list(g.groups), "median_batch_s": g.median().values,
                       "p95_batch_s": g.quantile(0.95).values,
                       "replans": raw.groupby("variant", sort=False).replans.sum().values,
                       "a2a_share": (raw.a2a_s / raw.batch_s).groupby(raw.variant, sort=False).median().values,
                       "load_max_over_mean": raw.groupby("variant", sort=False).load_max_over_mean.median().values})
    ideal = df.set_index("variant").loc["ideal"]
    df["median_batch_over_ideal"] = df.median_batch_s / ideal.median_batch_s
    df["p95_batch_over_ideal"] = df.p95_batch_s / ideal.p95_batch_s
    df = frames.speedups_over_baseline(df)
    df.attrs["label"] = raw.attrs["label"]
    long = df.melt(id_vars="variant", value_vars=["median_batch_over_ideal", "p95_batch_over_ideal"])
    sens = _batch_size_sensitivity(ctx)
    fit = serving_scale.fitted_infer_tokens(ctx.scale.name, ctx.seed)
    return Made(df, figures={"fig16s_inference": F.bars(long, "variant", "value", color="variable", line=1.0,
                                                        label=df.attrs["label"],
                                                        title="Fig. 16: batch time over Ideal, one device per expert")},
                tables={"table_fig16s": (df, "Fig. 16 (simulated): batch time per variant"),
                        "table_fig16s_batch_size": (sens, "Fig. 16 (simulated): Lina and Ideal over the baseline vs "
                                                          "the tokens per batch")},
                notes=fired(df[df.variant == "lina"], "replans", "Lina's phase-2 re-plan")
                + ["the batch size is FITTED to Table 1's inference all-to-all time (a fit, not a result): "
                   f"{fit['tokens']} tokens give the baseline {1e3 * fit['a2a_per_layer_s']:.2f} ms "
                   "of all-to-all per MoE "
                   f"layer (target {1e3 * fit['target_s']:.2f} ms); Lina's "
                   "scheduling costs are fixed per layer, so its speedup grows with the batch: " + ", ".join(
                       f"{int(r.tokens_per_batch)} tokens ({r.kind}): lina {r.lina_median_speedup:.2f}x, ideal "
                       f"{r.ideal_median_speedup:.2f}x" for r in sens.itertuples()),
                   "the busiest device's tokens over the mean (median over layers and batches): " + ", ".join(
                       f"{r.variant} {r.load_max_over_mean:.2f}" for r in df.itertuples())
                   + f"; with the scheduler's costs set to zero (what-if) Lina gains "
                   f"{sens[sens.kind.str.endswith(WHAT_IF)].lina_median_speedup.iloc[0]:.2f}x "
                   "at the fitted batch: the rest of its gap to Ideal is the placement (whole devices per expert)",
                   f"rows '{BALANCED_SUFFIX.strip()}': an option, not the spec's - "
                   "replica counts chosen so the busiest "
                   f"device is within {BALANCE_TOL:.0%} of the mean "
                   "(serve.strategy_options.replica_rounding: balanced) instead of floor(n(e)); the "
                   "first path_len layers stay static in both", LOAD_NOTE] + _first_note(df))


LOAD_NOTE = (f"row '{LOAD_KEY}': an option, not the paper's - "
             "lina (balanced) whose phase 2 re-plans iff the kept plan's "
             "busiest device carries more than 1 + serve.strategy_options.replan_tol "
             f"({LinaServeOptions.replan_tol}) times the load the estimate "
             "predicted for it (serve.strategy_options.replan_test: load), "
             f"instead of iff the top-{LinaServeOptions.k_cmp} sets differ")


def _first_note(df) -> list:
    rows = df[df.variant.isin(list(FIRST_KEYS))]
    return [f"rows '{'/'.join(FIRST_KEYS)}': an option, not the spec's - lina planning the MoE layers before "
            "serve.strategy_options.path_len from the actual counts (serve.strategy_options.first_layers: actual; "
            "phase 2 without an estimate, blocking), "
            "where the spec leaves them static (the paper's slower start): the baseline's p95 batch time over theirs "
            + ", ".join(f"{r.variant} {r.p95_speedup_over_baseline:.2f}x"
                        for r in rows.itertuples())] if len(rows) else []


WHAT_IF = ", scheduler costs 0 (what-if)"  # the sensitivity row priced without Lina's scheduler costs


def _batch_size_sensitivity(ctx) -> pd.DataFrame:
    """fig16s at the fitted batch, the assumption's value (the fit's start) and its range's ends: median speedups."""
    a = load_assumptions("lina")["infer_tokens_per_batch"]
    fit = serving_scale.fitted_infer_tokens(ctx.scale.name, ctx.seed)["tokens"]
    rows = []
    runs = [(tokens, False) for tokens in sorted({a.range[0], a.value, fit, a.range[1]})] + [(fit, True)]
    for tokens, free in runs:
        df = serving_scale.inference(ctx.scale.name, ctx.seed, None if tokens == fit else tokens, free_scheduling=free)
        g = df.groupby("variant").batch_s.median()
        kind = "fitted" if tokens == fit else "assumption" if tokens == a.value else "range end"
        rows.append({"tokens_per_batch": df.attrs["batch_tokens"],
                     "kind": kind + (WHAT_IF if free else ""),
                     "lina_median_speedup": g["baseline"] / g["lina"],
                     "ideal_median_speedup": g["baseline"] / g["ideal"]})
    out = pd.DataFrame(rows)
    out.attrs["label"] = serving_scale.inference(ctx.scale.name, ctx.seed).attrs["label"].split(", each tiled")[0] + \
        "; each batch tiled to the tokens of the row (the fitted batch and the assumption's range)"
    return out


@product(P, "fig17r", needs_real=True)
def fig17r(ctx):
    df = frames.layer_p95(ctx.scale.name, ctx.seed)
    return Made(df, figures={"fig17r_layer_p95": F.lines(df, "layer", "p95_layer_s", color="variant",
                                                         label=df.attrs["label"],
                                                         title="Fig. 17 analog: p95 MoE-layer time per layer")},
                tables={"table_fig17r": (df, "Fig. 17 analog: p95 MoE-layer time per variant and layer")})


def _tail_a2a(out: pd.DataFrame, stem: str, name: str) -> Made:
    """Fig. 18: the baseline's p95 all-to-all time over Lina's, per MoE layer (``out``: layer, a2a_reduction)."""
    notes = [f"tail all-to-all reduction baseline/lina: mean {out.a2a_reduction.mean():.2f}x, max "
             f"{out.a2a_reduction.max():.2f}x over layers (paper: average {paper('tail_a2a_reduction'):.2f}x, max "
             f"{paper('tail_a2a_reduction_max'):.2f}x)"]
    return Made(out, figures={stem: F.bars(out, "layer", "a2a_reduction", line=1.0, label=out.attrs["label"],
                                           title=f"{name}: p95 all-to-all time, baseline over Lina")},
                tables={f"table_{stem.split('_')[0]}": (out, f"{name}: tail all-to-all reduction per layer")},
                notes=notes)


@product(P, "fig18r", needs_real=True, quantities={"a2a_reduction": TAIL_A2A})
def fig18r(ctx):
    df = frames.layer_p95(ctx.scale.name, ctx.seed)
    piv = df.pivot(index="layer", columns="variant", values="p95_a2a_s")
    out = pd.DataFrame({"layer": piv.index, "a2a_reduction": (piv["baseline"] / piv["lina"]).values})
    out.attrs["label"] = df.attrs["label"]
    return _tail_a2a(out, "fig18r_tail_a2a", "Fig. 18 analog")


@product(P, "fig17s", needs_real=True, quantities={"p95_layer_speedup": LAYER_P95})
def fig17s(ctx):
    df = serving_scale.inference_layers(ctx.scale.name, ctx.seed)
    lina = df[df.variant == "lina"]
    notes = [f"p95 MoE-layer time, baseline over lina: mean {lina.p95_layer_speedup.mean():.2f}x over the "
             f"{len(lina)} MoE layers (the first serve.strategy_options.path_len layers stay static) "
             f"(paper: {paper('layer_p95_E8'):.2f}x / {paper('layer_p95_E16'):.2f}x, TXL 8 / 16)"]
    return Made(df, figures={"fig17s_layer_p95": F.lines(df, "layer", "p95_layer_s", color="variant",
                                                         label=df.attrs["label"],
                                                         title="Fig. 17: p95 MoE-layer time per layer")},
                tables={"table_fig17s": (df, "Fig. 17 (simulated): p95 MoE-layer and all-to-all time per variant "
                                             "and layer")}, notes=notes)


@product(P, "fig18s", needs_real=True, quantities={"a2a_reduction": TAIL_A2A})
def fig18s(ctx):
    df = serving_scale.inference_layers(ctx.scale.name, ctx.seed)
    out = df[df.variant == "lina"][["layer", "p95_a2a_s", "a2a_reduction"]].reset_index(drop=True)
    out.attrs["label"] = df.attrs["label"]
    return _tail_a2a(out, "fig18s_tail_a2a", "Fig. 18 (simulated)")


@product(P, "fig19r", needs_real=True, quantities={"accuracy": ACC, "replan_rate": REPLAN})
def fig19r(ctx):
    df = frames.estimation_accuracy(ctx.scale.name, ctx.seed)
    notes = [f"overall estimation accuracy {np.average(df.accuracy, weights=df.instances):.1%}, re-plan rate "
             f"{np.average(df.replan_rate, weights=df.instances):.1%} "
             f"(paper: {100 * paper('accuracy_txl'):.2f} % TXL, {100 * paper('accuracy_bertl'):.2f} % BERT-L; "
             f"{100 * paper('replan_rate'):.0f} % re-plans)"] \
        if len(df) else ["no scheduled layer: the path is as long as the model"]
    return Made(df, figures={"fig19r_accuracy": F.bars(df, "layer", "accuracy", label=df.attrs["label"],
                                                       title="Fig. 19 analog: estimation accuracy per layer")},
                tables={"table_fig19r": (df, "Fig. 19 analog: top-2 estimation accuracy per layer")}, notes=notes)


@product(P, "table5r", needs_real=True, quantities={"accuracy": ACC, "replan_rate": REPLAN,
                                                   "median_over_ideal": INFER, "p95_over_ideal": INFER})
def table5r(ctx):
    df = frames.path_length_table(ctx.scale.name, ctx.seed)
    return Made(df, tables={"table5r_path_length": (df, "Table 5 analog: path length vs accuracy, "
                                                        "re-plans, batch time")})


PAPER_PATHS = (1, 3, 6)  # Table 5's path lengths (paper.yaml keys lina_over_ideal_*_Lp<n>)


@product(P, "table5s", needs_real=True, quantities={"median_over_ideal": INFER, "p95_over_ideal": INFER})
def table5s(ctx):
    df = serving_scale.path_length_times(ctx.scale.name, ctx.seed)
    notes = ["the times of Table 5 at one device per expert, from the REAL routing traces (its accuracy and re-plan "
             "share: table5r); a longer path starts Lina later (layer path_len + 1): " + ", ".join(
                 f"Lp {r.path_len}: median {r.median_over_ideal:.2f}x, p95 {r.p95_over_ideal:.2f}x of Ideal"
                 for r in df.itertuples()) + " (paper, TXL: " + ", ".join(
                 f"{paper(f'lina_over_ideal_median_Lp{n}'):.2f}/{paper(f'lina_over_ideal_p95_Lp{n}'):.2f}"
                 for n in PAPER_PATHS) + f" at Lp {'/'.join(str(n) for n in PAPER_PATHS)})"]
    return Made(df, tables={"table5s_path_length": (df, "Table 5 (simulated): path length vs batch time over Ideal")},
                notes=notes)


PAPER_TASKS = ("imdb", "twitter", "wmt_fr", "wmt_ru")  # Table 6's tasks (paper.yaml keys generalization_*_<task>)


@product(P, "table6d", needs_real=True, quantities={"p95_over_ideal": INFER, "accuracy": ACC})
def table6d(ctx):
    df = frames.generalization(ctx.scale.name, ctx.seed)
    notes = [f"{r.domain}: p95 {r.p95_over_ideal:.2f}x Ideal, accuracy {r.accuracy:.1%} ({r.instances} estimated "
             f"layer instances)" for r in df.itertuples()]
    notes.append("paper (Table 6): p95 " + "/".join(f"{paper(f'generalization_p95_{t}'):.2f}" for t in PAPER_TASKS)
                 + "x of Ideal, accuracy " + "/".join(f"{100 * paper(f'generalization_accuracy_{t}'):.1f}"
                                                      for t in PAPER_TASKS)
                 + " % on " + ", ".join(paper_at(f"generalization_accuracy_{t}") for t in PAPER_TASKS))
    notes += fired(df, "instances", "Lina's popularity estimation (no scheduled layer)")
    return Made(df, figures={"table6d_generalization": F.bars(df.melt(id_vars="domain", value_vars=["p95_over_ideal",
                                                                                                   "accuracy"]),
                                                               "domain", "value", color="variable", line=1.0,
                                                               label=df.attrs["label"],
                                                               title="Table 6 substitute: Lina on three local "
                                                                     "text domains")},
                tables={"table6d_generalization": (df, "Table 6 substitute: per text domain, p95 batch time over "
                                                       "Ideal and estimation accuracy")}, notes=notes)
