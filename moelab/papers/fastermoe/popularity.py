"""FasterMoE reproduction, Figs. 3 and 4: expert parallelism on 3 REAL ranks (routing and idle time) and expert
popularity over iterations (T1 REAL tiny MoE-GPT, T2 synthetic)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.papers.kit.traces import popularity_summary, top2_shares

from .common import scale_spec
from .convergence import convergence_suite
from .suite import run_layer_suite
from .traces import t2_popularity

# ==== Fig. 3, 4, 6, 7, 8 ===========================================================================================
FIG3_COUNTS = np.array([[2, 1, 1], [3, 1, 0], [1, 2, 1]])  # expert 0: 6 = 3x expert 2 (2); spec §4 Fig. 3


def fig3_ep_example(scale, seed: int = 0):
    """Fig. 3 (a): expert parallelism on a REAL 3-rank run (gloo, 1 expert per rank, top-1 trace replay):
    the routing matrix (expert 0 gets 3x the tokens of expert 2) and, per worker, its forward expert
    compute and how long it then idles for the slowest worker. Returns ``(routing, workers)``."""
    sp = scale_spec(scale)
    mult, d = (128, 256) if sp.name == "smoke" else (256, 512)
    iters = 4
    tr = np.repeat((FIG3_COUNTS * mult)[None], iters, axis=0)
    s = run_layer_suite(tr, {"fastmoe": {}}, nodes=1, d=d, k=1, emulate=False, warmup=1, seed=seed)
    df = s["times"]
    df = df[df.iter >= 1]
    routing = pd.DataFrame([dict(source=f"worker {j}", expert=f"expert {e} (worker {e})", tokens=int(tr[0, j, e]))
                            for j in range(3) for e in range(3)])
    comp = df.groupby("rank").expert_fw_s.median()
    lay = df.groupby("rank").own_s.median()
    workers = pd.DataFrame(dict(worker=[f"worker {r}" for r in comp.index], tokens=tr[0].sum(0),
                                compute_fw_ms=1e3 * comp.values, layer_ms=1e3 * lay.values))
    workers["idle_ms"] = workers.compute_fw_ms.max() - workers.compute_fw_ms
    label = f"REAL: 3 ranks gloo (CPU), top-1 trace replay, h={s['d']}, h_ff={s['f']}"
    routing.attrs["label"] = workers.attrs["label"] = label
    return routing, workers


def fig4_popularity(scale, seed: int = 0, include_t1: bool = True):
    """Fig. 4 SUBSTITUTE (the paper's two real 16-expert models are unavailable): expert-selection share
    per iteration of (4a) T1, the REAL gate of the tiny MoE-GPT trained here with no balance loss (the
    layer whose popularity changes most), and (4b) T2, the synthetic drifting popularity (expected top-2
    shares). Returns ``(shares, summary)``; the paper's own numbers are set beside the summary by the
    paper-vs-moelab table (experiments/fastermoe/paper.yaml), not retyped here."""
    sp = scale_spec(scale)
    its = np.arange(sp.fig4_iters)
    t2 = top2_shares(t2_popularity(its, 16, layer=0, seed=seed))
    panels = []
    summ = []
    t1_label = ""
    if include_t1:
        cs = convergence_suite(sp)
        loads = cs["loads"]["FastMoE (top-2)"]  # [steps, L, N, E]
        tot = loads.sum(2).astype(np.float64)  # [steps, L, E]
        sh = tot / tot.sum(-1, keepdims=True)
        change = [np.abs(np.diff(sh[:, l], axis=0)).sum(1).mean() for l in range(sh.shape[1])]
        lay = int(np.argmax(change))
        t1 = sh[:, lay]
        panels.append((f"T1: REAL tiny MoE-GPT, layer {lay}", t1, np.arange(1, len(t1) + 1)))
        summ.append(dict(trace=f"T1 (layer {lay}, all {len(t1)} steps)", **popularity_summary(t1)))
        t1_label = f"T1 = REAL tiny MoE-GPT ({sp.conv_nproc} ranks, {sp.conv_steps} steps, no balance loss); "
    panels.append(("T2: synthetic drifting popularity", t2, its))
    rows = []
    for name, arr, it in panels:
        for e in range(arr.shape[1]):
            rows.append(pd.DataFrame(dict(trace=name, iter=it, expert=e, share=arr[:, e])))
    shares = pd.concat(rows, ignore_index=True)
    early = min(len(t2), 50)
    summ += [dict(trace="T2 (all iterations)", **popularity_summary(t2)),
             dict(trace=f"T2 (first {early} iterations)", **popularity_summary(t2[:early]))]
    summary = pd.DataFrame(summ)
    label = ("SUBSTITUTE for the paper's 16-expert models: " + t1_label
             + "T2 = synthetic random walk calibrated to the paper's Fig. 4 hot-expert share at start")
    shares.attrs["label"] = summary.attrs["label"] = label
    return shares, summary


