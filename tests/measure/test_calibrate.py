"""Calibration fits recover known terms; the compute/communication split of a comparison is what it
says; the calibrated local profile carries its fitted terms as data. Pure: the "real" runs here are
made by the simulator itself with known terms, so a fit that cannot recover them fails."""
import numpy as np
import pandas as pd
import pytest

from moelab.comm.topology import LINK_CLASSES
from moelab.config import RunConfig
from moelab.measure.calibrate import fit_compute, fit_in_context
from moelab.measure.validate import BASE_MODEL, RealRun, compare, machine_profile, simulate_real
from moelab.sim import synthetic_loads

CAL = {"nproc": 4, "cores": 2, "gemm_flops": 1e9,
       "collectives": {op: {"alpha": 3e-4, "beta": 2e-9} for op in ("all_to_all", "all_reduce", "all_gather")}}
TRUTH = {"op_overhead_s": 4e-4, "flops_per_s": 5e9, "call_overhead_s": 1.5e-3, "source": "test truth"}


def cfg(B, E=4, k=2, nodes=1):
    return RunConfig().with_overrides({**BASE_MODEL, "parallel.nproc": 4, "parallel.topology.nodes": nodes,
                                       "model.moe.num_experts": E, "model.moe.top_k": k, "train.batch_size": B,
                                       "train.iters": 4}).validate()


def fake_real(c, seed=0):
    """A RealRun whose step times and call records are the simulator's own under TRUTH."""
    loads = np.stack([synthetic_loads(c, seed=seed + it) for it in range(c.train.iters)])
    sim = simulate_real(c, loads, machine_profile(c, {**CAL, "in_context": TRUTH}, compute="in_context"))
    rows, steps = [], []
    for it, res in enumerate(sim.results):
        calls = [o for o in res.graph.ops if o.comm is not None]
        for r in range(4):
            mine = sorted((o for o in calls if r in o.ranks), key=lambda o: res.start[o.id])
            for seq, o in enumerate(mine):
                rows.append((r, it, o.meta.get("layer") if o.meta.get("layer") is not None else -1,
                             o.meta.get("phase", ""), o.comm["op"], seq, res.start[o.id], res.end[o.id], 0.0, 0, 0, 0))
        steps.append([res.makespan] * 4)
    comm = pd.DataFrame(rows, columns=["rank", "iter", "layer", "phase", "op", "seq", "t_start", "t_end", "emulated_s",
                                       *[f"bytes_{x}" for x in LINK_CLASSES]])
    spans = pd.DataFrame(columns=["rank", "name", "cat", "t_start", "t_end", "iter", "layer"])
    return RealRun(c, np.array(steps), loads, comm, spans), sim


def test_fit_compute_recovers_a_line():
    ops = np.array([14, 14, 28, 14, 28])
    flops = np.array([1e6, 5e7, 2e7, 2e8, 1e8])
    t = 3e-4 * ops + flops / 8e9
    f = fit_compute({"ops": ops, "flops": flops, "time_s": t})
    assert f["op_overhead_s"] == pytest.approx(3e-4) and f["flops_per_s"] == pytest.approx(8e9)
    assert f["r2"] == pytest.approx(1.0) and f["kind"] == "fitted" and f["source"]


def test_split_of_a_comparison_is_calls_versus_the_rest():
    real, sim = fake_real(cfg(8))
    c = compare(real, sim, warmup=0, warn=False)
    it = c.iters
    for i, res in enumerate(sim.results):  # every call's own time, summed; compute is the rest
        want = sum(res.end[o.id] - res.start[o.id] for o in res.graph.ops if o.comm is not None)
        assert it.real_comm_s[i] == pytest.approx(want)
        assert it.real_compute_s[i] == pytest.approx(res.makespan - want)
    # the simulator on its own plan: both parts, and the total, agree exactly
    np.testing.assert_allclose(it.sim_comm_s, it.real_comm_s, rtol=1e-9)
    np.testing.assert_allclose(it.sim_compute_s, it.real_compute_s, rtol=1e-9)
    assert c.metrics["median_rel_err_comm"] < 1e-9 and c.metrics["median_rel_err_compute"] < 1e-9
    # the noise ceiling: each config's median predicting its iterations
    y = it.real_s.to_numpy()
    assert c.metrics["r2_ceiling"] == pytest.approx(1 - ((y - np.median(y)) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    assert "compute only" in c.summary() and "communication only" in c.summary()


def test_fit_in_context_recovers_the_terms_the_runs_were_made_with():
    reals = [fake_real(cfg(B, E, k, n), seed=B)[0] for B, E, k, n in ((2, 4, 1, 1), (12, 8, 2, 2), (32, 4, 2, 1))]
    f = fit_in_context(CAL, reals, warmup=1)
    assert f["call_overhead_s"] == pytest.approx(TRUTH["call_overhead_s"], rel=1e-6)
    assert f["op_overhead_s"] == pytest.approx(TRUTH["op_overhead_s"], rel=0.05)
    assert f["flops_per_s"] == pytest.approx(TRUTH["flops_per_s"], rel=0.05)
    assert f["kind"] == "fitted" and "held-out" in f["source"] and f["n"] == 9
    # and a validation config it never saw is then predicted as it was made
    real, _ = fake_real(cfg(20, 8, 1, 2), seed=50)
    sim = simulate_real(real.cfg, real.loads, machine_profile(real.cfg, {**CAL, "in_context": f}, compute="in_context"))
    assert compare(real, sim, warmup=0, warn=False).metrics["median_rel_err"] < 0.02


def test_calibrated_profile_carries_its_fits_and_labels_them():
    c = cfg(4)
    prof = machine_profile(c, {**CAL, "in_context": TRUTH}, compute="in_context")
    assert (prof.achieved_flops, prof.op_overhead_s, prof.call_overhead_s, prof.shared_cores) == (5e9, 4e-4, 1.5e-3, 0)
    assert "fitted" in prof.sources["achieved_flops"]
    one = {"op_overhead_s": 2e-4, "flops_per_s": 3e9, "source": "one process"}
    pool = machine_profile(c, {**CAL, "compute": one, "in_context": TRUTH}, compute="calibrated")
    assert (pool.shared_cores, pool.op_overhead_s, pool.call_overhead_s, pool.achieved_flops) == (2, 2e-4, 0.0, 3e9)
    for mode in ("calibrated", "in_context"):
        with pytest.raises(ValueError, match="compute fit"):
            machine_profile(c, {**CAL, "compute": one} if mode == "in_context" else CAL, compute=mode)
    # today's modes keep today's pricing: no pool, no overheads
    gemm = machine_profile(c, CAL, compute="gemm")
    assert (gemm.shared_cores, gemm.op_overhead_s, gemm.call_overhead_s) == (0, 0.0, 0.0)


def test_predicted_vs_measured_shows_the_split():
    from moelab.viz import simfigs

    real, sim = fake_real(cfg(8))
    c = compare(real, sim, warmup=0, warn=False)
    c.iters.loc[0, "sim_comm_s"] *= 3  # a communication error a good total could hide
    title = simfigs.predicted_vs_measured(c.iters, label="REAL: 4 ranks gloo vs SIMULATED: local").layout.title.text
    assert "compute only: R^2 = 1.000" in title and "communication only: R^2 = " in title
    assert "communication only: R^2 = 1.000" not in title
