"""Frames Lina's figures are drawn from, derived from the cached runs (:mod:`.runs`)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.measure.local import machine_profile
from moelab.sim.result import covered_fraction
from moelab.strategies.lina.infer import phase1_plan
from moelab.strategies.lina.options import LinaOptions
from moelab.strategies.lina.placement import top_set
from moelab.strategies.lina.popularity import pattern_share
from moelab.strategies.lina.sim_infer import InferShape, predict_served, recorded_plans, replay_latencies

from .common import labelled as _labelled
from .common import scale_spec
from .runs import FREE_LINKS, FREE_RUNS, inference_suite, policy_runs, serve_options


# ---- training (EMULATED) ------------------------------------------------------------------------------
def bwd_a2a_slowdown(scale, seed=0) -> pd.DataFrame:
    """Fig. 4: each backward all-to-all's time under a policy over the same call (rank, iteration,
    order) under ``after_backward``, where nothing overlaps it."""
    pr = policy_runs(scale, seed)
    c = pr["comm"]
    a = c[(c.op == "all_to_all") & (c.phase == "bwd")].copy()
    a["dur"] = a.t_done - a.t_start
    a["k"] = a.sort_values("t_start").groupby(["policy", "rank", "iter"]).cumcount()
    iso = a[a.policy == "after_backward"].set_index(["rank", "iter", "k"]).dur
    rows = []
    for pol in ("ddp_overlap", "priority", "lina"):
        g = a[a.policy == pol].set_index(["rank", "iter", "k"]).dur
        common = g.index.intersection(iso.index)
        rows += [{"policy": pol, "slowdown": float(g[i] / iso[i])} for i in common if iso[i] > 0]
    return _labelled(pd.DataFrame(rows), pr["comm"].attrs["label"])


def backward_timeline(scale, policy: str, seed=0, ranks=(0, 1)) -> pd.DataFrame:
    """Fig. 5: the last iteration's backward on ``ranks``: all-to-alls and all-reduces as two lanes."""
    pr = policy_runs(scale, seed)
    c = pr["comm"]
    c = c[(c.policy == policy) & c["rank"].isin(ranks)]
    c = c[c.iter == c.iter.max()]
    t0 = c.t_start.min()
    c = c[c.op.isin(["all_to_all", "all_reduce"])]
    df = pd.DataFrame({"rank": c["rank"], "lane": np.where(c.op == "all_to_all", "a2a", "all-reduce"),
                       "name": c.op + " " + c.phase.astype(str), "start": c.t_start - t0, "end": c.t_done - t0})
    return _labelled(df.reset_index(drop=True), pr["comm"].attrs["label"] + f"; policy {policy}, last iteration")


def a2a_share(scale, seed=0) -> pd.DataFrame:
    """Table 1 analog (EMULATED): the all-to-all share of the step without overlap (``after_backward``) and
    under the baseline (``ddp_overlap``): the mean all-to-all busy time over the mean step, the same iterations."""
    pr = policy_runs(scale, seed)
    df = pr["summary"][pr["summary"].policy.isin(["after_backward", "ddp_overlap"])][["policy", "step_s", "mean_step_s",
                                                                                        "a2a_s", "a2a_share"]]
    return _labelled(df.reset_index(drop=True), pr["summary"].attrs["label"])


def pipelining_efficiency(scale, seed=0, policies=("lina_pipe", "lina_full")) -> pd.DataFrame:
    """Table 3 analog (EMULATED): the paper's pipelining efficiency - the share of all-to-all time during which
    the rank's experts compute (forward and backward chunks) - per rank and iteration, averaged, for the
    pipelined policies without (``lina_pipe``, q = 1) and with packing (``lina_full``, q = 2)."""
    pr = policy_runs(scale, seed)
    c, sp = pr["comm"], pr["spans"]
    rows = []
    for pol in policies:
        a = c[(c.policy == pol) & (c.op == "all_to_all")]
        e = sp[(sp.policy == pol) & (sp.cat == "expert")]
        eff = []
        for (rank, it), g in a.groupby(["rank", "iter"]):
            x = e[(e["rank"] == rank) & (e.iter == it)]
            eff.append(covered_fraction(zip(g.t_start, g.t_done), zip(x.t_start, x.t_end)))
        eff = [v for v in eff if not np.isnan(v)]
        rows.append({"policy": pol, "experts_per_rank": LinaOptions(policy=pol).q,
                     "pipelining_eff": float(np.mean(eff)) if eff else np.nan, "samples": len(eff)})
    return _labelled(pd.DataFrame(rows), pr["comm"].attrs["label"])


def busy_and_memory(scale, seed=0, policies=("ddp_overlap", "lina_full")) -> pd.DataFrame:
    """Table 4 analog (REAL storages, EMULATED links): rank 0's compute-busy fraction of the step (its main
    thread's CPU seconds over the step's wall seconds: waits use no CPU) and its peak memory (params, grads,
    Adam, activations: live storages), per policy; no DRAM offload is modelled (the paper offloads for two
    of its models)."""
    pr = policy_runs(scale, seed)
    m = pr["metrics"]
    rows = []
    for pol in policies:
        g = m[m.policy == pol]
        rows.append({"policy": pol, "busy_fraction": float(np.median(g.cpu_main_s / g.step_time_s)),
                     "peak_mem_bytes": int(g.mem_total_peak_bytes.max())})
    df = pd.DataFrame(rows)
    base = df.set_index("policy").loc[policies[0]]
    df["busy_gain"] = df.busy_fraction - base.busy_fraction
    df["mem_ratio"] = df.peak_mem_bytes / base.peak_mem_bytes
    return _labelled(df, pr["metrics"].attrs["label"] + "; rank 0's CPU time and live storages")


# ---- inference (REAL) ---------------------------------------------------------------------------------
def serve_summary(scale, seed=0, keys=None, emulated=False, rounding="floor", yields=False, repeat=1) -> pd.DataFrame:
    """Fig. 16 (REAL; ``emulated``: served over EMULATED links): per variant, request latency p50/p95/p99
    and batch time median/p95, each also over Ideal's (``yields``, ``repeat``: see :func:`inference_suite`)."""
    su = inference_suite(scale, seed, emulated=emulated, rounding=rounding, yields=yields, repeat=repeat)
    keys = keys or [k for k in su["serve"] if not k.startswith("lina_Lp")]
    rows = []
    for k in keys:
        r = su["serve"][k]
        lat = np.array([q["latency_s"] for q in r["requests"]])
        bt = np.array([b["batch_s"] for b in r["batches"]])
        rows.append({"variant": k, "p50_latency_s": np.percentile(lat, 50), "p95_latency_s": np.percentile(lat, 95),
                     "p99_latency_s": np.percentile(lat, 99), "median_batch_s": np.median(bt),
                     "p95_batch_s": np.percentile(bt, 95), "requests": len(lat), "batches": len(bt)})
    df = pd.DataFrame(rows)
    ideal = df.set_index("variant").loc["ideal"] if "ideal" in set(df.variant) else None
    for col in ("median_batch_s", "p95_batch_s", "p50_latency_s", "p95_latency_s"):
        df[col.replace("_s", "_over_ideal")] = df[col] / ideal[col] if ideal is not None else np.nan
    return _labelled(speedups_over_baseline(df), su["label"])


def serve_predicted(scale, seed=0, emulated=False, rounding="floor", yields=False, repeat=1) -> pd.DataFrame:
    """:func:`predict_suite` of the EMULATED serve runs of :func:`serve_summary` (same arguments)."""
    return predict_suite(inference_suite(scale, seed, emulated=emulated, rounding=rounding, yields=yields,
                                         repeat=repeat))


def predict_suite(su: dict) -> pd.DataFrame:
    """The simulator's prediction of every EMULATED serve run of an inference suite (:func:`.runs._suite_rank`),
    in :func:`serve_summary`'s columns: each batch priced from the run's own recorded plans and counts
    (:func:`moelab.strategies.lina.sim_infer.predict_served`) on the emulated links, this model's compute
    rate on this host (:func:`moelab.measure.local.machine_profile`, ``compute="model"``) and the call costs
    measured in the suite's spawn after serving (held out); request latencies by replaying the run's
    batches through the batcher at the predicted batch times
    (:func:`~moelab.strategies.lina.sim_infer.replay_latencies`).
    Planning costs: each run's own allocation timed again here on the popularities it planned from (held
    out from its timeline). The serving path's own work beyond the FLOP model - per layer (``host_layer_s``:
    the interpreter's gate and permutation) and per expert a rank runs (``expert_launch_s``) - is FITTED on
    held-out runs: the static and a replicated placement served again in the same spawn over links that cost
    nothing (:data:`.runs.FREE_RUNS`, :data:`.runs.FREE_LINKS`), their batch times less the prediction of
    those runs without the two terms (:func:`_host_costs`)."""
    import dataclasses

    if "call_costs" not in su:
        raise ValueError("predict_suite prices EMULATED serve runs (inference_suite(..., emulated=...))")
    base = RunConfig.from_dict(su["config"])
    cfgs = {k: base.with_overrides(o).validate() for k, o in su["overrides"].items()}
    cfg = next(iter(cfgs.values()))
    cc, m, p = su["call_costs"], cfg.model, cfg.parallel
    prof = dataclasses.replace(machine_profile(cfg, None, compute="model"), call_overhead_s=cc["call_s"],
                               emulated_sync_s=cc["sync_s"])
    topo = Topology.from_config(p.nproc, p.topology.nodes, p.topology.ranks_per_node)
    shape = InferShape(d_model=m.d_model, d_ff=m.d_ff, seq_len=m.seq_len,
                       elem_bytes=8 if cfg.train.dtype == "float64" else 4)
    B, N = cfg.serve.batch_size, p.nproc
    io = (B * (m.seq_len + 1) * 8, N * -(-B // N) * 3 * 8)  # int64 tokens; per rank (id, token, nll) float64 rows
    free_cfgs = {k: serve_options(base.with_overrides(FREE_RUNS[k]).validate()) for k in su["free_links"]}
    host, per_expert = _host_costs(su["free_links"], prof, topo, shape, io,
                                   {k: _plan_cost(r, free_cfgs[k], N) for k, r in su["free_links"].items()})
    rows = []
    for key, run in su["serve"].items():
        if key.startswith("lina_Lp"):
            continue
        over = {"o_check_s": 0.0, "o_plan_s": _plan_cost(run, serve_options(cfgs[key]), N), "host_layer_s": host,
                "expert_launch_s": per_expert}
        bt = predict_served(run["layers"], prof, topo, shape, over, io)
        lat = replay_latencies(run["requests"], bt, B, cfgs[key].serve.max_wait_ms / 1e3)
        rows.append({"variant": key, "p50_latency_s": np.percentile(lat, 50), "p95_latency_s": np.percentile(lat, 95),
                     "p99_latency_s": np.percentile(lat, 99), "median_batch_s": float(np.median(list(bt.values()))),
                     "p95_batch_s": float(np.percentile(list(bt.values()), 95)), "o_plan_s": over["o_plan_s"],
                     "host_layer_s": host, "host_expert_s": per_expert})
    return _labelled(pd.DataFrame(rows), f"SIMULATED ({prof.name}, call {1e3 * cc['call_s']:.2f} + "
                     f"{1e3 * cc['sync_s']:.2f} ms "
                     f"measured, host work {1e3 * host:.2f} ms per layer + {1e3 * per_expert:.2f} ms per expert FITTED "
                     "on held-out runs over free links): the recorded plans of the runs")


def _plan_cost(run: dict, sv, N: int) -> float:
    """Seconds one blocking plan of ``run`` takes here: its allocation timed again on (up to 64 of) the
    popularities it planned from (held out from the run's timeline); 0 where it planned none."""
    import time

    pops = [np.asarray(json.loads(r["pop"]) if isinstance(r["pop"], str) else r["pop"]) for r in run["layers"]
            if r["planned_from"] == "actual" or r["replanned"]][:64]
    if not pops:
        return 0.0
    t = time.perf_counter()
    for pop in pops:
        phase1_plan(sv, pop, N, 0)
    return (time.perf_counter() - t) / len(pops)


def _host_costs(free_runs: dict, prof, topo, shape, io, plan_s=None) -> tuple:
    """``(host_layer_s, host_expert_s)``: least squares (both >= 0) of the held-out free-link runs' batch times
    less their prediction without those terms, on each batch's MoE layers and its experts on the busiest rank
    summed over layers (the static run holds E/N a rank, the replicated one more: the two costs separate);
    ``plan_s``: each run's blocking plan cost (:func:`_plan_cost`)."""
    import dataclasses

    free = dataclasses.replace(prof, **FREE_LINKS)  # the held-out runs' links, in the profile's own field names
    X, y = [], []
    for key0, run in free_runs.items():
        guess = predict_served(run["layers"], free, topo, shape, {"o_check_s": 0.0, "expert_launch_s": 0.0,
                                                                  "o_plan_s": (plan_s or {}).get(key0, 0.0)}, io)
        terms = {(rnd, b): [len(plans), sum(max(len(d) for d in p[0]) for p in plans)]  # layers, busiest-rank experts
                 for rnd, b, plans in recorded_plans(run["layers"])}
        for bt in run["batches"]:
            key = (bt.get("round", 0), bt["batch"])
            X.append(terms[key])
            y.append(bt["batch_s"] - guess[key])
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    fits = [np.linalg.lstsq(X, y, rcond=None)[0]]  # both terms, then each alone (a negative fit is no cost)
    fits += [np.where(np.arange(2) == i, max(0.0, float(X[:, i] @ y / (X[:, i] @ X[:, i]))), 0.0) for i in range(2)]
    ok = [f for f in fits if (f >= 0).all()]
    best = min(ok, key=lambda f: float(np.sum((X @ f - y) ** 2)))
    return float(best[0]), float(best[1])


def speedups_over_baseline(df: pd.DataFrame) -> pd.DataFrame:
    """Fig. 16's headline: the baseline's median and p95 batch time over each variant's (> 1: faster)."""
    base = df.set_index("variant").loc["baseline"] if "baseline" in set(df.variant) else None
    for col in ("median_batch_s", "p95_batch_s"):
        df[col.replace("_batch_s", "_speedup_over_baseline")] = base[col] / df[col] if base is not None else np.nan
    return df


def layer_records(scale, seed=0, key="lina", dataset="pydocs", emulated=False, rounding="floor",
                  yields=False, repeat=1) -> pd.DataFrame:
    su = inference_suite(scale, seed, dataset, emulated, rounding, yields, repeat)
    df = pd.DataFrame(su["serve"][key]["layers"])
    for col in ("pop", "pop_hat", "devs"):
        if col in df:
            df[col] = [json.loads(v) if isinstance(v, str) else v for v in df[col]]
    return _labelled(df, su["label"])


def layer_p95(scale, seed=0) -> pd.DataFrame:
    """Figs. 17, 18 (REAL): per variant and MoE layer, the p95 over batches (rank 0's view) of the layer's
    time (gate, plan, swap, dispatch, experts, combine), of its two all-to-alls and of its experts."""
    rows = []
    su = inference_suite(scale, seed)
    for k in [k for k in su["serve"] if not k.startswith("lina_Lp")]:
        df = layer_records(scale, seed, k)
        for layer, g in df.groupby("layer"):
            rows.append({"variant": k, "layer": int(layer), "p95_layer_s": float(np.percentile(g.layer_s, 95)),
                         "p95_a2a_s": float(np.percentile(g.a2a_s, 95)),
                         "p95_experts_s": float(np.percentile(g.experts_s, 95))})
    return _labelled(pd.DataFrame(rows), su["label"])


def estimation_accuracy(scale, seed=0, key="lina", k=2, dataset="pydocs", emulated=False,
                        rounding="floor", yields=False, repeat=1) -> pd.DataFrame:
    """Fig. 19 (REAL): per MoE layer, the fraction of batches whose estimated top-k set was right."""
    df = layer_records(scale, seed, key, dataset, emulated, rounding, yields, repeat)
    df = df[df.planned_from == "estimate"]
    rows = [{"layer": int(layer), "accuracy": float(np.mean([top_set(a, k) == top_set(b, k)
                                                              for a, b in zip(g.pop_hat, g["pop"])])),
             "replan_rate": float(g.replanned.mean()), "instances": len(g)} for layer, g in df.groupby("layer")]
    return _labelled(pd.DataFrame(rows), df.attrs["label"])


def path_length_table(scale, seed=0) -> pd.DataFrame:
    """Table 5 (REAL): per path length, estimation accuracy, re-plan rate, median/p95 batch time over Ideal."""
    s = scale_spec(scale)
    su = inference_suite(scale, seed)
    ideal = [b["batch_s"] for b in su["serve"]["ideal"]["batches"]]
    rows = []
    for n in s.path_lens:
        key = f"lina_Lp{n}"
        acc = estimation_accuracy(scale, seed, key)
        bt = [b["batch_s"] for b in su["serve"][key]["batches"]]
        rows.append({"path_len": int(n), "accuracy": _weighted(acc, "accuracy"),
                     "replan_rate": _weighted(acc, "replan_rate"),
                     "median_over_ideal": float(np.median(bt) / np.median(ideal)),
                     "p95_over_ideal": float(np.percentile(bt, 95) / np.percentile(ideal, 95))})
    return _labelled(pd.DataFrame(rows), su["label"])


def _weighted(acc, col):
    w = acc.instances.sum()
    return float((acc[col] * acc.instances).sum() / w) if w else np.nan


def generalization(scale, seed=0, domains=("pydocs", "pytests", "pytext")) -> pd.DataFrame:
    """Table 6 (SUBSTITUTE of four tasks on BERT and T5): per local text domain, the tiny model trained and
    served there; Lina's p95 batch time over Ideal's and its estimation accuracy (top-2 sets)."""
    rows = []
    for d in domains:
        su = inference_suite(scale, seed, d)
        acc = estimation_accuracy(scale, seed, dataset=d)
        p95 = {v: np.percentile([b["batch_s"] for b in su["serve"][v]["batches"]], 95) for v in ("ideal", "lina")}
        rows.append({"domain": d, "p95_over_ideal": float(p95["lina"] / p95["ideal"]),
                     "accuracy": _weighted(acc, "accuracy"), "replan_rate": _weighted(acc, "replan_rate"),
                     "instances": int(acc.instances.sum()), "final_loss": float(su["losses"][-1])})
    label = ("SUBSTITUTE of Table 6's tasks (BERT on IMDB/Twitter, T5 on WMT-Fr/Ru: no hub data or weights here): "
             "three local text domains, each " + inference_suite(scale, seed)["label"].replace(" on pydocs", ""))
    return _labelled(pd.DataFrame(rows), label)


def pattern(scale, seed=0) -> pd.DataFrame:
    """Fig. 9 (REAL traces): per layer n, the share of tokens following their group's k' most frequent
    next experts (k' = 1, 2), and the i.i.d. uniform level k'/E."""
    su = inference_suite(scale, seed)
    t = np.asarray(su["traces"])
    E = scale_spec(scale).i_experts
    rows = [{"layer": n, "k": k, "share": pattern_share(t, n, k), "uniform": k / E}
            for n in range(t.shape[1] - 1) for k in (1, 2)]
    return _labelled(pd.DataFrame(rows), su["label"] + " (profiling-split traces)")


def top_experts(scale, seed=0, k=4) -> pd.DataFrame:
    """Table 2 (REAL traces): the k most popular experts per MoE layer."""
    su = inference_suite(scale, seed)
    t = np.asarray(su["traces"])
    E = scale_spec(scale).i_experts
    rows = []
    for layer in range(t.shape[1]):
        c = np.bincount(t[:, layer], minlength=E)
        order = np.argsort(-c, kind="stable")[:k]
        rows.append({"layer": layer, "top": ", ".join(str(int(e)) for e in order),
                     "top_share": float(c[order].sum() / c.sum())})
    return _labelled(pd.DataFrame(rows), su["label"] + " (profiling-split traces)")


def popularity_skew(scale, seed=0) -> pd.DataFrame:
    """Fig. 6 (REAL): per MoE layer, most/least popular expert's tokens in training (last quarter of the
    iterations, with the balance loss) and at inference (per served batch, median; an expert without a
    token counts as one, so the ratio stays finite)."""
    su = inference_suite(scale, seed)
    loads = pd.DataFrame(su["loads"])
    last = loads[loads.iter >= loads.iter.max() * 3 // 4].groupby(["layer", "expert"]).tokens.sum().unstack()
    inf = layer_records(scale, seed, "baseline")
    rows = []
    for layer in sorted(inf.layer.unique()):
        tr = last.loc[layer].to_numpy(dtype=float)
        g = inf[inf.layer == layer]
        counts = np.array([p for p in g["pop"]]) * g.tokens.to_numpy()[:, None]  # tokens per expert per batch
        med = np.median(counts.max(1) / np.maximum(counts.min(1), 1.0))  # an expert with no token counts as 1
        rows.append({"layer": int(layer), "train_max_over_min": float(tr.max() / max(tr.min(), 1.0)),
                     "infer_max_over_min_median": float(med),
                     "infer_least_popular_share": float(np.median(counts.min(1) / counts.sum(1)))})
    return _labelled(pd.DataFrame(rows), su["label"])
