"""Hecate's policies replayed over a load trace, without processes: the per-iteration plans
:class:`moelab.strategies.hecate.update.HecateUpdate` would compute, as keyword arguments of
:func:`moelab.strategies.hecate.sim_graph.hecate_iteration_graph`. Same pure functions, same order
(iteration 0 has no history: P' = P; an iteration's plan uses the loads of earlier iterations only;
calibration sees the iteration's own counts, as after the gate), so paper-scale figures price the
policies the runtime runs, not a model of them."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from moelab.strategies.hecate.policy import (
    LoadWindow,
    calibrate_plan,
    holders_of,
    homogeneous_owners,
    materialize_plan,
    reshard_owners,
)


def hecate_plans(trace, *, t: int, m: int, ranks_per_node: int, cost=None, reshard_interval: int = 100,
                 window: int = 5, reshard_window: Optional[int] = None, calibration: bool = True, rm: bool = False,
                 assign: str = "proportional", materialize: bool = True, shard: bool = True,
                 prefer_fewer_free: bool = True, backend: str = "a2a", calibration_rule: str = "all_slots",
                 time_policy: bool = False) -> list:
    """Per iteration of ``trace`` (``[iters, layers, N, E]`` tokens per source and expert) the graph kwargs
    ``owners / prefetch / holders / moved / rm / backend`` plus ``calibration`` (per layer: off, nothing,
    rejected, accepted). ``cost``: a :class:`~moelab.sim.placement_cost.PlacementCost` (needed for calibration).
    ``time_policy``: also ``policy_s``, this host's CPU seconds of each layer's calibration (``thread_time``),
    which the graph puts on every rank's path before dispatch as a REAL run's record does; off by default, so
    that figures do not depend on the host."""
    trace = np.asarray(trace, dtype=np.int64)
    iters, L, N, E = trace.shape
    G = int(ranks_per_node)
    owners = homogeneous_owners(L, E, N)
    win, rwin = LoadWindow(window, L, E), LoadWindow(reshard_window or window, L, E)
    out = []
    for it in range(iters):
        moved = []
        if shard and reshard_interval and it > 0 and it % reshard_interval == 0 and len(rwin):
            new = reshard_owners(rwin.estimate(), t, owners, N, G, prefer_fewer_free)
            moved = [(l, e, owners[l][e], new[l][e]) for l in range(L) for e in range(E) if new[l][e] != owners[l][e]]
            owners = new
        F = win.estimate()
        pre, final, status, cpu = [], [], [], []
        for l in range(L):
            P = holders_of(owners[l])
            p = materialize_plan(owners[l], F[l].tolist(), t, m, N, G, assign) if materialize and len(win) else P
            f, s, c0 = p, "off", time.thread_time()
            if calibration and materialize and m > 0 and cost is not None:
                cal = calibrate_plan(p, owners[l], trace[it, l], m, N, G, cost, assign, calibration_rule)
                f, s = cal.holders, cal.status
            cpu.append(time.thread_time() - c0)
            pre.append(p)
            final.append(f)
            status.append(s)
        out.append(dict(owners=[list(o) for o in owners], prefetch=pre, holders=final, moved=moved, rm=rm,
                        backend=backend, calibration=status, **({"policy_s": cpu} if time_policy else {})))
        loads = trace[it].sum(1)
        win.push(loads)
        rwin.push(loads)
    return out


def graph_kwargs(plan: dict) -> dict:
    """The graph's arguments of one replayed iteration (without the bookkeeping keys)."""
    return {k: v for k, v in plan.items() if k != "calibration"}
