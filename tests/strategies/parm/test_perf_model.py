"""Parm's pure performance model (spec §5 I8-I11): OLS recovery with standard errors, Alg. 1 and its
closed form, paper_mode formulas, the Table III grid and its memory filter."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moelab.comm.costs import AlphaBeta, fit_alpha_beta
from moelab.strategies.parm import perf_model as pm
from moelab.strategies.parm.grid import SETTINGS, configs, filtered, memory_bytes


def _fits(aA=1e-4, bA=2e-9, aG=5e-5, bG=1e-9, aO=2e-4, bO=1.5e-9, **more):
    f = {"A2A_EPESP": AlphaBeta(aA, bA, 1.0), "AG_MP": AlphaBeta(aG, bG, 1.0), "SAA": AlphaBeta(aO, bO, 1.0)}
    f.update({k: AlphaBeta(a, b, 1.0) for k, (a, b) in more.items()})
    return f


def test_ols_recovers_alpha_beta_exactly_and_within_three_standard_errors():
    x = np.array([2.0 ** e for e in range(8, 25, 2)])
    ab = fit_alpha_beta(x, 3e-5 + 7e-10 * x)
    assert math.isclose(ab.alpha, 3e-5, rel_tol=1e-9) and math.isclose(ab.beta, 7e-10, rel_tol=1e-9)
    assert ab.r2 == pytest.approx(1.0) and ab.beta_se < 1e-15
    rng = np.random.default_rng(0)
    misses = 0
    for _ in range(50):
        ab = fit_alpha_beta(x, 3e-5 + 7e-10 * x + rng.normal(0, 2e-4, len(x)))
        misses += abs(ab.alpha - 3e-5) > 3 * ab.alpha_se or abs(ab.beta - 7e-10) > 3 * ab.beta_se
        assert ab.alpha_se > 0 and ab.beta_se > 0
    assert misses <= 3  # a 3-sigma band misses about 0.3% of the time per parameter


def test_paper_mode_is_the_equations():
    s = pm.ParmShape(B=4, L=1024, M=2048, E=8, k=1, f=1.2, n_mp=2, n_esp=4)
    f = _fits(AG_ESP=(3e-5, 4e-10), AR_ESP=(6e-5, 9e-10), A2A_EP=(8e-5, 2.5e-9))
    T = math.ceil(1.2 * 4 * 1024 / 8)
    assert s.T == T and s.x == 4 * 1024 * 2048 and s.y == 8 * T * 2048 * 4
    y = 8 * T * 2048 * 4
    assert pm.t_baseline(s, f) == pytest.approx((3e-5 + 4e-10 * s.x * 4) + (6e-5 + 9e-10 * y) + 2 * (8e-5 + 2.5e-9 * y),
                                                rel=1e-15)
    assert pm.t_s1(s, f) == pytest.approx(2 * (1e-4 + 2e-9 * y / 2) + 5e-5 + 1e-9 * s.x, rel=1e-15)
    assert pm.t_s2(s, f) == pytest.approx((1e-4 + 2e-9 * y / 2) + (2e-4 + 1.5e-9 * y), rel=1e-15)
    assert pm.t_fused(s, f) == pytest.approx(2 * (1e-4 + 2e-9 * y), rel=1e-15)
    from moelab.sim.profiles import get_profile  # the paper's Fig. 6 fits, kept once by the testbeds' profiles

    assert pm.paper_fits(get_profile("parm_A"))["AG_MP"].alpha == 6.64e-4
    assert pm.paper_fits(get_profile("parm_B"))["AG_MP"].beta == 7.14e-10


def test_alg1_argmin_ties_closed_form_and_threshold():
    f = _fits()
    s = pm.ParmShape(B=2, L=512, M=1024, E=8, k=1, f=1.2, n_mp=2, n_esp=2)
    choice, d1, d2 = pm.select(s, f)
    assert choice == ("s1" if d1 <= d2 else "s2")
    assert pm.select(pm.ParmShape(2, 512, 1024, 8, 1, 1.2, 1, 2), f)[0] == "s1"  # N_MP = 1: one schedule
    # a tie goes to S1: make tD2 equal tD1 through the SAA latency
    tie = dict(f, SAA=AlphaBeta(f["SAA"].alpha + (d1 - d2), f["SAA"].beta, 1.0))
    c, t1, t2 = pm.select(s, tie)
    assert math.isclose(t1, t2, rel_tol=1e-12) and c == "s1"
    # closed form: delta's sign is Alg. 1's choice when T has no ceiling effect (k*f*B*L/E integral)
    for fcap in (0.5, 1.0, 2.0, 4.0, 8.0):
        s = pm.ParmShape(B=2, L=512, M=1024, E=8, k=1, f=fcap, n_mp=2, n_esp=2)
        c, t1, t2 = pm.select(s, f)
        assert math.isclose(pm.delta(s, f), t1 - t2, rel_tol=1e-9, abs_tol=1e-15)
    fs = pm.f_star(s, f)
    assert fs is not None
    below = pm.ParmShape(2, 512, 1024, 8, 1, round(fs * 0.5, 6), 2, 2)
    above = pm.ParmShape(2, 512, 1024, 8, 1, round(fs * 2, 6), 2, 2)
    assert pm.select(below, f)[0] == "s2" and pm.select(above, f)[0] == "s1"
    assert pm.f_star(s, _fits(bO=1e-10)) is None  # SAA cheaper per element than the split all-to-all


def test_choice_is_monotone_in_f_with_at_most_one_switch_s2_to_s1():
    f = _fits()
    picks = [pm.select(pm.ParmShape(2, 512, 1024, 8, 1, ff, 2, 2), f)[0] for ff in np.linspace(0.1, 10, 60)]
    switches = [(a, b) for a, b in zip(picks, picks[1:]) if a != b]
    assert switches == [("s2", "s1")]


@pytest.mark.parametrize("kw", [dict(B=0), dict(M=-1), dict(n_mp=0), dict(f=0.0)])
def test_bad_shapes_are_named(kw):
    base = dict(B=2, L=512, M=1024, E=8, k=1, f=1.2, n_mp=2, n_esp=2)
    with pytest.raises(ValueError, match=next(iter(kw))):
        pm.ParmShape(**{**base, **kw})


def test_grid_sizes_filter_and_memory_monotone():
    for setting in SETTINGS:
        cs = configs(setting)
        assert len(cs) == 3 ** 6 * 2  # every layout divides the GPUs per node on A and B
        keep, drop = filtered(setting)
        assert len(keep) + len(drop) == len(cs) and keep and drop
        assert all(c.layout().errors() == [] for c in keep)
    lit = configs("B-8", scale_m_with_esp=True)
    assert {c.M // c.n_esp for c in lit} == {1024, 2048, 4096}
    c = configs("B-32")[0]
    grow = [memory_bytes(type(c)(**{**c.__dict__, "B": b}))["total"] for b in (2, 4, 8)]
    assert grow[0] < grow[1] < grow[2]
    grow = [memory_bytes(type(c)(**{**c.__dict__, "L": L}))["total"] for L in (512, 1024, 2048)]
    assert grow[0] < grow[1] < grow[2]
    # the einsum's dense mask is what makes the baseline big (P18)
    assert memory_bytes(c, dispatcher="index")["total"] < memory_bytes(c)["total"]
