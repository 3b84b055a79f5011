"""SmartMoE's re-placement as pure functions (spec ``papers/hecate.md`` §3 SmartMoE): a permutation of the
experts over the devices, exactly E/N each, balanced by longest-processing-time-first, applied only when the
§2.9 cost model says the next K iterations gain more than the migration costs. No torch.distributed, ties
broken by id, so every rank computes the same placement from the same all-reduced loads."""
from __future__ import annotations

from typing import Sequence

import numpy as np

DECISIONS = ("cost", "always", "never")


def lpt_owners(F: Sequence[int], N: int, slots_per_device: int) -> list:
    """Experts by load, descending (ties: lower id), each to the least-loaded device with a free slot
    (ties: lower rank)."""
    E = len(F)
    if slots_per_device * N != E:
        raise ValueError(f"{E} experts do not fill {N} devices x {slots_per_device} slots")
    load, free = [0] * N, [slots_per_device] * N
    owners = [-1] * E
    for e in sorted(range(E), key=lambda e: (-int(F[e]), e)):
        d = min((d for d in range(N) if free[d] > 0), key=lambda d: (load[d], d))
        owners[e] = d
        free[d] -= 1
        load[d] += int(F[e])
    return owners


def device_loads(owners: Sequence[int], F: Sequence[int], N: int) -> list:
    out = [0] * N
    for e, d in enumerate(owners):
        out[d] += int(F[e])
    return out


def moves(old: Sequence[int], new: Sequence[int]) -> list:
    """``[(expert, src, dst)]`` of the experts whose owner changes."""
    return [(e, int(a), int(b)) for e, (a, b) in enumerate(zip(old, new)) if a != b]


def layer_time(cost, owners, counts) -> float:
    """One layer's forward + backward time of a permutation (§2.9: 4 all-to-alls, 3x the expert forward)."""
    R = cost.routes(tuple((int(o),) for o in owners), counts)
    return 4.0 * cost.t_a2a_routes(R) + 3.0 * cost.t_expert_fwd_routes(R)


def decide(old, new, counts, K: int, cost, decision: str = "cost", iterations: int = 1) -> tuple:
    """``(apply, gain_s, cost_s)``: the gain of ``new`` over ``old`` on ``counts`` (per-source loads summed over
    ``iterations``) for K iterations against moving the changed experts with their optimizer state (over a NIC
    if one crosses nodes, else intra-node)."""
    if decision not in DECISIONS:
        raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
    mv = moves(old, new)
    if not mv:
        return False, 0.0, 0.0
    gain = K * (layer_time(cost, old, counts) - layer_time(cost, new, counts)) / max(1, iterations)
    G = cost.ranks_per_node
    bw = cost.nic_Bps if any(s // G != d // G for _, s, d in mv) else cost.intra_Bps
    mig = cost.migration_bytes(len(mv)) / bw
    ok = {"always": True, "never": False}.get(decision, gain > mig)
    return ok, float(gain), float(mig)


def smartmoe_round(owners, window_loads, K: int, cost, N: int, decision: str = "cost", iterations: int = 1) -> list:
    """Every layer's ``(new owners, status, gain_s, cost_s)`` for one re-placement round from the window's
    summed per-source loads ``[L, N, E]`` (status: applied | rejected | none)."""
    out = []
    W = np.asarray(window_loads, dtype=np.int64)
    for li, old in enumerate(owners):
        E = len(old)
        new = lpt_owners(W[li].sum(0).tolist(), N, E // N)
        ok, gain, mig = decide(old, new, W[li], K, cost, decision, iterations)
        status = "none" if not moves(old, new) else ("applied" if ok else "rejected")
        out.append(([int(o) for o in (new if ok else old)], status, gain, mig))
    return out
