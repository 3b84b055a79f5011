"""Calibration: measure this machine's collectives and GEMMs, fit alpha-beta lines, make a profile.

The x of every fit is the most non-local bytes a rank sends in the call by the shared byte rule
(:func:`moelab.sim.costs.sent_bytes`), so a fitted ``beta`` is directly seconds per byte on the
link class and the cost model can reuse the line unchanged. Default sizes are small: a full
:func:`calibrate_local` takes a few seconds on 2 cores.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import numpy as np

from moelab.comm.topology import Topology

COLLECTIVES = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast")
# the torch.distributed call each op name is measured with
TORCH_CALLS = {"all_to_all": "all_to_all_single", "all_reduce": "all_reduce",
               "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
               "broadcast": "broadcast"}
DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)  # bytes of each rank's input
DEFAULT_GEMMS = ((128, 128, 128), (256, 256, 256), (512, 512, 512))


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # s
    beta: float  # s per byte
    r2: float
    n: int = 0  # points fitted

    @property
    def bandwidth(self) -> float:
        """Bytes/s implied by beta."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")

    def predict(self, x):
        return self.alpha + self.beta * np.asarray(x, dtype=float)

    def as_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "r2": self.r2, "n": self.n}


def fit_alpha_beta(x, t) -> AlphaBeta:
    """Ordinary least squares ``t = alpha + beta * x``; R^2 of the fit."""
    x, t = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    A = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    resid = t - (alpha + beta * x)
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(float(alpha), float(beta), r2, len(x))


def fit_collectives(df) -> dict:
    """``{op: AlphaBeta}`` from a :func:`measure_collectives` frame (x = ``sent_bytes``, y = ``time_s``)."""
    return {op: fit_alpha_beta(grp.sent_bytes, grp.time_s) for op, grp in df.groupby("op", sort=False)}


def sent_bytes_for(op: str, nproc: int, nbytes: int) -> int:
    """The fit's x for a measured call with ``nbytes`` of input per rank (root 0)."""
    from moelab.sim.costs import sent_bytes

    group = list(range(nproc))
    topo = Topology(nproc, nproc)
    if op == "all_to_all":
        split = nbytes // nproc
        return sent_bytes(op, group, topo, splits=[[split] * nproc] * nproc)
    return sent_bytes(op, group, topo, nbytes, root=0)


# ---- collectives ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=timeout_s))
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
        ctx = mp.start_processes(_collective_worker,
                                 args=(nproc, _free_port(), list(sizes), list(ops), reps, warmup, timeout_s, path),
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


def calibrate_local(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, gemm_sizes=DEFAULT_GEMMS,
                    ops: Sequence[str] = COLLECTIVES, reps: int = 7, timeout_s: float = 60.0) -> dict:
    """Measure and fit everything :func:`moelab.sim.profiles.local_profile_from_calibration` needs."""
    coll = measure_collectives(nproc, sizes, ops, reps=reps, timeout_s=timeout_s)
    gemm = measure_gemm(gemm_sizes)
    fits = fit_collectives(coll)
    return {"nproc": nproc, "device": "cpu", "elem_bytes": 4,
            "gemm_flops": float(gemm.flops_per_s.iloc[-1]), "peak_flops": float(gemm.flops_per_s.max()),
            "collectives": {op: ab.as_dict() for op, ab in fits.items()},
            "raw": {"collectives": coll.to_dict("records"), "gemm": gemm.to_dict("records")}}
