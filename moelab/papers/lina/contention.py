"""The baseline's contention at paper scale: how much all-reduce the SIMULATED ``ddp_overlap`` step puts beside
its backward all-to-alls, the contention Lina's priority scheduler removes (the paper's Figs. 2 and 4).

Per paper configuration (Table 1's models x E = 2..16), on the calibrated profile with the fitted gamma
(:mod:`.paper_scale`): the all-to-all share of a MoE layer's forward (Fig. 2), the backward all-to-alls per step
and how many of them an all-reduce overlaps, the DDP buckets (PyTorch's reducer rule after its first step's
rebuild: parameters in gradient-ready order, a first bucket of 1 MiB, then ``bucket_MB`` MiB, a bucket closed once
it reaches its cap: :func:`moelab.runtime.update.bucket_groups`) and how many launch before backward ends, per
backward all-to-all, and the overlapped ops' slowdown over the same op alone (Fig. 4). Beside them, what any
schedule of the same all-reduce bytes could win at most (the ``bound_*`` columns: the backward all-to-alls and
the step with the all-reduce out of the way, priced by the ``after_backward`` policy, whose one all-reduce runs
alone after backward). The paper's numbers sit beside them, read from ``experiments/lina/paper.yaml``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.sim.graphs import dense_param_count, moe_layer_ids
from moelab.sim.result import interval_union, overlap_seconds, union_seconds

from . import paper_scale as ps
from .common import cached, paper


def _row(layers: int, E: int) -> dict:
    cfg = ps.paper_config(layers, E, "ddp_overlap")
    res = ps._simulate(cfg)
    df = res.ops_frame()
    ar = df[df.category == "allreduce"]
    bwd = df[df.phase == "bwd"]
    back_end = float(bwd[bwd.kind == "compute"].end.max())
    a2a = df[(df.category == "a2a") & (df.phase == "bwd")]
    ar_union = interval_union(zip(ar.start, ar.end))
    over = [overlap_seconds(ar_union, [(a, b)]) for a, b in zip(a2a.start, a2a.end)]
    fwd_a2a = df[(df.category == "a2a") & (df.phase == "fwd")]
    shares = []
    for _, _, a, b in res.moe_layer_spans(moe_layer_ids(cfg.model), ("fwd",)):
        w = fwd_a2a[(fwd_a2a.end > a) & (fwd_a2a.start < b)]
        shares.append(union_seconds(np.maximum(w.start.values, a), np.minimum(w.end.values, b)) / (b - a))
    m = cfg.model
    emb = (m.vocab_size + m.seq_len) * m.d_model  # the (tied) token and the position embeddings: ready last
    in_bwd = int((ar.start < back_end - 1e-12).sum())
    nbytes = [o.comm["nbytes"] for o in res.graph.ops if o.category == "allreduce"]
    alone = ps._simulate(ps.paper_config(layers, E, "after_backward")).ops_frame()  # one all-reduce, after backward
    t_ar = float(alone[alone.category == "allreduce"].duration.sum())
    floor_bwd = float(alone[(alone.category == "a2a") & (alone.phase == "bwd")].duration.sum())
    gamma = ps.fitted_gamma()["gamma"]
    return {"layers": layers, "experts": E, "a2a_share_moe_fwd": float(np.mean(shares)),
            "dense_grad_MB": dense_param_count(cfg.model) * 2 / 1e6, "embedding_grad_MB": emb * 2 / 1e6,
            "dense_grad_MB_per_layer": (dense_param_count(cfg.model) - emb) * 2 / 1e6 / layers,
            "buckets": len(nbytes), "largest_bucket_MB": max(nbytes) / 1e6,
            "buckets_launched_in_backward": in_bwd, "bwd_a2a": len(a2a),
            "overlapped_bwd_a2a": int(np.sum(np.array(over) > 0)),
            "buckets_per_bwd_a2a": in_bwd / len(a2a),
            "bwd_a2a_time_overlapped": float(np.sum(over) / a2a.duration.sum()),
            "dense_allreduce_alone_ms": 1e3 * t_ar, "bwd_a2a_ms": 1e3 * float(a2a.duration.sum()),
            "bwd_a2a_alone_ms": 1e3 * floor_bwd,
            # what any schedule of the same all-reduce bytes can win at most (no packing, no pipelining): the
            # backward all-to-alls alone, the step without its all-reduce
            "bound_bwd_a2a_speedup": float(a2a.duration.sum()) / floor_bwd,
            "bound_step_speedup": float(res.makespan) / (float(alone.end.max()) - t_ar),
            # the slowdown the backward all-to-alls could endure at most if every dense byte moved beside them
            # (fluid sharing at 1/(2 gamma): an all-reduce of t alone delays the all-to-all by (2 gamma - 1) t)
            "bound_bwd_a2a_slowdown_all_overlapped": (floor_bwd + (2 * gamma - 1) * t_ar) / floor_bwd,
            # how many times the dense all-reduce would have to be as long for every backward all-to-all to endure
            # Fig. 4's median slowdown
            "allreduce_needed_for_median":
                (paper("bwd_a2a_slowdown_median") - 1) * floor_bwd / ((2 * gamma - 1) * t_ar)}


@cached
def baseline_contention() -> pd.DataFrame:
    """One row per paper configuration (Table 1's models x E = 2..16, :data:`.paper_scale.PAPER_GRID`, at every
    scale: gamma's fit prices them all anyway): the baseline's contention figures (module docstring), the
    overlapped backward all-to-alls' median and max slowdown at the fitted gamma (NaN where none overlaps), and
    the paper's Fig. 2 share and Fig. 4 median beside them."""
    models, experts = ps.PAPER_GRID
    out = pd.DataFrame([_row(n, E) for n in models for E in experts])
    slow = ps._slowdowns(ps.fitted_gamma()["gamma"], ps._alone(models, experts))
    stats = slow[slow.overlapped].groupby(["layers", "experts"]).slowdown.agg(["median", "max"])
    key = list(zip(out.layers, out.experts))
    out["slowdown_median"] = [stats["median"].get(k, np.nan) for k in key]
    out["slowdown_max"] = [stats["max"].get(k, np.nan) for k in key]
    out["paper_a2a_share_moe_fwd"] = paper("layer_a2a_share")
    out["paper_slowdown_median"] = paper("bwd_a2a_slowdown_median")
    out.attrs["label"] = ps.sim_label() + "; policy ddp_overlap (the baseline); the paper's numbers are references"
    return out


def notes(df: pd.DataFrame) -> list:
    """What the contention table says, in words (fig4s's notes)."""
    per = df.overlapped_bwd_a2a / df.bwd_a2a
    return [f"the baseline's contention (SIMULATED, ddp_overlap): {int(df.overlapped_bwd_a2a.sum())} of "
            f"{int(df.bwd_a2a.sum())} backward all-to-alls overlap an all-reduce ({per.min():.1%}-{per.max():.1%} per "
            f"configuration); {df.buckets_launched_in_backward.min()}-{df.buckets_launched_in_backward.max()} DDP "
            f"buckets launch before backward ends ({df.buckets_per_bwd_a2a.max():.3f} per backward all-to-all at "
            f"most); the dense gradients are {df.dense_grad_MB_per_layer.min():.2f}-"
            f"{df.dense_grad_MB_per_layer.max():.2f} MB per layer (fp16), so one 25 MiB bucket spans about "
            f"{25 * 2**20 / 1e6 / df.dense_grad_MB_per_layer.max():.0f} layers: with PyTorch DDP's own bucket rule "
            "the all-reduce can meet at most about one backward all-to-all per bucket",
            f"all-to-all share of a MoE layer's forward: {df.a2a_share_moe_fwd.min():.1%}-"
            f"{df.a2a_share_moe_fwd.max():.1%} (paper, Fig. 2: {100 * paper('layer_a2a_share'):.1f} %)",
            f"what the contention costs: the baseline's backward all-to-alls take {df.bound_bwd_a2a_speedup.min():.3f}-"
            f"{df.bound_bwd_a2a_speedup.max():.3f}x their time alone (what priority could win on them); even with "
            "every dense byte beside a backward all-to-all they would be "
            f"{df.bound_bwd_a2a_slowdown_all_overlapped.min():.2f}-"
            f"{df.bound_bwd_a2a_slowdown_all_overlapped.max():.2f}x slower at the fitted gamma (paper, Fig. 4: median "
            f"{paper('bwd_a2a_slowdown_median'):.2f}x, the Fig. 13 speedup {paper('bwd_a2a_E4'):.2f}x at E = 4); "
            f"the all-reduce would have to be {df.allreduce_needed_for_median.min():.1f}-"
            f"{df.allreduce_needed_for_median.max():.1f}x as long for Fig. 4's median on every backward all-to-all; "
            "any schedule of the same bytes (no packing, no pipelining) wins at most "
            f"{df.bound_step_speedup.max():.3f}x on the step (paper: +priority "
            f"{paper('ablation_priority_emulated'):.2f}x, "
            f"+partition {paper('ablation_partition_E4'):.2f}-{paper('ablation_partition_E16'):.2f}x)"]
