"""Hecate's pure policies (moelab.strategies.hecate.policy) and cost model (moelab.sim.placement_cost): spec
papers/hecate.md §5.6 (Alg. 1), §5.8 (Alg. 2), §5.10 (load window), §5.11 (calibration), §5.13 (t).
No processes: every rank runs these same functions on the same integers."""
from __future__ import annotations

import numpy as np
import pytest

from moelab.sim.placement_cost import PlacementCost, overlap_degree
from moelab.sim.profiles import get_profile
from moelab.strategies.hecate.policy import (
    LoadWindow,
    calibrate_plan,
    holders_of,
    homogeneous_owners,
    materialize_plan,
    memory_slots,
    plan_hash,
    remaining_slots,
    replicas_per_device,
    reshard_owners,
    top_experts,
)

RNG = np.random.default_rng(7)


def random_case(rng, N=None, G=None, E=None):
    G = G or int(rng.choice([1, 2, 4]))
    N = N or G * int(rng.integers(1, 4))
    E = E or N * int(rng.integers(1, 4))
    owners = [e // (E // N) for e in range(E)]
    F = rng.zipf(1.5, size=E).clip(max=10_000).tolist()
    return N, G, E, owners, F


def check_alg1(owners, F, t, m, N, G, plan):
    E = len(owners)
    for e, h in enumerate(plan):
        assert h[0] == owners[e] and len(set(h)) == len(h)  # P ⊆ P', owner first, no duplicate
        assert list(h[1:]) == sorted(h[1:])
    t_, m_ = min(t, E), min(m, t, E)
    assert max(replicas_per_device(plan, N)) <= m_  # non-owned copies per device <= min(m, t)
    added = [len(h) - 1 for h in plan]
    if t_ == 0 or m_ == 0 or not any(F):
        assert plan == holders_of(owners)
        return
    top = top_experts(F, t_)
    if m >= t_:  # exactly the top-t everywhere, nothing else
        for e in range(E):
            assert len(plan[e]) == (N if e in top else 1)
    else:
        assert sum(added) <= N * m_
        assert all(added[e] == 0 for e in range(E) if e not in top)
        counts = [added[e] for e in top]  # hottest first
        assert counts == sorted(counts, reverse=True) or len(set(F[e] for e in top)) < len(top)


@pytest.mark.parametrize("assign", ["proportional", "mean_load"])
def test_alg1_invariants_on_random_cases(assign):
    rng = np.random.default_rng(1)
    for _ in range(300):
        N, G, E, owners, F = random_case(rng)
        t, m = int(rng.integers(0, E + 2)), int(rng.integers(0, E + 2))
        plan = materialize_plan(owners, F, t, m, N, G, assign)
        check_alg1(owners, F, t, m, N, G, plan)
        assert materialize_plan(owners, list(F), t, m, N, G, assign) == plan  # deterministic


def test_alg1_t_zero_m_zero_and_zero_loads_give_p():
    owners = [0, 0, 1, 1]
    assert materialize_plan(owners, [9, 1, 1, 1], 0, 4, 2, 1) == holders_of(owners)
    assert materialize_plan(owners, [9, 1, 1, 1], 3, 0, 2, 1) == holders_of(owners)
    assert materialize_plan(owners, [0, 0, 0, 0], 3, 3, 2, 1) == holders_of(owners)


def test_alg1_spreads_over_nodes_before_doubling_up():
    # 2 nodes x 2, m = 1 slot per device; experts 0 and 1 (both owned on node 0) want 2 replicas each:
    # each first crosses to node 1 (no copy there yet), then doubles up in node 0
    owners = [0, 1, 2, 3]
    plan = materialize_plan(owners, [500, 500, 0, 0], 2, 1, 4, 2)
    assert plan[0] == (0, 1, 2) and plan[1] == (1, 0, 3) and plan[2:] == ((2,), (3,))
    # t >= E is capped at E; m >= t replicates the top-t on every device
    assert materialize_plan(owners, [5, 4, 3, 2], 9, 9, 4, 2) == tuple((o,) + tuple(r for r in range(4) if r != o)
                                                                    for o in owners)


def test_alg1_with_one_expert_per_rank_and_every_token_to_one_expert():
    owners = list(range(4))
    plan = materialize_plan(owners, [800, 0, 0, 0], 1, 1, 4, 2)
    assert plan[0] == (0, 1, 2, 3) and all(len(h) == 1 for h in plan[1:])


def test_uniform_loads_need_no_replica_under_the_mean_load_rule():
    # spec §5.13 "uniform trace => Hecate == EP": with memory binding (m < t) and replicas only until the
    # per-copy load reaches the mean device load, no expert of a uniform layer gets a replica
    owners = [e // 2 for e in range(8)]
    assert materialize_plan(owners, [100] * 8, 4, 2, 4, 2, "mean_load") == holders_of(owners)
    assert materialize_plan(owners, [100] * 8, 4, 2, 4, 2, "proportional") != holders_of(owners)


def test_remaining_slots_count_non_owned_copies():
    owners = [0, 1]
    assert remaining_slots(((0, 1), (1,)), owners, 2, 2) == [2, 1]


# ---- calibration ----------------------------------------------------------------------------------------
def cost(G=2, **kw):
    return PlacementCost.from_profile(get_profile("hecate_A"), 768, 1536, ranks_per_node=G, **kw)


def test_calibration_accepts_only_a_modeled_gain_and_stays_within_slots():
    owners = [e // 2 for e in range(8)]
    P = holders_of(owners)
    heavy = np.array([[20000, 1, 1, 1, 1, 1, 1, 1]] * 4)  # one expert gets everything: replicas pay off
    cal = calibrate_plan(P, owners, heavy, 2, 4, 2, cost())
    assert cal.accepted and cal.t_after < cal.t_before and cal.added
    assert max(replicas_per_device(cal.holders, 4)) <= 2
    assert all(d in cal.holders[e] for e, d in cal.added)
    light = np.array([[50, 1, 1, 1, 30, 1, 1, 1]] * 4)  # a few tokens: the blocking gather costs more
    cal = calibrate_plan(P, owners, light, 1, 4, 2, cost())
    assert not cal.accepted and cal.holders == P and cal.t_after >= cal.t_before and cal.added
    # no slot left: nothing proposed
    full = materialize_plan(owners, heavy.sum(0), 1, 1, 4, 2)
    cal = calibrate_plan(full, owners, heavy, 1, 4, 2, cost())
    assert cal.added == () and not cal.accepted and cal.holders == full


def test_calibration_best_rule_takes_the_few_hot_experts_the_all_slots_rule_cannot():
    """``all_slots`` proposes every free slot (t_cal = m_rem), all or nothing; ``best`` prices t_cal = 1..m_rem
    and proposes the fastest. One hot expert among many warm ones: gathering 6 experts onto every device costs
    more than it saves, gathering the hot one pays."""
    owners = [e // 2 for e in range(8)]
    P = holders_of(owners)
    C = np.array([[2000, 200, 200, 200, 200, 200, 200, 200]] * 4)
    c = cost()
    full = calibrate_plan(P, owners, C, 6, 4, 2, c)
    best = calibrate_plan(P, owners, C, 6, 4, 2, c, rule="best")
    assert not full.accepted and full.holders == P  # the all-slots proposal does not pay
    assert best.accepted and best.t_after < best.t_before and best.t_after < full.t_after
    assert max(replicas_per_device(best.holders, 4)) == 1  # one of the 6 free slots: the hot expert everywhere
    assert best.holders[0] == (0, 1, 2, 3)
    # never worse than all_slots: on the heavy case both accept, best at most as slow
    heavy = np.array([[20000, 1, 1, 1, 1, 1, 1, 1]] * 4)
    a, b = (calibrate_plan(P, owners, heavy, 2, 4, 2, c, rule=r) for r in ("all_slots", "best"))
    assert a.accepted and b.accepted and b.t_after <= a.t_after
    with pytest.raises(ValueError, match="rule"):
        calibrate_plan(P, owners, heavy, 2, 4, 2, c, rule="some")


def _calibrate_by_loop(holders, owners, C, m, N, G, c, rule):
    """The rule as the spec words it: Alg. 1 re-run for each t_cal, each proposal priced on its own."""
    from moelab.strategies.hecate.policy import _alg1, _canonical

    holders = _canonical(holders)
    F = C.sum(0).tolist()
    m_rem = min(remaining_slots(holders, owners, m, N))
    t_before = c.t_moe(holders, C)
    best = None
    for t_cal in (range(1, m_rem + 1) if rule == "best" else (m_rem,)) if m_rem > 0 else ():
        cal = _alg1(holders, F, t_cal, t_cal, N, G, "proportional")
        if cal == holders:
            continue
        t = c.t_moe(cal, C) + c.t_spag(holders, cal)
        if best is None or t < best[1]:
            best = (cal, t)
    if best is None:
        return holders, False, t_before
    return (best[0] if best[1] < t_before else holders), best[1] < t_before, best[1]


@pytest.mark.parametrize("N, G, E, hier", [(4, 2, 8, True), (8, 4, 16, False), (8, 2, 8, True), (16, 4, 32, True)])
def test_calibration_prices_its_nested_candidates_in_one_pass_exactly_as_one_by_one(N, G, E, hier):
    """``calibrate_plan`` prices every t_cal of a call at once (cumulative route deltas, a batched cost); the
    plan, the decision and the modeled times equal the spec's loop over Alg. 1 bit for bit, on skewed and
    flat counts, with replicas already materialized and slots already used."""
    rng = np.random.default_rng(N * E + G)
    c = cost(G, hier=hier)
    owners = [e // (E // N) for e in range(E)]
    for trial in range(12):
        skew = rng.dirichlet(np.full(E, 0.3 if trial % 2 else 3.0))
        C = rng.multinomial(int(rng.integers(1, 40000)), skew, size=N)
        P = materialize_plan(owners, C.sum(0), int(rng.integers(0, 3)), int(rng.integers(0, 3)), N, G)
        m = int(rng.integers(0, E))
        for rule in ("all_slots", "best"):
            got = calibrate_plan(P, owners, C, m, N, G, c, rule=rule)
            want = _calibrate_by_loop(P, owners, C, m, N, G, c, rule)
            assert (got.holders, got.accepted) == want[:2] and got.t_after == want[2], (trial, rule)
    R = np.stack([c.routes(P, C), c.routes(holders_of(owners), C)])
    assert list(c.t_moe_many(R)) == [c.t_moe_routes(r) for r in R]


# ---- Alg. 2 ----------------------------------------------------------------------------------------------
def brute_least_loaded_node(F_layer, placed, e, slots, N, G):
    """Node loads (this layer's J' experts placed so far) of nodes with a free slot: the minimum."""
    loads = {}
    for n in range(N // G):
        if any(slots[d] > 0 for d in range(n * G, (n + 1) * G)):
            loads[n] = sum(F_layer[x] for x, d in placed if d // G == n)
    return min(loads.values())


@pytest.mark.parametrize("prefer_fewer_free", [True, False])
def test_alg2_owns_each_expert_once_and_balances_slots(prefer_fewer_free):
    rng = np.random.default_rng(3)
    for _ in range(60):
        G = int(rng.choice([1, 2]))
        N = G * int(rng.integers(1, 4))
        E = N * int(rng.integers(1, 3))
        L = int(rng.integers(1, 4))
        F = rng.zipf(1.4, size=(L, E)).clip(max=5000)
        t = int(rng.integers(0, E + 1))
        cur = homogeneous_owners(L, E, N)
        new = reshard_owners(F, t, cur, N, G, prefer_fewer_free)
        flat = [d for row in new for d in row]
        assert all(0 <= d < N for d in flat)
        assert np.bincount(flat, minlength=N).tolist() == [L * E // N] * N
        assert reshard_owners(F, t, cur, N, G, prefer_fewer_free) == new


def test_alg2_j_prime_greedy_picks_a_least_loaded_node_brute_force():
    F = np.array([[50, 40, 30, 20, 10, 5, 3, 1]])
    N, G = 4, 2
    new = reshard_owners(F, 1, homogeneous_owners(1, 8, N), N, G)
    # replay the greedy: each J' expert (load order) must land on a node of minimal load among open nodes
    slots, placed = [2] * N, []
    for e in sorted(range(1, 8), key=lambda e: -F[0][e]):
        want = brute_least_loaded_node(F[0], placed, e, slots, N, G)
        got = sum(F[0][x] for x, d in placed if d // G == new[0][e] // G)
        assert got == want, (e, new[0])
        placed.append((e, new[0][e]))
        slots[new[0][e]] -= 1


def test_alg2_homogeneous_is_ep_and_hot_experts_keep_their_owner():
    assert homogeneous_owners(2, 8, 4) == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2
    with pytest.raises(ValueError):
        homogeneous_owners(1, 6, 4)
    F = np.array([[1, 1, 1, 1, 1, 1, 1, 1]])
    assert reshard_owners(F, 8, homogeneous_owners(1, 8, 4), 4, 2) == homogeneous_owners(1, 8, 4)  # t >= E: J only
    new = reshard_owners(np.array([[90, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 90]]), 1,
                         homogeneous_owners(2, 8, 4), 4, 2)
    assert new[0][0] == 0  # layer 0's hot (J) expert keeps its owner, which still had a free slot
    assert np.bincount(sum(new, []), minlength=4).tolist() == [4] * 4
    with pytest.raises(ValueError, match="not divisible"):
        reshard_owners(np.ones((1, 6)), 1, [[0] * 6], 4, 2)


def test_alg2_can_leave_a_rank_without_experts_of_a_layer():
    # two layers, one hot expert per layer on different devices: heterogeneous counts per layer appear
    F = np.array([[1000, 900, 800, 700, 1, 1, 1, 1], [1, 1, 1, 1, 1000, 900, 800, 700]])
    new = reshard_owners(F, 0, homogeneous_owners(2, 8, 4), 4, 2)
    per_layer = [np.bincount(row, minlength=4).tolist() for row in new]
    assert per_layer[0] != [2, 2, 2, 2] and sum(map(sum, per_layer)) == 16
    assert np.bincount(sum(new, []), minlength=4).tolist() == [4] * 4


# ---- load window, hash, t and m ---------------------------------------------------------------------------
def test_load_window_sums_the_last_w_iterations_as_integers():
    w = LoadWindow(3, 1, 2)
    assert w.estimate().tolist() == [[0, 0]] and len(w) == 0
    for i in range(5):
        w.push([[i, 2 * i]])
        lo = max(0, i - 2)
        assert w.estimate().tolist() == [[sum(range(lo, i + 1)), 2 * sum(range(lo, i + 1))]]
        assert w.estimate().dtype == np.int64
    assert len(w) == 3
    with pytest.raises(ValueError):
        w.push([[1, 2, 3]])
    with pytest.raises(ValueError):
        LoadWindow(0, 1, 1)


def test_plan_hash_is_stable_and_tells_plans_apart():
    a = [((0, 2, 1), (1,)), ((0,), (1, 0))]
    assert plan_hash(a) == plan_hash([((0, 1, 2), (1,)), ((0,), (1, 0))])  # replica order does not matter
    assert plan_hash(a) != plan_hash([((0, 1), (1,)), ((0,), (1, 0))])


def test_overlap_degree_is_monotone_and_capped():
    s = 4.72e6
    ts = [overlap_degree(T, 12.5e9, s, 64) for T in (0, 1e-4, 5e-4, 1e-3, 1.0)]
    assert ts == sorted(ts) and ts[0] == 0 and ts[-1] == 64
    bws = [overlap_degree(5e-4, bw, s, 64) for bw in (1e9, 12.5e9, 50e9)]
    assert bws == sorted(bws) and bws[0] < bws[-1]
    c = cost()
    assert c.overlap_degree(5e-4, 64) >= PlacementCost(**{**c.__dict__, "hier": False}).overlap_degree(5e-4, 64)
    with pytest.raises(ValueError):
        overlap_degree(-1, 1e9, s, 4)
    assert memory_slots(10e6, 2, 2e6, 2e6) == 1 and memory_slots(0, 12, 1, 1) == 0


# ---- cost model ---------------------------------------------------------------------------------------------
def test_cost_model_rewards_replicating_a_hot_expert_and_prices_sparse_gathers():
    c = cost()
    owners = [e // 2 for e in range(8)]
    P = holders_of(owners)
    C = np.array([[4000, 10, 10, 10, 10, 10, 10, 10]] * 4)
    P2 = materialize_plan(owners, C.sum(0), 2, 2, 4, 2)
    assert c.load(P2, C).max() < c.load(P, C).max() and c.t_moe(P2, C) < c.t_moe(P, C)
    assert c.t_spag(P, P) == 0.0 and c.t_spag(P, P2) > 0
    flat = PlacementCost(**{**c.__dict__, "hier": False})
    assert flat.t_spag(P, P2) >= c.t_spag(P, P2)  # flat sends one copy per remote replica
    uniform = np.full((4, 8), 100)  # replicas cannot beat EP on uniform loads: the busiest device only gains rows
    assert c.load(materialize_plan(owners, uniform.sum(0), 2, 2, 4, 2), uniform).max() >= c.load(P, uniform).max()
    assert c.migration_bytes(2) == 2 * c.expert_bytes * 7
    assert c.routes(P, C).sum() == C.sum()


def test_plan_pricer_equals_a_full_routing_for_every_plan_it_prices():
    """The memoized delta pricing (calibration's ``best`` rule, FlexMoE's gain) is exact: integer routes."""
    rng = np.random.default_rng(3)
    N, E, G = 8, 16, 4
    c = PlacementCost(**{**cost().__dict__, "ranks_per_node": G})
    C = rng.integers(0, 500, size=(N, E))
    owners = [e // 2 for e in range(E)]
    pr = c.pricer(C)
    plans = [holders_of(owners)] + [
        tuple(tuple([owners[e]] + sorted(set(rng.choice(N, size=rng.integers(0, N), replace=False).tolist())
                                         - {owners[e]}))
              for e in range(E)) for _ in range(12)]
    # nested plans (calibration's `best` candidates: one more expert everywhere each time) go from the last plan
    nested = [tuple(tuple(range(N)) if e < k else holders_of(owners)[e] for e in range(E)) for k in range(1, 6)]
    for P in plans + plans[::-1] + nested:  # the first plan becomes the base; later ones deltas of it or the last
        R = pr.routes(P)
        assert np.array_equal(R, c.routes(P, C))
        assert pr.t_moe(P) == c.t_moe(P, C)
        R += 1  # the caller's copy: the pricer's own stays exact
    with pytest.raises(ValueError, match="experts"):
        pr.routes(plans[0][:-1])
