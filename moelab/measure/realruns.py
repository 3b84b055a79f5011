"""Real runs for the simulator's validation, and the compute measurements a local profile is fitted from.

:func:`run_real_many` trains each config on spawned gloo ranks (:class:`moelab.runtime.train.Trainer`)
and keeps what the comparison needs (:class:`RealRun`: per-rank step times, the dispatcher's loads,
the communicator's records and spans). :func:`measure_compute` / :func:`measure_compute_concurrent`
time a config's model on one process (or on as many as the run has ranks, concurrently) with no
communication: the effective FLOP/s at the model's own shapes. :mod:`moelab.measure.validate` compares.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from moelab.comm.cpu_priority import compute_yields
from moelab.comm.topology import LINK_CLASSES
from moelab.config import RunConfig
from moelab.registry import get
from moelab.runtime.ranks import caller_state, rank_context, run_ranks, take_caller_state
from moelab.runtime.train import Trainer
from moelab.sim.graphs import iteration_graph, moe_layer_ids
from moelab.sim.profiles import ClusterProfile


# ---- real runs -------------------------------------------------------------------------------------
@dataclass
class RealRun:
    """What one real run measured (every rank), iterations in order.

    ``step_times[it, r]``: rank r's step time (forward, backward, grad sync, optimizer) in s.
    ``loads[it, l]``: the ``[N, E]`` matrix of tokens each source rank routed to each expert in MoE
    layer l (after capacity drops), from the dispatcher's count exchange (a strategy without one,
    ``Strategy.shared_loads`` False: rank 0's gating pool's counts).
    ``comm``: one row per training collective call (metric traffic is not recorded): rank, iter,
    layer, phase, op, seq (call order within (rank, iter)), t_start, t_end (when its issuer waited), t_done (when it
    had finished: earlier for an async call waited late, :class:`moelab.comm.record.CommRecord`), emulated_s, bytes_*.
    ``spans``: the recorder's compute spans: rank, name, cat, t_start, t_end, iter, layer.
    ``plans[it]``: rank 0's plan records of iteration ``it`` (``layer.plan_record()`` of every MoE layer,
    as in ``plans.jsonl``; the plans are pure functions of all-gathered data, the same on every rank).
    """

    cfg: RunConfig
    step_times: np.ndarray
    loads: np.ndarray
    comm: "object"  # pandas DataFrame
    spans: "object"  # pandas DataFrame
    wall_s: float = 0.0
    plans: list = field(default_factory=list)
    metrics: list = field(default_factory=list)  # rank 0's per-iteration metrics rows (memory peaks, bytes)
    layer_metrics: object = None  # every rank's per-(iteration, layer) ``layer.last_metrics`` rows (DataFrame)
    memory: object = None  # every rank's per-iteration memory peaks (DataFrame: rank, iter, mem_<cat>_peak_bytes)
    probe: object = None  # rank 0's ``probe(trainer)`` result (:func:`run_real_many`), if one was given

    @property
    def nproc(self) -> int:
        return self.step_times.shape[1]

    @property
    def iters(self) -> int:
        return self.step_times.shape[0]

    @property
    def step_time_max(self) -> np.ndarray:
        return self.step_times.max(axis=1)

    def bytes(self):
        """Per (iter, rank): bytes sent per link class, training traffic only."""
        cols = [f"bytes_{c}" for c in LINK_CLASSES]
        return self.comm.groupby(["iter", "rank"])[cols].sum().reset_index()

    @property
    def label(self) -> str:
        return real_label(self.cfg)

    def graph_plans(self) -> list:
        """Per iteration, the keyword arguments of the strategy's simulator graph for the plan this run
        executed (:meth:`moelab.registry.Strategy.graph_kwargs` of ``plans[it]``): what
        :func:`moelab.measure.validate.simulate_real` takes as ``plans=`` to price the same plans."""
        s = get(self.cfg.parallel.strategy)
        return [s.graph_kwargs(self.cfg, recs) for recs in self.plans]


def real_label(cfg: RunConfig) -> str:
    e = cfg.emulation
    topo = cfg.parallel.topology
    s = f"REAL: {cfg.parallel.nproc} ranks gloo"
    if topo.nodes > 1:
        s += f" ({topo.nodes} nodes declared)"
    if e.enabled:
        s += f", EMULATED links (intra {e.intra_bw_GBps:g} GB/s, inter {e.inter_bw_GBps:g} GB/s per rank)"
    return s


def _real_worker(rank, world, cfg_dicts, probe=None):
    """Runs on every rank: each config in turn, step by step; returns plain picklable data."""
    import time

    import torch

    torch.set_num_threads(1)
    out = []
    for d in cfg_dicts:
        cfg = RunConfig.from_dict(d)
        t0 = time.time()
        tr = Trainer.build(cfg)
        loads = []
        with compute_yields(cfg.emulation.compute_yields):
            for it in range(cfg.train.iters):
                tr.step(it)
                loads.append(np.stack([layer.last_global_counts.numpy().astype(np.int64)
                                       for layer in tr.model.moe_layers()]))
        comm, seq = [], {}
        for r in tr.comm.rec.comm:
            it = r.tags.get("iter", -1)
            seq[it] = seq.get(it, -1) + 1
            comm.append((rank, it, r.tags.get("layer", -1), r.tags.get("phase", ""), r.op, seq[it],
                         r.t_start, r.t_end, r.t_done, r.emulated_s, *(int(r.bytes.get(c, 0)) for c in LINK_CLASSES)))
        spans = [(rank, name, cat, t0_, t1_, tags.get("iter", -1), tags.get("layer", -1))
                 for name, cat, t0_, t1_, tags in tr.comm.rec.spans]
        plans = [[] for _ in range(cfg.train.iters)]
        for rec in tr.plans:
            plans[rec["iter"]].append(rec)
        out.append(dict(step_times=[m["step_time_s"] for m in tr.metrics], loads=np.stack(loads),
                        comm=comm, spans=spans, wall=time.time() - t0, plans=plans, metrics=list(tr.metrics),
                        layer_metrics=list(tr.layer_metrics),
                        memory=[{"iter": m["iter"], **{k: v for k, v in m.items() if k.endswith("_peak_bytes")}}
                                for m in tr.metrics]))
        if probe is not None:
            out[-1]["probe"] = probe(tr)
        tr.close()  # its process groups and threads: the next configuration runs beside none of them
    return out


def run_real_many(cfgs: Sequence[RunConfig], nproc: Optional[int] = None, *, timeout: float = 300.0,
                  probe=None) -> list:
    """Run several configs (same ``nproc``) one after another on one set of spawned gloo ranks.

    One spawn for all of them: starting ranks (importing torch, reading the corpus) costs seconds
    on a small machine, a short run less. Returns one :class:`RealRun` per config. ``probe``: a
    picklable ``f(trainer)`` every rank calls after each config's iterations, in the same processes
    (a held-out measurement under the run's own placement of processes on cores); rank 0's result
    is the run's ``probe``.
    """
    import pandas as pd

    cfgs = list(cfgs)
    if not cfgs:
        return []
    nproc = nproc or cfgs[0].parallel.nproc
    dicts = []
    for c in cfgs:
        if c.parallel.nproc != nproc:
            c = c.with_overrides({"parallel.nproc": nproc})
        dicts.append(c.validate().to_dict())
    per_rank = run_ranks(_real_worker, nproc, dicts, probe, timeout=timeout)
    runs = []
    for i, d in enumerate(dicts):
        res = [per_rank[r][i] for r in range(nproc)]
        comm = pd.DataFrame([row for x in res for row in x["comm"]],
                            columns=["rank", "iter", "layer", "phase", "op", "seq", "t_start", "t_end",
                                     "t_done", "emulated_s", *[f"bytes_{c}" for c in LINK_CLASSES]])
        spans = pd.DataFrame([row for x in res for row in x["spans"]],
                             columns=["rank", "name", "cat", "t_start", "t_end", "iter", "layer"])
        cfg = RunConfig.from_dict(d)
        shared = get(cfg.parallel.strategy).shared_loads
        for r in range(1, nproc if shared else 1):  # the count exchange made every rank's loads the same matrix
            if not np.array_equal(res[r]["loads"], res[0]["loads"]):
                raise AssertionError(f"rank {r} recorded other loads than rank 0: the count exchange is broken")
        runs.append(RealRun(cfg, np.array([x["step_times"] for x in res]).T,
                            res[0]["loads"], comm, spans, wall_s=max(x["wall"] for x in res),
                            plans=res[0]["plans"], metrics=res[0]["metrics"],
                            layer_metrics=pd.DataFrame([{"rank": r, **row} for r, x in enumerate(res)
                                                        for row in x["layer_metrics"]]),
                            memory=pd.DataFrame([{"rank": r, **row} for r, x in enumerate(res) for row in x["memory"]]),
                            probe=res[0].get("probe")))
    return runs


def run_real(cfg: RunConfig, nproc: Optional[int] = None, *, timeout: float = 300.0) -> RealRun:
    """A short real training of ``cfg`` on ``nproc`` spawned gloo ranks (default ``cfg.parallel.nproc``)."""
    return run_real_many([cfg], nproc, timeout=timeout)[0]


# ---- profiles of this machine ---------------------------------------------------------------------------


def _compute_only_cfg(cfg: RunConfig) -> RunConfig:
    """``cfg``'s model on one rank, every expert local: plain EP (a strategy's options, e.g. Hecate's ``hier``
    backend, may not be valid on one node, and on one rank none of them changes the compute)."""
    return cfg.with_overrides({"parallel.nproc": 1, "parallel.topology.nodes": 1, "parallel.strategy": "ep",
                               "parallel.strategy_options": {},
                               "parallel.topology.ranks_per_node": None, "parallel.placement": None,
                               "emulation.enabled": False, "train.trace": False})


_COMPUTE_CACHE: dict = {}


def measure_compute(cfg: RunConfig, iters: int = 10, warmup: int = 2, cache: bool = True) -> dict:
    """Effective compute FLOP/s of ``cfg``'s model on one process of this machine (1 thread).

    Runs ``iters`` real training steps of the model with every expert local (world 1: no
    communication; the same per-rank batch, so the same attention, gate, head and, on average, expert
    work per rank), and divides the FLOPs the simulator charges for that iteration by the median
    measured step time after ``warmup``. Returns ``{flops, ops, time_s, flops_per_s}`` (``ops``: the
    compute ops the simulator charges per rank, what a per-op overhead multiplies). Cached per model
    shape (the result does not depend on the parallel layout).
    """
    import torch

    c1 = _compute_only_cfg(cfg).with_overrides({"train.iters": iters + warmup})
    key = (repr(c1.model), c1.train.batch_size, c1.train.dtype, iters, warmup)
    if cache and key in _COMPUTE_CACHE:
        return dict(_COMPUTE_CACHE[key])
    unit = ClusterProfile(name="unit", nodes=1, gpus_per_node=1, gpu="-", peak_flops=1.0, achieved_flops=1.0,
                          intra_bw_GBps=1.0, intra_latency_us=0.0, inter_bw_GBps=1.0, inter_latency_us=0.0,
                          mem_GB=1.0)
    E = c1.model.moe.num_experts
    L = len(moe_layer_ids(c1.model))
    T = c1.train.batch_size * c1.model.seq_len * c1.model.moe.top_k
    loads = np.zeros((L, 1, E), dtype=np.int64)
    loads[:, 0, :] = T // E
    loads[:, 0, : T % E] += 1
    g = iteration_graph(c1, unit, loads)
    flops = float(sum(o.duration for o in g.ops if o.kind == "compute"))
    n_ops = sum(1 for o in g.ops if o.kind == "compute" and o.duration > 0)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = Trainer.build(c1.validate())
        times = [tr.step(it)["step_time_s"] for it in range(iters + warmup)]
    finally:
        torch.set_num_threads(old)
    t = float(np.median(times[warmup:]))
    out = dict(flops=flops, ops=n_ops, time_s=t, flops_per_s=flops / t)
    _COMPUTE_CACHE[key] = dict(out)
    return out


def fit_compute(df) -> dict:
    """Least squares ``time = op_overhead_s * ops + flops / flops_per_s`` over single-process steps.

    Tiny CPU models are bound by per-op interpreter and kernel-launch cost as much as by FLOPs, so
    one FLOP rate cannot price both a batch of 1 and a batch of 20; a fixed cost per compute op of
    the simulator's graph plus a rate can. Both numbers are data: ``kind: fitted`` with their
    ``source``. ``df`` rows: ``ops`` (compute ops per rank), ``flops``, ``time_s``."""
    A = np.stack([np.asarray(df["ops"], float), np.asarray(df["flops"], float)], axis=1)
    t = np.asarray(df["time_s"], float)
    (over, inv_rate), *_ = np.linalg.lstsq(A, t, rcond=None)
    if inv_rate <= 0 or over < 0:  # a line with no physical meaning: fall back to the rate alone
        over, inv_rate = 0.0, float((A[:, 1] @ t) / (A[:, 1] @ A[:, 1]))
    pred = A @ np.array([over, inv_rate])
    ss = float(((t - t.mean()) ** 2).sum())
    return {"op_overhead_s": float(over), "flops_per_s": float(1.0 / inv_rate),
            "r2": 1.0 - float(((t - pred) ** 2).sum()) / ss if ss > 0 else 1.0, "n": int(len(t)), "kind": "fitted",
            "source": "single-process training steps of the tiny GPT-MoE (measure_model_compute), 1 thread"}


def measure_compute_line(cfg: RunConfig, scales: Sequence[int] = (1, 2, 4), iters: int = 10, warmup: int = 2,
                         cache: bool = True) -> dict:
    """``cfg``'s model on one process at ``scales`` x its per-rank batch, and the line
    ``time = op_overhead_s * ops + flops / flops_per_s`` through those steps
    (:func:`moelab.measure.calibrate.fit_compute`; the ops are the same at every batch).

    Why: :func:`measure_compute`'s one effective rate spreads a tiny model's fixed per-op cost (the
    interpreter, small kernels, the optimizer) over its FLOPs, so the large ops, the experts, are priced
    several times slower than they run, and the time a schedule can hide behind them is overstated (on
    Lina's benchmark model, 2.5 ms a step op and 88 GFLOP/s marginal, against 51 GFLOP/s effective).
    Returns the fit (``kind: fitted``, ``source``) with each point's ``batch``, ``flops`` and
    ``time_s``."""

    if not scales or any(int(k) < 1 for k in scales) or len(set(scales)) < 2:
        raise ValueError(f"scales must hold at least two distinct batch multiples >= 1, got {scales!r}")
    b = cfg.train.batch_size
    rows = [dict(batch=k * b, **measure_compute(cfg.with_overrides({"train.batch_size": k * b}), iters, warmup, cache))
            for k in sorted(set(int(k) for k in scales))]
    fit = fit_compute({c: [r[c] for r in rows] for c in ("ops", "flops", "time_s")})
    return {**fit, "points": rows,
            "source": f"single-process training steps of this model at batches {[r['batch'] for r in rows]} "
                      "(measure_compute_line), 1 thread"}


def _compute_worker(i, cfg_dicts, iters, warmup, barrier, q, state):
    import torch

    torch.set_num_threads(1)
    try:
        take_caller_state(state)
        out = []
        for d in cfg_dicts:
            barrier.wait(timeout=120)  # every process measures the same config at the same time
            out.append(measure_compute(RunConfig.from_dict(d), iters=iters, warmup=warmup, cache=False))
        q.put((i, True, out))
    except BaseException as e:  # report, the parent raises
        q.put((i, False, repr(e)))


def measure_compute_concurrent(cfgs: Sequence[RunConfig], nproc: int, *, iters: int = 6, warmup: int = 2,
                               timeout: float = 300.0) -> list:
    """:func:`measure_compute` of each config on ``nproc`` processes at once (no communication).

    ``nproc`` ranks share this machine's cores (and whatever else runs on it), so the rate one rank
    gets is measured the way the real run will get it: all ranks computing together, as they do in
    an expert-parallel step. Returns, per config, the median over processes of ``measure_compute``.
    """
    import queue as queue_mod
    import time

    ctx = rank_context()
    q, barrier = ctx.Queue(), ctx.Barrier(nproc)
    dicts, state = [c.to_dict() for c in cfgs], caller_state()
    procs = [ctx.Process(target=_compute_worker, args=(i, dicts, iters, warmup, barrier, q, state), daemon=True)
             for i in range(nproc)]
    for p in procs:
        p.start()
    res, deadline = {}, time.monotonic() + timeout
    try:
        while len(res) < nproc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"measure_compute_concurrent did not finish within {timeout:.0f} s")
            try:
                i, ok, payload = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a compute-measurement process died with exit code {dead[0]}") from None
                continue
            if not ok:
                raise RuntimeError(f"compute measurement failed in process {i}: {payload}")
            res[i] = payload
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
    out = []
    for j in range(len(dicts)):
        rows = [res[i][j] for i in range(nproc)]
        t = float(np.median([r["time_s"] for r in rows]))
        out.append(dict(flops=rows[0]["flops"], time_s=t, flops_per_s=rows[0]["flops"] / t, nproc=nproc))
    return out
