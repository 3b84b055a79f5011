"""Hecate reproduction, the REAL parts on gloo ranks: a short Hecate training on 2 declared nodes (Figs. 4,
5: bytes and the event order of one iteration), the 4-rank sparse collectives on visible buffers (Fig. 6),
and Alg. 2 on the recorded trace (Fig. 8)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.comm.door import Communicator
from moelab.comm.sparse import accumulate_, sp_all_gather, sp_reduce_scatter, sparse_plan
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.measure.realruns import run_real_many
from moelab.measure.validate import simulate_real
from moelab.papers.kit.cache import cached
from moelab.placement import Placement
from moelab.placement.rules import LocalityFirst
from moelab.registry import known_strategies
from moelab.runtime.ranks import run_ranks
from moelab.sim.profiles import get_profile
from moelab.strategies.hecate.policy import holders_of, homogeneous_owners, reshard_owners

from .common import ScaleSpec, scale_spec
from .trace import real_trace, trace_label

HECATE_REAL = {"t": 2, "m": 2, "reshard_interval": 3}  # small enough to see every mechanism in a few iterations
ABLATION_REAL = {"Hecate (sharding only)": {**HECATE_REAL, "materialize": False, "calibration": False},
                 "Hecate (materialization only)": {**HECATE_REAL, "shard": False}}  # Fig. 15a's ablation


def real_config(sp: ScaleSpec, strategy: str = "hecate", options=None):
    """A tiny Transformer-MoE on ``sp``'s ranks and nodes running ``strategy`` (Hecate: :data:`HECATE_REAL`)."""
    return RunConfig().with_overrides({
        "paper": "hecate", "name": strategy, "model.d_model": sp.d, "model.d_ff": 2 * sp.d, "model.n_layers": sp.layers,
        "model.n_heads": 4, "model.seq_len": sp.seq, "model.moe.num_experts": sp.experts, "model.moe.top_k": 2,
        "model.moe.balance_loss_coef": 0.0, "parallel.nproc": sp.nproc, "parallel.topology.nodes": sp.nodes,
        "parallel.strategy": strategy, "parallel.strategy_options": dict(HECATE_REAL if options is None else options),
        "train.iters": sp.iters, "train.batch_size": sp.batch, "train.trace": False}).validate()


@cached
def real_runs(scale="smoke") -> dict:
    """REAL runs of EP, Hecate and FSDP of the experts (same data, same model) on ``nodes x ranks_per_node``
    gloo ranks."""
    sp = scale_spec(scale)
    systems = {"EP": ("ep", {}), "Hecate": ("hecate", None), "Hecate-RM": ("hecate", {**HECATE_REAL, "rm": True}),
               "FSDP": ("fsdp_expert", {}),
               "FasterMoE": ("fastermoe", {"shadow": True, "smart": True, "group_size": sp.ranks_per_node}),
               "FlexMoE": ("flexmoe", {"interval": 2}), "SmartMoE": ("smartmoe", {"interval": 2}),
               **{n: ("hecate", o) for n, o in ABLATION_REAL.items()}}
    have = known_strategies()
    names = [n for n, (s, _) in systems.items() if s in have]
    runs = run_real_many([real_config(sp, *systems[n]) for n in names], sp.nproc, timeout=900)
    return dict(zip(names, runs))


def fig9_real(scale="smoke", cluster: str = "hecate_A") -> pd.DataFrame:
    """The REAL runs' own plans and loads (every system on the same gloo ranks), each iteration priced by the
    simulator with ``cluster``'s links and compute: what these plans would cost there at this model size."""
    sp = scale_spec(scale)
    prof = get_profile(cluster)
    rows = []
    for name, run in real_runs(sp.name).items():
        sim = simulate_real(run.cfg, run.loads, prof, plans=run.graph_plans())
        t = np.array([r.makespan for r in sim.results])[1:]
        fired = sum(1 for it in run.plans for r in it if (r.get("hecate", {}).get("prefetch") or r.get("shadowed")
                                                          or r.get("hecate", {}).get("moved")
                                                          or r.get("flexmoe", {}).get("steps")
                                                          or r.get("smartmoe", {}).get("moved")))
        rows.append(dict(system=name, policy_fired=fired,
                         sim_iter_ms=1e3 * float(t.mean()), real_iter_ms=1e3 * float(np.median(run.step_time_max[1:])),
                         inter_bytes=int(run.comm[run.comm.iter >= 1].bytes_inter.sum())))
    df = pd.DataFrame(rows)
    ep = df.set_index("system").loc["EP"]
    df["speedup_vs_ep"] = ep.sim_iter_ms / df.sim_iter_ms
    df["real_speedup_vs_ep"] = ep.real_iter_ms / df.real_iter_ms  # REAL: this CPU's wall clock, not cluster A
    df["model"], df["gpus"] = f"tiny (d={sp.d}, E={sp.experts})", sp.nproc
    df.attrs["label"] = (f"SIMULATED: {cluster} links and compute pricing the plans and loads of REAL runs "
                         f"on {sp.nproc} gloo ranks ({sp.nodes} declared nodes), tiny model; "
                         "real_iter_ms and real_speedup_vs_ep are REAL: "
                         "this CPU's wall clock of the same runs")
    return df


def call_device_load(rec: dict, N: int, ranks_per_node: int) -> np.ndarray:
    """Tokens each rank computes in one recorded MoE layer call: its per-source counts routed through its holders
    (Hecate: the plan's P'; otherwise EP's owners) by the locality-first dispatcher, exact integers."""
    C = np.asarray(rec["counts"], dtype=np.int64).reshape(N, -1)
    E = C.shape[1]
    holders = rec["hecate"]["holders"] if "hecate" in rec else holders_of(homogeneous_owners(1, E, N)[0])
    return Placement(E, N, tuple(tuple(int(d) for d in h) for h in holders),
                     LocalityFirst(ranks_per_node)).routes(C).sum(0)


def device_loads(scale="smoke", systems=("EP", "Hecate", "Hecate (sharding only)", "Hecate (materialization only)")):
    """Fig. 11's device load on the REAL runs: per system, iteration (after the first) and MoE layer, the tokens
    each device computes, the recorded per-source counts routed through the recorded holders by the run's rule
    (EP: the owners; Hecate: its plan's P' with the locality-first dispatcher, exact integers), as max / mean."""
    sp = scale_spec(scale)
    runs = real_runs(sp.name)
    rows = []
    for name in [n for n in systems if n in runs]:
        run = runs[name]
        N = run.cfg.parallel.nproc
        for it, recs in enumerate(run.plans):
            for rec in recs if it >= 1 else ():
                load = call_device_load(rec, N, sp.ranks_per_node)
                rows.append(dict(system=name, iter=it, layer=rec["layer"], max_tokens=int(load.max()),
                                 mean_tokens=float(load.mean()),
                                 max_over_mean=float(load.max() / max(load.mean(), 1e-9))))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (runs["EP"].label + "; tokens each rank computes per MoE layer: the recorded counts routed "
                         "through the recorded plan (exact), iterations after the first")
    return df


def bytes_by_phase(scale="smoke") -> pd.DataFrame:
    """Fig. 12's byte breakdown on the REAL runs: per system and phase, the bytes all ranks sent per iteration
    (mean over the iterations after the first) as the comm door recorded them, intra- and inter-node."""
    sp = scale_spec(scale)
    runs = real_runs(sp.name)
    rows = []
    for name, run in runs.items():
        c = run.comm[run.comm.iter >= 1]
        n_it = max(int(c.iter.nunique()), 1)
        for (phase, op), g in c.groupby([c.phase.fillna(""), c.op]):
            rows.append(dict(system=name, phase=f"{phase} {op}".strip(), bytes_intra=float(g.bytes_intra.sum()) / n_it,
                             bytes_inter=float(g.bytes_inter.sum()) / n_it))
    df = pd.DataFrame(rows)
    df["bytes"] = df.bytes_intra + df.bytes_inter
    df.attrs["label"] = runs["EP"].label + "; bytes sent per iteration, all ranks, as recorded by the comm door"
    return df


def ablation_real(scale="smoke", cluster: str = "hecate_A") -> pd.DataFrame:
    """Fig. 15a on the REAL runs: EP, sharding only, materialization only and Hecate, their recorded plans and
    loads priced by the simulator on ``cluster`` (as :func:`fig9_real`), with the wall clock beside."""
    full = fig9_real(scale, cluster)
    keep = [s for s in ("EP", *ABLATION_REAL, "Hecate") if s in set(full.system)]
    df = full.set_index("system").loc[keep].reset_index()
    df.attrs["label"] = full.attrs["label"]
    return df


def fig13_real(scale="smoke") -> pd.DataFrame:
    """Model-state memory per rank as the REAL runs measured it (Fig. 13's exact accounting, spec §4): the distinct
    storages of live parameters, gradients and optimizer state (:mod:`moelab.runtime.memory`), fp32, each category
    at its peak, the max over ranks and over the iterations after the first (whose plan has no history)."""
    sp = scale_spec(scale)
    runs = real_runs(sp.name)
    rows = []
    for name, run in runs.items():
        m = run.memory[run.memory.iter >= 1]
        rows.append(dict(system=name, **{f"{c}_MB": float(m[f"mem_{k}_peak_bytes"].max()) / 1e6
                                         for c, k in (("param", "params"), ("grad", "grads"), ("optim", "optim"))}))
    df = pd.DataFrame(rows)
    df["total_MB"] = df.param_MB + df.grad_MB + df.optim_MB
    ep = df.set_index("system").loc["EP"]
    df["param_over_ep"], df["total_over_ep"] = df.param_MB / ep.param_MB, df.total_MB / ep.total_MB
    df.attrs["label"] = (runs["EP"].label + "; model states of fp32 training (params and grads 4 B, Adam 8 B per "
                         "parameter), storage bytes of live tensors at the iteration peak; Hecate t = m = 2, "
                         "FlexMoE r = 1 holding its slot budget")
    return df


def fig4_bytes(scale="smoke") -> pd.DataFrame:
    """Bytes per MoE layer per iteration, all ranks, as the door recorded them: Hecate's spAG + spRS against
    the ``fsdp_expert`` baseline's all-gather + reduce-scatter of the same layer (beside its formula
    2(N-1)/N·S per rank) and the token all-to-alls of EP and Hecate."""
    sp = scale_spec(scale)
    runs = real_runs(sp.name)
    hec, ep, fsdp = runs["Hecate"], runs["EP"], runs["FSDP"]
    m = hec.cfg.model
    N = hec.cfg.parallel.nproc
    elem = 4
    S = m.moe.num_experts * (2 * m.d_model * m.d_ff + m.d_ff + m.d_model) * elem
    byts = lambda df: df[[c for c in df.columns if c.startswith("bytes_") and c != "bytes_local"]].sum(axis=1)  # noqa: E731
    rows = []
    for it in range(1, hec.iters):
        for layer in range(m.n_layers):
            h = hec.comm[(hec.comm.iter == it) & (hec.comm.layer == layer)]
            e = ep.comm[(ep.comm.iter == it) & (ep.comm.layer == layer)]
            f = fsdp.comm[(fsdp.comm.iter == it) & (fsdp.comm.layer == layer)]
            rows.append(dict(iter=it, layer=layer,
                             hecate_sparse=int(byts(h[h.phase.isin(["spag", "sprs", "calibrate", "spag_rm"])]).sum()),
                             hecate_a2a=int(byts(h[h.phase.isin(["fwd", "bwd"]) & (h.op == "all_to_all")]).sum()),
                             ep_a2a=int(byts(e[e.phase.isin(["fwd", "bwd"]) & (e.op == "all_to_all")]).sum()),
                             fsdp=int(byts(f[f.op.isin(["all_gather", "reduce_scatter"])]).sum()),
                             fsdp_formula=int(N * 2 * (N - 1) * S // N)))
    df = pd.DataFrame(rows)
    df.attrs["label"] = hec.label + f"; fp32; S = {S} B of experts per layer (FSDP pads it to a multiple of N)"
    return df


def event_order(scale="smoke", iteration: int = None, system: str = "Hecate") -> pd.DataFrame:
    """One iteration of ``system``'s REAL run as rows (rank, what, start, end) from the door's records and the
    recorder's spans: attention (forward; backward start marks), gate, experts, spAG issue -> wait, spRS,
    all-to-alls; times from the iteration's first event."""
    sp = scale_spec(scale)
    hec = real_runs(sp.name)[system]
    it = iteration if iteration is not None else hec.iters - 1
    c = hec.comm[hec.comm.iter == it]
    s = hec.spans[(hec.spans.iter == it) & hec.spans.name.isin(["attention", "attention.bwd.start", "experts", "gate"])]
    rows = [dict(rank=r.rank, what=f"{r.phase} {r.op}".strip(), layer=r.layer, start=r.t_start, end=r.t_done,
                 kind="comm")
            for r in c.itertuples()]
    rows += [dict(rank=r.rank, what=r.name, layer=r.layer, start=r.t_start, end=max(r.t_end, r.t_start + 1e-5),
                  kind="compute") for r in s.itertuples()]
    df = pd.DataFrame(rows)
    t0 = df.start.min()
    df["start_ms"], df["end_ms"] = 1e3 * (df.start - t0), 1e3 * (df.end - t0)
    why = "no overlap gain on 2 cores: spec §2.8"  # not a paper number: a section of the spec
    df.attrs["label"] = hec.label + f"; iteration {it}; wall clock ({why})"
    return df.drop(columns=["start", "end"]).sort_values(["rank", "start_ms"]).reset_index(drop=True)


# ---- Fig. 6: the sparse collectives on visible buffers ---------------------------------------------------------------
FIG6_P = ((0,), (1,), (2,), (3,))
FIG6_PP = ((0, 1, 2), (1,), (2, 3), (3, 0))  # the paper's flavour: some chunks to some devices


def _fig6_rank(rank, world):
    import torch

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, 2), groups={"sparse": [list(range(world))]})
    plan = sparse_plan(FIG6_P, FIG6_PP, rank, world, 2)
    owned = {e: torch.full((1,), 10.0 * (e + 1)) for e in range(4) if FIG6_P[e][0] == rank}
    got = sp_all_gather(comm, plan, owned, 1, torch.float32, async_op=False)
    grads = {e: torch.full((1,), float(rank + 1)) for e in got}
    red = sp_reduce_scatter(comm, plan, grads, 1, torch.float32, async_op=False)
    sums = {e: float(accumulate_(torch.full((1,), float(rank + 1)), red.get(e))) for e in owned}
    return dict(before={e: float(v) for e, v in owned.items()}, after={**{e: float(v) for e, v in owned.items()},
                                                                       **{e: float(v) for e, v in got.items()}},
                sums=sums, bytes_in=sum(v for r in comm.rec.comm[:1] for q, v in r.recv_from.items() if q != rank))


@cached
def fig6_buffers() -> pd.DataFrame:
    """REAL, 4 gloo ranks (2 declared nodes): chunk c of device d before spAG (owners only), after spAG(P, P')
    (replicas hold the owner's bytes), and after spRS(P', P) with every holder contributing (rank + 1)."""
    res = run_ranks(_fig6_rank, 4, timeout=120)
    rows = []
    for d, r in enumerate(res):
        for c in range(4):
            rows.append(dict(device=d, chunk=c, before=r["before"].get(c), after_spag=r["after"].get(c),
                             after_sprs=r["sums"].get(c)))
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("REAL: 4 ranks gloo (2 declared nodes), moelab.comm.sparse a2a backend, "
                         "fp32 chunks of 1 element")
    return df


# ---- Fig. 8: Alg. 2 on the recorded trace ----------------------------------------------------------------------------
def fig8_sharding(scale="smoke", t: int = 1, window: int = 5) -> pd.DataFrame:
    """Homogeneous (EP) vs heterogeneous (Alg. 2) sharding of the REAL trace's last window, 4 devices in 2
    nodes: per layer and device the experts owned and their load (the pure function the runtime calls)."""
    sp = scale_spec(scale)
    tr = real_trace(sp.name)
    L, N, E = tr.shape[1], tr.shape[2], tr.shape[3]
    F = tr[-window:].sum(axis=(0, 2))  # [L, E]
    homo = homogeneous_owners(L, E, N)
    het = reshard_owners(F, t, homo, N, 2)
    rows = []
    for kind, owners in (("homogeneous", homo), ("heterogeneous", het)):
        for l in range(L):
            for d in range(N):
                mine = [e for e in range(E) if owners[l][e] == d]
                rows.append(dict(sharding=kind, layer=l, device=d, experts=len(mine), load=int(F[l][mine].sum()),
                                 owned=",".join(map(str, mine))))
    df = pd.DataFrame(rows)
    df.attrs["label"] = trace_label(sp) + f"; Alg. 2 (t={t}, window {window}) on its last iterations, 2 nodes x 2"
    return df


def max_over_mean(frame: pd.DataFrame) -> pd.DataFrame:
    g = frame.groupby(["sharding", "layer"]).load
    out = (g.max() / g.mean()).rename("max_over_mean").reset_index()
    out.attrs["label"] = frame.attrs["label"]
    return out
