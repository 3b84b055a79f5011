"""Lina's real runs for the reproduction, cached per (scale, seed).

- :func:`policy_runs` (EMULATED): the training policies on 4 gloo ranks (2 nodes x 2) with
  contention-aware emulated links, one spawn (:func:`moelab.measure.realruns.run_real_many`).
- :func:`inference_suite` (REAL): one spawn of 4 ranks trains the inference model (top-1, aux loss,
  E = ``i_experts``), checkpoints it, then serves it under every variant and every path length of
  Table 5 through :mod:`moelab.runtime.serve`; returns the training loads, the routing traces of the
  profiling split and every serve run's records. On another text domain (``dataset``: Table 6's
  substitute) the same model is trained there and served under Ideal and Lina only.
"""
from __future__ import annotations

import tempfile

import numpy as np
import pandas as pd

from moelab.comm.cpu_priority import resolve
from moelab.comm.door import Communicator, Recorder
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.measure.local import emulated_call_costs
from moelab.measure.realruns import run_real_many
from moelab.papers.kit.cache import cached
from moelab.papers.lina.paper_scale import fitted_gamma
from moelab.runtime.checkpoint import save
from moelab.runtime.ranks import run_ranks
from moelab.runtime.serve import build, run
from moelab.runtime.train import Trainer, topology_for
from moelab.sim.result import interval_union, overlap_seconds, union_seconds
from moelab.strategies.lina.options import POLICIES, SERVE_VARIANTS, LinaServeOptions

from .common import scale_spec

# runs beside the policies that depart from the spec, each named apart and said so where shown:
# lina with runs of small gradients sharing one micro-op of <= S (option coalesce_bytes = S)
DEPARTURES = {"lina_coalesce": ("lina", "coalesce_bytes")}
DEPARTURE_NOTE = ("lina_coalesce: lina with runs of consecutive small gradients sharing one micro-op of <= S "
                  "(coalesce_bytes = S), a departure from the spec's one gradient per micro-op")
VARIANTS = SERVE_VARIANTS
SCHEDULED = VARIANTS[2:]  # the variants that plan placements (serve.strategy_options.replica_rounding applies to them)
# their runs with serve.strategy_options.replica_rounding "balanced"
# (moelab.strategies.lina.placement.allocate_balanced)
BALANCED_SUFFIX = " (balanced)"
# lina (balanced) whose phase 2 re-plans by load (serve.strategy_options.replan_test "load")
LOAD_KEY = "lina (balanced, load test)"
LOAD_OPTIONS = {"serve.strategy_options.replica_rounding": "balanced", "serve.strategy_options.replan_test": "load"}
# lina whose layers before path_len are planned from the actual counts (serve.strategy_options.first_layers "actual"),
# with the spec's floor and with balanced replicas: what the paper's "slower start" costs on this model
FIRST_KEYS = {"lina (first layers from counts)": {"serve.strategy_options.first_layers": "actual"},
              "lina (balanced, first layers from counts)": {"serve.strategy_options.first_layers": "actual",
                                                            "serve.strategy_options.replica_rounding": "balanced"}}
WORLD, NODES = 4, 2


def train_yields(yields=None) -> bool:
    """Whether the training runs' compute threads yield to communication (``emulation.compute_yields``, ranks'
    compute at SCHED_IDLE during the iterations, :mod:`moelab.comm.cpu_priority`): ``None`` = on where the
    host allows, as ``benchmarks/lina.py`` does. With 4 ranks on 2 cores a call a communication thread issues
    during backward otherwise waits for a core behind the compute (a NIC does not wait for the GPU)."""
    return resolve("auto") if yields is None else bool(yields)


def train_config(s, policy: str, seed: int = 0, yields=None, S=None) -> RunConfig:
    """One training run of :func:`policy_runs`: a policy of :data:`POLICIES`, or a name of :data:`DEPARTURES`;
    ``S``: the micro-op size (default: the scale's)."""
    base, extra = DEPARTURES.get(policy, (policy, None))
    opts = {extra: s.t_S} if extra else {}
    S = s.t_S if S is None else S
    return RunConfig().with_overrides({
        "paper": "lina", "name": f"policy-{policy}" + ("" if S == s.t_S else f"-S{S:g}"), "train.seed": seed,
        **train_overrides(s.t_d, s.t_layers, s.t_seq, s.t_batch, s.t_iters, base, S, s.t_bucket_mb, **opts),
        **emulated_links(s), "emulation.compute_yields": train_yields(yields)}).validate()


def train_overrides(d: int, layers: int, seq: int, batch: int, iters: int, policy: str, S: float, bucket_mb: float,
                    ff: int = 4, **opts) -> dict:
    """The training model and Lina options the reproduction and ``benchmarks/lina.py`` both run: ``layers``
    MoE blocks of width ``d`` (experts ``ff * d`` wide), 4 experts top-2 through the dense dispatcher at capacity
    factor 1.0, on 4 ranks; ``opts``: more strategy options (``experts_per_device``, ...)."""
    return {
        "model.d_model": d, "model.d_ff": ff * d, "model.n_layers": layers, "model.n_heads": 4, "model.seq_len": seq,
        "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.gate": "topk",
        "model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0,
        "train.iters": iters, "train.batch_size": batch, "train.trace": False,
        "parallel.nproc": WORLD, "parallel.strategy": "lina", "parallel.bucket_mb": bucket_mb,
        "parallel.strategy_options": {"policy": policy, "partition_bytes": S, "a2a_chunks": 4, **opts}}


def emulated_links(s) -> dict:
    """Config overrides for the scale's contention-aware EMULATED links, 2 nodes x 2 (:func:`links_label`),
    with the all-to-all / all-reduce interference gamma the simulator fitted to Fig. 4 (one gamma for
    EMULATED and SIMULATED: without it overlapping the two would cost nothing beyond fair sharing)."""
    return {"emulation.enabled": True, "emulation.intra_bw_GBps": s.intra_GBps, "emulation.inter_bw_GBps": s.inter_GBps,
            "emulation.intra_latency_us": 20.0, "emulation.inter_latency_us": 50.0, "parallel.topology.nodes": NODES,
            "emulation.interference_gamma": _gamma()}


def _gamma() -> float:
    return float(fitted_gamma()["gamma"])


def a2a_times(comm, phase=None) -> float:
    """Mean over ranks of the per-iteration all-to-all busy time: the union of the calls' intervals from issue to
    finish (``t_done``: a pipelined chunk's call waited after its chunk's compute ends at its finish, not there)."""
    a = comm[comm.op == "all_to_all"]
    if phase is not None:
        a = a[a.phase == phase]
    if not len(a):
        return 0.0
    per = a.groupby(["rank", "iter"]).apply(lambda g: union_seconds(g.t_start, g.t_done), include_groups=False)
    return float(per.groupby(level=0).mean().mean())


def a2a_beside_allreduce(comm, phase="bwd") -> float:
    """The share of the all-to-alls' busy time (issue to finish, per rank and iteration) during which an
    all-reduce of the same rank was in flight too (issued, not finished): the overlap a policy lets happen (the
    baseline's DDP buckets beside its all-to-alls; none under strict priority unless a bounded wait gave up).
    nan: no all-to-all."""
    a = comm[comm.op == "all_to_all"]
    if phase is not None:
        a = a[a.phase == phase]
    ar = {key: list(zip(x.t_start, x.t_done)) for key, x in comm[comm.op == "all_reduce"].groupby(["rank", "iter"])}
    busy = beside = 0.0
    for key, g in a.groupby(["rank", "iter"]):
        W = interval_union(zip(g.t_start, g.t_done))
        busy += sum(b - a_ for a_, b in W)
        beside += overlap_seconds(interval_union(ar.get(key, ())), W)
    return beside / busy if busy > 0 else float("nan")


def allreduce_calls(comm) -> int:
    """All-reduce calls (micro-ops or buckets) per rank and step in the records of all ranks."""
    return int((comm.op == "all_reduce").sum() / WORLD / max(1, comm.iter.nunique()))


def step_summary(step_times, comm) -> dict:
    """One run's step and all-to-all times over the kept iterations (``step_times``: per iteration, every
    rank's; ``comm``: the same iterations' call records): the median and mean step of the slowest rank, the
    backward and total all-to-all busy time (:func:`a2a_times`), and the all-to-all share of the step - the
    mean busy time over the mean step, so that a slow iteration counts in both."""
    steps = [max(row) for row in step_times]
    mean_step, a2a = float(np.mean(steps)), a2a_times(comm)
    return {"step_s": float(np.median(steps)), "mean_step_s": mean_step, "bwd_a2a_s": a2a_times(comm, "bwd"),
            "a2a_s": a2a, "a2a_share": a2a / mean_step, "bwd_a2a_beside_ar": a2a_beside_allreduce(comm)}


def links_label(s, yields: bool = False) -> str:
    return (f"EMULATED links: 4 gloo ranks, 2 nodes x 2, intra {s.intra_GBps:g} GB/s, inter {s.inter_GBps:g} GB/s "
            f"per rank, shared by concurrent calls; an all-to-all and an all-reduce sharing a port each get 1/gamma "
            f"of their share, gamma {_gamma():.2f} FITTED to Fig. 4 in the simulator"
            + ("; compute threads yield to communication (SCHED_IDLE)" if yields else ""))


@cached
def policy_runs(scale: str, seed: int = 0, yields=None) -> dict:
    """``{"summary": frame per policy, "comm": every rank's call records, "spans": every rank's compute
    spans, "metrics": rank 0's per-iteration metrics rows, "loads": tokens per (iteration, MoE layer, source
    rank, expert)}``, each with a policy column, warm-up dropped;
    :data:`POLICIES`, then :data:`DEPARTURES`; ``yields``: :func:`train_yields`."""
    s, yields = scale_spec(scale), train_yields(yields)
    names = POLICIES + tuple(DEPARTURES)
    runs = run_real_many([train_config(s, p, seed, yields) for p in names], timeout=1800)
    rows, comms, spans, metrics, loads = [], [], [], [], []
    for pol, r in zip(names, runs):
        index = dict(zip(("iter", "layer", "src", "expert"), (i.ravel() for i in np.indices(r.loads.shape))))
        loads.append(pd.DataFrame({"policy": pol, **index, "tokens": r.loads.ravel()}).query(f"iter >= {s.t_warmup}"))
        keep = r.comm[r.comm.iter >= s.t_warmup].copy()
        keep["policy"] = pol
        comms.append(keep)
        spans.append(r.spans[r.spans.iter >= s.t_warmup].assign(policy=pol))
        metrics.append(pd.DataFrame(r.metrics).query(f"iter >= {s.t_warmup}").assign(policy=pol))
        rows.append({"policy": pol, **step_summary(r.step_times[s.t_warmup:], keep),
                     "allreduce_calls": allreduce_calls(keep)})
    df = pd.DataFrame(rows)
    base = df.set_index("policy").loc["ddp_overlap"]
    df["step_speedup"] = base.step_s / df.step_s
    df["bwd_a2a_speedup"] = base.bwd_a2a_s / df.bwd_a2a_s
    out = {"summary": df, "comm": pd.concat(comms, ignore_index=True), "spans": pd.concat(spans, ignore_index=True),
           "metrics": pd.concat(metrics, ignore_index=True), "loads": pd.concat(loads, ignore_index=True)}
    label = links_label(s, yields)
    for v in out.values():
        v.attrs["label"] = label
    return out


PARTITION_FACTORS = (0.25, 1.0, 4.0, 16.0)  # Fig. 15's sweep: micro-op sizes as multiples of the scale's S


@cached
def partition_runs(scale: str, seed: int = 0, factors=PARTITION_FACTORS) -> pd.DataFrame:
    """Fig. 15 (EMULATED): ``lina``'s step at micro-op sizes ``factors`` x the scale's S (S is scaled with the
    model, as the bucket is), one row each: S, micro-ops per step (all-reduce calls of a rank), the step."""
    s = scale_spec(scale)
    cfgs = [train_config(s, "lina", seed, S=f * s.t_S) for f in factors]
    rows = []
    for f, r in zip(factors, run_real_many(cfgs, timeout=1800)):
        keep = r.comm[r.comm.iter >= s.t_warmup]
        rows.append({"S_factor": f, "partition_bytes": int(f * s.t_S),
                     "micro_ops": allreduce_calls(keep),
                     **step_summary(r.step_times[s.t_warmup:], keep)})
    out = pd.DataFrame(rows)
    out.attrs["label"] = links_label(s, train_yields(None)) + "; policy lina"
    return out


def infer_config(s, seed: int = 0, dataset: str = "pydocs", **serve) -> RunConfig:
    return RunConfig().with_overrides({
        "paper": "lina", "name": "infer", "train.dataset": dataset,
        "model.d_model": s.i_d, "model.d_ff": 2 * s.i_d, "model.n_layers": s.i_layers, "model.n_heads": 4,
        "model.seq_len": s.i_seq, "model.moe.num_experts": s.i_experts, "model.moe.top_k": 1,
        "model.moe.gate": "switch", "model.moe.capacity_factor": None, "model.moe.balance_loss_coef": 0.01,
        "train.iters": s.i_iters, "train.batch_size": s.i_batch, "train.trace": False, "train.seed": seed,
        "train.lr": 3e-3, "parallel.nproc": WORLD,
        "serve.requests": s.requests, "serve.batch_size": s.serve_batch, "serve.rate_per_s": s.rate_per_s,
        "serve.strategy_options.profile_batches": s.profile_batches,
        "serve.strategy_options.path_len": s.path_lens[min(1, len(s.path_lens) - 1)],
        "serve.strategy_options.max_pack": max_pack(s), "serve.strategy": "lina",
        **{f"serve.strategy_options.{k}": v for k, v in serve.items()}}).validate()


def serve_options(cfg) -> LinaServeOptions:
    """Lina's serving options of a serve run's config (a :class:`RunConfig` or its dict)."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    return LinaServeOptions.from_dict(d["serve"]["strategy_options"])


def max_pack(s) -> int:
    """Experts a device may hold when serving: the paper's 4 per device at one expert per device (N = E),
    scaled to this world's E / N experts per device, so Lina keeps the paper's room to pack cold experts
    and replicate hot ones (at max_pack = E / N every device is full and no plan can replicate). The paper's
    count is Lina's option default (:class:`LinaServeOptions`)."""
    return LinaServeOptions.max_pack * max(1, s.i_experts // WORLD)


def _suite_rank(rank, world, cfg_dict, runs, ckpt_dir, repeat=1):
    cfg = RunConfig.from_dict(cfg_dict)
    tr = Trainer.build(cfg)
    rows = tr.run()
    save(tr, ckpt_dir, cfg.train.iters)
    out = {"losses": [r["loss"] for r in rows], "loads": tr.loads, "serve": {}, "config": cfg_dict, "overrides": runs}
    tr.close()
    for rnd in range(repeat):  # rounds of every run, interleaved: a drift of the host hits every variant alike
        for key, over in runs.items():
            sc = RunConfig.from_dict(cfg_dict).with_overrides({"train.init_from": ckpt_dir, **over}).validate()
            res = run(sc)
            got = out["serve"].setdefault(key, {"requests": [], "batches": [], "layers": []})
            for part, rows in got.items():
                rows += [{**row, "round": rnd} for row in res[part]]
    emulated = [o for o in runs.values() if o.get("emulation.enabled")]
    if emulated:  # held out, after the serving: this host's costs beside the links, for the simulator's prediction
        cfg = RunConfig.from_dict(cfg_dict).with_overrides({"train.init_from": ckpt_dir, **emulated[0]})
        out["call_costs"] = _serve_call_costs(cfg, world)
        out["free_links"] = {}
        for key, over in FREE_RUNS.items():
            res = run(cfg.with_overrides({**over, **{f"emulation.{k}": v for k, v in FREE_LINKS.items()}}).validate())
            out["free_links"][key] = {part: res[part] for part in ("requests", "batches", "layers")}
    return out


# the held-out serve runs on links that cost (almost) nothing: what the serving path costs on this host beyond
# them, with the static placement and with many replicas per rank (so a cost per layer and one per expert separate)
FREE_LINKS = {"intra_bw_GBps": 1e6, "inter_bw_GBps": 1e6, "intra_latency_us": 0.0, "inter_latency_us": 0.0}
FREE_RUNS = {"static": {"serve.strategy_options.variant": "baseline"},
             "replicated": {"serve.strategy_options.variant": "lina_no_estimation",
                            "serve.strategy_options.replica_rounding": "balanced"}}


def _serve_call_costs(cfg, world) -> dict:
    """:func:`moelab.measure.local.emulated_call_costs` of a 1-element all-to-all over every serving rank, on
    a communicator with the serve runs' EMULATED links (the simulator's prediction of a served batch prices
    each of its calls with them)."""
    import torch.distributed as dist

    comm = Communicator(topology_for(cfg, world), cfg.emulation, Recorder(dist.get_rank()))
    try:
        return emulated_call_costs(comm, "world", "all_to_all", reps=40)
    finally:
        comm.close()


@cached
def inference_suite(scale: str, seed: int = 0, dataset: str = "pydocs", emulated: bool = False,
                    rounding: str = "floor", yields: bool = False, repeat: int = 1) -> dict:
    """Train, checkpoint and serve (see module doc). Returns rank 0's records per serve run (keys: the
    variants, and ``lina_Lp{n}`` per Table 5 path length; on another ``dataset`` ``ideal`` and ``lina``),
    ``loads`` (training, last iterations), ``traces`` ([tokens, MoE layers] of the profiling split), ``losses``.
    ``emulated``: serve over the scale's contention-aware EMULATED links (2 nodes x 2; training stays REAL),
    or over links of ``(intra, inter)`` GB/s per rank when a pair is given. ``rounding``: the scheduled
    variants' ``serve.strategy_options.replica_rounding`` (the spec's ``floor``, or ``nearest``, ``balanced``); with
    ``floor`` they
    are also served with ``balanced`` (keys ``"<variant> (balanced)"``), and ``lina`` with ``balanced`` and
    phase 2 by load (:data:`LOAD_KEY`), and ``lina`` planning its first layers too (:data:`FIRST_KEYS`), on the
    same model. ``yields``: serve with
    ``emulation.compute_yields`` (the ranks' serving threads at SCHED_IDLE, phase 1's loader not). ``repeat``:
    serve every run that many times, interleaved, its records pooled (each with its ``round``)."""
    import dataclasses

    s = scale_spec(scale)
    if isinstance(emulated, (tuple, list)):
        s = dataclasses.replace(s, intra_GBps=float(emulated[0]), inter_GBps=float(emulated[1]))
    cfg = infer_config(s, seed, dataset)
    links = emulated_links(s) if emulated else {}
    if rounding != "floor":
        links = {**links, "serve.strategy_options.replica_rounding": rounding}
    if yields:
        links = {**links, "emulation.compute_yields": True}
    if dataset == "pydocs":
        runs = {v: {"serve.strategy_options.variant": v, **links} for v in VARIANTS}
        runs.update({f"lina_Lp{n}": {"serve.strategy_options.variant": "lina",
                                     "serve.strategy_options.path_len": int(n), **links}
                     for n in s.path_lens})
        if rounding == "floor":  # the option beside the spec's rounding, on the same trained model
            runs.update({v + BALANCED_SUFFIX: {"serve.strategy_options.variant": v, **links,
                                               "serve.strategy_options.replica_rounding": "balanced"}
                         for v in SCHEDULED})
            runs[LOAD_KEY] = {"serve.strategy_options.variant": "lina", **links, **LOAD_OPTIONS}
            runs.update({k: {"serve.strategy_options.variant": "lina", **links, **o} for k, o in FIRST_KEYS.items()})
    else:
        runs = {v: {"serve.strategy_options.variant": v, **links} for v in ("ideal", "lina")}
    with tempfile.TemporaryDirectory(prefix="moelab-lina-") as d:
        res = run_ranks(_suite_rank, WORLD, cfg.to_dict(), runs, d, repeat, timeout=3600 * repeat)
        out = res[0]
        out["traces"] = _traces(cfg, d) if dataset == "pydocs" else None  # Figs. 9, Table 2: the main domain
    out["label"] = (f"REAL: {WORLD} gloo ranks, a {s.i_layers}-layer MoE LM (d={s.i_d}, E={s.i_experts}, top-1) "
                    f"trained {s.i_iters} iterations here on {dataset}, served on held-out windows, "
                    f"max_pack {max_pack(s)} (the paper's {LinaServeOptions.max_pack} at one expert per device, x E/N)")
    if emulated:
        out["label"] = out["label"].replace("REAL: ", "EMULATED: ", 1) + " over " + links_label(s)
    if rounding != "floor":
        out["label"] += f", replicas rounded {rounding} (the spec's floor is the default)"
    if yields:
        out["label"] += ", compute yielding to communication (SCHED_IDLE)"
    if repeat > 1:
        out["label"] += f", every variant served {repeat} times, interleaved, the rounds' samples pooled"
    return out


def _traces(cfg, ckpt_dir) -> np.ndarray:
    """Routing traces of the trained model on the profiling split (one process: every expert on it)."""
    return run_ranks(_trace_rank, 1, cfg.to_dict(), ckpt_dir, timeout=600)[0]


def _trace_rank(rank, world, cfg_dict, ckpt_dir):
    cfg = RunConfig.from_dict(cfg_dict).with_overrides({"parallel.nproc": 1, "train.init_from": ckpt_dir,
                                                        "serve.strategy_options.profile_batches":
                                                            4 * serve_options(cfg_dict).profile_batches})
    comm = Communicator(Topology(1, 1))
    server = build(cfg, comm)
    try:
        return server.prepare()
    finally:
        server.close()
