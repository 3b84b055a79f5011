"""Lina's inference placement and estimator as pure functions (spec §5 I8, I9, I12-I14)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moelab.strategies.lina.placement import (
    BALANCE_TOL,
    allocate,
    busiest,
    load_off,
    needs_replan,
    replica_split,
    to_placement,
    top_set,
)
from moelab.strategies.lina.popularity import PathTable, estimation_accuracy, markov_traces, pattern_share


def random_n(rng, E, N):
    pop = rng.dirichlet(np.full(E, 0.3))
    keep = rng.random(E) < 0.8  # some experts nobody ranked
    pop = pop * keep
    return N * pop * rng.uniform(0.6, 1.0)  # estimated mass < 1


@pytest.mark.parametrize("rounding", ["floor", "nearest", "balanced"])
@pytest.mark.parametrize("E,N,max_pack", [(4, 4, 4), (8, 4, 4), (16, 16, 4), (16, 4, 4), (16, 8, 2), (6, 3, 2)])
def test_allocation_places_every_expert_within_max_pack_on_exactly_n_devices(E, N, max_pack, rounding):
    rng = np.random.default_rng(E * 100 + N)
    for _ in range(200):
        n = random_n(rng, E, N)
        devs = allocate(n, N, max_pack, seed=1, rounding=rounding)
        assert len(devs) == N
        assert all(1 <= len(d) <= max_pack for d in devs)
        assert {e for d in devs for e in d} == set(range(E))
        assert all(len(set(d)) == len(d) for d in devs)
        reps = {e: sum(e in d for d in devs) for e in range(E)}
        if rounding == "balanced":
            # replicas chosen for the busiest device: never busier than floor's, or the tolerance
            assert busiest(devs, n) <= max(busiest(allocate(n, N, max_pack), n), (1 + BALANCE_TOL) * n.sum() / N) + 1e-9
        elif sum(math.floor(v) for v in n) * (max_pack - 1) + (N - sum(math.floor(v) for v in n)) * max_pack >= E:
            assert all(reps[e] >= math.floor(n[e]) for e in range(E))
        to_placement(devs, E)  # a valid Placement


def test_allocation_edge_cases():
    assert allocate([0, 0, 0, 0], 4, 4) == [[0], [1], [2], [3]]  # nothing ranked: one per device
    devs = allocate([4, 0, 0, 0], 4, 4)  # one expert wants every device: the others still placed
    assert {e for d in devs for e in d} == {0, 1, 2, 3} and sum(0 in d for d in devs) >= 1
    devs = allocate([1, 1, 1, 1, 1, 1, 1, 1], 2, 4)  # max_pack * N == E
    assert sorted(len(d) for d in devs) == [4, 4]
    with pytest.raises(ValueError, match="cannot hold"):
        allocate([1] * 9, 2, 4)
    assert allocate([0.5, 0.3, 0.2, 0.0], 2, 4, seed=3) == allocate([0.5, 0.3, 0.2, 0.0], 2, 4, seed=3)


def test_nearest_rounding_replicates_a_hot_experts_fraction():
    n = [1.64, 0.9, 0.8, 0.66]  # 4 devices; expert 0 wants 1.64 of them
    floor, nearest = allocate(n, 4, 4), allocate(n, 4, 4, rounding="nearest")
    assert sum(0 in d for d in floor) == 1 and sum(0 in d for d in nearest) == 2
    assert busiest(nearest, n) < busiest(floor, n) == pytest.approx(1.64)
    # rounds down
    assert allocate([1.3, 0.9, 0.9, 0.9], 4, 4, rounding="nearest") == allocate([1.3, 0.9, 0.9, 0.9], 4, 4)
    with pytest.raises(ValueError, match="rounding"):
        allocate(n, 4, 4, rounding="ceil")


def test_balanced_replicas_bring_a_skewed_batch_near_the_mean():
    n = np.array([2.88, 1.97, 1.75, 1.66, 1.53, 1.41, 1.22, 0.78, 0.69, 0.59, 0.5, 0.5, 0.22, 0.19, 0.06, 0.06])
    floor, balanced = allocate(n, 16, 4), allocate(n, 16, 4, rounding="balanced")
    assert busiest(floor, n) > 1.4  # a fraction of a hot expert left on one device
    assert busiest(balanced, n) <= (1 + BALANCE_TOL) * n.sum() / 16 + 1e-9
    reps = {e: sum(e in d for d in balanced) for e in range(16)}
    assert reps[0] >= 3 and reps[15] == 1  # the hot expert replicated, the cold one packed
    assert allocate(n, 16, 4, rounding="balanced") == balanced  # deterministic
    uniform = np.ones(8)
    assert allocate(uniform, 8, 4, rounding="balanced") == allocate(uniform, 8, 4)  # floor already balanced: kept


def _bins_opt(sizes):
    """Brute force: the fewest bins of capacity 1.0 holding ``sizes`` (no count limit)."""
    for b in range(1, len(sizes) + 1):
        for assign in itertools.product(range(b), repeat=len(sizes)):
            load = [0.0] * b
            for s, i in zip(sizes, assign):
                load[i] += s
            if max(load) <= 1.0 + 1e-12:
                return b
    return len(sizes)


def test_ffd_respects_capacity_and_is_near_optimal():
    """Fractional experts only, a device per item available (never forced): the bins FFD opened (the
    devices holding some expert's first copy; leftover devices only add replicas) each carry at most
    1.0 and number at most 11/9 OPT + 1 (OPT by brute force)."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        k = int(rng.integers(2, 7))
        n = rng.uniform(0.05, 0.95, size=k)
        log: list = []
        devs = allocate(n, N=k, max_pack=k, seed=0, log=log)
        assert not log
        first = {}
        for i, d in enumerate(devs):
            for e in d:
                first.setdefault(e, i)
        bins = sorted(set(first.values()))
        assert all(sum(n[e] for e in devs[i]) <= 1.0 + 1e-12 for i in bins)
        assert len(bins) <= 11 / 9 * _bins_opt(list(n)) + 1


def test_forced_overflow_is_logged():
    log: list = []
    devs = allocate([0.9, 0.9, 0.9], 2, 4, log=log)
    assert log and {e for d in devs for e in d} == {0, 1, 2}


def test_phase_two_replans_iff_top_sets_differ_and_never_with_an_oracle():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = rng.random(8), rng.random(8)
        assert needs_replan(a, b, 2) == (set(np.argsort(-a)[:2]) != set(np.argsort(-b)[:2]))
        assert not needs_replan(a, a, 2)
    assert top_set([0.1, 0.5, 0.5, 0.2], 2) == {1, 2}
    assert not needs_replan([0.5, 0.4, 0.1], [0.4, 0.5, 0.1], 2)  # same set, other order


def test_phase_two_by_load_replans_iff_the_busiest_device_exceeds_its_estimate():
    # the right top-2 set, the wrong magnitudes: the set test keeps the plan, the load test does not
    est, act = [0.4, 0.4, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]
    devs = allocate(2 * np.asarray(est), 2, 4)
    assert not needs_replan(est, act, 2)
    assert busiest(devs, [0.8, 0.8, 0.2, 0.2]) == pytest.approx(1.0) and busiest(devs, [1.4, 0.2, 0.2, 0.2]) > 1.5
    assert load_off(devs, est, act, 0.1) and not load_off(devs, est, act, 0.7)
    # normalised: an estimate of K_est entries per token (summing below 1) compares as the same shares
    assert not load_off(devs, 0.5 * np.asarray(est), est, 0.0)
    assert load_off(devs, [0.0] * 4, act, 0.1)  # an estimate of nothing re-plans
    rng = np.random.default_rng(1)
    for _ in range(200):
        a, b = rng.random(8), rng.random(8)
        d = allocate(4 * a / a.sum(), 4, 4)
        assert not load_off(d, a, a, 0.0)  # an oracle estimate never re-plans
        ratio = busiest(d, 4 * b / b.sum()) / busiest(d, 4 * a / a.sum())
        assert load_off(d, a, b, 0.1) == (ratio > 1.1 + 1e-9)


def test_replica_split_is_near_equal_and_rotates():
    for count in range(0, 20):
        for R in range(1, 5):
            per_src = [replica_split(count, R, src) for src in range(R)]
            assert all(sum(p) == count and max(p) - min(p) <= 1 for p in per_src)
            totals = np.sum(per_src, axis=0)  # over R sources the remainders spread evenly
            assert totals.max() - totals.min() <= 1


def test_path_table_distributions_sum_to_one_and_pop_hat_is_bounded():
    t = markov_traces(2000, 6, 8, order=1, seed=1)
    tab = PathTable.fit(t, 8, path_len=3)
    for (l, s), table in tab.tables.items():
        for d in table.values():
            assert d.sum() == pytest.approx(1.0)
    for l in range(3, 6):
        for k in (1, 2, 8):
            p = tab.estimate(t[:64, l - 3:l], l, k)
            assert (p >= 0).all() and p.sum() <= 1 + 1e-12
        assert tab.estimate(t[:64, l - 3:l], l, 8).sum() == pytest.approx(1.0)
    unseen = tab.dist(5, (7, 7, 7))  # backoff gives a distribution even for a path never seen
    assert unseen.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="path_len"):
        PathTable.fit(t, 8, path_len=6)
    with pytest.raises(ValueError, match="K_est"):
        tab.estimate(t[:4, :3], 3, 9)


def test_pop_hat_is_the_mean_of_each_tokens_kept_entries_seen_paths_or_not():
    """``estimate`` (each distinct path's kept entries computed once and remembered) equals the definition
    token by token: the mean over tokens of the ``K_est`` largest entries of their path's distribution, with
    backoff for paths the profile never saw; asked again (remembered entries), the same numbers."""
    t = markov_traces(400, 6, 8, order=1, seed=3)
    tab = PathTable.fit(t, 8, path_len=3)
    rng = np.random.default_rng(0)
    batch = np.concatenate([t[:40, 1:4], rng.integers(0, 8, (40, 3))])  # seen paths and random (some unseen)
    assert any(tuple(int(v) for v in row) not in tab.tables[(4, 3)] for row in batch)
    for k in (1, 2, 8):
        want = np.zeros(8)
        for row in batch:
            d = tab.dist(4, row)
            top = np.argsort(-d, kind="stable")[:k]
            want[top] += d[top]
        want /= len(batch)
        np.testing.assert_allclose(tab.estimate(batch, 4, k), want, rtol=0, atol=1e-15)
        np.testing.assert_allclose(tab.estimate(batch, 4, k), want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(tab.estimate(np.c_[np.zeros(80, dtype=int), batch], 4, 2), tab.estimate(batch, 4, 2))


def _token_accuracy(tab, t, layer, Lp):
    pred = np.array([np.argmax(tab.dist(layer, row)) for row in t[:, layer - Lp:layer]])
    return float((pred == t[:, layer]).mean())


def test_estimator_reaches_bayes_accuracy_iff_its_path_covers_the_chain_order():
    E, order = 6, 2
    train, table = markov_traces(40000, 6, E, order=order, seed=3, return_table=True)
    test = markov_traces(8000, 6, E, order=order, seed=3)
    layer = 5
    bayes = float((np.argmax(table[test[:, layer - 2], test[:, layer - 1]], -1) == test[:, layer]).mean())
    acc = {Lp: _token_accuracy(PathTable.fit(train, E, Lp), test, layer, Lp) for Lp in (1, 2, 3)}
    se = math.sqrt(bayes * (1 - bayes) / len(test))
    assert abs(acc[2] - bayes) < 4 * se and abs(acc[3] - bayes) < 4 * se + 0.01
    assert acc[1] < bayes - 6 * se  # a path shorter than the order is measurably worse


def test_pattern_metric_is_one_for_deterministic_and_k_over_e_for_uniform_routing():
    det = np.stack([np.arange(800) % 8, (np.arange(800) % 8 + 3) % 8], 1)
    assert pattern_share(det, 0, 1) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    iid = rng.integers(0, 8, size=(80000, 2))
    assert pattern_share(iid, 0, 1) == pytest.approx(1 / 8, abs=0.01)
    assert pattern_share(iid, 0, 2) == pytest.approx(2 / 8, abs=0.015)


def test_estimation_accuracy_scores_top_sets():
    assert estimation_accuracy([[0.5, 0.3, 0.2]], [[0.3, 0.5, 0.2]], 2) == 1.0
    assert estimation_accuracy([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]], [[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], 2) == 0.5


def test_the_reproductions_serving_max_pack_leaves_room_to_replicate_a_hot_expert():
    from moelab.papers.lina.common import scale_spec
    from moelab.papers.lina.runs import WORLD, max_pack

    s = scale_spec("default")
    E = s.i_experts
    pop = np.full(E, 0.5 / (E - 1))
    pop[3] = 0.5  # half the tokens: it wants two of the four devices

    def holders(mp):
        return sum(3 in d for d in allocate(WORLD * pop, WORLD, mp, seed=0))

    assert holders(E // WORLD) == 1  # max_pack = E/N: every device is full, no plan can replicate
    assert holders(max_pack(s)) == 2
