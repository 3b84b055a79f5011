"""FasterMoE reproduction experiments (moelab.papers.fastermoe) at smoke scale: pure helpers
against their definitions, the SIMULATED paper-scale results against the spec's invariants, and the REAL /
EMULATED suites returning sane, labelled frames."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from moelab.papers import fastermoe as E
from moelab.strategies.fastermoe import perf_model as pm
from moelab.viz.figures import check_label

SMOKE = "smoke"


def labelled(frame):
    check_label(frame.attrs["label"])
    return frame


# ---- pure helpers -------------------------------------------------------------------------------------------
def test_scale_spec():
    for s in E.SCALES:
        sp = E.scale_spec(s)
        assert sp.name == s and sp.nproc % 2 == 0 and 80500 in sp.trace_iters
    assert E.scale_spec("default").nproc == 8 and E.scale_spec("smoke").nproc == 4  # 2 x 4 / 2 x 2
    with pytest.raises(ValueError, match="scale must be one of"):
        E.scale_spec("huge")


def test_top2_shares_is_a_distribution_of_distinct_pairs():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    s = E.top2_shares(p)
    assert s.sum() == pytest.approx(1.0) and (s <= 0.5 + 1e-12).all()
    rng = np.random.default_rng(0)
    C = E.top2_counts(p, 20000, 1, rng)[0]
    assert C.sum() == 40000 and C.max() <= 20000
    np.testing.assert_allclose(C / C.sum(), s, atol=0.01)


def test_t2_is_calibrated_deterministic_and_drifts():
    P = E.t2_popularity([0, 500, 80500], 16, layer=3, seed=1)
    np.testing.assert_allclose(P.sum(1), 1.0)
    np.testing.assert_array_equal(P, E.t2_popularity([0, 500, 80500], 16, layer=3, seed=1))
    top4 = np.sort(E.top2_shares(P[0]))[::-1][:4]
    assert top4.mean() == pytest.approx(0.20, abs=0.01)  # "4 of 16 experts at about 20 % each"
    assert np.abs(P[2] - P[0]).sum() > 0.05  # popularity changes over training
    # asking for iteration 80500 alone gives the same state as walking through 500 first (exact increments)
    assert E.t2_popularity([80500], 16, 3, 1).shape == (1, 16)
    C = E.t2_counts([500, 501], 2, 4, 16, 256)
    assert C.shape == (2, 2, 4, 16) and (C.sum(-1) == 512).all() and C.max() <= 256


def test_rescale_counts_keeps_sums_caps_and_nodes():
    rng = np.random.default_rng(0)
    C = E.top2_counts(E.t2_popularity([0], 16)[0], 64, 4, rng)
    C[0, 15] += 0  # node 0 = sources 0, 1
    out = E.rescale_counts(C, 16, 1024, 2, 2)
    assert out.shape == (16, 16) and (out.sum(1) == 2048).all() and out.max() <= 1024
    # workers 0..7 (node 0) replay node-0 sources, 8..15 node-1 sources
    np.testing.assert_allclose(out[0] / 2048, C[0] / 128, atol=2 / 2048)
    np.testing.assert_allclose(out[8] / 2048, C[2] / 128, atol=2 / 2048)
    dropped = E.rescale_counts(C * 0 + np.array([[10] * 16] * 4), 8, 100, 2, 2, tokens_src=100)
    assert (dropped.sum(1) == 160).all()  # dropped slots stay dropped (scaled by tokens, not by row sum)


def test_emulated_cluster_is_the_link_emulator():
    """The perf model on EmulatedCluster equals Communicator.emulated_time of the slowest rank."""
    from moelab.comm.bytes import by_link_class, peer_bytes
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import EmulationConfig

    N, h = 8, 64
    rng = np.random.default_rng(2)
    C = rng.integers(0, 300, size=(N, 2 * N))
    emu = EmulationConfig(enabled=True, intra_bw_GBps=0.3, inter_bw_GBps=0.05, intra_latency_us=40,
                          inter_latency_us=40)
    comm = Communicator(Topology(1, 1), emulation=emu)
    topo = Topology(N, N // 2)
    B = pm.traffic_matrix(C) * h * 4
    group = list(range(N))
    t_emu = max(comm.emulated_time(by_link_class(topo, r, peer_bytes("all_to_all", group, r, splits=B[r].tolist())),
                                   by_link_class(topo, r, peer_bytes("all_to_all", group, r, splits=B[:, r].tolist())))
                for r in range(N))
    cl = E.EmulatedCluster(N, 2, 0.3e9, 0.05e9, latency_s=40e-6)
    assert cl.a2a_time(C, h) == pytest.approx(t_emu, rel=1e-9)


def test_pipeline_gantt_matches_the_pipeline_model():
    rng = np.random.default_rng(3)
    for G in (1, 2, 4):
        dS, dC, dR = rng.random(G), rng.random(G), rng.random(G)
        g = E.pipeline_gantt(dS, dC, dR)
        assert g.end.max() == pytest.approx(pm.pipeline_time(dS, dC, dR))
        assert E.pipeline_gantt(dS, dC, dR, sequential=True).end.max() == pytest.approx(dS.sum() + dC.sum() + dR.sum())
        order = list(rng.permutation(G))
        assert E.pipeline_gantt(dS, dC, dR, order=order).end.max() == pytest.approx(
            pm.pipeline_time(dS[order], dC[order], dR[order]))


def test_predicted_variants_on_a_hot_trace():
    from moelab.models.traces import routing_trace

    C = routing_trace("hot_expert", 1, 1, 8, 16, 512, 2, 0, expert=3, share=0.4).numpy()[0, 0]
    cl = E.EmulatedCluster(8, 2, 0.1e9, 0.02e9, P=2e10, latency_s=50e-6)
    S = E.select_shadows(C, 256, 512, 2e10, 0.02e9, c=5)
    assert S == (3,)
    p = E.predict_layer_variants(C, cl, 256, 512, group_size=2, shadowed=S)
    assert p["shadow"] < p["fastmoe"] and p["both"] < p["fastmoe"] and p["smart"] <= p["fastmoe"] * (1 + 1e-9)
    assert 1.0 <= p["theoretical"] <= 1.75
    assert p["smart"] >= max(p["Tc"] * 3, 0) - 1e-12  # never faster than the compute alone


def test_fig7_schedule_serves_every_group_once():
    g = labelled(E.fig7_schedule(N=6, group_size=2))
    assert sorted(g.op.value_counts().to_dict().items()) == [("C", 3), ("R", 3), ("S", 3)]
    comm = g[g.stream == "comm"].sort_values("start")
    assert (comm.start.diff().fillna(0) >= -1e-15).all()  # one comm stream: ops in order, no overlap
    assert (comm.start.to_numpy()[1:] >= comm.end.to_numpy()[:-1] - 1e-15).all()
    assert g[g.op == "S"].step.tolist() == [0, 1, 2]


# ---- SIMULATED at paper scale -------------------------------------------------------------------------------
def test_fig5_roofline_points_ordered_as_the_spec_says():
    pts, lines = E.fig5_roofline(SMOKE)
    labelled(pts)
    p = pts.set_index("name")
    assert (p.theta_TFLOPs <= p.ideal_TFLOPs * (1 + 1e-9)).all()  # nothing above the ideal line
    for n in ("DP", "MP", "EP", "EP+shadow"):  # synchronous points: on or under semi-ideal
        assert p.loc[n, "theta_TFLOPs"] <= p.loc[n, "semi_ideal_TFLOPs"] * (1 + 1e-9), n
    assert p.loc["DP", "rho"] < 1 and p.loc["DP overlapped", "theta_TFLOPs"] > p.loc["DP", "theta_TFLOPs"]
    imb = pts.attrs["imbalance"]
    assert p.loc["EP", "theta_TFLOPs"] == pytest.approx(p.loc["EP", "semi_ideal_TFLOPs"] * imb, rel=1e-9)
    assert pts.attrs["shadowed"], "a skewed T2 layer on johnny shadows something"
    assert p.loc["EP+shadow", "rho"] < p.loc["EP", "rho"]  # arrow (1): rho down, Theta up
    assert p.loc["EP+shadow", "theta_TFLOPs"] > p.loc["EP", "theta_TFLOPs"]
    assert p.loc["EP+smart", "rho"] == pytest.approx(p.loc["EP", "rho"])  # arrow (2): same rho, Theta up
    assert p.loc["EP+smart", "theta_TFLOPs"] > p.loc["EP", "theta_TFLOPs"]
    assert (lines.ideal_TFLOPs >= lines.semi_ideal_TFLOPs).all()


def test_paper_scale_breakdown_and_end_to_end():
    f13 = labelled(E.fig13_breakdown(SMOKE))
    assert set(f13.model) == set(E.PAPER_LAYER_MODELS) and set(f13.variant) == {"shadow", "smart", "both"}
    assert (f13[f13.variant == "shadow"].speedup >= 1.0).all()  # a skewed trace: shadowing never hurts here
    assert (f13.speedup >= 1.0).all()
    both = f13[f13.variant == "both"].set_index("model").speedup
    single = f13[f13.variant != "both"].groupby("model").speedup.max()
    assert (both >= single.reindex(both.index) * 0.95).all()
    f10 = labelled(E.fig10_end_to_end(SMOKE))
    t = f10.pivot_table(index="model", columns="system", values="time_ms")
    assert (t.FasterMoE < t.FastMoE).all()  # shadowing + smart schedule on a skewed trace (as Fig. 13)
    # speedup columns are the time ratios, recomputed here from the time column
    for _, r in f10.iterrows():
        assert r.speedup_vs_zero3 == pytest.approx(t.loc[r.model, "ZeRO-3"] / r.time_ms)
        assert r.speedup_vs_zero2 == pytest.approx(t.loc[r.model, "ZeRO-2"] / r.time_ms)
    # ZeRO pricing mechanism (spec §3), not an outcome: stage 3 moves 3/2 of stage 1/2's bytes, compute is
    # 12 B k h h_ff / P, the overlap hides that fraction of min(compute, comm)
    sp = E.scale_spec(SMOKE)
    for m in E.PAPER_LAYER_MODELS.values():
        z = {st: E.zero_layer_time(st, m, overlap=0.0) for st in (1, 2, 3)}
        Tc = 12.0 * m.tokens * 2 * m.h * m.h_ff / E.sim_profile(m.cluster).achieved_flops
        assert z[1] == z[2] and z[3] > z[2] > Tc
        assert (z[3] - Tc) / (z[2] - Tc) == pytest.approx(1.5, rel=1e-6)
        o = E.assumptions().value("zero_overlap")
        for st in (2, 3):
            assert E.zero_layer_time(st, m) == pytest.approx(z[st] - o * min(Tc, z[st] - Tc))
        L = min(sp.paper_layers, m.layers)
        assert t.loc[m.name, "ZeRO-3"] == pytest.approx(1e3 * L * E.zero_layer_time(3, m))



def test_zero12_step_allgather_prices_the_aes_timed_region():
    """``zero12_step_allgather`` = 0 (the AE's run_ds.py times forward + backward, never DeepSpeed's step(),
    where stage 1/2 all-gather the updated partitions): stage 1/2 move the reduce-scatter only, half of the
    all-reduce's bytes; stage 3 gathers inside forward / backward and does not move."""
    from moelab.comm import costs

    A = E.assumptions()
    assert A.value("zero12_step_allgather") == 1 and "zero12_step_allgather" in E.PRICING_ONLY
    off = (("zero12_step_allgather", 0),)
    for m in E.PAPER_LAYER_MODELS.values():
        Tc = 12.0 * m.tokens * 2 * m.h * m.h_ff / E.sim_profile(m.cluster).achieved_flops
        base = {st: E.zero_layer_time(st, m, overlap=0.0) for st in (1, 2, 3)}
        aet = {st: E.zero_layer_time(st, m, overlap=0.0, overrides=off) for st in (1, 2, 3)}
        assert aet[3] == base[3] and aet[1] == aet[2]
        prof = dataclasses.replace(E.sim_profile(m.cluster), allreduce="ring")  # zero_layer_time's rings
        Sp = m.experts * 2 * m.h * m.h_ff * 4
        assert aet[2] - Tc == pytest.approx(costs.reduce_scatter_time(Sp, prof.topology(), prof))
        assert (aet[2] - Tc) / (base[2] - Tc) == pytest.approx(0.5, rel=1e-3)  # ring: RS is half the AR
    with pytest.raises(ValueError, match="0 or 1"):
        E.zero_layer_time(2, E.PAPER_LAYER_MODELS["GPT-S"], overrides=(("zero12_step_allgather", 0.5),))
    # only ZeRO-1/2 move: FasterMoE over ZeRO-3 stays, over ZeRO-2 falls
    b, a = E.fig10_end_to_end(SMOKE), E.fig10_end_to_end(SMOKE, 0, off)
    fb, fa = b[b.system == "FasterMoE"].set_index("model"), a[a.system == "FasterMoE"].set_index("model")
    assert (fa.speedup_vs_zero3 == fb.speedup_vs_zero3).all() and (fa.speedup_vs_zero2 < fb.speedup_vs_zero2).all()

def test_fig12_theory_bounds_and_fig11_shadowing():
    f12 = labelled(E.fig12_smart(SMOKE))
    assert ((f12.theoretical >= 1.0) & (f12.theoretical <= 1.75 + 1e-12)).all()
    assert (f12.achieved_pipeline_model <= f12.theoretical + 1e-9).all()
    assert (f12.achieved_simulator >= 1.0).all()
    assert "fraction_of_theory" not in f12  # renamed: model / theory is not the paper's measured / theory
    np.testing.assert_allclose(f12.model_fraction_of_theory, f12.achieved_pipeline_model / f12.theoretical)
    lat, smap, summ = E.fig11_shadowing(SMOKE)
    labelled(lat)
    s = summ.iloc[0]
    assert 0 < s.mean_fraction_shadowed < 1 and s.mean_speedup >= 1.0
    assert smap.groupby("iter").share.sum().round(6).eq(1.0).all()


def test_full_iteration_cross_check_when_a_zero_graph_exists():
    df = E.fig10_full_iteration(SMOKE)
    if not len(df):
        pytest.skip("no 'zero' simulator graph registered")
    ok = df.dropna(subset=["makespan_ms"])
    assert {"FastMoE", "FasterMoE"} <= set(ok.system)
    t = ok.pivot_table(index="model", columns="system", values="makespan_ms")
    assert (t.FasterMoE <= t.FastMoE).all()


def check_table3(t3, curves):
    """Table 3 against its definition, recomputed from the curves: one target (FastMoE's smoothed loss at
    80 % of the budget), first step at or below it, ratios to FastMoE / FasterMoE."""
    ref = curves[curves.system == "FastMoE (top-2)"]
    target = float(ref.loss_smooth.iloc[int(0.8 * len(ref)) - 1])
    assert t3.target.nunique() == 1 and (t3.target_loss == target).all()
    t = t3.set_index("system")
    for name, g in curves.groupby("system"):
        hit = g[g.loss_smooth <= target]
        assert t.loc[name, "reached"] == bool(len(hit))
        if len(hit):
            assert t.loc[name, "steps_to_target"] == hit.step.iloc[0]
            assert t.loc[name, "modelled_time_to_target_s"] == hit.modelled_time_s.iloc[0]
        else:
            assert math.isnan(t.loc[name, "steps_to_target"])
    fm = t.loc["FastMoE (top-2)"]
    np.testing.assert_allclose(t.steps_vs_fastmoe, t.steps_to_target / fm.steps_to_target)
    np.testing.assert_allclose(t.iter_speedup_vs_fastmoe, fm.mean_modelled_iter_ms / t.mean_modelled_iter_ms)
    if "FasterMoE" in t.index:
        fr = t.loc["FasterMoE"]
        np.testing.assert_allclose(t.time_vs_fastermoe, t.modelled_time_to_target_s / fr.modelled_time_to_target_s)
        np.testing.assert_allclose(t.iter_gain_vs_fastermoe, 1 - t.mean_modelled_iter_ms / fr.mean_modelled_iter_ms)


def test_table3_one_target_on_synthetic_curves():
    n = 50
    steps = np.arange(1, n + 1)
    rows = []
    for name, rate, it_s in (("FastMoE (top-2)", 1.0, 0.2), ("FasterMoE", 1.0, 0.1), ("GShard", 0.9, 0.1),
                             ("slow", 0.01, 0.1)):
        loss = 5.0 * np.exp(-rate * 0.05 * steps)
        rows.append(pd.DataFrame(dict(system=name, step=steps, loss=loss, loss_smooth=loss,
                                      modelled_iter_s=it_s, modelled_time_s=it_s * steps,
                                      measured_step_s=it_s, measured_time_s=it_s * steps)))
    curves = pd.concat(rows, ignore_index=True)
    t3 = E.table3_time_to_loss(SMOKE, curves)
    check_table3(t3, curves)
    t = t3.set_index("system")
    assert t.loc["FastMoE (top-2)", "steps_to_target"] == 40  # 80 % of 50 steps
    assert t.loc["GShard", "steps_to_target"] == 45 and t.loc["GShard", "steps_vs_fastmoe"] == pytest.approx(45 / 40)
    assert not t.loc["slow", "reached"] and math.isnan(t.loc["slow", "time_vs_fastermoe"])
    assert t.loc["FasterMoE", "time_to_target_speedup_vs_fastmoe"] == pytest.approx(2.0)


# ---- REAL / EMULATED at smoke scale ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_layer_suite_figures():
    s = E.layer_suite(SMOKE)
    assert s["N"] == 4 and s["nodes"] == 2 and s["label"].startswith("EMULATED")
    t = s["times"]
    assert (t.time_s > 0).all() and set(E.suite_variants(4)) <= set(t.variant)
    b = labelled(E.fig6_shadow_bytes(SMOKE))
    per = b.groupby(["variant", "op"]).MB.sum()
    assert per["no shadow", "all_to_all"] > per["shadow hottest expert", "all_to_all"]
    assert "broadcast" in per["shadow hottest expert"] and "broadcast" not in per["no shadow"]
    real8, sim8 = E.fig8_schedules(SMOKE)
    labelled(real8), labelled(sim8)
    assert {"comm", "compute"} <= set(real8.stream)
    ms = sim8.attrs["makespan_ms"]
    assert ms["8c two streams, smart order"] <= ms["8a sequential"] + 1e-9
    pts, _ = E.fig5_roofline_measured(SMOKE)
    assert (labelled(pts).rho > 0).all() and (pts.theta_GFLOPs > 0).all()
    for f in (E.fig12_smart_real(SMOKE), E.fig13_breakdown_real(SMOKE)):
        assert len(labelled(f)) and np.isfinite(f.select_dtypes("number").to_numpy()).all()
    lat, smap, summ = E.fig11_shadowing_real(SMOKE)
    assert len(labelled(lat)) and 0 <= summ.mean_fraction_shadowed.iloc[0] <= 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_fig3_routing_and_idle():
    routing, workers = E.fig3_ep_example(SMOKE)
    labelled(workers)
    tot = routing.groupby("expert").tokens.sum().to_numpy()
    assert tot[0] == 3 * tot[2]  # expert 0 gets 3x expert 2
    w = workers.set_index("worker")
    assert list(w.tokens) == [6 * 128, 4 * 128, 2 * 128]  # worker e owns expert e
    # idle = the slowest worker's compute minus one's own (measured CPU times decide who is slowest: on a loaded
    # machine the 3x worker is usually, not always, the slowest, so the test asserts the rule, not the timing)
    assert w.idle_ms[w.compute_fw_ms.idxmax()] == 0.0 and (w.idle_ms >= 0).all()
    assert w.idle_ms.to_numpy() == pytest.approx((w.compute_fw_ms.max() - w.compute_fw_ms).to_numpy())


@pytest.mark.slow
# its R^2 is of wall-clock layer times on emulated links: run alone (0.72 against 0.75 beside a worker)
@pytest.mark.timing
@pytest.mark.timeout(400)
def test_real_convergence_and_predictor():
    curves = labelled(E.fig14_convergence(SMOKE))
    a = curves[curves.system == "FastMoE (top-2)"].loss.to_numpy()
    b = curves[curves.system == "FasterMoE"].loss.to_numpy()
    np.testing.assert_allclose(b, a, rtol=1e-4)  # shadowing + smart schedule do not change the model
    assert (curves.modelled_iter_s > 0).all()
    for _, g in curves.groupby("system"):
        assert (np.diff(g.modelled_time_s.to_numpy()) > 0).all()  # cumulative time strictly increases
    t3 = E.table3_time_to_loss(SMOKE, curves)
    check_table3(t3, curves)
    shares, summ = E.fig4_popularity(SMOKE)
    assert summ.trace.str.startswith("T1").any() and (shares.groupby(["trace", "iter"]).share.sum().round(6) == 1).all()
    pts, metrics = E.fig9_predictor(SMOKE)
    labelled(pts)
    # parts measured on the real runs (spans, all-to-all records), each a share of the measured layer time
    assert (pts.compute_fw_s > 0).all() and (pts.comm_s > 0).all() and (pts.compute_fw_s + pts.comm_s < pts.e2e_s).all()
    ev = metrics[(metrics["mode"] == "emulated") & (metrics.split == "evaluation")].set_index("part")
    assert set(ev.index) == {"e2e", "compute", "comm"} and set(ev.run) == {"EMULATED links"}
    assert ev[["r2", "median_rel_err"]].notna().all().all()
    # spec §5.9 on the held-out half (EMULATED links), where it has enough points for R^2 to mean something
    from moelab.sim.accuracy import MIN_R2_POINTS, R2_TEST_FLOOR, REL_ERR_TARGET
    e = ev.loc["e2e"]
    assert e.n >= MIN_R2_POINTS and e.r2_meaningful and pts.e2e_s.max() > 2 * pts.e2e_s.min()
    assert e.r2 >= R2_TEST_FLOOR and e.median_rel_err <= REL_ERR_TARGET, metrics.to_string()  # 0.9: the notebook
    assert not metrics.run.eq("PAPER").any()  # the paper's R² lives in paper.yaml only


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_end_to_end_steps():
    df = labelled(E.fig10_real(SMOKE))
    t = df.set_index("system")
    assert {"FastMoE", "FasterMoE"} <= set(t.index) and (t.step_ms > 0).all()
    assert t.loc["FasterMoE", "final_loss"] == pytest.approx(t.loc["FastMoE", "final_loss"], rel=1e-4)
    if E.zero_available():
        assert {"ZeRO-1", "ZeRO-2", "ZeRO-3"} <= set(t.index)
        np.testing.assert_allclose(t.speedup_vs_zero3, t.loc["ZeRO-3", "step_ms"] / t.step_ms)
