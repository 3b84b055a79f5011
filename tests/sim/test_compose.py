"""The simulator composes techniques (moelab.sim.compose): each technique's contribution fills the skeleton's
hooks it owns, a composed graph prices each part as that technique prices it alone, one owner per hook, and a
composition with a technique that declares no contribution is refused with the reason."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moelab.config import RunConfig
from moelab.placement import Placement
from moelab.sim import ClusterProfile, synthetic_loads
from moelab.sim.compose import Contribution, composed_graph
from moelab.sim.graphs import dense_param_count, expert_param_count, graph_bytes, route_matrix, topology_of


def prof():
    return ClusterProfile(name="t", nodes=2, gpus_per_node=2, gpu="x", peak_flops=1e9, achieved_flops=1e9,
                          intra_bw_GBps=1.0, intra_latency_us=10.0, inter_bw_GBps=0.5, inter_latency_us=20.0,
                          mem_GB=1.0)


def cfg(strategy, opts=None):
    return RunConfig().with_overrides({
        "parallel.nproc": 4, "parallel.topology.nodes": 2, "parallel.topology.ranks_per_node": 2,
        "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.n_layers": 2, "model.d_model": 16,
        "model.d_ff": 32, "model.seq_len": 8, "train.batch_size": 2, "parallel.strategy": strategy,
        "parallel.strategy_options": opts or {}})


def graph_of(name, opts=None, **plan):
    """(cfg, loads, the strategy's graph of one iteration): a composition registered from its name."""
    from moelab.registry import get
    from moelab.strategies.compose import composed

    c = cfg(name, opts)
    loads = synthetic_loads(c, seed=3, skew=1.2)
    s = composed(name) if "+" in name else get(name)
    return c, loads, s.graph()(c, prof(), loads, None, **plan)


def by_category(g, c, cats):
    out = graph_bytes(g, topology_of(c), categories=set(cats))
    return {r: dict(v) for r, v in out.items()}


def categories(g):
    return {op.category for op in g.ops if op.comm is not None}


def test_lina_and_lsh_moe_each_price_their_own_part_as_alone():
    """Lina owns the dense-gradient sync (its micro-ops, the all-to-all stream first), LSH-MoE the token rows
    (centroids) and the 2E count exchange: the composition's bytes of each part are the technique's alone."""
    opts = {"lina": {"policy": "lina"}, "lsh_moe": {"hash_family": "identity"}}
    c, loads, _ = graph_of("lina+lsh_moe", opts)
    cen = np.maximum(loads // 2, np.minimum(loads, 1))  # fewer centroid rows than tokens
    _, _, g = graph_of("lina+lsh_moe", opts, lsh_moe={"centroids": cen})
    _, _, lina = graph_of("lina", {"policy": "lina"})
    _, _, lsh = graph_of("lsh_moe", {"hash_family": "identity"}, centroids=cen)
    assert categories(g) == categories(lina) | categories(lsh)
    sync = {"allreduce", "scheduler"}
    assert by_category(g, c, sync) == by_category(lina, c, sync)
    token = categories(lsh) - sync - {"balance"}
    assert by_category(g, c, token) == by_category(lsh, c, token) != by_category(lina, c, token)
    assert g.stream_priority.get("comm") == 1  # Lina's strict priority of the all-to-alls
    assert any(op.category == "lsh" for op in g.ops)
    counts = [op.comm["nbytes"] for op in g.ops if op.category == "count_exchange"]
    assert counts and set(counts) == {16 * 8}  # tokens and centroids per expert, int64
    reduced = sum(op.comm["nbytes"] for op in g.ops if op.category == "allreduce")
    assert reduced == dense_param_count(c.model) * 4  # every dense gradient once (fp32)


def test_smartmoes_placement_routes_lsh_moes_centroid_rows_and_migrates():
    c, loads, _ = graph_of("lsh_moe+smartmoe")
    cen = np.maximum(loads // 3, np.minimum(loads, 1))
    owners = [[(e + 1 + j) % 4 for e in range(8)] for j in range(loads.shape[0])]  # layer j's own permutation
    moved = [(0, 0, 0, 1), (1, 5, 2, 0)]
    _, _, g = graph_of("lsh_moe+smartmoe", lsh_moe={"centroids": cen},
                          smartmoe={"owners": owners, "moved": moved})
    disp = [op for op in g.ops if op.name.endswith(".dispatch")]
    for j, op in enumerate(disp):
        pl = Placement(8, 4, tuple((o,) for o in owners[j]))
        assert np.array_equal(np.asarray(op.comm["splits"]), route_matrix(pl, cen[j]) * 16 * 4)  # rows x d x fp32
    mig = [op for op in g.ops if op.category == "migrate"]
    assert len(mig) == 1 and int(np.asarray(mig[0].comm["splits"]).sum()) == 2 * 3 * expert_param_count(c.model) * 4


def test_fastermoes_shadows_under_linas_schedule():
    opts = {"lina": {"policy": "priority"}, "fastermoe": {"shadow_force": [0, 3]}}
    c, _, g = graph_of("fastermoe+lina", opts)
    _, _, fm = graph_of("fastermoe", {"shadow_force": [0, 3]})
    _, _, lina = graph_of("lina", {"policy": "priority"})
    shadow = {"shadow", "a2a", "count_exchange"}
    assert by_category(g, c, shadow) == by_category(fm, c, shadow)
    assert by_category(g, c, {"allreduce"}) == by_category(lina, c, {"allreduce"})
    assert any(op.category == "shadow" for op in g.ops) and g.stream_priority.get("comm") == 1


def test_a_hook_has_one_owner_and_a_fallback_token_path_yields_to_an_owner():
    c = cfg("ep")
    loads = synthetic_loads(c, seed=1)
    seen = []

    def path(tag):
        def make(pls, lds):
            seen.append(tag)
            from moelab.sim.graphs import token_stages

            return token_stages([route_matrix(pl, L) for pl, L in zip(pls, lds)])
        return make

    composed_graph(c, prof(), loads, None, [Contribution(token_path=path("fallback"), owns_token_path=False),
                                            Contribution(token_path=path("owner"))])
    assert seen == ["owner"]
    with pytest.raises(ValueError, match="one technique owns it"):
        composed_graph(c, prof(), loads, None, [Contribution(count_bytes=8), Contribution(count_bytes=16)])


def test_a_composition_with_a_technique_without_a_contribution_is_refused_with_the_reason():
    from moelab.techniques import Technique, all_techniques, sim_refusal

    ts = all_techniques()
    assert sim_refusal((ts["lina"], ts["lsh_moe"])) == ""
    bare = dataclasses.replace(ts["smartmoe"], name="bare", sim=None)
    why = sim_refusal((ts["lsh_moe"], bare))
    assert "bare declares no simulator contribution" in why
    assert Technique("x", "wire").sim is None


def test_every_compatible_pair_whose_techniques_contribute_is_simulated():
    from moelab.strategies.compose import compatible_strategies

    for s in compatible_strategies():
        assert bool(s.sim_refused) == any(t.sim is None for t in s.techniques), s.name


def test_linas_planned_launches_price_the_whole_composition_to_a_steady_plan():
    """``launch_agreement: plan`` is priced by rebuilding the graph with the plan's windows: in a composition
    the whole composed graph is rebuilt (LSH-MoE's centroid all-to-alls close Lina's windows)."""
    opts = {"lina": {"policy": "lina", "launch_agreement": "plan"}, "lsh_moe": {"hash_family": "identity"}}
    c, _, g = graph_of("lina+lsh_moe", opts)
    assert g.meta["plan_passes"] >= 1 and "plan_windows" in g.meta
    assert any(op.name.startswith("lina_plan.") for op in g.ops)  # the plan's agreement after the drain
    assert any(op.category == "lsh" for op in g.ops) and g.meta["strategy"] == "lina+lsh_moe"
    _, _, lina = graph_of("lina", {"policy": "lina", "launch_agreement": "plan"})
    assert by_category(g, c, {"allreduce", "scheduler"}) == by_category(lina, c, {"allreduce", "scheduler"})
