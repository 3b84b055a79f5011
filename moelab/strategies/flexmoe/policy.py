"""FlexMoE's placement scheduler (spec ``papers/hecate.md`` §3 FlexMoE, §2.9 migration cost), pure.

One layer at a time. Every device has ``E/N + r`` expert slots (``r`` reserved); every expert has at
least one holder, and a holder ("vExpert") keeps the parameters and its own optimizer state. An
expert's tokens are assumed split evenly over its holders (the runtime's dispatcher keeps a holder's
own tokens local and splits the rest, :class:`moelab.placement.rules.HolderOrder`).

The greedy round (:func:`schedule`), at most ``max_steps`` steps, each one of the three primitives of
the FlexMoE paper (the greedy order and tie-breaks are ours, spec [choice]):

- **Expand**: replicate the expert with the highest per-replica load (among those not yet on every
  device) into the least-loaded device
  that has a free slot and does not hold it; with no such slot, one obtained by **Shrink** (drop a
  replica of the expert with the lowest per-replica load that has >= 2 replicas, on the least-loaded
  device holding it that does not hold the expanded expert);
- **Migrate**: move a replica from the most loaded device to the least-loaded device with a free
  slot (the expert whose move best evens the two).

Both candidates are priced and the better one kept while ``gain × K > migration cost`` (each copied
expert costs ``migration_cost``; dropping a replica is free) and the balance ratio does not grow.
Holder sets are kept sorted, so the owner (first holder) is the lowest rank and a round's copies
come from a deterministic sender. Ties always go to the lower expert id, then the lower rank.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

KINDS = ("expand", "shrink", "migrate")


def canonical(holders) -> tuple:
    """Holders as a tuple of sorted rank tuples (the scheduler's and the plan record's form)."""
    return tuple(tuple(sorted(int(r) for r in h)) for h in holders)


def slot_budget(E: int, N: int, r: int) -> int:
    """Expert slots per device and layer: E/N + r."""
    if E % N:
        raise ValueError(f"FlexMoE needs E divisible by N: {E} experts on {N} devices")
    if r < 0:
        raise ValueError(f"reserved slots r must be >= 0, got {r}")
    return E // N + r


def device_loads(holders, F: Sequence[float], N: int) -> np.ndarray:
    """Tokens each device computes when an expert's ``F[e]`` tokens split evenly over its holders."""
    load = np.zeros(N, dtype=np.float64)
    for e, h in enumerate(holders):
        for q in h:
            load[q] += float(F[e]) / len(h)
    return load


def balance_ratio(holders, F: Sequence[float], N: int) -> float:
    """max / mean device load (1.0 when there are no tokens): FlexMoE's trigger and our invariant."""
    load = device_loads(holders, F, N)
    mean = load.sum() / N
    return float(load.max() / mean) if mean > 0 else 1.0


def slots_used(holders, N: int) -> np.ndarray:
    used = np.zeros(N, dtype=np.int64)
    for h in holders:
        for q in h:
            used[q] += 1
    return used


def check_holders(holders, N: int, budget: int) -> None:
    """ValueError unless every expert has >= 1 distinct holder in 0..N-1 and no device exceeds ``budget``."""
    for e, h in enumerate(holders):
        if not h or len(set(h)) != len(h) or any(not 0 <= q < N for q in h):
            raise ValueError(f"expert {e}: holders {list(h)} must be >= 1 distinct ranks of 0..{N - 1}")
    used = slots_used(holders, N)
    if used.max(initial=0) > budget:
        raise ValueError(f"device {int(used.argmax())} holds {int(used.max())} experts, the budget is {budget}")


def load_gain(F: Sequence[float], N: int) -> Callable:
    """A gain in tokens: how much the busiest device's load drops (pair it with a migration cost in tokens)."""
    def gain(old, new) -> float:
        return float(device_loads(old, F, N).max() - device_loads(new, F, N).max())
    return gain


def time_gain(cost, counts) -> Callable:
    """A gain in seconds per iteration from a cost model's plan pricer for ``counts[N][E]``
    (:meth:`moelab.sim.placement_cost.PlacementCost.pricer`): the MoE layer's forward critical path saved."""
    price = cost.pricer(counts).t_moe

    def gain(old, new) -> float:
        return float(price(old) - price(new))
    return gain


def _with(holders, e, add=None, drop=None) -> tuple:
    h = [list(x) for x in holders]
    if drop is not None:
        h[e].remove(drop)
    if add is not None:
        h[e].append(add)
    return canonical(h)


def _expand(holders, F, N, budget) -> Optional[tuple]:
    """(new holders, steps) of the Expand candidate (with a Shrink when no slot is free), or None."""
    E = len(holders)
    load, used = device_loads(holders, F, N), slots_used(holders, N)
    per = [float(F[e]) / len(holders[e]) for e in range(E)]
    growable = [e for e in range(E) if len(holders[e]) < N]
    if not growable:
        return None
    hot = min(growable, key=lambda e: (-per[e], e))
    if per[hot] <= 0:
        return None
    src = holders[hot][0]
    free = [q for q in range(N) if used[q] < budget and q not in holders[hot]]
    if free:
        dst = min(free, key=lambda q: (load[q], q))
        return _with(holders, hot, add=dst), [("expand", hot, src, dst)]
    cold = [e for e in range(E) if len(holders[e]) >= 2 and e != hot
            and any(q not in holders[hot] for q in holders[e])]
    if not cold:
        return None
    e2 = min(cold, key=lambda e: (per[e], e))
    dst = min((q for q in holders[e2] if q not in holders[hot]), key=lambda q: (load[q], q))
    shrunk = _with(holders, e2, drop=dst)
    return _with(shrunk, hot, add=dst), [("shrink", e2, dst, -1), ("expand", hot, src, dst)]


def _migrate(holders, F, N, budget) -> Optional[tuple]:
    """(new holders, steps) of the Migrate candidate, or None."""
    load, used = device_loads(holders, F, N), slots_used(holders, N)
    src = min(range(N), key=lambda q: (-load[q], q))
    free = [q for q in range(N) if used[q] < budget and q != src]
    if not free:
        return None
    dst = min(free, key=lambda q: (load[q], q))
    movable = [e for e, h in enumerate(holders) if src in h and dst not in h and F[e] > 0]
    if not movable:
        return None

    def after(e):
        p = float(F[e]) / len(holders[e])
        return max(load[src] - p, load[dst] + p)

    e = min(movable, key=lambda e: (after(e), e))
    return _with(holders, e, add=dst, drop=src), [("migrate", e, src, dst)]


def schedule(holders, F: Sequence[float], N: int, r: int, *, max_steps: int = 4,
             gain_fn: Optional[Callable] = None, migration_cost: float = 0.0, K: int = 1) -> tuple:
    """One FlexMoE scheduling round of one layer (module doc). ``holders[e]``: the expert's ranks;
    ``F[e]``: its (windowed) tokens; ``gain_fn(old, new)``: what a change saves per iteration (default
    :func:`load_gain`, in tokens); ``migration_cost``: the cost of copying one expert with its
    optimizer state, in the gain's units times iterations (e.g. seconds); ``K``: iterations the
    placement is kept (the scheduling interval). Returns ``(new holders, steps)``, a step being
    ``(kind, expert, src, dst)`` (Shrink: ``dst = -1``; Expand: ``src`` = the expert's owner)."""
    E = len(holders)
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if K < 1:
        raise ValueError(f"K (the scheduling interval) must be >= 1, got {K}")
    if len(F) != E:
        raise ValueError(f"F has {len(F)} loads for {E} experts")
    budget = slot_budget(E, N, r)
    cur = canonical(holders)
    check_holders(cur, N, budget)
    gain_fn = gain_fn or load_gain(F, N)
    steps: list = []
    for _ in range(max_steps):
        ratio = balance_ratio(cur, F, N)
        best = None
        for cand in (_expand(cur, F, N, budget), _migrate(cur, F, N, budget)):
            if cand is None or balance_ratio(cand[0], F, N) > ratio + 1e-12:
                continue
            copies = sum(1 for s in cand[1] if s[0] != "shrink")
            net = gain_fn(cur, cand[0]) * K - copies * migration_cost
            if net > 0 and (best is None or net > best[0]):
                best = (net, cand)
        if best is None:
            break
        cur, new_steps = best[1]
        steps.extend(new_steps)
    return cur, steps


def undo_steps(holders, steps) -> tuple:
    """The holders before ``steps`` were applied (steps of one round, in order; sorted holder sets):
    what the simulator needs to price a round's copies from the recorded plan."""
    cur = [set(h) for h in holders]
    for kind, e, src, dst in reversed([tuple(s) for s in steps]):
        if kind == "expand":
            cur[e].discard(dst)
        elif kind == "shrink":
            cur[e].add(src)
        elif kind == "migrate":
            cur[e].discard(dst)
            cur[e].add(src)
        else:
            raise ValueError(f"unknown FlexMoE step kind {kind!r}; known: {list(KINDS)}")
    return canonical(cur)


def plan_round(holders_per_layer, window_loads, n_window: int, iteration: int, N: int, *, r: int, interval: int,
               threshold: float, max_steps: int, cost, migration_cost: float) -> list:
    """One iteration's FlexMoE round for every layer: ``[(new holders, steps), ...]``. Pure in the window's
    summed ``[L, N, E]`` loads (``n_window`` iterations) and the current holders, so the runtime's Update and
    the paper-scale replay run the very same decision: a layer is scheduled every ``interval`` iterations or
    when its balance ratio exceeds ``threshold``, each step priced by ``cost.t_moe`` (gain per iteration x K
    against ``migration_cost`` seconds per copied expert)."""
    out = []
    for li, holders in enumerate(holders_per_layer):
        holders = canonical(holders)
        if not n_window:
            out.append((holders, []))
            continue
        W = window_loads[li]
        F = W.sum(0)
        if not (iteration % interval == 0 or balance_ratio(holders, F, N) > threshold):
            out.append((holders, []))
            continue
        gain = time_gain(cost, W)
        per_iter = lambda old, new, g=gain: g(old, new) / n_window  # noqa: E731 (the window sums n_window iterations)
        out.append(schedule(holders, F, N, r, max_steps=max_steps, gain_fn=per_iter, migration_cost=migration_cost,
                            K=interval))
    return out
