"""LSH-MoE in the simulator (spec §2.9): paper-scale centroid counts within the group bounds, the four
all-to-alls priced on centroid rows (bytes = rho x EP's, count exchange 2E apart), the hashing ops, the
experts-on-centroids switch, and ``hash_family: none`` pricing exactly the EP graph."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moelab.config import RunConfig
from moelab.sim import ClusterProfile, simulate, synthetic_loads
from moelab.sim.graphs import ep_iteration_graph, graph_bytes, topology_of
from moelab.strategies.lsh_moe.sim_graph import centroid_counts, lsh_moe_iteration_graph


def prof(**kw):
    base = ClusterProfile(name="t", nodes=2, gpus_per_node=2, gpu="x", peak_flops=1e12, achieved_flops=1e12,
                          intra_bw_GBps=10.0, intra_latency_us=5.0, inter_bw_GBps=1.0, inter_latency_us=10.0,
                          mem_GB=8.0)
    return dataclasses.replace(base, **kw)


def cfg(**opts):
    return RunConfig().with_overrides({"parallel.nproc": 4, "parallel.strategy": "lsh_moe",
                                       "parallel.strategy_options": opts,
                                       "model.moe.num_experts": 8, "model.n_layers": 2, "model.d_model": 32,
                                       "model.d_ff": 64, "model.seq_len": 16, "train.batch_size": 4})


def a2a_bytes(g, c):
    per = graph_bytes(g, topology_of(c), categories=("a2a",))
    return sum(sum(v.values()) for v in per.values())


def test_centroid_counts_respect_the_group_bounds():
    n = np.array([[0, 1, 7, 100], [3, 50, 2, 9]])
    m = centroid_counts(n, 0.2, bmax=16)
    assert (m >= np.minimum(n, 1)).all() and (m <= np.minimum(n, 16)).all()
    assert m.tolist() == [[0, 1, 1, 16], [1, 10, 1, 2]]
    assert (centroid_counts(n, 1.0) == n).all()
    with pytest.raises(ValueError, match="rho"):
        centroid_counts(n, 0.0)


def test_all_to_alls_priced_on_centroids_and_hashing_paid():
    c = cfg()
    loads = synthetic_loads(c, seed=1)
    ep = ep_iteration_graph(c, prof(), loads)
    full = lsh_moe_iteration_graph(c, prof(), loads)  # no centroids given: M = A
    assert a2a_bytes(full, c) == a2a_bytes(ep, c)
    cen = centroid_counts(loads, 0.25)
    lsh = lsh_moe_iteration_graph(c, prof(), loads, centroids=cen)
    ratio = a2a_bytes(lsh, c) / a2a_bytes(ep, c)
    assert ratio == pytest.approx(cen.sum() / loads.sum(), rel=1e-12) and ratio < 0.5
    cats = {o.category for o in lsh.ops}
    assert "lsh" in cats
    counts = [o for o in lsh.ops if o.category == "count_exchange"]
    assert all(o.comm["nbytes"] == 16 * 8 for o in counts)
    r_ep, r_lsh = simulate(ep), simulate(lsh)
    assert r_lsh.makespan < r_ep.makespan  # a slow inter-node link: compression pays
    exp_time = lambda r: r.ops_frame().query("category == 'expert'").duration.sum()
    on_tokens = simulate(lsh_moe_iteration_graph(c, prof(), loads, centroids=cen, experts_on_centroids=False))
    assert exp_time(on_tokens) == pytest.approx(exp_time(r_ep)) and exp_time(r_lsh) < exp_time(r_ep)
    slow_hash = simulate(lsh_moe_iteration_graph(c, prof(), loads, centroids=cen, lsh_row_s=1e-3))
    assert slow_hash.makespan > r_lsh.makespan
    assert lsh_moe_iteration_graph(c, prof(), loads, rho=0.25).meta["rho"] == pytest.approx(cen.sum() / loads.sum())


def test_hash_family_none_is_the_ep_graph():
    c = cfg(hash_family="none")
    loads = synthetic_loads(c, seed=2)
    none, ep = lsh_moe_iteration_graph(c, prof(), loads), ep_iteration_graph(c, prof(), loads)
    assert simulate(none).makespan == pytest.approx(simulate(ep).makespan)
    assert graph_bytes(none, topology_of(c)) == graph_bytes(ep, topology_of(c))
