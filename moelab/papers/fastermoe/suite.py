"""FasterMoE reproduction, the REAL layer benchmark shared by Figs. 5a, 6, 8, 11a, 12a and 13a: FasterMoE layers
on spawned gloo ranks with EMULATED 2-node links replaying a trace, every variant interleaved per iteration
and timed by the kit's harness; the perf model on the emulated network; the shadow policy's decisions."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import EmulationConfig, MoEConfig, RunConfig
from moelab.measure.validate import emulation_profile
from moelab.models.traces import routing_trace
from moelab.papers.kit.cache import cached
from moelab.papers.kit.traces import TraceGate, rescale_counts
from moelab.runtime.ranks import run_ranks
from moelab.runtime.timing import barrier, gather_floats, measure
from moelab.sim import simulate
from moelab.sim.profiles import ClusterProfile
from moelab.strategies.fastermoe import perf_model as pm
from moelab.strategies.fastermoe import roofline as rl
from moelab.strategies.fastermoe.layer import FasterMoELayer
from moelab.strategies.fastermoe.sim_graph import fastermoe_iteration_graph

from .common import moe_layer_times, scale_spec
from .convergence import _conv_tokens, convergence_suite
from .traces import t2_counts


def _emulation(intra, inter, lat):
    return EmulationConfig(enabled=True, intra_bw_GBps=intra, inter_bw_GBps=inter, intra_latency_us=lat,
                           inter_latency_us=lat)


def _measure_flops(d: int, f: int, rows: int, reps: int = 5) -> float:
    """FLOP/s of one expert FFN forward (2 GEMMs) on ``rows`` rows, this process, 1 thread."""
    w1, w2 = torch.randn(d, f) * 0.02, torch.randn(f, d) * 0.02
    x = torch.randn(max(rows, 1), d)
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.nn.functional.gelu(x @ w1) @ w2
        ts.append(time.perf_counter() - t0)
    return 4.0 * max(rows, 1) * d * f / float(np.median(ts[1:]))


def _layer_rank(rank, world, a):
    """One rank of :func:`run_layer_suite` (spawned by :func:`moelab.runtime.ranks.run_ranks`)."""
    torch.set_num_threads(1)
    topo = Topology(world, world // a["nodes"])
    emu = _emulation(a["intra"], a["inter"], a["lat"]) if a["emulate"] else None
    comm = Communicator(topo, emulation=emu)
    d, f, k, E = a["d"], a["f"], a["k"], a["E"]
    trace = np.asarray(a["trace"])  # [iters, N, E]
    # calibrate the per-rank compute rate with every rank computing at once (cores are shared), mean
    # over ranks so every rank prices the shadow policy with the same constant
    rows = int(trace[0].sum() // world) if trace.size else a["tokens"] * k
    barrier(comm)
    P_eff = float(np.mean(gather_floats(comm, _measure_flops(d, f, rows))))
    variants = {}
    for name, opts in a["variants"].items():
        o = dict(opts)
        if o.pop("_policy", False):
            o.update(shadow=True, shadow_gpu_flops=P_eff, shadow_net_bw=a["policy_W"],
                     shadow_comm_factor=a["policy_c"])
        variants[name] = o
    cfg = MoEConfig(num_experts=E, top_k=k, gate="topk", balance_loss_coef=0.0)
    layers = {}
    for name, opts in variants.items():
        layer = FasterMoELayer(d, f, cfg, comm=comm, options=opts, seed=a["seed"])
        layer.gate = TraceGate(E, k)
        layers[name] = layer
    g = torch.Generator().manual_seed(1000 + rank)
    x0 = torch.randn(a["tokens"], d, generator=g)
    rows_out, timeline = [], []
    all_iters = a["all_iters"]
    for it in range(len(trace)):
        names = list(layers) if it < all_iters else [n for n in a["long_variants"] if n in layers]
        for name in names:
            if name in a.get("timeline_only", ()) and it != a["timeline_iter"]:
                continue
            layer = layers[name]
            layer.gate.set_counts(trace[it, rank], seed=it * 1009 + rank)
            m = measure(comm, lambda: layer(x0.clone().requires_grad_()).sum().backward())
            expert_fw = sum(t1 - t0_ for nm, cat, t0_, t1, tags in m.spans
                            if cat == "expert" and tags.get("phase") == "fwd" and not nm.endswith("bwd"))
            dec = layer.last_shadow_decision  # the policy's modelled times (None: forced or off)
            rows_out.append(dict(iter=it, variant=name, rank=rank, time_s=m.time.slowest_s, own_s=m.time.own_s,
                                 a2a_s=m.op_seconds("all_to_all"), a2a_bytes=m.op_bytes("all_to_all"),
                                 expert_fw_s=expert_fw, shadowed=tuple(layer.last_shadowed),
                                 modelled_imbl_s=dec.t_imbl if dec else float("nan"),
                                 modelled_shadow_s=dec.t_chosen if dec else float("nan")))
            if it == a["timeline_iter"] and name in a["timeline_variants"]:
                timeline += _timeline_rows(m, name, rank)
            layer.zero_grad(set_to_none=True)
    return dict(rows=rows_out, timeline=timeline, P_eff=P_eff)


def _timeline_rows(m, name: str, rank: int) -> list:
    """One step's door records and compute spans as timeline rows (seconds from the step's start)."""
    rows = [dict(variant=name, rank=rank, kind="comm", name=r.op, t0=r.t_start - m.wall0, t1=r.t_done - m.wall0,
                 emulated_s=r.emulated_s, phase=r.tags.get("phase", ""),
                 **{f"bytes_{c}": int(r.bytes.get(c, 0)) for c in ("local", "intra", "inter")}) for r in m.comm]
    rows += [dict(variant=name, rank=rank, kind="span", name=nm, t0=s0 - m.wall0, t1=s1 - m.wall0, emulated_s=0.0,
                  phase=tags.get("phase", ""), bytes_local=0, bytes_intra=0, bytes_inter=0)
             for nm, cat, s0, s1, tags in m.spans]
    return rows


def run_layer_suite(trace, variants: dict, *, nodes: int = 2, d: int = 128, f: Optional[int] = None, k: int = 2,
                    emulate: bool = True, intra_GBps: float = 0.1, inter_GBps: float = 0.02, latency_us: float = 50.0,
                    all_iters: Optional[int] = None, long_variants: Sequence[str] = ("fastmoe", "shadow"),
                    timeline_iter: Optional[int] = None, timeline_variants: Sequence[str] = (),
                    timeline_only: Sequence[str] = (), policy_c: Optional[int] = None, seed: int = 0,
                    warmup: int = 1, timeout: float = 600.0) -> dict:
    """Real FasterMoE layers on spawned gloo ranks replaying ``trace`` (``[iters, N, E]`` counts, N =
    ranks, ``N*E_local`` experts): every iteration each variant does forward + backward on the same
    routing (variants interleaved, a barrier before each; an iteration's time is the slowest rank's).

    ``variants``: name -> fastermoe options; ``{"_policy": True}`` turns on the shadow policy with
    constants calibrated here: ``P`` = the measured per-rank FFN rate (all ranks computing at once,
    averaged, identical on every rank), ``W_net`` = the emulated per-rank NIC bandwidth, ``c`` =
    ``policy_c`` (default 2, the paper's: one broadcast and one reduce, each a pipelined chain that
    moves the expert's bytes once over the slowest link, as the emulator and the simulator price them;
    spec §2.4 exposes ``c``).
    Iterations ``>= all_iters`` run only ``long_variants`` (Fig. 11's long replay).
    Returns ``{"times": frame, "timeline": frame, "P_eff": FLOP/s, "label": str, ...}``.
    """
    trace = np.asarray(trace, dtype=np.int64)
    iters, N, E = trace.shape
    f = f or 2 * d
    rpn = N // nodes
    a = dict(trace=trace, variants=variants, nodes=nodes, d=d, f=f, k=k, E=E, emulate=emulate, intra=intra_GBps,
             inter=inter_GBps, lat=latency_us, tokens=int(trace[0, 0].sum() // k), seed=seed,
             all_iters=iters if all_iters is None else all_iters, long_variants=tuple(long_variants),
             timeline_iter=-1 if timeline_iter is None else timeline_iter, timeline_variants=tuple(timeline_variants),
             timeline_only=tuple(timeline_only), policy_W=inter_GBps * 1e9,
             policy_c=int(policy_c if policy_c is not None else 2))
    t0 = time.time()
    per_rank = run_ranks(_layer_rank, N, a, timeout=timeout)
    rows = pd.DataFrame([r for x in per_rank for r in x["rows"]])
    tl = pd.DataFrame([r for x in per_rank for r in x["timeline"]])
    kind = "EMULATED links" if emulate else "REAL"
    where = f"{nodes} nodes x {rpn}" if nodes > 1 else "1 node"
    label = (f"{kind}: {N} ranks gloo ({where})" + (f", intra {intra_GBps:g} GB/s, inter {inter_GBps:g} GB/s per rank"
                                                   if emulate else "") + f", h={d}, h_ff={f}, {E} experts")
    return dict(times=rows, timeline=tl, P_eff=float(per_rank[0]["P_eff"]), trace=trace, label=label, N=N, E=E,
                d=d, f=f, k=k, nodes=nodes, intra_GBps=intra_GBps, inter_GBps=inter_GBps, latency_us=latency_us,
                emulate=emulate, wall_s=time.time() - t0, variants=variants, policy_c=a["policy_c"], warmup=warmup)


# ==== the performance model on the emulated network ======================================================
class EmulatedCluster(pm.Cluster):
    """The link emulator's network (``Communicator.emulated_time``) as a perf-model cluster: every rank
    has its own intra-node port and its own NIC, each a pair of directed edges; an intra pair uses the
    sender's intra-out and the receiver's intra-in edge, an inter pair the two NIC edges. So
    ``perf_model.comm_time`` (``max_e V_e / BW_e``) is the emulator's all-to-all time without its
    per-call latency (added by :meth:`a2a_time`)."""

    def __init__(self, N: int, nodes: int, intra_Bps: float, inter_Bps: float, P: float = 1e10,
                 latency_s: float = 0.0):
        super().__init__("emulated", [f"r{r}" for r in range(N)], P=P, ranks_per_node=N // nodes)
        self.intra_Bps, self.inter_Bps, self.latency_s = float(intra_Bps), float(inter_Bps), float(latency_s)

    def node(self, r: int) -> int:
        return r // self.ranks_per_node

    def route(self, src: int, dst: int):
        if src == dst:
            return []
        cls = "intra" if self.node(src) == self.node(dst) else "inter"
        return [(f"r{src}", f"{cls}_out"), (f"{cls}_in", f"r{dst}")]

    def bandwidth(self, edge) -> float:
        u, v = edge
        port = v if u.startswith("r") else u
        return self.intra_Bps if port.startswith("intra") else self.inter_Bps

    def a2a_time(self, C, h: int, s: int = pm.ELEM_BYTES) -> float:
        t = pm.comm_time(C, self, h, s)
        return t + self.latency_s if t > 0 else 0.0

    def shadow_time(self, nbytes: float) -> float:
        """Broadcast plus reduce of one expert's ``nbytes``, each a pipelined chain from / to the owner
        (as the emulator and the simulator price them): the bytes once over the slowest link, N - 1 latencies."""
        rpn, N = self.ranks_per_node, self.world_size
        one = nbytes / (self.inter_Bps if N > rpn else self.intra_Bps) + (N - 1) * self.latency_s
        return 2 * one


def _shadow_comm(cl, S, h, f, s=pm.ELEM_BYTES, E_local: int = 1):
    """Seconds of the broadcasts + reduces of the shadowed experts ``S`` (fw + bw) on cluster ``cl``."""
    nbytes = 2 * h * f * s
    if isinstance(cl, EmulatedCluster):
        return len(S) * cl.shadow_time(nbytes)
    return sum(pm.broadcast_time(cl, nbytes, root=e // E_local) + pm.reduce_time(cl, nbytes, root=e // E_local)
               for e in S)


def predict_layer_variants(C, cl, h: int, f: int, P=None, group_size: int = 2, shadowed: Sequence[int] = (),
                           s: int = pm.ELEM_BYTES) -> dict:
    """Performance-model time (s) of one layer's forward + backward under each FasterMoE variant:
    ``fastmoe`` (``3 Tc + 4 Tm``), ``shadow`` (shadowed experts' tokens computed at their source, their
    parameters broadcast and gradients reduced), ``smart`` (two-stream pipeline of the smart schedule's
    steps, :func:`perf_model.smart_layer_time`), ``both`` (the pipeline on the dispatched tokens with
    the shadow collectives between the S and R steps and the shadow compute after the last C), plus
    ``Tc``/``Tm`` (one round) and the theoretical smart speedup."""
    C = pm.as_counts(C)
    P = cl.P if P is None else P
    N, NE = C.shape
    E_local = NE // N
    a2a = cl.a2a_time if isinstance(cl, EmulatedCluster) else (lambda M, hh, ss=s: pm.comm_time(M, cl, hh, ss))
    Tc = pm.compute_time(C, h, f, P)
    Tm = a2a(C, h, s)
    out = dict(Tc=Tc, Tm=Tm, fastmoe=3 * Tc + 4 * Tm, theoretical=pm.smart_speedup_theoretical(Tm, Tc))
    S = list(shadowed)
    Cd, local = rl.shadow_counts(C, S)
    loads = pm.worker_loads(Cd) + local
    Tsh = _shadow_comm(cl, S, h, f, s, E_local)
    out["shadow"] = 3 * pm.compute_time_from_loads(loads, h, f, P) + 4 * a2a(Cd, h, s) + Tsh
    gs = min(group_size, N)

    def steps(M, backward):
        dS, dC, dR = pm.smart_step_times(M, cl, gs, h, f, s, P, backward=backward)
        if isinstance(cl, EmulatedCluster):
            dS = [x + cl.latency_s if x > 0 else 0.0 for x in dS]
            dR = [x + cl.latency_s if x > 0 else 0.0 for x in dR]
        return dS, dC, dR

    out["smart"] = pm.pipeline_time(*steps(C, False)) + pm.pipeline_time(*steps(C, True))
    tail = pm.compute_time_from_loads(local, h, f, P) if S else 0.0
    half = Tsh / 2
    out["both"] = (pm.pipeline_time(*steps(Cd, False), mid_comm=half, tail_compute=tail)
                   + pm.pipeline_time(*steps(Cd, True), mid_comm=half, tail_compute=2 * tail))
    return out


def suite_variants(nproc: int) -> dict:
    """The FasterMoE variants the layer suite runs (name -> options; ``_policy``: the shadow policy with
    constants calibrated on this machine, see :func:`run_layer_suite`)."""
    v = {"fastmoe": {}, "shadow": {"_policy": True}}
    for gs in (1, 2, 4):
        if gs < nproc and nproc % gs == 0:
            v[f"smart_gs{gs}"] = {"smart": True, "group_size": gs}
    v["both"] = {"_policy": True, "smart": True, "group_size": 2}
    v["smart_seq"] = {"smart": True, "group_size": 2, "smart_threaded": False}
    return v


TRACE_KINDS = {  # what the layer suite replays, in the words its labels use
    "t2": "SUBSTITUTE trace T2 (synthetic drifting popularity from iteration 5000)",
    "hot": "SUBSTITUTE trace: expert 3 takes 40 % of the assignments (a skewed benchmark load)",
    "t1": "trace T1 (REAL routing of the tiny MoE-GPT, rescaled)",
}


def suite_trace(scale, kind: str = "t2", seed: int = 0) -> np.ndarray:
    """The ``[iters, N, 16]`` counts the layer suite replays (:data:`TRACE_KINDS`): ``t2`` (16 experts from
    iteration 5000 on, one layer), ``hot`` (one expert takes 40 % of the assignments), ``t1`` (REAL gate
    decisions of the tiny MoE-GPT, :func:`convergence_suite`)."""
    sp = scale_spec(scale)
    n_it = sp.suite_iters + sp.shadow_iters
    N, E = sp.nproc, 16
    if kind == "t2":
        return t2_counts(list(range(5000, 5000 + n_it)), 1, N, E, sp.tokens, seed)[:, 0]
    if kind == "hot":
        return routing_trace("hot_expert", n_it, 1, N, E, sp.tokens, 2, seed, expert=3, share=0.4).numpy()[:, 0]
    if kind == "t1":
        loads = convergence_suite(scale)["loads"]["FastMoE (top-2)"]  # [steps, L, N_r, E]
        T_r = _conv_tokens(sp)
        steps = np.linspace(len(loads) // 2, len(loads) - 1, n_it).astype(int)
        return np.stack([rescale_counts(loads[s, 0], N, sp.tokens, 2, 2, T_r) for s in steps])
    raise ValueError(f"trace kind must be t2, hot or t1, got {kind!r}")


@cached
def layer_suite(scale, trace: Optional[str] = None, seed: int = 0) -> dict:
    """REAL layer benchmark at ``scale`` (EMULATED 2-node links), every variant of :func:`suite_variants`
    plus ``shadow_top1`` (the hottest expert forced into shadowing, on the timeline iteration only:
    Fig. 6). Shared by Figs. 5a, 6, 8, 11a, 12a and 13a. ``trace``: default the scale's ``suite_trace``
    (``hot`` at every scale: on T2 seed 0 the shadow policy never fires, see :func:`shadow_decisions`)."""
    sp = scale_spec(scale)
    trace = trace or sp.suite_trace
    tr = suite_trace(sp, trace, seed)
    variants = suite_variants(sp.nproc)
    t_it = sp.suite_iters - 1
    hot = int(np.argmax(tr[t_it].sum(0)))
    variants["shadow_top1"] = {"shadow_force": [hot]}
    s = run_layer_suite(tr, variants, nodes=2, d=sp.d, emulate=True, intra_GBps=sp.intra_GBps,
                        inter_GBps=sp.inter_GBps, latency_us=sp.latency_us, all_iters=sp.suite_iters,
                        long_variants=("fastmoe", "shadow"), timeline_iter=t_it,
                        timeline_variants=("fastmoe", "shadow_top1", "smart_gs2", "smart_seq", "both"),
                        timeline_only=("shadow_top1",), seed=seed, warmup=sp.warmup)
    s.update(trace_kind=trace, label=f"{s['label']}; {TRACE_KINDS[trace]}")
    return s


def shadow_decisions(suite: dict, variant: str = "shadow") -> pd.DataFrame:
    """The shadow policy's decision per timed iteration of a policy variant (identical on every rank,
    checked): the chosen set and what the policy compared, T_imbl vs T_shadow(chosen) (modelled, ms)."""
    df = suite["times"]
    df = df[(df.variant == variant) & (df.iter >= _suite_warmup(suite))]
    rows = []
    for it, g in df.groupby("iter"):
        sets = set(g.shadowed)
        if len(sets) != 1:
            raise AssertionError(f"iteration {it}: ranks chose different shadow sets {sets}")
        r = g.iloc[0]
        rows.append(dict(iter=int(it), variant=variant, shadowed=r.shadowed, n_shadowed=len(r.shadowed),
                         modelled_imbl_ms=1e3 * r.modelled_imbl_s, modelled_shadow_ms=1e3 * r.modelled_shadow_s,
                         modelled_gain_ms=1e3 * (r.modelled_imbl_s - r.modelled_shadow_s)))
    out = pd.DataFrame(rows)
    out.attrs["label"] = suite["label"]
    return out


def shadowing_note(decisions: pd.DataFrame) -> str:
    """One line saying whether the policy fired, for titles and notes (a figure must say so when not)."""
    n, k = len(decisions), int((decisions.n_shadowed > 0).sum()) if len(decisions) else 0
    if not k:
        return f"shadow policy never fired in {n} iterations on this configuration: shadow == FastMoE"
    fired = decisions[decisions.n_shadowed > 0]
    return (f"shadow policy fired in {k}/{n} iterations (mean {fired.n_shadowed.mean():.1f} experts, "
            f"modelled gain {fired.modelled_gain_ms.mean():.1f} ms of {fired.modelled_imbl_ms.mean():.1f} ms)")


def suite_medians(suite: dict, variants: Optional[Sequence[str]] = None,
                  iters: Optional[Sequence[int]] = None) -> pd.Series:
    """Median iteration time (s, slowest rank) per variant over the timed iterations."""
    df = suite["times"]
    df = df[(df["rank"] == 0)]
    warm = _suite_warmup(suite)
    df = df[df.iter >= warm]
    if iters is not None:
        df = df[df.iter.isin(list(iters))]
    med = df.groupby("variant").time_s.median()
    return med if variants is None else med.reindex(list(variants))


def _suite_warmup(suite) -> int:
    return int(suite.get("warmup", 1))


def suite_cluster(suite: dict) -> EmulatedCluster:
    return EmulatedCluster(suite["N"], suite["nodes"], suite["intra_GBps"] * 1e9, suite["inter_GBps"] * 1e9,
                           P=suite["P_eff"], latency_s=suite["latency_us"] * 1e-6)


# ==== predictions beside real layer runs (benchmark) ==================================================================
def simulate_layer_variants(suite: dict, it: int, group_size: int = 2) -> dict:
    """SIMULATED seconds of one layer's forward + backward for each FasterMoE variant at iteration ``it``
    of a layer suite: ``moelab.sim`` on the suite's own network (``emulation_profile``: the emulated
    links), compute at the suite's measured per-rank FLOP/s, the shadow sets the real run used."""
    N, E, d, f, nodes = suite["N"], suite["E"], suite["d"], suite["f"], suite["nodes"]
    C = suite["trace"][it]
    T = int(C[0].sum() // suite["k"])
    cfg = RunConfig().with_overrides({
        "model.d_model": d, "model.d_ff": f, "model.n_layers": 1, "model.n_heads": 1, "model.seq_len": T,
        "model.moe.num_experts": E, "model.moe.top_k": suite["k"], "train.batch_size": 1,
        "parallel.nproc": N, "parallel.topology.nodes": nodes, "parallel.strategy": "fastermoe",
        "emulation.enabled": True, "emulation.intra_bw_GBps": suite["intra_GBps"],
        "emulation.inter_bw_GBps": suite["inter_GBps"], "emulation.intra_latency_us": suite["latency_us"],
        "emulation.inter_latency_us": suite["latency_us"]})
    base = ClusterProfile(name="cpu", nodes=nodes, gpus_per_node=N // nodes, gpu="cpu rank", peak_flops=suite["P_eff"],
                          achieved_flops=suite["P_eff"], intra_bw_GBps=1.0, intra_latency_us=0.0, inter_bw_GBps=1.0,
                          inter_latency_us=0.0, mem_GB=0.0, elem_bytes=4)
    prof = emulation_profile(cfg, base)
    df = suite["times"]
    out = {}
    for v, o in suite["variants"].items():
        row = df[(df.variant == v) & (df.iter == it) & (df["rank"] == 0)]
        if not len(row):
            continue
        opts = {k: val for k, val in o.items() if not k.startswith("_")}
        opts.pop("smart_threaded", None)
        opts.pop("shadow_force", None)
        S = tuple(row.shadowed.iloc[0])
        c = cfg.with_overrides({"parallel.strategy_options": opts})
        g = fastermoe_iteration_graph(c, prof, C[None], shadows=[S])
        out[v] = float(moe_layer_times(simulate(g), [0])[0])
    return out
