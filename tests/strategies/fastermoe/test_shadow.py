"""FasterMoE shadowing policy (§2.4 Algorithm 1), pure: spec §5 invariant 5 (single-process part)."""
from __future__ import annotations

import numpy as np
import pytest

from moelab.strategies.fastermoe.shadow import (
    expert_totals,
    select_shadows,
    shadow_decision,
    shadow_loads,
    t_imbl,
    t_shadow,
)

CHEAP = dict(h=64, h_ff=128, P=1e9, W_net=1e9)  # slow compute, small model: shadowing pays


def one_hot_counts(N=4, E=1, per_source=1000, hot=0, frac=0.7):
    """Every source sends the same batch; ``frac`` of it to expert ``hot``, the rest spread evenly."""
    NE = N * E
    C = np.full((N, NE), per_source * (1 - frac) / (NE - 1))
    C[:, hot] = per_source * frac
    return np.rint(C).astype(np.int64)


def test_balanced_load_shadows_nothing():
    for N, E in ((2, 1), (4, 1), (4, 2), (8, 2)):
        C = np.full((N, N * E), 250, dtype=np.int64)
        assert select_shadows(C, **CHEAP) == ()


def test_one_hot_expert_is_shadowed_exactly():
    for N, E, hot in ((2, 1, 1), (4, 1, 0), (4, 2, 5), (8, 1, 3)):
        C = one_hot_counts(N, E, hot=hot)
        assert select_shadows(C, **CHEAP) == (hot,)
        d = shadow_decision(C, **CHEAP)
        assert d.t_chosen < d.t_imbl and d.order[0] == hot


def test_public_code_reduction_bug_is_not_replicated():
    """Equal batches per source: the per-*source* totals (FastMoE's ``sum(1)``) are all equal, so its
    greedy never improves and shadows nothing. Ours reduces over sources and shadows the hot expert."""
    C = one_hot_counts(4, 1, hot=2)
    assert len(set(C.sum(1).tolist())) == 1  # equal batches
    buggy_totals = C.sum(1)  # what the public code would sort by
    # with those totals the approximate max-load of one shadow equals the unshadowed max: no gain
    assert np.sort(buggy_totals)[::-1][1] == buggy_totals.max()
    assert list(expert_totals(C)) == list(C.sum(0))
    assert select_shadows(C, **CHEAP) == (2,)
    assert select_shadows(C, **CHEAP, exact=False) == (2,)


def test_decision_is_deterministic_prefix_and_not_worse():
    rng = np.random.default_rng(0)
    for trial in range(300):
        N = int(rng.choice([2, 4, 8]))
        E = int(rng.choice([1, 2]))
        C = rng.integers(0, 50, size=(N, N * E))
        hot = rng.integers(0, N * E, size=int(rng.integers(0, 3)))
        C[:, hot] += rng.integers(0, 3000, size=(N, len(hot)))
        kw = dict(h=int(rng.choice([16, 64, 256])), h_ff=128, P=float(rng.choice([1e8, 1e9, 1e11])),
                  W_net=float(rng.choice([1e8, 1e9, 1e10])), c=int(rng.choice([1, 2])), exact=bool(trial % 2))
        d = shadow_decision(C, **kw)
        again = shadow_decision(C.copy(), **kw)
        assert d == again  # identical input, identical decision
        assert d.chosen == tuple(sorted(d.chosen))
        assert set(d.chosen) == set(d.order[:len(d.chosen)])  # a prefix of the popularity order
        assert d.t_chosen <= d.t_imbl
        if kw["exact"]:
            assert t_shadow(C, d.chosen, kw["h"], kw["h_ff"], kw["P"], kw["W_net"], c=kw["c"]) == d.t_chosen
        # popularity order: descending totals, id tie-break
        tot = expert_totals(C)
        assert all((tot[a], -a) > (tot[b], -b) for a, b in zip(d.order, d.order[1:]))


def test_tie_break_by_expert_id():
    C = np.zeros((4, 4), dtype=np.int64)
    C[:, 1] = C[:, 3] = 1000  # two equally hot experts
    d = shadow_decision(C, **CHEAP)
    assert d.order[:2] == (1, 3)
    # shadowing expert 1 alone leaves expert 3's owner as loaded as before: no improvement, and the
    # greedy stops at the first non-improvement (clean FastMoE behaviour), so nothing is chosen
    assert d.chosen == () and len(d.trials) == 1
    C[:, 3] -= 1  # break the tie the other way round: the order follows the loads
    C[:, 1] -= 2
    assert shadow_decision(C, **CHEAP).order[:2] == (3, 1)


def test_no_network_or_expensive_model_shadows_nothing():
    C = one_hot_counts(4, 1)
    assert select_shadows(C, h=64, h_ff=128, P=1e9, W_net=0.0) == ()
    # W_net -> 0: only the traffic terms count. Shadowing then pays only if the token bytes it saves
    # the hot worker exceed the parameter bytes it moves (condition (a)); with wide experts it does not
    wide = dict(h=64, h_ff=4096, P=1e9)
    saved = 4 * 64 * 4 * (shadow_loads(C, ()).max() - shadow_loads(C, (0,)).max())
    assert saved < 2 * 2 * 64 * 4096 * 4
    assert select_shadows(C, **wide, W_net=1e-3) == ()
    assert select_shadows(C, **wide, W_net=1e9) == (0,)  # with a real network the compute gain wins
    assert select_shadows(C, h=64, h_ff=2 ** 20, P=1e15, W_net=1e9) == ()  # huge experts, fast compute
    assert select_shadows(C, **CHEAP, max_shadow=0) == ()


def test_loads_and_exact_vs_approximate():
    C = np.array([[100, 0], [100, 0]])  # expert 0 (owner 0) gets everything
    assert list(shadow_loads(C, ())) == [200, 0]
    assert list(shadow_loads(C, (0,))) == [100, 100]  # shadow tokens stay at their source
    h, h_ff, P, W = 8, 16, 1e6, 1e12
    exact = t_shadow(C, (0,), h, h_ff, P, W)
    approx = t_shadow(C, (0,), h, h_ff, P, W, exact=False)
    assert approx < exact  # the approximation ignores the load moved back to the sources
    assert t_imbl(C, h, h_ff, P, W) == pytest.approx(12 * h * h_ff * 200 / P + 4 * h * 4 * 200 / W)
    # E = 2: owner(e) = e // 2
    C2 = np.array([[5, 1, 0, 0], [5, 1, 0, 2]])
    assert list(shadow_loads(C2, ())) == [12, 2]
    assert list(shadow_loads(C2, (0,))) == [2 + 5, 2 + 5]


def test_policy_constants_are_checked():
    with pytest.raises(ValueError, match="must be > 0"):
        select_shadows(np.ones((2, 2)), h=0, h_ff=1)
