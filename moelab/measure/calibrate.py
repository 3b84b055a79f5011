"""Calibration: measure this machine's collectives and GEMMs, fit alpha-beta lines, make a profile.

The x of every fit is the most non-local bytes a rank sends in the call by the shared byte rule
(:func:`moelab.comm.bytes.sent_bytes`), so a fitted ``beta`` is directly seconds per byte on the
link class and the cost model can reuse the line unchanged. Default sizes are small: a full
:func:`calibrate_local` takes a few seconds on 2 cores.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from typing import Optional, Sequence

import numpy as np

from moelab.comm.bytes import sent_bytes
from moelab.comm.costs import AlphaBeta, fit_alpha_beta  # noqa: F401  (the fits' line, shared with the strategies)
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.measure.local import BASE_MODEL, cpu_cores, machine_profile
from moelab.measure.realruns import fit_compute, measure_compute, run_real_many
from moelab.measure.validate import compare, simulate_real
from moelab.runtime.ranks import hosted_store, join_hosted
from moelab.sim.graphs import iteration_graph
from moelab.sim.profiles import ClusterProfile

COLLECTIVES = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast")
# the torch.distributed call each op name is measured with
TORCH_CALLS = {"all_to_all": "all_to_all_single", "all_reduce": "all_reduce",
               "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
               "broadcast": "broadcast"}
DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)  # bytes of each rank's input
DEFAULT_GEMMS = ((128, 128, 128), (256, 256, 256), (512, 512, 512))


def fit_collectives(df) -> dict:
    """``{op: AlphaBeta}`` from a :func:`measure_collectives` frame (x = ``sent_bytes``, y = ``time_s``)."""
    return {op: fit_alpha_beta(grp.sent_bytes, grp.time_s) for op, grp in df.groupby("op", sort=False)}


def sent_bytes_for(op: str, nproc: int, nbytes: int) -> int:
    """The fit's x for a measured call with ``nbytes`` of input per rank (root 0)."""
    group = list(range(nproc))
    topo = Topology(nproc, nproc)
    if op == "all_to_all":
        split = nbytes // nproc
        return sent_bytes(op, group, topo, splits=[[split] * nproc] * nproc)
    return sent_bytes(op, group, topo, nbytes, root=0)


# ---- collectives ---------------------------------------------------------------------------------
def _call(dist, op, x, out, nproc):
    if op == "all_to_all":
        dist.all_to_all_single(out, x)
    elif op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)
    elif op == "reduce_scatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x)
    elif op == "broadcast":
        dist.broadcast(x, src=0)
    else:
        raise ValueError(f"unknown collective {op!r}; known: {COLLECTIVES}")


def _collective_worker(rank, nproc, port, sizes, ops, reps, warmup, timeout_s, result_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    join_hosted(rank, nproc, port, timeout_s)
    rows = []
    try:
        for op in ops:
            for nbytes in sizes:
                numel = max(nproc, (int(nbytes) // 4) // nproc * nproc)
                x = torch.ones(numel, dtype=torch.float32)
                out = torch.empty(numel * nproc if op == "all_gather" else
                                  numel // nproc if op == "reduce_scatter" else numel)
                times = torch.zeros(reps, dtype=torch.float64)
                for i in range(warmup + reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    _call(dist, op, x, out, nproc)
                    if i >= warmup:
                        times[i - warmup] = time.perf_counter() - t0
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                rows.append({"op": op, "torch_call": TORCH_CALLS[op], "nproc": nproc, "input_bytes": numel * 4,
                             "sent_bytes": sent_bytes_for(op, nproc, numel * 4),
                             "time_s": float(times.median()), "time_min_s": float(times.min())})
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def measure_collectives(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, ops: Sequence[str] = COLLECTIVES,
                        reps: int = 5, warmup: int = 2, timeout_s: float = 60.0):
    """Time real gloo collectives on ``nproc`` spawned ranks: one row per (op, size).

    Each timed call follows a barrier; a call's time is the max over ranks, a row's the median over
    ``reps``. Columns: op, torch_call, nproc, input_bytes (per rank), sent_bytes (the fit's x),
    time_s, time_min_s. The ranks are killed and ``TimeoutError`` raised after ``timeout_s``.
    """
    import pandas as pd
    import torch.multiprocessing as mp

    bad = [o for o in ops if o not in COLLECTIVES]
    if bad:
        raise ValueError(f"unknown collective(s) {bad}; known: {COLLECTIVES}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        store = hosted_store(timeout_s)  # noqa: F841 - served until the ranks are done
        ctx = mp.start_processes(_collective_worker,
                                 args=(nproc, store.port, list(sizes), list(ops), reps, warmup, timeout_s, path),
                                 nprocs=nproc, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"measure_collectives({nproc}) did not finish in {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        with open(path) as f:
            return pd.DataFrame(json.load(f))


# ---- compute -------------------------------------------------------------------------------------
def measure_gemm(sizes: Sequence[tuple] = DEFAULT_GEMMS, reps: int = 5, device: str = "cpu",
                 dtype=None, threads: Optional[int] = 1):
    """Achieved FLOP/s of ``torch.matmul`` for each (m, k, n): one row each (median of ``reps``).

    ``threads`` pins torch's CPU threads for the measurement (1 = what one rank gets by default).
    """
    import pandas as pd
    import torch

    dtype = dtype or torch.float32
    old = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    try:
        for m, k, n in sizes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            torch.matmul(a, b)
            sync()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                sync()
                ts.append(time.perf_counter() - t0)
            t = float(np.median(ts))
            flops = 2.0 * m * k * n
            rows.append({"m": m, "k": k, "n": n, "device": device, "dtype": str(dtype).replace("torch.", ""),
                         "flops": flops, "time_s": t, "flops_per_s": flops / t})
    finally:
        torch.set_num_threads(old)
    return pd.DataFrame(rows)


def calibrate_gpu(sizes: Sequence[tuple] = ((1024, 1024, 1024), (4096, 4096, 4096)), dtype=None):
    """GEMM FLOP/s on the CUDA device, or None when there is none (never required)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return measure_gemm(sizes, reps=10, device="cuda", dtype=dtype or torch.float16, threads=None)


# ---- compute of whole models ------------------------------------------------------------------------
# (batch, experts, top_k) of the tiny GPT-MoE the compute line is fitted on: spanning the batches
# the 4-rank validation set uses (2-64; a line fitted on small batches extrapolates badly), but
# never its shapes, so the fit is checked on configs it never saw
COMPUTE_MODELS = ((1, 4, 1), (12, 8, 2), (64, 4, 2), (128, 16, 1), (224, 8, 2))


def measure_model_compute(models: Sequence[tuple] = COMPUTE_MODELS, base: Optional[dict] = None, iters: int = 6,
                          warmup: int = 2):
    """One process, no communication: median step time of the tiny GPT-MoE (``base`` overrides, default
    :data:`moelab.measure.local.BASE_MODEL`) at each (batch, experts, top_k), with the FLOPs and
    compute ops the simulator charges for that step. One row each."""
    import pandas as pd


    rows = []
    for b, e, k in models:
        cfg = RunConfig().with_overrides({**(base or BASE_MODEL), "parallel.nproc": 1, "train.batch_size": b,
                                          "model.moe.num_experts": e, "model.moe.top_k": k}).validate()
        m = measure_compute(cfg, iters=iters, warmup=warmup, cache=False)
        rows.append({"batch": b, "experts": e, "top_k": k, **m})
    return pd.DataFrame(rows)


# (nodes, experts, top_k, batch) of the 4-rank training runs the in-context terms are fitted on:
# shapes the validation set (moelab.measure.validate.GRID_4) does not use
TRAIN_MODELS = ((1, 8, 1, 4), (2, 4, 2, 32), (1, 16, 2, 112), (2, 8, 1, 200))


def train_model_configs(nproc: int = 4, models: Sequence[tuple] = TRAIN_MODELS, iters: int = 8) -> list:
    """``[(name, RunConfig)]`` of the tiny GPT-MoE at each (nodes, experts, top_k, batch), unemulated."""
    return [(f"cal-n{nproc}x{n}-e{e}k{k}-b{b}", RunConfig().with_overrides({
        **BASE_MODEL, "parallel.nproc": nproc, "parallel.topology.nodes": n, "model.moe.num_experts": e,
        "model.moe.top_k": k, "train.batch_size": b, "train.iters": iters, "train.seed": 9}).validate())
        for n, e, k, b in models]


def fit_in_context(calibration: dict, reals: Sequence, warmup: int = 3) -> dict:
    """The compute line and a per-call cost fitted on real multi-rank training steps.

    Ranks sharing a few cores do not slow each other by ``ranks / cores`` in lockstep: the
    measured steps show them taking turns, a rank computing at nearly full speed while others wait
    inside a collective, and each collective taking longer than alone (its members must be
    scheduled again). So both terms are fitted where they occur, on training steps of shapes the
    validation never uses, each on its own part of the step (``Comparison``'s split):

    - compute: ``real compute = op_overhead_s * ops + flops / flops_per_s`` (least squares over the
      timed iterations; per compute step of the graph, the busiest rank's flops, as a critical path
      through ranks that wait for each other at every collective charges them);
    - communication: ``call_overhead_s`` = median over timed iterations of (real communication -
      simulated alpha-beta communication) / collective calls per rank (clipped at 0).
    """
    unit = ClusterProfile(name="unit", nodes=1, gpus_per_node=1, gpu="-", peak_flops=1.0, achieved_flops=1.0,
                          intra_bw_GBps=1.0, intra_latency_us=0.0, inter_bw_GBps=1.0, inter_latency_us=0.0, mem_GB=1.0)
    rows = []
    for r in reals:  # per timed iteration: per compute step (op name), its busiest rank's flops
        for it in range(warmup, r.iters):
            g = iteration_graph(r.cfg, unit, r.loads[it])
            step: dict = {}
            for o in g.ops:
                if o.kind == "compute" and o.duration > 0:
                    step[o.name] = max(step.get(o.name, 0.0), o.duration)
            rows.append((len(step), sum(step.values())))
    base = {**calibration, "in_context": {"op_overhead_s": 0.0, "flops_per_s": 1e12, "call_overhead_s": 0.0,
                                          "source": "-"}}  # alpha-beta communication alone
    sims = [simulate_real(r.cfg, r.loads, machine_profile(r.cfg, base, compute="in_context")) for r in reals]
    it = compare(list(reals), sims, warmup=warmup, warn=False).iters
    it = it[~it.warmup]
    comp = fit_compute({"ops": [x[0] for x in rows], "flops": [x[1] for x in rows],
                        "time_s": it.real_compute_s.to_numpy()})
    calls = [sum(1 for o in sim.results[0].graph.ops if o.comm is not None and 0 in o.ranks) for sim in sims]
    n_calls = np.repeat(calls, [r.iters - warmup for r in reals])
    extra = (it.real_comm_s.to_numpy() - it.sim_comm_s.to_numpy()) / n_calls
    return {**comp, "call_overhead_s": max(float(np.median(extra)), 0.0), "n": int(len(it)),
            "configs": [r.cfg.run_id() for r in reals],
            "source": f"real training steps on {reals[0].nproc} gloo ranks of held-out shapes (fit_in_context)"}


def calibrate_local(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, gemm_sizes=DEFAULT_GEMMS,
                    ops: Sequence[str] = COLLECTIVES, reps: int = 7, timeout_s: float = 60.0,
                    compute_models: Optional[Sequence[tuple]] = None,
                    train_models: Optional[Sequence[tuple]] = None) -> dict:
    """Measure and fit everything :func:`moelab.sim.profiles.local_profile_from_calibration` needs.

    Collectives are timed on ``nproc`` ranks, so their alpha already holds what ``nproc`` ranks on
    this machine's cores pay per call when nothing else runs. With ``compute_models`` (e.g.
    :data:`COMPUTE_MODELS`) the single-process compute line of :func:`fit_compute` is fitted too
    (``compute``: priced with the ranks sharing ``cores`` as an engine CPU pool). With
    ``train_models`` (e.g. :data:`TRAIN_MODELS`) real ``nproc``-rank training steps of those shapes
    are run and :func:`fit_in_context` fits the compute line and a per-call cost on them
    (``in_context``: ``machine_profile(compute="in_context")``)."""
    coll = measure_collectives(nproc, sizes, ops, reps=reps, timeout_s=timeout_s)
    gemm = measure_gemm(gemm_sizes)
    fits = fit_collectives(coll)
    out = {"nproc": nproc, "device": "cpu", "elem_bytes": 4, "cores": cpu_cores(),
           "gemm_flops": float(gemm.flops_per_s.iloc[-1]), "peak_flops": float(gemm.flops_per_s.max()),
           "collectives": {op: {**ab.as_dict(), "kind": "fitted",
                                "source": f"gloo {TORCH_CALLS[op]} on {nproc} loopback ranks (measure_collectives)"}
                           for op, ab in fits.items()},
           "raw": {"collectives": coll.to_dict("records"), "gemm": gemm.to_dict("records")}}
    if compute_models:
        comp = measure_model_compute(compute_models)
        out["compute"] = fit_compute(comp)
        out["raw"]["compute"] = comp.to_dict("records")
    if train_models:
        named = train_model_configs(nproc, train_models)
        out["in_context"] = fit_in_context(out, run_real_many([c for _, c in named], nproc, timeout=300))
    return out


def quick_calibration(nproc: int = 2, sizes=(1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 23), reps: int = 5,
                      ops=("all_to_all", "all_reduce", "all_gather"), timeout_s: float = 60.0,
                      compute_models=None, train_models=None) -> dict:
    """:func:`calibrate_local` at small sizes (a few seconds on 2 cores);
    ``compute_models`` / ``train_models`` (:data:`COMPUTE_MODELS` / :data:`TRAIN_MODELS`)
    add the fitted compute line and the in-context terms (tens of seconds more)."""
    return calibrate_local(nproc, sizes=sizes, gemm_sizes=((64, 64, 64), (128, 128, 128), (256, 256, 256)),
                           ops=ops, reps=reps, timeout_s=timeout_s, compute_models=compute_models,
                           train_models=train_models)


# ---- the EMULATED door's fixed costs per call, held out (what a simulator of an EMULATED run adds) -----
