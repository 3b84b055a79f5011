"""Parm at paper scale (SIMULATED on ``parm_A`` / ``parm_B``) and the tables built from data.

- Table I (notation) and Table II (testbeds as profiles);
- the Table III grid through the §2.10d memory filter; per kept configuration the simulated MoE-layer
  time (fwd + bwd) of the baseline, S1, S2 and S2-AAS (:mod:`moelab.strategies.parm.sim_graph`, the
  runtime's own plans), Parm = Alg. 1's pick from alpha-beta fits *of the simulator's own collective
  curves* on that setting (no measured constant), Oracle = the faster of S1/S2;
- Table IV (cell means), Sec. VI-C (ranges, Parm over the worse of S1/S2, SAA vs AAS), Fig. 1 (the
  baseline's communication share, B-32), Fig. 7 (B-32, (4,4));
- Fig. 6 (REAL fits beside the paper's AG_MP lines and the simulator's curves), Table V (full-size
  models SIMULATED; the tiny EMULATED analog from :mod:`.real`).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.comm.costs import fit_alpha_beta
from moelab.papers.kit.assumptions import load_assumptions
from moelab.papers.kit.cache import cached
from moelab.sim import simulate
from moelab.sim.profiles import get_profile
from moelab.strategies.parm.grid import SETTINGS as GRID
from moelab.strategies.parm.grid import filtered
from moelab.strategies.parm.layout import ParmLayout
from moelab.strategies.parm.perf_model import ParmShape, paper_fits, select
from moelab.strategies.parm.plan import Shape
from moelab.strategies.parm.sim_graph import layer_time, model_fits, parm_model_graph, sim_curve

from . import real
from .common import paper, scale_spec

NOTATION = [  # (paper symbol, meaning, where moelab keeps it)
    ("P", "world size (GPUs / processes)", "parallel.nproc"),
    ("N_MP", "tensor-parallel degree of the dense parts", "strategy_options.mp"),
    ("N_ESP", "shards per expert", "strategy_options.esp"),
    ("N_EP", "expert-parallel degree, P / N_ESP", "ParmLayout.n_ep"),
    ("N_DP", "distinct micro-batches, P / N_MP", "ParmLayout.n_dp; Strategy.data_shard"),
    ("B, L", "samples per MP group, tokens per sample", "train.batch_size, model.seq_len"),
    ("M, H, h", "model width, expert hidden size, H / N_ESP", "model.d_model, model.d_ff, ParmMoE.w1.shape[-1]"),
    ("E, E_l", "experts, experts per EP rank", "model.moe.num_experts, ParmLayout.e_local"),
    ("k, f", "top-k, capacity factor", "model.moe.top_k (gate switch / gshard), model.moe.capacity_factor"),
    ("T", "capacity ceil(k f S / E) (S2: padded to a multiple of N_MP)", "parm.gating.capacity; plan.sizes"),
    ("AG/AR/RS/A2A_g", "collective time on group g", "parm.fits.COLLECTIVES (door ops on the declared groups)"),
    ("SAA", "all-to-all overlapped with the MP all-gather", "moelab.comm.saa.saa"),
    ("alpha, beta", "latency [s], time per element [s/elem]", "parm.fits.fit (OLS, SE, R^2)"),
    ("t_B, t_D1, t_D2", "modelled comm time of baseline, S1, S2", "parm.perf_model"),
]


def notation() -> pd.DataFrame:
    df = pd.DataFrame(NOTATION, columns=["symbol", "meaning", "moelab"])
    df.attrs["label"] = "REAL: moelab's names for the paper's symbols"
    return df


def testbeds() -> pd.DataFrame:
    rows = []
    for name in ("parm_A", "parm_B"):
        p = _profile(name)
        for f in ("nodes", "gpus_per_node", "gpu", "peak_flops", "achieved_flops", "intra_bw_GBps", "intra_latency_us",
                  "inter_bw_GBps", "inter_latency_us", "mem_GB", "elem_bytes"):
            rows.append(dict(profile=name, field=f, value=str(getattr(p, f)), source=p.sources.get(f, "")))
    df = pd.DataFrame(rows)
    df.attrs["label"] = "SIMULATED: the testbed profiles moelab.sim prices (B is used with 2, 4, 8 nodes)"
    return df


def _assumed(name: str, overrides: tuple = ()):
    """The value of assumption ``name`` in ``experiments/parm/assumptions.yaml``, or in ``overrides`` (a gap
    ladder's ``((name, value), ...)``, each checked against the assumption's range)."""
    a = load_assumptions("parm")
    return (a.with_values(dict(overrides)) if overrides else a).value(name)


def headline_dispatcher(overrides: tuple = ()) -> str:
    """The dispatcher of the headline rows: DeepSpeed's dense ``einsum`` unless ``dense_dispatch`` is 0 (``index``)."""
    return "einsum" if _assumed("dense_dispatch", overrides) else "index"


def _profile(name: str, nodes=None, overrides: tuple = ()):
    """Testbed ``name`` as Parm's reproduction prices it: at ``nodes`` nodes (None: the profile's), compute at
    the assumed efficiency (``compute_efficiency``)."""
    p = get_profile(name)
    eff = _assumed("compute_efficiency", overrides)
    return p.with_nodes(p.nodes if nodes is None else nodes).with_efficiency(
        eff, f"{eff:g} of peak: compute_efficiency in experiments/parm/assumptions.yaml")


def _grid_options(overrides: tuple = ()) -> dict:
    """:func:`moelab.strategies.parm.grid.configs`'s unstated k and E_l, from the assumptions file."""
    return {"k": int(_assumed("top_k", overrides)), "experts_per_rank": int(_assumed("experts_per_rank", overrides))}


def _saa_options(overrides: tuple = (), testbed: str = "A") -> dict:
    """How the simulator prices SAA at paper scale on ``testbed``: its streams, and per round either the measured
    latency of one NCCL round there (``saa_round_us_A`` / ``_B``, with the paper's two-stream kernel) or
    ``saa_phase_alpha`` of the class latency (phase by phase)."""
    streams = int(_assumed("saa_streams", overrides))
    return {"saa_phase_alpha": _assumed("saa_phase_alpha", overrides), "saa_streams": streams,
            "saa_round_s": _assumed(f"saa_round_us_{testbed}", overrides) * 1e-6 if streams == 2 else None}


def _experts(opts: dict) -> str:
    """E as the label states it."""
    return "E=P/N_ESP" if opts["experts_per_rank"] == 1 else f"E={opts['experts_per_rank']}*P/N_ESP"


# ---- the Table III grid, simulated ------------------------------------------------------------------
INDEX_STRIDE = 4  # the index dispatcher's grid is sampled 4x more sparsely (a check of P18, not the headline)


@cached
def sim_grid(scale, dispatcher: str | None = None, overrides: tuple = ()) -> pd.DataFrame:
    """Every kept configuration (every ``grid_stride``-th at small scales; the dispatcher that is not the headline's
    (:func:`headline_dispatcher`; None: that one) 4x sparser) with its simulated layer times; ``overrides``: a gap
    ladder's assumption values."""
    head = headline_dispatcher(overrides)
    dispatcher = dispatcher or head
    stride = scale_spec(scale).grid_stride * (INDEX_STRIDE if dispatcher != head else 1)
    reserve = _assumed("memory_reserve_GiB", overrides)
    opts = _grid_options(overrides)
    rows, fits = [], {}
    for setting, (prof_name, nodes, _) in GRID.items():
        prof = _profile(prof_name, nodes, overrides)
        saa = _saa_options(overrides, setting[0])
        keep, _ = filtered(setting, reserve_GiB=reserve, **opts)
        for c in keep[::stride]:
            lay = c.layout()
            key = (setting, c.n_mp, c.n_esp)
            if key not in fits:
                fits[key] = model_fits(prof, lay, **saa)
            t = {m: layer_time(prof, lay, c.shape(dispatcher), m, **saa)
                 for m in ("baseline", "s1", "s2", "s2_aas")}
            pick = select(ParmShape(c.B, c.L, c.M, c.E, c.k, c.f, c.n_mp, c.n_esp), fits[key])[0]
            rows.append(dict(dispatcher=dispatcher, setting=setting, testbed=setting[0], P=c.P, n_mp=c.n_mp,
                             n_esp=c.n_esp, B=c.B, L=c.L,
                             M=c.M, h=c.h, f=c.f, E=c.E, **{f"{m}_s": v["time_s"] for m, v in t.items()},
                             comm_share=t["baseline"]["comm_share"], pick=pick))
    df = pd.DataFrame(rows)
    df["parm_s"] = np.where(df.pick == "s1", df.s1_s, df.s2_s)
    df["oracle_s"] = np.minimum(df.s1_s, df.s2_s)
    for m in ("s1", "s2", "s2_aas", "parm", "oracle"):
        df[f"{m}_speedup"] = df.baseline_s / df[f"{m}_s"]
    df.attrs["label"] = (f"SIMULATED: parm_A / parm_B (2, 4, 8 nodes), one MoE layer fwd+bwd per kept Table III "
                         f"configuration{'' if stride == 1 else f' (every {stride}th)'}, k={opts['k']}, "
                         f"{_experts(opts)}, {dispatcher} dispatcher, fp32, compute at "
                         f"{_assumed('compute_efficiency', overrides):g} of peak (assumed); Parm = Alg. 1 on "
                         f"alpha-beta lines fitted to the simulator's own collective curves")
    return df


def grid_counts(scale) -> pd.DataFrame:
    reserve = load_assumptions("parm").value("memory_reserve_GiB")
    g = sim_grid(scale)
    rows = []
    for setting in GRID:
        keep, drop = filtered(setting, reserve_GiB=reserve, **_grid_options())
        rows.append(dict(setting=setting, configs=len(keep) + len(drop), kept=len(keep), dropped=len(drop),
                         simulated=int((g.setting == setting).sum())))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("SIMULATED: the §2.10d memory model (baseline peak within the GPU memory minus "
                         f"{reserve:g} GiB); paper: {paper('valid_configs'):.0f} valid over the four settings")
    return df


def table4(scale, overrides: tuple = (), check: bool = True) -> pd.DataFrame:
    """Cell means per setting; the headline dispatcher (:func:`headline_dispatcher`: DeepSpeed's ``einsum``) and,
    with ``check``, the other one, sampled 4x more sparsely (P18)."""
    head = headline_dispatcher(overrides)
    other = "index" if head == "einsum" else "einsum"
    g = pd.concat([sim_grid(scale, None, overrides)] + ([sim_grid(scale, other, overrides)] if check else []),
                  ignore_index=True)
    g = g[(g.n_mp > 1) & (g.n_esp > 1)]
    g = g.assign(right=(g.pick == np.where(g.s1_s <= g.s2_s, "s1", "s2")))
    df = g.groupby(["dispatcher", "setting", "n_mp", "n_esp"], sort=False).agg(
        configs=("right", "size"), s1_speedup=("s1_speedup", "mean"), s2_speedup=("s2_speedup", "mean"),
        aas_speedup=("s2_aas_speedup", "mean"), parm_speedup=("parm_speedup", "mean"),
        oracle_speedup=("oracle_speedup", "mean"), selection_accuracy=("right", "mean")).reset_index()
    df.attrs["label"] = sim_grid(scale, None, overrides).attrs["label"].replace(
        f"{head} dispatcher", f"{head} and {other} dispatchers" if check else f"{head} dispatcher")
    return df


def vic(scale, overrides: tuple = (), check: bool = True) -> pd.DataFrame:
    g = sim_grid(scale, None, overrides)
    t4 = table4(scale, overrides, check)
    t4 = t4[t4.dispatcher == headline_dispatcher(overrides)]
    multi = g[(g.n_mp > 1) | (g.n_esp > 1)]
    rows = []
    for tb in ("A", "B"):
        sub = t4[t4.setting.str.startswith(tb)]
        for m in ("s1", "s2", "parm"):
            rows.append(dict(metric=f"{m}_cell_mean_min", testbed=tb, value=sub[f"{m}_speedup"].min()))
            rows.append(dict(metric=f"{m}_cell_mean_max", testbed=tb, value=sub[f"{m}_speedup"].max()))
        gg = g[(g.testbed == tb) & (g.n_mp > 1)]
        rows.append(dict(metric="parm_over_worse", testbed=tb,
                         value=float((np.maximum(gg.s1_s, gg.s2_s) / gg.parm_s).mean())))
        rows.append(dict(metric="saa_over_aas", testbed=tb, value=float((gg.s2_aas_s / gg.s2_s).mean())))
        rows.append(dict(metric="all_beat_baseline", testbed=tb,
                         value=float(((gg.s1_speedup > 1) & (gg.s2_speedup > 1)).mean())))
    rows.append(dict(metric="parm_speedup_min_config", testbed="A+B", value=float(multi.parm_speedup.min())))
    rows.append(dict(metric="parm_cell_mean_max", testbed="A+B", value=float(t4.parm_speedup.max())))
    df = pd.DataFrame(rows)
    df.attrs["label"] = sim_grid(scale, None, overrides).attrs["label"]
    df.attrs["note"] = ("saa_over_aas > 1 means SAA (raw forwarding, the paper's kernel) beats all-to-all-then-"
                        "all-gather; all_beat_baseline is the fraction of N_MP > 1 configurations where both S1 and "
                        "S2 beat the baseline (paper: every case)")
    return df


SAA_SWEEP = (("A-8", 1), ("B-8", 2), ("B-32", 8))  # settings and node counts of the SAA sweep (Table III's)


def saa_sweep(scale=None) -> pd.DataFrame:
    """SAA against all-to-all followed by all-gather (AAS) as the simulator prices them alone, over message sizes:
    per setting and N_MP (N_ESP = 1), SAA at output ``x`` elements vs A2A_EPESP(x / N_MP) + AG_MP(x), each with its
    fixed costs (SAA as :func:`_saa_options` prices it; AAS: one class latency for the all-to-all, N_MP - 1 ring
    steps for the all-gather); ``aas_over_saa`` > 1: SAA is faster, as the paper claims (``saa_over_aas``).
    ``saa_fixed_ms``: SAA alone at the smallest size (its fixed costs)."""
    rows, how = [], ""
    for setting, nodes in SAA_SWEEP:
        prof_name, _, g = GRID[setting]
        prof = _profile(prof_name, nodes)
        opts = _saa_options((), setting[0])
        how = ("the paper's two-stream kernel, one class latency per call and saa_round_us_A / _B per round"
               if opts["saa_streams"] == 2 else
               f"phase by phase, {opts['saa_phase_alpha']:g} x the class latency per phase (saa_phase_alpha)")
        P = prof.world_size
        lat = prof.latency("inter" if nodes > 1 else "intra")
        for n_mp in (2, 4):
            lay = ParmLayout(P, n_mp, 1, P, g)
            fixed = sim_curve(prof, lay, "SAA", [1], **opts)[0]
            for e in range(12, 25, 4):
                x = 2 ** e
                saa = sim_curve(prof, lay, "SAA", [x], **opts)[0]
                a2a = sim_curve(prof, lay, "A2A_EPESP", [x // n_mp])[0]
                ag = sim_curve(prof, lay, "AG_MP", [x])[0]
                rows.append(dict(setting=setting, P=P, n_mp=n_mp, x_elems=x, saa_ms=saa * 1e3, a2a_ms=a2a * 1e3,
                                 ag_ms=ag * 1e3, aas_over_saa=(a2a + ag) / saa, saa_fixed_ms=fixed * 1e3,
                                 aas_fixed_ms=(lat + (n_mp - 1) * prof.latency("intra")) * 1e3,
                                 paper_saa_over_aas=paper("saa_over_aas")))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("SIMULATED: one SAA vs all-to-all then all-gather, alone on parm_A / parm_B, N_ESP = 1; "
                         f"SAA as {how} (assumptions)")
    return df


def fig1_share(scale) -> pd.DataFrame:
    g = sim_grid(scale)
    df = g[g.setting == "B-32"][["n_mp", "n_esp", "B", "L", "M", "h", "f", "comm_share"]]
    df = df.sort_values("comm_share").reset_index(drop=True)
    df.attrs["label"] = ("SIMULATED: parm_B, 32 GPUs, the baseline's communication share of the layer's critical "
                         "path per kept configuration" + sim_grid(scale).attrs["label"].split("configuration", 1)[1])
    return df


def fig7(scale) -> pd.DataFrame:
    g = sim_grid(scale)
    df = g[(g.setting == "B-32") & (g.n_mp == 4) & (g.n_esp == 4)].copy()
    df["above_4x"] = (df.parm_speedup > 4).astype(float)
    df = df.reset_index(drop=True)
    df.attrs["label"] = ("SIMULATED: parm_B 32 GPUs, N_MP=N_ESP=4"
                         + sim_grid(scale).attrs["label"].split("fwd+bwd", 1)[1])
    return df


# ---- Fig. 6 --------------------------------------------------------------------------------------
@cached
def fig6_frame(scale, seed: int = 0) -> tuple:
    """(points and curves, fits): REAL and EMULATED measurements at P=4 (2,2), the paper's AG_MP lines (A, B),
    the simulator's curves on parm_A / parm_B (4 ranks of one node, (2,2))."""
    suite = real.layer_suite(4, scale, seed)
    rows, fits = [], []
    for src, fs in suite["fits"].items():
        for name, f in fs.items():
            fits.append(dict(source=src, name=name, **{k: f[k] for k in ("alpha", "beta", "r2", "n")},
                             alpha_se=f.get("alpha_se", np.nan), beta_se=f.get("beta_se", np.nan)))
    xs = [2 ** e for e in scale_spec(scale).fit_exps]
    for f in fits:
        for x in xs:
            rows.append(dict(source=f["source"], name=f["name"], x=x, time_s=np.nan, fit_s=f["alpha"] + f["beta"] * x))
    for tb in ("A", "B"):
        pf = paper_fits(get_profile(f"parm_{tb}"))["AG_MP"]
        a, b = (pf.alpha, pf.beta) if hasattr(pf, "alpha") else (pf["alpha"], pf["beta"])
        for x in [2 ** e for e in range(8, 25, 2)]:
            rows.append(dict(source=f"PAPER testbed {tb}", name="AG_MP", x=x, time_s=np.nan, fit_s=a + b * x))
        fits.append(dict(source=f"PAPER testbed {tb}", name="AG_MP", alpha=a, beta=b, r2=np.nan, n=np.nan))
    for prof_name, nodes in (("parm_A", 1), ("parm_B", 1)):
        prof = _profile(prof_name, nodes)
        lay = ParmLayout(prof.world_size, 2, 2, prof.world_size // 2, prof.gpus_per_node)
        big = [2 ** e for e in range(8, 25, 2)]
        for name in ("AG_MP", "A2A_EPESP", "SAA"):
            ts = sim_curve(prof, lay, name, big)
            ab = fit_alpha_beta(big, ts)
            fits.append(dict(source=f"SIMULATED {prof_name}", name=name,
                             alpha=ab.alpha, beta=ab.beta, r2=ab.r2, n=ab.n))
            rows += [dict(source=f"SIMULATED {prof_name}", name=name, x=x, time_s=np.nan, fit_s=t)
                     for x, t in zip(big, ts)]
    df, ft = pd.DataFrame(rows), pd.DataFrame(fits)
    df.attrs["label"] = ("REAL: 4 gloo ranks (loopback) and EMULATED links, x in elements as the paper counts; PAPER: "
                         "Fig. 6's AG_MP fits; SIMULATED: parm_A / parm_B one node, (2,2)")
    ft.attrs["label"] = df.attrs["label"]
    return df, ft


# ---- Table V ---------------------------------------------------------------------------------------
TV_MODELS = {"MoE-BERT-Base": dict(seq=512, vocab=30522), "MoE-GPT-2": dict(seq=1024, vocab=50257)}


@cached
def table5_sim(scale, overrides: tuple = ()) -> pd.DataFrame:
    """Full-size models (12 layers, M=768, H=3072, MoE every other layer; k, f and B from the assumptions file:
    ``top_k``, ``table5_capacity_factor``, ``table5_batch``) on testbed A (P=8) and B (P=32), N_MP=N_ESP=4,
    E = E_l * P / N_ESP (``experts_per_rank``; 2 and 8 at E_l = 1): baseline vs Parm (Alg. 1 per layer shape,
    model fits), with the headline dispatcher (:func:`headline_dispatcher`); ``overrides``: a gap ladder's."""
    A = lambda name: _assumed(name, overrides)  # noqa: E731
    B = int(A("table5_batch"))
    k, f, e_local = int(A("top_k")), A("table5_capacity_factor"), int(A("experts_per_rank"))
    disp = headline_dispatcher(overrides)
    n_mp = n_esp = 4
    rows = []
    for tb, prof_name, nodes in (("A", "parm_A", 1), ("B", "parm_B", 8)):
        prof = _profile(prof_name, nodes, overrides)
        E = e_local * (prof.world_size // n_esp)
        lay = ParmLayout(prof.world_size, n_mp, n_esp, E, prof.gpus_per_node)
        saa = _saa_options(overrides, tb)
        fits = model_fits(prof, lay, **saa)
        for model, m in TV_MODELS.items():
            shape = Shape(S=B * m["seq"], M=768, H=3072, k=k, f=f, dispatcher=disp)
            pick, _, _ = select(ParmShape(B=B, L=m["seq"], M=768, E=E, k=k, f=f, n_mp=n_mp, n_esp=n_esp), fits)
            kw = dict(n_layers=12, seq_len=m["seq"], vocab=m["vocab"], d_ff=3072)
            t = {s: simulate(parm_model_graph(prof, lay, shape, schedule=s, **saa, **kw)).makespan
                 for s in ("baseline", pick)}
            rows.append(dict(model=model, testbed=tb, P=prof.world_size, E=E, pick=pick,
                             baseline_ms=t["baseline"] * 1e3, parm_ms=t[pick] * 1e3, speedup=t["baseline"] / t[pick]))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"SIMULATED: parm_A (8 GPUs) and parm_B (32 GPUs), Megatron TP over MP, fp32, B={B} "
                         f"(assumed), compute at {A('compute_efficiency'):g} of peak (assumed), {disp} "
                         "dispatcher; dense-DP gradient all-reduce included")
    return df


def table5_real_frame(scale, seed: int = 0) -> pd.DataFrame:
    rows = real.table5_real(scale, seed)
    df = pd.DataFrame(rows)
    out = []
    for model, g in df.groupby("model", sort=False):
        base = g[g.system.str.startswith("DeepSpeed")].iter_ms.iloc[0]
        parm = g[g.system.str.startswith("Parm")]
        out.append(dict(model=model, setup="8 gloo ranks", system="speedup", iter_ms=np.nan, std_ms=np.nan,
                        schedule=parm.schedule.iloc[0], speedup=base / parm.iter_ms.iloc[0]))
    df["setup"] = "8 gloo ranks"
    df = pd.concat([df, pd.DataFrame(out)], ignore_index=True)
    s = scale_spec(scale)
    df.attrs["label"] = (f"EMULATED: 8 gloo ranks, 2 nodes x 4, N_MP=N_ESP=4, E=2, tiny models (d={s.tv_d}, "
                         f"{s.tv_layers} layers, seq {s.tv_seq}, batch {s.tv_batch}), intra {s.intra_GBps:g} / inter "
                         f"{s.inter_GBps:g} GB/s; mean of {s.tv_iters} iterations after the first, slowest rank")
    return df

