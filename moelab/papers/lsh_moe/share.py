"""Fig. 3: the share of a training step spent in all-to-all.

SIMULATED (lsh_a100, the uncompressed EP step priced by ``moelab.sim``): of the two constants the paper does
not give, the achieved fraction of peak FLOPs (MFU) is an assumption (the spec's worked example) and the
achieved fraction of the NIC bandwidth (eta_n) is *fitted* to Fig. 3(a)'s three bars (16 GPUs; paper.yaml
``a2a_share_roberta``, ``a2a_share_gpt15b``, ``a2a_share_swin``, read from there) — the share depends on the two
almost only through their ratio, so fitting both would be ill-posed. The fit is data too: assumptions.yaml's
``eta_n`` (kind fitted, ``fitted_to`` those keys) records the smoke-scale result and gives the search interval
(its ``range``); :func:`fit` reports whether the run-time value equals the record;
(b) 32 GPUs and (c) 16 GPUs with twice the experts are then *predicted* with those constants and set
beside the paper's "nearly constant". A model with fewer experts than GPUs (RoBERTa-MoE's 16 on 32) runs
expert parallelism over groups of E GPUs, data parallel across them (an assumption: the paper does not say;
the experts' gradient all-reduce is not priced), so its share is its 16-GPU one.
The tokens per GPU and the Swin-MoE-L stand-in are assumptions
(``experiments/lsh_moe/assumptions.yaml``). Eq. 9's closed form is shown beside each bar.

REAL / EMULATED: the measured share of tiny models on 2 and 4 gloo ranks, without and with emulated
links (time inside the all-to-all records over the step time).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from moelab.config import ModelConfig, MoEConfig, RunConfig
from moelab.measure.realruns import run_real_many
from moelab.models.params import paper_model
from moelab.papers.kit.assumptions import Assumptions, load_assumptions
from moelab.papers.kit.cache import cached
from moelab.papers.kit.compare import paper_value
from moelab.sim import simulate
from moelab.sim.graphs import ep_iteration_graph, moe_layer_ids
from moelab.sim.profiles import get_profile
from moelab.strategies.lsh_moe.analysis import a2a_compute_ratio

from . import common

PAPER_A_KEYS = {"RoBERTa-MoE": "a2a_share_roberta", "GPT-MoE-15B": "a2a_share_gpt15b",
                "Swin-MoE-L": "a2a_share_swin"}  # model -> paper.yaml key of its Fig. 3(a) bar (the fit's targets)
FIT_RTOL = 5e-3  # the run-time eta_n "equals" the recorded one within this relative difference (the record is rounded)


def paper_a() -> dict:
    """model -> the paper's Fig. 3(a) all-to-all share, read from paper.yaml (the fit's targets)."""
    return {m: paper_value("lsh_moe", k) for m, k in PAPER_A_KEYS.items()}


SETUPS = {"a": (2, 1), "b": (4, 1), "c": (2, 2)}  # setup -> (servers of 8 GPUs, expert multiplier)


@functools.lru_cache(maxsize=1)
def _base_assumptions() -> Assumptions:
    return load_assumptions("lsh_moe", root=Path(__file__).resolve().parent)


def assumptions(overrides: tuple = ()) -> Assumptions:
    """LSH-MoE's constants as data; ``overrides``: ``((name, value), ...)`` (hashable, so cached experiments can
    take it) replaces some values (checked against their ranges), e.g. for a gap ladder's rung."""
    A = _base_assumptions()
    return A.with_values(dict(overrides)) if overrides else A


def model_config(name: str, overrides: tuple = ()):
    """The Table 1 config (``moelab.models.params``), or the Swin-MoE-L stand-in (the paper gives none):
    a uniform 24-layer transformer at Swin-L's stage-3 width, MoE every other layer, 32 experts, top-2,
    49 tokens per window-sequence (Swin's 7x7 windows)."""
    if name != "Swin-MoE-L":
        return paper_model(name)
    A = assumptions(overrides)
    d = int(A.value("swin_d_model"))
    return ModelConfig(arch="bert", vocab_size=1000, d_model=d, d_ff=4 * d, n_layers=24, n_heads=d // 32, seq_len=49,
                       moe_every=2, moe=MoEConfig(num_experts=32, top_k=2, gate="topk", expert_bias=True))


TOKENS = {"RoBERTa-MoE": "tokens_per_gpu_roberta", "GPT-MoE-15B": "tokens_per_gpu_gpt",
          "Swin-MoE-L": "tokens_per_gpu_swin"}


def paper_step(name: str, servers: int, mfu: float, eta: float, *, expert_mult: int = 1, tokens_per_gpu=None,
               profile: str = "lsh_a100", overrides: tuple = ()):
    """``(cfg, profile, loads)`` of one uncompressed step of ``name`` on ``servers`` nodes of ``profile`` at
    (MFU, eta_n): balanced loads (the share at its floor); ``tokens_per_gpu`` defaults to the model's
    assumption. Fewer experts than GPUs: EP over groups of E GPUs, data parallel across them. ``overrides``: see
    :func:`assumptions`."""
    m = model_config(name, overrides)
    m.moe.num_experts *= expert_mult
    tokens = int(tokens_per_gpu if tokens_per_gpu is not None else assumptions(overrides).value(TOKENS[name]))
    gpus = min(8 * servers, m.moe.num_experts)
    cfg = RunConfig()
    cfg.model = m
    cfg = cfg.with_overrides({"parallel.nproc": gpus, "parallel.topology.nodes": max(1, gpus // 8),
                              "train.batch_size": max(1, tokens // m.seq_len)})
    base = get_profile(profile)
    prof = dataclasses.replace(base, nodes=cfg.parallel.topology.nodes, achieved_flops=mfu * base.peak_flops,
                               inter_bw_GBps=eta * base.inter_bw_GBps)  # the node's NICs, shared by its GPUs (§6.12)
    E, k = m.moe.num_experts, m.moe.top_k
    T = cfg.train.batch_size * m.seq_len
    return cfg, prof, np.full((len(moe_layer_ids(m)), gpus, E), T * k // E, dtype=np.int64)


def a2a_share(name: str, servers: int, expert_mult: int, mfu: float, eta: float, overrides: tuple = ()) -> float:
    """All-to-all time / step time of one uncompressed EP iteration on lsh_a100 at (MFU, eta_n)."""
    return sim_a2a_share(simulate(ep_iteration_graph(*paper_step(name, servers, mfu, eta, expert_mult=expert_mult,
                                                                   overrides=overrides))))


def sim_a2a_share(result) -> float:
    """All-to-all time / step time of a simulated iteration (the Fig. 3 definition)."""
    ops = result.ops_frame()
    return float(ops[ops.category == "a2a"].duration.sum() / result.makespan)


@cached
def fit(scale, overrides: tuple = ()) -> dict:
    """eta_n minimising the squared error of Fig. 3(a)'s three shares (read from paper.yaml) at the assumed MFU:
    a log grid over assumptions.yaml's ``eta_n`` range, then a finer one around its best point (``at_edge`` says
    when the best is a grid end). eta_n multiplies the node's stated 200 Gb/s shared by its 8 GPUs (spec §6.12):
    above 1 it says the GPUs had more inter-node bandwidth than that (up to 8: a 200 Gb/s path per GPU).

    ``recorded`` is ``eta_n``'s recorded value (the smoke-scale fit) and ``matches_record`` whether this fit
    equals it within :data:`FIT_RTOL`; a mismatch warns (the record is stale: refit and update
    assumptions.yaml) and Fig. 3's notes say so."""
    s = common.scale_spec(scale)
    A = assumptions(overrides)
    mfu = float(A.value("mfu"))
    lo, hi = A["eta_n"].range  # the fit's search interval
    targets = paper_a()
    err = lambda eta: sum((a2a_share(m, 2, 1, mfu, eta, overrides) - p) ** 2 for m, p in targets.items())  # noqa: E731
    n = 9 if s.name == "smoke" else 17
    grid = np.geomspace(lo, hi, n)
    errs = [err(e) for e in grid]
    i = int(np.argmin(errs))
    fine = np.geomspace(grid[max(i - 1, 0)], grid[min(i + 1, n - 1)], 7)
    ferrs = [err(e) for e in fine]
    j = int(np.argmin(ferrs))
    eta, recorded = float(fine[j]), float(A.value("eta_n"))
    matches = abs(eta / recorded - 1.0) <= FIT_RTOL
    if not matches:
        warnings.warn(f"lsh_moe Fig. 3 fit at scale {s.name}: eta_n {eta:.4g} differs from the value recorded in "
                      f"experiments/lsh_moe/assumptions.yaml ({recorded:.4g}): update the record", stacklevel=2)
    return dict(mfu=mfu, eta=eta, rmse=float(np.sqrt(ferrs[j] / len(targets))), at_edge=i in (0, n - 1),
                recorded=recorded, matches_record=matches)


BAR_OF = {"GPT-MoE-52B": "GPT-MoE-15B"}
"""A model without a Fig. 3(a) bar -> the bar it is priced at when ``eta_n_per_model`` is set: Fig. 3 shows no
GPT-MoE 52B, and says the share stays nearly constant in larger models (Fig. 3(c), twice the experts)."""


@cached
def fit_model(model: str, overrides: tuple = ()) -> dict:
    """eta_n at which ``model``'s uncompressed step in Fig. 3(a)'s setup (16 GPUs on lsh_a100, the assumed MFU)
    spends exactly the paper's Fig. 3(a) bar for that model (read from paper.yaml) in all-to-all: bisection in
    log eta_n over eta_n's range (the share falls as eta_n grows). ``at_edge``: the bar is out of reach in the
    range (eta_n is then the nearer end). Not moelab's setting: a gap ladder's rung (``eta_n_per_model``)."""
    A = assumptions(overrides)
    mfu = float(A.value("mfu"))
    lo, hi = (float(np.log(v)) for v in A["eta_n"].range)
    target = paper_a()[model]
    excess = lambda log_eta: a2a_share(model, 2, 1, mfu, float(np.exp(log_eta)), overrides) - target  # noqa: E731
    above_at_hi, below_at_lo = excess(hi) > 0, excess(lo) < 0
    if above_at_hi:
        lo = hi
    elif below_at_lo:
        hi = lo
    while hi - lo > 1e-7:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    eta = float(np.exp(0.5 * (lo + hi)))
    return dict(model=model, mfu=mfu, eta=eta, target=target, share=a2a_share(model, 2, 1, mfu, eta, overrides),
                at_edge=bool(above_at_hi or below_at_lo))


def constants(scale, model: str, overrides: tuple = ()) -> dict:
    """``(mfu, eta, eta_source)`` pricing ``model`` at paper scale: the joint fit of Fig. 3(a)'s three bars
    (:func:`fit`, moelab's setting), or, with the assumption ``eta_n_per_model`` set, eta_n fitted to the model's
    own bar (:func:`fit_model`; :data:`BAR_OF` for a model without one; a model with neither keeps the joint fit)."""
    f = fit(scale, overrides)
    bar = BAR_OF.get(model, model)
    if not assumptions(overrides).value("eta_n_per_model") or bar not in PAPER_A_KEYS:
        return dict(mfu=f["mfu"], eta=f["eta"], eta_source="joint fit of Fig. 3(a)")
    g = fit_model(bar, overrides)
    return dict(mfu=g["mfu"], eta=g["eta"], eta_source=f"fitted to Fig. 3(a)'s {bar} bar")


@cached
def fig3(scale) -> pd.DataFrame:
    """One row per (setup, model): simulated share at the fitted constants, the paper's (a) bar, Eq. 9's
    all-to-all/compute ratio turned into a share ``r / (1 + r)`` at the same constants."""
    f = fit(scale)
    prof = get_profile("lsh_a100")
    paper = paper_a()
    rows = []
    for setup, (servers, mult) in SETUPS.items():
        for name in paper:
            m = model_config(name)
            share = a2a_share(name, servers, mult, f["mfu"], f["eta"])
            ep = paper_step(name, servers, f["mfu"], f["eta"], expert_mult=mult)[0].parallel.nproc
            B = f["eta"] * prof.inter_bw_GBps * 1e9 / prof.gpus_per_node / prof.elem_bytes  # elements/s per GPU
            r = a2a_compute_ratio(m.moe.top_k, m.d_model, max(1, ep // 8), f["mfu"] * prof.peak_flops, B)
            rows.append(dict(setup=setup, gpus=8 * servers, ep_gpus=ep, experts=m.moe.num_experts * mult, model=name,
                             share=share, paper_share=paper[name] if setup == "a" else None,
                             role="fit" if setup == "a" else "prediction", eq9_share=r / (1 + r)))
    df = pd.DataFrame(rows)
    A = assumptions()
    df.attrs["fit"] = f
    df.attrs["label"] = ("SIMULATED lsh_a100 (uncompressed EP, balanced loads): "
                         f"MFU {f['mfu']:.2f} assumed, NIC efficiency "
                         f"eta_n {f['eta']:.3f} FITTED to Fig. 3(a) (rms error {f['rmse']:.3f}); (b), (c) predicted; "
                         f"tokens per GPU {int(A.value('tokens_per_gpu_roberta'))}/"
                         f"{int(A.value('tokens_per_gpu_gpt'))}/"
                         f"{int(A.value('tokens_per_gpu_swin'))} and the Swin-MoE-L stand-in are assumptions")
    return df


@cached
def measured(scale) -> pd.DataFrame:
    """REAL and EMULATED share of the all-to-all in tiny masked-LM MoE steps on 2 and 4 gloo ranks."""
    s = common.scale_spec(scale)
    rows = []
    for nproc in (2, 4):
        cfgs = []
        for emulate in (False, True):
            over = {**common.tiny_overrides(s, iters=max(3, s.q_eval_every)), "parallel.nproc": nproc,
                    "parallel.topology.nodes": 2, "emulation.enabled": emulate, "emulation.intra_bw_GBps": s.intra_GBps,
                    "emulation.inter_bw_GBps": s.inter_GBps, "emulation.intra_latency_us": s.latency_us,
                    "emulation.inter_latency_us": s.latency_us}
            cfgs.append(RunConfig().with_overrides(over).validate())
        for emulate, run in zip((False, True), run_real_many(cfgs, nproc, timeout=600)):
            c = run.comm
            c = c[c.iter >= 1]  # iteration 0 pays the warm-up
            a2a = c[c.op == "all_to_all"].assign(d=lambda f: f.t_done - f.t_start).groupby(["iter", "rank"]).d.sum()
            step = pd.Series(run.step_times[1:].max(axis=1), index=range(1, len(run.step_times)))
            per_iter = a2a.groupby("iter").max() / step
            rows.append(dict(ranks=nproc, links="EMULATED" if emulate else "REAL loopback",
                             share=float(per_iter.median()), step_ms=float(step.median() * 1e3)))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"EMULATED (and REAL loopback rows): tiny bert-MoE (d={s.d}, {s.experts} experts) "
                         "on 2 and 4 gloo ranks as 2 nodes; "
                         f"emulated links {s.intra_GBps}/{s.inter_GBps} GB/s; median over iterations after the first")
    return df
