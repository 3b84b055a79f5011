"""FasterMoE reproduction, Figs. 10 and 13: SIMULATED MoE-layer replays on johnny / trevor (FastMoE, shadowing,
smart schedule, both; ZeRO-1/2/3 priced by the spec's volume model), the whole-iteration cross-check, and the
REAL whole-step and layer-suite counterparts."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd

from moelab.comm import costs
from moelab.config import RunConfig
from moelab.papers.kit.cache import cached
from moelab.registry import known_strategies
from moelab.runtime.ranks import run_ranks
from moelab.sim import get_graph, simulate
from moelab.sim.graphs import config_for_profile
from moelab.strategies.fastermoe.sim_graph import fastermoe_iteration_graph

from .common import (
    PAPER_LAYER_MODELS,
    TRACE_ITERS,
    TRACE_WEIGHTS,
    PaperLayerModel,
    assumptions,
    mark_assumptions,
    moe_layer_times,
    paper_layer_models,
    policy_constants,
    scale_spec,
    sim_profile,
)
from .convergence import FASTERMOE_OPTS, _conv_config, _conv_rank
from .suite import layer_suite, shadow_decisions, shadowing_note, suite_medians
from .traces import t2_counts


# ==== SIMULATED paper scale: MoE-layer replays (Figs. 10-13) ==================================================
def paper_variant_options(cluster: str, overrides: tuple = ()) -> dict:
    """The FasterMoE plans simulated at paper scale: shadow policy with the cluster's constants,
    smart schedule with its group size (johnny Gs = 2, the AE's ``FMOE_FUSE_GRAN=2``; trevor Gs = 4, the
    code default = one node), all from the assumptions file (:func:`policy_constants`)."""
    c = policy_constants(cluster, overrides)
    sh = {"shadow": True, "shadow_gpu_flops": c["P"], "shadow_net_bw": c["W_net"], "shadow_comm_factor": c["c"]}
    gs = c["group_size"]
    return {"fastmoe": {}, "shadow": sh, "smart": {"smart": True, "group_size": gs},
            "both": {**sh, "smart": True, "group_size": gs}}


def _paper_layer_config(m: PaperLayerModel, layers: int, options: dict, overrides: tuple = ()):
    seq = 1024 if m.name.startswith("GPT") else 512
    cfg = RunConfig().with_overrides({
        "model.arch": "gpt", "model.vocab_size": 256, "model.d_model": m.h, "model.d_ff": m.h_ff,
        "model.n_layers": layers, "model.n_heads": 16, "model.seq_len": seq, "model.moe.num_experts": m.experts,
        "model.moe.top_k": 2, "train.batch_size": max(m.tokens // seq, 1), "train.dtype": "float32",
        "parallel.strategy": "fastermoe", "parallel.strategy_options": options})
    return config_for_profile(cfg, sim_profile(m.cluster, overrides))


def paper_trace(m: PaperLayerModel, iters: Sequence[int], layers: int, seed: int = 0,
                overrides: tuple = ()) -> np.ndarray:
    """T2 counts ``[len(iters), layers, N, E]`` of a paper model (one expert per GPU); every model gets its
    own T2 draw (the paper's models have their own traces)."""
    N = m.experts
    k = list(PAPER_LAYER_MODELS).index(m.name) if m.name in PAPER_LAYER_MODELS else 0
    return t2_counts(list(iters), layers, N, m.experts, m.tokens, 1000 * seed + k, overrides)


CLUSTERS = ("johnny", "trevor")


def paper_layer_sims(scale, seed: int = 0, overrides: tuple = (), clusters: tuple = CLUSTERS) -> pd.DataFrame:
    """SIMULATED: every paper layer model (:func:`paper_layer_models`) of ``clusters`` on its cluster
    profile, T2 traces at ``trace_iters``, the four plans of :func:`paper_variant_options`; one row per
    (model, trace iteration, layer, variant) with the MoE-layer time (ms) and the shadow set (the
    policy's, same function the runtime calls). ``overrides``: assumptions varied (sensitivity); only
    the base runs are cached, so a sensitivity sweep does not evict them."""
    clusters = tuple(c for c in CLUSTERS if c in clusters)
    if overrides:
        return _paper_layer_sims(scale, seed, tuple(overrides), clusters)
    return _paper_layer_sims_cached(scale, seed, clusters)


@cached
def _paper_layer_sims_cached(scale, seed: int, clusters: tuple) -> pd.DataFrame:
    return _paper_layer_sims(scale, seed, (), clusters)


def _paper_layer_sims(scale, seed: int, overrides: tuple, clusters: tuple) -> pd.DataFrame:
    sp = scale_spec(scale)
    rows = []
    for m in paper_layer_models(overrides).values():
        if m.cluster not in clusters:
            continue
        L = m.layers if sp.paper_layers is None else min(sp.paper_layers, m.layers)
        tr = paper_trace(m, sp.trace_iters, L, seed, overrides)
        prof = sim_profile(m.cluster, overrides)
        for vi, (variant, opts) in enumerate(paper_variant_options(m.cluster, overrides).items()):
            cfg = _paper_layer_config(m, L, opts, overrides)
            for ti, it in enumerate(sp.trace_iters):
                g = fastermoe_iteration_graph(cfg, prof, tr[ti])
                res = simulate(g)
                times = moe_layer_times(res, range(L))
                for layer in range(L):
                    rows.append(dict(cluster=m.cluster, model=m.name, trace_iter=it, layer=layer, variant=variant,
                                     time_ms=1e3 * times[layer], shadowed=tuple(g.meta["shadows"][layer]),
                                     experts=m.experts))
    df = pd.DataFrame(rows)
    df.attrs["label"] = "SIMULATED: fastermoe_johnny / fastermoe_trevor profiles, SUBSTITUTE T2 traces"
    return df


def weighted_model_times(sims: pd.DataFrame) -> pd.DataFrame:
    """Per (cluster, model, variant): the sum over layers of the AE's time-weighted mean over trace
    iterations (weights 500 : 5000 : 75000 for iterations 500 / 5500 / 80500; renormalised over the
    iterations present)."""
    w = dict(zip(TRACE_ITERS, TRACE_WEIGHTS))
    s = sims.assign(w=sims.trace_iter.map(w).fillna(1.0))
    per = s.groupby(["cluster", "model", "variant", "layer"]).apply(
        lambda g: float(np.average(g.time_ms, weights=g.w)), include_groups=False).rename("time_ms").reset_index()
    return per.groupby(["cluster", "model", "variant"], sort=False).time_ms.sum().reset_index()


def zero_layer_time(stage: int, m: PaperLayerModel, overlap: Optional[float] = None, overrides: tuple = ()) -> float:
    """Seconds of one MoE layer (forward + backward) under ZeRO stage 1/2/3 on the model's cluster
    profile, by the spec's §3 volume model on the simulator's cost functions: every worker runs its
    own ``tokens x 2`` assignments through all (replicated) experts locally (``12 B k h h_ff / P``, no
    imbalance); stage 1/2 all-reduce the layer's gradients (``2 (N-1)/N Sp``, a ring over the
    profile's links), stage 3 all-gathers the parameters before forward and again before backward and
    reduce-scatters the gradients (``3 (N-1)/N Sp``); ``Sp = E * 2 h h_ff * 4`` bytes. ``overlap``
    hides that fraction of ``min(compute, comm)`` (DeepSpeed's overlap_comm / prefetch; default: the
    assumption ``zero_overlap``, the least trustworthy number here, spec §6.16). Stages 1 and 2 move the
    same bytes in this model.

    ``zero12_step_allgather`` (assumptions.yaml; 1 = the spec's per-iteration volume) prices stage 1/2's
    gradient reduction as the reduce-scatter half of that all-reduce plus the all-gather of the updated
    parameter partitions; 0 prices the reduce-scatter alone: DeepSpeed's stage 1/2 optimizer all-gathers
    the partitions in ``step()``, and the AE's DeepSpeed benchmark (``benchmarks/run_ds.py``) times
    ``model(x)`` and ``model.backward(loss)`` only. Stage 3 gathers inside forward and backward: unchanged."""
    import dataclasses

    A = assumptions(overrides)
    overlap = A.value("zero_overlap") if overlap is None else overlap
    step = A.value("zero12_step_allgather")
    if step not in (0, 1):
        raise ValueError(f"zero12_step_allgather is 0 or 1, got {step}")
    prof = dataclasses.replace(sim_profile(m.cluster, overrides), allreduce="ring")  # the spec's volume model: rings
    topo = prof.topology()
    N = prof.world_size
    Sp = m.experts * 2 * m.h * m.h_ff * 4
    Tc = 12.0 * m.tokens * 2 * m.h * m.h_ff / prof.achieved_flops
    if stage in (1, 2):
        Tm = costs.allreduce_time(Sp, topo, prof) if step else costs.reduce_scatter_time(Sp, topo, prof)
    elif stage == 3:
        Tm = 2 * costs.allgather_time(Sp // N, topo, prof) + costs.reduce_scatter_time(Sp, topo, prof)
    else:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    return Tc + Tm - overlap * min(Tc, Tm)


PRICING_ONLY = ("zero_overlap", "zero12_step_allgather")  # assumptions that only the analytic ZeRO pricing reads


def fig10_end_to_end(scale, seed: int = 0, overrides: tuple = (),
                     clusters: tuple = ("johnny", "trevor")) -> pd.DataFrame:
    """Fig. 10 (b): per model, MoE-layer time of ZeRO-1/2/3 (spec §3 volume model on the simulator's
    costs, :func:`zero_layer_time`), FastMoE and FasterMoE (shadowing + smart schedule, simulated), and
    the speedup over ZeRO-3 (and ZeRO-2) = that system's time / this row's time. ``overrides`` varies
    assumptions (:func:`fig10_sensitivity`); ``clusters`` restricts the models simulated."""
    sim_ov = tuple((k, v) for k, v in overrides if k not in PRICING_ONLY)  # no re-simulation for those
    sims = paper_layer_sims(scale, seed, sim_ov, tuple(clusters))
    wt = weighted_model_times(sims)
    sp = scale_spec(scale)
    models = [m for m in paper_layer_models(overrides).values() if m.cluster in clusters]
    rows = []
    for m in models:
        L = m.layers if sp.paper_layers is None else min(sp.paper_layers, m.layers)
        w = wt[wt.model == m.name].set_index("variant").time_ms
        for stage in (1, 2, 3):
            rows.append(dict(cluster=m.cluster, model=m.name, system=f"ZeRO-{stage}",
                             time_ms=1e3 * L * zero_layer_time(stage, m, overrides=overrides),
                             source="spec §3 volume model on the simulator's costs (analytic)"))
        rows.append(dict(cluster=m.cluster, model=m.name, system="FastMoE", time_ms=float(w["fastmoe"]),
                         source="moelab.sim (EP plan)"))
        rows.append(dict(cluster=m.cluster, model=m.name, system="FasterMoE", time_ms=float(w["both"]),
                         source="moelab.sim (shadow policy + smart schedule)"))
    df = pd.DataFrame(rows)
    z3 = df[df.system == "ZeRO-3"].set_index("model").time_ms
    z2 = df[df.system == "ZeRO-2"].set_index("model").time_ms
    df["speedup_vs_zero3"] = df.model.map(z3) / df.time_ms
    df["speedup_vs_zero2"] = df.model.map(z2) / df.time_ms
    df["layers"] = df.model.map({m.name: (m.layers if sp.paper_layers is None else min(sp.paper_layers, m.layers))
                                 for m in models})
    df.attrs["label"] = ("SIMULATED: johnny (16 GPUs) / trevor (64 GPUs) profiles, SUBSTITUTE T2 traces; "
                         "ZeRO priced analytically (spec §3 volume model, the least trustworthy numbers, spec §6.16)")
    return mark_assumptions(df, "fig10", overrides)


def fig10_full_iteration(scale, seed: int = 0) -> pd.DataFrame:
    """Whole-iteration makespans (all layers, attention included) of EP, FasterMoE and ZeRO-1/2/3 from the
    simulator, when a ``"zero"`` simulator graph is registered (empty frame otherwise)."""
    try:
        import moelab.strategies.zero  # noqa: F401  (registers the "zero" graph when it exists)

        zero_graph = get_graph("zero")
    except Exception:  # noqa: BLE001 - no zero graph (yet): the analytic Fig. 10 stands alone
        return pd.DataFrame(columns=["cluster", "model", "system", "makespan_ms", "speedup_vs_zero3"])
    sp = scale_spec(scale)
    rows = []
    for m in paper_layer_models().values():
        L = m.layers if sp.paper_layers is None else min(sp.paper_layers, m.layers)
        tr = paper_trace(m, [sp.trace_iters[-1]], L, seed)[0]
        prof = sim_profile(m.cluster)
        opts = paper_variant_options(m.cluster)
        for name, o in (("FastMoE", opts["fastmoe"]), ("FasterMoE", opts["both"])):
            res = simulate(fastermoe_iteration_graph(_paper_layer_config(m, L, o), prof, tr))
            rows.append(dict(cluster=m.cluster, model=m.name, system=name, makespan_ms=1e3 * res.makespan))
        for stage in (1, 2, 3):
            cfg = _paper_layer_config(m, L, {}).with_overrides({"parallel.strategy": "zero",
                                                                 "parallel.strategy_options": {"stage": stage}})
            try:
                res = simulate(zero_graph(cfg, prof, tr))
            except Exception as e:  # noqa: BLE001 - a zero graph that cannot price this config is reported
                rows.append(dict(cluster=m.cluster, model=m.name, system=f"ZeRO-{stage}", makespan_ms=np.nan,
                                 error=repr(e)[:200]))
                continue
            rows.append(dict(cluster=m.cluster, model=m.name, system=f"ZeRO-{stage}", makespan_ms=1e3 * res.makespan))
    df = pd.DataFrame(rows)
    z3 = df[df.system == "ZeRO-3"].set_index("model").makespan_ms
    df["speedup_vs_zero3"] = df.model.map(z3) / df.makespan_ms
    df.attrs["label"] = "SIMULATED: whole iterations (moelab.sim graphs ep/fastermoe/zero), SUBSTITUTE T2 traces"
    return mark_assumptions(df, "fig10")


def zero_available() -> bool:
    """True when moelab has the ZeRO baseline strategy (``parallel.strategy: zero``)."""
    return "zero" in known_strategies()


def fig10_real(scale) -> pd.DataFrame:
    """Fig. 10 (a): REAL whole-model training steps of the tiny MoE-GPT (the convergence model, 2 nodes with
    EMULATED links) under FastMoE, FasterMoE (shadowing + smart schedule) and ZeRO-1/2/3 (moelab's
    ``zero`` strategy, when present): median step time (slowest rank) after one warm-up step, speedup
    over ZeRO-3. Whole iterations on a tiny model (attention, head and dense all-reduce included), so
    the ratios are not the paper's MoE-layer ratios."""
    sp = scale_spec(scale)
    systems = {"FastMoE": {}, "FasterMoE": {"parallel.strategy": "fastermoe",
                                            "parallel.strategy_options": dict(FASTERMOE_OPTS)}}
    if zero_available():
        for st in (1, 2, 3):
            systems[f"ZeRO-{st}"] = {"parallel.strategy": "zero", "parallel.strategy_options": {"stage": st}}
    cfgs = {n: _conv_config(sp, {**ov, "train.iters": sp.e2e_iters + 1}) for n, ov in systems.items()}
    per_rank = run_ranks(_conv_rank, sp.conv_nproc, [c.to_dict() for c in cfgs.values()], timeout=1800)
    rows = []
    for i, name in enumerate(cfgs):
        t = np.max([per_rank[r][i]["times"] for r in range(sp.conv_nproc)], axis=0)[1:]
        rows.append(dict(system=name, step_ms=1e3 * float(np.median(t)), min_ms=1e3 * float(t.min()),
                         max_ms=1e3 * float(t.max()), final_loss=float(per_rank[0][i]["losses"][-1])))
    df = pd.DataFrame(rows)
    if "ZeRO-3" in set(df.system):
        z3 = float(df.set_index("system").step_ms["ZeRO-3"])
        df["speedup_vs_zero3"] = z3 / df.step_ms
    c = next(iter(cfgs.values()))
    df.attrs["label"] = (f"EMULATED links: {sp.conv_nproc} ranks gloo (2 nodes x {sp.conv_nproc // 2}, intra "
                         f"{sp.intra_GBps:g} / inter {sp.inter_GBps:g} GB/s per rank), "
                         f"tiny MoE-GPT L={c.model.n_layers} "
                         f"d={c.model.d_model}, 16 experts, whole training steps")
    df.attrs["missing"] = [] if zero_available() else ["ZeRO (moelab has no zero strategy)"]
    return df


def fig13_breakdown(scale, seed: int = 0) -> pd.DataFrame:
    """Fig. 13 (b): speedup over FastMoE of shadowing, the smart schedule and both, per paper model
    (SIMULATED, MoE-layer replay, time-weighted over the trace iterations)."""
    wt = weighted_model_times(paper_layer_sims(scale, seed))
    rows = []
    for (cl, model), g in wt.groupby(["cluster", "model"], sort=False):
        t = g.set_index("variant").time_ms
        for v in ("shadow", "smart", "both"):
            rows.append(dict(cluster=cl, model=model, variant=v, fastmoe_ms=float(t["fastmoe"]),
                             time_ms=float(t[v]), speedup=float(t["fastmoe"] / t[v])))
    df = pd.DataFrame(rows)
    df.attrs["label"] = "SIMULATED: johnny / trevor profiles, SUBSTITUTE T2 traces (MoE-layer replay)"
    return mark_assumptions(df, "fig13")


def fig13_breakdown_real(scale, trace: Optional[str] = None) -> pd.DataFrame:
    """Fig. 13 (a): the same speedups measured on the REAL layer suite (EMULATED links)."""
    s = layer_suite(scale, trace)
    med = suite_medians(s)
    rows = []
    for v, name in (("shadow", "shadow"), ("smart_gs2", "smart"), ("both", "both")):
        if v in med:
            rows.append(dict(variant=name, fastmoe_ms=1e3 * med["fastmoe"], time_ms=1e3 * med[v],
                             speedup=float(med["fastmoe"] / med[v])))
    df = pd.DataFrame(rows)
    dec = shadow_decisions(s, "both")  # "shadow" and "both" run the same policy on the same loads
    note = shadowing_note(dec)
    df.attrs.update(label=f"{s['label']}; {note}", shadowing=note, fired=bool((dec.n_shadowed > 0).any()))
    return df


