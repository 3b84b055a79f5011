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

The hashing is priced at ``hash_functions`` cross-polytope functions of dimension ``cp_dim`` (assumptions.yaml;
``hash_full_rotation`` prices Eq. 3's rotation of the whole d_model space instead). Every function takes
``overrides`` (``((assumption, value), ...)``, see :func:`moelab.papers.lsh_moe.share.assumptions`), so a gap ladder
(:mod:`.ladders`) can move one assumption at a time. Table 3's frame also carries the evidence behind the
``speedup_min`` row's ``contradicted`` (paper.yaml): the all-to-all share of moelab's uncompressed Swin step, the
Amdahl speedup of the all-to-all bytes alone at the rate, and the extra time per step the paper's speedup needs.

Fig. 6's *simulated time* (spec §4 Fig. 6 (ii)): :func:`simulated_time` prices each variant's step at paper
scale (RoBERTa-MoE on lsh_v100, T5-MoE on lsh_a100) at the rate the variant measured in its run, and
multiplies it by the iterations that run needed to the equal perplexity.
"""
from __future__ import annotations

import pandas as pd

from moelab.papers.kit.cache import cached
from moelab.papers.kit.compare import paper_value
from moelab.sim import simulate
from moelab.sim.graphs import ep_iteration_graph
from moelab.strategies.lsh_moe.hashing import max_buckets
from moelab.strategies.lsh_moe.sim_graph import centroid_counts, lsh_moe_iteration_graph

from . import common, rates, share

MEASURED = "measured on the substitute"


def paper_rate(key: str) -> tuple:
    """``(rho_source, rho)`` of the paper's own rate ``key`` of paper.yaml (read there, never typed)."""
    return f"paper ({key})", paper_value("lsh_moe", key)


GLUE_MODELS = ("GPT-MoE-15B", "GPT-MoE-52B")  # Table 2's speed columns: the V100 cluster, 2 servers (16 GPUs)
SWIN_MODEL = "Swin-MoE-L"  # Table 3: the A100 cluster, 4 servers (32 GPUs)
SWIN_TOKENS_PER_IMAGE = 196  # stage-3 tokens per 224-px image (patch 4, two merges): tokens_per_gpu_swin's unit


def hashing(model: str, overrides: tuple = ()) -> tuple:
    """``(L, r)`` the simulator prices LSH-MoE's hashing at: ``hash_functions`` functions of dimension ``cp_dim``,
    or of the model's d_model with ``hash_full_rotation`` set (Eq. 3: a rotation of the whole space)."""
    A = share.assumptions(overrides)
    L = int(A.value("hash_functions"))
    r = share.model_config(model, overrides).d_model if A.value("hash_full_rotation") else int(A.value("cp_dim"))
    return L, r


def step_times(model: str, profile: str, servers: int, tokens_per_gpu: int, rho: float, mfu: float, eta: float, *,
               overrides: tuple = ()) -> dict:
    """Seconds of one EP step and of LSH-MoE steps at ``rho`` (experts on centroids / on tokens), the EP step's
    all-to-all share and the hashing ops' seconds per rank (in the experts-on-centroids step)."""
    cfg, prof, loads = share.paper_step(model, servers, mfu, eta, tokens_per_gpu=tokens_per_gpu, profile=profile,
                                        overrides=overrides)
    gpus = cfg.parallel.nproc
    L, r = hashing(model, overrides)
    bmax = min(max_buckets("cross_polytope", r, L), int(loads.max()))  # a bound above every group's rows binds none
    cen = centroid_counts(loads, rho, bmax)
    ep = simulate(ep_iteration_graph(cfg, prof, loads))
    on_c = simulate(lsh_moe_iteration_graph(cfg, prof, loads, centroids=cen, num_hashes=L, cp_dim=r))
    on_t = simulate(lsh_moe_iteration_graph(cfg, prof, loads, centroids=cen, experts_on_centroids=False,
                                            num_hashes=L, cp_dim=r)).makespan
    ops = on_c.ops_frame()
    return dict(ep_s=ep.makespan, lsh_s=on_c.makespan, lsh_tokens_s=on_t, seqs_per_gpu=cfg.train.batch_size, gpus=gpus,
                rho_effective=float(cen.sum() / loads.sum()), a2a_share_ep=share.sim_a2a_share(ep),
                hash_s=float(ops[ops.category == "lsh"].duration.sum() / gpus))


def measured_rho(scale, overrides: tuple = ()) -> float:
    """The substitute's rate at the paper's setting (CP, ``hash_functions`` functions of dimension ``cp_dim``, or
    the substitute's full width with ``hash_full_rotation``; trained rows)."""
    A = share.assumptions(overrides)
    L = int(A.value("hash_functions"))
    r = common.scale_spec(scale).d if A.value("hash_full_rotation") else int(A.value("cp_dim"))
    df = rates.rate_sweep(scale)
    row = df[(df.source == "trained") & (df.family == "cross_polytope") & (df.r == r) & (df.L == L)]
    if row.empty:
        raise ValueError(f"lsh_moe: scale {getattr(scale, 'name', scale)}'s rate sweep has no CP row at r={r}, L={L}")
    return float(row.rho.iloc[0])


def experiment_rate(scale, key: str, overrides: tuple = ()) -> float:
    """The rate a headline row prices: the substitute's (:func:`measured_rho`, moelab's setting), or with the
    assumption ``rate_from_paper`` set, the rate the paper states for that experiment (paper.yaml ``key``)."""
    if share.assumptions(overrides).value("rate_from_paper"):
        return paper_value("lsh_moe", key)
    return measured_rho(scale, overrides)


def glue_step(scale, model: str, rho: float, overrides: tuple = ()) -> dict:
    """:func:`step_times` of a Table 2 model on lsh_v100 (16 GPUs) at ``rho``, with ``speedup`` (EP over LSH-MoE,
    experts on centroids) and the (MFU, eta_n) it was priced at."""
    A = share.assumptions(overrides)
    c = share.constants(scale, model, overrides)
    t = step_times(model, "lsh_v100", 2, int(A.value("tokens_per_gpu_glue")), rho, c["mfu"], c["eta"],
                   overrides=overrides)
    return {**t, **c, "speedup": t["ep_s"] / t["lsh_s"]}


def swin_step(scale, rho: float, overrides: tuple = ()) -> dict:
    """:func:`step_times` of the Swin-MoE-L stand-in on lsh_a100 (32 GPUs) at ``rho``, with ``speedup``."""
    A = share.assumptions(overrides)
    c = share.constants(scale, SWIN_MODEL, overrides)
    t = step_times(SWIN_MODEL, "lsh_a100", 4, int(A.value("tokens_per_gpu_swin")), rho, c["mfu"], c["eta"],
                   overrides=overrides)
    return {**t, **c, "speedup": t["ep_s"] / t["lsh_s"]}


def amdahl(p: float, rho: float) -> float:
    """Amdahl's speedup when only the all-to-all time (share ``p`` of the step) shrinks to ``rho`` of itself."""
    return 1.0 / ((1.0 - p) + p * rho)


@cached
def table2_speed(scale, overrides: tuple = ()) -> pd.DataFrame:
    """Speedup of LSH-MoE over EP per GPT-MoE model on lsh_v100 (16 GPUs) at the measured and the paper's rate."""
    f = share.fit(scale, overrides)
    A = share.assumptions(overrides)
    rows = []
    for model in GLUE_MODELS:
        for which, rho in ((MEASURED, measured_rho(scale, overrides)), paper_rate("rate_at_L6")):
            t = glue_step(scale, model, rho, overrides)
            rows.append(dict(model=model, rho_source=which, rho=rho, rho_effective=t["rho_effective"],
                             speedup=t["speedup"], speedup_experts_on_tokens=t["ep_s"] / t["lsh_tokens_s"],
                             ep_step_ms=t["ep_s"] * 1e3, lsh_step_ms=t["lsh_s"] * 1e3,
                             a2a_share_ep=t["a2a_share_ep"],
                             amdahl_speedup=amdahl(t["a2a_share_ep"], t["rho_effective"]),
                             hash_share=t["hash_s"] / t["ep_s"]))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("SIMULATED lsh_v100 (16 V100, 100 Gb/s), "
                         "GPT-MoE 15B/52B fine-tuning steps on balanced loads, "
                         f"{int(A.value('tokens_per_gpu_glue'))} tokens per GPU (assumed), MFU {f['mfu']:.2f} assumed, "
                         f"eta_n {f['eta']:.2f} as fitted on lsh_a100 in Fig. 3 (reused: an assumption)")
    return df


@cached
def table3_speed(scale, overrides: tuple = ()) -> pd.DataFrame:
    """Samples/s of the Swin-MoE-L stand-in on lsh_a100 (32 GPUs) uncompressed and with LSH-MoE, and the evidence
    columns of ``speedup_min``'s ``contradicted`` (paper.yaml):

    - ``a2a_share_ep``: the all-to-all share of moelab's uncompressed step (the (b) Swin-MoE-L bar of Fig. 3's
      32-GPU prediction: eta_n fitted to Fig. 3(a));
    - ``amdahl_speedup``: ``1 / ((1 - p) + p·rho)`` at that share: the speedup of shrinking the all-to-all bytes
      alone (experts on every token, hashing free), a floor under what the LSH step saves;
    - ``hash_share``: moelab's priced hashing, centroid and decompression ops per rank / the uncompressed step;
    - ``implied_a2a_share``: the share at which Amdahl gives the paper's ``speedup_min`` at this rate;
    - ``overhead_needed``: the time per step, as a share of the uncompressed step, that LSH-MoE would have to add
      to the Amdahl step for the paper's ``speedup_min`` to hold (``1/S_paper - 1/amdahl_speedup``)."""
    f = share.fit(scale, overrides)
    A = share.assumptions(overrides)
    tokens = int(A.value("tokens_per_gpu_swin"))
    s_paper = paper_value("lsh_moe", "speedup_min")
    rows = []
    for which, rho in ((MEASURED, measured_rho(scale, overrides)), paper_rate("swin_rate")):
        t = swin_step(scale, rho, overrides)
        images = t["gpus"] * tokens / SWIN_TOKENS_PER_IMAGE
        p, rho_e = t["a2a_share_ep"], t["rho_effective"]
        bound = amdahl(p, rho_e)
        rows.append(dict(rho_source=which, rho=rho, rho_effective=rho_e,
                         samples_per_s_origin=images / t["ep_s"], samples_per_s_lsh=images / t["lsh_s"],
                         speedup=t["speedup"], speedup_experts_on_tokens=t["ep_s"] / t["lsh_tokens_s"],
                         a2a_share_ep=p, amdahl_speedup=bound, hash_share=t["hash_s"] / t["ep_s"],
                         implied_a2a_share=(1.0 - 1.0 / s_paper) / (1.0 - rho_e),
                         overhead_needed=1.0 / s_paper - 1.0 / bound))
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
