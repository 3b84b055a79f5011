"""FasterMoE reproduction, Fig. 5: the DDL-Roofline, SIMULATED on johnny with the performance model and measured
on CPU ranks (EMULATED links) from the layer suite."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from moelab.strategies.fastermoe import perf_model as pm
from moelab.strategies.fastermoe import roofline as rl
from moelab.strategies.fastermoe.shadow import select_shadows

from .common import cluster_preset, policy_constants
from .suite import _shadow_comm, _suite_warmup, layer_suite, suite_cluster, suite_medians
from .traces import t2_counts


# ==== Fig. 5: DDL-Roofline =========================================================================================
def fig5_roofline(scale, seed: int = 0, h: int = 1024, h_ff: int = 2048, tokens: int = 1024, iteration: int = 500):
    """Fig. 5 (b): the DDL-Roofline on the johnny tree (perf model, spec §2.3), ``h=1024, h_ff=2048``,
    1024 tokens x 2 per worker, T2 counts at ``iteration``: DP (synchronous and overlapped), MP, EP,
    EP + shadowing (arrow 1), EP + smart schedule (arrow 2), EP + both. Returns ``(points, lines)``;
    Theta in TFLOP/s per worker, rho = per-iteration totals (spec [R])."""
    cl = cluster_preset("johnny")
    C = t2_counts([iteration], 1, 16, 16, tokens, seed)[0, 0]
    c = policy_constants("johnny")
    S = select_shadows(C, h, h_ff, c["P"], c["W_net"])
    pts = rl.roofline_points(C, tokens * 2, h, h_ff, cl, shadowed=S)
    sh = [p for p in pts if p.name == "EP+shadow"][0]
    pts.append(rl.smart_point(sh, sh.Tc / 3, sh.Tm / 4, name="EP+shadow+smart"))
    rows = [dict(name=p.name, rho=p.rho, theta_TFLOPs=p.theta / 1e12, T_e2e_ms=1e3 * p.T_e2e, Tc_ms=1e3 * p.Tc,
                 Tm_ms=1e3 * p.Tm, ideal_TFLOPs=float(rl.ideal(p.rho, cl.P)) / 1e12,
                 semi_ideal_TFLOPs=float(rl.semi_ideal(p.rho, cl.P)) / 1e12) for p in pts]
    points = pd.DataFrame(rows)
    points.attrs["shadowed"] = list(S)
    points.attrs["imbalance"] = float(pm.worker_loads(C).mean() / pm.worker_loads(C).max())
    rho = np.logspace(-2, 2, 200)
    lines = pd.DataFrame(dict(rho=rho, ideal_TFLOPs=rl.ideal(rho, cl.P) / 1e12,
                              semi_ideal_TFLOPs=rl.semi_ideal(rho, cl.P) / 1e12))
    label = (f"SIMULATED: perf model on the johnny tree (16 V100-PCIe, P={cl.P / 1e12:g} TFLOP/s), h={h}, h_ff={h_ff}, "
             f"{tokens}x2 assignments per worker, SUBSTITUTE T2 counts (iteration {iteration}); shadowed {list(S)}")
    points.attrs["label"] = lines.attrs["label"] = label
    return points, lines


def fig5_roofline_measured(scale, trace: Optional[str] = None):
    """Fig. 5 (a): measured points of the REAL layer suite (EMULATED links): Theta from the measured
    iteration time, rho from the calibrated model (measured P, emulated bandwidths), with this machine's
    own ideal / semi-ideal lines (roof = the measured per-rank P). Returns ``(points, lines)``."""
    s = layer_suite(scale, trace)
    med = suite_medians(s)
    cl = suite_cluster(s)
    P, h, f, N = s["P_eff"], s["d"], s["f"], s["N"]
    warm = _suite_warmup(s)
    df = s["times"]
    rows = []
    for v, shadow, smart in (("fastmoe", False, False), ("shadow", True, False), ("smart_gs2", False, True),
                             ("both", True, True)):
        if v not in med:
            continue
        g = df[(df.variant == v) & (df["rank"] == 0) & (df.iter >= warm)]
        its = g.iter.tolist()
        rhos, thetas, tcs, tms = [], [], [], []
        for it, t_meas, S in zip(its, g.time_s, g.shadowed):
            C = s["trace"][it]
            Cd, local = rl.shadow_counts(C, list(S) if shadow else [])
            loads = pm.worker_loads(Cd) + local
            Tc = 3 * pm.compute_time_from_loads(loads, h, f, P)
            Tm = 4 * cl.a2a_time(Cd, h) + (_shadow_comm(cl, S, h, f, E_local=C.shape[1] // N) if shadow else 0.0)
            rhos.append(Tc / Tm)
            thetas.append(rl.theta(h, f, C.sum(), N, t_meas))
            tcs.append(Tc)
            tms.append(Tm)
        rows.append(dict(name={"fastmoe": "EP (FastMoE)", "shadow": "EP+shadow", "smart_gs2": "EP+smart",
                               "both": "EP+shadow+smart"}[v], variant=v, rho=float(np.median(rhos)),
                         theta_GFLOPs=float(np.median(thetas)) / 1e9, T_meas_ms=1e3 * float(med[v]),
                         Tc_model_ms=1e3 * float(np.median(tcs)), Tm_model_ms=1e3 * float(np.median(tms)),
                         semi_ideal_GFLOPs=float(rl.semi_ideal(np.median(rhos), P)) / 1e9))
    points = pd.DataFrame(rows)
    rho = np.logspace(-2, 2, 200)
    lines = pd.DataFrame(dict(rho=rho, ideal_GFLOPs=rl.ideal(rho, P) / 1e9,
                              semi_ideal_GFLOPs=rl.semi_ideal(rho, P) / 1e9))
    label = s["label"] + f"; P = {P / 1e9:.1f} GFLOP/s per rank (measured, all ranks at once)"
    points.attrs["label"] = lines.attrs["label"] = label
    return points, lines


