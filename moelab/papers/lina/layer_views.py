"""What one MoE layer does in a real training step, read from the policy runs' records (:mod:`.runs`): Fig. 1
redrawn (a layer's routing, every rank's ops of a step), and the EMULATED analogs of Figs. 2, 7, 8, 11 and 12
(one layer's forward or backward on rank 0 under a policy; every layer's forward and backward time)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.sim.result import interval_union, overlap_seconds, union_seconds

from .common import labelled as _labelled
from .runs import policy_runs

A2A_ROLES = {"fwd": ("a2a dispatch", "a2a combine"), "bwd": ("a2a combine (grad)", "a2a dispatch (grad)")}


def dp_ep_step(comm: pd.DataFrame, spans: pd.DataFrame) -> tuple:
    """Fig. 1(b) from one iteration's records of every rank: ``(timeline, counts)``. ``timeline``: rank, lane
    (pass / compute / comm), name, layer, start, end (s from the iteration's first event); a MoE layer's
    all-to-alls are named by their order in the layer's pass (forward: dispatch then combine; backward: their
    gradients in reverse), or ``all-to-all #k`` beyond two. ``counts``: all-to-all calls per (rank, layer, pass),
    counted, so a layer that does not make two says so."""
    t0 = min(comm.t_start.min(), spans.t_start.min())
    a2a = comm[comm.op == "all_to_all"].sort_values("t_start")
    k = a2a.groupby(["rank", "layer", "phase"]).cumcount()
    names = [A2A_ROLES.get(ph, ())[i] if i < len(A2A_ROLES.get(ph, ())) else f"all-to-all #{i}"
             for ph, i in zip(a2a.phase, k)]
    other = comm[comm.op != "all_to_all"]
    lanes = [pd.DataFrame({"rank": a2a["rank"], "lane": "comm", "name": names, "layer": a2a.layer,
                           "start": a2a.t_start, "end": a2a.t_done}),
             pd.DataFrame({"rank": other["rank"], "lane": "comm",
                           "name": other.op.map({"all_gather": "count exchange",
                                                 "all_reduce": "all-reduce"}).fillna(other.op),
                           "layer": other.layer, "start": other.t_start, "end": other.t_done})]
    for lane, cats in (("pass", ("forward", "backward", "comm", "optimizer")), ("compute", ("gate", "expert"))):
        sp = spans[spans.cat.isin(cats)]
        lanes.append(pd.DataFrame({"rank": sp["rank"], "lane": lane,
                                   "name": sp.name.replace({"grad_sync": "gradient drain"}),
                                   "layer": sp.layer, "start": sp.t_start, "end": sp.t_end}))
    tl = pd.concat(lanes, ignore_index=True)
    tl["start"], tl["end"] = tl.start - t0, tl.end - t0
    counts = (a2a.groupby(["rank", "layer", "phase"]).size().unstack("phase", fill_value=0)
              .reindex(columns=["fwd", "bwd"], fill_value=0).reset_index())
    counts.columns.name = None
    return tl.sort_values(["rank", "start"]).reset_index(drop=True), counts


def layer_routing(loads: pd.DataFrame, experts_per_rank: int) -> pd.DataFrame:
    """Fig. 1(a) from one MoE layer's routing: tokens per (source rank, expert) with the rank that holds the
    expert (static EP) and whether the tokens leave their rank in the dispatch (and come back in the combine)."""
    df = loads[["src", "expert", "tokens"]].copy()
    df["holder"] = df.expert // experts_per_rank
    df["moves"] = df.src != df.holder
    return df.reset_index(drop=True)


def dp_ep_frames(scale, seed=0, policy="ddp_overlap", layer=0) -> tuple:
    """Fig. 1 redrawn from the baseline's last timed iteration: (routing of MoE ``layer``, timeline, counts)."""
    pr = policy_runs(scale, seed)
    c, sp, ld = (pr[k][pr[k].policy == policy] for k in ("comm", "spans", "loads"))
    it = int(c.iter.max())
    tl, counts = dp_ep_step(c[c.iter == it], sp[sp.iter == it])
    ld = ld[(ld.iter == it) & (ld.layer == layer)]
    routing = layer_routing(ld, (ld.expert.max() + 1) // (ld.src.max() + 1))
    label = pr["comm"].attrs["label"] + f"; policy {policy}, iteration {it}"
    return (_labelled(routing, label + f", MoE layer {layer}; token counts after capacity drops"),
            _labelled(tl, label), _labelled(counts, label))


def layer_windows(comm: pd.DataFrame, spans: pd.DataFrame, phase: str) -> pd.DataFrame:
    """Each (rank, iter, MoE layer)'s ``phase`` window: the forward from its gate to its last forward all-to-all's
    finish; the backward from its first backward all-to-all's issue to its last one's finish (the experts'
    backward runs between them)."""
    a = comm[(comm.op == "all_to_all") & (comm.phase == phase) & (comm.layer >= 0)]
    g = a.groupby(["rank", "iter", "layer"])
    w = pd.DataFrame({"start": g.t_start.min(), "end": g.t_done.max(), "a2a_calls": g.size()})
    if phase == "fwd":
        gate = spans[spans.cat == "gate"].groupby(["rank", "iter", "layer"]).t_start.min()
        w["start"] = gate.reindex(w.index).fillna(w.start)
    return w.reset_index()


def layer_pass(comm: pd.DataFrame, spans: pd.DataFrame, phase: str, rank=0, busiest: bool = False) -> pd.DataFrame:
    """Figs. 2, 7, 8 (EMULATED): ``rank``'s ops during one MoE layer's ``phase`` in the last iteration, clipped to
    the window of :func:`layer_windows`: the middle layer, or (``busiest``) the one whose window overlaps the most
    all-reduce time. ``attrs``: layer, span_s, a2a_share (the all-to-alls' union over the window), allreduce_s."""
    comm, spans = comm[comm["rank"] == rank], spans[spans["rank"] == rank]
    it = int(comm.iter.max())
    comm, spans = comm[comm.iter == it], spans[spans.iter == it]
    w = layer_windows(comm, spans, phase).set_index("layer")
    ar = interval_union(zip(*[comm[comm.op == "all_reduce"][c] for c in ("t_start", "t_done")]))
    over = {l: overlap_seconds(ar, [(r.start, r.end)]) for l, r in w.iterrows()}
    layer = int(w.index[len(w) // 2])
    if busiest and max(over.values()) > 0:
        layer = int(max(over, key=over.get))
    a, b = w.loc[layer, "start"], w.loc[layer, "end"]
    c = comm[(comm.t_done > a) & (comm.t_start < b)]
    sp = spans[spans.cat.isin(["gate", "expert"]) & (spans.t_end > a) & (spans.t_start < b)]
    names = {"all_to_all": "a2a", "all_reduce": "allreduce", "all_gather": "count exchange"}
    out = pd.concat([pd.DataFrame({"rank": rank, "lane": np.where(c.op == "all_reduce", "all-reduce", "all-to-all"),
                                   "name": c.op.map(names).fillna(c.op).values, "layer": c.layer.values,
                                   "start": c.t_start.values, "end": c.t_done.values}),
                     pd.DataFrame({"rank": rank, "lane": "compute", "name": sp.cat.values, "layer": sp.layer.values,
                                   "start": sp.t_start.values, "end": sp.t_end.values})], ignore_index=True)
    out["start"], out["end"] = out.start.clip(lower=a) - a, out.end.clip(upper=b) - a
    a2a = out[out.name == "a2a"]
    out.attrs.update(layer=layer, iteration=it, span_s=b - a, allreduce_s=over[layer],
                     a2a_share=union_seconds(a2a.start, a2a.end) / (b - a))
    return out.sort_values("start").reset_index(drop=True)


def policy_layer_pass(scale, policy: str, phase: str, seed=0, busiest: bool = False) -> pd.DataFrame:
    pr = policy_runs(scale, seed)
    c, sp = (pr[k][pr[k].policy == policy] for k in ("comm", "spans"))
    out = layer_pass(c, sp, phase, busiest=busiest)
    out.attrs.update(runs_label=pr["comm"].attrs["label"], label=pr["comm"].attrs["label"] + (
        f"; policy {policy}, rank 0, iteration {out.attrs['iteration']}, MoE layer {out.attrs['layer']} ({phase})"))
    return out


def layer_times(scale, seed=0, policies=("ddp_overlap", "priority", "lina", "lina_pipe", "lina_full")) -> pd.DataFrame:
    """Figs. 11, 12 (EMULATED): per policy, the mean MoE-layer forward and backward window (:func:`layer_windows`)
    over ranks, timed iterations and layers, and each as a speedup over ``ddp_overlap``."""
    pr = policy_runs(scale, seed)
    rows = []
    for pol in policies:
        c, sp = (pr[k][pr[k].policy == pol] for k in ("comm", "spans"))
        f, b = (layer_windows(c, sp, ph) for ph in ("fwd", "bwd"))
        rows.append({"policy": pol, "moe_fwd_s": float((f.end - f.start).mean()),
                     "moe_bwd_s": float((b.end - b.start).mean()), "windows": len(f)})
    df = pd.DataFrame(rows)
    base = df.set_index("policy").loc["ddp_overlap"]
    df["moe_fwd_speedup"], df["moe_bwd_speedup"] = base.moe_fwd_s / df.moe_fwd_s, base.moe_bwd_s / df.moe_bwd_s
    return _labelled(df, pr["comm"].attrs["label"])
