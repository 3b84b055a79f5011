"""The rearranging baselines replayed over a load trace at paper scale, with their runtime's own pure
policies (no processes): FlexMoE's rounds (:func:`moelab.strategies.flexmoe.policy.plan_round`, the function its
Update calls) and SmartMoE's LPT re-placement (its strategy's replay, when present in this checkout).
Each returns the per-iteration keyword arguments of the strategy's simulator graph and a note of what the
policy did (a policy that never fired says so)."""
from __future__ import annotations

import numpy as np

from moelab.strategies.flexmoe.policy import canonical, plan_round

FLEXMOE = dict(r=1, interval=10, threshold=1.2, max_steps=4, window=5)  # the strategy's defaults (spec §3 [choice])


def flexmoe_plans(trace, cost, *, r: int = 1, interval: int = 10, threshold: float = 1.2, max_steps: int = 4,
                  window: int = 5) -> tuple:
    """``(plans, note)`` for ``trace`` ``[iters, L, N, E]``: holders start as EP; each iteration's round sees the
    previous ``window`` iterations' loads, as the runtime's; migration priced by §2.9 over one NIC."""
    trace = np.asarray(trace, dtype=np.int64)
    iters, L, N, E = trace.shape
    holders = [tuple((e // (E // N),) for e in range(E)) for _ in range(L)]
    hist: list = []
    mig = cost.migration_bytes(1) / cost.nic_Bps
    plans, rounds, copies = [], 0, 0
    for it in range(iters):
        W = np.sum(hist, axis=0, dtype=np.int64) if hist else np.zeros((L, N, E), dtype=np.int64)
        res = plan_round(holders, W, len(hist), it, N, r=r, interval=interval, threshold=threshold,
                         max_steps=max_steps, cost=cost, migration_cost=mig)
        holders = [canonical(h) for h, _ in res]
        steps = [[list(s) for s in st] for _, st in res]
        rounds += sum(1 for st in steps if st)
        copies += sum(len(st) for st in steps)
        plans.append(dict(holders=holders, steps=steps))
        hist.append(trace[it])
        del hist[:-window]
    reps = sum(len(h) - 1 for h in holders[0]) if holders else 0
    return plans, (f"r={r}, K={interval}; layer rounds with steps: {rounds} ({copies} steps); "
                   f"replicas at the end (layer 0): {reps}")


def smartmoe_plans(trace, cost, ranks_per_node: int):
    """SmartMoE's replay from its strategy package, or None while the strategy is not in this checkout."""
    try:
        from moelab.strategies.smartmoe.sim_graph import smartmoe_replay  # here: guarded, the strategy may be absent
    except ImportError:
        return None
    return smartmoe_replay(trace, K=25, window=5, cost=cost, N=trace.shape[2], decision="cost")
