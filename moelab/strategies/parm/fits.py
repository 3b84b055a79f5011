"""Alpha-beta fits of Parm's collectives, measured through the comm door on the live groups (spec §2.10a).

Each (collective, group) the paper's model needs is timed over a sweep of sizes on the groups the
run declared: a world barrier before every timed call, the max over ranks of each repetition, the
median over repetitions, then OLS ``t = alpha + beta * x`` (:func:`moelab.measure.calibrate.fit_alpha_beta`,
with standard errors and R^2). ``x`` counts elements the way the paper does: AllGather output,
AlltoAll per-rank send, AllReduce tensor, ReduceScatter input, SAA output. Every rank gets the same
numbers (the max is agreed collectively), so Alg. 1 chooses the same schedule everywhere.

A fit says where it came from: ``emulated`` when the door emulates declared links (EMULATED), else
the loopback of this machine (REAL gloo); the two are never pooled. The sweep's calls are removed
from the run's records afterwards: they are calibration, not training traffic.
"""
from __future__ import annotations

import statistics
import time

import torch

from moelab.comm.costs import fit_alpha_beta
from moelab.comm.saa import saa
from moelab.runtime.timing import barrier
from moelab.strategies.parm.layout import EP, EPESP, ESP, MP, SAA, ParmLayout

# name -> (door op, group): the collectives of Eq. 1, 11, 14 and Alg. 1
COLLECTIVES = {"AG_MP": ("all_gather", MP), "AG_ESP": ("all_gather", ESP), "AR_ESP": ("all_reduce", ESP),
               "RS_ESP": ("reduce_scatter", ESP), "A2A_EP": ("all_to_all", EP), "A2A_EPESP": ("all_to_all", EPESP),
               "SAA": ("saa", SAA)}
CPU_SIZES = tuple(2 ** p for p in range(8, 19, 2))  # 256 .. 262144 elements (the paper: 2^8 .. 2^24 on GPUs)


def _group_size(comm, name: str) -> int:
    op, group = COLLECTIVES[name]
    return len(comm.group_ranks(MP if op == "saa" else group))


def _issue(comm, name: str, x: int, dtype):
    """One call of ``name`` whose paper-``x`` is ``x`` elements (x is rounded to a multiple the op needs)."""
    op, group = COLLECTIVES[name]
    n = len(comm.group_ranks(group))
    if op == "all_gather":
        return comm.all_gather(torch.ones(max(x // n, 1), dtype=dtype), group=group)
    if op == "all_to_all":
        rows = [1] * n
        return comm.all_to_all_raw(torch.ones(n, max(x // n, 1), dtype=dtype), rows, rows, group)
    if op == "all_reduce":
        return comm.all_reduce_(torch.ones(x, dtype=dtype), group=group)
    if op == "reduce_scatter":
        return comm.reduce_scatter(torch.ones(n * max(x // n, 1), dtype=dtype), group=group)
    n_mp = len(comm.group_ranks(MP))
    return saa(comm, torch.ones(comm.world_size, max(x // (n_mp * comm.world_size), 1), dtype=dtype), SAA, MP)


def paper_x(comm, name: str, x: int) -> int:
    """The elements actually moved for a requested ``x`` (after the rounding of :func:`_issue`)."""
    op, group = COLLECTIVES[name]
    n = len(comm.group_ranks(group))
    if op in ("all_gather", "all_to_all", "reduce_scatter"):
        return n * max(x // n, 1)
    if op == "saa":
        n_mp = len(comm.group_ranks(MP))
        return n_mp * comm.world_size * max(x // (n_mp * comm.world_size), 1)
    return x


def measure(comm, layout: ParmLayout, names=tuple(COLLECTIVES), sizes=CPU_SIZES, reps: int = 5, warmup: int = 2,
            dtype=torch.float32) -> list:
    """Rows ``{name, group_size, x, time_s}`` (time = median over reps of the max over ranks). A
    collective whose group has one member moves nothing and is skipped."""
    rows, n0 = [], len(comm.rec.comm)
    for name in names:
        if _group_size(comm, name) == 1:
            continue
        for x in sizes:
            times = []
            for i in range(warmup + reps):
                barrier(comm)
                t0 = time.perf_counter()
                _issue(comm, name, x, dtype)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            worst = comm.all_gather(torch.tensor(times, dtype=torch.float64), group="world").max(0).values
            rows.append({"name": name, "group_size": _group_size(comm, name), "x": paper_x(comm, name, x),
                         "time_s": statistics.median(worst.tolist())})
    del comm.rec.comm[n0:]  # calibration traffic is not the run's
    return rows


def fit(rows: list, emulated: bool) -> dict:
    """``{name: {alpha, beta (s per element), r2, alpha_se, beta_se, n, source}}`` from :func:`measure` rows."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = [r for r in rows if r["name"] == name]
        ab = fit_alpha_beta([r["x"] for r in pts], [r["time_s"] for r in pts])
        out[name] = {**ab.as_dict(), "source": "EMULATED links" if emulated else "REAL gloo loopback",
                     "group_size": pts[0]["group_size"]}
    return out


def measure_fits(comm, layout: ParmLayout, **kw) -> dict:
    """Measure and fit every collective of the layout on the live groups (same result on every rank)."""
    return fit(measure(comm, layout, **kw), emulated=comm.emulation is not None)
