"""FasterMoE pure models: performance model (§2.2), smart-schedule plan and speedup (§2.5), DDL-Roofline
(§2.3). Spec §5 invariants 3 (plan part), 8, 10, 11. No processes."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moelab.strategies.fastermoe import perf_model as pm
from moelab.strategies.fastermoe import roofline as rl
from moelab.strategies.fastermoe import schedule as sch


# ---- §5.8 performance model units ------------------------------------------------------------------
@pytest.mark.parametrize("N", [2, 4, 8])
def test_uniform_a2a_on_star_takes_n_minus_1_b_over_bw(N):
    bw, t, h, s = 3e9, 17, 64, 4
    cl = pm.star(N, bw)
    C = np.full((N, N), t)  # E = 1
    b = t * h * s
    assert pm.comm_time(C, cl, h, s) == pytest.approx((N - 1) * b / bw, rel=1e-12)
    # E = 2: per-pair traffic is the sum over the destination's experts
    C2 = np.full((N, 2 * N), t)
    assert pm.comm_time(C2, cl, h, s) == pytest.approx((N - 1) * 2 * b / bw, rel=1e-12)


def test_ring_allreduce_and_broadcast_edge_loads():
    N, S = 4, 1000.0
    cl = pm.star(N, 1e9)
    loads = pm.allreduce_link_loads(cl, S)
    assert len(loads) == 2 * N  # every up and down edge of the star is a ring hop's
    for v in loads.values():
        assert v == pytest.approx(2 * (N - 1) / N * S)
    assert pm.allreduce_time(cl, S) == pytest.approx(2 * (N - 1) / N * S / 1e9)
    for root in range(N):
        for reduce in (False, True):
            ld = pm.broadcast_link_loads(cl, S, root=root, reduce=reduce)
            assert set(ld.values()) == {S}
            assert len(ld) == 2 * (N - 1)  # a chain of N-1 hops, 2 edges each on the star
            # the root only sends (broadcast) or only receives (reduce)
            me = f"w{root}"
            assert ((me, "switch") in ld) != reduce and ((("switch", me) in ld) == reduce)
    assert pm.broadcast_time(cl, S) == pytest.approx(S / 1e9)


def test_directed_edges_load_independently():
    cl = pm.star(2, 1e9)
    C = np.array([[0, 10], [2, 0]])
    ld = pm.a2a_link_loads(cl, pm.traffic_matrix(C) * 8)
    assert ld[("w0", "switch")] == 80 and ld[("switch", "w1")] == 80
    assert ld[("w1", "switch")] == 16 and ld[("switch", "w0")] == 16
    assert pm.comm_time(C, cl, 2, 4) == pytest.approx(80 / 1e9)


def test_tree_routing_is_lca_and_nvlink_peers_use_only_the_peer_link():
    cl = pm.johnny()
    assert cl.world_size == 16 and cl.ranks_per_node == 8
    assert cl.route(0, 1) == [("n0.s0.g0", "n0.s0"), ("n0.s0", "n0.s0.g1")]
    assert cl.route(0, 4) == [("n0.s0.g0", "n0.s0"), ("n0.s0", "n0.nic"), ("n0.nic", "n0.s1"), ("n0.s1", "n0.s1.g0")]
    r = cl.route(5, 9)
    assert r == [("n0.s1.g1", "n0.s1"), ("n0.s1", "n0.nic"), ("n0.nic", "switch"), ("switch", "n1.nic"),
                 ("n1.nic", "n1.s0"), ("n1.s0", "n1.s0.g1")]
    assert [cl.bandwidth(e) for e in r] == [11e9, 22.5e9, 6.25e9, 6.25e9, math.inf, 11e9]
    tv = pm.trevor(nodes=2)
    for a, b in itertools.permutations(range(4), 2):
        assert tv.route(a, b) == [(f"n0.g{a}", f"n0.g{b}")]
    assert tv.bandwidth(("n0.g0", "n0.g1")) == pytest.approx(317e9 / 8)
    assert tv.bandwidth(("n0.g0", "n0.g2")) == pytest.approx(88e9 / 8)
    # a peer pair's traffic never touches the tree (the AE add_traffic bug would add it to the NIC too)
    M = np.zeros((8, 8))
    M[0, 1] = 1e6
    assert set(pm.a2a_link_loads(tv, M)) == {("n0.g0", "n0.g1")}
    assert tv.route(0, 5) == [("n0.g0", "n0.nic"), ("n0.nic", "switch"), ("switch", "n1.nic"), ("n1.nic", "n1.g1")]
    assert pm.trevor().world_size == 64


def test_compute_is_4_b_h_hff_over_p_exactly():
    h, h_ff, P = 96, 192, 2.5e12
    C = np.array([[3, 5, 0, 1], [7, 0, 2, 2]])  # N=2, E=2: worker loads 15 and 5
    assert list(pm.worker_loads(C)) == [15, 5]
    assert pm.compute_time(C, h, h_ff, P) == 4 * 15 * h * h_ff / P
    # per-worker and calibrated (callable) throughputs
    assert pm.compute_time(C, h, h_ff, [P, P / 4]) == 4 * 5 * h * h_ff / (P / 4)
    assert pm.compute_time(C, h, h_ff, lambda b: P * b / 20) == 4 * 5 * h * h_ff / (P * 5 / 20)
    pred = pm.predict_layer(C, pm.star(2, 1e9, P=P), h, h_ff)
    assert pred.e2e == pytest.approx(3 * pred.T_comp + 4 * pred.T_comm)
    assert (pred.fw == pytest.approx(2 * pred.T_comm + pred.T_comp)
            and pred.bw == pytest.approx(2 * pred.T_comm + 2 * pred.T_comp))
    assert pm.e2e_time(1, 2, 3, 4) == 3 + 8 + 6 + 4


def test_count_matrix_validation():
    with pytest.raises(ValueError, match=r"\[N, N\*E\]"):
        pm.traffic_matrix(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=">= 0"):
        pm.traffic_matrix(-np.ones((2, 2)))
    with pytest.raises(KeyError, match="unknown cluster preset"):
        pm.cluster("nope")


# ---- §5.3 schedule validity (the plan) -------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 2, 4, 6, 8, 16])
def test_schedule_serves_every_ordered_pair_once(N):
    for Gs in [g for g in range(1, N + 1) if N % g == 0]:
        G = N // Gs
        plan = sch.step_pairs(N, Gs)
        assert len(plan) == G
        flat = [p for step in plan for p in step]
        assert sorted(flat) == sorted(itertools.product(range(N), range(N)))
        for s, step in enumerate(plan):
            senders = {}
            receivers = {}
            for src, dst in step:
                senders.setdefault(src, set()).add(dst // Gs)
                receivers.setdefault(dst, set()).add(src // Gs)
            for r in range(N):  # every rank sends to exactly one group and receives from exactly one
                assert len(senders[r]) == 1 and len(receivers[r]) == 1
                assert sch.send_peers(r, s, N, Gs) == sch.group_members(senders[r].pop(), Gs)
            if s == 0:
                assert all(src // Gs == dst // Gs for src, dst in step)
            if s == G - 1 and G > 1:  # ring neighbours
                assert all((dst // Gs - src // Gs) % G in (1, G - 1) for src, dst in step)


@pytest.mark.parametrize("N, Gs, msg", [(4, 3, "N % group_size"), (4, 0, ">= 1"), (4, 8, "exceeds")])
def test_schedule_rejects_bad_group_sizes(N, Gs, msg):
    with pytest.raises(ValueError, match=msg):
        sch.check_group_size(N, Gs)


# ---- §5.11 theoretical speedup and the pipeline simulator --------------------------------------------
def test_theoretical_speedup_bounds():
    vals = [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 10.0]
    for tm, tc in itertools.product(vals, vals):
        sp = pm.smart_speedup_theoretical(tm, tc)
        assert 1.0 - 1e-12 <= sp <= 1.75 + 1e-12
    assert pm.smart_speedup_theoretical(1.0, 1.0) == 1.75
    assert pm.smart_speedup_theoretical(2.5, 2.5) == 1.75
    assert pm.smart_speedup_theoretical(1.0, 1.1) < 1.75


def test_pipeline_simulator_bounds():
    rng = np.random.default_rng(0)
    for _ in range(200):
        G = int(rng.integers(1, 7))
        S, Cc, R = (rng.random(G) * rng.choice([0.1, 1, 10]) for _ in range(3))
        t = pm.pipeline_time(S, Cc, R)
        assert t <= S.sum() + Cc.sum() + R.sum() + 1e-12
        assert t >= max(S.sum() + R.sum(), Cc.sum()) - 1e-12
    # 8c: with compute the bottleneck only the first S and the last R stick out
    assert pm.pipeline_time([1, 1, 1], [5, 5, 5], [1, 1, 1]) == 1 + 15 + 1


def test_smart_step_times_cover_the_traffic():
    rng = np.random.default_rng(1)
    cl = pm.johnny()
    C = rng.integers(0, 50, size=(16, 16))
    h, h_ff = 256, 512
    for Gs in (1, 2, 4, 8, 16):
        dS, dC, dR = pm.smart_step_times(C, cl, Gs, h, h_ff)
        assert len(dS) == 16 // Gs
        # compute over the steps adds up to at least the busiest worker's whole batch
        assert sum(dC) >= pm.compute_time(C, h, h_ff, cl.P) * (1 - 1e-12)
        t = pm.smart_layer_time(C, cl, Gs, h, h_ff)
        assert t > 0
    dS, dC, dR = pm.smart_step_times(C, cl, 16, h, h_ff)  # one group: one step = the whole a2a
    assert dS[0] == pytest.approx(pm.comm_time(C, cl, h))
    assert dC[0] == pytest.approx(pm.compute_time(C, h, h_ff, cl.P))


# ---- §5.10 roofline sanity --------------------------------------------------------------------------
def hot_counts(N, B, frac):
    C = np.full((N, N), B * (1 - frac) / (N - 1))
    C[:, 0] = B * frac
    return C


@pytest.mark.parametrize("rho_mode", ["total", "per_round"])
def test_roofline_points_sit_under_their_lines(rho_mode):
    cl = pm.johnny()
    P = cl.P
    for B, h, frac in itertools.product((256, 2048, 16384), (256, 1024, 4096), (0.0625, 0.3, 0.6)):
        C = hot_counts(16, B, frac)
        pts = {p.name: p for p in rl.roofline_points(C, B, h, 2 * h, cl, shadowed=[0], rho_mode=rho_mode)}
        for p in pts.values():
            assert p.theta <= P * (1 + 1e-9)
            if rho_mode == "total":  # the knee at rho = 1 needs per-iteration totals
                assert p.theta <= float(rl.ideal(p.rho, P)) * (1 + 1e-9), p.name
        if rho_mode == "total":
            for name in ("DP", "MP", "EP", "EP+shadow"):  # synchronous
                assert pts[name].theta <= float(rl.semi_ideal(pts[name].rho, P)) * (1 + 1e-9), name
            assert pts["DP"].theta == pytest.approx(float(rl.semi_ideal(pts["DP"].rho, P)))
            assert pts["MP"].theta == pytest.approx(float(rl.semi_ideal(pts["MP"].rho, P)))
            loads = pm.worker_loads(C)
            assert pts["EP"].theta == pytest.approx(float(rl.semi_ideal(pts["EP"].rho, P)) * loads.mean() / loads.max())
            assert pts["DP overlapped"].theta >= pts["DP"].theta
            # arrow 2: same rho, higher Theta
            assert pts["EP+smart"].rho == pts["EP"].rho and pts["EP+smart"].theta >= pts["EP"].theta


def test_shadowing_arrow_lowers_rho_and_raises_theta():
    cl = pm.johnny()
    C = hot_counts(16, 2048, 0.5)
    ep = rl.ep_point(C, 1024, 2048, cl)
    sh = rl.ep_shadow_point(C, [0], 1024, 2048, cl)
    assert sh.rho < ep.rho and sh.theta > ep.theta
    with pytest.raises(ValueError, match="rho_mode"):
        rl.ep_point(C, 1024, 2048, cl, rho_mode="nope")


def test_roofline_lines():
    rho = np.array([0.01, 0.5, 1.0, 2.0, 100.0])
    assert np.allclose(rl.ideal(rho, 2.0), [0.02, 1.0, 2.0, 2.0, 2.0])
    assert np.allclose(rl.semi_ideal(rho, 2.0), 2 * rho / (1 + rho))
    assert (rl.semi_ideal(rho, 2.0) <= rl.ideal(rho, 2.0)).all()
