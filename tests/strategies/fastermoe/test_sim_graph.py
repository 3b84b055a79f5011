"""FasterMoE in the simulator: the registered op graph prices the runtime's plan (same shadow sets,
same bytes as measured on real gloo runs) and the smart schedule overlaps in simulation."""
from __future__ import annotations

import numpy as np
import pytest

import moelab.strategies.fastermoe  # noqa: F401  (registers the "fastermoe" graph)
from moelab.comm.topology import LINK_CLASSES
from moelab.config import RunConfig
from moelab.sim import get_graph, get_profile, simulate, synthetic_loads
from moelab.sim.graphs import config_for_profile
from moelab.strategies.fastermoe.shadow import select_shadows
from moelab.strategies.fastermoe.sim_graph import fastermoe_iteration_graph, shadow_sets

SMALL = {"model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
         "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.balance_loss_coef": 0.0,
         "train.iters": 3, "train.batch_size": 2, "train.dtype": "float64", "train.trace": False}


def cfg(nproc, **ov):
    return RunConfig().with_overrides({**SMALL, "parallel.nproc": nproc, **ov}).validate()


def paper_cfg(opts):
    base = RunConfig().with_overrides({"model.d_model": 1024, "model.d_ff": 2048, "model.n_layers": 2,
                                       "model.n_heads": 16, "model.seq_len": 512, "model.moe.num_experts": 16,
                                       "model.moe.top_k": 2, "train.batch_size": 2,
                                       "parallel.strategy": "fastermoe", "parallel.strategy_options": opts})
    return config_for_profile(base, get_profile("johnny"))


def test_graph_is_registered_and_simulates_at_paper_scale():
    assert get_graph("fastermoe") is fastermoe_iteration_graph
    prof = get_profile("johnny")
    times = {}
    for name, opts in {"fastmoe": {}, "shadow": {"shadow": True}, "smart": {"smart": True, "group_size": 4},
                       "both": {"shadow": True, "smart": True, "group_size": 2}}.items():
        c = paper_cfg(opts)
        loads = synthetic_loads(c, seed=1, skew=1.5)
        g = fastermoe_iteration_graph(c, prof, loads)
        times[name] = simulate(g).makespan
        if opts.get("shadow"):
            assert g.meta["shadows"] == [list(s) for s in shadow_sets(c, loads)]
            assert any(g.meta["shadows"])  # a skewed load on johnny shadows something
    assert times["smart"] < times["fastmoe"]  # the pipeline overlaps
    assert times["shadow"] < times["fastmoe"]
    assert times["both"] < times["fastmoe"]


def test_shadow_sets_follow_the_policy():
    c = cfg(2, **{"parallel.strategy": "fastermoe",
                  "parallel.strategy_options": {"shadow": True, "shadow_gpu_flops": 1e5, "shadow_net_bw": 1e12}})
    loads = np.array([[[30, 2, 0, 0], [28, 0, 2, 2]], [[8, 8, 8, 8], [8, 8, 8, 8]]])
    assert shadow_sets(c, loads) == [select_shadows(loads[0], 16, 32, 1e5, 1e12), ()]
    assert shadow_sets(c, loads)[0] == (0,)
    forced = cfg(2, **{"parallel.strategy": "fastermoe", "parallel.strategy_options": {"shadow_force": [1, 3]}})
    assert shadow_sets(forced, loads) == [(1, 3), (1, 3)]


REAL = {
    "forced": {"shadow_force": [0, 3]},
    "policy": {"shadow": True, "shadow_gpu_flops": 1e2, "shadow_net_bw": 1e12},
    "smart+shadow": {"smart": True, "group_size": 1, "shadow_force": [1]},
}


@pytest.fixture(scope="module")
def real_runs():
    from moelab.measure.validate import run_real_many

    cfgs = [cfg(2, **{"parallel.strategy": "fastermoe", "parallel.strategy_options": o}) for o in REAL.values()]
    # the policy case on 2 experts, top-1: a skewed enough load that the policy shadows
    cfgs[1] = cfgs[1].with_overrides({"model.moe.num_experts": 2, "model.moe.top_k": 1})
    return dict(zip(REAL, run_real_many(cfgs, 2, timeout=150)))


def test_simulated_bytes_equal_measured_bytes(real_runs):
    from moelab.measure.validate import simulate_real

    prof = get_profile("johnny")  # bytes do not depend on the profile
    cols = [f"bytes_{c}" for c in LINK_CLASSES]
    for name, real in real_runs.items():
        sim = simulate_real(real.cfg, real.loads, prof)
        rb = real.comm.groupby(["iter", "rank", "op"])[cols].sum()  # smart steps are p2p on both sides
        sb = sim.bytes.groupby(["iter", "rank", "op"])[cols].sum()
        both = rb.add_suffix("_real").join(sb.add_suffix("_sim"), how="outer").fillna(0)
        for c in cols:
            assert (both[f"{c}_real"] == both[f"{c}_sim"]).all(), (name, both)
        ops = set(rb.index.get_level_values("op"))
        assert {"broadcast", "reduce"} <= ops, name  # shadowing happened for real
