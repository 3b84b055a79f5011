"""Lina's inference placement as pure functions (spec §2.3): allocation, the phase-2 test, and the
replica split every rank applies to its tokens.

Every rank runs these on the same all-gathered inputs and gets the same plan without talking.

- :func:`allocate`: ``n(e)`` devices wanted per expert (Eq. 1, ``n = N * pop_hat``) -> one expert list
  per device: ``floor(n(e))`` dedicated replicas for popular experts (``rounding="nearest"``: ``n(e)``
  rounded half up, so an expert wanting 1.6 devices gets 2, not 1), first-fit-decreasing packing of
  the fractional ones (bins of capacity 1.0, at most ``max_pack`` experts), experts nobody ranked
  spread over free devices (else a seeded device with room), leftover devices to the expert with the
  highest load per replica. Every expert is placed, no device exceeds ``max_pack``.
  ``rounding="balanced"`` (:func:`allocate_balanced`, an option): replica counts chosen for the busiest
  device instead, packed largest first.
- :func:`top_set`, :func:`needs_replan`: phase 2 re-plans iff the estimated and actual top-``K``
  expert sets differ (set comparison, order ignored). :func:`load_off` (an option): iff the kept plan's
  busiest device carries more of the actual load than the estimate promised it.
- :func:`replica_split`: a source's tokens of one expert in near-equal contiguous parts over its
  replicas, part j to replica ``(j + src) mod R`` (rotation spreads the remainders).
"""
from __future__ import annotations

import collections
import heapq
import math
import random
from typing import Sequence

import numpy as np

from moelab.placement import Placement

ROUNDING = ("floor", "nearest", "balanced")
REPLAN_TESTS = ("sets", "load")  # phase 2: the paper's top-K set comparison | the kept plan's busiest load
BALANCE_TOL = 0.05  # [choice] "balanced" stops adding replicas once the busiest device is within 5 % of the
#                     mean load (each replica costs a swap and a launch; see allocate_balanced)


def allocate(n, N: int, max_pack: int = 4, seed: int = 0, log: list = None, rounding: str = "floor") -> list:
    """Device -> experts for ``n[e]`` wanted devices (see module doc). ``log`` (a list) receives a
    note for every forced overflow of a bin past capacity 1.0. ``rounding``: dedicated replicas of an
    expert with ``n(e) >= 1``, ``floor`` (the spec's [R] default) or ``nearest`` (half up): with few
    devices per expert (N < E) the floor leaves a hot expert's fraction on one device; ``balanced``:
    :func:`allocate_balanced` (``seed`` and ``log`` unused: nothing is random or forced there)."""
    n = np.asarray(n, dtype=np.float64)
    E = len(n)
    if N < 1 or max_pack < 1:
        raise ValueError(f"allocate needs N >= 1 and max_pack >= 1, got N={N}, max_pack={max_pack}")
    if max_pack * N < E:
        raise ValueError(f"max_pack={max_pack} x N={N} devices cannot hold E={E} experts")
    if (n < 0).any() or not np.isfinite(n).all():
        raise ValueError("wanted devices n(e) must be finite and >= 0")
    if rounding not in ROUNDING:
        raise ValueError(f"rounding must be one of {ROUNDING}, got {rounding!r}")
    if rounding == "balanced":
        return allocate_balanced(n, N, max_pack)
    order = sorted(range(E), key=lambda e: (-n[e], e))
    half = 0.5 if rounding == "nearest" else 0.0
    reps = {e: int(math.floor(n[e] + half)) for e in order if n[e] >= 1}
    def short() -> bool:  # too many replica devices, or too little room left for every other expert
        R = sum(reps.values())
        rest = E - sum(1 for r in reps.values() if r > 0)
        return R > N or R * (max_pack - 1) + (N - R) * max_pack < rest

    while short():  # trim: the expert with most replicas, smallest remainder, loses one
        e = max((e for e in reps if reps[e] > 0), key=lambda e: (reps[e], -(n[e] - math.floor(n[e])), -e))
        reps[e] -= 1
    devs, load = [], []
    for e in order:
        for _ in range(reps.get(e, 0)):
            devs.append([e])
            load.append(n[e] / reps[e])
    placed = {e for e, r in reps.items() if r > 0}
    n_dedicated = len(devs)
    small = [e for e in order if e not in placed and n[e] > 0]
    for e in small:  # first fit decreasing into new bins while devices are free
        fit = [i for i in range(n_dedicated, len(devs)) if load[i] + n[e] <= 1.0 + 1e-12 and len(devs[i]) < max_pack]
        if fit:
            i = fit[0]
        elif len(devs) < N:
            devs.append([])
            load.append(0.0)
            i = len(devs) - 1
        else:  # no free device: the least-loaded one with room (over capacity: logged)
            room = [i for i in range(len(devs)) if len(devs[i]) < max_pack]
            i = min(room, key=lambda i: (load[i], i))
            if log is not None:
                log.append(f"expert {e} (n={n[e]:.3f}) forced onto device {i} at load {load[i]:.3f}")
        devs[i].append(e)
        load[i] += n[e]
        placed.add(e)
    zero = [e for e in range(E) if e not in placed]
    rng = random.Random(seed)
    for e in zero:  # nobody ranked it: a free device, else a seeded device with room
        if len(devs) < N:
            devs.append([e])
            load.append(0.0)
        else:
            room = [i for i in range(len(devs)) if len(devs[i]) < max_pack]
            i = rng.choice(room)
            devs[i].append(e)
    while len(devs) < N:  # leftover devices: another replica of the most loaded expert per replica
        count = {e: sum(e in d for d in devs) for e in range(E)}
        e = max(range(E), key=lambda e: (n[e] / count[e], -e))
        devs.append([e])
        load.append(0.0)
    return devs


def _lpt(n, reps, N: int, max_pack: int):
    """(busiest device's load, device -> experts): every expert's ``reps[e]`` replicas, each carrying
    ``n[e] / reps[e]``, largest first onto the least-loaded device that has room and no copy of it yet
    (ties: fewer experts, lower index); None where some replica finds no such device."""
    items = sorted(((n[e] / reps[e], e) for e in range(len(n)) for _ in range(reps[e])), key=lambda x: (-x[0], x[1]))
    heap = [(0.0, 0, d) for d in range(N)]  # (load, experts held, device)
    devs = [[] for _ in range(N)]
    for size, e in items:
        skipped = []
        while heap and e in devs[heap[0][2]]:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, k, d = heapq.heappop(heap)
        devs[d].append(e)
        if k + 1 < max_pack:
            heapq.heappush(heap, (load + size, k + 1, d))
        for x in skipped:
            heapq.heappush(heap, x)
    return busiest(devs, n), devs


def allocate_balanced(n, N: int, max_pack: int = 4) -> list:
    """Device -> experts with replica counts chosen for the busiest device, not rounded from ``n(e)``.

    The spec's ``floor`` leaves an expert wanting 1.6 devices on one: on a skewed batch its device
    carries 1.5x the mean (median over the default scale's layers). Here every expert starts with
    one replica; one more goes, step by step, to the expert with the largest load per replica, each
    step packed by :func:`_lpt`. The first packing whose busiest device is within :data:`BALANCE_TOL`
    of a device's mean load wins (a replica is a swap and a launch on its device: no more than needed);
    if none is by ``max_pack * N`` replicas, the packing with the least busy busiest device. The spec's
    ``floor`` allocation is the first candidate, so the busiest device is never busier than there, or
    than the tolerance. No device is left empty; every expert is placed; no device exceeds ``max_pack``."""
    n = np.asarray(n, dtype=np.float64)
    E = len(n)
    good = (1.0 + BALANCE_TOL) * n.sum() / N + 1e-12
    floor = allocate(n, N, max_pack)
    best = (busiest(floor, n), floor)
    if best[0] <= good:
        return floor
    reps = [1] * E
    while True:
        got = _lpt(n, reps, N, max_pack)
        if got is not None and all(got[1]):
            if got[0] <= good:
                return got[1]
            if got[0] < best[0] - 1e-12:
                best = got
        big = max((e for e in range(E) if reps[e] < N), key=lambda e: (n[e] / reps[e], -e), default=None)
        if sum(reps) >= N * max_pack or big is None:
            break
        reps[big] += 1
    return best[1]


def busiest(devs, n) -> float:
    """The busiest device's load: its experts' ``n(e)`` over their replica counts, summed."""
    reps = collections.Counter(e for d in devs for e in d)
    return max(sum(n[e] / reps[e] for e in d) for d in devs)


def to_placement(devs: Sequence[Sequence[int]], num_experts: int) -> Placement:
    """The :class:`Placement` of a device -> experts list (holders in device order)."""
    holders = [[] for _ in range(num_experts)]
    for d, es in enumerate(devs):
        for e in es:
            holders[e].append(d)
    return Placement(num_experts, len(devs), tuple(tuple(h) for h in holders))


def top_set(pop, k: int) -> frozenset:
    """The ``k`` most popular experts (ties: lower id first)."""
    p = np.asarray(pop, dtype=np.float64)
    return frozenset(sorted(range(len(p)), key=lambda e: (-p[e], e))[:k])


def needs_replan(pop_hat, pop, k: int) -> bool:
    """Phase 2: re-plan iff the estimated and the actual top-k sets differ."""
    return top_set(pop_hat, k) != top_set(pop, k)


def load_off(devs, pop_hat, pop, tol: float) -> bool:
    """Phase 2 by load (``serve.strategy_options.replan_test: load``): re-plan iff the plan made from ``pop_hat``
    puts on its busiest device more than ``1 + tol`` times the busiest load the estimate predicted for it (both
    normalised to N devices' worth). The set test ignores magnitudes: a plan can keep the right hot
    experts and still balance them badly; a plan as good as its estimate is kept however coarse its
    replicas (a re-plan from the actual counts could not round them finer). An estimate of nothing
    re-plans."""
    est, act = np.asarray(pop_hat, dtype=np.float64), np.asarray(pop, dtype=np.float64)
    if not est.sum() > 0:
        return True
    N = len(devs)
    return busiest(devs, N * act / act.sum()) > (1.0 + tol) * busiest(devs, N * est / est.sum()) + 1e-12


def replica_split(count: int, replicas: int, src: int) -> list:
    """Tokens a source sends to each of an expert's ``replicas`` (index into its holder list):
    near-equal parts, part j (the larger ones first) going to replica ``(j + src) mod replicas``."""
    base, extra = divmod(int(count), replicas)
    out = [0] * replicas
    for j in range(replicas):
        out[(j + src) % replicas] = base + (1 if j < extra else 0)
    return out
