"""Hecate's (FSSDP) scheduling policies as pure functions (spec ``papers/hecate.md`` §2.3-§2.7).

Every rank runs these on the same integer inputs (all-reduced loads, the current plan) and gets the
same plan without talking: no torch.distributed, deterministic tie-breaks (lower expert id, lower
rank, lower node id). A plan of one layer is ``holders``: per expert the tuple ``(owner, replica
ranks ascending...)``, the :class:`moelab.placement.Placement` format; the *sharding* P of a layer is
its owners row (one owner per expert), the *materialization plan* P' ⊇ P adds replicas.

- :func:`materialize_plan` — Alg. 1: P' from P, estimated loads F, overlap degree t, memory slots m.
- :func:`calibrate_plan` — §2.4: after the gate, more replicas on top of P' if the cost model says the
  layer gets faster despite the blocking gather.
- :func:`reshard_owners` — Alg. 2: heterogeneous sharding of all layers jointly, L·E/N experts per device.
- :class:`LoadWindow` — §2.7: integer sums of the last w iterations' global loads.
"""
from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

ASSIGN = ("proportional", "mean_load")


# ---- helpers ------------------------------------------------------------------------------------------
def top_experts(F: Sequence[int], t: int) -> tuple:
    """The ``t`` experts with the largest load, hottest first (ties: lower expert id)."""
    t = max(0, min(int(t), len(F)))
    return tuple(sorted(range(len(F)), key=lambda e: (-int(F[e]), e))[:t])


def holders_of(owners: Sequence[int]) -> tuple:
    """The plan P of a sharding: every expert on its owner only."""
    return tuple((int(o),) for o in owners)


def _canonical(holders) -> tuple:
    """Owner first, replicas ascending (one spelling per plan, so plans compare and hash equal)."""
    return tuple((h[0],) + tuple(sorted(h[1:])) for h in holders)


def replicas_per_device(holders, N: int) -> list:
    """Non-owned copies each device holds."""
    out = [0] * N
    for h in holders:
        for d in h[1:]:
            out[d] += 1
    return out


def remaining_slots(holders, owners: Sequence[int], m: int, N: int) -> list:
    """Per device: ``m`` minus the replicas (copies of experts it does not own) it holds in ``holders``."""
    out = [int(m)] * N
    for e, h in enumerate(holders):
        for d in h:
            if d != owners[e]:
                out[d] -= 1
    return out


def _wanted(assign: str, e: int, F, top, total_slots: int, remaining: int, N: int) -> int:
    """``assignSlotsByLoad`` (undefined in the paper; spec §2.3 [choice]): extra replicas of ``e``.

    ``proportional``: ``round(total_slots · F_e / Σ_top F)`` (round half up); ``mean_load``: replicas until
    the per-copy load reaches the mean device load, ``ceil(F_e / (ΣF / N)) - 1``. Capped by ``N - 1`` and
    the slots still in the pool."""
    if assign == "proportional":
        s = sum(int(F[x]) for x in top)
        want = math.floor(total_slots * int(F[e]) / s + 0.5) if s else 0
    elif assign == "mean_load":
        total = sum(int(x) for x in F)
        want = math.ceil(int(F[e]) * N / total) - 1 if total else 0
    else:
        raise ValueError(f"assign must be one of {ASSIGN}, got {assign!r}")
    return max(0, min(N - 1, remaining, want))


def _alg1(base, F, t: int, m: int, N: int, G: int, assign: str) -> tuple:
    """Alg. 1 on top of ``base`` holders: at most ``m`` new copies per device, top-``t`` experts."""
    E = len(base)
    if len(F) != E:
        raise ValueError(f"loads have {len(F)} entries for {E} experts")
    if G < 1 or N % G:
        raise ValueError(f"{N} ranks do not split into nodes of {G}")
    if t < 0 or m < 0:
        raise ValueError(f"t and m must be >= 0, got t={t}, m={m}")
    holders = [list(h) for h in base]
    t = min(int(t), E)
    m = min(int(m), t)
    if t == 0 or m == 0 or not any(int(x) for x in F):
        return _canonical(holders)
    top = top_experts(F, t)
    if m >= t:  # memory does not bind (the paper's "t <= m" after m = min(m, t), spec §6.1)
        for e in top:
            holders[e] += [d for d in range(N) if d not in holders[e]]
        return _canonical(holders)
    slots = [m] * N
    remaining = N * m
    for e in top:
        n = _wanted(assign, e, F, top, N * m, remaining, N)
        placed = 0
        for _ in range(n):
            have = set(holders[e])
            open_nodes = sorted({d // G for d in range(N) if slots[d] > 0 and d not in have})
            if not open_nodes:
                break

            def node_key(nd):
                members = range(nd * G, (nd + 1) * G)
                return (any(d in have for d in members), -sum(slots[d] for d in members), nd)

            nd = min(open_nodes, key=node_key)
            d = min((d for d in range(nd * G, (nd + 1) * G) if slots[d] > 0 and d not in have),
                    key=lambda d: (-slots[d], d))
            holders[e].append(d)
            slots[d] -= 1
            placed += 1
        remaining -= placed  # unplaceable replicas go back to the pool
    return _canonical(holders)


# ---- Alg. 1 and calibration ------------------------------------------------------------------------------
def materialize_plan(owners: Sequence[int], F: Sequence[int], t: int, m: int, N: int, ranks_per_node: int,
                     assign: str = "proportional") -> tuple:
    """Alg. 1 (spec §2.3): the materialization plan P' of one layer.

    ``owners[e]``: the sharding P; ``F``: estimated loads (integers); ``t``: overlap degree (experts a device
    can receive hidden behind the previous non-MoE compute); ``m``: memory slots per device. With
    ``m >= t`` the top-``t`` experts go to every device; otherwise at most ``m`` replicas per device, the
    hottest experts first, each spread over nodes without a copy before doubling up inside a node
    (then most free slots, lowest node id; inside the node: most free slots, lowest rank). ``t = 0``,
    ``m = 0`` or all-zero loads give P."""
    return _alg1(holders_of(owners), F, t, m, N, ranks_per_node, assign)


@dataclass(frozen=True)
class Calibration:
    """The calibration stage's decision (spec §2.4): ``holders`` is the plan to use (P_cal if accepted,
    else the input P'), ``added`` the replicas it proposed, ``t_before`` / ``t_after`` the modeled
    MoE-layer times (``t_after`` includes the blocking gather)."""

    holders: tuple
    accepted: bool
    added: tuple
    t_before: float
    t_after: float

    @property
    def status(self) -> str:
        """What the plan records: accepted, rejected (proposed, did not pay) or nothing (no copy to add)."""
        return "accepted" if self.accepted else ("rejected" if self.added else "nothing")


CALIBRATION_RULES = ("all_slots", "best")


def calibrate_plan(holders, owners: Sequence[int], counts, m: int, N: int, ranks_per_node: int, cost,
                   assign: str = "proportional", rule: str = "all_slots") -> Calibration:
    """§2.4: with the real per-source ``counts`` ``[N][E]`` of this call, re-run Alg. 1 on top of the
    materialized ``holders`` with loads F_act = Σ_s counts, memory = the least remaining slots over
    devices m_rem; accept iff ``cost.t_moe(P_cal) + cost.t_spag(P', P_cal) < cost.t_moe(P')`` (the extra
    gather is on the critical path, not hidden).

    ``rule``: ``all_slots`` (the spec's [choice]) proposes t_cal = m_rem, every free slot, so the proposal is
    all or nothing; ``best`` prices t_cal = 1..m_rem and proposes the fastest (ties: fewer replicas), so a
    call whose full proposal does not pay may still take the few hottest experts. ``assign`` does not enter:
    with t = m, Alg. 1 assigns no slots by load (kept for the callers' symmetry with :func:`materialize_plan`)."""
    if rule not in CALIBRATION_RULES:
        raise ValueError(f"rule must be one of {CALIBRATION_RULES}, got {rule!r}")
    C = np.asarray(counts, dtype=np.int64)
    holders = _canonical(holders)
    F = C.sum(0).tolist()
    m_rem = min(remaining_slots(holders, owners, m, N))
    pricer = cost.pricer(C)
    t_before = float(pricer.t_moe(holders))
    # Alg. 1 with t = m = t_cal puts the t_cal hottest experts on every device: the candidates t_cal = 1..m_rem
    # are nested, each the one before plus the next hottest expert everywhere, and are priced in one pass
    top = top_experts(F, m_rem) if m_rem > 0 and any(F) else ()
    steps = [(e, _canonical([holders[e] + tuple(d for d in range(N) if d not in holders[e])])[0]) for e in top]
    differs = np.cumsum([h != holders[e] for e, h in steps]) > 0  # candidate k is not P' itself
    ks = [k for k in (range(len(steps)) if rule == "best" else range(len(steps))[-1:]) if differs[k]]
    if not ks:
        return Calibration(holders, False, (), t_before, t_before)

    def proposal(k):
        cal = list(holders)
        for e, h in steps[:k + 1]:
            cal[e] = h
        return tuple(cal)

    if len(ks) == 1:  # one proposal (all_slots): price that plan alone
        cal = proposal(ks[0])
        t_after = float(pricer.t_moe(cal)) + float(cost.t_spag(holders, cal))
    else:  # best: every proposal in one pass, the first minimum (ties go to fewer replicas)
        t = cost.t_moe_many(pricer.routes_growing(holders, steps)[ks]) + cost.t_spag_growing(holders, steps, N)[ks]
        i = int(np.argmin(t))
        cal, t_after = proposal(ks[i]), float(t[i])
    added = tuple((e, d) for e in range(len(cal)) for d in cal[e] if d not in holders[e])
    ok = t_after < t_before
    return Calibration(cal if ok else holders, ok, added, t_before, t_after)


# ---- Alg. 2 ---------------------------------------------------------------------------------------------
def homogeneous_owners(L: int, E: int, N: int) -> list:
    """The initial sharding: E/N contiguous experts per device per layer, i.e. the EP layout."""
    if E % N:
        raise ValueError(f"{E} experts are not divisible by {N} ranks")
    return [[e // (E // N) for e in range(E)] for _ in range(L)]


def reshard_owners(F, t: int, owners, N: int, ranks_per_node: int, prefer_fewer_free: bool = True) -> list:
    """Alg. 2 (spec §2.5, §6.6): a new owner for every (layer, expert), ``L·E/N`` per device in total.

    Per layer the top-``t`` experts (J) are replicated by Alg. 1 anyway; the others (J') are placed greedily,
    layers by their hottest J' expert first, experts by load: the node with the least (per-layer) load
    among nodes with a free slot, then the least-loaded device in it (ties: fewer free slots first, as the
    paper writes — ``prefer_fewer_free=False`` inverts —, then the lower id). J experts then keep their
    current owner where it has a free slot (less to migrate), else take free devices in rank order."""
    F = np.asarray(F, dtype=np.int64)
    L, E = F.shape
    G = int(ranks_per_node)
    if (L * E) % N:
        raise ValueError(f"L*E = {L * E} expert slots are not divisible by {N} ranks")
    if G < 1 or N % G:
        raise ValueError(f"{N} ranks do not split into nodes of {G}")
    slots = [L * E // N] * N
    J = [set(top_experts(F[l], t)) for l in range(L)]
    Jp = [[e for e in range(E) if e not in J[l]] for l in range(L)]
    sign = 1 if prefer_fewer_free else -1
    order = sorted(range(L), key=lambda l: (-(max(int(F[l][e]) for e in Jp[l]) if Jp[l] else -1), l))
    new = [[-1] * E for _ in range(L)]
    for l in order:
        node_load, dev_load = [0] * (N // G), [0] * N
        for e in sorted(Jp[l], key=lambda e: (-int(F[l][e]), e)):
            free = [sum(slots[d] for d in range(n * G, (n + 1) * G)) for n in range(N // G)]
            n = min((n for n in range(N // G) if free[n] > 0), key=lambda n: (node_load[n], sign * free[n], n))
            d = min((d for d in range(n * G, (n + 1) * G) if slots[d] > 0),
                    key=lambda d: (dev_load[d], sign * slots[d], d))
            new[l][e] = d
            slots[d] -= 1
            node_load[n] += int(F[l][e])
            dev_load[d] += int(F[l][e])
    rest = sorted(((l, e) for l in range(L) for e in J[l]), key=lambda le: (le[0], -int(F[le[0]][le[1]]), le[1]))
    deferred = []
    for l, e in rest:
        d = int(owners[l][e])
        if slots[d] > 0:
            new[l][e] = d
            slots[d] -= 1
        else:
            deferred.append((l, e))
    for l, e in deferred:
        d = next(d for d in range(N) if slots[d] > 0)
        new[l][e] = d
        slots[d] -= 1
    return new


# ---- load window, hashing, t and m ------------------------------------------------------------------------
class LoadWindow:
    """The last ``w`` iterations' global loads ``[L, E]`` (int64); :meth:`estimate` is their integer sum.

    Sums, not means (spec §2.7 [choice]): the ranking Alg. 1/2 need is the same and integers are identical
    on every rank bitwise. Before any push the estimate is all zeros (iteration 0: P' = P)."""

    def __init__(self, w: int, num_layers: int, num_experts: int):
        if w < 1:
            raise ValueError(f"window must be >= 1, got {w}")
        self.w, self.shape = int(w), (int(num_layers), int(num_experts))
        self._q: deque = deque(maxlen=self.w)

    def push(self, loads) -> None:
        a = np.asarray(loads, dtype=np.int64)
        if a.shape != self.shape:
            raise ValueError(f"loads must be {list(self.shape)}, got {list(a.shape)}")
        self._q.append(a.copy())

    def estimate(self) -> np.ndarray:
        return np.sum(self._q, axis=0, dtype=np.int64) if self._q else np.zeros(self.shape, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._q)


def plan_hash(holders_per_layer) -> str:
    """A stable digest of a plan (all layers), for the debug check that every rank computed the same."""
    canon = tuple(_canonical(h) for h in holders_per_layer)
    return hashlib.sha1(repr(canon).encode()).hexdigest()


def memory_slots(free_bytes: float, n_live_layers: int, param_bytes: float, grad_bytes: float) -> int:
    """m = ⌊free / (n_live_layers · (param + grad bytes per expert))⌋ (spec §2.3 [choice]); n_live_layers is
    L without re-materialization, 2 with it."""
    if free_bytes < 0 or n_live_layers < 1 or param_bytes + grad_bytes <= 0:
        raise ValueError(f"need free >= 0, live layers >= 1, bytes per expert > 0; got "
                         f"{free_bytes}, {n_live_layers}, {param_bytes}+{grad_bytes}")
    return int(free_bytes // (n_live_layers * (param_bytes + grad_bytes)))

