"""Lina's inference placement as pure functions (spec §2.3): allocation, the phase-2 test, and the
replica split every rank applies to its tokens.

Every rank runs these on the same all-gathered inputs and gets the same plan without talking.

- :func:`allocate`: ``n(e)`` devices wanted per expert (Eq. 1, ``n = N * pop_hat``) -> one expert list
  per device: ``floor(n(e))`` dedicated replicas for popular experts (``rounding="nearest"``: ``n(e)``
  rounded half up, so an expert wanting 1.6 devices gets 2, not 1), first-fit-decreasing packing of
  the fractional ones (bins of capacity 1.0, at most ``max_pack`` experts), experts nobody ranked
  spread over free devices (else a seeded device with room), leftover devices to the expert with the
  highest load per replica. Every expert is placed, no device exceeds ``max_pack``.
- :func:`top_set`, :func:`needs_replan`: phase 2 re-plans iff the estimated and actual top-``K``
  expert sets differ (set comparison, order ignored).
- :func:`replica_split`: a source's tokens of one expert in near-equal contiguous parts over its
  replicas, part j to replica ``(j + src) mod R`` (rotation spreads the remainders).
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np

from moelab.placement import Placement


ROUNDING = ("floor", "nearest")


def allocate(n, N: int, max_pack: int = 4, seed: int = 0, log: list = None, rounding: str = "floor") -> list:
    """Device -> experts for ``n[e]`` wanted devices (see module doc). ``log`` (a list) receives a
    note for every forced overflow of a bin past capacity 1.0. ``rounding``: dedicated replicas of an
    expert with ``n(e) >= 1``, ``floor`` (the spec's [R] default) or ``nearest`` (half up): with few
    devices per expert (N < E) the floor leaves a hot expert's fraction on one device."""
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


def replica_split(count: int, replicas: int, src: int) -> list:
    """Tokens a source sends to each of an expert's ``replicas`` (index into its holder list):
    near-equal parts, part j (the larger ones first) going to replica ``(j + src) mod replicas``."""
    base, extra = divmod(int(count), replicas)
    out = [0] * replicas
    for j in range(replicas):
        out[(j + src) % replicas] = base + (1 if j < extra else 0)
    return out
