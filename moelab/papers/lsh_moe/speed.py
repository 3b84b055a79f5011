"""Paper-scale speed of LSH-MoE (SIMULATED): Table 2's "Speed" column (GPT-MoE 15B/52B fine-tuning on the
V100 cluster) and Table 3's samples/s (Swin-MoE-L on the A100 cluster).

One uncompressed EP step and one LSH-MoE step of the same model on balanced loads, the LSH step's
all-to-alls priced on ``centroid_counts(loads, rho)`` (each group's bounds kept) with its hashing op, at
two rates: the one measured on the substitute (CP L=6, r=2 on the trained tiny model's rows: Fig. 7
middle; ``rho_source`` "measured on the substitute", the comparison that tests the paper) and the paper's
own, read from paper.yaml (``rate_at_L6`` for Table 2, ``swin_rate`` for Table 3; ``rho_source``
"paper (<key>)": a value that takes the paper's number as its input, so never evidence for it). Both
accountings: experts on centroids (what the runtime does) and experts on every token (the paper's analysis,
§6.8). Constants: MFU assumed, NIC efficiency as fitted in Fig. 3 (on the A100 cluster; reused for the V100
one: an assumption).

Fig. 6's *simulated time* (spec §4 Fig. 6 (ii)): :func:`simulated_time` prices each variant's step at paper
scale (RoBERTa-MoE on lsh_v100, T5-MoE on lsh_a100) at the rate the variant measured in its run, and
multiplies it by the iterations that run needed to the equal perplexity.
"""
from __future__ import annotations

import pandas as pd

from moelab.papers.kit.cache import cached
from moelab.papers.kit.compare import paper_value

from . import rates, share

MEASURED = "measured on the substitute"


def paper_rate(key: str) -> tuple:
    """``(rho_source, rho)`` of the paper's own rate ``key`` of paper.yaml (read there, never typed)."""
    return f"paper ({key})", paper_value("lsh_moe", key)


def step_times(model: str, profile: str, servers: int, tokens_per_gpu: int, rho: float, mfu: float, eta: float) -> dict:
    """Seconds of one EP step and of LSH-MoE steps at ``rho`` (experts on centroids / on tokens)."""
    from moelab.sim import simulate
    from moelab.sim.graphs import ep_iteration_graph
    from moelab.strategies.lsh_moe.hashing import max_buckets
    from moelab.strategies.lsh_moe.sim_graph import centroid_counts, lsh_moe_iteration_graph

    cfg, prof, loads = share.paper_step(model, servers, mfu, eta, tokens_per_gpu=tokens_per_gpu, profile=profile)
    gpus = cfg.parallel.nproc
    cen = centroid_counts(loads, rho, max_buckets("cross_polytope", 2, 6))
    ep = simulate(ep_iteration_graph(cfg, prof, loads)).makespan
    on_c = simulate(lsh_moe_iteration_graph(cfg, prof, loads, centroids=cen)).makespan
    on_t = simulate(lsh_moe_iteration_graph(cfg, prof, loads, centroids=cen, experts_on_centroids=False)).makespan
    return dict(ep_s=ep, lsh_s=on_c, lsh_tokens_s=on_t, seqs_per_gpu=cfg.train.batch_size, gpus=gpus,
                rho_effective=float(cen.sum() / loads.sum()))


def measured_rho(scale) -> float:
    """The substitute's rate at the paper's setting (CP, L=6, r=2, trained rows)."""
    df = rates.rate_sweep(scale)
    row = df[(df.source == "trained") & (df.family == "cross_polytope") & (df.r == 2) & (df.L == 6)]
    return float(row.rho.iloc[0])


@cached
def table2_speed(scale) -> pd.DataFrame:
    """Speedup of LSH-MoE over EP per GPT-MoE model on lsh_v100 (16 GPUs) at the measured and the paper's rate."""
    f = share.fit(scale)
    A = share.assumptions()
    rows = []
    for model in ("GPT-MoE-15B", "GPT-MoE-52B"):
        for which, rho in ((MEASURED, measured_rho(scale)), paper_rate("rate_at_L6")):
            t = step_times(model, "lsh_v100", 2, int(A.value("tokens_per_gpu_glue")), rho, f["mfu"], f["eta"])
            rows.append(dict(model=model, rho_source=which, rho=rho, rho_effective=t["rho_effective"],
                             speedup=t["ep_s"] / t["lsh_s"], speedup_experts_on_tokens=t["ep_s"] / t["lsh_tokens_s"],
                             ep_step_ms=t["ep_s"] * 1e3, lsh_step_ms=t["lsh_s"] * 1e3))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("SIMULATED lsh_v100 (16 V100, 100 Gb/s), "
                         "GPT-MoE 15B/52B fine-tuning steps on balanced loads, "
                         f"{int(A.value('tokens_per_gpu_glue'))} tokens per GPU (assumed), MFU {f['mfu']:.2f} assumed, "
                         f"eta_n {f['eta']:.2f} as fitted on lsh_a100 in Fig. 3 (reused: an assumption)")
    return df


@cached
def table3_speed(scale) -> pd.DataFrame:
    """Samples/s of the Swin-MoE-L stand-in on lsh_a100 (32 GPUs) uncompressed and with LSH-MoE."""
    f = share.fit(scale)
    A = share.assumptions()
    tokens = int(A.value("tokens_per_gpu_swin"))
    rows = []
    for which, rho in ((MEASURED, measured_rho(scale)), paper_rate("swin_rate")):
        t = step_times("Swin-MoE-L", "lsh_a100", 4, tokens, rho, f["mfu"], f["eta"])
        images = t["gpus"] * tokens / 196  # 196 stage-3 tokens per image
        rows.append(dict(rho_source=which, rho=rho, rho_effective=t["rho_effective"],
                         samples_per_s_origin=images / t["ep_s"], samples_per_s_lsh=images / t["lsh_s"],
                         speedup=t["ep_s"] / t["lsh_s"], speedup_experts_on_tokens=t["ep_s"] / t["lsh_tokens_s"]))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"SIMULATED lsh_a100 (32 A100, 200 Gb/s): the uniform Swin-MoE-L stand-in, {tokens} "
                         f"tokens per GPU (assumed), MFU {f['mfu']:.2f} assumed, eta_n {f['eta']:.2f} fitted in Fig. 3")
    return df


FIG6 = {"lm": ("RoBERTa-MoE", "lsh_v100", 2), "span": ("T5-MoE", "lsh_a100", 4)}  # spec §4 Fig. 6: 16 V100 / 32 A100


def fig6_tokens(task: str) -> int:
    """Tokens per GPU per step of Fig. 6's model (assumptions: the paper gives no batch size)."""
    A = share.assumptions()
    return int(A.value("tokens_per_gpu_t5") if task == "span" else A.value("tokens_per_gpu_roberta"))


def simulated_time(summary: pd.DataFrame, task: str, scale) -> pd.DataFrame:
    """Fig. 6's *simulated time* (spec §4 Fig. 6 (ii)) beside the EMULATED one: ``summary``
    (:func:`moelab.papers.lsh_moe.quality.summary` of the substitute's runs) with, per variant,

    - ``sim_step_s``: one step of the paper's model on the paper's cluster (:data:`FIG6`) priced at the rate
      the variant measured in its run (Origin: the uncompressed EP step), experts on centroids;
    - ``sim_time_to_equal_s``: the substitute's iterations to the equal perplexity times ``sim_step_s``
      (``origin_sim_time_to_equal_s``: Origin's, to the same level);
    - ``sim_time_speedup_to_target``: their ratio, the paper's metric in simulated time;
      ``sim_time_speedup_experts_on_tokens``: the same with experts on every token (the paper's accounting).

    The iterations are a tiny substitute's, not the paper model's: the result is a trend check, never a
    paper-scale ratio."""
    f = share.fit(scale)
    model, profile, servers = FIG6[task]
    tokens = fig6_tokens(task)
    out = summary.copy()
    on_c, on_t = [], []
    for rho in out.rho:
        t = step_times(model, profile, servers, tokens, min(float(rho), 1.0), f["mfu"], f["eta"])
        compressed = float(rho) < 1.0
        on_c.append(t["lsh_s"] if compressed else t["ep_s"])
        on_t.append(t["lsh_tokens_s"] if compressed else t["ep_s"])
    o = list(out.variant).index("Origin")
    t_o, t_o_tok = on_c[o], on_t[o]
    i_v = pd.to_numeric(out.iters_to_equal, errors="coerce")
    i_o = pd.to_numeric(out.origin_iters_to_equal, errors="coerce")
    out["sim_step_s"] = on_c
    out["sim_time_to_equal_s"] = i_v * out.sim_step_s
    out["origin_sim_time_to_equal_s"] = i_o * t_o
    out["sim_time_speedup_to_target"] = out.origin_sim_time_to_equal_s / out.sim_time_to_equal_s
    out["sim_time_speedup_experts_on_tokens"] = (i_o * t_o_tok) / (i_v * pd.Series(on_t, index=out.index))
    out.attrs = dict(summary.attrs)
    out.attrs["sim"] = dict(model=model, profile=profile, gpus=8 * servers, tokens_per_gpu=tokens, mfu=f["mfu"],
                            eta=f["eta"])
    out.attrs["label"] = (summary.attrs.get("label", "") + f"; sim_* columns: SIMULATED time = the substitute's "
                          f"iterations to the equal perplexity x one {model} step on {profile} ({8 * servers} GPUs) "
                          f"priced at each variant's measured rho ({tokens} tokens per GPU and MFU {f['mfu']:.2f} "
                          f"assumed, eta_n {f['eta']:.2f} fitted in Fig. 3)")
    return out
