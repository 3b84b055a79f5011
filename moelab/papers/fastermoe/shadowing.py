"""FasterMoE reproduction, Figs. 6 and 11: dynamic shadowing, SIMULATED on johnny over consecutive T2 iterations
and EMULATED on the layer suite (the policy's decision per iteration and whether it fired), and the bytes a
forced shadow moves."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from moelab.papers.kit.traces import top2_counts
from moelab.sim import simulate
from moelab.strategies.fastermoe import perf_model as pm
from moelab.strategies.fastermoe import roofline as rl
from moelab.strategies.fastermoe.sim_graph import fastermoe_iteration_graph

from .common import PAPER_LAYER_MODELS, mark_assumptions, moe_layer_times, policy_constants, scale_spec, sim_profile
from .end_to_end import _paper_layer_config, paper_variant_options
from .suite import _suite_warmup, layer_suite, shadow_decisions, shadowing_note
from .traces import t2_popularity


# ==== Fig. 11: shadowing over consecutive iterations ==========================================================
def fig11_shadowing(scale, seed: int = 0):
    """Fig. 11 (b) SIMULATED: layer 12 of MoE-BERT-Deep (h = 1024, 2048 tokens per GPU, 16 experts, johnny)
    over ``fig11_iters`` consecutive iterations from 5000, SUBSTITUTE T2 popularity: MoE-layer latency
    without optimisation and with shadowing (simulator), and the shadow set the policy picks each
    iteration. Returns ``(latency, shadow_map, summary)``."""
    sp = scale_spec(scale)
    m = PAPER_LAYER_MODELS["BERT-Deep"]
    iters = list(range(5000, 5000 + sp.fig11_iters))
    P = t2_popularity(iters, m.experts, layer=11, seed=seed)
    rng = np.random.default_rng([seed, 11, 5000])
    prof = sim_profile("johnny")
    opts = paper_variant_options("johnny")
    cfgs = {v: _paper_layer_config(m, 1, opts[v]) for v in ("fastmoe", "shadow")}
    lat, smap = [], []
    for i, it in enumerate(iters):
        C = top2_counts(P[i], m.tokens, 16, rng)[None]
        t = {}
        for v, cfg in cfgs.items():
            g = fastermoe_iteration_graph(cfg, prof, C)
            t[v] = float(moe_layer_times(simulate(g), [0])[0])
            if v == "shadow":
                S = tuple(g.meta["shadows"][0])
        for v in t:
            lat.append(dict(iter=it, variant=v, latency_ms=1e3 * t[v]))
        for e in range(m.experts):
            smap.append(dict(iter=it, expert=e, shadowed=int(e in S), share=float(C[0, :, e].sum() / C.sum())))
    lat, smap = pd.DataFrame(lat), pd.DataFrame(smap)
    summary = _fig11_summary(lat, smap, m.experts)
    c = policy_constants("johnny")
    for f in (lat, smap, summary):
        f.attrs["label"] = ("SIMULATED: fastermoe_johnny, MoE-BERT-Deep layer 12 (h=1024), SUBSTITUTE T2 trace, "
                            f"shadow policy with the FastMoE constants (P={c['P'] / 1e12:g} TFLOP/s, "
                            f"W_net={c['W_net'] / 1e9:g} GB/s, c={c['c']})")
        mark_assumptions(f, "fig11")
    return lat, smap, summary


def _fig11_summary(lat, smap, E) -> pd.DataFrame:
    w = lat.pivot_table(index="iter", columns="variant", values="latency_ms")
    sp = w["fastmoe"] / w["shadow"]
    n = smap.groupby("iter").shadowed.sum()
    one = sp[n.reindex(sp.index) == 1]
    return pd.DataFrame([dict(iterations=len(w), mean_fraction_shadowed=float(n.mean() / E),
                              mean_shadowed_experts=float(n.mean()), iterations_with_shadow=int((n > 0).sum()),
                              mean_speedup=float(sp.mean()), max_speedup=float(sp.max()),
                              max_speedup_one_shadow=float(one.max()) if len(one) else float("nan"))])


def fig11_shadowing_real(scale, trace: Optional[str] = None):
    """Fig. 11 (a): the REAL layer suite (EMULATED 2-node links, 16 experts): per iteration, the measured
    latency of FastMoE and of shadowing (policy constants calibrated on this machine) and the shadow set.
    Returns ``(latency, shadow_map, summary)``."""
    s = layer_suite(scale, trace)
    df = s["times"]
    df = df[(df["rank"] == 0) & (df.variant.isin(["fastmoe", "shadow"])) & (df.iter >= _suite_warmup(s))]
    lat = df[["iter", "variant"]].assign(latency_ms=1e3 * df.time_s)
    smap = []
    for _, r in df[df.variant == "shadow"].iterrows():
        C = s["trace"][r.iter]
        for e in range(s["E"]):
            smap.append(dict(iter=int(r.iter), expert=e, shadowed=int(e in r.shadowed),
                             share=float(C[:, e].sum() / C.sum())))
    smap = pd.DataFrame(smap)
    summary = _fig11_summary(lat, smap, s["E"])
    summary["P_eff_GFLOPs"] = s["P_eff"] / 1e9
    summary["policy_W_net_GBps"] = s["inter_GBps"]
    summary["policy_c"] = s["policy_c"]
    dec = shadow_decisions(s)
    summary["mean_modelled_gain_ms"] = float(dec.modelled_gain_ms.mean()) if len(dec) else float("nan")
    note = shadowing_note(dec)
    for f in (lat, smap, summary):
        f.attrs["label"] = f"{s['label']}; {note}"
        f.attrs["shadowing"] = note
        f.attrs["fired"] = bool((dec.n_shadowed > 0).any())
    return lat, smap, summary


def fig6_shadow_bytes(scale, trace: Optional[str] = None) -> pd.DataFrame:
    """Fig. 6 (a): bytes one REAL iteration moves (all ranks, by collective and link class) without and with
    the hottest expert shadowed (``shadow_force``): its tokens no longer travel; its parameters are
    broadcast and its gradients reduced instead. Also the tokens each rank computes."""
    s = layer_suite(scale, trace)
    tl = s["timeline"]
    tl = tl[(tl.kind == "comm") & tl.variant.isin(["fastmoe", "shadow_top1"])]
    rows = []
    for (v, op), g in tl.groupby(["variant", "name"]):
        for c in ("intra", "inter"):
            rows.append(dict(variant={"fastmoe": "no shadow", "shadow_top1": "shadow hottest expert"}[v], op=op,
                             link=c, MB=g[f"bytes_{c}"].sum() / 1e6))
    df = pd.DataFrame(rows)
    t_it = max(i for i in s["times"][s["times"].variant == "shadow_top1"].iter.unique())
    C = s["trace"][t_it]
    hot = s["variants"]["shadow_top1"]["shadow_force"][0]
    df.attrs["hot_expert"] = hot
    df.attrs["hot_share"] = float(C[:, hot].sum() / C.sum())
    El = C.shape[1] // s["N"]
    df.attrs["compute_rows"] = dict(
        no_shadow=pm.worker_loads(C).tolist(),
        shadow=(pm.worker_loads(rl.shadow_counts(C, [hot])[0]) + rl.shadow_counts(C, [hot])[1]).tolist())
    df.attrs["E_local"] = El
    df.attrs["label"] = s["label"] + f", iteration {t_it}; shadowed expert {hot} (forced)"
    return df


